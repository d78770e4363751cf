"""Start fetching the heads of two weights' rows into L2 (sm_90's bulk prefetch), as one launch in the decode
chain; kernels/l2_prefetch.py says when and why.

    grid (cdiv(rows_a + rows_b, BLOCK),): lane r < rows_a prefetches a_bytes from row r of A, the others
    b_bytes from row r - rows_a of B; nothing is waited for, read or written

With PDL (kernels/pdl.py) its programs wait for the kernel before them like every kernel of the chain, so the
prefetch starts once that kernel (a bandwidth-bound linear) is done and runs while the latency-bound kernels
after it (RoPE, attention, its sum) leave DRAM idle.
"""

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import launch_options, prefetch_l2

_BLOCK = 128  # rows a program: one bulk prefetch per lane


@triton.jit(do_not_specialize=["rows_a", "rows_b", "stride_a", "stride_b", "a_bytes", "b_bytes"])
def _l2_prefetch_kernel(a_ptr, b_ptr, rows_a, rows_b, stride_a, stride_b, a_bytes, b_bytes,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r = tl.minimum(r, rows_a + rows_b - 1)  # the last program's spare lanes fetch the last row again
    in_a = r < rows_a
    a_row = tl.where(in_a, r, 0).to(tl.int64)
    b_row = tl.where(in_a, 0, r - rows_a).to(tl.int64)
    addr = tl.where(in_a, (a_ptr + a_row * stride_a).to(tl.int64, bitcast=True),
                    (b_ptr + b_row * stride_b).to(tl.int64, bitcast=True))
    prefetch_l2(addr, tl.where(in_a, a_bytes, b_bytes))


def prefetch_weights_l2_triton(a: torch.Tensor, a_bytes: int, b: torch.Tensor, b_bytes: int) -> None:
    """a, b: 2-D weights whose rows' starts and strides are multiples of 16 bytes; a_bytes, b_bytes: the bytes
    of each row to fetch (multiples of 16, <= a row; 0 skips that weight)."""
    rows_a = a.shape[0] if a_bytes else 0
    rows_b = b.shape[0] if b_bytes else 0
    if rows_a + rows_b == 0:
        return
    _l2_prefetch_kernel[(triton.cdiv(rows_a + rows_b, _BLOCK),)](
        a.view(torch.int8), b.view(torch.int8), rows_a, rows_b, a.stride(0) * a.element_size(),
        b.stride(0) * b.element_size(), a_bytes, b_bytes, BLOCK=_BLOCK, num_warps=4, **launch_options(a.device))
