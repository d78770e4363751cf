"""benchmarks/transfer_backends.py's CPU-runnable parts: its arguments, its refusal of GPU-only backends on CPUs, and
whole runs between two processes with a small shape that write the JSON: nccl over gloo, and tcp, store over shm
and store over a real redis-server side by side. The GPU numbers are not produced here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "transfer_backends.py"
SMOL_BYTES_32_TOKENS = 30 * 2 * 2 * 16 * 3 * 64 * 4  # layers x K,V x blocks x block x heads x dim x fp32


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], check=False, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_gpu_only_backends_are_refused_on_cpus(tmp_path: Path) -> None:
    done = run("--devices", "cpu", "cpu", "--backends", "cuda_ipc", "tcp", "--out", str(tmp_path / "x.json"))
    assert done.returncode != 0 and "['cuda_ipc'] need CUDA devices" in done.stderr
    done = run("--tokens", "100", "--out", str(tmp_path / "x.json"))
    assert done.returncode != 0 and "multiple of 16" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_an_nccl_run_over_gloo_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "results" / "transfer.json"
    done = run("--devices", "cpu", "cpu", "--presets", "smollm2-135m", "--tokens", "32", "--backends", "nccl",
               "--repeat", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    entry = json.loads(out.read_text())["presets"]["smollm2-135m"]
    kv = entry["kv"]
    assert kv["blocks"] == 2 and kv["bytes"] == kv["layer_bytes"] * kv["num_layers"] == SMOL_BYTES_32_TOKENS
    nccl = entry["results"]["nccl"]
    assert len(nccl["ms_all"]) == 2 and nccl["gbps"] > 0


def test_tcp_and_both_stores_side_by_side(tmp_path: Path, redis_server) -> None:
    out = tmp_path / "transfer.json"
    done = run("--devices", "cpu", "cpu", "--presets", "smollm2-135m", "llama3-8b:bfloat16", "--tokens", "32",
               "--backends", "copy", "tcp", "store-shm", "store-redis", "--chunk-mib", "0.05", "1",
               "--redis-url", redis_server.url, "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["errors"] and not report["skipped"]
    rows = report["presets"]["llama3-8b"]["results"]
    assert report["presets"]["llama3-8b"]["kv"]["dtype"] == "bfloat16"
    assert set(rows) == {"copy", "tcp", "store-shm@0.05MiB", "store-shm@1MiB", "store-redis@0.05MiB",
                         "store-redis@1MiB"}
    assert all(rows[name]["ms"] > 0 and rows[name]["p_ms"] > 0 and "vs_tcp" in rows[name] for name in rows
               if name != "copy")
    assert "store-shm@1MiB" in done.stdout
