"""The decode role: reserve KV blocks, receive a prompt's KV from P, decode under continuous batching, stream.

Life of a request on D (one `RequestState`, changed only by `DecodeQueues.move`):

    POST /internal/reserve ──▶ WAITING_FOR_KV   blocks for prompt + 1 reserved; the KV receiver expects the
        │                        │               blocks P writes, under a lease (--kv-lease-timeout)
        │ 503 + retry_after      │ P's "done" frame (every layer of every block arrived, first token inside)
        │ when the blocks         ▼
        │ do not fit          WAITING           the first token's frame goes out now (TTFT = prefill + transfer)
        │                        │ a slot in the running batch (--max-num-seqs)
        ▼                        ▼
    (router tries         RUNNING ◀────────────┐ one token per step for every running request;
     another D)              │   │              │ frames: token ids + text (incremental detokenizer,
                             │   │ blocks ran   │ stop strings across token boundaries, held back
                             │   ▼ out          │ while they might still match)
                             │ PREEMPTED ───────┘ resumed when its blocks fit again
                             ▼
    FINISHED_STOPPED (EOS, stop token, stop string) | FINISHED_LENGTH (max_tokens, max_model_len)
    FINISHED_ABORTED (stream closed, /internal/abort; a request waiting for KV has its expected transfer
                      cancelled first, so late frames are dropped) | FINISHED_ERROR (transfer failed, lease ran out)
    ── every FINISHED_* frees the request's blocks (cached prefix blocks become evictable when colocated);
       STOPPED and LENGTH first commit prompt + output to the tiered cache (named on this worker's device,
       copied to host RAM and Redis), so the conversation's next turn reuses its whole history on any P

A colocated worker (`--role both`) looks the prompt up in its prefix cache at reserve, and, with host / Redis
tiers, fetches the blocks after the device's prefix first (on the event loop; loaded under the state lock).

Preemption is by recompute, not swap: the newest running request gives its blocks back and, once they fit
again, D itself prefills its prompt + generated tokens (all but the last) into fresh blocks before its next
decode step. D does run such a prefill, though the decode role otherwise never runs prompts: it needs no host
copy of the KV, no round trip through a prefill worker, and it stays rare when the pool is sized for the load.
Seeded sampling draws per (seed, step), so a preempted request continues exactly as it would have.

Queues (`Scheduler.queues`, decode_node/queues.py): `requests` (all live), `waiting`, `running`, `preempted`,
`local_prefills`; per request an asyncio queue of frames that `/internal/stream/{id}` drains. Threads: the event
loop (HTTP, KV receiver callbacks) and one step thread (`DecodeEngine`), sharing the scheduler under a lock that
is never held during a forward.

Modules: request.py (state, request), queues.py (the queues, the one place a state changes), scheduler.py
(phases of a step), step.py (a step's batch and frames), prefix.py (reservations' cached prefix), engine.py (the
step thread), node.py (reserve, status, metrics), service.py (the data-plane messages); finish checks and text:
engine/output.py.
"""
