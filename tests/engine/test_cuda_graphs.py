"""Decode CUDA graphs: which buckets are captured and in what order, what padding rows hold, that CPU stays
eager; on a GPU (skipped elsewhere), that a graph replay gives the eager forward's logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine.attention_metadata import DecodeBuffers, DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_order, use_cuda_graphs
from pdserve.engine.runner import ModelRunner, default_decode_buckets
from pdserve.engine.weights.dummy import dummy_weights

TINY = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_model_len=512)
BLOCK = 16


def test_buckets_on_cuda_follow_the_batch_closely_and_are_captured_largest_first() -> None:
    cuda = torch.device("cuda")
    buckets = default_decode_buckets(256, cuda)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 256 and len(buckets) == 23
    gaps = [b - a for a, b in itertools.pairwise(buckets)]
    assert max(gaps[:10]) == 8 and set(gaps[10:]) == {16}  # every 8 up to 64, every 16 up to 256
    assert default_decode_buckets(512, cuda)[-9:] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert default_decode_buckets(48, cuda) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert default_decode_buckets(100, cuda)[-3:] == [80, 96, 100]
    assert capture_order([1, 2, 4, 8, 16, 24, 48]) == [48, 24, 16, 8, 4, 2, 1]
    buffers = DecodeBuffers(48, 8, BLOCK, torch.device("cpu"), default_decode_buckets(48, cuda))
    assert [buffers.bucket_for(n) for n in (1, 3, 8, 17, 33, 48)] == [1, 4, 8, 24, 40, 48]
    with pytest.raises(ValueError, match="exceeds the largest bucket 48"):
        buffers.bucket_for(49)


def test_graphs_only_on_cuda_and_only_unless_eager() -> None:
    assert use_cuda_graphs(torch.device("cuda", 0), enforce_eager=False)
    assert not use_cuda_graphs(torch.device("cuda", 0), enforce_eager=True)
    assert not use_cuda_graphs(torch.device("cpu"), enforce_eager=False)
    buffers = DecodeBuffers(4, 8, BLOCK, torch.device("cpu"), [1, 2, 4])
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(lambda batch: batch.input_ids, buffers, torch.device("cpu"))


def test_padded_rows_write_nothing_and_attend_to_nothing() -> None:
    buffers = DecodeBuffers(8, 8, BLOCK, torch.device("cpu"), [1, 2, 4, 8])
    items = [DecodeInput(5, 17, [3, 9]), DecodeInput(6, 0, [4]), DecodeInput(7, 31, [1, 2])]
    batch = buffers.prepare(items)
    assert batch.num_seqs == 3 and batch.input_ids.shape == (4,)
    assert batch.slot_mapping.tolist() == [9 * BLOCK + 1, 4 * BLOCK, 2 * BLOCK + 15, -1]
    assert batch.seq_lens.tolist() == [18, 1, 32, 0]
    assert batch.block_tables[3].tolist() == [0] * 8 and batch.block_tables[0, :3].tolist() == [3, 9, 0]
    pad = buffers.padding_batch(8)  # what a graph is captured on: every row is padding
    assert pad.num_seqs == 0 and pad.slot_mapping.tolist() == [-1] * 8 and pad.seq_lens.tolist() == [0] * 8
    assert int(pad.block_tables.abs().sum()) == 0
    with pytest.raises(ValueError, match="not one of the decode buckets"):
        buffers.padding_batch(3)


def test_cpu_runner_is_eager_and_padding_does_not_change_logits() -> None:
    weights = dummy_weights(TINY, torch.float32, "cpu", seed=1)
    padded = ModelRunner(TINY, CacheConfig(num_blocks=16, block_size=BLOCK), weights, "cpu", torch.float32,
                         max_num_seqs=4, decode_buckets=[4])
    exact = ModelRunner(TINY, CacheConfig(num_blocks=16, block_size=BLOCK), weights, "cpu", torch.float32,
                        max_num_seqs=4)
    assert padded.graphs is None and exact.graphs is None
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    for runner in (padded, exact):
        runner.prefill([PrefillChunk(ids, 0, [0, 1])])
    items = [DecodeInput(11, 20, [0, 1])]
    torch.testing.assert_close(padded.decode(items), exact.decode(items), rtol=0, atol=1e-6)


def _prefilled_runner(dtype: torch.dtype, max_num_seqs: int) -> tuple[ModelRunner, list[DecodeInput]]:
    blocks_per_seq = 8  # 128 tokens of room
    runner = ModelRunner(TINY, CacheConfig(num_blocks=max_num_seqs * blocks_per_seq, block_size=BLOCK),
                         dummy_weights(TINY, dtype, "cuda", seed=2), "cuda", dtype, max_num_seqs=max_num_seqs)
    gen = torch.Generator().manual_seed(3)
    items = []
    for i in range(max_num_seqs):
        length = int(torch.randint(1, 100, (1,), generator=gen))
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        runner.prefill([PrefillChunk(torch.randint(0, 512, (length,), generator=gen).tolist(), 0, table)])
        items.append(DecodeInput(int(torch.randint(0, 512, (1,), generator=gen)), length, table))
    return runner, items


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_forward(dtype: torch.dtype) -> None:
    runner, items = _prefilled_runner(dtype, max_num_seqs=32)
    assert runner.graphs is not None and runner.graphs.captured_buckets == [1, 2, 4, 8, 16, 24, 32]
    for n in (1, 3, 8, 17):
        graph = runner.decode(items[:n]).clone()
        eager = runner._forward_decode(runner.decode_buffers.prepare(items[:n]))[:n]
        assert graph.shape == (n, TINY.vocab_size)
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
        # a second replay with other live rows: nothing of the first batch may leak into it
        others = items[n:2 * n]  # 15 rows for n = 17: the bucket of 16, padded by one
        again = runner.decode(others).clone()
        eager = runner._forward_decode(runner.decode_buffers.prepare(others))[:len(others)]
        torch.testing.assert_close(again, eager, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_graphs_captured_with_pdl_give_the_logits_of_graphs_without_it(quantization: str, monkeypatch) -> None:
    from pdserve.kernels import pdl

    logits = []
    for enabled in (False, True):  # read at each launch: each runner's graphs are captured under its value
        monkeypatch.setattr(pdl, "ENABLED", enabled)  # restored after the test
        weights = dummy_weights(TINY, torch.bfloat16, "cuda", seed=2)
        runner = ModelRunner(TINY, CacheConfig(num_blocks=64, block_size=BLOCK), weights, "cuda",
                             torch.bfloat16, max_num_seqs=8, quantization=quantization)
        table = list(range(8))
        runner.prefill([PrefillChunk(list(range(1, 70)), 0, table)])
        items = [DecodeInput(7, 69, table)] + [DecodeInput(3 + i, 0, [8 + i]) for i in range(4)]
        logits.append(torch.stack([runner.decode(items[:n])[0].clone() for n in (1, 5)]))
    assert logits[0].equal(logits[1])
