"""FP8 (float8_e4m3fn) weights and activations: the quantized-weight type and the plain-torch (de)quantizers.

    weight  W[N, K] ──quantize_weight_fp8──▶ Fp8Weight(weight=Wq[N, K] e4m3, scale=s[N] fp32)
            s[n] = max_k |W[n, k]| / 448;  Wq = round(W / s[:, None]);  W ≈ Wq * s[:, None]   (per output channel)
    activ.  x[M, K]  ──quantize_rows_fp8_ref──▶ (xq[M, K] e4m3, sx[M] fp32), the same per row (per token,
            computed at every call: "dynamic")

448 is e4m3fn's largest finite value; a row of zeros gets scale 1e-12 / 448 (any positive value: its codes
are all zero). Made once at load (engine/model.py fuse_weights) or read from an FP8 checkpoint
(engine/weights/fp8_checkpoint.py); linear() sends an Fp8Weight to kernels/linear_fp8.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# up to this many rows an fp8 linear is weight-only: x stays in its dtype and the fp8 weight is upcast in
# registers (the GEMV of kernels/linear_triton.py); above it x is quantized per row and the product runs on
# fp8 tensor cores (W8A8 GEMM). 0: W8A8 at every batch, because on the H200 the weight-only GEMV read fp8 at
# ~1 TB/s (decode b1 ctx512 8.63 ms against bf16's 4.73) while W8A8 at 64 rows ran a step in 6.04 ms
# (benchmarks/results/engine_gpu_fp8w_h200.json, run with 16 here); per linear, the W8A8 GEMM at 64 rows beat
# the GEMV at one row on all four llama3-8b shapes (linear_fp8_h200.json). 16 routes decode batches back to it.
FP8_WEIGHT_ONLY_MAX_ROWS = 0
_MIN_AMAX = 1e-12


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight in fp8 with one fp32 scale per output channel (row)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32: W[n, :] ≈ weight[n, :] * scale[n]
    # the CPU references' fp32 copy (dequantized()), made at first use: torch's CPU e4m3 -> fp32 conversion
    # takes ~5 ns a value, so dequantizing at every call made a CPU decode step of the default model ~0.8 s
    _dequantized: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"Fp8Weight.weight must be a 2-D {FP8_DTYPE}, got {self.weight.dtype} "
                             f"{tuple(self.weight.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.weight.shape[0],):
            raise ValueError(f"Fp8Weight.scale must be float32 [{self.weight.shape[0]}], got {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()

    def dequantized(self) -> torch.Tensor:
        """weight * scale in fp32, as dequantize_weight_fp8 computes it. On the CPU it is kept after the first
        call (the references' linears then cost what fp32 ones do, and hold an fp32 copy beside the fp8 one:
        on a CPU fp8 weights check the numbers, they save no memory); elsewhere computed at every call.
        engine/model.py fuse_weights calls it at load, so that a first step does not allocate (and fault in)
        the copies: under a loaded 2-core machine that step outlasted the 4 s stall timeout."""
        if self._dequantized is not None:
            return self._dequantized
        out = dequantize_weight_fp8(self)
        if self.weight.device.type == "cpu":
            object.__setattr__(self, "_dequantized", out)  # frozen: the cache is not part of the value
        return out


def quantize_weight_fp8(weight: torch.Tensor) -> Fp8Weight:
    """[N, K] float weight -> per-output-channel fp8 (computed in fp32)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale)


def dequantize_weight_fp8(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (weight.weight.float() * weight.scale[:, None]).to(dtype)


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scale [M] fp32), one scale per row (token)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(_MIN_AMAX) / FP8_MAX
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
