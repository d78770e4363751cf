"""Perplexity of the default model (or any) on held-out text, per dtype and quantization setting.

    .venv/bin/python benchmarks/perplexity.py [--dtype float32] [--quantization fp8] [--window 512] [--windows 4]

Text: docs/*.md and README.md of this repository, in file-name order (pdserve's own prose, written after the
model's training data was gathered, so held out from it), tokenized once and cut into `--windows`
non-overlapping windows of `--window` tokens; each window is one prefill from an empty cache (all logits), so
ppl = exp(mean over predicted tokens of -log p(token | its window's preceding tokens)).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.llm import LLM

ROOT = Path(__file__).resolve().parent.parent


def held_out_text() -> str:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def perplexity(llm: LLM, token_ids: list[int], window: int, windows: int) -> float:
    blocks = -(-window // llm.cache_config.block_size)
    nll, count = 0.0, 0
    for w in range(windows):
        ids = token_ids[w * window:(w + 1) * window]
        if len(ids) < window:
            raise ValueError(f"the text has {len(token_ids)} tokens, fewer than {windows} windows of {window}")
        out = llm.runner.prefill([PrefillChunk(ids, 0, list(range(blocks)), all_logits=True)])
        logp = torch.log_softmax(out.all_logits[0].float(), dim=-1)[:-1]
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none", choices=("none", "fp8"))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, quantization=args.quantization, progress=False, num_blocks=64)
    ids = llm.tokenizer.encode(held_out_text())
    ppl = perplexity(llm, ids, args.window, args.windows)
    print(json.dumps({"dtype": args.dtype, "quantization": args.quantization, "tokens": args.window * args.windows,
                      "perplexity": ppl}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
