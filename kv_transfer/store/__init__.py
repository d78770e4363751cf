"""`store` KV transfer: P writes each finished layer's blocks into a store both pools reach, D loads them as they
land. No connection between P and D: only the shared store (cache_store/shared_store.py) and the router.

    D: expect(request, blocks) ─▶ TransferTarget{backend "store", store: its store_id, inbox, token}
    P: begin(target)            ─▶ refuses a target whose store is not the one it writes
       layer i done             ─▶ host snapshot ─▶ chunks of ≤ chunk_bytes put under keys of (token, part),
                                   sealed ─▶ a kv_stored record per chunk pushed to D's inbox, in send order
       finish                   ─▶ a done record (the first token) ─▶ PREFILLED to the router
    D: kv_stored               ─▶ take (bounded read, then gone), seal, CRC ─▶ scatter in record order
       done                     ─▶ every layer of every block recorded ─▶ on_complete
    the router loses P before the first token ─▶ SENDER_LOST to D ─▶ D completes what landed, fails the rest

The stores: `shm` (a tmpfs directory and a Unix socket per inbox: one host) and `redis` (keys with TTLs and a
list per inbox: any hosts). Values and records are named and sealed with the deployment's secret exactly as
the Redis tier's blocks (cache_store/redis_auth.py; kv_transfer/store/records.py).
"""

from pdserve.kv_transfer.store.receiver import StoreKVReceiver
from pdserve.kv_transfer.store.sender import StoreKVSender

__all__ = ["StoreKVReceiver", "StoreKVSender"]
