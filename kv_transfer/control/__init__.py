"""The control channel every KV transfer backend shares: how a transfer begins and ends, whatever moves its bytes.

    P: OutgoingTransfers (outgoing.py)   begin: the target check ─▶ layer sends tracked ─▶ finish: "done" or
                                         "error"; abort: "error" ─▶ over a ControlChannel:
         ControlLinks (links.py)         tcp, cuda_ipc, nccl: one authenticated connection per D (handshake.py:
                                         hello / HMAC auth / ready, with deadlines), then the backend's step
                                         (cuda_ipc: D's pools; nccl: the rendezvous and the group join)
         store/inbox.py                  store: sealed records in D's inbox
    D: ListeningReceiver (server.py)     the server side of those connections: handshake, then per connection
                                         the backend's data path (tcp: kv frames; nccl: kv_bulk + the group;
                                         cuda_ipc: none); done / error ─▶ end_transfer ─▶ the TransferTable
       store/receiver.py                 the inbox's records: its done / error ─▶ the same end_transfer

The data paths are the backends' packages: kv_transfer/tcp/ (bytes on the socket), cuda_ipc/ (P's kernels
write D's pool), nccl/ (group sends), store/ (the shared store's values); kv_transfer/staging.py is the sender
of those whose layers are copied out on the compute thread and sent from the loop (tcp, nccl, store).
"""
