"""The Llama-family forward against Hugging Face transformers on tiny random models (fp32, CPU), and the
equivalences the serving paths rely on: chunked = whole, batched = alone, padded decode = unpadded."""

from __future__ import annotations

import pytest
import torch
from tiny_hf_models import KINDS, TinyModel, hf_last_logits, make_tiny

from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.model import fuse_weights
from pdserve.engine.runner import ModelRunner

BLOCK = 4
TOL = 2e-5  # fp32, logits of magnitude ~1: summation order differs from HF's SDPA


@pytest.fixture(scope="module", params=KINDS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param))


def make_runner(tiny: TinyModel, num_blocks: int = 64, buckets: list[int] | None = None) -> ModelRunner:
    return ModelRunner(tiny.config, CacheConfig(num_blocks=num_blocks, block_size=BLOCK), tiny.weights, "cpu",
                       torch.float32, max_num_seqs=8, decode_buckets=buckets)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def table(first: int, n: int = 16) -> list[int]:
    return list(range(first, first + n))


def test_prefill_then_decode_match_hf(tiny: TinyModel) -> None:
    runner = make_runner(tiny)
    ids = prompt(21, 0)
    out = runner.prefill([PrefillChunk(ids, 0, table(0))])
    assert out.chunk_indices == [0] and out.num_tokens == 21
    logits = out.logits[0]
    torch.testing.assert_close(logits, hf_last_logits(tiny.hf, ids), atol=TOL, rtol=0)
    for _ in range(6):
        ids.append(int(logits.argmax()))
        logits = runner.decode([DecodeInput(ids[-1], len(ids) - 1, table(0))])[0]
        torch.testing.assert_close(logits, hf_last_logits(tiny.hf, ids), atol=TOL, rtol=0)


def test_chunked_prefill_equals_one_pass(tiny: TinyModel) -> None:
    ids = prompt(23, 1)
    whole = make_runner(tiny)
    expected = whole.prefill([PrefillChunk(ids, 0, table(0))]).logits[0]
    chunked = make_runner(tiny)
    for start in range(0, 23, 5):
        piece = ids[start:start + 5]
        out = chunked.prefill([PrefillChunk(piece, start, table(0), need_logits=start + 5 >= 23)])
    torch.testing.assert_close(out.logits[0], expected, atol=1e-5, rtol=0)
    for layer in range(tiny.config.num_layers):  # same K/V in the same slots
        torch.testing.assert_close(chunked.kv_caches[layer][:, :6], whole.kv_caches[layer][:, :6])


def test_batched_prefill_with_cached_prefix_equals_alone(tiny: TinyModel) -> None:
    """Three sequences in one packed batch, one continuing after 8 cached tokens, one not sampled."""
    a, b, c = prompt(13, 2), prompt(3, 3), prompt(20, 4)
    alone = []
    for ids in (a, b, c):
        alone.append(make_runner(tiny).prefill([PrefillChunk(ids, 0, table(0))]).logits[0])
    runner = make_runner(tiny)
    runner.prefill([PrefillChunk(b[:2] + c[:8], 0, table(40))])  # unrelated sequence first: dirty cache
    runner.prefill([PrefillChunk(c[:8], 0, table(20))])
    out = runner.prefill([
        PrefillChunk(tuple(a), 0, tuple(table(0, 4))),  # tuples, as cache_store hands out block ids
        PrefillChunk(b, 0, table(4, 1), need_logits=False),
        PrefillChunk(c[8:], 8, table(20, 5)),
    ])
    assert out.chunk_indices == [0, 2] and out.logits.shape == (2, tiny.config.vocab_size)
    torch.testing.assert_close(out.logits[0], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[1], alone[2], atol=1e-5, rtol=0)
    logits = runner.decode([DecodeInput(7, 3, tuple(table(4, 1))), DecodeInput(9, 13, table(0, 4))])
    torch.testing.assert_close(logits[0], hf_last_logits(tiny.hf, b + [7]), atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(tiny.hf, a + [9]), atol=TOL, rtol=0)


