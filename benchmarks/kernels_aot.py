# ruff: noqa: C408  (keyword dicts mirror the kernels' argument lists)
"""Compile pdserve's Triton kernels for sm_90 (H100/H200) on a machine without a GPU, and print each
variant's registers, spills and shared memory: errors and spills show up here at no device time.

    .venv/bin/python benchmarks/kernels_aot.py
    .venv/bin/python benchmarks/kernels_aot.py --pdl     (every PDL kernel: the wait before any global access)
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels.activation_triton import _silu_and_mul_fp8_kernel, _silu_and_mul_kernel
from pdserve.kernels.decode_attention_sum_triton import _decode_reduce_kernel
from pdserve.kernels.decode_attention_triton import _decode_split_kernel
from pdserve.kernels.linear_fp8_skinny_triton import _fp8_skinny_kernel
from pdserve.kernels.linear_fp8_triton import _fp8_gemm_kernel, _quantize_rows_kernel
from pdserve.kernels.linear_triton import _gemv_kernel, _split_k_reduce_kernel
from pdserve.kernels.prefill_attention_triton import _prefill_attention_kernel
from pdserve.kernels.rms_norm_triton import _rms_norm_kernel
from pdserve.kernels.rope_triton import _rope_kv_write_kernel

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@dataclass(frozen=True)
class C:
    """A constexpr argument."""

    value: object


def compile_variant(fn, args: dict, num_warps: int, num_stages: int = 3):
    """args: name -> C(value) | '*bf16'-style pointer type | int (i32, 16-divisible when it is, unless the kernel
    marks it do_not_specialize) | float."""
    sig, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        v = args[name] if name in args else C(param.default)  # a defaulted constexpr (PDL) left out
        if isinstance(v, C) or (type(v) is int and v == 1 and not param.do_not_specialize):
            sig[name], consts[name] = "constexpr", v.value if isinstance(v, C) else 1
        elif isinstance(v, str):
            sig[name], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if v % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def resources(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} smem {kernel.metadata.shared}"


def variants():
    bf = "*bf16"
    norm = dict(x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, h_ptr=bf, s_ptr=bf, num_rows=8192, hidden=4096,
                stride_x=4096, stride_res=4096, stride_out=4096, stride_h=4096, eps=1e-5, HAS_RESIDUAL=C(True),
                QUANT=C(False), FP8_MAX=C(448.0), ROUND=C(False))
    for rows, warps in ((1, 8), (2, 8), (4, 16)):
        yield f"rms_norm rows{rows} w{warps}", _rms_norm_kernel, {**norm, "BLOCK_ROWS": C(rows), "BLOCK_H": C(4096)}, warps, 1
    fp8_norm = {**norm, "out_ptr": "*fp8e4nv", "s_ptr": "*fp32", "QUANT": C(True), "BLOCK_ROWS": C(1), "BLOCK_H": C(4096)}
    yield "rms_norm fp8 rows1 w4", _rms_norm_kernel, fp8_norm, 4, 1
    silu = dict(x_ptr=bf, out_ptr=bf, inter=14336, stride_x=28672, stride_out=14336, EVEN=C(True))
    yield "silu_and_mul 1024", _silu_and_mul_kernel, {**silu, "BLOCK": C(1024)}, 4, 1
    silu_fp8 = dict(x_ptr=bf, q_ptr="*fp8e4nv", s_ptr="*fp32", inter=14336, stride_x=28672, stride_q=14336,
                    BLOCK=C(16384), ONE_PASS=C(True), FP8_MAX=C(448.0), ROUND=C(False))
    yield "silu_and_mul fp8 one pass w16", _silu_and_mul_fp8_kernel, silu_fp8, 16, 1
    yield "silu_and_mul fp8 two passes w16", _silu_and_mul_fp8_kernel, {**silu_fp8, "BLOCK": C(4096),
                                                                        "ONE_PASS": C(False)}, 16, 1
    rope = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, pos_ptr="*i64", cos_sin_ptr="*fp32", cache_ptr=bf, slot_ptr="*i64",
                inv_k_scale=1.0, inv_v_scale=1.0, FP8=C(False), stride_qt=6144, stride_qh=128, stride_kt=6144, stride_kh=128, stride_vt=6144, stride_vh=128,
                stride_cs=128, stride_ckv=1 << 28, stride_cblk=16384, stride_ctok=1024, stride_ch=128,
                NUM_Q_HEADS=C(32), NUM_KV_HEADS=C(8), HALF=C(64), PAGE=C(16), BLOCK_HQ=C(32), BLOCK_HKV=C(8),
                BLOCK_HALF=C(64))
    yield "rope_kv_write llama3-8b", _rope_kv_write_kernel, rope, 4, 1
    yield "rope_kv_write llama3-8b fp8", _rope_kv_write_kernel, {**rope, "cache_ptr": "*fp8e4nv", "FP8": C(True)}, 4, 1
    yield from attention_variants(bf)
    yield from gemv_variants(bf)


def pdl_variants():
    """Every kernel launched with kernels/pdl.py's options (one variant of each, and the fp8 forms of the norm and
    silu_and_mul), compiled as it is then (PDL, and the weight kernels' L2 prefetch): `pdl_order` checks its PTX."""
    seen = set()
    for name, fn, args, warps, stages in variants():
        if "PDL" in fn.arg_names and ((fn, "fp8" in name) not in seen or "two passes" in name):
            seen.add((fn, "fp8" in name))
            extra = {"PDL": C(True)}
            if "PREFETCH" in fn.arg_names:
                extra["PREFETCH"] = C(1024)
            yield name + " pdl", fn, {**args, **extra}, warps, stages
    red = dict(part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", N=4096, split_k=4, stride_ps=4096, stride_om=4096,
               HAS_BIAS=C(False), BLOCK=C(1024))
    yield "split-k reduce pdl", _split_k_reduce_kernel, {**red, "PDL": C(True)}, 4, 1
    quant = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", M=1, K=4096, stride_xm=4096, stride_qm=4096,
                 FP8_MAX=C(448.0), BLOCK_K=C(4096), ONE_PASS=C(True), ROUND=C(False))
    yield "quantize rows pdl", _quantize_rows_kernel, {**quant, "PDL": C(True)}, 8, 1


