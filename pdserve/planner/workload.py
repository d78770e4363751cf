"""Synthetic workloads for the planner: arrivals, prompt and output lengths, shared prefixes.

Lengths are drawn as `pdserve bench` draws them (pdserve.bench.datasets.LengthSpec), arrivals with the same
gamma process (pdserve.bench.runner.arrival_times), so a plan and a benchmark can describe one workload.
A prefix ratio f with G groups gives each prompt a shared prefix of f·(its length) tokens from one of G
groups: the part a prefill worker's prefix cache can skip once it has seen the group.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if self.num_requests <= 0:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        if not 0.0 <= self.prefix_ratio < 1.0:
            raise ValueError(f"prefix ratio must be in [0, 1), got {self.prefix_ratio}")
        if self.num_prefix_groups <= 0:
            raise ValueError(f"num_prefix_groups must be positive, got {self.num_prefix_groups}")

    def with_rate(self, rate: float) -> WorkloadSpec:
        return WorkloadSpec(rate, self.num_requests, self.input_len, self.output_len, self.prefix_ratio,
                            self.num_prefix_groups, self.burstiness, self.seed)


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
