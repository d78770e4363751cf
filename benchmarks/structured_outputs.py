"""The cost of a constrained decode step (structured outputs) against an unconstrained one, at batch 1 and 64.

    .venv/bin/python benchmarks/structured_outputs.py [--device cpu] [--threads 1] [--repeats 15] \
        [--out benchmarks/results/structured_outputs_cpu.json]
    # the H200 (the lead): dummy Llama-3-8B weights, the default model's tokenizer for the grammar
    python benchmarks/structured_outputs.py --device cuda --load-format dummy --model-preset llama3-8b \
        --out benchmarks/results/structured_outputs_h200.json

One decode step is runner.decode (the forward) + Sampler.sample(...).result() (the draw, its host copy). The
constrained step has every row under a JSON-schema grammar (xgrammar; each matcher inside a JSON string, where
most of the vocabulary is allowed, and after a key, where few tokens are): its extra work is the bitmask
filled on the host row by row (TokenBitmasks.fill), one copy to the device, the mask applied there and the
masked copy of the logits. Reported apart: `mask` (fill + copy + apply alone) and `sample` with and without.
Variants alternate within each repeat (medians), so a busy neighbour slows both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.attention_metadata import DecodeInput
from pdserve.engine.config import CacheConfig
from pdserve.engine.grammar import GrammarBackend, TokenBitmasks, apply_token_bitmask
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams, SamplingRequest
from pdserve.engine.structured_output import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import DEFAULT_MODEL, ModelSpec, load_model
from pdserve.engine.weights.fetch import default_cache_dir, fetch_default_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
PREFIXES = ['{"name": "Ada Love', '{"name": "Bob", "age": 3']  # inside a string; after a number
CONTEXT = 256


def timed(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    for fn in fns.values():
        fn()
        sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: round(1000 * statistics.median(v), 4) for name, v in samples.items()}


def matchers(backend: GrammarBackend, tokenizer: Tokenizer, batch: int) -> list:
    out = []
    for i in range(batch):
        matcher = backend.matcher(StructuredOutput.json_schema(SCHEMA))
        for token in tokenizer.encode(PREFIXES[i % len(PREFIXES)], add_special_tokens=False):
            assert matcher.accept_token(token)
        out.append(matcher)
    return out


def bench(runner: ModelRunner, backend: GrammarBackend, tokenizer: Tokenizer, batch: int, repeats: int,
          device: torch.device) -> dict:
    block_size = runner.cache_config.block_size
    per_seq = -(-CONTEXT // block_size)
    items = [DecodeInput(100 + i, CONTEXT - 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)]
    plain = [SamplingRequest(SamplingParams(temperature=0.0), [1] * CONTEXT, []) for _ in range(batch)]
    grammars = matchers(backend, tokenizer, batch)
    constrained = [SamplingRequest(r.params, r.prompt_token_ids, [], 0, g) for r, g in zip(plain, grammars, strict=True)]
    sampler, masks = Sampler(device), TokenBitmasks(runner.config.vocab_size, device)
    logits = runner.decode(items).clone()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = timed({
        "step_unconstrained": lambda: sampler.sample(runner.decode(items), plain).result(),
        "step_constrained": lambda: sampler.sample(runner.decode(items), constrained).result(),
        "sample_unconstrained": lambda: sampler.sample(logits, plain).result(),
        "sample_constrained": lambda: sampler.sample(logits, constrained).result(),
        "mask_fill": lambda: masks.fill(grammars),
        "mask_fill_apply": lambda: apply_token_bitmask(logits, masks.fill(grammars)),  # type: ignore[arg-type]
    }, repeats, sync)
    times["step_overhead_pct"] = round(100 * (times["step_constrained"] / times["step_unconstrained"] - 1), 1)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--model-preset", default=None)
    parser.add_argument("--tokenizer", default=None,
                        help="the grammar's tokenizer directory (default: the default model's, fetched if needed)")
    parser.add_argument("--out", default="benchmarks/results/structured_outputs_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = args.model_preset if args.load_format == "dummy" else DEFAULT_MODEL
    loaded = load_model(ModelSpec(model, args.load_format), dtype, args.device, default_cache_dir())
    tokenizer = loaded.tokenizer or Tokenizer.from_dir(args.tokenizer or fetch_default_model(default_cache_dir(),
                                                                                             progress=False))
    backend = GrammarBackend(tokenizer, loaded.config.vocab_size, list(tokenizer.eos_token_ids))
    num_blocks = max(args.batches) * -(-CONTEXT // 16) + 16
    runner = ModelRunner(loaded.config, CacheConfig(num_blocks, 16), loaded.weights, device, dtype,
                         max_num_seqs=max(args.batches))
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["benchmarks/structured_outputs.py",
              *sys.argv[1:]]), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "threads": args.threads, "model": model, "vocab_size": loaded.config.vocab_size, "context": CONTEXT,
              "batches": {str(b): bench(runner, backend, tokenizer, b, args.repeats, device) for b in args.batches}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["batches"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