_GLOBAL_ACCESS = re.compile(r"\b(ld|st|atom|red)\.global|\bcp\.async\.(ca|cg)\b|\bcp\.async\.bulk\.tensor")


def pdl_order(ptx: str) -> str | None:
    """None if the kernel's PTX waits (griddepcontrol.wait) before its first global load, store or atomic and
    lets dependents launch only after the wait; else what is wrong. The L2 prefetch may come first."""
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next((i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")), None)
    if wait is None:
        return "no griddepcontrol.wait"
    early = [line for line in lines[:wait] if _GLOBAL_ACCESS.search(line)]
    if early:
        return f"{len(early)} global accesses before the wait, the first: {early[0]}"
    launch = next((i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents")), None)
    if launch is not None and launch < wait:
        return "launch_dependents before the wait"
    return None


def attention_variants(bf: str):
    cache = dict(stride_ckv=1 << 28, stride_cblk=16384, stride_ctok=1024, stride_ch=128)
    dec = dict(q_ptr=bf, cache_ptr=bf, seq_lens_ptr="*i32", block_tables_ptr="*i32", out_ptr=bf,
               part_out_ptr="*fp32", part_lse_ptr="*fp32", ticket_ptr="*i32", qk_scale=0.127, v_scale=1.0,
               num_splits=2, stride_qb=4096, stride_qh=128, stride_ob=4096, stride_oh=128, stride_bt=256, **cache, stride_pb=8192,
               stride_ph=256, stride_ps=128, stride_lb=64, stride_lh=2, GROUP=C(4), HEAD_DIM=C(128), PAGE=C(16),
               SINGLE=C(False), PRECISION=C("tf32"), BLOCK_G=C(16), BLOCK_D=C(128), F16_DOT=C(False), FMA=C(False),
               K_T=C(False), PAGE_ROWS=C(False), BITS=C(False), V_WIDE=C(False))
    for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 3), (64, 8, 3)):
        yield f"decode split n{block_n} w{warps} s{stages}", _decode_split_kernel, {**dec, "BLOCK_N": C(block_n)}, warps, stages
    fp8 = {**dec, "cache_ptr": "*fp8e4nv", "F16_DOT": C(True), "K_T": C(True), "BLOCK_N": C(64)}
    yield "decode split fp8 kt n64 w4 s3", _decode_split_kernel, fp8, 4, 3
    yield "decode split fp8 kt+vwide n64 w4 s3", _decode_split_kernel, {**fp8, "V_WIDE": C(True)}, 4, 3
    yield "decode split fp8 kt+pages n64 w4 s3", _decode_split_kernel, {**fp8, "PAGE_ROWS": C(True)}, 4, 3
    yield "decode split fp8 kt+vt n128 w4 s1", _decode_split_kernel, {**fp8, "V_T": C(True), "BLOCK_N": C(128)}, 4, 1
    yield ("decode split fp8 kt+vt n64 w2 s3 combine", _decode_split_kernel,
           {**fp8, "V_T": C(True), "COMBINE": C(True), "BLOCK_H": C(4)}, 2, 3)
    red = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=bf, num_splits=2, stride_pb=8192, stride_ph=256,
               stride_ps=128, stride_lb=64, stride_lh=2, stride_ob=4096, stride_oh=128, HEAD_DIM=C(128),
               BLOCK_S=C(2), BLOCK_D=C(128))
    yield "decode reduce", _decode_reduce_kernel, red, 4, 1
    pre = dict(q_ptr=bf, cache_ptr=bf, cu_q_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32", out_ptr=bf,
               qk_scale=0.127, v_scale=1.0, num_seqs=1, stride_qt=4096, stride_qh=128, stride_ot=4096, stride_oh=128,
               stride_bt=256, **cache, GROUP=C(4), HEAD_DIM=C(128), PAGE=C(16), PRECISION=C("tf32"), SEARCH=C(128), BLOCK_D=C(128))
    for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3)):
        yield (f"prefill m{bm} n{bn} w{warps} s{stages}", _prefill_attention_kernel,
               {**pre, "BLOCK_M": C(bm), "BLOCK_N": C(bn)}, warps, stages)
    yield ("prefill fp8 m128 n128 w8 s3", _prefill_attention_kernel,
           {**pre, "cache_ptr": "*fp8e4nv", "V_T": C(True), "BLOCK_M": C(128), "BLOCK_N": C(128)}, 8, 3)