def test_padded_decode_bucket_writes_nothing_and_matches(tiny: TinyModel) -> None:
    runner = make_runner(tiny, buckets=[4, 8])
    seqs = [prompt(6, 5), prompt(11, 6), prompt(1, 7)]
    runner.prefill([PrefillChunk(s, 0, table(4 * i, 4)) for i, s in enumerate(seqs)])
    before = [kv.clone() for kv in runner.kv_caches]
    items = [DecodeInput(5, len(s), table(4 * i, 4)) for i, s in enumerate(seqs)]
    logits = runner.decode(items)  # bucket 4: one padded row
    assert logits.shape == (3, tiny.config.vocab_size)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], hf_last_logits(tiny.hf, s + [5]), atol=TOL, rtol=0)
    written = {(4 * i + len(s) // BLOCK, len(s) % BLOCK) for i, s in enumerate(seqs)}
    for kv, old in zip(runner.kv_caches, before, strict=True):
        changed = {(int(b), int(o)) for b, o in (kv != old).any(-1).any(-1).any(0).nonzero().tolist()}
        assert changed == written


def test_layer_done_follows_each_layers_kv_write(tiny: TinyModel) -> None:
    runner = make_runner(tiny)
    seen: list[tuple[int, bool, bool]] = []

    def layer_done(i: int) -> None:
        this_written = bool(runner.kv_caches[i][:, 2:4].abs().sum() > 0)
        next_written = i + 1 < len(runner.kv_caches) and bool(runner.kv_caches[i + 1][:, 2:4].abs().sum() > 0)
        seen.append((i, this_written, next_written))

    runner.prefill([PrefillChunk(prompt(7, 8), 0, [2, 3])], layer_done=layer_done)
    assert seen == [(i, True, False) for i in range(tiny.config.num_layers)]


def test_fused_layouts(tiny: TinyModel) -> None:
    fused = fuse_weights(tiny.config, tiny.weights, "cpu", torch.float32)
    layer = fused.layers[1]
    w = tiny.weights
    assert torch.equal(layer.qkv[: tiny.config.q_size], w["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(layer.qkv[-tiny.config.kv_size:], w["model.layers.1.self_attn.v_proj.weight"])
    gate = layer.gate_up[: tiny.config.intermediate_size]
    assert torch.equal(gate, w["model.layers.1.mlp.gate_proj.weight"])
    assert (layer.qkv_bias is not None) == tiny.config.attention_bias
    assert (fused.lm_head is fused.embed) == tiny.config.tie_word_embeddings


def test_weight_errors_name_the_problem(tiny: TinyModel) -> None:
    weights = dict(tiny.weights)
    del weights["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"1 weights missing .*layers\.2\.mlp\.up_proj"):
        fuse_weights(tiny.config, weights, "cpu", torch.float32)
    weights = dict(tiny.weights, **{"model.norm.weight": torch.ones(63)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight: \(63,\) \(expected \(64,\)\)"):
        fuse_weights(tiny.config, weights, "cpu", torch.float32)


def test_runner_in_fp16_stays_close(tiny: TinyModel) -> None:
    """Half precision runs the same code path; only rounding differs (loose bound, CPU fp16 matmul)."""
    ids = prompt(9, 9)
    runner = ModelRunner(tiny.config, CacheConfig(num_blocks=8, block_size=BLOCK), tiny.weights, "cpu",
                         torch.float16, max_num_seqs=2)
    assert runner.kv_caches[0].dtype == torch.float16 and runner.kv_caches[0].shape == (2, 8, BLOCK, 2, 16)
    logits = runner.prefill([PrefillChunk(ids, 0, [0, 1, 2])]).logits[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_last_logits(tiny.hf, ids), atol=0.05, rtol=0)



@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the launchers on CPU tensors under Triton's interpreter, "
                    "which is set only where no GPU is (tests/conftest.py)")
def test_whole_prompts_through_sdpa_equal_our_attention(tiny: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a table entry sending whole new prompts to SDPA (its math backend on CPU), the launchers run (Triton's
    interpreter) and give the reference's logits and KV: SDPA sees the keys RoPE rotated in place."""
    import importlib

    from pdserve import kernels

    dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports the function
    sdpa = dispatcher.prefill_attention_sdpa
    used: list[int] = []
    monkeypatch.setattr(dispatcher, "sdpa_entry", lambda *args: {"backend": "math", "min_tokens": 4, "max_seqs": 2})
    monkeypatch.setattr(dispatcher, "prefill_attention_sdpa", lambda *args: used.append(1) or sdpa(*args))
    chunks = [PrefillChunk(prompt(9, 1), 0, table(0)), PrefillChunk(prompt(14, 2), 0, table(16))]
    expected = make_runner(tiny)
    want = expected.prefill(chunks).logits
    runner = make_runner(tiny)
    kernels.set_backend("triton")
    try:
        got = runner.prefill(chunks).logits
    finally:
        kernels.set_backend("auto")
    assert len(used) == tiny.config.num_layers
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for ours, ref in zip(runner.kv_caches, expected.kv_caches, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
