"""Latency models of one worker, fitted by least squares on measured steps (DistServe's forms):

  prefill iteration  t ≈ a·Σl + b·Σl·(s+l) + c     l = chunk tokens, s = tokens already cached before the
                                                      chunk (s = 0 for a whole prompt: the l² attention term)
  decode step        t ≈ a·Σctx + b·batch + c       ctx = tokens each sequence attends over

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
DECODE_TERMS = ("sum_ctx", "batch", "const")


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
    """One measured decode step: batch size, the batch's total context (tokens), and its time (s)."""

    batch: int
    sum_ctx: int
    seconds: float

    def features(self) -> tuple[float, float, float]:
        return (float(self.sum_ctx), float(self.batch), 1.0)


def prefill_features(lens: tuple[int, ...] | list[int], starts: tuple[int, ...] | list[int]) -> tuple[float, float, float]:
    return (float(sum(lens)), float(sum(n * (s + n) for n, s in zip(lens, starts))), 1.0)


@dataclass(frozen=True)
class LinearFit:
    """t ≈ Σ coef[i]·feature[i]; r2 is the coefficient of determination on the fitted samples."""

    terms: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float

    def predict(self, features: tuple[float, ...]) -> float:
        return float(sum(c * f for c, f in zip(self.coef, features)))

    def as_dict(self) -> dict[str, Any]:
        return {"terms": list(self.terms), "coef": list(self.coef), "r2": self.r2,
                **{name: value for name, value in zip(self.terms, self.coef)}}


def fit_linear(features: np.ndarray, seconds: np.ndarray, terms: tuple[str, ...]) -> LinearFit:
    """Least squares on relative error (rows scaled by 1/t, so a 5 ms step counts as much as a 500 ms one),
    with every coefficient >= 0: a negative per-token cost or intercept is noise, and would make the model
    predict negative times. With three terms the exact non-negative solution is the best of the 7 subsets."""
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

    def decode_time(self, batch: int, sum_ctx: int) -> float:
        return max(0.0, self.decode.predict((float(sum_ctx), float(batch), 1.0)))

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
        raw = json.loads(text)
        return cls(
            model=raw["model"], device=raw["device"], dtype=raw["dtype"],
            kv_bytes_per_token=int(raw["kv_bytes_per_token"]), block_size=int(raw["block_size"]),
            prefill=_fit_from(raw["prefill_fit"]), decode=_fit_from(raw["decode_fit"]),
            prefill_samples=[PrefillSample(tuple(s["lens"]), s["seconds"], tuple(s.get("starts", ())))
                             for s in raw.get("prefill_samples", [])],
            decode_samples=[DecodeSample(s["batch"], s["sum_ctx"], s["seconds"]) for s in raw.get("decode_samples", [])],
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
