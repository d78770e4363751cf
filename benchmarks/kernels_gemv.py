"""GEMV / skinny-GEMM benchmark and tuner: Triton configs against torch.matmul (cuBLAS), Llama-3-8B shapes."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from kernels_common import (
    DEVICE,
    SETTINGS,
    Row,
    bench_us,
    best_of,
    copies_for,
    device_name,
    rel_error,
    rotating,
)

from pdserve.kernels.linear_triton import GemvConfig, gemv_triton
from pdserve.kernels.tuning import BATCH_BUCKETS, TuningTable, default_table

TARGET_SHAPES = {"mlp_up 4096->14336": (14336, 4096), "mlp_down 14336->4096": (4096, 14336)}
OTHER_SHAPES = {"qkv 4096->6144": (6144, 4096), "o_proj 4096->4096": (4096, 4096),
                "gate_up 4096->28672": (28672, 4096), "lm_head 4096->128256": (128256, 4096)}


def candidate_configs() -> list[GemvConfig]:
    out = []
    for bn in (16, 32, 64):
        for bk in (128, 256, 512):
            for warps, stages in ((4, 3), (4, 4), (8, 4), (4, 6)):
                if (bn + 16) * bk * 2 * stages <= 200_000:  # W and padded-x tiles per stage must fit in smem
                    out.append(GemvConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
    return out


def _splits(n: int, block_n: int) -> list[int]:
    programs = triton.cdiv(n, block_n)
    return [s for s in (1, 2, 4, 8) if s == 1 or programs * s <= 8 * 132]


def _weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5 for _ in range(copies_for(n * k * 2))]


def _key(cfg: GemvConfig) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def tune_shape(n: int, k: int, m: int, configs: list[GemvConfig], weights: list[torch.Tensor]) -> dict:
    x = torch.randn(m, k, device=DEVICE, dtype=weights[0].dtype)
    variants = {}
    for cfg in configs:
        for split in _splits(n, cfg.block_n):
            c = GemvConfig(**{**cfg.__dict__, "split_k": split})
            variants[_key(c)] = (c, rotating([lambda w=w, c=c: gemv_triton(x, w, None, c) for w in weights]))
    best, us, times = best_of({name: fn for name, (_, fn) in variants.items()}, rep_ms=20)
    torch_us = bench_us(rotating([lambda w=w: F.linear(x, w) for w in weights]), rep_ms=20)
    cfg = variants[best][0]
    entry = {"backend": "triton" if us < torch_us else "torch", "config": cfg.__dict__,
             "triton_us": round(us, 2), "torch_us": round(torch_us, 2)}
    ranked = sorted((t, name) for name, t in times.items() if not math.isnan(t))
    print(f"gemv tune N{n} K{k} M{m}: best {best} {us:.1f} us vs torch {torch_us:.1f} us -> {entry['backend']}; "
          f"runners-up {[name for _, name in ranked[1:4]]}", flush=True)
    return entry


def tune(path: Path) -> TuningTable:
    """Full sweep on the target shapes; the other shapes try the configs that won there."""
    dtype = SETTINGS.dtype
    table = TuningTable.load(path)
    device = device_name()
    winners: list[GemvConfig] = []
    for shapes, pool in ((TARGET_SHAPES, None), (OTHER_SHAPES, winners)):
        for n, k in shapes.values():
            weights = _weights(n, k, dtype)
            configs = candidate_configs() if pool is None else _dedupe(pool)
            for m in BATCH_BUCKETS:
                entry = tune_shape(n, k, m, configs, weights)
                table.record(device, dtype, n, k, m, entry)
                if pool is None:
                    winners.append(GemvConfig(**{**entry["config"], "split_k": 1}))
            del weights
            if not SETTINGS.compile_only:  # after every shape, so a run cut short keeps what it measured
                table.save(path)
                default_table().entries.update(table.entries)
    return table


def _dedupe(configs: list[GemvConfig]) -> list[GemvConfig]:
    return list(dict.fromkeys(configs))


def gemv_rows() -> list[Row]:
    """Triton with the tuned (or heuristic) config vs F.linear, per shape and batch; the dispatcher's pick noted."""
    dtype = SETTINGS.dtype
    from pdserve.kernels.linear_triton import choose_config, heuristic_config

    rows = []
    device = device_name()
    for name, (n, k) in {**TARGET_SHAPES, **OTHER_SHAPES}.items():
        weights = _weights(n, k, dtype)
        for m in BATCH_BUCKETS:
            x = torch.randn(m, k, device=DEVICE, dtype=dtype)
            entry = default_table().lookup(device, dtype, n, k, m)
            cfg = GemvConfig(**entry["config"]) if entry else heuristic_config(m, n, k, dtype)
            dispatch = "torch" if choose_config(m, n, k, dtype, x.device) is None else "triton"
            err = rel_error(gemv_triton(x, weights[0], None, cfg), F.linear(x, weights[0]))
            t = bench_us(rotating([lambda w=w, x=x, c=cfg: gemv_triton(x, w, None, c) for w in weights]))
            base = bench_us(rotating([lambda w=w, x=x: F.linear(x, w) for w in weights]))
            target = name in TARGET_SHAPES and m <= 8
            row = Row("gemv", f"{name} M{m}", t, "torch.matmul", base, bytes=2 * (n * k + m * k + m * n),
                      rel_err=err, target=">=3.4 TB/s & >=1.35x" if target else "",
                      extra={"config": cfg.__dict__, "dispatch": dispatch})
            row.target_met = (row.rate(t) >= 3.4 and base / t >= 1.35) if target else None
            rows.append(row)
        del weights
    return rows
