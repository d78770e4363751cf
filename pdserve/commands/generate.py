"""`pdserve generate PROMPT`: run the offline engine on one prompt and stream the continuation to stdout.

Only the generated text goes to stdout (anything else, such as download progress, goes to stderr), so
`pdserve generate "..." > out.txt` captures exactly the continuation.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.settings import KV_CACHE_DTYPE_FLAGS, QUANTIZATION_HELP, QUANTIZATIONS


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("generate", help="continue one prompt (offline, no server)")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=128, help="generate at most this many (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: keep the smallest set of tokens whose probability reaches this")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--chat", action="store_true", help="send PROMPT as one user message (chat template)")
    parser.add_argument("--model", default=None,
                        help="embedded model name, Hugging Face repo id, .gguf file or HF directory (default: the "
                             "embedded SmolLM2)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a repo id (default: main)")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="Hugging Face cache of repo ids (default: huggingface_hub's, from HF_HOME)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda:N")
    parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: fp32 on CPU)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_FLAGS,
                        help="auto: the --dtype; fp8 (or fp8_e4m3): float8_e4m3fn with per-layer scales "
                             "(docs/quantization.md)")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="with --kv-cache-dtype fp8: scales computed once from a built-in text, not 1.0")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks of 16 tokens (default 256)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="model cache (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)")
    parser.set_defaults(func=run)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr (subprocesses included, e.g. pip fetching the model)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.weights import DEFAULT_MODEL, resolve_device
    from pdserve.engine.weights.hub import HubOptions, ModelNotFoundError
    from pdserve.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    env_cache = os.environ.get("PDSERVE_CACHE_DIR")
    cache_dir = args.cache_dir or (Path(env_cache) if env_cache else None)
    hub = HubOptions(revision=args.revision, cache_dir=args.download_dir)
    try:
        device = resolve_device(args.device)
        with _stdout_to_stderr():
            llm = LLM(args.model or DEFAULT_MODEL, dtype=args.dtype, device=device, num_blocks=args.num_blocks,
                      max_num_seqs=1, cache_dir=cache_dir, hub=hub, kv_cache_dtype=args.kv_cache_dtype,
                      calculate_kv_scales=args.calculate_kv_scales,
                      quantization=args.quantization)
    except (ModelNotFoundError, ValueError) as exc:  # ValueError: flags the engine refuses
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    try:
        for delta in llm.stream(args.prompt, params, use_chat=args.chat):
            sys.stdout.write(delta)
            sys.stdout.flush()
    except ValueError as exc:
        print(f"\npdserve generate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    sys.stdout.write("\n")
    return 0
