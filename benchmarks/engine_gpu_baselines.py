"""The parts of benchmarks/engine_gpu.py that are not our engine's own step: HF transformers on the same
workloads, the cuda_ipc transfer between two processes against a device copy, and the bf16-vs-fp32 parity.

HF decode step = (generate of N + k new tokens - generate of N new tokens) / k, both with
cache_implementation="static" (transformers 5 then compiles the decode forward itself, generation/utils.py
_valid_auto_compile_criteria): the prefill and generate's setup cancel, what is left is one decode step as
an HF user gets it (compiled forward, logits processors, stopping checks). HF prefill: one eager forward of
the prompt with logits_to_keep=1, what generate's prefill runs.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.config import ModelConfig

PARITY_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at", "List three primary colors:",
    "Once upon a time, in a small village,", "The theory of relativity says", "SELECT name FROM users WHERE",
    "To make a cup of tea, first", "The largest planet in the solar system is", "import numpy as np\n",
    "Translate to French: Good morning", "The sum of 17 and 25 is", "A haiku about autumn:",
    "Photosynthesis is the process", "The first president of the United States was", "In 1969, humans",
    "My favourite book is", "HTTP status code 404 means", "The recipe needs two eggs and", "Q: What is DNA?\nA:",
]


def time_ms(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int) -> float:
    """Median wall time of fn in ms: CUDA events on a GPU (synchronised after each), perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def pipelined_ms(fn: Callable[[], object], device: torch.device, repeat: int, steps: int = 16) -> float:
    """Median time per call of `steps` calls back to back (one sync after them), of `repeat` such runs, in ms:
    the host's work for call N+1 overlaps the device's for call N, as in the decode worker's loop (async
    scheduling stages step N+1 while step N runs), where time_ms's per-call sync adds that work to each call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def hf_model(config: ModelConfig, device: torch.device) -> torch.nn.Module:
    """LlamaForCausalLM of the same shape, random bf16 weights, built in bf16 on the device (16 GB, not 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, max_position_embeddings=8192,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@torch.inference_mode()
def hf_decode_ms(model: torch.nn.Module, batch: int, context: int, device: torch.device, k: int = 64,
                 n: int = 16, repeat: int = 3) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)

    def generate(new: int) -> None:
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                       cache_implementation="static")

    short = time_ms(lambda: generate(n), device, repeat, warmup=2)  # warm-up compiles (once per batch shape)
    long = time_ms(lambda: generate(n + k), device, repeat, warmup=1)
    return (long - short) / k


@torch.inference_mode()
def hf_prefill_ms(model: torch.nn.Module, tokens: int, device: torch.device, repeat: int = 5) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    return time_ms(lambda: model(ids, logits_to_keep=1, use_cache=False), device, repeat, warmup=2)


@dataclass(frozen=True)
class TransferResult:
    bytes: int
    cuda_ipc_gpu_ms: float  # the copies' own span into D's pool (launches queued), median
    cuda_ipc_wall_ms: float  # P: first layer sent -> finish returned, median
    cuda_ipc_enqueue_ms_max: float  # P's Python enqueuing the 32 layers (gpu_ms is valid when this < the ~50 ms spin)
    device_copy_ms: float  # one contiguous copy of the same bytes on one GPU, median
    cuda_ipc_gbps: float  # from gpu_ms
    device_copy_gbps: float
    fraction_of_copy: float  # target >= 0.7


def transfer_benchmark(config: ModelConfig, tokens: int, device: torch.device, repeat: int = 5) -> TransferResult:
    """A 2-process cuda_ipc transfer of `tokens` tokens of KV (every layer) vs a device copy of its bytes."""
    from engine_gpu_ipc import BLOCK_SIZE, run_receiver

    blocks = tokens // BLOCK_SIZE
    nbytes = config.num_layers * 2 * blocks * BLOCK_SIZE * config.kv_size * 2  # bf16
    ipc = asyncio.run(run_receiver(config, blocks, repeat, device))
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy = time_ms(lambda: dst.copy_(src), device, repeat=10, warmup=2)
    ipc_gbps, copy_gbps = nbytes / ipc["gpu_ms"] / 1e6, nbytes / copy / 1e6
    return TransferResult(nbytes, ipc["gpu_ms"], ipc["wall_ms"], ipc["enqueue_ms_max"], copy, ipc_gbps, copy_gbps, ipc_gbps / copy_gbps)


def parity(device: torch.device, new_tokens: int = 16) -> dict[str, object]:
    """The default model's first greedy tokens in bf16 on the GPU against fp32 on the CPU, prompt by prompt, with
    HF transformers in bf16 on the same GPU beside ours (same prompt ids, same converted weights), and ours in
    fp16 (3 more mantissa bits than bf16, where the weights' range allows it). Where ours
    differs, the fp32 run's logprob gap between its top two tokens at the first differing step says how near a
    tie that step was (bf16 keeps 8 bits of mantissa: a logit near 16 moves in steps of 0.125)."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.weights.fetch import fetch_default_model
    from pdserve.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    outputs = {}
    runs = (("gpu_bf16", str(device), "bfloat16"), ("gpu_fp16", str(device), "float16"), ("cpu_fp32", "cpu", "float32"))
    for name, dev, dtype in runs:
        llm = LLM(device=dev, dtype=dtype, progress=False)
        prompt_ids = [llm.tokenizer.encode(p) for p in PARITY_PROMPTS]
        outputs[name] = llm.generate(prompt_ids, params)
        del llm
    ours = [o.token_ids for o in outputs["gpu_bf16"]]
    ref = [o.token_ids for o in outputs["cpu_fp32"]]
    hf = _hf_greedy(fetch_default_model(progress=False), prompt_ids, new_tokens, device)
    gaps = []
    for a, b, out in zip(ours, ref, outputs["cpu_fp32"], strict=True):
        if a != b:
            j = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            top = out.logprobs[j].top if out.logprobs and out.logprobs[j] else []
            gaps.append({"step": j, "fp32_top2_logprob_gap": top[0][1] - top[1][1] if len(top) > 1 else None,
                         "bf16_took_fp32_second": len(top) > 1 and a[j] == top[1][0]})
    same = [a == b for a, b in zip(ours, ref, strict=True)]
    return {"prompts": len(same), "same_first_tokens": sum(same), "fraction": sum(same) / len(same),
            "target_fraction": 0.9, "new_tokens": new_tokens,
            "hf_bf16_gpu_same_as_cpu_fp32": sum(h == b for h, b in zip(hf, ref, strict=True)),
            "ours_bf16_same_as_hf_bf16": sum(a == h for a, h in zip(ours, hf, strict=True)),
            "ours_fp16_same_as_cpu_fp32": sum(o.token_ids == b for o, b in zip(outputs["gpu_fp16"], ref, strict=True)),
            "first_difference": gaps}


@torch.inference_mode()
def _hf_greedy(model_dir, prompt_ids: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device=device)
        y = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
        out.append(y[0, len(ids):].tolist())
    del model
    return out
