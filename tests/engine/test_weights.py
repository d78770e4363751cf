"""The embedded default model: fetched, converted once, loaded fast, and equal to what transformers loads."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pdserve.engine.presets import PRESETS, weight_shapes
from pdserve.engine.weights import DEFAULT_MODEL, LoadedModel, ModelSpec, load_model, load_tokenizer


def test_weights_equal_transformers_gguf_load(loaded_default: LoadedModel, hf_model: torch.nn.Module) -> None:
    """Same dequantisation and the same undoing of llama.cpp's q/k row permutation, bit for bit."""
    hf = hf_model.state_dict()
    ours = loaded_default.weights
    assert set(ours) == set(hf)
    for name, tensor in hf.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name


def test_config_comes_from_gguf_metadata(loaded_default: LoadedModel, hf_model: torch.nn.Module) -> None:
    config = loaded_default.config
    assert config.name == DEFAULT_MODEL
    assert config.max_model_len == 8192  # llama.context_length
    assert config.eos_token_ids == (2,)  # <|im_end|>
    assert config.bos_token_id == 1
    assert config.tie_word_embeddings and loaded_default.weights["lm_head.weight"] is \
        loaded_default.weights["model.embed_tokens.weight"]
    hf = hf_model.config
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == hf.rms_norm_eps
    shape_fields = (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers,
                    config.num_heads, config.num_kv_heads, config.head_dim)
    assert shape_fields == (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                            hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    preset = PRESETS["smollm2-135m"]
    assert weight_shapes(config) == weight_shapes(preset)


def test_second_load_reads_the_cached_safetensors(model_cache_dir: Path, loaded_default: LoadedModel) -> None:
    path = loaded_default.path
    assert path is not None and path.parent == model_cache_dir / "models"
    assert (path / "model.safetensors").is_file() and (path / "pdserve.json").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = load_model(ModelSpec(DEFAULT_MODEL), dtype=torch.float16, cache_dir=model_cache_dir)
    elapsed = time.perf_counter() - start
    print(f"\nsecond load of {DEFAULT_MODEL} (fp16, CPU): {elapsed:.2f} s")
    assert again.path == path and (path / "model.safetensors").stat().st_mtime_ns == mtime  # not re-converted
    assert again.weights["model.norm.weight"].dtype == torch.float16
    assert again.tokenizer is not None and again.tokenizer.eos_token_ids == (2,)


def test_fingerprint_is_stable(model_cache_dir: Path, loaded_default: LoadedModel) -> None:
    again = load_model(DEFAULT_MODEL, dtype="float32", cache_dir=model_cache_dir)
    assert again.fingerprint == loaded_default.fingerprint and len(again.fingerprint) == 32


def test_converted_dir_loads_as_a_hf_directory(model_cache_dir: Path, loaded_default: LoadedModel) -> None:
    assert loaded_default.path is not None
    from_dir = load_model(ModelSpec(str(loaded_default.path), load_format="hf"), cache_dir=model_cache_dir)
    assert from_dir.fingerprint == loaded_default.fingerprint
    assert torch.equal(from_dir.weights["model.layers.3.self_attn.k_proj.weight"],
                       loaded_default.weights["model.layers.3.self_attn.k_proj.weight"])


def test_bf16_load_casts_and_has_its_own_fingerprint(model_cache_dir: Path, loaded_default: LoadedModel) -> None:
    """KV computed from bf16 weights must not be reused by an fp32 worker: the dtype is in the fingerprint."""
    loaded = load_model(DEFAULT_MODEL, dtype="bf16", cache_dir=model_cache_dir)
    assert {t.dtype for t in loaded.weights.values()} == {torch.bfloat16}
    assert loaded.fingerprint != loaded_default.fingerprint


def test_tokenizer_alone_for_the_router(model_cache_dir: Path, loaded_default: LoadedModel) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL, cache_dir=model_cache_dir)
    assert tokenizer is not None and loaded_default.tokenizer is not None
    assert tokenizer.eos_token_ids == loaded_default.tokenizer.eos_token_ids == (2,)
    assert tokenizer.encode("hi there") == loaded_default.tokenizer.encode("hi there")
    assert load_tokenizer(ModelSpec("llama3-8b", load_format="dummy")) is None
