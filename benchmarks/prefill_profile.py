"""Where one prefill's GPU time goes, for benchmarks/prefill_4096_gpu.py: kernels under torch.profiler by group,
the GPU's idle intervals (benchmarks/prefill_gaps.py), and the prefill's four GEMM shapes alone.
"""

from __future__ import annotations

import collections
import re
import statistics
import time

import torch
from prefill_gaps import GPU_CATS, annotated, counter_delta, gap_timeline, memory_counters, trace
from prefill_timing import timed_ms
from prefill_variants import variant

from pdserve.engine import runner as runner_module
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner

GROUPS = (  # first match wins: (group, regex over the kernel name)
    ("attention", r"prefill_attention|fmha|flash|cudnn|attn|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|gemv"),
    ("norms", r"rms_norm"),
    ("rope_kv_write", r"rope"),
    ("silu_and_mul", r"silu"),
    ("copies", r"copy|elementwise|Memcpy|Memset|cat|index"),
)


def kernel_profile(runner: ModelRunner, chunks: list[PrefillChunk], name: str) -> dict:
    """One prefill under torch.profiler: GPU ms per kernel (top 25), per group, and the wall minus their sum."""
    from torch.profiler import ProfilerActivity, profile

    with variant(name):
        runner.prefill(chunks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            runner.prefill(chunks)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1e3
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.time_range.elapsed_us())  # a device event's own span (us)
    per = {k: {"ms": sum(v) / 1e3, "count": len(v), "mean_us": sum(v) / len(v)} for k, v in kernels.items()}
    groups: dict[str, float] = collections.Counter()
    for kname, row in per.items():
        group = next((g for g, rx in GROUPS if re.search(rx, kname, re.IGNORECASE)), "other")
        groups[group] += row["ms"]
    total = sum(r["ms"] for r in per.values())
    top = dict(sorted(per.items(), key=lambda kv: -kv[1]["ms"])[:25])
    return {"wall_ms_profiled": wall, "kernels_ms": total, "gaps_ms": wall - total,
            "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "top_kernels": top}


def gaps(runner: ModelRunner, chunks: list[PrefillChunk], name: str, with_stack: bool) -> dict:
    """One prefill's gap timeline (benchmarks/prefill_gaps.py) and the allocator's counters around it."""
    with variant(name), annotated(runner, runner_module) as layer_done:
        runner.prefill(chunks, layer_done)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        before = memory_counters() if torch.cuda.is_available() else {}
        events, wall = trace(lambda: runner.prefill(chunks, layer_done), with_stack)
        out = gap_timeline(events, wall, busy_cats=GPU_CATS if torch.cuda.is_available() else {"cpu_op"})
        if torch.cuda.is_available():
            out["allocator_delta"] = counter_delta(before, memory_counters())
    return out


def gemm_shapes(config_name: str, tokens: int, dtype: torch.dtype) -> dict:
    """The prefill's four GEMM shapes alone (x [M, K] @ W[N, K].T), cuBLAS and cuBLASLt, CUDA-event medians."""
    c = get_preset(config_name)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    out = {}
    saved = torch.backends.cuda.preferred_blas_library()
    try:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for name, (n, k) in shapes.items():
                x = torch.randn(tokens, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
                for _ in range(3):
                    torch.nn.functional.linear(x, w)
                ms = statistics.median(timed_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), True) for _ in range(20))
                out.setdefault(name, {"n": n, "k": k})[lib] = {"us": ms * 1e3,
                                                                "tflops": 2 * tokens * n * k / (ms * 1e-3) / 1e12}
    finally:
        torch.backends.cuda.preferred_blas_library(saved)
    per_layer = {lib: sum(s[lib]["us"] for s in out.values()) for lib in ("cublas", "cublaslt")}
    return {"shapes": out, "per_layer_us": per_layer,
            "all_layers_ms": {lib: us * c.num_layers / 1e3 for lib, us in per_layer.items()}}
