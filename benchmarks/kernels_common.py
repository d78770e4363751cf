"""Shared pieces of the kernel benchmarks: timing, rotation over input copies, result rows, the table."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import triton

COPY_TBPS = 4.2  # BENCHMARKS.md: H200 device-to-device copy, bytes read + written
GEMM_TFLOPS = 757.0  # BENCHMARKS.md: H200 bf16 GEMM 8192^3 through cuBLAS
L2_BYTES = 60e6
DEVICE = "cuda"  # a CPU dry run of the scripts (interpreter, tiny shapes) sets "cpu"


@dataclass
class Settings:
    compile_only: bool = False  # run each variant once (fills Triton's cache), time nothing
    dry_run: bool = False  # CPU check of the scripts themselves: every time is 1 us
    dtype: torch.dtype = torch.bfloat16
    warmup_ms: float = 10.0
    rep_ms: float = 50.0


SETTINGS = Settings()


def bench_us(fn: Callable[[], object], rep_ms: float | None = None) -> float:
    """Median time of fn in microseconds (triton.testing.do_bench: CUDA events, L2 flushed before each call)."""
    fn()
    if SETTINGS.dry_run:
        return 1.0
    torch.cuda.synchronize()
    if SETTINGS.compile_only:
        return math.nan
    ms = triton.testing.do_bench(fn, warmup=SETTINGS.warmup_ms, rep=rep_ms or SETTINGS.rep_ms, return_mode="median")
    return ms * 1e3


def graph_us(fn: Callable[[], object], rep_ms: float = 5.0) -> float:
    """Median per-call time over CUDA-graph replays of back-to-back calls (NaN where fn cannot be captured)."""
    if SETTINGS.dry_run:
        return 1.0
    if SETTINGS.compile_only:
        return math.nan
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    except Exception as exc:  # noqa: BLE001 -- e.g. a torch reference that syncs (boolean indexing) in capture
        print(f"  no graph timing: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        torch.cuda.synchronize()
        return math.nan


def cpu_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host time per call with the GPU kept ahead (the launcher's own cost when the kernel is short)."""
    if SETTINGS.dry_run or SETTINGS.compile_only:
        return math.nan
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def device_name() -> str:
    return "dry-run" if SETTINGS.dry_run else torch.cuda.get_device_name()


def sm_count() -> int:
    return 132 if SETTINGS.dry_run else torch.cuda.get_device_properties(0).multi_processor_count


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One call per invocation, cycling over closures bound to different input copies (defeats L2 reuse)."""
    state = {"i": 0}

    def run() -> object:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return run


def copies_for(nbytes: float, at_least: int = 2) -> int:
    """How many input copies make the rotation's working set >= 4x the L2."""
    return max(at_least, math.ceil(4 * L2_BYTES / max(nbytes, 1)))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere gives NaN)."""
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


@dataclass
class Row:
    """One kernel vs its baseline. *_us: do_bench medians (L2 flushed by a 256 MB memset before each call, so
    the call also pays for writing back ~50 MB of dirty L2, and a slow host launch shows as idle time);
    *_graph_us: medians over CUDA-graph replays of back-to-back calls on rotated inputs (GPU time in steady
    state, no host launch cost: how the engine's captured decode step runs them); cpu_us: host time per call
    of the Triton launcher."""

    op: str
    case: str
    triton_us: float
    baseline: str
    baseline_us: float
    triton_graph_us: float = math.nan
    baseline_graph_us: float = math.nan
    cpu_us: float = math.nan
    bytes: float = 0.0
    flops: float = 0.0
    rel_err: float = math.nan
    target: str = ""
    target_met: bool | None = None  # on the do_bench time
    target_met_graph: bool | None = None  # on the graph time
    extra: dict = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return "TFLOP/s" if self.flops else "TB/s"

    def rate(self, us: float) -> float:
        work = self.flops if self.flops else self.bytes
        return work / (us * 1e-6) / 1e12 if us and not math.isnan(us) else math.nan

    def pct(self, us: float) -> float:
        return 100 * self.rate(us) / (GEMM_TFLOPS if self.flops else COPY_TBPS)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(unit=self.unit, triton_rate=self.rate(self.triton_us), baseline_rate=self.rate(self.baseline_us),
                 triton_graph_rate=self.rate(self.triton_graph_us), pct_ceiling=self.pct(self.triton_us),
                 pct_ceiling_graph=self.pct(self.triton_graph_us), speedup=self.baseline_us / self.triton_us,
                 speedup_graph=self.baseline_graph_us / self.triton_graph_us)
        return d


def timed(row: Row, triton_fn: Callable[[], object], base_fn: Callable[[], object] | None,
          check: Callable[[Row, float], bool] | None = None, base_graph: bool = True) -> Row:
    """Fills row's times (both methods, both sides) and, given check(row, us), its two target verdicts.
    base_graph=False for baselines that cannot be captured (they sync: a failed capture poisons the process)."""
    row.triton_us, row.triton_graph_us, row.cpu_us = bench_us(triton_fn), graph_us(triton_fn), cpu_us(triton_fn)
    if base_fn is not None:
        row.baseline_us = bench_us(base_fn)
        row.baseline_graph_us = graph_us(base_fn) if base_graph else math.nan
    if check is not None:
        row.target_met, row.target_met_graph = check(row, row.triton_us), check(row, row.triton_graph_us)
    return row


def _verdict(met: bool | None) -> str:
    return "" if met is None else ("MET" if met else "MISSED")


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'op':14s} {'case':30s} {'triton us':>9s} {'graph us':>8s} {'rate':>7s} {'graph':>7s} {'unit':7s} "
            f"{'%ceil':>5s} {'%c gr':>5s} {'baseline':20s} {'base us':>8s} {'b graph':>8s} {'x base':>6s} "
            f"{'x b gr':>6s} {'cpu us':>6s} {'relerr':>7s}  target (do_bench / graph)")
    lines = [head, "-" * len(head)]
    for r in rows:
        verdict = f"  {_verdict(r.target_met)} / {_verdict(r.target_met_graph)}" if r.target else ""
        lines.append(
            f"{r.op:14s} {r.case:30s} {r.triton_us:9.1f} {r.triton_graph_us:8.1f} {r.rate(r.triton_us):7.2f} "
            f"{r.rate(r.triton_graph_us):7.2f} {r.unit:7s} {r.pct(r.triton_us):5.1f} {r.pct(r.triton_graph_us):5.1f} "
            f"{r.baseline:20s} {r.baseline_us:8.1f} {r.baseline_graph_us:8.1f} {r.baseline_us / r.triton_us:6.2f} "
            f"{r.baseline_graph_us / r.triton_graph_us:6.2f} {r.cpu_us:6.1f} {r.rel_err:7.1e}  {r.target}{verdict}"
        )
    return "\n".join(lines)


def best_of(
    variants: dict[str, Callable[[], object]], rep_ms: float | None = None, graph: bool = False
) -> tuple[str, float, dict]:
    """Times every variant (do_bench, or graph replay) skipping ones that fail to compile or launch
    -> (best name, its us, all times)."""
    times: dict[str, float] = {}
    for name, fn in variants.items():
        try:
            times[name] = graph_us(fn) if graph and not SETTINGS.compile_only else bench_us(fn, rep_ms)
        except Exception as exc:  # noqa: BLE001 -- a config the chip cannot hold (smem, registers) is no result
            times[name] = math.nan
            print(f"  skipped {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    valid = {k: v for k, v in times.items() if not math.isnan(v)}
    if not valid:
        return next(iter(variants)), math.nan, times
    best = min(valid, key=valid.get)
    return best, valid[best], times
