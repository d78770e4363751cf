"""Test-only pickle guard: with PDSERVE_TEST_PICKLE_GUARD_LOG set, every pickle entry point of this process
(pickle.dumps/loads/dump/load, Pickler, Unpickler, and so multiprocessing and torch.load/save) appends a line
with the call stack to that file and raises. tests/reliability starts every pdserve process with this
directory first on PYTHONPATH, so Python imports this module at start-up, before anything else runs.

One exception: a call made while a module is being imported runs (and is logged as ALLOWED). Module constants
computed with pickle at import time (jinja2's bytecode-cache header: `pickle.dumps(bc_version, 2)`) touch no
network or cache data; everything a request can reach runs after the imports.
"""

from __future__ import annotations

import os
import pickle
import traceback

_LOG = os.environ.get("PDSERVE_TEST_PICKLE_GUARD_LOG")
_ORIGINALS = {name: getattr(pickle, name) for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler")}


def _during_import(stack: list[traceback.FrameSummary]) -> bool:
    return any(frame.filename == "<frozen importlib._bootstrap>" for frame in stack)


def _check(name: str) -> bool:
    """True when the call may run (during an import); logs every call either way."""
    stack = traceback.extract_stack()[:-2]
    allowed = _during_import(stack)
    with open(_LOG, "a") as log:  # type: ignore[arg-type]
        log.write(f"{'ALLOWED' if allowed else 'PICKLE'} pid={os.getpid()} pickle.{name}\n"
                  f"{''.join(traceback.format_list(stack[-12:]))}\n")
    return allowed


def _guarded(name: str):
    def call(*args: object, **kwargs: object) -> object:
        if _check(name):
            return _ORIGINALS[name](*args, **kwargs)
        raise pickle.PicklingError(f"pickle.{name} is forbidden in pdserve processes (test pickle guard)")

    return call


if _LOG:
    class _GuardedPickler(pickle.Pickler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            if not _check("Pickler"):
                raise pickle.PicklingError("pickle.Pickler is forbidden in pdserve processes (test pickle guard)")
            super().__init__(*args, **kwargs)

    class _GuardedUnpickler(pickle.Unpickler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            if not _check("Unpickler"):
                raise pickle.UnpicklingError("pickle.Unpickler is forbidden in pdserve processes (test guard)")
            super().__init__(*args, **kwargs)

    for _name in ("dumps", "loads", "dump", "load"):
        setattr(pickle, _name, _guarded(_name))
    pickle.Pickler = _GuardedPickler  # type: ignore[misc]
    pickle.Unpickler = _GuardedUnpickler  # type: ignore[misc]
