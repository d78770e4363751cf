"""benchmarks/engine_gpu.py's fp8 KV cache rows (issue 19 item 4): a decode step at batch 64 over 4,096 tokens of
context with the KV pool in bf16 (the model's dtype) and in fp8 (float8_e4m3fn, scale 1.0), the sequences of
4,096 tokens one GiB of pool holds in each, and the bytes of one 4,096-token request's KV that P sends D.

    python benchmarks/engine_gpu.py --fp8-kv ...              (H200, llama3-8b shape: with the other rows)
    python benchmarks/engine_gpu.py --device cpu --tiny --skip-hf --fp8-kv --repeat 2 --out /tmp/e.json  (plumbing)

Targets (issue 19): decode b64 ctx 4096 >= 1.4x faster with fp8 KV than bf16 KV, twice the sequences per GB, the
4,096-token transfer halved in bytes and time. The transfer's time by backend is benchmarks/transfer_backends.py
with `--presets llama3-8b:bfloat16 llama3-8b:float8_e4m3fn` (its rows name the dtype and the bytes); this module
gives the bytes. The pools are one at a time (llama3-8b: 32 GiB of bf16 KV for 64 x 4,096 tokens), each freed
before the next, their KV zeros: the step reads every byte whatever they hold.
"""

from __future__ import annotations

import functools
import gc
import re
import statistics

import torch
from engine_gpu_baselines import pipelined_ms, time_ms

from pdserve.engine.attention_metadata import DecodeInput
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_cache import blocks_for_bytes
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.kernels import decode_attention_sum_triton as sums
from pdserve.kernels import decode_attention_triton as attention
from pdserve.kernels import pdl

BATCH, CONTEXT, BLOCK = 64, 4096, 16
TRANSFER_TOKENS = 4096


