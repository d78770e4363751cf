"""Shared pieces of the kernel benchmarks: timing, rotation over input copies, result rows, the table."""

from __future__ import annotations

import math
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
    op: str
    case: str
    triton_us: float
    baseline: str
    baseline_us: float
    bytes: float = 0.0
    flops: float = 0.0
    rel_err: float = math.nan
    target: str = ""
    target_met: bool | None = None
    extra: dict = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return "TFLOP/s" if self.flops else "TB/s"

    def rate(self, us: float) -> float:
        work = self.flops if self.flops else self.bytes
        return work / (us * 1e-6) / 1e12 if us and not math.isnan(us) else math.nan

    @property
    def pct_ceiling(self) -> float:
        ceiling = GEMM_TFLOPS if self.flops else COPY_TBPS
        return 100 * self.rate(self.triton_us) / ceiling

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(unit=self.unit, triton_rate=self.rate(self.triton_us), baseline_rate=self.rate(self.baseline_us),
                 pct_ceiling=self.pct_ceiling, speedup=self.baseline_us / self.triton_us if self.triton_us else None)
        return d


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'op':16s} {'case':34s} {'triton us':>10s} {'rate':>8s} {'unit':7s} {'%ceil':>6s} "
            f"{'baseline':22s} {'base us':>9s} {'x base':>7s} {'relerr':>8s}  target")
    lines = [head, "-" * len(head)]
    for r in rows:
        met = "" if r.target_met is None else ("  MET" if r.target_met else "  MISSED")
        lines.append(
            f"{r.op:16s} {r.case:34s} {r.triton_us:10.1f} {r.rate(r.triton_us):8.2f} {r.unit:7s} "
            f"{r.pct_ceiling:6.1f} {r.baseline:22s} {r.baseline_us:9.1f} {r.baseline_us / r.triton_us:7.2f} "
            f"{r.rel_err:8.1e}  {r.target}{met}"
        )
    return "\n".join(lines)


def best_of(variants: dict[str, Callable[[], object]], rep_ms: float | None = None) -> tuple[str, float, dict]:
    """Times every variant (skipping ones that fail to compile or launch) -> (best name, its us, all times)."""
    times: dict[str, float] = {}
    for name, fn in variants.items():
        try:
            times[name] = bench_us(fn, rep_ms)
        except Exception as exc:  # noqa: BLE001 -- a config the chip cannot hold (smem, registers) is no result
            times[name] = math.nan
            print(f"  skipped {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    valid = {k: v for k, v in times.items() if not math.isnan(v)}
    if not valid:
        return next(iter(variants)), math.nan, times
    best = min(valid, key=valid.get)
    return best, valid[best], times
