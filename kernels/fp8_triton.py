"""An fp8 KV cache's block layout (kernels/fp8.py) on the Triton side: the tile of V the attention kernels read
from blocks that hold V as [Hkv, D, PAGE], shared by decode (kernels/decode_attention_triton.py) and prefill
attention (kernels/prefill_attention_triton.py).

    keys n0 .. n0 + BLOCK_N (n0 page-aligned)  ─▶  one table entry per page  ─▶  [BLOCK_D, pages, PAGE] bytes,
    a page's tokens contiguous (16-byte loads)  ─▶  V [BLOCK_N, BLOCK_D], still e4m3

Masked by page only: the last live page's slots past the sequence's end are read, and the kernels give those
keys p = 0.
"""

import triton
import triton.language as tl


@triton.jit
def tile_pages(table, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The pages of keys n0 .. n0 + BLOCK_N (n0 page-aligned), one table entry each, and which hold keys < end."""
    pidx = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
    live = pidx * PAGE < end
    return tl.load(table + pidx, mask=live, other=0).to(tl.int64), live


@triton.jit
def fp8_v_tile(v_head, table, n0, end, stride_cblk, d, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """V of keys n0 .. n0 + BLOCK_N as [BLOCK_N, BLOCK_D]; v_head: the cache's V half at its kv head's
    [D, PAGE] column of block 0 (+ head * HEAD_DIM * PAGE); d: tl.arange(0, BLOCK_D)."""
    pages, live = tile_pages(table, n0, end, PAGE, BLOCK_N)
    vt = tl.load(v_head + pages[None, :, None] * stride_cblk + d[:, None, None] * PAGE
                 + tl.arange(0, PAGE)[None, None, :],
                 mask=(d < HEAD_DIM)[:, None, None] & live[None, :, None], other=0.0)
    return tl.trans(tl.reshape(vt, [BLOCK_D, BLOCK_N]))
