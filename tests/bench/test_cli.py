"""`pdserve bench` end to end through the CLI entry point, against the FakeOpenAIServer (see conftest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main


def test_bench_saves_vllm_named_results_and_plots(fake_server, tmp_path: Path, capsys) -> None:
    rc = main(["bench", "--base-url", fake_server.url, "--num-prompts", "12", "--random-input-len", "16",
               "--random-output-len", "5", "--request-rate", "200", "--goodput", "ttft:500", "tpot:100",
               "--tokenizer", "none", "--save-result", "--plot", "--result-dir", str(tmp_path),
               "--result-filename", "run.json", "--disable-tqdm"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "Request goodput (req/s):" in table and "P99 TTFT (ms):" in table
    result = json.loads((tmp_path / "run.json").read_text())
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "std_ttft_ms", "p90_tpot_ms", "mean_itl_ms",
                "mean_e2el_ms", "request_throughput", "output_throughput", "total_token_throughput",
                "completed", "total_input_tokens", "total_output_tokens", "duration", "request_goodput"):
        assert key in result, key
    assert result["completed"] == 12 and result["total_output_tokens"] == 60 and result["total_input_tokens"] == 192
    assert result["model_id"] == "fake-model" and result["request_goodput"] > 0
    assert len(result["ttfts"]) == 12 and all(len(itl) == 4 for itl in result["itls"])
    assert (tmp_path / "run-cdf.png").stat().st_size > 1000


def test_sweep_writes_one_result_per_rate_and_sweep_plot(fake_server, tmp_path: Path,
                                                          tiny_tokenizer_dir: Path, capsys) -> None:
    rc = main(["bench", "--base-url", fake_server.url, "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
               "--dataset-name", "multiturn", "--multiturn-turns", "2", "--random-input-len", "8",
               "--random-output-len", "3", "--tokenizer", str(tiny_tokenizer_dir), "--sweep-rate", "50,inf", "--save-result",
               "--result-dir", str(tmp_path), "--label", "t", "--disable-tqdm"])
    assert rc == 0
    sweep = json.loads((tmp_path / "pdserve-sweep-t-sweep.json").read_text())
    assert sweep["rates"] == [50.0, float("inf")] and [r["completed"] for r in sweep["runs"]] == [12, 12]
    assert (tmp_path / "pdserve-sweep-t-sweep.png").stat().st_size > 1000
    assert "Turn 2 median TTFT (ms):" in capsys.readouterr().out  # multi-turn: TTFT by turn index
    runs = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("pdserve-bench-*.json"))]
    assert len(runs) == 2 and all(set(run["ttft_by_turn"]) == {"1", "2"} for run in runs)
    assert all("p99_ms" in run["ttft_by_turn"]["2"] for run in runs)


def test_bad_flags_fail_with_the_reason(fake_server, capsys) -> None:
    assert main(["bench", "--base-url", fake_server.url, "--percentile-metrics", "ttft,foo"]) == 2
    assert "foo" in capsys.readouterr().err
    assert main(["bench", "--base-url", fake_server.url, "--endpoint", "/v1/chat/completions", "--tokenizer",
                 "none", "--num-prompts", "2"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="dataset-path"):
        main(["bench", "--base-url", fake_server.url, "--dataset-name", "sharegpt", "--tokenizer", "none"])
