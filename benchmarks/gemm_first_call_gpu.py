"""Is the first prefill of a new prompt length slower because cuBLAS meets a new M? Host ms of the first and a
second call of each llama3-8b prefill GEMM (x [M, K] @ W[N, K].T, bf16) at row counts M it has not seen, cuBLAS
and cuBLASLt, synchronized around each call; then, in a 2-layer llama3-8b runner after its warm-up, the host ops
whose self time grew most from a new length's second prefill to its first (torch.profiler, CPU).

    OUT=/some/dir python benchmarks/gemm_first_call_gpu.py        # writes gemm_first_call_h200.json

(benchmarks/results/prefill_served_lengths_h200.json: after the warm-up, a served length's first prefill ran the
same kernels and runtime calls as its second, no allocation, but 6-8 ms more GPU idle inside the forward.)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def host_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def cpu_us(fn) -> dict[str, float]:
    """Host us per op name (self CPU time, torch.profiler) in one synchronized call of fn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.self_cpu_time_total for e in prof.key_averages()}


def engine_ops(lengths: tuple[int, ...] = (1374, 2361, 3562)) -> dict:
    """A 2-layer llama3-8b runner after warm_up_prefill: per new prompt length, the ops whose host time grew
    most from the second call to the first (us), and each call's total."""
    import dataclasses

    from pdserve.engine.attention_metadata import PrefillChunk
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.presets import get_preset
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.weights.dummy import dummy_weights

    config = dataclasses.replace(get_preset("llama3-8b"), num_layers=2)
    runner = ModelRunner(config, CacheConfig(num_blocks=272, block_size=16),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16, max_num_seqs=4,
                         enforce_eager=True)
    runner.warm_up_prefill(1 << 20)
    out = {}
    for n in lengths:
        chunk = [PrefillChunk([(5 * j + 1) % config.vocab_size for j in range(n)], 0, list(range(-(-n // 16))))]
        first, again = (cpu_us(lambda c=chunk: runner.prefill(c)) for _ in range(2))
        grew = sorted(((k, round(first[k] - again.get(k, 0.0), 1)) for k in first), key=lambda kv: -kv[1])[:8]
        out[n] = {"first_total_us": round(sum(first.values())), "again_total_us": round(sum(again.values())),
                  "grew_most": dict(grew)}
        print(n, out[n], flush=True)
    return out


def main() -> None:
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (n, kk) in SHAPES.items()}
    x = torch.randn(8192, 14336, device="cuda", dtype=torch.bfloat16)
    for w in weights.values():  # libraries loaded, handles made, one M seen
        torch.nn.functional.linear(x[:64, : w.shape[1]], w)
    gen = torch.Generator().manual_seed(5)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for _ in range(6):
            m = int(torch.randint(1100, 8000, (1,), generator=gen))
            row = {"lib": lib, "m": m}
            for name, w in weights.items():
                a = x[:m, : w.shape[1]]
                row[name] = [round(host_ms(lambda a=a, w=w: torch.nn.functional.linear(a, w)), 3) for _ in range(3)]
            result["rows"].append(row)
            print(row, flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    extra = [r[n][0] - statistics.median(r[n][1:]) for r in result["rows"] if r["lib"] == "cublas" for n in SHAPES]
    result["cublas_first_minus_steady_ms"] = {"median": statistics.median(extra), "max": max(extra)}
    print("cublas first call minus steady, per GEMM (ms):", result["cublas_first_minus_steady_ms"])
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gemm_first_call_h200.json"
    path.write_text(json.dumps(result, indent=1) + "\n")  # before the engine part: its failure loses only itself
    result["engine_first_minus_again_cpu_us"] = engine_ops()
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
