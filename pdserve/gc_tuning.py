"""The cyclic garbage collector in a serving process: once started, out of the per-token path.

What a process loaded at start (the tokenizer, the app, a worker's engine and its Python objects) lives as
long as the process: `gc.freeze` keeps the collector from walking it at every collection. Serving allocates a
few short-lived objects per token, none in a cycle, so a larger young generation makes collections rare. In
the router this took the relay from ~34k to ~50k tokens/s on one core (benchmarks/router_relay.py, paced
case, 2026-12-01): py-spy had put ~15% of its time inside msgpack's unpack, which allocation-triggered
collections are charged to.

While a serving process starts, the collector is off (`collector_off_while_starting`, the first thing its
command does): the imports and the model load make ~0.5M objects that all live on, and the collections they
triggered walked them again and again: 0.32 CPU-s in 484 collections during a worker's imports alone
(gc.callbacks), of its ~4.5 CPU-s to ready. `quiet_garbage_collector` then collects once (~0.15 s), freezes what
is left and turns it on. A deployment's four processes took 10.95 CPU-s to ready, against 11.43 with the
collector on while starting (both with setup.sh's bytecode; medians of 15 interleaved starts on the 2-core host,
results/serve_start_cpu.json: one role's spread across starts is ~1 s, so only the sum is read).
"""

from __future__ import annotations

import gc


def collector_off_while_starting() -> None:
    gc.disable()


def quiet_garbage_collector() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    gc.enable()
