"""Synthetic workloads for the planner: arrivals, prompt and output lengths, shared prefixes.

Lengths are drawn as `pdserve bench` draws them (pdserve.bench.datasets.LengthSpec), arrivals with the same
gamma process (pdserve.bench.runner.arrival_times), so a plan and a benchmark can describe one workload.
A prefix ratio f with G groups gives each prompt a shared prefix of f·(its length) tokens from one of G
groups: the part a prefill worker's prefix cache can skip once it has seen the group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pdserve.bench.datasets import LengthSpec
from pdserve.bench.runner import arrival_times


@dataclass(frozen=True)
class WorkloadSpec:
    request_rate: float
    num_requests: int
    input_len: LengthSpec
    output_len: LengthSpec
    prefix_ratio: float = 0.0
    num_prefix_groups: int = 1
    burstiness: float = 1.0
    seed: int = 0
    recorded_lens: tuple[tuple[int, int], ...] = ()  # (input, output) pairs to draw from instead of the specs

    def __post_init__(self) -> None:
        if self.num_requests <= 0:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        if not 0.0 <= self.prefix_ratio < 1.0:
            raise ValueError(f"prefix ratio must be in [0, 1), got {self.prefix_ratio}")
        if self.num_prefix_groups <= 0:
            raise ValueError(f"num_prefix_groups must be positive, got {self.num_prefix_groups}")

    def with_rate(self, rate: float) -> WorkloadSpec:
        return replace(self, request_rate=rate)

    @classmethod
    def from_bench_result(cls, path: str | Path, request_rate: float, num_requests: int, **kwargs: object) -> WorkloadSpec:
        """The (input, output) length pairs a `pdserve bench --save-result` run sent, drawn with replacement."""
        raw = json.loads(Path(path).read_text())
        pairs = tuple((int(i), int(o)) for i, o in zip(raw["input_lens"], raw["output_lens"]) if i > 0 and o > 0)
        if not pairs:
            raise ValueError(f"{path} has no requests with known input and output lengths")
        mean_in = max(1, round(float(np.mean([p[0] for p in pairs]))))
        mean_out = max(1, round(float(np.mean([p[1] for p in pairs]))))
        return cls(request_rate, num_requests, LengthSpec(mean_in), LengthSpec(mean_out), recorded_lens=pairs,
                   **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Workload:
    """Per-request arrays, index = request id, arrivals sorted."""

    arrival: np.ndarray  # s
    input_len: np.ndarray  # tokens
    output_len: np.ndarray  # tokens (>= 1; the first comes from the prefill worker)
    prefix_len: np.ndarray  # leading tokens shared with the request's group
    group: np.ndarray  # prefix group id

    def __len__(self) -> int:
        return int(self.arrival.size)


def make_workload(spec: WorkloadSpec) -> Workload:
    rng = np.random.default_rng(spec.seed)
    if spec.recorded_lens:
        pairs = np.asarray(spec.recorded_lens, dtype=np.int64)[rng.integers(0, len(spec.recorded_lens),
                                                                             spec.num_requests)]
        in_lens, out_lens = pairs[:, 0], pairs[:, 1]
    else:
        in_lens = spec.input_len.sample(rng, spec.num_requests)
        out_lens = spec.output_len.sample(rng, spec.num_requests)
    arrivals = arrival_times(spec.num_requests, spec.request_rate, spec.burstiness, rng)
    return Workload(
        arrival=arrivals,
        input_len=in_lens,
        output_len=out_lens,
        prefix_len=np.floor(in_lens * spec.prefix_ratio).astype(np.int64),
        group=rng.integers(0, spec.num_prefix_groups, spec.num_requests),
    )


def workload_from_lengths(arrivals: np.ndarray, input_lens: list[int], output_lens: list[int]) -> Workload:
    """A recorded workload (e.g. the lengths a benchmark sent), without shared prefixes."""
    n = len(input_lens)
    return Workload(np.asarray(arrivals, dtype=np.float64), np.asarray(input_lens, dtype=np.int64),
                    np.asarray(output_lens, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
