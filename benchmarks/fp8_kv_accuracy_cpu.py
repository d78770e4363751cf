"""What an fp8 KV cache costs the default model in accuracy, on the CPU (the reference kernels, whose fp8 math is
the Triton kernels'):

    .venv/bin/python benchmarks/fp8_kv_accuracy_cpu.py [--new-tokens 16] [--linears none|fp8|all]
        [--out benchmarks/results/fp8_kv_accuracy_cpu.json]

For weights in fp32, bf16 and fp16, each with the KV cache in its own dtype (auto), in fp8 (float8_e4m3fn,
scale 1.0: the GGUF checkpoint has no KV scales) and in fp8 with scales calculated at start from the built-in text
(fp8-calc: --calculate-kv-scales, engine/kv_scale_calibration.py). With --linears fp8 (or all), fp8 linears
(--quantization fp8, W8A8 as the GPU runs it) with fp32 and bf16 weights, each with its own cache and with fp8:
issue 19's "fp8 weights" and "both" settings, on the same text as the cache's rows.

  parity      the first --new-tokens greedy tokens of benchmarks/engine_gpu_baselines.PARITY_PROMPTS (the 20
              prompts of benchmarks/dtype_parity_cpu.py) against fp32 weights with an fp32 cache; per prompt, the
              first index where a run leaves fp32's tokens
  perplexity  on held-out text: the first --ppl-tokens tokens of docs/architecture.md (this repository's prose,
              written after the model was trained), teacher-forced in chunks of --ppl-chunk tokens, so every
              chunk after the first reads the earlier ones from the (fp8) cache as decode would

Also the largest |K| and |V| the fp8 cache was asked to hold over the perplexity text (after RoPE; e4m3 saturates
at 448), which says whether scale 1.0 is safe for this model; for fp8-calc in codes (|x| / scale), which says how
near 448 the held-out text came with the calculated scales.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from engine_gpu_baselines import PARITY_PROMPTS

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM

HELD_OUT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
SETTINGS = [(w, kv, None) for w in ("float32", "bfloat16", "float16") for kv in ("auto", "fp8", "fp8-calc")]
FP8_LINEAR_SETTINGS = [(w, kv, "fp8") for w in ("float32", "bfloat16") for kv in ("auto", "fp8")]


def greedy(llm: LLM, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    return [o.token_ids for o in llm.generate(PARITY_PROMPTS, params)]


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], chunk: int) -> float:
    """exp(mean NLL) of ids[1:] given the tokens before, the prompt fed `chunk` tokens at a time."""
    table = list(range(-(-len(ids) // llm.cache_config.block_size)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:min(start + chunk, len(ids) - 1)]
        out = llm.runner.prefill([PrefillChunk(piece, start, table, need_logits=False, all_logits=True)])
        logprobs = torch.log_softmax(out.all_logits[0].float(), dim=-1)
        targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])
        nll -= logprobs[torch.arange(len(piece)), targets].sum().item()
        count += len(piece)
    return math.exp(nll / count)


def kv_amax(llm: LLM, num_tokens: int) -> dict[str, float]:
    """Largest |value| held in the pool's first num_tokens slots (fp32 caches: what fp8 would be asked to hold)."""
    caches = [kv.view(2, -1, *kv.shape[3:])[:, :num_tokens].float() for kv in llm.runner.kv_caches]
    return {"k": max(c[0].abs().max().item() for c in caches), "v": max(c[1].abs().max().item() for c in caches)}


def divergence(ours: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))


def run(weights: str, kv: str, linears: str | None, args: argparse.Namespace, held_out: list[int] | None) -> dict:
    llm = LLM(device="cpu", dtype=weights, kv_cache_dtype=kv.removesuffix("-calc"), progress=False, num_blocks=256,
              calculate_kv_scales=kv.endswith("-calc"), quantization=linears)
    ids = held_out if held_out is not None else llm.tokenizer.encode(HELD_OUT.read_text())[:args.ppl_tokens]
    started = time.perf_counter()
    row = {"weights": weights, "kv_cache_dtype": kv, "linears": linears, "tokens": greedy(llm, args.new_tokens),
           "perplexity": perplexity(llm, ids, args.ppl_chunk), "held_out_ids": ids}
    row["kv_amax"] = kv_amax(llm, len(ids) - 1)
    row["kv_scales"] = {"k": list(llm.runner.kv_spec.k_scales), "v": list(llm.runner.kv_spec.v_scales)}
    row["seconds"] = time.perf_counter() - started
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--ppl-chunk", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--linears", choices=("none", "fp8", "all"), default="none",
                        help="none: the nine cache rows; fp8: fp32/fp32 (the reference) and the four fp8-linear "
                             "rows; all: both")
    parser.add_argument("--out", default="benchmarks/results/fp8_kv_accuracy_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[dict] = []
    settings = {"none": SETTINGS, "fp8": SETTINGS[:1] + FP8_LINEAR_SETTINGS,
                "all": SETTINGS + FP8_LINEAR_SETTINGS}[args.linears]
    for weights, kv, linears in settings:
        rows.append(run(weights, kv, linears, args, rows[0]["held_out_ids"] if rows else None))
        r = rows[-1]
        print(f"{weights:9} kv {kv:4} linears {linears or 'as-is'}: perplexity {r['perplexity']:.4f}, |K| max {r['kv_amax']['k']:.1f}, "
              f"|V| max {r['kv_amax']['v']:.1f} ({r['seconds']:.0f} s)", flush=True)
    ref = rows[0]["tokens"]
    results = {}
    for r in rows:
        first = [divergence(a, b) for a, b in zip(r["tokens"], ref, strict=True)]
        same = sum(a == b for a, b in zip(r["tokens"], ref, strict=True))
        results[f"{r['weights']}_kv_{r['kv_cache_dtype']}" + ("_fp8_w" if r["linears"] else "")] = {
            "identical_to_fp32": same, "prompts": len(ref), "first_divergence": first,
            "perplexity": r["perplexity"], "kv_amax": r["kv_amax"], "kv_scales": r["kv_scales"]}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": "cpu", "new_tokens": args.new_tokens,
              "held_out": f"docs/architecture.md, first {len(rows[0]['held_out_ids'])} tokens, chunks of "
                          f"{args.ppl_chunk}", "kv_scales": "fp8: 1.0 (the GGUF has none); fp8-calc: calculated at start",
              "command": f"benchmarks/fp8_kv_accuracy_cpu.py --new-tokens {args.new_tokens} --ppl-tokens "
                         f"{args.ppl_tokens} --ppl-chunk {args.ppl_chunk} --threads {args.threads} --linears "
                         f"{args.linears}",
              "results": results, "seconds": time.perf_counter() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, r in results.items():
        print(f"{name:27} {r['identical_to_fp32']}/{r['prompts']} prompts as fp32, perplexity {r['perplexity']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
