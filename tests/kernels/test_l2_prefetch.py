"""kernels/l2_prefetch.py: the byte plan (o_proj whole, gate_up's row heads, within the L2 share), that the decode
forward asks for it once a layer and the prefill never, that it does nothing where it cannot run; on an sm_90 GPU
(skipped elsewhere), that decode graphs captured with it launch it and give the logits of graphs without it."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.kernels import l2_prefetch
from pdserve.kernels.fp8_weight import quantize_weight_fp8

TINY = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_model_len=512)
META = torch.device("meta")
MB = 1 << 20


def test_the_plan_takes_the_first_weight_whole_then_spreads_the_rest_over_the_second_rows() -> None:
    o, gate_up = torch.empty(4096, 4096, dtype=torch.uint8, device=META), torch.empty(28672, 4096, dtype=torch.uint8,
                                                                                       device=META)
    a, b = l2_prefetch.plan(o, gate_up, 50 * MB, 0.6)  # llama3-8b's fp8 o_proj and gate_up, a 50 MB L2
    assert a == 4096 and b % 16 == 0 and 0 < b < 4096
    assert 4096 * a + 28672 * b <= 0.6 * 50 * MB < 4096 * a + 28672 * (b + 16)  # the budget, to 16 bytes a row
    bf16_o = torch.empty(4096, 4096, dtype=torch.bfloat16, device=META)  # 32 MiB: more than the whole budget
    a, b = l2_prefetch.plan(bf16_o, gate_up, 50 * MB, 0.6)
    assert (a, b) == (int(0.6 * 50 * MB) // 4096 // 16 * 16, 0) and a < 8192
    assert l2_prefetch.plan(o, gate_up, 1 << 40, 0.6) == (4096, 4096)  # never past a row


def test_decode_asks_for_it_once_a_layer_and_prefill_never(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(kernels, "prefetch_weights_l2", lambda first, then, rows: calls.append((first, then, rows)))
    weights = dummy_weights(TINY, torch.float32, "cpu", seed=1)
    runner = ModelRunner(TINY, CacheConfig(num_blocks=16, block_size=16), weights, "cpu", torch.float32,
                         max_num_seqs=4)
    runner.prefill([PrefillChunk(list(range(1, 20)), 0, [0, 1])])
    assert calls == []
    runner.decode([DecodeInput(5, 19, [0, 1]), DecodeInput(6, 0, [2])])
    layers = runner.model.weights.layers
    assert [(f, t) for f, t, _ in calls] == [(w.o_proj, w.gate_up) for w in layers]
    assert {rows for _, _, rows in calls} == {2}


def test_it_does_nothing_off_cuda_or_past_its_batches(monkeypatch) -> None:
    monkeypatch.setattr(l2_prefetch, "MAX_ROWS", 64)
    launched = []
    monkeypatch.setattr(l2_prefetch, "plan", lambda *a: launched.append(a) or (16, 16))
    w = quantize_weight_fp8(torch.randn(32, 64))
    l2_prefetch.prefetch_weights_l2(w, w, 1)  # a CPU weight: no device to prefetch on
    monkeypatch.setattr(l2_prefetch, "MAX_ROWS", 0)
    l2_prefetch.prefetch_weights_l2(w, w, 1)
    assert launched == []


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the bulk L2 prefetch needs sm_90")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_graphs_captured_with_the_prefetch_launch_it_and_give_the_logits_without_it(quantization: str,
                                                                                    monkeypatch) -> None:
    from pdserve.kernels.specialization import LaunchRecorder

    logits, launched = [], []
    for max_rows in (0, 64):  # read at each call: each runner's graphs are captured under its value
        monkeypatch.setattr(l2_prefetch, "MAX_ROWS", max_rows)
        weights = dummy_weights(TINY, torch.bfloat16, "cuda", seed=2)
        with LaunchRecorder() as recorder:
            runner = ModelRunner(TINY, CacheConfig(num_blocks=64, block_size=16), weights, "cuda", torch.bfloat16,
                                 max_num_seqs=8, quantization=quantization)
        launched.append(any(key[0] == "_l2_prefetch_kernel" for key in recorder.keys))
        table = list(range(8))
        runner.prefill([PrefillChunk(list(range(1, 70)), 0, table)])
        items = [DecodeInput(7, 69, table)] + [DecodeInput(3 + i, 0, [8 + i]) for i in range(4)]
        logits.append(torch.stack([runner.decode(items[:n])[0].clone() for n in (1, 5)]))
    assert launched == [False, True]
    assert logits[0].equal(logits[1])
