"""The prefill warm-up (engine/prefill_warm_up.py): its plan, and that served batches compile nothing after it.

On a CPU the check runs over launch keys: the warm-up's batches and 200 random served ones go through the
real model and launchers on shape-only "meta" tensors (nothing is computed, the kernels are recorded, not
run), with the launchers choosing their configs as on the H200, and every served key must be a warm-up key:
a new constexpr or integer class that follows the batch fails here. On a GPU (skipped elsewhere) the same
random prefills run for real after the warm-up and Triton's own compile hook must not fire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator

import pytest
import torch
from served_batches import NUM_BLOCKS, served_batch

from pdserve import kernels
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_cache_spec import KVCacheSpec
from pdserve.engine.prefill_warm_up import WarmUpSequence, warm_up_limit, warm_up_plan
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.kernels import specialization

TINY = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_model_len=512)
BLOCK = 16


def test_plan_runs_each_gemv_bucket_each_power_of_two_and_the_limit_on_our_attention() -> None:
    plan = warm_up_plan(100, BLOCK, num_blocks=64)
    ours = WarmUpSequence(1, BLOCK)  # a continuation: keeps the batch off SDPA
    assert [sum(s.q_len for s in b) for b in plan] == [1, 2, 4, 8, 16, 32, 64, 100, 100]
    assert all(b[0] == ours for b in plan[:-1]) and plan[-1] == [WarmUpSequence(100)]
    assert plan[3] == [ours] + [WarmUpSequence(1)] * 7  # 8 rows and 8 logits rows: the GEMV's bucket 8
    assert [sum(s.q_len for s in b) for b in warm_up_plan(100, BLOCK, num_blocks=6)] == [1, 2, 4, 8, 16, 32, 64,
                                                                                         65, 100]
    assert warm_up_plan(0, BLOCK, 64) == [] and warm_up_plan(1, BLOCK, 64) == [[ours], [WarmUpSequence(1)]]
    assert warm_up_limit(2048, 8192, 10, BLOCK) == 9 * BLOCK and warm_up_limit(2048, 512, 4096, BLOCK) == 511


def test_prefill_warm_up_is_nothing_on_a_cpu() -> None:
    runner = ModelRunner(TINY, CacheConfig(num_blocks=8, block_size=BLOCK), dummy_weights(TINY, torch.float32, "cpu"),
                         "cpu", torch.float32, max_num_seqs=2)
    assert runner.warm_up_prefill(64) == 0


@pytest.fixture
def as_on_the_h200(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Launchers pick their configs as on the H200 (tiles, tuned GEMV table), kernels through the launchers."""
    from pdserve.kernels import linear_triton
    from pdserve.kernels import prefill_attention_triton as pre

    choose = pre._default_config
    monkeypatch.setattr(pre, "_default_config", lambda d, t, dev, n, h: choose(d, t, torch.device("cuda"), n, h))
    monkeypatch.setattr(linear_triton, "device_name", lambda device: "NVIDIA H200")
    linear_triton.choose_config.cache_clear()
    kernels.set_backend("triton")
    yield
    kernels.set_backend("auto")
    linear_triton.choose_config.cache_clear()


def _keys(runner: ModelRunner, batches: list[list[PrefillChunk]]) -> set[tuple]:
    with specialization.LaunchRecorder(run=False) as recorder:
        for chunks in batches:
            runner.prefill(chunks)
    return recorder.keys


@pytest.mark.parametrize("preset,dtype,budget,sdpa", [
    ("llama3-8b", torch.bfloat16, 2048, False), ("llama3-8b", torch.bfloat16, 8192, False),
    ("llama3-8b", torch.bfloat16, 8192, True), ("smollm2-135m", torch.bfloat16, 2048, False),
    ("tiny", torch.float32, 400, True)])
