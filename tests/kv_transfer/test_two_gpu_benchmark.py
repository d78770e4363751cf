"""benchmarks/two_gpu.py's CPU-runnable parts: its arguments, its refusal of GPU-only backends on CPUs, and a
whole nccl (gloo) run between two processes with a small shape that writes the JSON. The GPU numbers need two
GPUs and are not produced here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "two_gpu.py"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], check=False, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_gpu_only_backends_are_refused_on_cpus(tmp_path: Path) -> None:
    done = run("--devices", "cpu", "cpu", "--backends", "copy", "nccl", "--out", str(tmp_path / "x.json"))
    assert done.returncode != 0 and "['copy'] need two CUDA devices" in done.stderr
    done = run("--tokens", "100", "--out", str(tmp_path / "x.json"))
    assert done.returncode != 0 and "multiple of 16" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_an_nccl_run_over_gloo_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "results" / "two_gpu.json"
    done = run("--devices", "cpu", "cpu", "--preset", "smollm2-135m", "--tokens", "32", "--backends", "nccl",
               "--repeat", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    kv = report["kv"]
    assert kv["blocks"] == 2 and kv["bytes"] == kv["layer_bytes"] * kv["num_layers"] == 30 * 2 * 2 * 16 * 3 * 64 * 4
    nccl = report["results"]["nccl"]
    assert len(nccl["ms_all"]) == 2 and nccl["gbps"] > 0 and not report["errors"]
