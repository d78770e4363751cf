"""The prefill role: batch prompts under a token budget, compute only the uncached suffix, push KV to D.

Life of a request on P (one `PrefillState`, changed only by `Batcher._move`):

    POST /internal/prefill     checked against our KV layout; the blocks after the device's cached prefix are
          │                    looked up in host RAM, then Redis (deadline --cache-timeout) and staged
          ▼                    (`request.fetched`); sender.begin(target)
                             QUEUED
                                 │ FIFO; admitted when its blocks fit: the longest cached prefix (device tier
                                 │ of the prefix cache) is taken as is, the staged blocks that continue it are
                                 │ copied into the first new blocks, new blocks for the rest
                                 ▼
                             PREFILLING      one chunk per forward, up to --max-num-batched-tokens over the
                                 │ ▲         whole packed batch (long prompts continue first, then new ones);
                                 │ └─ more   after each layer, that layer's blocks go to D (kv_transfer sender:
                                 │   chunks  copied out on the compute thread, written by the event loop while
                                 │           the next layer computes); the first chunk also sends the cached prefix
                                 │           (but the blocks D holds already: its target leaves them out)
                                 ▼ last chunk: the first token is sampled with the request's SamplingParams
                             FINISHED        full prompt blocks committed to the prefix cache (write-through:
                                             the computed ones copied to host RAM and Redis on the tiers' writer
                                             thread), our references freed (cached blocks stay, evictable); then
                                             the "done" frame (first token) is written and the HTTP answer returns
    any state ──▶ ABORTED (/internal/abort: D is told through the transfer's error frame)
              ──▶ FAILED  (prompt can never fit, the forward raised, or the transfer broke: that request only)

Colocated (`--role both`, transfer backend `local`): there is one pool. D's reservation already took the cached
prefix from the shared prefix cache (and loaded what host RAM / Redis held), so P computes the rest straight into D's reserved blocks (holding a
reference of its own on them while it writes) and "sending" a layer only records it: nothing is copied.

Queues: `Batcher.queue` (QUEUED), `Batcher.prefilling`; per request an asyncio future the HTTP handler awaits.
Threads: the event loop (HTTP, sender I/O) and one step thread (`PrefillEngine`).

Modules: request.py (state, request), batcher.py (batch formation), engine.py (the step thread and the KV
push), node.py (request checks, status, metrics), app.py (HTTP routes).
"""
