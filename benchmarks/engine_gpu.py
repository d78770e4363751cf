"""Our engine on the GPU beside HF transformers: decode steps (CUDA graphs), a 4,096-token prefill, and the
cuda_ipc KV transfer between two processes against a device copy; correctness is checked before timing.

    python benchmarks/engine_gpu.py --out benchmarks/results/engine_gpu_h200.json   (H200: benchmarks/engine_gpu_h200.sh)
    python benchmarks/engine_gpu.py --device cpu --tiny --out /tmp/engine_gpu_cpu.json   (plumbing, seconds)

Model: `--load-format dummy --model-preset llama3-8b` in bf16 (engine/presets.py, random weights) or, with
--tiny, a 2-layer model of that family. `--quantization none,fp8` (the default) times the same workloads a
second time with fp8 linears (`--quantization fp8`: rows named `<workload>_fp8_w`, e.g. decode_b1_ctx512_fp8_w;
`fp8_w_ms` holds them as `decode_b1_ctx512_fp8_w_ms`), HF only beside bf16. `fp8-unfused` runs the fp8 linears
with the norms and silu_and_mul not quantizing for them (engine/model.py FUSE_FP8_ACTIVATIONS off: each fp8 linear
runs its own quantization kernel), rows `<workload>_fp8_w_unfused`: the A/B of that fusion. `-nopdl` runs without
programmatic dependent launch, `-prefetch` with every weight kernel's L2 prefetch before the wait and `-noprefetch`
with none (shipped: the fp8 skinny product's only), kernels/pdl.py, e.g. `none,none-nopdl,fp8,fp8-nopdl,fp8-noprefetch`:
rows `<workload>_fp8_w_nopdl`. `-heuristic` runs the fp8 skinny linear as on a device its table has no entry for
(kernels/linear_fp8_skinny_triton.py skinny_config's fallback), `-splitk` with the fallback before 2026-12-06
(split along K until ~4 programs a SM, kept here only to time against it). `-fp8kv` runs every row over an fp8
KV cache (--kv-cache-dtype fp8): `none-fp8kv` is fp8 KV alone, `fp8-fp8kv` both (rows `<workload>_fp8kv`,
`<workload>_fp8_w_fp8kv`), beside --fp8-kv's b64 ctx 4,096 rows. `-reduce` sums split decode attention's partials
with the reduce kernel at every split launch (kernels/decode_attention_sum_triton.py COMBINE_IN_SPLITS off), as before
2026-12-07: the A/B of the fused sum.
Checks: graph-replayed logits = the eager forward's at batch 1, 3, 8 (on CUDA); --parity: the default model's
first 16 greedy tokens in bf16 on the GPU = fp32 on the CPU for >= 90 % of 20 prompts. Times: median of --repeat after warm-ups, CUDA events. Every decode step streams the 16 GB of
weights, so L2 (60 MB) holds nothing from one step to the next and inputs need no rotation; the transfer
alternates between two pool halves of 512 MiB each. HF and cuda_ipc parts are skipped on CPU (noted in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu_baselines import (
    hf_decode_ms,
    hf_model,
    hf_prefill_ms,
    parity,
    pipelined_ms,
    time_ms,
    transfer_benchmark,
)
from engine_gpu_fp8kv import apply_modifiers, fp8_kv_rows

from pdserve.engine import model as engine_model
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.kernels import linear_fp8_skinny_triton as skinny
from pdserve.kernels import linear_fp8_triton, pdl
from pdserve.kernels.tuning import TuningTable

DECODE_SHAPES = ((1, 512), (8, 512), (64, 512), (1, 4096))  # (batch, context)
PREFILL_TOKENS = 4096
BLOCK = 16
# issue 6 / BENCHMARKS.md, H200 bf16, Llama-3-8B shape: our targets in ms (HF's anchors beside them)
TARGETS_MS = {"decode_b1_ctx512": 4.4, "decode_b8_ctx512": 4.6, "decode_b64_ctx512": 6.5, "decode_b1_ctx4096": 4.6,
              "prefill_4096": 100.0,
              # issue 19, fp8 linears (W8A8): halving the 16 GB a decode step reads
              "decode_b1_ctx512_fp8_w": 2.6, "decode_b64_ctx512_fp8_w": 4.0, "prefill_4096_fp8_w": 65.0}
SUFFIX = {"none": "", "fp8": "_fp8_w"}  # row-name suffix per --quantization; each modifier adds "_<modifier>"
MODIFIERS = ("unfused", "nopdl", "noprefetch", "prefetch", "heuristic", "splitk", "fp8kv", "reduce")


def run_suffix(quantization: str) -> str:
    """'fp8-nopdl' -> '_fp8_w_nopdl'."""
    base, *mods = quantization.split("-")
    if base not in SUFFIX or any(m not in MODIFIERS for m in mods):
        raise ValueError(f"--quantization run {quantization!r}: none|fp8, then any of -{'/-'.join(MODIFIERS)}")
    return SUFFIX[base] + "".join(f"_{m}" for m in mods)
HF_ANCHORS_MS = {"decode_b1_ctx512": 7.14, "decode_b8_ctx512": 8.49, "decode_b64_ctx512": 20.0, "prefill_4096": 133.0}
TINY = ModelConfig(name="tiny-llama", vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32, max_model_len=8192)


@dataclass(frozen=True)
class Row:
    name: str
    ours_ms: float
    hf_ms: float | None
    target_ms: float | None


@dataclass
class Report:
    device: str
    model: str
    torch: str
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))
    checks: dict[str, object] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    transfer: dict[str, object] | None = None
    fp8_kv: dict[str, object] | None = None  # --fp8-kv: benchmarks/engine_gpu_fp8kv.py
    notes: list[str] = field(default_factory=list)
    fp8_w_ms: dict[str, float] = field(default_factory=dict)  # the fp8 rows again, keyed <row>_ms


def build_runner(config: ModelConfig, device: torch.device, quantization: str = "none", kv: str = "auto",
                 num_blocks: int | None = None) -> ModelRunner:
    """The llama3-8b-shaped runner the rows time (`kv`: the KV cache dtype, as --kv-cache-dtype; `num_blocks`:
    the pool, by default b64 ctx 512 and two 4k rows)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks = num_blocks or 64 * -(-(512 + 1) // BLOCK) + 2 * -(-(PREFILL_TOKENS + 1) // BLOCK)
    weights = dummy_weights(config, dtype, str(device))
    return ModelRunner(config, CacheConfig(num_blocks=blocks, block_size=BLOCK), weights, device, dtype,
                       max_num_seqs=64, quantization=quantization,
                       kv_spec=KVCacheSpec.build(kv, dtype, config.num_layers))


def decode_items(batch: int, context: int, first_block: int = 0) -> list[DecodeInput]:
    per_seq = -(-(context + 1) // BLOCK)
    return [DecodeInput(11 + i, context, list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq)))
            for i in range(batch)]


