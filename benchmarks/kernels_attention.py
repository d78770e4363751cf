"""Decode and prefill attention benchmarks (Llama-3-8B heads: 32 q / 8 kv / 128, block 16, bf16)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kernels_common import (
    COPY_TBPS,
    DEVICE,
    SETTINGS,
    Row,
    bench_us,
    best_of,
    copies_for,
    rel_error,
    rotating,
    sm_count,
    timed,
)

from pdserve.kernels import decode_attention_triton as dec
from pdserve.kernels import prefill_attention_triton as pre

HQ, HKV, DIM, PAGE = 32, 8, 128, 16
SCALE = DIM**-0.5


def _paged_cache(seq_lens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cache with every sequence's blocks scattered over the pool (as after some churn)."""
    width = max(math.ceil(n / PAGE) for n in seq_lens)
    num_blocks = len(seq_lens) * width
    cache = torch.randn(2, num_blocks, PAGE, HKV, DIM, device=DEVICE, dtype=dtype)
    tables = torch.randperm(num_blocks, device=DEVICE).view(len(seq_lens), width).int()
    return cache, tables


def _dense_kv(cache: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, L, D] K and V gathered from the pages (L = table width * PAGE)."""
    batch = tables.shape[0]
    k = cache[0, tables.long()].reshape(batch, -1, HKV, DIM).transpose(1, 2)
    v = cache[1, tables.long()].reshape(batch, -1, HKV, DIM).transpose(1, 2)
    return k, v


def _torch_decode(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    k, v = _dense_kv(cache, tables)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=SCALE, enable_gqa=True)[:, :, 0]


def _decode_setup(batch: int, context: int, dtype: torch.dtype):
    cache, tables = _paged_cache([context] * batch, dtype)
    kv_bytes = 2 * batch * context * HKV * DIM * cache.element_size()
    sets = []
    for _ in range(copies_for(kv_bytes)):
        cache, tables = _paged_cache([context] * batch, dtype)
        q = torch.randn(batch, HQ, DIM, device=DEVICE, dtype=dtype)
        sets.append((q, cache, torch.full((batch,), context, device=DEVICE, dtype=torch.int32), tables))
    return sets, kv_bytes + 2 * batch * HQ * DIM * cache.element_size()


def decode_rows(shapes: list[tuple[int, int]]) -> list[Row]:
    dtype, rows = SETTINGS.dtype, []
    for batch, context in shapes:
        sets, nbytes = _decode_setup(batch, context, dtype)
        q, cache, lens, tables = sets[0]
        err = rel_error(dec.decode_attention_triton(q, cache, lens, tables, SCALE), _torch_decode(q, cache, tables))
        splits = dec.num_splits_for(batch, HKV, tables.shape[1] * PAGE, sm_count())
        target = batch == 32 and context == 4096
        row = Row("decode_attn", f"B{batch} ctx{context} splits{splits}", 0, "gather+SDPA", 0, bytes=nbytes,
                  rel_err=err, target=">=80% copy bw" if target else "")
        rows.append(timed(row, rotating([lambda s=s: dec.decode_attention_triton(*s, SCALE) for s in sets]),
                          rotating([lambda s=s: _torch_decode(s[0], s[1], s[3]) for s in sets]),
                          (lambda r, us: r.pct(us) >= 80) if target else None))
        del sets
    return rows


def decode_sweep(shapes: list[tuple[int, int]]) -> dict:
    """Split counts x tiles, per shape: which the heuristic should pick."""
    dtype = SETTINGS.dtype
    out = {}
    configs = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 8, 3), (32, 4, 4)]
    for batch, context in shapes:
        sets, nbytes = _decode_setup(batch, context, dtype)
        variants = {}
        for splits in (1, 2, 4, 8, 16):
            for cfg in configs:
                calls = [lambda s=s, n=splits, c=cfg: dec._launch(*s, SCALE, num_splits=n, config=c) for s in sets]
                variants[f"splits{splits} n{cfg[0]} w{cfg[1]} s{cfg[2]}"] = rotating(calls)
        best, us, times = best_of(variants, graph=True)
        out[f"B{batch} ctx{context}"] = {"best": best, "best_tbps": nbytes / (us * 1e-6) / 1e12, "times_us": times}
        print(f"decode sweep B{batch} ctx{context}: best {best} {us:.1f} us "
              f"({nbytes / (us * 1e-6) / 1e12:.2f} TB/s, {100 * nbytes / (us * 1e-6) / 1e12 / COPY_TBPS:.0f}%)", flush=True)
        del sets
    return out


def _prefill_setup(chunks: list[tuple[int, int]], dtype: torch.dtype):
    seq_lens = [q_len + prefix for q_len, prefix in chunks]
    cache, tables = _paged_cache(seq_lens, dtype)
    cu = torch.tensor([0] + [q for q, _ in chunks], device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), HQ, DIM, device=DEVICE, dtype=dtype)
    lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32)
    pairs = sum(q_len * prefix + q_len * (q_len + 1) / 2 for q_len, prefix in chunks)
    return (q, cache, cu, lens, tables), 4 * DIM * HQ * pairs


def _sdpa_baseline(args) -> tuple:
    """The faster of SDPA with enable_gqa and SDPA on K/V expanded to 32 heads (expansion not timed), on dense
    contiguous K/V -> (its closure, its output, its label)."""
    q, cache, _, lens, tables = args
    k, v = _dense_kv(cache, tables)
    length = int(lens[0])
    k, v = k[:, :, :length].contiguous(), v[:, :, :length].contiguous()
    qd = q.transpose(0, 1)[None]  # [1, Hq, T, D]
    ke, ve = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    gqa = lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    expanded = lambda: F.scaled_dot_product_attention(qd, ke, ve, is_causal=True, scale=SCALE)
    ref = expanded()[0].transpose(0, 1)
    if bench_us(gqa) <= bench_us(expanded):
        return gqa, ref, "SDPA(gqa)"
    return expanded, ref, "SDPA(expanded kv)"


def prefill_rows(cases: dict[str, list[tuple[int, int]]]) -> list[Row]:
    dtype, rows = SETTINGS.dtype, []
    for name, chunks in cases.items():
        args, flops = _prefill_setup(chunks, dtype)
        out = pre.prefill_attention_triton(*args, SCALE)
        base_fn, err, label = None, math.nan, "n/a (prefix/varlen)"
        if len(chunks) == 1 and chunks[0][1] == 0:
            base_fn, ref, label = _sdpa_baseline(args)
            err = rel_error(out, ref)
        target = name == "1x4096"
        row = Row("prefill_attn", name, 0, label, math.nan, flops=flops, rel_err=err,
                  target=">= SDPA TFLOP/s" if target else "")
        timed(row, lambda args=args: pre.prefill_attention_triton(*args, SCALE), base_fn,
              (lambda r, us: us <= (r.baseline_us if us == r.triton_us else r.baseline_graph_us)) if target else None)
        rows.append(row)
    return rows


def prefill_sweep(cases: dict[str, list[tuple[int, int]]]) -> dict:
    dtype = SETTINGS.dtype
    out = {}
    configs = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4),
               (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 4, 4), (64, 32, 4, 3)]
    for name, chunks in cases.items():
        args, flops = _prefill_setup(chunks, dtype)
        variants = {f"m{c[0]} n{c[1]} w{c[2]} s{c[3]}": (lambda c=c, a=args: pre._launch(*a, SCALE, config=c)) for c in configs}
        best, us, times = best_of(variants, rep_ms=40)
        out[name] = {"best": best, "best_tflops": flops / (us * 1e-6) / 1e12, "times_us": times}
        print(f"prefill sweep {name}: best {best} {us:.1f} us ({flops / (us * 1e-6) / 1e12:.0f} TFLOP/s)", flush=True)
    return out
