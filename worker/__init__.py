"""The worker: one process that loads the engine once and serves the prefill role, the decode role, or both.

Life of a worker process (modules in brackets):

    `pdserve prefill | decode`, or a child of `pdserve serve` ─▶ run_worker                     [app, flags]
      ▼
    build: load_model ─▶ runner + block pool + prefix cache ─▶ the role's node(s)                 [assembly]
           KV cache tiers over the pool (host RAM, Redis) and the transfer backends               [cache, transfer]
      ▼
    serve: one FastAPI app (/health, /metrics, /internal/status, cache, control)                 [app, metrics]
           the data plane: the routers' multiplexed connections, each message to its role         [data_plane]
           with --router: register with every router, then heartbeat each                       [router_links]
      ▼
    change role / drain at run time (in-flight work finishes first)                               [control]
      ▼
    SIGTERM: drain, deregister from every router, exit                                            [control, router_links]

It decides no policy: batching and admission are the nodes' (prefill_node/, decode_node/), worker choice
the router's. Outside this folder it imports the nodes, engine/, cache_store/, kv_transfer/, protocol/ and
pdserve.settings (what the flags build) and pdserve.gc_tuning, never the router or the CLI.
"""