def _items(per_seq: int) -> list[DecodeInput]:
    return [DecodeInput(11 + i, CONTEXT, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(BATCH)]


_PREFETCH_SHIPPED = pdl.PREFETCH_WEIGHTS


def apply_modifiers(mods: list[str] | tuple[str, ...]) -> None:
    """-reduce: split attention's partials summed by the reduce kernel at every split launch (COMBINE_IN_SPLITS
    off). -prefetch: every weight kernel prefetches its first tiles before its PDL wait, -noprefetch: none does
    (kernels/pdl.py PREFETCH_WEIGHTS; shipped: the fp8 skinny product's). Read at every launch, so a runner built
    after this captures it; [] puts the shipped choices back."""
    sums.COMBINE_IN_SPLITS = "reduce" not in mods
    pdl.PREFETCH_WEIGHTS = (pdl.PREFETCH_KERNELS if "prefetch" in mods else frozenset() if "noprefetch" in mods
                            else _PREFETCH_SHIPPED)


def _decode_ms(config: ModelConfig, device: torch.device, dtype: torch.dtype, kv: str, repeat: int,
               quantization: str = "none", mods: tuple[str, ...] = ()) -> tuple[float, float]:
    """The step in ms: synchronised after each (time_ms: the host's staging of 64 block tables of 257 blocks
    included) and back to back (pipelined_ms: staged while the previous step runs, as the served loop does).
    `mods`: apply_modifiers's, for this runner only."""
    apply_modifiers(mods)
    try:
        return _runner_ms(config, device, dtype, kv, repeat, quantization)
    finally:
        apply_modifiers(())


def _runner_ms(config: ModelConfig, device: torch.device, dtype: torch.dtype, kv: str, repeat: int,
               quantization: str) -> tuple[float, float]:
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    spec = KVCacheSpec.build(kv, dtype, config.num_layers)
    runner = ModelRunner(config, CacheConfig(num_blocks=BATCH * per_seq, block_size=BLOCK),
                         dummy_weights(config, dtype, str(device)), device, dtype, max_num_seqs=BATCH, kv_spec=spec,
                         quantization=quantization)
    step = functools.partial(runner.decode, _items(per_seq))
    ms = time_ms(step, device, repeat, warmup=3), pipelined_ms(step, device, max(3, repeat // 2))
    del step, runner  # the pool (and its graphs) go before the next one is allocated
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


def _variant_rows(config: ModelConfig, device: torch.device, dtype: torch.dtype, repeat: int,
                  variants: list[str]) -> dict[str, float]:
    """fp8 KV (bf16 and fp8 linears) with each other decode attention variant as the fp8 cache's default
    (kernels/decode_attention_triton.py VARIANTS), optionally with its tile ("kt+vwide@64x4x3": BLOCK_N x
    warps x stages; then that tile at every batch, no fp8_plan) or its two tiles and programs per SM
    ("kt@128x4x1/64x2x1:6", fp8_plan's): its A/B against the default in the same run."""

    def tile(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("x"))

    rows = {}
    default = (attention._FP8_VARIANT, attention._FP8_TILE, attention._FP8_MANY_TILE, attention._FP8_PROGRAMS_PER_SM)
    try:
        for name in variants:
            variant, _, tiles = name.partition("@")
            few, _, many = tiles.partition("/")
            # read at every launch: the new runner's graphs capture them
            attention._FP8_VARIANT = variant
            attention._FP8_TILE = tile(few) if few else default[1]
            attention._FP8_MANY_TILE = tile(many.partition(":")[0]) if many else None if few else default[2]
            attention._FP8_PROGRAMS_PER_SM = int(many.partition(":")[2] or default[3])
            key = f"decode_b{BATCH}_ctx{CONTEXT}_fp8kv_{re.sub('[^0-9a-z]', '_', name)}"
            rows[f"{key}_ms"] = _decode_ms(config, device, dtype, "fp8", repeat)[0]
            rows[f"{key}_fp8_w_ms"] = _decode_ms(config, device, dtype, "fp8", repeat, quantization="fp8")[0]
    finally:
        (attention._FP8_VARIANT, attention._FP8_TILE, attention._FP8_MANY_TILE,
         attention._FP8_PROGRAMS_PER_SM) = default
    return rows


def fp8_kv_rows(config: ModelConfig, device: torch.device, repeat: int,
                variants: list[str] | None = None, rounds: int = 1, mods: tuple[str, ...] = ()) -> dict[str, object]:
    """The rows (ms), the speed-up, sequences per GiB and the transfer's bytes, bf16 (or the CPU's fp32) vs fp8;
    `variants`: the same fp8 rows with other decode attention variants (_variant_rows). Each cache is timed with
    bf16 linears and with fp8 ones (`--quantization fp8`). `rounds` > 1 builds the four runners that many times,
    in turn, and reports each one's median (and every sample): rows of one setting differ by up to ~2 % from one
    runner to the next (docs/quantization.md). `mods`: each round also times the fp8 cache's two settings with
    each (keys ending _reduce: the A/B of the fused split sum); only reduce, which touches the fp8 cache alone: the
    speed-ups divide by the unmodified bf16 cache's rows."""
    if set(mods) - {"reduce"}:
        raise ValueError(f"--fp8-kv-modifiers takes reduce only (it changes only the fp8 cache's step), got {mods}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")
    row = f"decode_b{BATCH}_ctx{CONTEXT}"
    base = {f"{name}kv": ("auto", "none"), "fp8kv": ("fp8", "none"),  # bf16 linears, then fp8 linears
            f"{name}kv_fp8_w": ("auto", "fp8"), "fp8kv_fp8_w": ("fp8", "fp8")}
    settings = {key: (kv, quantization, ()) for key, (kv, quantization) in base.items()}
    speedups = {"fp8kv_speedup": (f"{name}kv", "fp8kv"), "fp8kv_speedup_fp8_w": (f"{name}kv_fp8_w", "fp8kv_fp8_w")}
    for mod in mods:  # only the fp8 cache's settings: the bf16 cache does not split at b64
        settings |= {f"{key}_{mod}": (kv, quantization, (mod,)) for key, (kv, quantization) in base.items()
                     if kv == "fp8"}
        speedups |= {f"{speedup}_{mod}": (b, f"{f}_{mod}") for speedup, (b, f) in list(speedups.items())[:2]}
    samples: dict[str, list[float]] = {key: [] for key in settings}
    pipelined: dict[str, list[float]] = {key: [] for key in settings}
    for round_ in range(max(1, rounds)):
        for key, (kv, quantization, modifiers) in settings.items():
            synced, back_to_back = _decode_ms(config, device, dtype, kv, repeat, quantization, modifiers)
            samples[key].append(synced)
            pipelined[key].append(back_to_back)
            print(f"fp8 KV round {round_}: {key} {synced:.3f} ms, back to back {back_to_back:.3f} ms",
                  flush=True)  # kept if a run is cut
    median = {key: statistics.median(values) for key, values in samples.items()}
    piped = {key: statistics.median(values) for key, values in pipelined.items()}
    base = median[f"{name}kv"]
    others = _variant_rows(config, device, dtype, repeat, variants or [])
    per_seq_blocks = -(-(CONTEXT + 1) // BLOCK)
    pool = 64 << 30  # sequences of 4,096 tokens a 64 GiB pool holds (one GiB holds one or two: too coarse)
    seqs = {kv: blocks_for_bytes(config, BLOCK, d, pool) // per_seq_blocks
            for kv, d in ((name, dtype), ("fp8", torch.float8_e4m3fn))}
    blocks = {kv: blocks_for_bytes(config, BLOCK, d, 1 << 30) for kv, d in ((name, dtype), ("fp8", torch.float8_e4m3fn))}
    transfer = {kv: config.kv_bytes_per_token(d.itemsize) * TRANSFER_TOKENS
                for kv, d in ((name, dtype), ("fp8", torch.float8_e4m3fn))}
    return {**{f"{row}_{key}_ms": v for key, v in median.items()},
            **{speedup: median[b] / median[f] for speedup, (b, f) in speedups.items()}, "target_speedup": 1.4,
            # the same steps back to back (the served loop's async scheduling: staging overlaps the device)
            **{f"{row}_{key}_pipelined_ms": v for key, v in piped.items()},
            **{f"{speedup}_pipelined": piped[b] / piped[f] for speedup, (b, f) in speedups.items()},
            **others,
            **({"rounds": rounds, "samples_ms": samples, "pipelined_samples_ms": pipelined,
                **{f"{speedup}_per_round": [x / y for x, y in zip(samples[b], samples[f], strict=True)]
                   for speedup, (b, f) in speedups.items()}} if rounds > 1 else {}),
            **{f"fp8kv_speedup_{k.removeprefix(f'decode_b{BATCH}_ctx{CONTEXT}_fp8kv_').removesuffix('_ms')}": base / v
               for k, v in others.items() if not k.endswith("_fp8_w_ms")},
            f"seqs_per_64gib_ctx{CONTEXT}": seqs, "blocks_per_gib": blocks,
            f"transfer_{TRANSFER_TOKENS}_tokens_bytes": transfer,
            "transfer_times": "benchmarks/transfer_backends.py --presets llama3-8b:bfloat16 llama3-8b:float8_e4m3fn"}
