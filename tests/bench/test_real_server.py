"""`pdserve bench` against a real `pdserve serve` (router + 1 prefill + 1 decode worker, the default model on
CPU): every request completes, the token counts are the server's, and the timings are consistent; over
ShareGPT prompts, the answers whose first token is EOS count as completed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.cli import main
from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup, serve_command

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, default_model_dir: Path) -> Iterator[str]:
    port, log = free_port("127.0.0.1"), tmp_path_factory.mktemp("serve") / "serve.log"
    flags = ["--num-blocks", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--torch-threads", "1"]
    group = ProcessGroup(serve_command(port, flags), log, {**os.environ, "PDSERVE_CACHE_DIR": str(model_cache_dir)},
                         cwd=REPO).start()
    try:
        group.wait_until(lambda: "pdserve ready" in group.log(1 << 30), 240, "pdserve serve")
        yield f"http://127.0.0.1:{port}"
    finally:
        group.stop(grace_s=20)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_against_pdserve(served: str, default_model_dir: Path, tmp_path: Path, endpoint: str) -> None:
    rc = main(["bench", "--base-url", served, "--endpoint", endpoint, "--num-prompts", "4", "--random-input-len",
               "24", "--random-output-len", "6", "--ignore-eos", "--request-rate", "inf", "--tokenizer",
               str(default_model_dir), "--goodput", "ttft:60000", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "r.json", "--disable-tqdm"])
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["output_lens"] == [6, 6, 6, 6]  # --ignore-eos: exactly max_tokens, as the server counts them
    assert result["input_lens"] == [24] * 4 or endpoint.endswith("chat/completions")
    assert all(0 < t < r / 1000 for t, r in zip(result["ttfts"], [result["mean_e2el_ms"] * 4] * 4))
    assert result["mean_tpot_ms"] > 0 and result["request_goodput"] == pytest.approx(result["request_throughput"])
    models = httpx.get(served + "/v1/models", timeout=10).json()["data"]
    assert result["model_id"] == models[0]["id"]


def test_sharegpt_eos_answers_count_as_completed(served: str, default_model_dir: Path, tmp_path: Path,
                                                sharegpt_path: Path) -> None:
    """The issue's run: 24 ShareGPT prompts on /v1/completions, where SmolLM2 answers several with EOS at once
    (7 of 24 in a run by hand: 200, finish_reason stop, usage 1 token, no text); bench counted them failed."""
    rc = main(["bench", "--base-url", served, "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_path),
               "--num-prompts", "24", "--sharegpt-output-len", "8", "--tokenizer", str(default_model_dir),
               "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "sg.json",
               "--disable-tqdm"])
    result = json.loads((tmp_path / "sg.json").read_text())
    assert rc == 0 and result["completed"] == 24 and result["failed"] == 0
    empty = [n for n, text in zip(result["output_lens"], result["generated_texts"]) if text == ""]
    assert empty and all(n <= 1 for n in empty), list(zip(result["output_lens"], result["generated_texts"]))
