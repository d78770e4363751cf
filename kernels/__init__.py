"""Kernels: each op's dispatcher (`op`), its plain-torch reference (`op_ref`) and, in `<op>_triton.py`, its
Triton launcher (`op_triton`). Nothing here imports anything above it."""

from pdserve.kernels.activation import silu_and_mul, silu_and_mul_fp8
from pdserve.kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from pdserve.kernels.decode_attention import decode_attention
from pdserve.kernels.dispatch import get_backend, set_backend
from pdserve.kernels.linear import linear
from pdserve.kernels.prefill_attention import prefill_attention
from pdserve.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_fp8, rms_norm, rms_norm_fp8
from pdserve.kernels.rope import build_cos_sin_cache, rope_kv_write

__all__ = [
    "build_cos_sin_cache",
    "copy_blocks",
    "decode_attention",
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "gather_blocks",
    "get_backend",
    "linear",
    "prefill_attention",
    "rms_norm",
    "rms_norm_fp8",
    "rope_kv_write",
    "scatter_blocks",
    "set_backend",
    "silu_and_mul",
    "silu_and_mul_fp8",
]
