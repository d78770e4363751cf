"""build_prefill_batch against a per-token loop over random chunk mixes (CPU), and a whole prefill on CUDA that
must not synchronize the host with the device (torch.cuda.set_sync_debug_mode("error") raises on any sync,
such as the pageable `.to(device)` copies the batch build used to make)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention_metadata import PrefillChunk, build_prefill_batch
from pdserve.engine.config import CacheConfig
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights

BLOCK = 4


def expected(chunks: list[PrefillChunk], block_size: int) -> dict[str, list]:
    """The packed fields token by token, straight from the definitions in attention_metadata's docstring."""
    out: dict[str, list] = {k: [] for k in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens",
                                            "logits_indices")}
    out["cu_seqlens_q"].append(0)
    row = 0
    for c in chunks:
        for j, token in enumerate(c.token_ids):
            p = c.start_pos + j
            out["input_ids"].append(token)
            out["positions"].append(p)
            out["slot_mapping"].append(c.block_table[p // block_size] * block_size + p % block_size)
            if c.all_logits or (c.need_logits and j == len(c.token_ids) - 1):
                out["logits_indices"].append(row + j)
        row += len(c.token_ids)
        out["cu_seqlens_q"].append(row)
        out["seq_lens"].append(c.start_pos + len(c.token_ids))
    width = max(1, max(len(c.block_table) for c in chunks))
    out["block_tables"] = [[*c.block_table] + [0] * (width - len(c.block_table)) for c in chunks]
    return out


def random_chunks(rng: random.Random) -> list[PrefillChunk]:
    chunks = []
    for _ in range(rng.randint(1, 6)):
        n, start = rng.randint(1, 23), rng.choice([0, 0, rng.randint(1, 40)])
        blocks = -(-(start + n) // BLOCK) + rng.randint(0, 2)  # some tables longer than needed
        table = rng.sample(range(200), blocks)
        all_logits = rng.random() < 0.2
        chunks.append(PrefillChunk([rng.randint(0, 999) for _ in range(n)], start, table,
                                   need_logits=all_logits or rng.random() < 0.7, all_logits=all_logits))
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_batch_equals_token_by_token(seed: int) -> None:
    chunks = random_chunks(random.Random(seed))
    batch = build_prefill_batch(chunks, BLOCK, torch.device("cpu"))
    want = expected(chunks, BLOCK)
    dtypes = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
              "cu_seqlens_q": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32,
              "logits_indices": torch.int64}
    for name, dtype in dtypes.items():
        got = getattr(batch, name)
        assert got.dtype == dtype, name
        assert got.tolist() == want[name], name
        assert got.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned (Triton's alignment class would differ)"
    assert batch.shape.q_lens == tuple(len(c.token_ids) for c in chunks)
    assert batch.shape.cached == any(c.start_pos > 0 for c in chunks)


def test_batch_rejects_short_table_and_empty_chunk() -> None:
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        build_prefill_batch([PrefillChunk(list(range(5)), 0, [3])], BLOCK, torch.device("cpu"))
    with pytest.raises(ValueError, match="chunk 1 has no tokens"):
        build_prefill_batch([PrefillChunk([1], 0, [0]), PrefillChunk([], 0, [1])], BLOCK, torch.device("cpu"))


def test_prompt_logprob_rows_and_sampled_rows_agree(tmp_path: Path) -> None:
    """A batch with an all_logits chunk: each chunk's sampled row is its last row, as computed alone."""
    tiny = pytest.importorskip("tiny_hf_models").make_tiny("llama", tmp_path)  # transformers: not on every GPU host
    runner = ModelRunner(tiny.config, CacheConfig(num_blocks=32, block_size=BLOCK), tiny.weights, "cpu",
                         torch.float32, max_num_seqs=4)
    a, b = PrefillChunk(list(range(3, 14)), 0, [0, 1, 2], all_logits=True), PrefillChunk([5, 9, 4], 0, [3])
    out = runner.prefill([a, b])
    assert out.chunk_indices == [0, 1] and out.all_logits[0].shape[0] == 11
    torch.testing.assert_close(out.logits[0], out.all_logits[0][-1])
    alone = runner.prefill([PrefillChunk(b.token_ids, 0, [4])]).logits[0]
    torch.testing.assert_close(out.logits[1], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_equals_cpu_batch() -> None:
    """Pinned staging, non_blocking copies, many batches in flight: what lands on the device is the host's."""
    mixes = [random_chunks(random.Random(seed)) for seed in range(50)]
    on_device = [build_prefill_batch(chunks, BLOCK, torch.device("cuda")) for chunks in mixes]  # no sync between
    for chunks, got in zip(mixes, on_device, strict=True):
        want = build_prefill_batch(chunks, BLOCK, torch.device("cpu"))
        for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables",
                     "logits_indices"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_never_syncs_the_host() -> None:
    config = get_preset("smollm2-135m")
    runner = ModelRunner(config, CacheConfig(num_blocks=64, block_size=16),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16, max_num_seqs=4,
                         enforce_eager=True)
    batches = [[PrefillChunk(list(range(3, 300)), 0, list(range(19)))],  # one whole prompt
               [PrefillChunk(list(range(5, 40)), 32, list(range(20, 25))),  # a cached prefix + a short prompt
                PrefillChunk(list(range(7, 20)), 0, [30])],
               [PrefillChunk(list(range(9, 30)), 0, [40, 41], all_logits=True),  # prompt logprobs
                PrefillChunk(list(range(2, 12)), 0, [42])]]
    for chunks in batches:  # compiles and first-shape library calls are the warm-up's business
        runner.prefill(chunks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [runner.prefill(chunks).logits for chunks in batches for _ in range(2)]  # pinned blocks reused
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [o.shape[0] for o in outs] == [1, 1, 2, 2, 2, 2]
    for first, again in zip(outs[::2], outs[1::2], strict=True):  # a reused pinned block raced: other inputs
        torch.testing.assert_close(again, first, rtol=1e-2, atol=1e-2)
    assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[4]).all()


def test_many_logit_rows_are_sliced_with_a_tick_between(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt logprobs of a long prompt are seconds of lm_head and log_softmax on a CPU: the step thread ticks
    between slices of rows (else the router sees no progress for --stream-stall-timeout and drops the worker),
    and the sliced rows and entries are the unsliced ones."""
    from pdserve.engine import model, prompt_logprobs

    tiny = pytest.importorskip("tiny_hf_models").make_tiny("llama", tmp_path)
    runner = ModelRunner(tiny.config, CacheConfig(num_blocks=32, block_size=BLOCK), tiny.weights, "cpu",
                         torch.float32, max_num_seqs=4)
    prompt = [(7 * i) % 90 + 3 for i in range(41)]
    chunks = [PrefillChunk(prompt, 0, list(range(11)), all_logits=True)]
    whole = runner.prefill(chunks).all_logits[0].clone()
    entries = prompt_logprobs.chunk_entries(whole, prompt, 0, 2)
    ticks: list[int] = []
    monkeypatch.setattr(model, "LOGIT_ROWS_PER_SLICE", 8)
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 16)
    sliced = runner.prefill(chunks, tick=lambda: ticks.append(1)).all_logits[0]
    assert len(ticks) == 6  # 41 rows: 5 full slices of 8 and one of 1
    torch.testing.assert_close(sliced, whole)
    ticks.clear()
    assert prompt_logprobs.chunk_entries(sliced, prompt, 0, 2, tick=lambda: ticks.append(1)) == entries
    assert len(ticks) == 3 and len(entries) == 40  # 40 targets: slices of 16, 16 and 8
