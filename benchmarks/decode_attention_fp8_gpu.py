"""Decode attention alone, fp8 KV cache (e4m3, K/V scales 0.5/2) against bf16, llama3-8b heads (32 q, 8 kv, dim
128, page 16), at issue 19's row (batch 64, context 4,096) and at batch 64 context 512, batch 1 context 4,096:
every variant of the fp8 path (kernels/decode_attention_triton.py VARIANTS) x its tiles (BLOCK_N, warps, stages),
the bf16 cache's default beside in the same run. Each row is checked against the plain-torch reference before
it is timed; a row that fails (error or compile) is recorded, not timed, and never the best.

Time: one layer's call, the mean of a CUDA graph of >= 16 calls replayed 10 times (median replay), so launch
overhead is out. Shapes whose cache fits in L2 (50 MB) cycle over copies of it (>= 256 MB in all), as the 32
layers of a step do. The b64 shapes run unsplit (num_splits_for: 512 programs), b1 with 16 splits; --splits
adds rows at other split counts (each tile at each), --tiles narrows the tiles. --plan adds the launcher's own
choice ("plan"), the same with split partials summed by the reduce kernel ("plan-reduce", COMBINE_IN_SPLITS off)
and bf16's default tile both ways ("dot-reduce", "dot-combine").

    python benchmarks/decode_attention_fp8_gpu.py --out benchmarks/results/decode_attention_fp8_h200.json
--warm I/N compiles part I of N of the kernels on a small shape of the same specialization, into Triton's cache
(the sweep script runs N of these at once, so the sweep itself compiles nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from pdserve.kernels import decode_attention_sum_triton as sums
from pdserve.kernels.decode_attention import decode_attention_ref
from pdserve.kernels.decode_attention_triton import VARIANTS, _launch, fp8_plan

Q_HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
K_SCALE, V_SCALE = 0.5, 2.0
SHAPES = (("b64_ctx4096", 64, 4096), ("b64_ctx512", 64, 512), ("b1_ctx4096", 1, 4096))
DOT_TILES = ((128, 4, 3), (128, 4, 2), (128, 4, 1), (64, 4, 3), (64, 4, 2), (64, 2, 2), (256, 4, 2), (128, 8, 2),
             (128, 8, 3), (64, 2, 1), (64, 4, 1), (128, 2, 1), (128, 8, 1), (256, 8, 1), (256, 4, 1))
FMA_TILES = ((16, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (32, 8, 2), (16, 2, 2), (32, 2, 3))
BF16_TILES = [(64, 4, 3), (128, 4, 3)]  # --bf16-tiles replaces them
L2_COPIES_BYTES = 256 << 20


SWEPT = list(VARIANTS)  # --variants narrows it


SPLITS: list[int | None] = [None]  # --splits: None is num_splits_for's choice
TILES: list[tuple[int, int, int]] = []  # --tiles narrows the tiles of every variant


def candidates() -> list[tuple[str, tuple[int, int, int]]]:
    return [(v, t) for v in SWEPT for t in (TILES or (FMA_TILES if v.startswith("fma") else DOT_TILES))]


def make_shape(batch: int, context: int, device: torch.device, copies: int | None = None) -> dict:
    torch.manual_seed(0)
    per_seq = context // PAGE + 1
    blocks = batch * per_seq
    q = torch.randn(batch, Q_HEADS, DIM, device=device, dtype=torch.bfloat16)
    one = blocks * PAGE * KV_HEADS * DIM * 2  # fp8 bytes of one copy
    copies = copies or max(1, math.ceil(L2_COPIES_BYTES / one))
    bf16 = [torch.randn(2, blocks, PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    fp8 = [torch.stack([(c[0] * 3 / K_SCALE).clamp(-448, 448), (c[1] * 3 / V_SCALE).clamp(-448, 448)])
           .to(torch.float8_e4m3fn) for c in bf16]
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(batch, per_seq)  # scattered pages
    lens = torch.full((batch,), context + 1, device=device, dtype=torch.int32)
    return {"q": q, "bf16": bf16, "fp8": fp8, "tables": tables, "lens": lens, "batch": batch, "context": context}


def graph_ms(call, caches: list[torch.Tensor]) -> float:
    """Mean ms of one call: a CUDA graph of n >= 16 calls cycling over caches, median of 10 replays / n."""
    n = max(16, len(caches))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in caches[:3]:
            call(c)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            call(caches[i % len(caches)])
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return statistics.median(times)


def row(shape: dict, kind: str, variant: str, tile: tuple[int, int, int], check: bool = True,
        splits: int | None = None) -> dict:
    q, tables, lens = shape["q"], shape["tables"], shape["lens"]
    scale = DIM ** -0.5
    ks, vs = (K_SCALE, V_SCALE) if kind == "fp8" else (1.0, 1.0)
    caches = shape[kind]

    def call(kv):
        if variant == "plan":  # the launcher's own choice (fp8_plan for an fp8 cache)
            return _launch(q, kv, lens, tables, scale, k_scale=ks, v_scale=vs)
        return _launch(q, kv, lens, tables, scale, num_splits=splits, config=tile, k_scale=ks, v_scale=vs,
                       variant=variant)

    out = {"kind": kind, "variant": variant, "tile": "x".join(map(str, tile)), "splits": splits or "auto"}
    try:
        if check:
            if ("ref", kind) not in shape:  # once per shape and cache
                shape["ref", kind] = decode_attention_ref(q, caches[0], lens, tables, scale, ks, vs).float()
            ref = shape["ref", kind]
            err = float((call(caches[0]).float() - ref).abs().max()) / max(1.0, float(ref.abs().max()))
            out["rel_err"] = err
            out["ok"] = err <= 2e-2
            if not out["ok"]:
                return out
        ms = graph_ms(call, caches)
        kv_bytes = shape["batch"] * (shape["context"] + 1) * KV_HEADS * DIM * 2 * caches[0].element_size()
        out.update(ms=ms, kv_tb_per_s=kv_bytes / ms / 1e9, ok=out.get("ok", True))
    except Exception as exc:  # noqa: BLE001 -- a tile that does not compile (smem, registers) is a result too
        out.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    return out


def warm(part: int, parts: int) -> None:
    """Compile this part's share of the kernels on a small shape with the sweep's specialization (dims,
    strides' divisibility, dtypes), unsplit, 16-split and at each --splits, into Triton's on-disk cache."""
    device = torch.device("cuda")
    shape = make_shape(2, 64, device, copies=1)
    jobs = [("fp8", v, t) for v, t in candidates()] + [("bf16", "dot", t) for t in BF16_TILES]
    for kind, variant, tile in jobs[part::parts]:
        for splits in sorted({1, 16} | {s for s in SPLITS if s}):
            try:
                _launch(shape["q"], shape[kind][0], shape["lens"], shape["tables"], 0.1, num_splits=splits,
                        config=tile, variant=variant)
            except Exception as exc:  # noqa: BLE001 -- the sweep records it again, as its row
                print("warm", kind, variant, tile, type(exc).__name__, str(exc)[:120], flush=True)
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_attention_fp8_h200.json"))
    parser.add_argument("--warm", default=None, help="I/N: compile part I of N and exit")
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop timing new rows after this")
    parser.add_argument("--variants", default="", help="comma-separated: only these of VARIANTS (default all)")
    parser.add_argument("--tiles", default="", help="comma-separated BLOCK_NxWARPSxSTAGES: only these tiles")
    parser.add_argument("--shapes", default="", help="comma-separated bB_ctxC (default: " +
                        ",".join(n for n, _, _ in SHAPES) + ")")
    parser.add_argument("--bf16-tiles", default="", help="comma-separated BLOCK_NxWARPSxSTAGES: the bf16 cache's "
                        "tiles (default 64x4x3,128x4x3)")
    parser.add_argument("--plan", action="store_true", help="add each shape's row with the launcher's default plan")
    parser.add_argument("--splits", default="auto",
                        help="comma-separated split counts each row also runs with ('auto': num_splits_for's)")
    args = parser.parse_args()
    TILES[:] = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",") if t]
    if args.bf16_tiles:
        BF16_TILES[:] = [tuple(int(x) for x in t.split("x")) for t in args.bf16_tiles.split(",")]
    SPLITS[:] = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    if args.variants:
        bad = set(args.variants.split(",")) - set(VARIANTS)
        if bad:
            parser.error(f"--variants {sorted(bad)} not in {VARIANTS}")
        SWEPT[:] = args.variants.split(",")
    if args.warm:
        part, parts = map(int, args.warm.split("/"))
        warm(part, parts)
        return 0
    t0 = time.monotonic()
    device = torch.device("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "heads": {"q": Q_HEADS, "kv": KV_HEADS, "dim": DIM, "page": PAGE},
              "timing": "CUDA graph mean per call", "shapes": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    shapes = [(n, int(n[1:n.index("_")]), int(n.split("ctx")[1])) for n in args.shapes.split(",")] if args.shapes \
        else SHAPES
    for i, (name, batch, context) in enumerate(shapes):
        shape = make_shape(batch, context, device)
        rows = [row(shape, "bf16", "dot", t, splits=s) for t in BF16_TILES for s in SPLITS]
        for (variant, tile), splits in itertools.product(candidates(), SPLITS):
            if time.monotonic() - t0 > args.budget_s * (i + 1) / len(shapes):  # each shape its share
                rows.append({"kind": "fp8", "variant": variant, "tile": "x".join(map(str, tile)), "ok": False,
                             "error": "budget"})
                continue
            rows.append(row(shape, "fp8", variant, tile, splits=splits))
        if args.plan:  # the default plan's row, its splits and tile named; then with split attention's
            splits, tile = fp8_plan(batch, KV_HEADS, shape["tables"].shape[1] * PAGE, sm_count)
            rows.append({**row(shape, "fp8", "plan", tile), "splits": splits})
            try:  # reduce kernel instead of the last program's sum (COMBINE_IN_SPLITS off): its A/B, bf16's too
                sums.COMBINE_IN_SPLITS = False
                rows.append({**row(shape, "fp8", "plan", tile), "splits": splits, "variant": "plan-reduce"})
                rows.append({**row(shape, "bf16", "dot", BF16_TILES[0]), "variant": "dot-reduce"})
            finally:
                sums.COMBINE_IN_SPLITS = True
            rows.append({**row(shape, "bf16", "dot", BF16_TILES[0]), "variant": "dot-combine"})
        report["shapes"][name] = {"batch": batch, "context": context, "copies": len(shape["fp8"]),
                                  "best": summarize(name, rows), "rows": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each shape: a later failure keeps it
        del shape
        torch.cuda.empty_cache()
    return 0


def summarize(name: str, rows: list[dict]) -> dict:
    """Prints the shape's table; returns the best bf16 and fp8 rows and fp8's speedup."""
    timed = [r for r in rows if r.get("ok") and "ms" in r]
    bf16 = min((r for r in timed if r["kind"] == "bf16"), key=lambda r: r["ms"], default=None)
    fp8 = min((r for r in timed if r["kind"] == "fp8"), key=lambda r: r["ms"], default=None)
    base = bf16["ms"] if bf16 else float("nan")
    print(f"== {name}: bf16 best {base * 1e3:.1f} us ({bf16 and bf16['tile']}, splits {bf16 and bf16['splits']}); "
          "fp8 best tile per variant:")
    for variant in SWEPT:
        mine = [r for r in timed if r["kind"] == "fp8" and r["variant"] == variant]
        bad = sum(1 for r in rows if r["kind"] == "fp8" and r["variant"] == variant and not r.get("ok"))
        if not mine:
            print(f"   {variant:14s} none timed ({bad} failed)")
            continue
        best = min(mine, key=lambda r: r["ms"])
        print(f"   {variant:14s} {best['tile']:9s} {best['ms'] * 1e3:7.1f} us {best['kv_tb_per_s']:5.2f} TB/s "
              f"splits {best['splits']} "
              f"x{base / best['ms']:.2f} vs bf16  ({bad} failed)")
    for r in rows:
        if not r.get("ok") and r.get("error") not in (None, "budget"):
            print("   failed:", r["variant"], r["tile"], r.get("error", f"rel_err {r.get('rel_err')}")[:150])
        elif not r.get("ok") and "rel_err" in r:
            print("   wrong:", r["variant"], r["tile"], "rel_err", r["rel_err"])
    for r in timed:
        if r["variant"] in ("plan", "plan-reduce", "dot-reduce", "dot-combine"):
            print(f"   {r['variant']}: {r['tile']} splits {r['splits']} {r['ms'] * 1e3:.1f} us x{base / r['ms']:.2f} "
                  "vs bf16")
    if len(SPLITS) > 1:
        for splits in SPLITS:
            at = [r for r in timed if r["splits"] == (splits or "auto")]
            print(f"   splits {splits or 'auto'}: " + ", ".join(
                f"{kind} {r['tile']} {r['ms'] * 1e3:.1f} us" for kind in ("bf16", "fp8")
                for r in [min((r for r in at if r["kind"] == kind), key=lambda r: r["ms"], default=None)] if r))
    if fp8:
        print(f"   best fp8: {fp8['variant']} {fp8['tile']} {fp8['ms'] * 1e3:.1f} us, x{base / fp8['ms']:.2f} vs bf16")
    print(flush=True)
    return {"bf16": bf16, "fp8": fp8, "fp8_speedup": base / fp8["ms"] if fp8 else None}


if __name__ == "__main__":
    raise SystemExit(main())
