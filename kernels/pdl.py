"""Programmatic dependent launch (PDL, sm_90 and later) for the Triton kernels of a decode step.

A CUDA kernel normally starts only after the one before it on the stream has finished and its writes are
flushed: at batch 1 a decode step of llama3-8b is ~450 short kernels, and each pays its launch, its ramp-up
and the previous one's tail with the GPU's bandwidth idle. With PDL the next kernel is launched while the
previous one still runs; its programs wait in `griddepcontrol.wait` until that kernel has completed and its
memory is visible, so only the launch and the prologue overlap, never a dependent read or any write.

The contract every kernel launched with `launch_options` keeps (one `PDL: tl.constexpr` argument):

    if PDL:
        tl.extra.cuda.gdc_wait()               # first, in every program: no read of a previous kernel's output,
        tl.extra.cuda.gdc_launch_dependents()  # and no store, before it; then let the next kernel launch

The wait comes before any early return, so a kernel's completion implies its predecessor's: a kernel two back
is then complete too, and the chain stays in stream order for reads and writes (the caching allocator's reuse
of a buffer included). A kernel launched without the attribute (cuBLAS, torch's own, a memcpy) waits for
everything before it as usual, and one launched with it after such a kernel starts when that kernel ends.
Inside a CUDA graph the capture keeps the programmatic edges (CUDA 12.3+).

ENABLED and PREFETCH_WEIGHTS are the A/B switches (benchmarks/engine_gpu.py `--quantization ...-nopdl`,
`...-prefetch`, `...-noprefetch`), not user settings; they are read at every launch, so they must not change
between a decode graph's capture and its replays. Measured on an H100 (no H200 was lent; benchmarks/pdl_h200.sh,
then benchmarks/results/engine_gpu_swap_h100.json, two runs on two machines, every GPU test passing with PDL on):
PDL without the prefetch takes 4-6 % off a b1 step with fp8 linears (4.10 -> 3.91 ms, 4.34 -> 4.08) and 2 % off
bf16's (6.36 -> 6.22), is within 1 % at b8 and b64 (fp8 b64 6.73 -> 6.80, 7.11 -> 7.15); with the prefetch in
every weight kernel it was slower than without (fp8 b1 4.17 against 4.08, bf16 b1 7.16 against 6.61 without PDL
at all: the early prefetch competes with the running kernel for the bandwidth it is bound by). So PDL is on.
On the H200 (2026-12-07, results/engine_gpu_prefetch_h200.json and engine_gpu_fp8both_prefetch_h200.json, each
setting twice, interleaved) the prefetch in every weight kernel took 1-1.5 % off every fp8-linear row (back to
back b1 ctx 512 2.887/2.879 -> 2.853/2.863 ms, b64 4.416/4.402 -> 4.346/4.347; with an fp8 cache b64
4.029/4.033 -> 3.970/3.976) and made bf16's GEMV rows slower (b1 4.39 -> 4.83): so PREFETCH_WEIGHTS names the
kernels that prefetch, the fp8 skinny product only ("fp8_skinny"; "gemv": the bf16 / fp32 GEMV). That form on an
H100 (results/engine_gpu_skinny_prefetch_h100.json): back to back b1 3.548/3.577 against 3.647/3.664 without, b64
5.519/5.520 against 5.623/5.618 (docs/quantization.md, "The fused sum on the H200").
PDSERVE_PDL=0 in a process's environment turns PDL off there.
"""

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("PDSERVE_PDL", "1") != "0"  # see above: on unless PDSERVE_PDL=0
# the second A/B switch: the weight kernels that prefetch their first tiles before the wait (above)
PREFETCH_WEIGHTS: frozenset[str] = frozenset({"fp8_skinny"})
PREFETCH_KERNELS = frozenset({"fp8_skinny", "gemv"})


@functools.cache
def _supported(index: int) -> bool:
    """sm_90+, and a Triton whose CUDA backend has the launch option (3.3 and later: 3.6 and 3.8 here)."""
    from triton.backends.nvidia.compiler import CUDAOptions

    return torch.cuda.get_device_capability(index)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch_options(device: torch.device) -> dict:
    """The kernel arguments that turn PDL on for a launch on `device` (PDL=True, launch_pdl=True), or {}: off
    CUDA, before sm_90, under TRITON_INTERPRET=1, or with ENABLED off."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if not _supported(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def prefetch_l2(row_ptrs, nbytes):
    """Start fetching nbytes (a multiple of 16, > 0) from each 16-byte-aligned address of row_ptrs into L2
    (sm_90's bulk prefetch; nothing is waited for or returned). A weight kernel issues it for its first tiles
    of W before its gdc_wait: W is no kernel's output, so it may be read while the previous kernel runs."""
    addr = row_ptrs.to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [addr, tl.zeros_like(addr).to(tl.int32) + nbytes], dtype=tl.int32, is_pure=False,
                              pack=1)


def weight_prefetch_bytes(kernel: str, device: torch.device, weight: torch.Tensor, k: int, k_per_split: int,
                          wanted: int) -> int:
    """The PREFETCH constexpr of a weight kernel's launch (`kernel`: one of PREFETCH_KERNELS): the bytes of each
    W row its program fetches into L2 before the wait (`wanted`, its pipeline's first tiles), or 0 where PDL is
    off, the kernel is not in PREFETCH_WEIGHTS, or a row's start or length would not be a multiple of 16 bytes
    (the bulk prefetch's rule)."""
    if kernel not in PREFETCH_KERNELS:
        raise ValueError(f"unknown weight kernel {kernel!r}; one of {sorted(PREFETCH_KERNELS)}")
    size = weight.element_size()
    if not (launch_options(device) and kernel in PREFETCH_WEIGHTS):
        return 0
    if weight.data_ptr() % 16 or (weight.stride(0) * size) % 16 or (k_per_split * size) % 16 or (k * size) % 16:
        return 0
    return wanted // 16 * 16
