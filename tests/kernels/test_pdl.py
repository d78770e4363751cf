"""kernels/pdl.py: programmatic dependent launch. Every kernel launched with its options waits before any global
access (checked in the kernels' sm_90 PTX, compiled on the CPU), each such kernel is launched with them, the
options are off wherever PDL cannot run; on a GPU (skipped elsewhere), a CUDA graph of a chain of decode kernels
launched with PDL gives the bits of the same chain launched without it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import pdl

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
AOT = ROOT / "benchmarks" / "kernels_aot.py"


def _jit_kernels_with_pdl() -> dict[str, ast.FunctionDef]:
    found = {}
    for path in KERNELS.glob("*_triton.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                found[node.name] = node
    return found


def _pdl_launches() -> set[str]:
    """Names of the kernels launched as `kernel[grid](..., **launch_options(...))`."""
    names = set()
    for path in KERNELS.glob("*_triton.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)
                    and any(k.arg is None and isinstance(k.value, ast.Call)
                            and getattr(k.value.func, "id", None) == "launch_options" for k in node.keywords)):
                names.add(node.func.value.id)
    return names


def test_each_kernel_with_a_pdl_argument_is_launched_with_the_options_and_waits_first() -> None:
    kernels = _jit_kernels_with_pdl()
    assert {"_gemv_kernel", "_fp8_skinny_kernel", "_rms_norm_kernel", "_decode_split_kernel"} <= set(kernels)
    assert _pdl_launches() == set(kernels)
    allowed_before = {"program_id", "arange", "max_contiguous", "multiple_of", "minimum", "to", "prefetch_l2"}
    for name, fn in kernels.items():
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
            else fn.body
        wait = next(i for i, stmt in enumerate(body) if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "PDL")
        assert [ast.unparse(s) for s in body[wait].body] == ["tl.extra.cuda.gdc_wait()",
                                                            "tl.extra.cuda.gdc_launch_dependents()"], name
        for stmt in body[:wait]:
            calls = {getattr(c.func, "attr", getattr(c.func, "id", None)) for c in ast.walk(stmt)
                     if isinstance(c, ast.Call)}
            assert calls <= allowed_before and not isinstance(stmt, ast.Return), (name, ast.unparse(stmt))


def test_pdl_order_finds_an_access_before_the_wait() -> None:
    sys.path.insert(0, str(AOT.parent))
    try:
        from kernels_aot import pdl_order
    finally:
        sys.path.remove(str(AOT.parent))
    good = "cp.async.bulk.prefetch.L2.global [%rd1], %r2;\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;\n" \
           "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd3];\nst.global.b16 [%rd4], %rs1;"
    assert pdl_order(good) is None
    assert pdl_order(good.replace("griddepcontrol.wait;\n", "")) == "no griddepcontrol.wait"
    assert "before the wait" in pdl_order("ld.global.nc.b32 %r1, [%rd2];\n" + good)
    assert "before the wait" in pdl_order("cp.async.cg.shared.global [%r1], [%rd2], 16;\n" + good)
    assert "before the wait" in pdl_order("st.global.b32 [%rd1], %r1;\n" + good)
    assert pdl_order("griddepcontrol.launch_dependents;\n" + good) == "launch_dependents before the wait"


def test_every_pdl_kernel_waits_before_its_first_global_access_in_its_sm90_ptx() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, for sm_90
    run = subprocess.run([sys.executable, str(AOT), "--pdl"], capture_output=True, text=True, env=env, timeout=300, check=False,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) >= len(_jit_kernels_with_pdl()) and all(line.endswith(" ok") for line in lines), run.stdout
    for kernel in ("rms_norm", "silu_and_mul fp8", "rope_kv_write", "decode split", "decode reduce", "gemv",
                   "fp8 skinny", "split-k reduce", "quantize rows"):
        assert any(line.startswith(kernel) for line in lines), (kernel, run.stdout)


def test_the_options_are_off_where_pdl_cannot_run() -> None:
    assert pdl.launch_options(torch.device("cpu")) == {}
    assert pdl.launch_options(torch.device("meta")) == {}
    weight = torch.empty(64, 256, dtype=torch.bfloat16)
    assert pdl.weight_prefetch_bytes("gemv", torch.device("cpu"), weight, 256, 256, 4096) == 0
    with pytest.raises(ValueError, match="unknown weight kernel"):
        pdl.weight_prefetch_bytes("gemm", torch.device("cpu"), weight, 256, 256, 4096)


def _chain(layers: list, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """A decode layer's kernels without attention: add+norm -> linear -> silu_and_mul -> linear, per layer."""
    from pdserve import kernels

    for norm_w, up, down in layers:
        h, res = (kernels.fused_add_rms_norm_fp8 if hasattr(up, "scale") else kernels.fused_add_rms_norm)(
            x, res, norm_w, 1e-5)
        act = kernels.silu_and_mul_fp8(kernels.linear(h, up)) if hasattr(up, "scale") else \
            kernels.silu_and_mul(kernels.linear(h, up))
        x = kernels.linear(act, down)
    return x + res


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs sm_90")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 8])
def test_a_cuda_graph_launched_with_pdl_gives_the_bits_of_the_chain_without_it(fp8: bool, rows: int,
                                                                              monkeypatch) -> None:
    from pdserve.kernels.fp8_weight import quantize_weight_fp8

    monkeypatch.setattr(pdl, "ENABLED", True)  # whatever its default: restored after the test

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 4096, 14336

    def weight(n: int, k: int):
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        return quantize_weight_fp8(w) if fp8 else w

    layers = [(torch.rand(hidden, device="cuda", generator=gen).to(torch.bfloat16) + 0.5, weight(2 * inter, hidden),
               weight(hidden, inter)) for _ in range(4)]
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn_like(x)
    pdl.ENABLED = False
    try:
        expected = _chain(layers, x, res)
    finally:
        pdl.ENABLED = True
    assert pdl.launch_options(x.device) and _chain(layers, x, res).equal(expected)  # eager, with PDL
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(layers, x, res)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(layers, x, res)
    for i in range(20):  # each replay's first kernel reads what the last one's inputs were rewritten to
        x.copy_(torch.randn(rows, hidden, device="cuda", generator=gen)) if i % 2 else None
        pdl.ENABLED = False
        try:
            expected = _chain(layers, x, res)
        finally:
            pdl.ENABLED = True
        graph.replay()
        assert out.equal(expected), i
