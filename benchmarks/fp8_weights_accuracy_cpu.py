"""Accuracy of fp8 linears (--quantization fp8) on the default model, on the CPU (the reference kernels):
the first greedy tokens against fp32 over benchmarks/engine_gpu_baselines.PARITY_PROMPTS (as
dtype_parity_cpu.py measures bf16 and fp16), the first step's logits cosine, and perplexity.py's perplexity.

    .venv/bin/python benchmarks/fp8_weights_accuracy_cpu.py [--new-tokens 16] [--out benchmarks/results/fp8_weights_accuracy_cpu.json]

Settings: fp32 (the reference), fp32 with fp8 linears, bf16 with fp8 linears (what a GPU runs); the linears
take the path the GPU takes at each batch size (kernels/linear_fp8.py: W8A8 at every batch).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from dtype_parity_cpu import compare
from engine_gpu_baselines import PARITY_PROMPTS
from perplexity import held_out_text, perplexity

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM

SETTINGS = {"float32": ("float32", "none"), "float32_fp8_w": ("float32", "fp8"), "bfloat16_fp8_w": ("bfloat16", "fp8")}


def first_logits(llm: LLM) -> list[torch.Tensor]:
    out = []
    for prompt in PARITY_PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        out.append(llm.runner.prefill([PrefillChunk(ids, 0, list(range(-(-len(ids) // 16))))]).logits[0].float())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/fp8_weights_accuracy_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    tokens, logits, ppl = {}, {}, {}
    for name, (dtype, quantization) in SETTINGS.items():
        llm = LLM(device="cpu", dtype=dtype, quantization=quantization, progress=False, num_blocks=64)
        tokens[name] = [o.token_ids for o in llm.generate(PARITY_PROMPTS, params)]
        logits[name] = first_logits(llm)
        ppl[name] = perplexity(llm, llm.tokenizer.encode(held_out_text()), 512, 4)
        print(name, "perplexity", round(ppl[name], 4), flush=True)
    cosine = {name: min(float(torch.nn.functional.cosine_similarity(a, b, dim=0))
                        for a, b in zip(rows, logits["float32"], strict=True))
              for name, rows in logits.items() if name != "float32"}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": "cpu", "new_tokens": args.new_tokens,
              "command": f"benchmarks/fp8_weights_accuracy_cpu.py --new-tokens {args.new_tokens} --threads "
                         f"{args.threads}",
              "tokens_vs_fp32": compare(tokens, "float32"), "first_step_logits_min_cosine_vs_fp32": cosine,
              "perplexity": {"text": "README.md + docs/*.md, 4 windows of 512 tokens", **ppl},
              "seconds": time.perf_counter() - started}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, r in report["tokens_vs_fp32"].items():
        print(f"{name:15} = fp32: {r['identical']}/{r['prompts']} prompts, first divergence {r['first_divergence']}")
    print("min first-step logits cosine", cosine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
