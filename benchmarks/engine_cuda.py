"""The engine on a CUDA GPU (Triton kernels): correctness against transformers on tiny random models, then
forward times of the Llama-3-8B shape with random bf16 weights (no CUDA graphs yet).

    python benchmarks/engine_cuda.py --out benchmarks/results/engine_cuda_h200.json

Checks: prefill and decode logits against transformers (fp32 on CPU) for Llama, Qwen2 (biases), Llama 3 rope
scaling and tied embeddings, in fp32 and bf16; chunked prefill = one pass; a padded decode bucket = unpadded.
Times (CUDA events, median of 20 after 3 warm-ups): decode steps at batch 1/8/64 with 512 tokens of context,
and a 4096-token prefill, beside BENCHMARKS.md's HF and target numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from engine_gpu_baselines import time_ms
from tiny_hf_models import KINDS, hf_last_logits, make_tiny

from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights

# BENCHMARKS.md, H200, Llama-3-8B shape: (HF static cache + compile, pdserve target) in ms
ANCHORS = {"decode_b1_ctx512": (7.14, 4.4), "decode_b8_ctx512": (8.49, 4.6), "decode_b64_ctx512": (20.0, 6.5),
           "prefill_4096": (133.0, 100.0)}


def check_tiny(kind: str, dtype: torch.dtype, root: Path) -> dict[str, float]:
    tiny = make_tiny(kind, root / kind)
    runner = ModelRunner(tiny.config, CacheConfig(num_blocks=64, block_size=16), tiny.weights, "cuda", dtype,
                         max_num_seqs=8, decode_buckets=[4, 8])
    ids = torch.randint(3, 96, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = runner.prefill([PrefillChunk(ids, 0, [0, 1, 2])]).logits[0].cpu()
    for start in range(0, 37, 16):  # the same prompt again, chunked, into other blocks
        out = runner.prefill([PrefillChunk(ids[start:start + 16], start, [3, 4, 5], start + 16 >= 37)])
    chunked = out.logits[0].cpu()
    decoded = runner.decode([DecodeInput(7, 37, [0, 1, 2])])[0].cpu()  # bucket 4: one real row, three padded
    return {
        "prefill_vs_hf": float((whole - hf_last_logits(tiny.hf, ids)).abs().max()),
        "decode_vs_hf": float((decoded - hf_last_logits(tiny.hf, ids + [7])).abs().max()),
        "chunked_vs_whole": float((chunked - whole).abs().max()),
    }


def cuda_ms(fn: Callable[[], object], repeat: int = 20, warmup: int = 3) -> float:
    return time_ms(fn, torch.device("cuda"), repeat, warmup)


def time_llama3_8b() -> dict[str, float]:
    config = get_preset("llama3-8b")
    weights = dummy_weights(config, torch.bfloat16, "cuda")
    runner = ModelRunner(config, CacheConfig(num_blocks=4096, block_size=16), weights, "cuda", torch.bfloat16,
                         max_num_seqs=64)
    del weights
    results: dict[str, float] = {}
    for batch in (1, 8, 64):
        tables = [list(range(i * 33, i * 33 + 33)) for i in range(batch)]  # 33 blocks: 528 slots
        items = [DecodeInput(11, 512, t) for t in tables]
        results[f"decode_b{batch}_ctx512"] = cuda_ms(lambda items=items: runner.decode(items))
    chunk = [PrefillChunk([(7 * j) % 1000 for j in range(4096)], 0, list(range(256)))]
    results["prefill_4096"] = cuda_ms(lambda: runner.prefill(chunk), repeat=5)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_cuda.json"))
    args = parser.parse_args()
    checks: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            for dtype in (torch.float32, torch.bfloat16):
                checks[f"{kind}-{str(dtype).removeprefix('torch.')}"] = check_tiny(kind, dtype, Path(tmp))
    for name, values in checks.items():
        print(f"{name:24s} " + "  ".join(f"{k} {v:.2e}" for k, v in values.items()), flush=True)
    times = time_llama3_8b()
    print(f"\n{'llama3-8b bf16':20s} {'pdserve ms':>10s} {'HF ms':>7s} {'target':>7s}")
    for name, ms in times.items():
        hf, target = ANCHORS[name]
        print(f"{name:20s} {ms:10.2f} {hf:7.2f} {target:7.2f}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "tiny_model_max_abs_logit_diff": checks, "llama3_8b_bf16_ms": times,
              "anchors_ms_hf_and_target": ANCHORS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
