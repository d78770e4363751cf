"""Where a decode step's time goes on the GPU: each op of the step timed alone, then summed, beside the whole
CUDA-graphed step (benchmarks/engine_gpu.py's workloads, `--load-format dummy` llama3-8b in bf16).

    python benchmarks/engine_gpu_profile.py --out benchmarks/results/engine_gpu_profile_h200.json   (H200)

Per op, its 32 calls of one step (one per layer, each on that layer's own weights and KV pool, so L2 holds
nothing from one call to the next, as in the step) are captured as one CUDA graph and replayed: the median
replay time is the op's kernel time in the step, launch gaps left out. The step's own replay minus the sum
of its ops is what neither explains (gaps between kernels inside the graph, the padding copies of
DecodeBuffers). Weight-streaming ops report TB/s over the weight bytes they read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import BLOCK, build_runner, decode_items
from engine_gpu_baselines import time_ms

from pdserve import kernels
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner

SHAPES = ((1, 512), (8, 512), (64, 512), (1, 4096))


def graph_ms(fn: Callable[[], object], repeat: int = 20) -> float:
    """Median replay time of one CUDA graph of fn (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, torch.device("cuda"), repeat, warmup=3)


def step_ops(runner: ModelRunner, batch: int, context: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (the op's calls of one step, weight bytes they read)."""
    c, w, caches = runner.config, runner.model.weights, runner.kv_caches
    meta = runner.decode_buffers.prepare(decode_items(batch, context))
    rows = meta.input_ids.shape[0]  # the bucket
    dev, dt = runner.device, runner.dtype
    h = torch.randn(rows, c.hidden_size, device=dev, dtype=dt)
    res = torch.randn_like(h)
    q = torch.randn(rows, c.num_heads, c.head_dim, device=dev, dtype=dt)
    k = torch.randn(rows, c.num_kv_heads, c.head_dim, device=dev, dtype=dt)
    gate_up = torch.randn(rows, 2 * c.intermediate_size, device=dev, dtype=dt)
    act = torch.randn(rows, c.intermediate_size, device=dev, dtype=dt)
    layers = range(c.num_layers)
    nbytes = lambda t: t.numel() * t.element_size()
    return {
        "qkv_proj": (lambda: [kernels.linear(h, w.layers[i].qkv) for i in layers],
                     sum(nbytes(w.layers[i].qkv) for i in layers)),
        "o_proj": (lambda: [kernels.linear(h, w.layers[i].o_proj) for i in layers],
                   sum(nbytes(w.layers[i].o_proj) for i in layers)),
        "gate_up_proj": (lambda: [kernels.linear(h, w.layers[i].gate_up) for i in layers],
                         sum(nbytes(w.layers[i].gate_up) for i in layers)),
        "down_proj": (lambda: [kernels.linear(act, w.layers[i].down) for i in layers],
                      sum(nbytes(w.layers[i].down) for i in layers)),
        "lm_head": (lambda: kernels.linear(h, w.lm_head), nbytes(w.lm_head)),
        "decode_attention": (lambda: [kernels.decode_attention(q, caches[i], meta.seq_lens, meta.block_tables,
                                                               runner.model.scale) for i in layers], 0),
        "rope_kv_write": (lambda: [kernels.rope_kv_write(q, k, k, meta.positions, runner.model.cos_sin_cache,
                                                         caches[i], meta.slot_mapping) for i in layers], 0),
        "rms_norms": (lambda: [kernels.fused_add_rms_norm(h, res, w.layers[i % c.num_layers].post_norm,
                                                         c.rms_norm_eps) for i in range(2 * c.num_layers + 1)], 0),
        "silu_and_mul": (lambda: [kernels.silu_and_mul(gate_up) for _ in layers], 0),
    }


def profile(runner: ModelRunner) -> list[dict]:
    out = []
    for batch, context in SHAPES:
        items = decode_items(batch, context)
        step = time_ms(lambda items=items: runner.decode(items), runner.device, 30, warmup=3)
        ops = {}
        for name, (fn, weight_bytes) in step_ops(runner, batch, context).items():
            ms = graph_ms(fn)
            ops[name] = {"ms": ms, **({"weight_tbps": weight_bytes / ms / 1e9} if weight_bytes else {})}
        total = sum(o["ms"] for o in ops.values())
        out.append({"batch": batch, "context": context, "step_ms": step, "ops_sum_ms": total,
                    "unexplained_ms": step - total, "ops": ops})
        print(f"\nbatch {batch} ctx {context}: step {step:.3f} ms (graph), ops {total:.3f} ms, rest {step - total:.3f}")
        for name, o in sorted(ops.items(), key=lambda kv: -kv[1]["ms"]):
            bw = f"  {o['weight_tbps']:.2f} TB/s" if "weight_tbps" in o else ""
            print(f"  {name:18s} {o['ms']:7.3f} ms{bw}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_gpu_profile_h200.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    runner = build_runner(get_preset("llama3-8b"), device)
    prompt = [(7 * j) % runner.config.vocab_size for j in range(4096)]
    from pdserve.engine.attention_metadata import PrefillChunk
    runner.prefill([PrefillChunk(prompt, 0, list(range(4096 // BLOCK)))])
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(device),
              "model": "llama3-8b (dummy weights, bf16)", "shapes": profile(runner)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
