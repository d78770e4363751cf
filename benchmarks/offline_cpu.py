"""Offline generation on CPU: Hugging Face transformers (sequential greedy `generate`) against pdserve's `LLM`
at batch 1 and batch 16, same prompts, same number of generated tokens, one process, one run.

    .venv/bin/python benchmarks/offline_cpu.py [--prompts 16] [--new-tokens 32] [--rounds 2] [--threads N] \
        [--out benchmarks/results/offline_cpu.json]

Every configuration generates exactly --new-tokens tokens per prompt (HF: min_new_tokens, pdserve:
ignore_eos), greedy, fp32. HF and pdserve batch 1 alternate prompt by prompt and the batch-16 run follows,
so a busy neighbour (these machines are shared) slows all of them alike. The speedup reported is the median
over --rounds rounds of each configuration's throughput over HF's in the same round; every run is in the
JSON. Throughput counts generated tokens over wall time, prefill included. The greedy tokens are compared
with HF's too, up to the first EOS (from there HF's min_new_tokens and pdserve's ignore_eos part ways).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.engine.weights import DEFAULT_MODEL, KNOWN_MODELS
from pdserve.engine.weights.fetch import default_cache_dir, fetch_gguf
from pdserve.llm import LLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "import numpy as np\nx = np.arange(10)\n",
    "Water boils at a temperature of",
    "Translate to French: 'Good morning, how are you?'",
    "The most important thing about writing tests is",
    "A recipe for pancakes: first, mix",
    "In 1969, the first humans landed on",
    "The speed of light in a vacuum is approximately",
    "Q: What is the largest ocean on Earth?\nA:",
    "Here is a list of the planets in our solar system:",
    "SELECT name, age FROM users WHERE",
    "The theory of evolution by natural selection states that",
    "My favourite book is",
]


@dataclass(frozen=True)
class Run:
    name: str
    round: int
    seconds: float
    generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            outs.append(y[0, len(ids):].tolist())
    return outs


def pd_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def same_until_eos(ours: list[int], hf: list[int], eos: frozenset[int]) -> bool:
    """HF's min_new_tokens forbids EOS where ignore_eos lets it through: compare up to our first EOS."""
    end = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    return ours[:end] == hf[:end]


def timed(name: str, rnd: int, fn: Callable[..., list[list[int]]],
          *args: object) -> tuple[Run, list[list[int]]]:
    start = time.perf_counter()
    outs = fn(*args)
    seconds = time.perf_counter() - start
    return Run(name, rnd, seconds, sum(len(o) for o in outs)), outs


def sequential_pair(models: dict, prompts: list[list[int]], new_tokens: int,
                    rnd: int) -> list[tuple[Run, list[list[int]]]]:
    """HF and pdserve batch 1 alternate prompt by prompt, so a slowly changing background load hits both."""
    seconds = {"hf_sequential": 0.0, "pdserve_batch1": 0.0}
    outs: dict[str, list[list[int]]] = {"hf_sequential": [], "pdserve_batch1": []}
    for ids in prompts:
        for name, fn, model in (("hf_sequential", hf_generate, models["hf"]),
                                ("pdserve_batch1", pd_generate, models["pd1"])):
            run, out = timed(name, rnd, fn, model, [ids], new_tokens)
            seconds[name] += run.seconds
            outs[name] += out
    return [(Run(name, rnd, seconds[name], sum(len(o) for o in outs[name])), outs[name]) for name in seconds]


def load_all(cache_dir: Path, batch: int) -> tuple[dict, dict[str, float]]:
    from transformers import AutoModelForCausalLM

    gguf = fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], cache_dir, progress=False)
    loads: dict[str, float] = {}
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf.eval()
    loads["hf_from_gguf_s"] = time.perf_counter() - start
    start = time.perf_counter()
    options = {"num_blocks": 256, "max_num_batched_tokens": 1024, "enable_prefix_caching": False,
               "cache_dir": cache_dir, "progress": False}
    pd1 = LLM(max_num_seqs=1, **options)  # type: ignore[arg-type]
    loads["pdserve_llm_s"] = time.perf_counter() - start
    pd16 = LLM(max_num_seqs=batch, **options)  # type: ignore[arg-type]
    return {"hf": hf, "pd1": pd1, "pd16": pd16}, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every configuration (default: torch's, one per core)")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/offline_cpu.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env_cache = os.environ.get("PDSERVE_CACHE_DIR")
    cache_dir = args.cache_dir or (Path(env_cache) if env_cache else default_cache_dir())
    models, loads = load_all(cache_dir, args.prompts)
    tokenizer = models["pd1"].tokenizer
    prompts = [tokenizer.encode(p) for p in (PROMPTS * 4)[: args.prompts]]
    pd_generate(models["pd16"], prompts[:2], 4)  # warm-up: first calls allocate and page in
    pd_generate(models["pd1"], prompts[:1], 4)
    hf_generate(models["hf"], prompts[:1], 4)
    load_before = os.getloadavg()
    runs, outputs = run_rounds(models, prompts, args.new_tokens, args.rounds)
    eos = models["pd1"].eos_token_ids
    hf_outs = outputs["hf_sequential"]
    matches = {name: sum(same_until_eos(a, b, eos) for a, b in zip(outs, hf_outs, strict=True))
               for name, outs in outputs.items()}
    speedups = paired_speedups(runs)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "model": DEFAULT_MODEL, "dtype": "float32", "num_prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens, "load_seconds": loads,
        "best_tokens_per_s": {name: max(r.tokens_per_s for r in runs if r.name == name) for name in outputs},
        "speedup_vs_hf_median_of_rounds": {name: statistics.median(v) for name, v in speedups.items()},
        "speedup_vs_hf_per_round": speedups, "prompts_matching_hf_greedy": matches,
        "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def run_rounds(models: dict, prompts: list[list[int]], new_tokens: int,
               rounds: int) -> tuple[list[Run], dict[str, list[list[int]]]]:
    runs: list[Run] = []
    outputs: dict[str, list[list[int]]] = {}
    batched = f"pdserve_batch{len(prompts)}"
    for rnd in range(rounds):
        for run, outs in [*sequential_pair(models, prompts, new_tokens, rnd),
                          timed(batched, rnd, pd_generate, models["pd16"], prompts, new_tokens)]:
            runs.append(run)
            outputs[run.name] = outs
            print(f"round {rnd} {run.name:18s} {run.seconds:7.2f} s  {run.tokens_per_s:7.1f} tok/s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return runs, outputs


def paired_speedups(runs: list[Run]) -> dict[str, list[float]]:
    """Each configuration's throughput over HF's in the same round (the background load of that round)."""
    hf = {r.round: r.tokens_per_s for r in runs if r.name == "hf_sequential"}
    out: dict[str, list[float]] = {}
    for r in runs:
        out.setdefault(r.name, []).append(r.tokens_per_s / hf[r.round])
    return out


def print_table(result: dict) -> None:
    print(f"\n{'config':18s} {'best tok/s':>10s} {'vs HF (median of rounds)':>25s}   greedy = HF")
    for name, tps in result["best_tokens_per_s"].items():
        speedup = result["speedup_vs_hf_median_of_rounds"][name]
        print(f"{name:18s} {tps:10.1f} {speedup:24.2f}x   {result['prompts_matching_hf_greedy'][name]}/"
              f"{result['num_prompts']}")
    loads = result["load_seconds"]
    print(f"load: HF from GGUF {loads['hf_from_gguf_s']:.1f} s, pdserve LLM {loads['pdserve_llm_s']:.1f} s")

if __name__ == "__main__":
    main()
