"""Kernel microbenchmarks on a CUDA device: each pdserve Triton kernel against its torch baseline and the
measured ceilings (BENCHMARKS.md: copy 4.2 TB/s, bf16 GEMM 757 TFLOP/s), Llama-3-8B shapes, bf16.

    python benchmarks/kernels.py --json benchmarks/results/kernels_h200.json            # the table
    python benchmarks/kernels.py --sweep --tune-linear kernels/linear_configs.json ...  # + config sweeps
    python benchmarks/kernels.py --compile-only --only gemv                              # fill Triton's cache

Times are triton.testing.do_bench medians (CUDA events, L2 flushed before every call); inputs are rotated
over copies adding up to >= 4x the 60 MB L2. Bandwidth counts each input read once and each output written
once. The table prints last; --json saves every number, the sweeps' times included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from kernels_attention import decode_rows, decode_sweep, prefill_rows, prefill_sweep
from kernels_common import (
    DEVICE,
    SETTINGS,
    Row,
    bench_us,
    best_of,
    device_name,
    format_table,
    rel_error,
    rotating,
    timed,
)
from kernels_gemv import gemv_rows, tune

from pdserve.kernels import activation_triton, block_copy_triton, rms_norm_triton, rope_triton
from pdserve.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdserve.kernels.rope import build_cos_sin_cache, rope_kv_write_ref

BF16 = torch.bfloat16  # the ceilings are measured in bf16; the kernels run in SETTINGS.dtype
HIDDEN, INTER, HQ, HKV, DIM, PAGE = 4096, 14336, 32, 8, 128, 16
NORM_TOKENS, SILU_TOKENS, ROPE_TOKENS, COPY_BLOCKS = (16384, 32), (4096, 32), 8192, 2048


def measure_ceilings() -> dict:
    """Copy bandwidth and bf16 GEMM rate on this device, now (random data, median)."""
    src = torch.randn(512 * 1024 * 1024, device=DEVICE, dtype=BF16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_us = bench_us(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device=DEVICE, dtype=BF16) for _ in range(2))
    gemm_us = bench_us(lambda: a @ b)
    return {"copy_tbps": 2 * src.numel() * 2 / (copy_us * 1e-6) / 1e12, "gemm_tflops": 2 * 8192**3 / (gemm_us * 1e-6) / 1e12}


def _bandwidth_check(pct: float) -> Callable[[Row, float], bool]:
    return lambda row, us: row.pct(us) >= pct


def norm_rows() -> list[Row]:
    dt, rows = SETTINGS.dtype, []
    for tokens in NORM_TOKENS:
        sets = [tuple(torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dt) for _ in range(2)) for _ in range(4)]
        w = torch.randn(HIDDEN, device=DEVICE, dtype=dt)
        out, _ = rms_norm_triton.fused_add_rms_norm_triton(*sets[0], w, 1e-5)
        err = rel_error(out, F.rms_norm(sets[0][0] + sets[0][1], (HIDDEN,), w, 1e-5))
        big = tokens >= 4096
        row = Row("add_rms_norm", f"{tokens}x{HIDDEN}", 0, "torch add+F.rms_norm", 0, bytes=4 * tokens * HIDDEN * 2,
                  rel_err=err, target=">=80% copy bw" if big else "")
        rows.append(timed(row, rotating([lambda s=s, w=w: rms_norm_triton.fused_add_rms_norm_triton(*s, w, 1e-5)
                                         for s in sets]),
                          rotating([lambda s=s, w=w: F.rms_norm(s[0] + s[1], (HIDDEN,), w, 1e-5) for s in sets]),
                          _bandwidth_check(80) if big else None))
    return rows


def silu_rows() -> list[Row]:
    dt, rows = SETTINGS.dtype, []
    for tokens in SILU_TOKENS:
        sets = [torch.randn(tokens, 2 * INTER, device=DEVICE, dtype=dt) for _ in range(2 if tokens > 1024 else 8)]
        ref = F.silu(sets[0][:, :INTER]) * sets[0][:, INTER:]
        err = rel_error(activation_triton.silu_and_mul_triton(sets[0]), ref)
        big = tokens >= 1024
        row = Row("silu_and_mul", f"{tokens}x{INTER}", 0, "torch silu*mul", 0, bytes=3 * tokens * INTER * 2,
                  rel_err=err, target=">=80% copy bw" if big else "")
        rows.append(timed(row, rotating([lambda x=x: activation_triton.silu_and_mul_triton(x) for x in sets]),
                          rotating([lambda x=x: F.silu(x[:, :INTER]) * x[:, INTER:] for x in sets]),
                          _bandwidth_check(80) if big else None))
    return rows


def rope_rows() -> list[Row]:
    dt, tokens = SETTINGS.dtype, ROPE_TOKENS
    cos_sin = build_cos_sin_cache(DIM, 8192, 500000.0).to(DEVICE)
    num_blocks = -(-tokens // PAGE)
    sets = []
    for _ in range(2):
        qkv = torch.randn(tokens, HQ + 2 * HKV, DIM, device=DEVICE, dtype=dt)
        q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
        cache = torch.randn(2, num_blocks, PAGE, HKV, DIM, device=DEVICE, dtype=dt)
        sets.append((q, k, v, torch.arange(tokens, device=DEVICE), cos_sin, cache,
                     torch.randperm(tokens, device=DEVICE)))
    q, k, *rest = sets[0]  # q and k are rotated in place: each side gets its own copies
    ref = rope_kv_write_ref(q.clone(), k.clone(), *rest)
    err = rel_error(rope_triton.rope_kv_write_triton(q.clone(), k.clone(), *rest), ref)
    nbytes = tokens * (2 * HQ * DIM * 2 + 2 * HKV * DIM * 2 * 2 + DIM * 4 + 16)
    row = Row("rope_kv_write", f"{tokens} tok 32q/8kv", 0, "torch ops (ref)", 0, bytes=nbytes, rel_err=err)
    return [timed(row, rotating([lambda s=s: rope_triton.rope_kv_write_triton(*s) for s in sets]),
                  rotating([lambda s=s: rope_kv_write_ref(*s) for s in sets]), base_graph=False)]


def block_copy_rows() -> list[Row]:
    num = COPY_BLOCKS
    cache = torch.randn(2, 2 * num, PAGE, HKV, DIM, device=DEVICE, dtype=SETTINGS.dtype)
    ids = [torch.randperm(2 * num, device=DEVICE)[:num] for _ in range(4)]
    nbytes = 2 * 2 * num * PAGE * HKV * DIM * 2
    blocks = block_copy_triton.gather_blocks_triton(cache, ids[0])
    err = rel_error(blocks, gather_blocks_ref(cache, ids[0]))
    gather = Row("gather_blocks", f"{num} blocks 16x8x128", 0, "torch index", 0, bytes=nbytes, rel_err=err)
    scatter = Row("scatter_blocks", f"{num} blocks 16x8x128", 0, "torch index_put", 0, bytes=nbytes)
    return [timed(gather, rotating([lambda i=i: block_copy_triton.gather_blocks_triton(cache, i) for i in ids]),
                  rotating([lambda i=i: gather_blocks_ref(cache, i) for i in ids])),
            timed(scatter, rotating([lambda i=i: block_copy_triton.scatter_blocks_triton(cache, i, blocks) for i in ids]),
                  rotating([lambda i=i: scatter_blocks_ref(cache, i, blocks) for i in ids]), base_graph=False)]


def small_sweeps() -> dict:
    """Rows per program / warps for the norm, block / warps for SiLU-mul, at the bandwidth sizes."""
    dt = SETTINGS.dtype
    out = {}
    for tokens in NORM_TOKENS:
        x, r = (torch.randn(tokens, HIDDEN, device=DEVICE, dtype=dt) for _ in range(2))
        w = torch.randn(HIDDEN, device=DEVICE, dtype=dt)
        variants = {f"rows{rows} w{warps}": (lambda c=(rows, HIDDEN, warps), x=x, r=r, w=w: rms_norm_triton._launch(x, r, w, 1e-5, c))
                    for rows in (1, 2, 4) for warps in (4, 8, 16)}
        best, us, times = best_of(variants, graph=True)
        out[f"add_rms_norm {tokens}"] = {"best": best, "best_tbps": 4 * tokens * HIDDEN * 2 / us / 1e6, "times_us": times}
    for tokens in SILU_TOKENS:
        x = torch.randn(tokens, 2 * INTER, device=DEVICE, dtype=dt)
        variants = {f"block{b} w{warps}": (lambda c=(b, warps), x=x: activation_triton._launch(x, c))
                    for b in (512, 1024, 2048, 4096) for warps in (4, 8)}
        best, us, times = best_of(variants, graph=True)
        out[f"silu_and_mul {tokens}"] = {"best": best, "best_tbps": 3 * tokens * INTER * 2 / us / 1e6, "times_us": times}
    for name, entry in out.items():
        print(f"sweep {name}: best {entry['best']} {entry['best_tbps']:.2f} TB/s", flush=True)
    return out


DECODE_SHAPES = [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (32, 1024), (128, 512)]
SWEEP_DECODE_SHAPES = [(32, 4096), (8, 4096), (1, 4096), (128, 512)]
SWEEP_PREFILL = ("1x4096", "1x1024")
PREFILL_CASES = {"1x1024": [(1024, 0)], "1x4096": [(4096, 0)], "4x1024 varlen": [(1024, 0), (700, 0), (1024, 0), (300, 0)],
                 "chunk 1024 after 3072": [(1024, 3072)]}


def run(args: argparse.Namespace) -> dict:
    only = set(args.only.split(",")) if args.only else None
    wanted = lambda name: only is None or name in only
    result: dict = {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "date": datetime.date.today().isoformat(), "sweeps": {}}
    if wanted("ceilings") and not SETTINGS.compile_only:
        result["ceilings_measured"] = measure_ceilings()
        print(f"ceilings now: {result['ceilings_measured']}", flush=True)
    if args.sweep:
        if wanted("small"):
            result["sweeps"].update(small_sweeps())
        if wanted("decode"):
            result["sweeps"]["decode"] = decode_sweep(SWEEP_DECODE_SHAPES)
        if wanted("prefill"):
            result["sweeps"]["prefill"] = prefill_sweep({k: PREFILL_CASES[k] for k in SWEEP_PREFILL})
    if args.tune_linear and wanted("gemv"):
        tune(Path(args.tune_linear))
    _save(args, result)  # the sweeps survive a failure further on
    rows: list[Row] = []
    for name, fn in (("small", lambda: norm_rows() + silu_rows() + rope_rows() + block_copy_rows()),
                     ("decode", lambda: decode_rows(DECODE_SHAPES)), ("prefill", lambda: prefill_rows(PREFILL_CASES)),
                     ("gemv", gemv_rows)):
        if wanted(name):
            rows += fn()
    result["rows"] = [r.as_dict() for r in rows]
    _save(args, result)
    if not SETTINGS.compile_only:
        print(format_table(rows), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="save all results here")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile/split configs of the other kernels")
    parser.add_argument("--tune-linear", help="tune the GEMV configs and write the table to this path")
    parser.add_argument("--only", help="comma list of: ceilings, small, decode, prefill, gemv")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--compile-only", action="store_true", help="launch every variant once, time nothing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    SETTINGS.compile_only = args.compile_only
    SETTINGS.dtype = getattr(torch, args.dtype)
    run(args)


def _save(args: argparse.Namespace, result: dict) -> None:
    if args.json and not SETTINGS.compile_only:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
