"""Prompt logprobs (`echo` with `logprobs`, vLLM's `prompt_logprobs`): the logprob of every prompt token given the
ones before it, from the logits of a prefill chunk's rows. One definition for the prefill worker and the offline
engine, so both report the same numbers.

    prompt:  t0   t1   t2   t3        a chunk of positions [start, end) computes rows start..end-1;
    row:     r0   r1   r2   r3        row p's logits predict token p + 1: entry(t[p+1]) from row p;
    entry:   None e1   e2   e3        t0 has none; the prompt's last row predicts the first output token
                                      (sampled, not an entry)

Each entry is {"token_id", "logprob", "rank", "top": [[id, logprob], ...]}: the raw model distribution
(log_softmax of fp32 logits), `rank` 1 for the likeliest token (vLLM's Logprob.rank).

A cached prefix has no logits: a request that asks for prompt logprobs skips the prefix cache (its whole
prompt is computed; its blocks are still committed for others), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.kernels.host_copy import to_device

ROWS_PER_SLICE = 256  # log_softmax, rank and top-k of this many rows, then a tick (engine/step_liveness.py)

PromptLogprobs = list[dict[str, Any] | None]


def chunk_entries(logits: torch.Tensor, prompt: list[int], start: int, k: int,
                  tick: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Entries for prompt tokens start+1 .. of the rows of one chunk (logits [rows, V], rows from `start`), a
    slice of ROWS_PER_SLICE rows at a time with tick() after each (a long prompt's rows are seconds of CPU)."""
    targets = prompt[start + 1:start + 1 + logits.shape[0]]
    entries: list[dict[str, Any]] = []
    for first in range(0, len(targets), ROWS_PER_SLICE):
        entries += _entries(logits[first:first + ROWS_PER_SLICE], targets[first:first + ROWS_PER_SLICE], k)
        if tick is not None:
            tick()
    return entries


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[str, Any]]:
    logprobs = logits[: len(targets)].float().log_softmax(dim=-1)
    ids = to_device(targets, torch.long, logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    top_values_l, top_ids_l = top_values.tolist(), top_ids.tolist()
    return [{"token_id": token, "logprob": chosen_l[i], "rank": ranks_l[i],
             "top": [[t, lp] for t, lp in zip(top_ids_l[i], top_values_l[i], strict=True)]}
            for i, token in enumerate(targets)]
