from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import SLOs, compute_metrics, percentile_word


def _out(ttft: float, itl: list[float], n_out: int, prompt_len: int = 10, ok: bool = True,
         turn: int = 0) -> RequestOutput:
    return RequestOutput(success=ok, prompt_len=prompt_len, output_len=n_out, ttft=ttft, itl=tuple(itl),
                         latency=ttft + sum(itl), start_time=0.0, error="" if ok else "boom", turn=turn)


def test_metric_math_on_recorded_timings() -> None:
    outs = [_out(0.1, [0.02, 0.02, 0.02], 4), _out(0.3, [0.05] * 9, 10, prompt_len=20), _out(0.0, [], 0, ok=False)]
    m = compute_metrics(outs, duration=2.0, slos=SLOs(ttft_ms=200, tpot_ms=30), percentiles=[50, 99, 99.9])
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 14)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(7.0)
    assert m.total_token_throughput == pytest.approx(22.0)
    assert m.request_goodput == pytest.approx(0.5)  # only the first meets TTFT <= 200 ms and TPOT <= 30 ms
    d = m.to_dict()
    assert d["mean_ttft_ms"] == pytest.approx(200.0) and d["median_ttft_ms"] == pytest.approx(200.0)
    assert d["std_ttft_ms"] == pytest.approx(100.0)
    assert d["mean_tpot_ms"] == pytest.approx((20.0 + 50.0) / 2)
    itl_ms = np.array([20.0] * 3 + [50.0] * 9)
    assert d["mean_itl_ms"] == pytest.approx(itl_ms.mean())
    assert d["p99_itl_ms"] == pytest.approx(np.percentile(itl_ms, 99))
    assert d["p99.9_e2el_ms"] == pytest.approx(np.percentile([160.0, 750.0], 99.9))
    assert d["p50_ttft_ms"] == pytest.approx(200.0)


def test_ttft_by_turn_only_for_multi_turn_runs() -> None:
    assert compute_metrics([_out(0.1, [], 1), _out(0.2, [], 1)], duration=1.0).ttft_by_turn == {}
    outs = [_out(0.4, [], 1), _out(0.6, [], 1), _out(0.1, [], 1, turn=1), _out(0.3, [], 1, turn=1),
            _out(9.0, [], 1, ok=False, turn=1), _out(0.05, [], 1, turn=2)]
    by_turn = compute_metrics(outs, duration=1.0, percentiles=[90]).ttft_by_turn
    assert list(by_turn) == [1, 2, 3]
    assert by_turn[1].median_ms == pytest.approx(500.0) and by_turn[2].median_ms == pytest.approx(200.0)
    assert by_turn[2].percentiles_ms == ((90, pytest.approx(np.percentile([100.0, 300.0], 90))),)
    assert by_turn[3].mean_ms == pytest.approx(50.0)


def test_tpot_skips_single_token_answers_but_goodput_counts_them() -> None:
    outs = [_out(0.05, [], 1), _out(0.05, [0.1], 2)]
    m = compute_metrics(outs, duration=1.0, slos=SLOs(tpot_ms=50))
    assert m.per_request.tpots_s == [pytest.approx(0.1)]
    assert m.request_goodput == pytest.approx(1.0)


def test_output_len_falls_back_to_tokenizer_then_chunks(tiny_tokenizer) -> None:
    text = " hello world, how are you"
    out = RequestOutput(success=True, prompt_len=0, output_len=0, ttft=0.1, itl=(0.01, 0.01), latency=0.12,
                        start_time=0.0, generated_text=text, server_prompt_tokens=9)
    with_tok = compute_metrics([out], 1.0, tokenizer=tiny_tokenizer)
    assert with_tok.total_output_tokens == len(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert with_tok.total_input_tokens == 9  # the server's usage when the benchmark could not count
    assert compute_metrics([out], 1.0).total_output_tokens == 3


def test_slo_parsing_and_errors() -> None:
    assert SLOs.parse(["ttft:200", "tpot:50", "e2el:3000"]) == SLOs(200.0, 50.0, 3000.0)
    assert not SLOs.parse(None).is_set()
    with pytest.raises(ValueError, match="itl:5"):
        SLOs.parse(["itl:5"])
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)
    assert percentile_word(99.0) == "99" and percentile_word(99.9) == "99.9"
