"""Tried, not kept: the skinny fp8 product (kernels/linear_fp8_skinny_triton.py) loading W and x through TMA
tensor descriptors (triton.tools.tensor_descriptor, Hopper's bulk async copies) instead of pointer loads.

    OUTF=benchmarks/results/linear_fp8_tma_h100.json python benchmarks/linear_fp8_tma_gpu.py   (GPU)
    TRITON_INTERPRET=1 python benchmarks/linear_fp8_tma_gpu.py             (CPU: the TMA kernel against a reference)

Product only (x quantized beforehand), llama3-8b's four shapes at 1, 16 and 64 rows, CUDA-graph replay of
back-to-back calls on rotated weights (benchmarks/kernels_common.graph_us): the table's config, the best of six
pointer configs and the best of sixteen TMA configs. H100, Triton 3.6 (2026-12-06,
results/linear_fp8_tma_h100.json): at 1 row the same (qkv 10.3 against 10.8 us, o 8.0 / 7.9, gate_up 40.9 /
41.3, down 22.4 / 22.3), at 64 rows 1-6 % faster (11.4 / 11.3, 8.7 / 8.2, 44.8 / 44.7, 24.9 / 23.6): 2 us a
layer, ~1 % of a b64 step. What holds the short linears (qkv and o at 2.1-2.4 TB/s against gate_up's 2.9) is
the kernel's ramp and tail, not how a tile is loaded, so the pointer kernel stays.
"""
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch
import triton
import triton.language as tl
from kernels_common import copies_for, graph_us, rotating
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.kernels.fp8_weight import quantize_weight_fp8
from pdserve.kernels.linear_fp8_skinny_triton import Fp8SkinnyConfig, fp8_skinny_triton, skinny_config
from pdserve.kernels.linear_fp8_triton import quantize_rows_fp8_triton
from pdserve.kernels.linear_triton import reduce_split_k, split_k_layout
from pdserve.kernels.pdl import launch_options

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M", "stride_ps"])
def _tma_kernel(x_desc, x_scale_ptr, w_desc, w_scale_ptr, out_ptr, part_ptr, M, N, K, k_per_split, stride_om,
                stride_ps, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    off_n = pid_n * BLOCK_N
    k0 = pid_k * k_per_split
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kk in tl.range(0, k_per_split, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([off_n, k0 + kk])
        x = x_desc.load([0, k0 + kk])
        acc = tl.dot(w, tl.trans(x), acc)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    n_ok = offs_n < N
    sx = tl.load(x_scale_ptr + offs_m, mask=m_ok, other=1.0)
    acc *= tl.load(w_scale_ptr + offs_n, mask=n_ok, other=1.0)[:, None] * sx[None, :]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def tma_skinny(xq, sx, weight, cfg: Fp8SkinnyConfig, out_dtype=torch.bfloat16):
    m, k = xq.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    k_per_split, split_k = split_k_layout(k, cfg.split_k, cfg.block_k)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=xq.device) if split_k > 1 else out
    w_desc = TensorDescriptor.from_tensor(weight.weight, [cfg.block_n, cfg.block_k])
    x_desc = TensorDescriptor.from_tensor(xq, [block_m, cfg.block_k])
    _tma_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x_desc, sx, w_desc, weight.scale, out, part, m, n, k, k_per_split, out.stride(0), part.stride(0),
        SPLIT=split_k > 1, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, **launch_options(xq.device))
    if split_k > 1:
        reduce_split_k(part, None, out)
    return out


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def check_cpu():
    gen = torch.Generator().manual_seed(0)
    for m in (1, 5):
        for (n, k), cfg in [((96, 256), Fp8SkinnyConfig(block_n=64, block_k=128, split_k=1, num_stages=2)),
                            ((64, 512), Fp8SkinnyConfig(block_n=32, block_k=128, split_k=2, num_stages=2))]:
            w = quantize_weight_fp8(torch.randn(n, k, generator=gen) / k**0.5)
            x = torch.randn(m, k, generator=gen)
            xq, sx = quantize_rows_fp8_triton(x)
            ref = (xq.float() * sx[:, None]) @ (w.weight.float() * w.scale[:, None]).T
            got = tma_skinny(xq, sx, w, cfg, out_dtype=torch.float32)
            print(m, n, k, float((got - ref).abs().max()))


def ptr_call(xq, sx, w, cfg):
    return fp8_skinny_triton(xq, sx, w, None, torch.bfloat16, cfg)


def over_weights(fn, ws, xq, sx, cfg) -> float:
    """Median us per call of fn over CUDA-graph replays, rotating over the weight copies ws."""
    return graph_us(rotating([functools.partial(fn, xq, sx, w, cfg) for w in ws]))


def main():
    if INTERP:
        return check_cpu()
    limit = float(os.environ.get("LIMIT_S", "400"))
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    tma_cfgs = [Fp8SkinnyConfig(block_n=bn, block_k=bk, split_k=s, num_stages=st, num_warps=nw)
                for (bn, bk, st, nw) in [(64, 256, 4, 4), (64, 256, 6, 4), (128, 256, 3, 4), (128, 256, 4, 4),
                                         (128, 128, 6, 4), (256, 128, 4, 8), (64, 128, 8, 4), (128, 256, 4, 8)]
                for s in (1, 2)]
    ptr_cfgs = [Fp8SkinnyConfig(block_n=bn, block_k=256, split_k=s, num_stages=st)
                for (bn, st) in [(64, 5), (128, 3), (64, 4)] for s in (1, 2)]
    for shape, (n, k) in SHAPES.items():
        ws = [quantize_weight_fp8(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
              for _ in range(copies_for(n * k))]
        for m in (1, 16, 64):
            if time.time() - t0 > limit:
                break
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            xq, sx = quantize_rows_fp8_triton(x)
            ref = fp8_skinny_triton(xq, sx, ws[0], None, torch.bfloat16, Fp8SkinnyConfig()).float()
            row = {"table": None, "ptr": {}, "tma": {}}
            tcfg = skinny_config(m, n, k, xq.device)
            if tcfg is not None:
                row["table"] = [str(tcfg), over_weights(ptr_call, ws, xq, sx, tcfg)]
            for c in ptr_cfgs:
                row["ptr"][str(c)] = over_weights(ptr_call, ws, xq, sx, c)
            for c in tma_cfgs:
                try:
                    got = tma_skinny(xq, sx, ws[0], c).float()
                    err = float((got - ref).norm() / ref.norm())
                    if err > 1e-2:
                        row["tma"][str(c)] = f"wrong {err:.3g}"
                        continue
                    row["tma"][str(c)] = over_weights(tma_skinny, ws, xq, sx, c)
                except Exception as exc:  # noqa: BLE001
                    row["tma"][str(c)] = f"{type(exc).__name__}: {str(exc)[:100]}"
            bp = min((v, kk) for kk, v in row["ptr"].items() if isinstance(v, float))
            bt = min(((v, kk) for kk, v in row["tma"].items() if isinstance(v, float)), default=(float("nan"), None))
            row["best_ptr"], row["best_tma"] = bp, bt
            out["rows"][f"{shape}_m{m}"] = row
            print(f"{shape:8s} m={m:3d} table {row['table']} | ptr {bp[0]:6.1f} ({n*k/bp[0]/1e3:.0f} GB/s) {bp[1]} | "
                  f"tma {bt[0]:6.1f} ({n*k/bt[0]/1e3:.0f} GB/s) {bt[1]}  [{time.time()-t0:.0f}s]", flush=True)
            Path(os.environ.get("OUTF", "/tmp/tma.json")).write_text(json.dumps(out, indent=1) + "\n")
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
