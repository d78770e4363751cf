"""Latency models of one worker, fitted by least squares on measured steps (DistServe's forms):

  prefill iteration  t ≈ a·Σl + b·Σl·(s+l) + c     l = chunk tokens, s = tokens already cached before the
                                                      chunk (s = 0 for a whole prompt: the l² attention term)
  decode step        t ≈ a·Σctx + p·batch·max(ctx)  ctx = tokens each sequence attends over; the p term:
                         + b·batch + c                attention that pads every row to the longest (CPU);
                         + m·[batch > 1]              the m term: a one-row step's matmuls are GEMVs

The padded term is there because the CPU decode attention (kernels/decode_attention.py) gathers every row up
to the batch's longest context: on one thread (SmolLM2-135M, fp32, 2-core machine), one 1,024-token sequence
among 15 of 64 tokens (Σctx 1,984) made a step cost 382 ms, more than 16 × 256 (Σctx 4,096: 221 ms) and near
16 × 1,024 (464 ms); `OMP_NUM_THREADS=1 taskset -c 0 pdserve profile --device cpu --repeats 2 --decode-batches
1,2,4,8,16,32 --max-num-batched-tokens 1024`, 2026-12-01. A GPU kernel that stops at each row's end fits p ≈ 0;
the profile measures batches of mixed contexts so that the two terms can be told apart.

The multi-row term is there because on CPU torch's linear layers take a matrix-vector path for one row and a
matrix-matrix path for more, which costs more per weight read at few rows: steps at 64-token contexts took 65 /
95 / 113 / 125 ms at batch 1 / 2 / 4 / 8 (one thread, SmolLM2-135M, fp32, 2-core machine: the profile in
benchmarks/results/plan_validation_cpu.json, 2026-12-01). Fitted without the term, a line through all the
samples prices batch 1 at 79 ms (21% high) and batch 2 at 84 ms (12% low); with it (m = 27 ms) 66 and 97 ms.
Where one row costs what two do, the fit gives m ≈ 0 (not yet measured on a GPU).

A `Profile` holds both fits, the R² of each, the samples they came from and what the planner needs to know
about KV (bytes per token, block size); it is saved as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PREFILL_TERMS = ("sum_tokens", "sum_attn", "const")
DECODE_TERMS = ("sum_ctx", "pad_ctx", "batch", "const", "multi_row")  # pad_ctx = batch·max(ctx); multi_row = [batch > 1]


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill iteration: the chunks' lengths and cached-prefix lengths, and its time (s)."""

    lens: tuple[int, ...]
    seconds: float
    starts: tuple[int, ...] = ()  # empty: every chunk starts at position 0

    def features(self) -> tuple[float, float, float]:
        starts = self.starts or (0,) * len(self.lens)
        return prefill_features(self.lens, starts)


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode step: batch size, the batch's total context (tokens), its time (s) and its longest
    context (0: every sequence has sum_ctx / batch)."""

    batch: int
    sum_ctx: int
    seconds: float
    max_ctx: int = 0

    def features(self) -> tuple[float, ...]:
        return decode_features(self.batch, self.sum_ctx, self.max_ctx)


def decode_features(batch: int, sum_ctx: int, max_ctx: int = 0) -> tuple[float, ...]:
    """In DECODE_TERMS order; max_ctx 0: a uniform batch (every sequence sum_ctx / batch long)."""
    longest = max_ctx if max_ctx > 0 else sum_ctx / max(batch, 1)
    return (float(sum_ctx), float(batch) * longest, float(batch), 1.0, float(batch > 1))


def prefill_features(lens: tuple[int, ...] | list[int], starts: tuple[int, ...] | list[int]) -> tuple[float, float, float]:
    return (float(sum(lens)), float(sum(n * (s + n) for n, s in zip(lens, starts))), 1.0)


@dataclass(frozen=True)
class LinearFit:
    """t ≈ Σ coef[i]·feature[i]; r2 is the coefficient of determination on the fitted samples."""

    terms: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float

    def __post_init__(self) -> None:
        if len(self.terms) != len(self.coef):
            raise ValueError(f"a fit needs one coefficient per term: {len(self.terms)} terms {self.terms}, "
                             f"{len(self.coef)} coefficients {self.coef}")

    def predict(self, features: tuple[float, ...]) -> float:
        return float(sum(c * f for c, f in zip(self.coef, features)))

    def coef_of(self, term: str) -> float:
        """A term's coefficient; 0 for a term the fit does not have (a profile saved before it existed)."""
        return self.coef[self.terms.index(term)] if term in self.terms else 0.0

    def predict_named(self, features: dict[str, float]) -> float:
        return float(sum(c * features[t] for t, c in zip(self.terms, self.coef)))

    def as_dict(self) -> dict[str, Any]:
        return {"terms": list(self.terms), "coef": list(self.coef), "r2": self.r2,
                **{name: value for name, value in zip(self.terms, self.coef)}}


