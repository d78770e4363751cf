"""How often does a lower-precision run of the default model give the same first greedy tokens as fp32?

    .venv/bin/python benchmarks/dtype_parity_cpu.py [--new-tokens 16] [--out benchmarks/results/dtype_parity_cpu.json]

The GPU issue asks that the default model in bf16 on the GPU give the same first 16 greedy tokens as the CPU's
fp32 path for >= 90 % of benchmarks/engine_gpu_baselines.PARITY_PROMPTS. This measures, on the CPU, what the
dtype alone does: pdserve in fp32, bf16 and fp16 (the same reference kernels, weights dequantised from the same
Q4_1 GGUF), and Hugging Face transformers in fp32 and bf16 on the same file as the anchor (does transformers'
bf16 keep to its fp32 any better?). Generation stops at EOS, as a client's would; the first index where each
run leaves fp32's tokens is saved per prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from engine_gpu_baselines import PARITY_PROMPTS

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.weights import DEFAULT_MODEL, KNOWN_MODELS
from pdserve.engine.weights.fetch import default_cache_dir, fetch_gguf
from pdserve.llm import LLM


def pdserve_tokens(dtype: str, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    return [o.token_ids for o in LLM(device="cpu", dtype=dtype, progress=False).generate(PARITY_PROMPTS, params)]


def hf_tokens(dtype: torch.dtype, new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], default_cache_dir(), progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = []
    for prompt in PARITY_PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def divergence(ours: list[int], ref: list[int]) -> int:
    """The first index where the two differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))


def compare(runs: dict[str, list[list[int]]], ref: str) -> dict[str, dict]:
    result = {}
    for name, tokens in runs.items():
        if name == ref:
            continue
        same = [a == b for a, b in zip(tokens, runs[ref], strict=True)]
        result[name] = {"same_as": ref, "identical": sum(same), "prompts": len(same),
                        "fraction": sum(same) / len(same),
                        "first_divergence": [divergence(a, b) for a, b in zip(tokens, runs[ref], strict=True)]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/dtype_parity_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    ours = {f"pdserve_{d}": pdserve_tokens(d, args.new_tokens) for d in ("float32", "bfloat16", "float16")}
    hf = {f"hf_{n}": hf_tokens(d, args.new_tokens) for n, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": "cpu", "new_tokens": args.new_tokens,
              "command": f"benchmarks/dtype_parity_cpu.py --new-tokens {args.new_tokens} --threads {args.threads}",
              "pdserve_vs_pdserve_fp32": compare(ours, "pdserve_float32"),
              "hf_vs_hf_fp32": compare(hf, "hf_float32"),
              "pdserve_fp32_vs_hf_fp32": compare({"pdserve_float32": ours["pdserve_float32"], **hf}, "hf_float32")
              ["pdserve_float32"], "seconds": time.perf_counter() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for group in ("pdserve_vs_pdserve_fp32", "hf_vs_hf_fp32"):
        for name, r in report[group].items():
            print(f"{name:18} = {r['same_as']}: {r['identical']}/{r['prompts']} prompts, first divergence "
                  f"{r['first_divergence']}")
    r = report["pdserve_fp32_vs_hf_fp32"]
    print(f"pdserve fp32 = hf fp32: {r['identical']}/{r['prompts']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
