# ruff: noqa: C408  (keyword dicts name the case's tensors)
"""Issue 23 item 3: torch SDPA (FlashAttention, cuDNN, memory-efficient) against our prefill attention, per
shape class, and the table entry the measurements imply (kernels/prefill_attention.py reads it).

    OUT=/some/dir python benchmarks/prefill_attention_sdpa.py [--quick] [--engine]
    python benchmarks/prefill_attention_sdpa.py --dry-run        # CPU check of the script (interpreter)

Llama-3-8B heads (32 q / 8 kv, d 128), bf16, pages of 16. Classes:
    prompt L          one new prompt: ours over the pages vs prefill_attention_sdpa on the q/k/v views of a
                      fused qkv buffer (what the model passes), per SDPA backend
    prompts n x L     n new prompts packed: ours in one launch vs SDPA one call per prompt (the dispatch's loop)
    prefix P + L      L new tokens after P cached: ours vs, for reference only, gathering the sequence's K/V
                      out of the pages + SDPA with a lower-right causal mask (flash)
Each output is checked against prefill_attention_ref (fp32 math) up to 8,192 tokens a sequence. Times are
triton.testing.do_bench medians (CUDA events, L2 flushed before each call); `first_ms` is a backend's first
call in the case, which at a length it has not run before includes cuDNN's per-shape execution plan. --engine times the whole
dummy llama3-8b prefill of 1 x 4,096 tokens through ModelRunner, ours everywhere vs the proposed entry
(target <= 95 ms). Writes prefill_attention_sdpa.json and, where SDPA wins somewhere,
prefill_attention_configs.json (copy it to kernels/ to use it) to $OUT, else to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import time
from pathlib import Path

import torch
import triton
from kernels_common import SETTINGS, bench_us, rel_error

from pdserve.kernels import prefill_attention_triton as pre
from pdserve.kernels.prefill_attention import SDPA_BACKENDS, prefill_attention_ref, prefill_attention_sdpa
from pdserve.kernels.tuning import prefill_key

HQ, HKV, DIM, PAGE = 32, 8, 128, 16
SCALE = DIM**-0.5
CANDIDATES = ("flash", "cudnn", "efficient")
FULL = {
    "prompt": [[(n, 0)] for n in (256, 512, 1024, 2048, 4096, 8192)],
    "prompts": [[(512, 0)] * 8, [(1024, 0)] * 4, [(2048, 0)] * 2, [(128, 0)] * 32, [(4096, 0)] * 2],
    "prefix": [[(1024, 3072)], [(2048, 2048)], [(512, 3584)], [(4096, 4096)], [(256, 1024)] * 8],
}
QUICK = {"prompt": [[(1024, 0)], [(4096, 0)]], "prompts": [[(1024, 0)] * 4], "prefix": [[(1024, 3072)]]}
DRY = {"prompt": [[(40, 0)]], "prompts": [[(20, 0)] * 2], "prefix": [[(16, 24)]]}


def build(chunks: list[tuple[int, int]], device: str, dtype: torch.dtype) -> dict:
    """q/k/v as views of a fused qkv buffer; every sequence's K/V (prefix random, chunk = k/v) in scattered pages."""
    q_lens = [q for q, _ in chunks]
    seq_lens = [q + p for q, p in chunks]
    tokens = sum(q_lens)
    qkv = torch.randn(tokens, HQ + 2 * HKV, DIM, device=device, dtype=dtype)
    q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
    width = max(-(-n // PAGE) for n in seq_lens)
    pool = len(chunks) * width
    cache = torch.randn(2, pool, PAGE, HKV, DIM, device=device, dtype=dtype)
    tables = torch.randperm(pool, device=device).view(len(chunks), width).int()
    flat = cache.view(2, pool * PAGE, HKV, DIM)
    start = 0
    for i, (q_len, prefix) in enumerate(chunks):
        pos = torch.arange(prefix, prefix + q_len, device=device)
        slots = tables[i, pos // PAGE].long() * PAGE + pos % PAGE
        flat[0, slots], flat[1, slots] = k[start:start + q_len], v[start:start + q_len]
        start += q_len
    cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, device=device, dtype=torch.int32)
    pairs = sum(q * p + q * (q + 1) / 2 for q, p in chunks)
    return dict(q=q, k=k, v=v, cache=cache, cu=cu, lens=lens, tables=tables, q_lens=tuple(q_lens),
                chunks=chunks, flops=4 * DIM * HQ * pairs)


def gather_sdpa(case: dict, backend: str) -> torch.Tensor:
    """Reference point for a prefix: each sequence's K/V gathered out of the pages, then SDPA (lower-right
    causal: query j of L sits at position P + j)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    out = torch.empty_like(case["q"])
    start = 0
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        for i, (q_len, prefix) in enumerate(case["chunks"]):
            blocks = case["tables"][i, : -(-(q_len + prefix) // PAGE)].long()
            kv = case["cache"][:, blocks].reshape(2, -1, HKV, DIM)[:, : q_len + prefix]
            qs = case["q"][start:start + q_len].transpose(0, 1)[None]
            ks, vs = (t.transpose(0, 1)[None] for t in kv)
            mask = causal_lower_right(q_len, q_len + prefix)
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=SCALE,
                                                                 enable_gqa=True)
            out[start:start + q_len] = o[0].transpose(0, 1)
            start += q_len
    return out


def candidates(case: dict) -> dict:
    c = case
    out = {"ours": lambda: pre.prefill_attention_triton(c["q"], c["cache"], c["cu"], c["lens"], c["tables"], SCALE)}
    uncached = all(p == 0 for _, p in c["chunks"])
    for backend in CANDIDATES:
        if uncached:
            out[f"sdpa_{backend}"] = lambda b=backend: prefill_attention_sdpa(c["q"], c["k"], c["v"], c["q_lens"],
                                                                              SCALE, b)
        elif backend == "flash":
            out["gather+sdpa_flash"] = lambda: gather_sdpa(c, "flash")
    return out


def first_call_ms(fn) -> float:
    if SETTINGS.dry_run:
        return math.nan
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def measure(cls: str, chunks: list[tuple[int, int]], device: str, dtype: torch.dtype) -> dict:
    case = build(chunks, device, dtype)
    label = " + ".join(f"{n}x{q}" + (f"@{p}" if p else "") for (q, p), n in _runs(chunks))
    ref = None
    if max(q + p for q, p in chunks) <= 8192:
        ref = prefill_attention_ref(case["q"], case["cache"], case["cu"], case["lens"], case["tables"], SCALE)
    row = {"class": cls, "case": label, "chunks": chunks, "tokens": sum(case["q_lens"]), "flops": case["flops"],
           "times_us": {}, "tflops": {}, "rel_err": {}, "first_ms": {}, "errors": {}}
    ours_out = None
    for name, fn in candidates(case).items():
        try:
            first = first_call_ms(fn) if name != "ours" else math.nan
            out = fn()
            us = bench_us(fn, rep_ms=40)
        except Exception as exc:  # noqa: BLE001 -- a backend this device / dtype / GQA does not offer
            row["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        if name == "ours":
            ours_out = out
        against = ref if ref is not None else ours_out
        row["rel_err"][name] = rel_error(out, against) if against is not None else math.nan
        row["times_us"][name], row["first_ms"][name] = us, first
        row["tflops"][name] = case["flops"] / (us * 1e-6) / 1e12
    del case
    return row


def _runs(chunks: list[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    runs: list[tuple[tuple[int, int], int]] = []
    for chunk in chunks:
        if runs and runs[-1][0] == chunk:
            runs[-1] = (chunk, runs[-1][1] + 1)
        else:
            runs.append((chunk, 1))
    return runs


def _fast(row: dict, name: str, limit: float = 2e-2) -> float:
    """name's time where its output checked out (else inf)."""
    ok = row["rel_err"].get(name, math.inf) <= limit
    return row["times_us"].get(name, math.inf) if ok else math.inf


def propose(rows: list[dict]) -> dict | None:
    """The SDPA backend and the shortest prompt from which it beats ours at that and every longer measured
    length, then the most packed prompts (each that long) for which SDPA's loop still wins."""
    singles = sorted((r for r in rows if r["class"] == "prompt"), key=lambda r: r["tokens"])
    best = None
    for backend in CANDIDATES:
        name, start = f"sdpa_{backend}", None
        for r in reversed(singles):
            if _fast(r, name) >= _fast(r, "ours"):
                break
            start = r["tokens"]
        if start is not None and (best is None or start < best[1]):
            best = (backend, start)
    if best is None:
        return None
    backend, min_tokens = best
    name, max_seqs = f"sdpa_{backend}", 1
    for r in rows:
        n = len(r["chunks"])
        if r["class"] == "prompts" and min(q for q, _ in r["chunks"]) >= min_tokens and _fast(r, name) < _fast(r, "ours"):
            max_seqs = max(max_seqs, n)
    return {"backend": backend, "min_tokens": min_tokens, "max_seqs": max_seqs,
            "measured": {r["case"]: {"ours_us": r["times_us"].get("ours"), "sdpa_us": r["times_us"].get(name)}
                         for r in rows if name in r["times_us"]}}


def engine_prefill(entry: dict | None, tokens: int = 4096) -> dict:
    """ms of ModelRunner.prefill of one new prompt on dummy llama3-8b (bf16): ours everywhere vs `entry`."""
    from pdserve.engine.attention_metadata import PrefillChunk
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.presets import get_preset
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.weights.dummy import dummy_weights

    config = get_preset("llama3-8b")
    runner = ModelRunner(config, CacheConfig(num_blocks=tokens // PAGE + 16, block_size=PAGE),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16, max_num_seqs=1,
                         enforce_eager=True)
    dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")
    chunk = [PrefillChunk([(7 * j + 3) % config.vocab_size for j in range(tokens)], 0, list(range(tokens // PAGE)))]
    result = {}
    for name, choice in (("ours", None), ("proposed", entry)):
        if name == "proposed" and entry is None:
            continue
        saved, dispatcher.sdpa_entry = dispatcher.sdpa_entry, (lambda *args, e=choice: e)
        try:
            for _ in range(2):
                runner.prefill(chunk)
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runner.prefill(chunk)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        finally:
            dispatcher.sdpa_entry = saved
        result[name] = {"median_ms": sorted(times)[2], "times_ms": times}
    return result


def table_text(rows: list[dict]) -> str:
    names = ["ours", *(f"sdpa_{b}" for b in CANDIDATES), "gather+sdpa_flash"]
    head = f"{'class':8s} {'case':22s} " + " ".join(f"{n:>17s}" for n in names) + "   (us / TFLOP/s; x: failed)"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for n in names:
            if n in r["times_us"]:
                bad = "!" if r["rel_err"][n] > 2e-2 else " "
                cells.append(f"{r['times_us'][n]:9.1f}/{r['tflops'][n]:5.0f}{bad} ")
            else:
                cells.append(f"{'x' if n in r['errors'] else '-':>17s}")
        lines.append(f"{r['class']:8s} {r['case']:22s} " + " ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two prompt lengths, one packed, one prefix case")
    parser.add_argument("--engine", action="store_true", help="also the whole llama3-8b prefill of 4,096 tokens")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter): the script only")
    args = parser.parse_args()
    SETTINGS.dry_run = args.dry_run
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cases = DRY if args.dry_run else QUICK if args.quick else FULL
    rows = []
    for cls, batches in cases.items():
        for chunks in batches:
            rows.append(measure(cls, chunks, device, dtype))
            r = rows[-1]
            print(f"{cls} {r['case']}: " + ", ".join(f"{k} {v:.1f} us" for k, v in r["times_us"].items())
                  + (f"; failed: {sorted(r['errors'])}" if r["errors"] else ""), flush=True)
    entry = propose(rows)
    name = "dry-run" if args.dry_run else torch.cuda.get_device_name()
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "rows": rows, "proposal": entry,
              "command": "python benchmarks/prefill_attention_sdpa.py" + (" --quick" if args.quick else "")}
    if args.engine and not args.dry_run:
        result["engine_prefill_4096"] = engine_prefill(entry)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefill_attention_sdpa.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if entry is not None:
        table = {"version": 1, "entries": {prefill_key(name, dtype, HQ, HKV, DIM): {
            **entry, "date": result["date"], "command": result["command"]}}}
        (out_dir / "prefill_attention_configs.json").write_text(json.dumps(table, indent=1) + "\n")
    print(table_text(rows))
    shown = {k: v for k, v in entry.items() if k != "measured"} if entry else "ours everywhere (SDPA never faster)"
    print(f"proposal: {shown}")
    if "engine_prefill_4096" in result:
        print("engine prefill 1 x 4096:", {k: round(v["median_ms"], 2) for k, v in result["engine_prefill_4096"].items()},
              "ms (target <= 95)")


if __name__ == "__main__":
    main()
