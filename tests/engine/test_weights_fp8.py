"""--quantization fp8 and FP8 checkpoints: a tiny random Qwen2 (q/k/v biases) written as an FP8 safetensors
checkpoint in each supported format, loaded as stored, and run; bf16/fp32 weights quantized at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_hf_models import TinyModel, hf_last_logits, make_tiny

from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.model import fuse_weights
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights import ModelSpec, load_model
from pdserve.kernels.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_weight_fp8

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = {  # name: (quantization_config, how a linear's scale is stored)
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor"),
    "compressed-tensors-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "type": "float", "num_bits": 8, "strategy": "channel"}}},
                                    "ignore": ["lm_head"]}, "channel"),
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": [32, 32]}, "block"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _quantize(w: torch.Tensor, strategy: str) -> dict[str, torch.Tensor]:
    if strategy == "channel":
        q = quantize_weight_fp8(w)
        return {"weight": q.weight, "weight_scale": q.scale[:, None]}
    if strategy == "tensor":
        scale = w.abs().max() / 448.0
        return {"weight": (w / scale).to(FP8_DTYPE), "weight_scale": scale.reshape(()), "input_scale":
                torch.tensor(0.02)}
    n, k = w.shape  # 80-row MLP weights: a partial last block
    rows, cols = -(-n // 32), -(-k // 32)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[32 * i:32 * i + 32, 32 * j:32 * j + 32].abs().max() / 448.0
    full = scale.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    return {"weight": (w / full).to(FP8_DTYPE), "weight_scale_inv": scale}


def write_fp8_checkpoint(tiny: TinyModel, source: Path, dest: Path, fmt: str) -> Path:
    """The tiny model's directory with its linears stored in fp8 as `fmt` does (model.safetensors, config)."""
    shutil.copytree(source, dest)
    config, strategy = FORMATS[fmt]
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tiny.weights.items():
        if _is_linear(name):
            for suffix, t in _quantize(tensor.float(), strategy).items():
                state[name.removesuffix("weight") + suffix] = t.contiguous()
        else:
            state[name] = tensor.contiguous()
    for file in dest.glob("*.safetensors"):
        file.unlink()
    save_file(state, str(dest / "model.safetensors"))
    raw = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    return dest


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.prefill([PrefillChunk(ids, 0, list(range(8)))]).logits[0]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_loads_as_stored(fmt: str, tiny: TinyModel, tmp_path: Path) -> None:
    path = write_fp8_checkpoint(tiny, _saved_dir(tiny, tmp_path), tmp_path / fmt, fmt)
    loaded = load_model(ModelSpec(str(path), "hf"), dtype=torch.float32, device="cpu")
    assert loaded.quantization == "fp8"
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    fused = fuse_weights(loaded.config, loaded.weights, "cpu", torch.float32, loaded.quantization)
    qkv = fused.layers[0].qkv
    assert isinstance(qkv, Fp8Weight) and qkv.shape == (64 + 2 * 32, 64)
    if fmt != "fp8-block":  # stored codes kept bit for bit; block-wise ones are re-quantized per channel
        stored = torch.cat([loaded.weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(qkv.weight.view(torch.uint8), stored.view(torch.uint8))
    assert fused.lm_head.dtype == torch.float32 and fused.embed.dtype == torch.float32
    runner = ModelRunner(loaded.config, CacheConfig(num_blocks=16, block_size=4), fused, "cpu", torch.float32)
    ids = list(range(3, 24))
    assert _cosine(_logits(runner, ids), hf_last_logits(tiny.hf, ids)) > 0.99
    none = load_model(ModelSpec(str(path), "hf", quantization="none"), dtype=torch.float32, device="cpu")
    assert none.quantization == "none" and none.fingerprint != loaded.fingerprint
    dequantized = fuse_weights(none.config, none.weights, "cpu", torch.float32, "none")
    assert dequantized.layers[0].qkv.dtype == torch.float32  # type: ignore[union-attr]


def _saved_dir(tiny: TinyModel, tmp_path: Path) -> Path:
    path = tmp_path / "saved"
    tiny.hf.save_pretrained(path)
    return path


def test_quantization_fp8_at_load_close_to_unquantized(tiny: TinyModel, tmp_path: Path) -> None:
    """An unquantized checkpoint with --quantization fp8: every layer linear fp8, the rest in the model dtype,
    logits of an 8-row and a 21-row prefill close to the fp32 run's."""
    path = _saved_dir(tiny, tmp_path)
    loaded = load_model(ModelSpec(str(path), "hf", quantization="fp8"), dtype=torch.float32, device="cpu")
    plain = load_model(ModelSpec(str(path), "hf"), dtype=torch.float32, device="cpu")
    assert loaded.quantization == "fp8" and plain.quantization == "none"
    assert loaded.fingerprint != plain.fingerprint  # KV of the two must not be shared
    cache = CacheConfig(num_blocks=16, block_size=4)
    fp8 = ModelRunner(loaded.config, cache, loaded.weights, "cpu", torch.float32, quantization="fp8")
    ref = ModelRunner(plain.config, cache, plain.weights, "cpu", torch.float32)
    layer = fp8.model.weights.layers[1]
    assert all(isinstance(w, Fp8Weight) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert layer.qkv_bias is not None and layer.qkv_bias.dtype == torch.float32
    for ids in (list(range(5, 13)), list(range(3, 24))):
        assert _cosine(_logits(fp8, ids), _logits(ref, ids)) > 0.99
    with pytest.raises(ValueError, match="int4"):
        fuse_weights(plain.config, plain.weights, "cpu", torch.float32, "int4")


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_fused_fp8_activations_give_the_unfused_logits(backend: str, tiny: TinyModel, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms and silu_and_mul quantizing for the fp8 linears (engine/model.py FUSE_FP8_ACTIVATIONS) give
    the logits of the linears quantizing themselves, bit for bit: prefill of 21 tokens, then a decode step.
    "triton": the launchers under the interpreter (CPU only, tests/conftest.py), fused kernels against
    rms_norm / silu_and_mul + quantize_rows_fp8_triton; "ref": the references' composition."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("the launchers run on CPU tensors only under the interpreter, set where no GPU is")
    from pdserve import kernels
    from pdserve.engine import model
    from pdserve.engine.attention_metadata import DecodeInput

    loaded = load_model(ModelSpec(str(_saved_dir(tiny, tmp_path)), "hf", quantization="fp8"), dtype=torch.float32,
                        device="cpu")
    fused_calls: list[str] = []
    for name in ("rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8"):
        op = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, op=op, name=name: fused_calls.append(name) or op(*a))
    ids = list(range(3, 24))

    def run(fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(model, "FUSE_FP8_ACTIVATIONS", fuse)
        runner = ModelRunner(loaded.config, CacheConfig(num_blocks=16, block_size=4), loaded.weights, "cpu",
                             torch.float32, quantization="fp8")
        kernels.set_backend(backend)
        try:
            prefill = _logits(runner, ids)
            decode = runner.decode([DecodeInput(int(prefill.argmax()), len(ids), list(range(8)))])[0]
        finally:
            kernels.set_backend("auto")
        return prefill, decode

    unfused = run(False)
    assert fused_calls == []
    fused = run(True)
    layers = loaded.config.num_layers
    assert sorted(set(fused_calls)) == ["fused_add_rms_norm_fp8", "rms_norm_fp8", "silu_and_mul_fp8"]
    assert len(fused_calls) == 2 * 3 * layers  # per layer: two norms and silu_and_mul, in prefill and decode
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