def fit_linear(features: np.ndarray, seconds: np.ndarray, terms: tuple[str, ...]) -> LinearFit:
    """Least squares on relative error (rows scaled by 1/t, so a 5 ms step counts as much as a 500 ms one),
    with every coefficient >= 0: a negative per-token cost or intercept is noise, and would make the model
    predict negative times. The exact non-negative solution is the best of the 2^k - 1 subsets of terms (the
    active set of a non-negative least-squares solution is one of them; 15 subsets for the decode fit)."""
    if features.shape[0] < features.shape[1]:
        raise ValueError(f"need at least {features.shape[1]} samples to fit {terms}, got {features.shape[0]}")
    weight = 1.0 / np.maximum(seconds, 1e-9)
    x, y = features * weight[:, None], seconds * weight
    best, best_err = np.zeros(features.shape[1]), np.inf
    for mask in range(1, 1 << features.shape[1]):
        cols = [i for i in range(features.shape[1]) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(features.shape[1])
        coef[cols] = sol
        err = float(((x @ coef - y) ** 2).sum())
        if err < best_err:
            best, best_err = coef, err
    residual = seconds - features @ best
    total = float(((seconds - seconds.mean()) ** 2).sum())
    r2 = 1.0 - float((residual ** 2).sum()) / total if total > 0 else 1.0
    return LinearFit(terms, tuple(float(c) for c in best), r2)


def fit_prefill(samples: list[PrefillSample]) -> LinearFit:
    x = np.array([s.features() for s in samples], dtype=np.float64)
    return fit_linear(x, np.array([s.seconds for s in samples]), PREFILL_TERMS)


def fit_decode(samples: list[DecodeSample]) -> LinearFit:
    x = np.array([s.features() for s in samples], dtype=np.float64)
    return fit_linear(x, np.array([s.seconds for s in samples]), DECODE_TERMS)


@dataclass(frozen=True)
class Profile:
    """What `pdserve profile` measured on one worker, and what `pdserve plan` reads."""

    model: str
    device: str
    dtype: str
    kv_bytes_per_token: int
    block_size: int
    prefill: LinearFit
    decode: LinearFit
    prefill_samples: list[PrefillSample] = field(default_factory=list)
    decode_samples: list[DecodeSample] = field(default_factory=list)

    def prefill_time(self, lens: list[int], starts: list[int] | None = None) -> float:
        return max(0.0, self.prefill.predict(prefill_features(lens, starts or [0] * len(lens))))

    def decode_time(self, batch: int, sum_ctx: int, max_ctx: int = 0) -> float:
        """One step; max_ctx 0: a uniform batch. A profile saved with older, fewer terms still reads."""
        features = dict(zip(DECODE_TERMS, decode_features(batch, sum_ctx, max_ctx), strict=True))
        return max(0.0, self.decode.predict_named(features))

    def decode_coef(self) -> tuple[float, float, float, float, float]:
        """(sum_ctx, pad_ctx, batch, const, multi_row) coefficients, 0 for a term the fit lacks."""
        return tuple(self.decode.coef_of(t) for t in DECODE_TERMS)  # type: ignore[return-value]

    def to_json(self) -> str:
        return json.dumps({
            "model": self.model, "device": self.device, "dtype": self.dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token, "block_size": self.block_size,
            "prefill_fit": self.prefill.as_dict(), "decode_fit": self.decode.as_dict(),
            "prefill_samples": [asdict(s) for s in self.prefill_samples],
            "decode_samples": [asdict(s) for s in self.decode_samples],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """ValueError, saying what is wrong, for text that is not a profile `pdserve profile` wrote."""
        written_by = "a profile is the JSON object `pdserve profile` writes"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc}); {written_by}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object; {written_by}")  # noqa: TRY004 (one kind)
        try:
            return cls._from_raw(raw)
        except KeyError as exc:
            raise ValueError(f"no {exc} field; {written_by}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"a malformed field ({exc}); {written_by}") from None

    @classmethod
    def _from_raw(cls, raw: dict[str, Any]) -> Profile:
        return cls(
            model=raw["model"], device=raw["device"], dtype=raw["dtype"],
            kv_bytes_per_token=int(raw["kv_bytes_per_token"]), block_size=int(raw["block_size"]),
            prefill=_fit_from(raw["prefill_fit"]), decode=_fit_from(raw["decode_fit"]),
            prefill_samples=[PrefillSample(tuple(s["lens"]), s["seconds"], tuple(s.get("starts", ())))
                             for s in raw.get("prefill_samples", [])],
            decode_samples=[DecodeSample(s["batch"], s["sum_ctx"], s["seconds"], s.get("max_ctx", 0))
                            for s in raw.get("decode_samples", [])],
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(Path(path).read_text())


def _fit_from(raw: dict[str, Any]) -> LinearFit:
    return LinearFit(tuple(raw["terms"]), tuple(float(c) for c in raw["coef"]), float(raw["r2"]))


MIN_R2 = 0.8  # below it the fit explains too little of the measured times for a plan to lean on


def fit_warnings(profile: Profile, min_r2: float = MIN_R2) -> list[str]:
    """One line per fit whose R² is below `min_r2`, saying what it means and what to do."""
    warnings = []
    for phase, fit, samples in (("prefill", profile.prefill, profile.prefill_samples),
                                ("decode", profile.decode, profile.decode_samples)):
        if fit.r2 < min_r2:
            warnings.append(
                f"warning: the {phase} fit explains only R² = {fit.r2:.2f} of the {len(samples)} measured {phase} "
                f"times (below {min_r2}), so plans from this profile may be far off. Profile again on a quiet "
                f"machine (other processes disturb the timings), with more --repeats, and look at the "
                f"{phase}_samples in the JSON for outliers")
    return warnings

