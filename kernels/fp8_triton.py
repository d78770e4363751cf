"""Triton helpers shared by the fp8 kernels (kernels/linear_fp8_triton.py, kernels/linear_fp8_skinny_triton.py)."""

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(v):
    # v: fp32 within [-448, 448] -> the nearest e4m3 value (ties to even), still fp32, so that the cast to fp8
    # after it is exact. Triton 3.8's interpreter casts fp32 -> e4m3 without carrying a rounded-up mantissa
    # into the exponent (1.95 -> 1.0, 125 -> 64); rounding here first gives every backend torch's codes.
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # below 2^-6 the subnormals' step is 2^-9, as at 2^-6
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    u = v / step  # exact (a power of two); |u| < 16
    return ((u + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: the fp32 add rounds u to an integer, to even
