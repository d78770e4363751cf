"""`pdserve generate` as a user runs it: a real subprocess; stdout holds exactly the continuation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.llm import LLM


def run_cli(args: list[str], cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PDSERVE_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def test_streams_the_greedy_continuation(model_cache_dir: Path) -> None:
    llm = LLM(num_blocks=32, max_num_seqs=1, cache_dir=model_cache_dir, progress=False)
    raw = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    chat = llm.generate(["Say hello."], SamplingParams(max_tokens=8, temperature=0), use_chat=True)[0]
    result = run_cli(["The capital of France is", "--max-tokens", "8"], model_cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == raw.text + "\n"
    result = run_cli(["Say hello.", "--chat", "--max-tokens", "8"], model_cache_dir)
    assert result.returncode == 0 and result.stdout == chat.text + "\n"


def test_invalid_sampling_value_is_reported(model_cache_dir: Path) -> None:
    result = run_cli(["x", "--top-p", "0"], model_cache_dir)
    assert result.returncode == 2 and result.stdout == ""
    assert "top_p must be in (0, 1], got 0.0" in result.stderr


@pytest.mark.parametrize(("calculate", "spelling"), [(False, "fp8"), (True, "fp8_e4m3")],
                         ids=["scale-1", "calculated-scales-sglang-spelling"])
def test_fp8_kv_cache_generates_on_the_cpu(model_cache_dir: Path, calculate: bool, spelling: str) -> None:
    """`--kv-cache-dtype fp8` through the CPU references: the offline engine's fp8 text (same torch threads);
    with --calculate-kv-scales, the scales the built-in text gives (not 1.0). fp8_e4m3 (SGLang's name, vLLM's
    other one) is the same cache, in the offline API and on the command line."""
    llm = LLM(num_blocks=32, max_num_seqs=1, cache_dir=model_cache_dir, progress=False, kv_cache_dtype=spelling,
              calculate_kv_scales=calculate)
    assert llm.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert (set(llm.runner.kv_spec.k_scales) != {1.0}) == calculate
    expected = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    flags = ["--kv-cache-dtype", spelling] + (["--calculate-kv-scales"] if calculate else [])
    result = run_cli(["The capital of France is", "--max-tokens", "8", *flags], model_cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n" and expected.text.strip()


def test_calculated_kv_scales_need_an_fp8_cache(model_cache_dir: Path) -> None:
    result = run_cli(["Hi", "--calculate-kv-scales"], model_cache_dir)
    assert result.returncode == 2 and "--calculate-kv-scales needs --kv-cache-dtype fp8, not 'auto'" in result.stderr


def test_quantization_fp8_runs_on_cpu_close_to_fp32(model_cache_dir: Path) -> None:
    """`--quantization fp8` through the reference kernels: the CLI prints the fp8 engine's greedy text, whose
    first tokens are fp32's (benchmarks/results/fp8_weights_accuracy_cpu.json measures all 20 parity prompts)."""
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=4, temperature=0)
    fp8 = LLM(num_blocks=32, max_num_seqs=1, cache_dir=model_cache_dir, progress=False, quantization="fp8")
    fp32 = LLM(num_blocks=32, max_num_seqs=1, cache_dir=model_cache_dir, progress=False)
    ours = fp8.generate([prompt], params)[0]
    assert ours.token_ids == fp32.generate([prompt], params)[0].token_ids
    result = run_cli([prompt, "--max-tokens", "4", "--quantization", "fp8"], model_cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ours.text + "\n"
