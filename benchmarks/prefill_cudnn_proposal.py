"""The cuDNN tuning entry benchmarks/prefill_4096_gpu.py proposes (issue 23): from its interleaved times of
`ours` and `cudnn` (and, for information, `ours_queued` / `cudnn_queued`: the GPU's own times), an entry of
tuning.PREFILL_PATH's format that sends whole uncached prompts of >= the run's length to cuDNN, only where
cuDNN wins beyond the run's spread. The lead decides whether to commit it (kernels/prefill_attention.py)."""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.engine.presets import get_preset
from pdserve.kernels.tuning import prefill_key


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def propose_entry(rows: dict, reps: int, config_name: str, dtype: torch.dtype) -> dict:
    """cuDNN for whole uncached prompts of >= this run's length, if its median beats ours by more than the
    larger interquartile range and it wins every round (round medians); else the numbers and why not."""
    ours, cudnn = rows.get("ours", {}), rows.get("cudnn", {})
    if "median_ms" not in ours or "median_ms" not in cudnn:
        return {"proposed": None, "why": "ours or cudnn did not run"}
    gain, spread = ours["median_ms"] - cudnn["median_ms"], max(_iqr(ours["times_ms"]), _iqr(cudnn["times_ms"]))
    rounds = [(statistics.median(o), statistics.median(c)) for o, c in
              zip(*([t[i:i + reps] for i in range(0, len(t), reps)] for t in (ours["times_ms"], cudnn["times_ms"])))]
    wins = sum(c < o for o, c in rounds)
    out = {"gain_ms": round(gain, 3), "spread_ms": round(spread, 3), "cudnn_wins_rounds": f"{wins}/{len(rounds)}"}
    oq, cq = rows.get("ours_queued", {}), rows.get("cudnn_queued", {})
    if "median_ms" in oq and "median_ms" in cq:  # the GPU's own times: the gain once no idle time is left
        out["queued_gain_ms"] = round(oq["median_ms"] - cq["median_ms"], 3)
    if gain <= spread or wins < len(rounds):
        return {**out, "proposed": None, "why": "cuDNN not faster beyond the run's spread in every round"}
    c = get_preset(config_name)
    key = prefill_key(torch.cuda.get_device_name(), dtype, c.num_heads, c.num_kv_heads, c.head_dim)
    entry = {"backend": "cudnn", "min_tokens": rows["tokens"], "max_seqs": 1, "date": time.strftime("%Y-%m-%d"),
             "command": "bash benchmarks/prefill_gaps_h200.sh (benchmarks/prefill_4096_gpu.py)",
             "measured": {"ours_ms": round(ours["median_ms"], 3), "cudnn_ms": round(cudnn["median_ms"], 3)}}
    return {**out, "proposed": {"version": 1, "entries": {key: entry}},
            "why": "min_tokens is this run's prompt length only; shorter prompts: benchmarks/prefill_attention_sdpa.py"}
