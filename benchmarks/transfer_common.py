"""benchmarks/transfer_backends.py's parts beside the transfers: the plain copy it compares them with, the stores
of the store rows (a /dev/shm directory, a Redis given or started here), and the report's small helpers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pdserve.cache_store.kv_codec import DTYPES

WARMUP = 2


def summary(times_ms: list[float], nbytes: int) -> dict[str, float | list[float]]:
    median = statistics.median(times_ms)
    return {"ms": median, "gbps": nbytes / median / 1e6, "ms_all": [round(t, 3) for t in times_ms]}


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def synchronize(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# ---- the plain copy --------------------------------------------------------------------------------------

def plain_copy(kv: dict, devices: list[torch.device], repeat: int) -> dict[str, object]:
    src_dev, dst_dev = devices
    dtype, num_layers = DTYPES[str(kv["dtype"])], int(kv["num_layers"])
    layer_elems = int(kv["layer_bytes"]) // dtype.itemsize
    # drawn in fp32 and cast: normal_ has no fp8 kernel ("normal_kernel_cpu" not implemented for Float8_e4m3fn)
    src = torch.empty(num_layers * layer_elems, device=src_dev).normal_().to(dtype)
    dst = torch.empty(src.shape, dtype=dtype, device=dst_dev)

    def timed(step: object) -> list[float]:
        times = []
        for i in range(WARMUP + repeat):
            synchronize(src_dev, dst_dev)
            t0 = time.perf_counter()
            step()  # type: ignore[operator]
            synchronize(src_dev, dst_dev)
            if i >= WARMUP:
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def per_layer() -> None:
        for layer in range(num_layers):
            dst[layer * layer_elems:(layer + 1) * layer_elems].copy_(src[layer * layer_elems:(layer + 1) * layer_elems])

    result: dict[str, object] = {"whole": summary(timed(lambda: dst.copy_(src)), int(kv["bytes"])),
                                 "per_layer": summary(timed(per_layer), int(kv["bytes"]))}
    if src_dev.type == dst_dev.type == "cuda" and src_dev != dst_dev:
        result["peer_access"] = torch.cuda.can_device_access_peer(src_dev.index or 0, dst_dev.index or 0)
    return result



# ---- the stores ---------------------------------------------------------------------------------------

class Skipped(RuntimeError):
    """A row this host cannot run (no redis-server): listed under `skipped`, not a failure."""


class Stores:
    """The store backends' stores for the run: a /dev/shm directory, and a Redis (given, or started here)."""

    def __init__(self, redis_url: str | None) -> None:
        self.shm = tempfile.mkdtemp(prefix="pdserve-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        self.redis_url, self._server = redis_url, None

    def spec(self, kind: str) -> dict[str, str | None]:
        if kind == "redis" and self.redis_url is None:
            self.redis_url = self._start_redis()
        return {"kind": kind, "dir": self.shm, "url": self.redis_url}

    def _start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise Skipped("redis-server not found on this host and no --redis-url")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self._server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while self._server.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.1)
        why = self._server.stderr.read().decode(errors="replace")[-500:] if self._server.poll() is not None else ""
        raise Skipped(f"{binary} did not start on port {port}: {why or 'no answer in 10 s'}")

    def server_cpu(self) -> float:
        """CPU seconds the redis-server started here has used (0 for one given by --redis-url: not known)."""
        if self._server is None:
            return 0.0
        fields = Path(f"/proc/{self._server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def close(self) -> None:
        shutil.rmtree(self.shm, ignore_errors=True)
        if self._server is not None:
            self._server.terminate()
            self._server.wait(timeout=10)
