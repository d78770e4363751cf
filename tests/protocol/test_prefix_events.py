"""Block-hash events with sequence numbers (protocol/prefix_events.py): a replica fed the events, or a
snapshot after a gap, holds exactly the keys the worker observed last."""

from __future__ import annotations

import random

import pytest

from pdserve.protocol.prefix_events import (
    PrefixEvent,
    PrefixEventLog,
    PrefixPublisher,
    PrefixReplica,
    PrefixSnapshot,
    decode_events,
    encode_events,
)


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def _keys(*ids: int) -> set[bytes]:
    return {_key(i) for i in ids}


def _wire(log: PrefixEventLog, events: list[PrefixEvent]) -> tuple[str, list[PrefixEvent]]:
    """Through the JSON form, as a heartbeat carries them."""
    return decode_events(encode_events(log.epoch, events))


def test_events_number_the_changes_and_replay_to_the_same_keys() -> None:
    log, replica = PrefixEventLog(), PrefixReplica()
    replica.load(PrefixSnapshot.from_dict(log.snapshot().to_dict()))
    assert log.observe(_keys(1, 2, 3)).seq == 1
    assert log.observe(_keys(1, 2, 3)) is None  # no change, no event
    event = log.observe(_keys(2, 3, 4))
    assert (event.seq, event.stored, event.removed) == (2, frozenset(_keys(4)), frozenset(_keys(1)))
    assert replica.apply(*_wire(log, log.since(0)))
    assert replica.keys == _keys(2, 3, 4) and replica.answer() == {"epoch": log.epoch, "seq": 2}


def test_random_walk_converges_through_batches_duplicates_and_snapshots() -> None:
    rng = random.Random(7)
    log, replica = PrefixEventLog(capacity=8), PrefixReplica()
    held: set[int] = set()
    acked: int | None = None
    for _ in range(300):
        held ^= {rng.randrange(40) for _ in range(rng.randrange(1, 5))}
        log.observe(_key(i) for i in held)
        if rng.random() < 0.3:
            continue  # this heartbeat was lost: the next one carries more
        events = log.since(acked) if acked is not None else None
        if events is None:
            replica.load(PrefixSnapshot.from_dict(log.snapshot().to_dict()))
        else:
            older = log.since(acked - 1) if acked and rng.random() < 0.2 else None  # an answer was lost:
            assert replica.apply(*_wire(log, events if older is None else older))  # one event comes twice
        acked = replica.answer()["seq"]
        assert replica.keys == _keys(*held)


def test_a_gap_puts_the_replica_out_of_step_until_a_snapshot() -> None:
    log, replica = PrefixEventLog(), PrefixReplica()
    replica.load(log.snapshot())
    for held in ((1,), (1, 2), (1, 2, 3)):
        log.observe(_keys(*held))
    assert not replica.apply(log.epoch, [log.since(2)[0]])  # seq 3 without 1 and 2
    assert replica.answer() == {"resync": True}
    assert not replica.apply(log.epoch, log.since(0))  # out of step: events wait for the snapshot
    replica.load(log.snapshot())
    assert replica.keys == _keys(1, 2, 3) and replica.answer()["seq"] == 3


def test_another_epoch_means_a_restarted_worker() -> None:
    first, replica = PrefixEventLog(), PrefixReplica()
    first.observe(_keys(1))
    replica.load(first.snapshot())
    second = PrefixEventLog()
    second.observe(_keys(9))
    assert not replica.apply(second.epoch, second.since(0))
    assert replica.answer() == {"resync": True}


def test_the_ring_forgets_old_events() -> None:
    log = PrefixEventLog(capacity=2)
    for i in range(1, 5):
        log.observe(_keys(i))
    assert log.since(1) is None  # events 2.. are gone: 3 and 4 kept
    assert [e.seq for e in log.since(2)] == [3, 4]
    assert log.since(4) == [] and log.since(5) is None


def test_malformed_bodies_are_refused() -> None:
    with pytest.raises(ValueError, match="epoch"):
        decode_events({"events": []})
    with pytest.raises(ValueError, match="seq"):
        decode_events({"epoch": "e", "events": [{"seq": 0, "stored": "", "removed": ""}]})
    with pytest.raises(ValueError, match="8-byte keys"):
        decode_events({"epoch": "e", "events": [{"seq": 1, "stored": "AAAA", "removed": ""}]})
    with pytest.raises(ValueError, match="epoch"):
        PrefixSnapshot.from_dict({"seq": 1, "keys": ""})


def test_publisher_sends_each_router_what_it_lacks() -> None:
    held = _keys(1)
    now = [0.0]
    publisher = PrefixPublisher(lambda: held, min_interval_s=0.5, clock=lambda: now[0])
    first = publisher.fields(None)
    assert set(first) == {"prefix_snapshot"} and first["prefix_snapshot"]["seq"] == 1
    acked = publisher.acknowledged({"epoch": publisher.log.epoch, "seq": 1})
    assert publisher.fields(acked) == {}  # nothing new
    held = _keys(1, 2)
    assert publisher.fields(acked) == {}  # observed again only after min_interval_s
    now[0] = 1.0
    events = publisher.fields(acked)["prefix_events"]
    assert [e["seq"] for e in events["events"]] == [2]
    assert publisher.acknowledged({"resync": True}) is None
    assert publisher.acknowledged({"epoch": "other", "seq": 2}) is None
    assert "prefix_snapshot" in publisher.fields(None)