def gemv_variants(bf: str):
    base = dict(x_ptr=bf, w_ptr=bf, scale_ptr=bf, bias_ptr=bf, out_ptr=bf, part_ptr="*fp32", M=4, N=4096, K=14336,
                k_per_split=3584, stride_xm=14336, stride_wn=14336, stride_om=4096, stride_ps=16384,
                HAS_BIAS=C(False), SCALED=C(False), SPLIT=C(True), EVEN=C(True), PRECISION=C("tf32"))
    for dot, bm, bn, bk, warps, stages in ((True, 16, 16, 512, 4, 4), (True, 16, 32, 256, 4, 4),
                                           (True, 16, 64, 128, 4, 3), (False, 1, 16, 512, 4, 4),
                                           (False, 4, 16, 128, 4, 4)):
        yield (f"gemv dot={dot} m{bm} n{bn} k{bk} w{warps} s{stages}", _gemv_kernel,
               {**base, "USE_DOT": C(dot), "BLOCK_M": C(bm), "BLOCK_N": C(bn), "BLOCK_K": C(bk)}, warps, stages)
    skinny = dict(x_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr=bf,
                  out_ptr=bf, part_ptr="*fp32", M=1, N=4096, K=14336, k_per_split=3584, stride_xm=14336,
                  stride_wn=14336, stride_om=4096, stride_ps=4096, HAS_BIAS=C(False), SPLIT=C(True), EVEN=C(True),
                  BLOCK_M=C(16), BLOCK_N=C(64), BLOCK_K=C(256))
    yield "fp8 skinny down split4", _fp8_skinny_kernel, skinny, 4, 3
    gemm = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", a_scale_ptr="*fp32", b_scale_ptr="*fp32", bias_ptr=bf, c_ptr=bf,
                M=4096, N=28672, K=4096, stride_am=4096, stride_bn=4096, stride_cm=28672, HAS_BIAS=C(False),
                EVEN_K=C(True), BLOCK_M=C(128), BLOCK_N=C(256), BLOCK_K=C(128), GROUP_M=C(8))
    yield "fp8 gemm prefill m128 n256 k128 w8 s3", _fp8_gemm_kernel, gemm, 8, 3


def main() -> None:
    if sys.argv[1:] == ["--pdl"]:  # tests/kernels/test_pdl.py runs this
        bad = 0
        for name, fn, args, warps, stages in pdl_variants():
            problem = pdl_order(compile_variant(fn, args, warps, stages).asm["ptx"])
            bad += problem is not None
            print(f"{name:40s} {problem or 'ok'}", flush=True)
        sys.exit(1 if bad else 0)
    for name, fn, args, warps, stages in variants():
        try:
            print(f"{name:40s} {resources(compile_variant(fn, args, warps, stages))}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- report every variant, not only the first failure
            print(f"{name:40s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
