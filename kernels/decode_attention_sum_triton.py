"""Summing split decode attention's partials (kernels/decode_attention_triton.py, S > 1 splits a (sequence, kv head)):

    out[b, q] = sum_s w_s * o_s / sum_s w_s,  w_s = 2^(lse_s - max lse)   (o_s normalised, lse_s in log2)

two ways. Where B * Hkv programs fill the SMs (only an fp8 cache splits there: fp8_plan), in the split kernel
itself: each program stores its partials, then takes a ticket (an int32 per (b, h): a barrier, an acq_rel atomic
add); the one that draws S - 1 reads all S back (bypassing L1) and sums them in split order with combine_splits,
then puts the ticket back to 0, so one launch does it all, a CUDA graph's next replay included. Below that, a
second kernel, grid (B, Hq), sums them (reduce_splits): there the fused sum lost, one program a group reading all
S partials after its atomic where the reduce kernel spreads them over Hq programs. On an H100 (2026-12-07, one
layer, CUDA graph; benchmarks/results/decode_attention_combine_h100.json), fused against the reduce kernel: fp8
B 32 ctx 4,096 (split 4) 99.2 against 105.6 us, B 64 (split 2) 191.6 against 192.6, B 64 ctx 512 32.8 both; but
B 8 ctx 4,096 32.2 against 31.1, B 1 14.1 against 13.0, B 1 ctx 512 11.4 against 10.8 (bf16 15.8 / 11.2 against
15.4 / 10.5 at B 1). On the H200 (2026-12-07, docs/quantization.md "The fused sum on the H200") the step of issue
19's fp8 KV row, b64 ctx 4,096, back to back: 9.19 ms against 9.22 (1.402x bf16 KV's against 1.397x, two runs of
3-4 rounds); one layer there: B 32 73.1 against 77.2 us, B 64 136.4 against 134.5. The reduce kernel compiles
once per BLOCK_S = S.
"""

import torch
import triton
import triton.language as tl

from pdserve.kernels.pdl import launch_options

COMBINE_IN_SPLITS = True  # split partials summed by each (sequence, kv head)'s last program where B * Hkv programs
# fill the SMs (fp8_plan's many-programs tile); below, and with this off, the reduce kernel (docstring: why)
_TICKETS = 1 << 16  # B * Hkv programs' tickets (int32) a buffer holds: 256 sequences x 256 kv heads
_tickets: dict[torch.device, torch.Tensor] = {}


def ticket_buffer(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed int32 tickets for COMBINE (every launch leaves them at zero; launches on one device
    must not overlap, as the engine's one decode step at a time does not). None where there are none: more than
    _TICKETS, or a first use inside a CUDA graph capture, where no kernel runs to zero a new buffer (the engine's
    graphs are warmed up eagerly first): those launches use the reduce kernel."""
    buffer = _tickets.get(device)
    if buffer is None and needed <= _TICKETS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffer = _tickets[device] = torch.zeros(_TICKETS, dtype=torch.int32, device=device)
    return buffer if needed <= _TICKETS else None


@triton.jit
def combine_splits(part_ptr, lse_ptr, out_ptr, num_splits, stride_ph, stride_ps, stride_lh, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[h] = sum_s w_s * o_s[h] / sum_s w_s, w_s = 2^(lse_s[h] - max lse[h]), for the GROUP heads h of one
    (sequence, kv head), its splits in order (a running max, so no per-S constexpr). Four splits' loads at a time
    (one round trip to L2 for four), bypassing L1 (.cg): the other programs' partials. The pointers are the
    group's first head's. BLOCK_H = next_power_of_2(GROUP): the real heads only, not the dot's 16 padded rows."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < GROUP
    hd_mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    parts = part_ptr + h[:, None] * stride_ph + d[None, :]
    top = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite even when every split is empty (seq_len 0)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, 4):
        for i in tl.static_range(4):
            s = s0 + i
            lse = tl.load(lse_ptr + h * stride_lh + s, mask=h_mask & (s < num_splits), other=float("-inf"),
                          cache_modifier=".cg")
            part = tl.load(parts + s * stride_ps, mask=hd_mask & (s < num_splits), other=0.0, cache_modifier=".cg")
            new_top = tl.maximum(top, lse)
            alpha = tl.exp2(top - new_top)
            w = tl.exp2(lse - new_top)  # 0 for an empty split
            den = den * alpha + w
            acc = acc * alpha[:, None] + part * w[:, None]
            top = new_top
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit(do_not_specialize=["num_splits"])  # BLOCK_S carries it
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    # part_out: [B, Hq, S, D], part_lse: [B, Hq, S] -> out: [B, Hq, D]; grid: (B, Hq)
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    top = tl.maximum(tl.max(lse, axis=0), -1.0e30)  # finite even when every split is empty (seq_len 0)
    w = tl.exp2(lse - top)  # [BLOCK_S]; 0 for empty splits
    sd_mask = s_mask[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=sd_mask, other=0.0)
    den = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def reduce_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """out [B, Hq, D] = the sum above of part_out [B, Hq, S, D] fp32 weighted by part_lse [B, Hq, S]."""
    batch, q_heads, dim = out.shape
    _decode_reduce_kernel[(batch, q_heads)](
        part_out, part_lse, out, num_splits, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
        **launch_options(out.device),
    )
