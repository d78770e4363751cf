"""Where a synchronised decode step's time goes beyond the GPU's own: issue 19's row (llama3-8b, batch 64, 4,096
tokens of context, CUDA graphs), bf16 and fp8 KV. Per step, medians of --repeat:

    prepare_ms       host: DecodeBuffers.prepare (staging 64 block tables, the non-blocking copies queued)
    replay_host_ms   host: the graph's launch (CUDAGraph.replay returning)
    synced_ms        CUDA events around prepare + replay, as engine_gpu.py's synchronised rows time a step
    graph_queued_ms  CUDA events around the replay alone, queued behind a GPU sleep: the GPU's own time

synced - graph_queued is what the host adds to a step that is not overlapped with the previous one.
prepare_profile: where prepare's host time goes, cProfile over --repeat calls (each synchronised after): the
functions with the most own time, in us a call of prepare.

    python benchmarks/decode_host_time_gpu.py --out benchmarks/results/decode_host_time_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from engine_gpu_fp8kv import BATCH, BLOCK, CONTEXT, _items

from pdserve.engine.config import CacheConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights


def step_times(kv: str, repeat: int) -> dict[str, float]:
    config, device, dtype = get_preset("llama3-8b"), torch.device("cuda"), torch.bfloat16
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    runner = ModelRunner(config, CacheConfig(num_blocks=BATCH * per_seq, block_size=BLOCK),
                         dummy_weights(config, dtype, "cuda"), device, dtype, max_num_seqs=BATCH,
                         kv_spec=KVCacheSpec.build(kv, dtype, config.num_layers))
    assert runner.graphs is not None, "CUDA graphs are what the served step replays"
    items = _items(per_seq)
    for _ in range(5):
        runner.decode(items)
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {"prepare_ms": [], "replay_host_ms": [], "synced_ms": [], "graph_queued_ms": []}
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        batch = runner.decode_buffers.prepare(items)
        t1 = time.perf_counter()
        runner.graphs.replay(batch)
        t2 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        samples["prepare_ms"].append((t1 - t0) * 1e3)
        samples["replay_host_ms"].append((t2 - t1) * 1e3)
        samples["synced_ms"].append(start.elapsed_time(end))
        batch = runner.decode_buffers.prepare(items)
        torch.cuda._sleep(4_000_000)  # a few ms of GPU spin: the replay below is queued before it starts
        start.record()
        runner.graphs.replay(batch)
        end.record()
        torch.cuda.synchronize()
        samples["graph_queued_ms"].append(start.elapsed_time(end))
    result: dict = {key: statistics.median(values) for key, values in samples.items()}
    result["prepare_profile"] = _profile(runner, items, repeat)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _profile(runner: ModelRunner, items: list, repeat: int, top: int = 12) -> list[list]:
    """[function, calls a prepare, own us a prepare, cumulative us a prepare] for the `top` by own time."""
    profiler = cProfile.Profile()
    for _ in range(repeat):
        profiler.enable()
        runner.decode_buffers.prepare(items)
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{Path(f).name}:{line}({name})", calls / repeat, tot / repeat * 1e6, cum / repeat * 1e6]
            for (f, line, name), (calls, _, tot, cum, _) in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_host_time_h200.json"))
    args = parser.parse_args()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "batch": BATCH, "context": CONTEXT, "kv": {}}
    for kv in ("auto", "fp8"):
        report["kv"][kv] = step_times(kv, args.repeat)
        print(kv, {k: round(v, 3) for k, v in report["kv"][kv].items() if k != "prepare_profile"}, flush=True)
        for name, calls, own, cum in report["kv"][kv]["prepare_profile"]:
            print(f"   {own:8.1f} us own {cum:8.1f} cum {calls:6.1f} calls  {name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