def test_served_batches_reach_only_warmed_up_kernels(preset: str, dtype: torch.dtype, budget: int, sdpa: bool,
                                                     as_on_the_h200: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """sdpa: with a table entry that sends whole new prompts of >= 256 tokens (up to 4) to SDPA (its math
    backend: shapes only here), the kernels our attention still needs are warmed up all the same."""
    dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports the function
    entry = {"backend": "math", "min_tokens": 256, "max_seqs": 4} if sdpa else None
    monkeypatch.setattr(dispatcher, "sdpa_entry", lambda *args: entry)
    # two layers: every layer launches the same keys (the first and last stay distinct), 16x fewer launches to walk
    config = TINY if preset == "tiny" else dataclasses.replace(get_preset(preset), num_layers=2, max_model_len=16384)
    runner = ModelRunner(config, CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
                         dummy_weights(config, dtype, "meta"), "meta", dtype, max_num_seqs=256)
    warm = _keys(runner, runner.prefill_warm_up_batches(budget))
    gen = torch.Generator().manual_seed(23)
    served = _keys(runner, [served_batch(gen, budget, config.max_model_len - 1) for _ in range(200)])
    new = sorted(served - warm)
    assert not new, f"{len(new)} launch keys reached by served batches but not by the warm-up, e.g. {new[:2]}"
    assert len(warm) < 60  # one key per kernel and config: a sum over buckets, not a product over batches


# what the tests below send to SDPA: whole new prompts of >= 512 tokens, up to 4 a batch, padded to 256s
BUCKETED = {"backend": "cudnn", "min_tokens": 512, "max_seqs": 4, "bucket": 256}


@contextlib.contextmanager
def sdpa_shapes(monkeypatch: pytest.MonkeyPatch, entry: dict, run: bool) -> Iterator[set[tuple]]:
    """The (dims, strides) of q, k, v at every SDPA call, with `entry` as the device's table entry: what
    cuDNN keys its execution plans by. run=False: nothing computed, an empty output of the right shape."""
    dispatcher = importlib.import_module("pdserve.kernels.prefill_attention")  # the package exports the function
    monkeypatch.setattr(dispatcher, "sdpa_entry", lambda *args: entry)
    real = torch.nn.functional.scaled_dot_product_attention
    seen: set[tuple] = set()

    def record(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.add(tuple((tuple(t.shape), t.stride()) for t in (q, k, v)))
        return real(q, k, v, **kwargs) if run else q.new_empty(q.shape)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    yield seen


@pytest.mark.parametrize("budget,kv", [(2048, "auto"), (8192, "auto"), (8192, "fp8")])
def test_served_prompts_reach_only_the_sdpa_shapes_the_warm_up_planned(
        budget: int, kv: str, as_on_the_h200: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN builds a plan (47-52 ms on the H200) for each new (dims, strides); the warm-up runs SDPA at every
    padded length, so 200 random served batches (1 in 5 whole new prompts) must meet none it has not run; over
    an fp8 cache too, whose prompts run SDPA on their codes."""
    config = dataclasses.replace(get_preset("llama3-8b"), num_layers=2, max_model_len=16384)
    runner = ModelRunner(config, CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
                         dummy_weights(config, torch.bfloat16, "meta"), "meta", torch.bfloat16, max_num_seqs=256,
                         kv_spec=KVCacheSpec.build(kv, torch.bfloat16, config.num_layers))
    gen = torch.Generator().manual_seed(29)
    with sdpa_shapes(monkeypatch, BUCKETED, run=False) as seen:
        assert runner.warm_up_sdpa(budget) == len(range(512, budget + 1, 256))
        warm = set(seen)
        seen.clear()
        _keys(runner, [served_batch(gen, budget, config.max_model_len - 1) for _ in range(200)])
    assert seen, "no served batch went to SDPA: the test checks nothing"
    assert not seen - warm, f"SDPA shapes no warm-up call ran: {sorted(seen - warm)[:2]}"


def test_an_fp8_cache_plans_the_same_sdpa_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 KV cache's whole prompts run SDPA on their codes in the model dtype's fused layout
    (kernels/prefill_attention.py prefill_attention_sdpa_fp8), so its warm-up plans what the model dtype's does;
    the limits (the entry's shortest prompt, the model length) bound both alike."""
    runners = [ModelRunner(TINY, CacheConfig(num_blocks=64, block_size=BLOCK), dummy_weights(TINY, torch.bfloat16,
                                                                                           "meta"), "meta",
                           torch.bfloat16, max_num_seqs=4, kv_spec=KVCacheSpec.build(kv, torch.bfloat16, 2))
               for kv in ("fp8", "auto")]
    with sdpa_shapes(monkeypatch, BUCKETED, run=False) as seen:
        assert [r.warm_up_sdpa(511) for r in runners] == [0, 0]  # TINY's limit is 511 tokens: under min_tokens 512
        assert [r.warm_up_sdpa(2048) for r in runners] == [0, 0]  # the model length bounds the limit too
        assert not seen
    small = {**BUCKETED, "min_tokens": 100, "bucket": 128}
    planned = []
    for runner in runners:
        with sdpa_shapes(monkeypatch, small, run=False) as seen:
            assert runner.warm_up_sdpa(511) == 4  # 128, 256, 384, 512 rows
        planned.append(set(seen))
    assert planned[0] == planned[1] and len(planned[0]) == 4


def test_without_buckets_served_lengths_would_need_new_plans(as_on_the_h200: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a 700-token prompt runs at 768 rows, a shape the bucketed warm-up ran; served
    unpadded (an entry without "bucket") it is a shape of its own, which cuDNN would plan on the request."""
    config = dataclasses.replace(get_preset("llama3-8b"), num_layers=1, max_model_len=4096)
    runner = ModelRunner(config, CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
                         dummy_weights(config, torch.bfloat16, "meta"), "meta", torch.bfloat16, max_num_seqs=4)
    prompt = [[PrefillChunk(list(range(700)), 0, list(range(700 // BLOCK + 1)))]]
    with sdpa_shapes(monkeypatch, BUCKETED, run=False) as seen:
        assert runner.warm_up_sdpa(1024) == 3  # 512, 768, 1024
        warm = set(seen)
        _keys(runner, prompt)
        assert seen == warm
    unpadded = {k: v for k, v in BUCKETED.items() if k != "bucket"}
    with sdpa_shapes(monkeypatch, unpadded, run=False) as seen:
        _keys(runner, prompt)
    assert seen and not seen & warm


def _random_prefills(runner: ModelRunner, count: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(count):
        chunks = served_batch(gen, budget, runner.config.max_model_len - 1)
        runner.prefill([dataclasses.replace(c, block_table=[b % runner.cache_config.num_blocks for b in c.block_table])
                        for c in chunks])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts real Triton compiles: needs a GPU")
@pytest.mark.parametrize("budget", [2048, 8192])
def test_no_compile_after_warm_up_on_a_gpu(budget: int) -> None:
    """Llama-3-8B's shapes (two of its layers) in bf16, as served: warm-up, then 200 random prefills."""
    config = dataclasses.replace(get_preset("llama3-8b"), num_layers=2, max_model_len=16384)
    runner = ModelRunner(config, CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16, max_num_seqs=256,
                         enforce_eager=True)  # no decode graphs: this is about prefill
    assert runner.warm_up_prefill(budget) > 0
    cached = specialization.cached_kernels()
    with specialization.CompileCounter() as counter:
        _random_prefills(runner, 200, budget)
        torch.cuda.synchronize()
    assert counter.compiled == [], f"{len(counter.compiled)} compiles after the warm-up: {counter.compiled[:3]}"
    assert specialization.cached_kernels() == cached


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs cuDNN: needs a GPU")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_no_cudnn_plan_after_warm_up_on_a_gpu(kv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cuDNN entry (whole prompts of >= 512 tokens padded to 256s): the warm-up runs cuDNN at every padded
    length, then 200 random prefills send it only shapes the warm-up ran (its plans' keys), compile no Triton
    kernel, and give the logits ours gives (within bf16's rounding) on a whole prompt of an odd length; over an
    fp8 cache too (SDPA on the codes against ours reading the pages)."""
    config = dataclasses.replace(get_preset("llama3-8b"), num_layers=2, max_model_len=16384)
    runner = ModelRunner(config, CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK),
                         dummy_weights(config, torch.bfloat16, "cuda"), "cuda", torch.bfloat16, max_num_seqs=256,
                         enforce_eager=True, kv_spec=KVCacheSpec.build(kv, torch.bfloat16, config.num_layers))
    prompt = [PrefillChunk([(7 * j + 3) % 512 for j in range(1000)], 0, list(range(63)))]
    ours = runner.prefill(prompt).logits
    with sdpa_shapes(monkeypatch, BUCKETED, run=True) as seen:
        assert runner.warm_up_prefill(8192) > 0
        warm = set(seen)
        assert len(warm) == len(range(512, 8193, 256))
        cached = specialization.cached_kernels()
        with specialization.CompileCounter() as counter:
            _random_prefills(runner, 200, 8192)
            padded = runner.prefill(prompt).logits
            torch.cuda.synchronize()
    assert seen and not seen - warm, f"SDPA shapes no warm-up call ran: {sorted(seen - warm)[:2]}"
    assert counter.compiled == [] and specialization.cached_kernels() == cached
    assert float((padded - ours).norm() / ours.norm()) < 2e-2  # bf16 attention: 1e-3..1e-2 apart


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the warm-up runs on CUDA only")
def test_prefill_warm_up_runs_and_leaves_outputs_unchanged() -> None:
    def prefilled(warm_up_tokens: int) -> tuple[ModelRunner, list[DecodeInput], int]:
        runner = ModelRunner(TINY, CacheConfig(num_blocks=32, block_size=BLOCK),
                             dummy_weights(TINY, torch.float32, "cuda", seed=2), "cuda", torch.float32, max_num_seqs=4)
        warmed = runner.warm_up_prefill(warm_up_tokens) if warm_up_tokens else 0  # before any block is used
        gen = torch.Generator().manual_seed(3)
        items = []
        for i in range(4):
            length = int(torch.randint(1, 100, (1,), generator=gen))
            table = list(range(i * 8, (i + 1) * 8))
            runner.prefill([PrefillChunk(torch.randint(0, 512, (length,), generator=gen).tolist(), 0, table)])
            items.append(DecodeInput(int(torch.randint(0, 512, (1,), generator=gen)), length, table))
        return runner, items, warmed

    cold, items, _ = prefilled(0)
    warm, same, warmed = prefilled(100)
    assert warmed == len(warm_up_plan(100, BLOCK, 32)) and same == items
    torch.testing.assert_close(warm.decode(items), cold.decode(items), rtol=0, atol=1e-5)
