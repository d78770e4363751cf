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
    best_of,
    copies_for,
    device_name,
    graph_us,
    rel_error,
    rotating,
    timed,
)

from pdserve.kernels.linear_triton import GemvConfig, choose_config, gemv_triton, heuristic_config
from pdserve.kernels.tuning import BATCH_BUCKETS, TuningTable, default_table

TARGET_SHAPES = {"mlp_up 4096->14336": (14336, 4096), "mlp_down 14336->4096": (4096, 14336)}
OTHER_SHAPES = {"qkv 4096->6144": (6144, 4096), "o_proj 4096->4096": (4096, 4096),
                "gate_up 4096->28672": (28672, 4096), "lm_head 4096->128256": (128256, 4096)}


def candidate_configs() -> list[GemvConfig]:
    """The space the first H200 sweep (2026-11-29, 36 configs) narrowed to: 4 warps, BLOCK_K <= 256 won."""
    out = []
    for bn in (16, 32, 64):
        for bk in (128, 256):
            for stages in (3, 4, 6):
                out.append(GemvConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=stages))
    return out


def _splits(n: int, block_n: int) -> list[int]:
    programs = triton.cdiv(n, block_n)
    return [s for s in (1, 2, 4) if s == 1 or programs * s <= 8 * 132]


def _weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5 for _ in range(copies_for(n * k * 2))]


def _key(cfg: GemvConfig) -> str:
    fma = "" if cfg.use_dot else " fma"
    return f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}{fma}"


def tune_shape(n: int, k: int, m: int, configs: list[GemvConfig], weights: list[torch.Tensor]) -> dict:
    x = torch.randn(m, k, device=DEVICE, dtype=weights[0].dtype)
    if m == 1:  # fp32-FMA path (no tensor cores, no cp.async pipeline): does it win anywhere?
        configs = configs + [GemvConfig(block_n=16, block_k=512, use_dot=False), GemvConfig(block_n=32, block_k=256, use_dot=False)]
    variants = {}
    for cfg in configs:
        for split in _splits(n, cfg.block_n):
            c = GemvConfig(**{**cfg.__dict__, "split_k": split})
            variants[_key(c)] = (c, rotating([lambda w=w, c=c: gemv_triton(x, w, None, c) for w in weights]))
    # ranked by graph replay: decode runs captured, back to back, and do_bench's memset flush adds the same
    # ~12 us of dirty-L2 write-back to every variant (measured on the H200, 2026-11-29)
    best, us, times = best_of({name: fn for name, (_, fn) in variants.items()}, graph=True)
    torch_us = graph_us(rotating([lambda w=w: F.linear(x, w) for w in weights]))
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
                choose_config.cache_clear()
    return table


def _dedupe(configs: list[GemvConfig]) -> list[GemvConfig]:
    return list(dict.fromkeys(configs))


def gemv_rows() -> list[Row]:
    """Triton with the tuned (or heuristic) config vs F.linear, per shape and batch; the dispatcher's pick noted."""
    dtype, rows = SETTINGS.dtype, []
    device = device_name()
    for name, (n, k) in {**TARGET_SHAPES, **OTHER_SHAPES}.items():
        weights = _weights(n, k, dtype)
        for m in BATCH_BUCKETS:
            x = torch.randn(m, k, device=DEVICE, dtype=dtype)
            entry = default_table().lookup(device, dtype, n, k, m)
            cfg = GemvConfig(**entry["config"]) if entry else heuristic_config(m, n, k, dtype)
            dispatch = "torch" if choose_config(m, n, k, dtype, x.device) is None else "triton"
            err = rel_error(gemv_triton(x, weights[0], None, cfg), F.linear(x, weights[0]))
            target = name in TARGET_SHAPES and m <= 8
            row = Row("gemv", f"{name} M{m}", 0, "torch.matmul", 0, bytes=2 * (n * k + m * k + m * n), rel_err=err,
                      target=">=3.4 TB/s & >=1.35x" if target else "", extra={"config": cfg.__dict__, "dispatch": dispatch})
            rows.append(timed(row, rotating([lambda w=w, x=x, c=cfg: gemv_triton(x, w, None, c) for w in weights]),
                              rotating([lambda w=w, x=x: F.linear(x, w) for w in weights]), _gemv_check if target else None))
        del weights
    return rows


def _gemv_check(row: Row, us: float) -> bool:
    base = row.baseline_us if us == row.triton_us else row.baseline_graph_us
    return row.rate(us) >= 3.4 and base / us >= 1.35
