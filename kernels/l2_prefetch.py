"""Fetching the next linears' weights into L2 while a small decode batch's attention leaves DRAM idle.

    qkv linear ─▶ prefetch_weights_l2(o_proj, gate_up) ─▶ RoPE + KV write ─▶ attention (─▶ its sum) ─▶ o_proj ─▶ ...
                  (waits for qkv, then starts     ~8-11 us at batch 1, ctx 512 on the H200, moving ~2 MB:
                   the fetches and returns)       the fetches run meanwhile

At batch 1 a decode step is its weights' bytes (llama3-8b with fp8 linears: 218 MB a layer) plus each kernel's
fixed cost; between qkv and o_proj the chain runs only latency-bound kernels, so DRAM idles for ~10 us a layer.
This op spends that time on the next two linears: every row of o_proj whole, and the head of every row of
gate_up (what is left of `L2_SHARE` of the L2 spread over its rows: each of its programs then reads its first
tiles from L2, so the whole kernel shortens, not only its first programs). The bytes moved are the same; they
move earlier. Whether it pays is measured (benchmarks/engine_gpu.py `-l2`): `MAX_ROWS` is 0 (off) until a
measurement says at which batches it does.

Values are untouched (a prefetch reads nothing into registers and writes nothing), so the reference is doing
nothing: off CUDA, under TRITON_INTERPRET=1 (no PTX to run) and before sm_90 (no bulk prefetch) it is that.
"""

from __future__ import annotations

import functools
import os

import torch

from pdserve.kernels.fp8_weight import Fp8Weight

MAX_ROWS = 0  # decode batches of up to this many rows prefetch; 0: off. Read at every call (a graph's capture)
L2_SHARE = 0.6  # of the device's L2, for o_proj's rows and gate_up's heads together


def _storage(weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    return weight.weight if isinstance(weight, Fp8Weight) else weight


def _row_bytes(t: torch.Tensor) -> int:
    return t.shape[1] * t.element_size()


def _aligned(t: torch.Tensor) -> bool:
    """The bulk prefetch's rule: each row starts on 16 bytes (and so its byte counts are multiples of 16)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def plan(first: torch.Tensor, then: torch.Tensor, l2_bytes: int, share: float) -> tuple[int, int]:
    """(bytes of each row of `first`, bytes of each row of `then`): first's rows whole as far as the budget
    (share x l2_bytes) goes, then the rest spread over then's rows; multiples of 16, each at most a row."""
    budget = int(l2_bytes * share)
    a = min(_row_bytes(first), budget // first.shape[0]) // 16 * 16
    left = budget - a * first.shape[0]
    b = min(_row_bytes(then), left // then.shape[0]) // 16 * 16
    return a, b


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.cache
def _runs_on(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def prefetch_weights_l2(first: torch.Tensor | Fp8Weight, then: torch.Tensor | Fp8Weight, num_rows: int) -> None:
    """Start fetching `first`'s rows and the heads of `then`'s into L2 (see above) when the batch of num_rows
    is one MAX_ROWS covers and the device can; returns at once, changes no value."""
    a, b = _storage(first), _storage(then)
    if num_rows > MAX_ROWS or not _runs_on(a.device) or not (_aligned(a) and _aligned(b)):
        return
    a_bytes, b_bytes = plan(a, b, _l2_bytes(a.device), L2_SHARE)
    from pdserve.kernels.l2_prefetch_triton import prefetch_weights_l2_triton

    prefetch_weights_l2_triton(a, a_bytes, b, b_bytes)