def check_graphs(runner: ModelRunner, report: Report) -> None:
    """Graph replay vs the eager forward on the same buffers, before anything is timed."""
    if runner.graphs is None:
        report.notes.append(f"graph check skipped: {runner.device} runs decode eagerly")
        return
    worst = 0.0
    for batch in (1, 3, 8):
        items = decode_items(batch, 300)
        graph = runner.decode(items).clone()
        eager = runner._forward_decode(runner.decode_buffers.prepare(items))[:batch]
        worst = max(worst, float((graph - eager).abs().max()))
    report.checks["graph_vs_eager_max_abs_logit_diff"] = worst
    if worst > 5e-2:
        raise SystemExit(f"graph replay differs from the eager forward by {worst} (logits): not timing this")


def time_ours(runner: ModelRunner, repeat: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Our times (decode: the mean of two passes' medians; *_pipelined: back to back, pipelined_ms) and each
    decode workload's two pass medians."""
    prompt = [(7 * j) % runner.config.vocab_size for j in range(PREFILL_TOKENS)]
    runner.prefill([PrefillChunk(prompt, 0, list(range(PREFILL_TOKENS // BLOCK)))])  # fills KV the decodes read
    warm = decode_items(1, 512)
    deadline = time.perf_counter() + (1.0 if runner.device.type == "cuda" else 0.0)
    while time.perf_counter() < deadline:  # the GPU out of its idle clocks before the first shape is timed
        runner.decode(warm)
    times, passes = {}, {}
    for _ in range(2):  # two passes over the shapes: their spread is what a difference must beat
        for batch, context in DECODE_SHAPES:
            items = decode_items(batch, context)
            passes.setdefault(f"decode_b{batch}_ctx{context}", []).append(
                time_ms(lambda items=items: runner.decode(items), runner.device, repeat, warmup=3))
    for name, both in passes.items():
        times[name] = statistics.fmean(both)
    for batch, context in DECODE_SHAPES:  # back to back, as the served loop runs them (pipelined_ms)
        items = decode_items(batch, context)
        times[f"decode_b{batch}_ctx{context}_pipelined"] = pipelined_ms(lambda items=items: runner.decode(items),
                                                                        runner.device, max(3, repeat // 2))
    chunk = [PrefillChunk(prompt, 0, list(range(PREFILL_TOKENS // BLOCK)))]
    times[f"prefill_{PREFILL_TOKENS}"] = time_ms(lambda: runner.prefill(chunk), runner.device, max(3, repeat // 4),
                                                 warmup=2)
    return times, passes


def time_hf(config: ModelConfig, device: torch.device) -> dict[str, float]:
    model = hf_model(config, device)
    times = {f"decode_b{b}_ctx{c}": hf_decode_ms(model, b, c, device) for b, c in DECODE_SHAPES}
    times[f"prefill_{PREFILL_TOKENS}"] = hf_prefill_ms(model, PREFILL_TOKENS, device)
    del model
    return times


SHIPPED_SKINNY_TABLE, SHIPPED_SKINNY_CONFIG = skinny.configs_table, linear_fp8_triton.skinny_config


def splitk_config(m: int, n: int, k: int, device: torch.device) -> skinny.Fp8SkinnyConfig:
    """skinny_config's fallback before 2026-12-06: 64-wide tiles split along K until ~4 programs a SM (of 132),
    each split at least 4 K-blocks long."""
    tiles, split = -(-n // 64), 1
    while split < 16 and tiles * split * 2 <= 4 * 132 and k // (split * 2) >= 4 * 256:
        split *= 2
    return skinny.Fp8SkinnyConfig(block_n=64, block_k=256, split_k=split)


def skinny_fallback(mods: list[str]) -> None:
    """-heuristic / -splitk: the fp8 skinny linear without its table entries (read at every launch)."""
    skinny.configs_table = TuningTable if {"heuristic", "splitk"} & set(mods) else SHIPPED_SKINNY_TABLE
    linear_fp8_triton.skinny_config = splitk_config if "splitk" in mods else SHIPPED_SKINNY_CONFIG
    SHIPPED_SKINNY_CONFIG.cache_clear()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> Report:
    device = torch.device(args.device)
    config = TINY if args.tiny else get_preset("llama3-8b")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = Report(device=name, model=config.name, torch=torch.__version__)
    if args.parity and device.type == "cuda":
        report.checks["parity"] = parity(device)
    elif args.parity:
        report.notes.append("parity skipped: it compares a GPU's bf16 run with the CPU's fp32 one")
    ours: dict[str, float] = {}
    pdl_default = pdl.ENABLED
    for quantization in filter(None, args.quantization.split(",")):  # "": none of these rows (--fp8-kv's alone)
        suffix, mods = run_suffix(quantization), quantization.split("-")[1:]
        engine_model.FUSE_FP8_ACTIVATIONS = "unfused" not in mods  # read at every forward and capture
        pdl.ENABLED = "nopdl" not in mods  # read at every launch
        skinny_fallback(mods)
        apply_modifiers(mods)
        runner = build_runner(config, device, quantization.split("-")[0], kv="fp8" if "fp8kv" in mods else "auto")
        check_graphs(runner, report)
        times, passes = time_ours(runner, args.repeat)
        print(f"run {quantization}: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)  # a timeout keeps it
        ours.update({k + suffix: v for k, v in times.items()})
        report.checks[f"decode_pass_medians_ms{suffix}"] = passes
        del runner
        free(device)
    engine_model.FUSE_FP8_ACTIVATIONS, pdl.ENABLED = True, pdl_default
    skinny_fallback([])
    apply_modifiers([])
    report.fp8_w_ms = {f"{k}_ms": v for k, v in ours.items() if k.endswith(SUFFIX["fp8"])}
    hf: dict[str, float] = {}
    if device.type == "cuda" and not args.skip_hf:
        hf = time_hf(config, device)
        free(device)
    else:
        report.notes.append("HF generate (static cache, torch.compile) skipped: CUDA only, or --skip-hf")
    report.rows = [Row(k, v, hf.get(k), TARGETS_MS.get(k) if not args.tiny else None) for k, v in ours.items()]
    if args.fp8_kv:
        report.fp8_kv = fp8_kv_rows(config, device, args.repeat, [v for v in args.fp8_kv_variants.split(",") if v],
                                    args.fp8_kv_rounds, tuple(m for m in args.fp8_kv_modifiers.split(",") if m))
    if device.type == "cuda" and not args.skip_transfer:
        report.transfer = dataclasses.asdict(transfer_benchmark(config, PREFILL_TOKENS, device))
    else:
        report.notes.append("cuda_ipc transfer skipped: it needs CUDA (two processes sharing a GPU)")
    return report


def print_table(report: Report) -> None:
    print(f"\n{report.model} on {report.device} (torch {report.torch})")
    for key, value in report.checks.items():
        print(f"  check {key}: {value}")
    print(f"{'workload':31s} {'ours ms':>9s} {'HF ms':>8s} {'HF anchor':>9s} {'target':>7s}")
    for row in report.rows:
        hf = f"{row.hf_ms:8.2f}" if row.hf_ms is not None else f"{'-':>8s}"
        target = row.target_ms
        anchor = HF_ANCHORS_MS.get(row.name) if target is not None else None
        print(f"{row.name:31s} {row.ours_ms:9.2f} {hf} {anchor or '-':>9} {target or '-':>7}")
    if report.transfer is not None:
        t = report.transfer
        print(f"cuda_ipc {t['bytes'] / 2**20:.0f} MiB: {t['cuda_ipc_gpu_ms']:.3f} ms ({t['cuda_ipc_gbps']:.0f} GB/s, "
              f"{t['fraction_of_copy']:.0%} of a device copy's {t['device_copy_gbps']:.0f} GB/s; wall "
              f"{t['cuda_ipc_wall_ms']:.2f} ms)")
    if report.fp8_kv is not None:
        print("fp8 KV: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in report.fp8_kv.items()))
    for note in report.notes:
        print(f"  note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model instead of llama3-8b (CPU plumbing)")
    parser.add_argument("--parity", action="store_true", help="also compare the default model bf16 GPU vs fp32 CPU")
    parser.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline")
    parser.add_argument("--fp8-kv", action="store_true",
                        help="also decode b64 ctx 4096 with a bf16 and an fp8 KV pool (benchmarks/engine_gpu_fp8kv.py)")
    parser.add_argument("--fp8-kv-rounds", type=int, default=1,
                        help="with --fp8-kv: build the bf16 and fp8 KV runners this many times, alternating, and "
                             "report medians (rows of one setting vary ~2 %% between builds)")
    parser.add_argument("--fp8-kv-variants", default="",
                        help="with --fp8-kv: comma-separated decode attention variants to run the fp8 rows with too "
                             "(kernels/decode_attention_triton.py VARIANTS), each optionally @ a tile (BLOCK_N x warps "
                             "x stages; that tile at every batch) or @ two tiles and programs a SM (fp8_plan's: "
                             "kt@128x4x1/64x2x1:6), e.g. kt,kt+vwide@64x4x3")
    parser.add_argument("--fp8-kv-modifiers", default="",
                        help="with --fp8-kv: comma-separated modifiers each round also times the fp8 cache's settings "
                             "with, keys ending _<modifier>: reduce (split attention's reduce kernel, not the fused sum)")
    parser.add_argument("--skip-transfer", action="store_true", help="no cuda_ipc transfer benchmark")
    parser.add_argument("--quantization", default="none,fp8",
                        help="comma-separated runs of the same workloads: none (bf16 linears), fp8 (fp8 linears), "
                             "and modifiers: -unfused (fp8 linears quantizing their own inputs: the fusion's A/B), "
                             "-nopdl (no programmatic dependent launch, kernels/pdl.py), -prefetch (every weight "
                             "kernel's L2 prefetch before its PDL wait; -noprefetch: none; shipped: the fp8 skinny "
                             "product's), -reduce (split "
                             "attention's reduce kernel, not the fused sum), e.g. "
                             "none,none-nopdl,fp8,fp8-nopdl")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_gpu_h200.json"))
    parser.add_argument("--parity-only", action="store_true",
                        help="only the parity study, its dict as the JSON (engine_gpu_parity_h200.json)")
    args = parser.parse_args()
    if args.parity_only:
        result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(args.device),
                  **parity(torch.device(args.device))}
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")
    print_table(report)


if __name__ == "__main__":
    main()
