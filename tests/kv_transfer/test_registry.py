"""The registry's backends: built by name on both sides, composed rather than derived from one another."""

from __future__ import annotations

import itertools

from pdserve.kv_transfer.registry import backend_names, get_backend


def test_no_backend_derives_from_another_backends_sender_or_receiver() -> None:
    """Each backend is its own data path over the shared control channel (kv_transfer/control/); a backend that
    subclassed another's sender or receiver would inherit a data path it then has to override."""
    backends = [get_backend(name) for name in backend_names()]
    for a, b in itertools.permutations(backends, 2):
        assert not issubclass(a.sender, b.sender), (a.name, b.name)
        assert not issubclass(a.receiver, b.receiver), (a.name, b.name)


def test_only_local_shares_the_pool() -> None:
    """What the prefill node and the worker ask instead of comparing the backend's name (`local`)."""
    assert {name for name in backend_names() if get_backend(name).shares_pool} == {"local"}
