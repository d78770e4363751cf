"""Serving metrics from recorded request timings, computed as `vllm bench serve` computes them (so results
compare): TTFT; TPOT = (E2E - TTFT) / (output tokens - 1) for requests of 2+ tokens; ITL = every gap between
chunks of every request; E2E latency. Statistics in ms: mean, median, std (population), percentiles (numpy's
linear interpolation). Goodput = requests per second that meet every given SLO (TTFT, TPOT, E2E in ms).
Multi-turn runs also get TTFT by turn index (turn 1 is the fresh prompt, later turns carry the history)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.client import RequestOutput
from pdserve.bench.tokenizer import CountingTokenizer

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class SLOs:
    """Service-level objectives in ms; None = not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> SLOs:
        """['ttft:200', 'tpot:50'] (the form of --goodput) -> SLOs(200, 50)."""
        values: dict[str, float] = {}
        for item in items or []:
            name, sep, value = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
            if float(value) <= 0:
                raise ValueError(f"an SLO must be positive, got {item!r}")
            values[f"{name}_ms"] = float(value)
        return cls(**values)

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms)) if v}


@dataclass(frozen=True)
class MetricStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]  # (percentile, value)

    @classmethod
    def of(cls, values_s: list[float], percentiles: list[float]) -> MetricStats:
        ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   tuple((p, float(np.percentile(ms, p))) for p in percentiles))


@dataclass(frozen=True)
class PerRequest:
    """Per-request numbers behind the statistics (successful requests only, in ms where timed)."""

    input_lens: list[int]
    output_lens: list[int]
    ttfts_s: list[float]
    tpots_s: list[float]
    itls_s: list[float]
    e2els_s: list[float]
    good: list[bool]


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, MetricStats]
    per_request: PerRequest = field(repr=False)
    ttft_by_turn: dict[int, MetricStats] = field(default_factory=dict)  # turn (1, 2, ...): multi-turn runs only

    def to_dict(self, selected: tuple[str, ...] = METRICS) -> dict[str, float | int]:
        """Flat dict with vLLM's field names: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..."""
        out: dict[str, float | int] = {
            name: getattr(self, name)
            for name in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                         "request_throughput", "request_goodput", "output_throughput", "total_token_throughput")
        }
        for metric in selected:
            s = self.stats[metric]
            out.update({f"mean_{metric}_ms": s.mean_ms, f"median_{metric}_ms": s.median_ms,
                        f"std_{metric}_ms": s.std_ms})
            out.update({f"p{percentile_word(p)}_{metric}_ms": v for p, v in s.percentiles_ms})
        return out


def percentile_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def output_tokens(out: RequestOutput, tokenizer: CountingTokenizer | None) -> int:
    """The server's count, else the tokenizer's count of the text, else one token per chunk; an empty answer
    (EOS first) without usage counts 0."""
    if out.output_len > 0 or not out.generated_text:
        return out.output_len
    if tokenizer is not None:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return len(out.itl) + 1


def per_request(outputs: list[RequestOutput], slos: SLOs, tokenizer: CountingTokenizer | None) -> PerRequest:
    rows = PerRequest([], [], [], [], [], [], [])
    for out in outputs:
        if not out.success:
            continue
        n_out = output_tokens(out, tokenizer)
        tpot = (out.latency - out.ttft) / (n_out - 1) if n_out > 1 else 0.0
        rows.input_lens.append(out.prompt_len or out.server_prompt_tokens)
        rows.output_lens.append(n_out)
        rows.ttfts_s.append(out.ttft)
        rows.itls_s.extend(out.itl)
        rows.e2els_s.append(out.latency)
        if n_out > 1:
            rows.tpots_s.append(tpot)
        rows.good.append(meets(slos, out.ttft, tpot, out.latency))
    return rows


def ttft_by_turn(outputs: list[RequestOutput], percentiles: list[float]) -> dict[int, MetricStats]:
    """TTFT statistics per turn index (1-based) of the successful requests; empty when every request is a
    first turn (a single-turn data set)."""
    if all(out.turn == 0 for out in outputs):
        return {}
    by_turn: dict[int, list[float]] = {}
    for out in outputs:
        if out.success:
            by_turn.setdefault(out.turn + 1, []).append(out.ttft)
    return {turn: MetricStats.of(values, percentiles) for turn, values in sorted(by_turn.items())}


def meets(slos: SLOs, ttft_s: float, tpot_s: float, e2el_s: float) -> bool:
    checks = ((slos.ttft_ms, ttft_s), (slos.tpot_ms, tpot_s), (slos.e2el_ms, e2el_s))
    return all(slo is None or value * 1000.0 <= slo for slo, value in checks)


def compute_metrics(
    outputs: list[RequestOutput],
    duration: float,
    slos: SLOs = SLOs(),
    percentiles: list[float] | None = None,
    tokenizer: CountingTokenizer | None = None,
) -> BenchmarkMetrics:
    """All statistics of one run; `duration` (s) is the wall time of the whole run."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    pcts = percentiles if percentiles is not None else [90.0, 99.0]
    rows = per_request(outputs, slos, tokenizer)
    completed, total_in, total_out = len(rows.ttfts_s), sum(rows.input_lens), sum(rows.output_lens)
    good = sum(rows.good) if slos.is_set() else completed
    series = {"ttft": rows.ttfts_s, "tpot": rows.tpots_s, "itl": rows.itls_s, "e2el": rows.e2els_s}
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration=duration,
        request_throughput=completed / duration,
        request_goodput=good / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        stats={m: MetricStats.of(v, pcts) for m, v in series.items()},
        per_request=rows,
        ttft_by_turn=ttft_by_turn(outputs, pcts),
    )
