"""`pdserve profile`: time one worker's prefill iterations and decode steps in process and fit the planner's
latency models (see planner/profile.py). Random weights of the model's shapes are used: step times
depend on shapes and dtype, not on weight values."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.planner.measure import ProfileGrid


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("profile", help="measure prefill/decode step latency and fit the planner's models")
    p.add_argument("--model-preset", default="smollm2-135m", help="model shapes (the default model's by default)")
    p.add_argument("--hf-config", default=None, help="a HF model directory whose config.json gives the shapes "
                                                     "(instead of --model-preset)")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and KV dtype; auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--prefill-lens", type=_ints, default=None, help="prompt lengths, e.g. 16,64,256,1024")
    p.add_argument("--prefill-batches", type=_ints, default=None, help="prompts per iteration, e.g. 1,2,4")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="skip prefill shapes above this")
    p.add_argument("--decode-batches", type=_ints, default=None, help="sequences per step, e.g. 1,8,32")
    p.add_argument("--decode-ctxs", type=_ints, default=None, help="context per sequence, e.g. 64,512")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per shape (median kept)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--output", default="profile.json", help="where the profile JSON goes")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def default_grid(device: str) -> ProfileGrid:
    """Shapes up to the server's default limits (max_num_batched_tokens 2048, max_num_seqs 64): a plan
    extrapolates the fits only as far as they were measured. About two minutes on CPU."""
    from pdserve.planner.measure import ProfileGrid

    if device == "cpu":
        return ProfileGrid(prefill_lens=(16, 64, 128, 256, 512, 1024), prefill_batches=(1, 2, 4),
                           max_batched_tokens=2048, decode_batches=(1, 2, 4, 8, 16, 32, 64),
                           decode_ctxs=(64, 256, 1024))
    return ProfileGrid(prefill_lens=(64, 256, 512, 1024, 2048, 4096), prefill_batches=(1, 2, 4, 8),
                       max_batched_tokens=8192, decode_batches=(1, 4, 16, 32, 64, 128), decode_ctxs=(128, 512, 2048))


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.engine.config import CacheConfig
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.weights import resolve_device
    from pdserve.engine.weights.dummy import dummy_weights
    from pdserve.planner.measure import decode_shapes, profile_runner
    from pdserve.planner.profile import fit_warnings

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise SystemExit(f"pdserve profile: {exc}") from None
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    grid = dataclasses.replace(default_grid(device.split(":")[0]), **_overrides(args))
    config = _model_config(args)
    runner = ModelRunner(config, CacheConfig(grid.blocks_needed(args.block_size), args.block_size),
                         dummy_weights(config, dtype, device, args.seed), device, dtype,
                         max_num_seqs=max(grid.decode_batches))
    print(f"profiling {config.name} on {device} ({dtype_name}): {len(grid.prefill_shapes())} prefill "
          f"shapes, {len(decode_shapes(grid))} decode shapes, {grid.repeats} repeats")
    profile = profile_runner(runner, grid, config.name, progress=not args.disable_tqdm)
    path = profile.save(args.output)
    pf, df = profile.prefill, profile.decode
    print(f"prefill  t = {pf.coef[0] * 1e6:.3f} us·Σl + {pf.coef[1] * 1e9:.4f} ns·Σl² + {pf.coef[2] * 1e3:.2f} ms"
          f"   R² = {pf.r2:.4f}")
    print(f"decode   t = {df.coef[0] * 1e9:.3f} ns·Σctx + {df.coef[1] * 1e9:.3f} ns·batch·max(ctx) + "
          f"{df.coef[2] * 1e6:.2f} us·batch + {df.coef[3] * 1e3:.2f} ms + {df.coef[4] * 1e3:.2f} ms·[batch > 1]"
          f"   R² = {df.r2:.4f}")
    print(f"profile saved to {path}")
    for warning in fit_warnings(profile):
        print(warning, file=sys.stderr)
    return 0


def _model_config(args: argparse.Namespace) -> ModelConfig:
    from pathlib import Path

    from pdserve.engine.presets import get_preset
    from pdserve.engine.weights.hf_config import hf_config

    if args.hf_config:
        return hf_config(Path(args.hf_config), Path(args.hf_config).name)
    return get_preset(args.model_preset)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {"prefill_lens": args.prefill_lens, "prefill_batches": args.prefill_batches,
             "max_batched_tokens": args.max_num_batched_tokens, "decode_batches": args.decode_batches,
             "decode_ctxs": args.decode_ctxs, "repeats": args.repeats}
    return {k: v for k, v in given.items() if v is not None}
