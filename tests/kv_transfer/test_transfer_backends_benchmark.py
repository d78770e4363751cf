"""benchmarks/transfer_backends.py's CPU-runnable parts: its arguments and its refusal of GPU-only backends on
CPUs (in this process: each run of the script costs a torch import, ~4 s on the 2-core CI box), and whole runs
between two processes with a small shape that write the JSON: nccl over gloo, and tcp, store over shm and store
over a real redis-server side by side. The GPU numbers are not produced here."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "transfer_backends.py"
SMOL_BYTES_32_TOKENS = 30 * 2 * 2 * 16 * 3 * 64 * 4  # layers x K,V x blocks x block x heads x dim x fp32


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], check=False, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def benchmark() -> ModuleType:
    """The script as a module; benchmarks/ is on sys.path only while it imports its sibling transfer_common (it
    holds a kernels.py, which would shadow the package of that name for the rest of the session)."""
    spec = importlib.util.spec_from_file_location("transfer_backends", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


@pytest.mark.parametrize(("argv", "why"), [
    (["--devices", "cpu", "cpu", "--backends", "cuda_ipc", "tcp"], "['cuda_ipc'] need CUDA devices"),
    (["--devices", "cuda:0", f"cuda:{torch.cuda.device_count()}"], "CUDA devices"),
    (["--tokens", "100"], "multiple of 16"),
    (["--chunk-mib", "0"], "--chunk-mib must be positive"),
    (["--torch-threads", "0"], "--torch-threads must be >= 1"),
])
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str], why: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv, "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match=re.escape(why)):
        benchmark().main()
    assert not (tmp_path / "x.json").exists()


def test_defaults_fit_the_host_and_nccl_on_one_gpu_is_skipped() -> None:
    module = benchmark()
    args = module.build_parser().parse_args([])
    module.check_args(args)
    gpus = torch.cuda.device_count()
    assert args.devices == {0: ["cpu", "cpu"], 1: ["cuda:0", "cuda:0"]}.get(gpus, ["cuda:0", "cuda:1"])
    assert ("cuda_ipc" in args.backends) == (gpus > 0) and {"tcp", "nccl", "store-shm", "store-redis"} <= set(
        args.backends)
    assert args.chunk_mib == [0.25, 1, 4, 16]
    one_gpu = [torch.device("cuda:0"), torch.device("cuda:0")]
    assert "needs two GPUs" in module.unrunnable("nccl", one_gpu)
    assert module.unrunnable("nccl", [torch.device("cuda:0"), torch.device("cuda:1")]) is None
    assert module.unrunnable("nccl", [torch.device("cpu")] * 2) is None  # gloo
    assert module.unrunnable("cuda_ipc", one_gpu) is None


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
    """The benchmark starts its own redis-server, as on the GPU machine, and so knows its CPU time
    (`redis_server` only makes sure that the binary is there)."""
    out = tmp_path / "transfer.json"
    done = run("--devices", "cpu", "cpu", "--presets", "llama3-8b:bfloat16", "--tokens", "32",
               "--backends", "copy", "tcp", "store-shm", "store-redis", "--chunk-mib", "0.05", "1",
               "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["errors"] and not report["skipped"]
    assert report["command"].startswith("python ") and "--chunk-mib 0.05 1" in report["command"]
    rows = report["presets"]["llama3-8b:bfloat16"]["results"]
    assert report["presets"]["llama3-8b:bfloat16"]["kv"]["dtype"] == "bfloat16"
    assert set(rows) == {"copy", "tcp", "store-shm@0.05MiB", "store-shm@1MiB", "store-redis@0.05MiB",
                         "store-redis@1MiB"}
    assert all(rows[name]["ms"] > 0 and rows[name]["p_ms"] > 0 and "vs_tcp" in rows[name] for name in rows
               if name != "copy")
    assert all(rows[name]["p_cpu_ms"] > 0 and rows[name]["d_cpu_ms"] > 0 for name in rows if name != "copy")
    assert [name for name in rows if "server_cpu_ms" in rows[name]] == ["store-redis@0.05MiB", "store-redis@1MiB"]
    assert rows["store-redis@1MiB"]["cpu_ms"] == pytest.approx(sum(
        rows["store-redis@1MiB"][part] for part in ("p_cpu_ms", "d_cpu_ms", "server_cpu_ms")))
    assert "store-shm@1MiB" in done.stdout
    # P's stages (benchmarks/transfer_stages.py), in the order a layer passes them: only tcp sums on P
    tcp = rows["tcp"]
    assert 0 < tcp["p_ready_first_ms"] <= tcp["p_summed_first_ms"] <= tcp["p_sent_first_ms"] <= tcp["p_sent_last_ms"]
    assert tcp["p_ready_last_ms"] <= tcp["p_summed_last_ms"] <= tcp["p_sent_last_ms"] <= tcp["p_ms"]
    assert "p_summed_first_ms" not in rows["store-shm@1MiB"] and rows["store-shm@1MiB"]["p_sent_last_ms"] > 0


def test_one_preset_in_two_dtypes_gets_two_entries(tmp_path: Path) -> None:
    """`llama3-8b:bfloat16 llama3-8b:float8_e4m3fn` (issue 19's transfer rows) once shared one key, the second
    overwriting the first."""
    out = tmp_path / "dtypes.json"
    done = run("--devices", "cpu", "cpu", "--presets", "smollm2-135m:float32", "smollm2-135m:float8_e4m3fn",
               "--tokens", "32", "--backends", "copy", "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    presets = json.loads(out.read_text())["presets"]
    assert {name: entry["kv"]["dtype"] for name, entry in presets.items()} == {
        "smollm2-135m:float32": "float32", "smollm2-135m:float8_e4m3fn": "float8_e4m3fn"}
    assert presets["smollm2-135m:float32"]["kv"]["bytes"] == 4 * presets["smollm2-135m:float8_e4m3fn"]["kv"]["bytes"]
