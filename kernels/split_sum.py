"""A split-K product's output left unsummed, for the kernel that reads it next to sum.

    linear(x, w, unsummed=True)  -> SplitSum(part [S, M, N] fp32, dtype)   where the Triton product ran split
                                    along K (S >= 2) without a bias; otherwise the summed [M, N] tensor as usual
    fused_add_rms_norm[_fp8](SplitSum, residual, ...)                      sums the S partials in order, rounds
                                    to dtype, then adds the residual (kernels/rms_norm_triton.py)

What the consumer computes is what the split-K reduce kernel (kernels/linear_triton.py reduce_split_k) would have
written, bit for bit (the same fp32 sum in the same order, the same rounding), without its launch: at batch 1 a
decode layer's down projection (fp8 weights, split in two on the H200) then costs one kernel less, and o_proj,
whose 4,096 outputs are 64 programs unsplit on 132 SMs, can split without paying for a reduce. The layer's two
residual norms read the hidden-wide outputs of o_proj and down, so those are the linears the model asks this of
(engine/model.py SUM_IN_NORM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitSum:
    part: torch.Tensor  # [S, M, N] fp32, unit stride along N
    dtype: torch.dtype  # what the summed output would have been stored as

    def __post_init__(self) -> None:
        if self.part.dim() != 3 or self.part.dtype != torch.float32 or self.part.stride(-1) != 1:
            raise ValueError(f"split partials must be [S, M, N] fp32 with unit stride along N, got "
                             f"{tuple(self.part.shape)} {self.part.dtype} strides {self.part.stride()}")

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.part.device

    def __getitem__(self, rows: torch.Tensor | slice) -> SplitSum:
        """The partials of these rows (an index tensor or a slice of M)."""
        return SplitSum(self.part[:, rows], self.dtype)

    def summed(self) -> torch.Tensor:
        """The reference: the partials added in split order in fp32, then rounded to dtype."""
        acc = torch.zeros(self.part.shape[1:], dtype=torch.float32, device=self.part.device)
        for s in range(self.part.shape[0]):
            acc += self.part[s]
        return acc.to(self.dtype)


def summed(x: torch.Tensor | SplitSum) -> torch.Tensor:
    """x as a tensor: a SplitSum's partials summed (SplitSum.summed), a tensor as it is."""
    return x.summed() if isinstance(x, SplitSum) else x
