"""`tcp` KV transfer: P and D on any hosts; the KV bytes as "kv" frames on the control connection itself.

    D: TcpKVReceiver = the control server (kv_transfer/control/server.py) ─▶ expect(...) ─▶ TransferTarget{host, port}
    P: begin(target) ─▶ control connection: hello / auth (HMAC) / ready (kv_transfer/control/links.py)
       layer i done ─▶ host snapshot on the compute thread ─▶ "kv" frame on the loop (kv_transfer/staging.py)
       finish ─▶ every frame written ─▶ "done"
    D: kv frame ─▶ checks ─▶ payload (socket ─▶ host buffer, pinned on CUDA) ─▶ crc32 ─▶ scatter into pool[i]
       "done" ─▶ on_complete
"""

from pdserve.kv_transfer.tcp.receiver import TcpKVReceiver
from pdserve.kv_transfer.tcp.sender import TcpKVSender

__all__ = ["TcpKVReceiver", "TcpKVSender"]
