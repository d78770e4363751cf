"""The router <-> worker data plane: messages defined once, their codec, and the connection that carries them.

One persistent TCP connection per router-worker pair (the worker listens on `--data-port`, the router
connects), multiplexing every sub-request the router has on that worker; HTTP stays for the public API,
health, metrics, registration and admin. Torch-free: the router, both nodes and the tests import it.

    router                                    worker
    ──────                                    ──────
    connect ───────────────────────────────▶  HELLO {nonce, worker_id}
    AUTH {mac = HMAC(secret, nonce)}  ──────▶  WELCOME | ERROR + close
    RESERVE {id, prompt, sampling, ...} ───▶  D: RESERVED {id, transfer, cached} | REFUSED {id, status, ...}
                                               (RESERVED local_prefill: D prefills it itself, no P is asked)
    PREFILL {id, prompt, sampling, transfer?}▶ P: (sent together with RESERVE; the target follows in
    PREFILL_TARGET {id, transfer} ─────────▶       PREFILL_TARGET once D reserved)
                                 ◀──────────   P: PREFILLED {id, first token + its text} | PREFILL_FAILED
                                 ◀──────────   D: TOKENS [delta, delta, ...]   one message per decode step
    ABORT {id, reason} ────────────────────▶   P and D free what the request holds
    SENDER_LOST {id, reason} ──────────────▶   D: P went before the first token (the store backend's D
                                                   completes what landed, fails the rest at once)
    PING {seq} ◀──────────────────────────▶   PONG {seq}   liveness in both directions

A frame is a 4-byte big-endian length and one msgpack array `[kind, field, field, ...]` (kinds are ints,
`protocol.messages.Kind`). A reader checks the length against its limit before it reads (or allocates) the
body, then the kind and every field's type (protocol/codec.py). Never pickle.

Modules: messages.py (the dataclasses), codec.py (encode / decode with type checks), framing.py (frames on an
asyncio stream, limits), auth.py (HMAC of the handshake), connection.py (a handshaken connection: send,
receive, close), server.py (the worker side: accept, handshake, hand each message to a handler).
"""
