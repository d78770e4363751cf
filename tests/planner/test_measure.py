"""Profiles a real ModelRunner (a 2-layer model of random weights, so it runs in a second on CPU)."""

from __future__ import annotations

import json

import torch

from pdserve.cli import main
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.runner import ModelRunner
from pdserve.engine.weights.dummy import dummy_weights
from pdserve.engine.weights.hf_config import write_hf_config
from pdserve.planner.measure import ProfileGrid, profile_runner

TINY = ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_model_len=1024)


def test_profile_a_real_runner() -> None:
    grid = ProfileGrid(prefill_lens=(8, 32, 128), prefill_batches=(1, 2), decode_batches=(1, 2, 4),
                       decode_ctxs=(16, 64), repeats=1)
    runner = ModelRunner(TINY, CacheConfig(grid.blocks_needed(16)), dummy_weights(TINY, torch.float32, "cpu"),
                         "cpu", torch.float32, max_num_seqs=4)
    prof = profile_runner(runner, grid, "tiny")
    assert [s.lens for s in prof.prefill_samples][:2] == [(8,), (8, 8)]
    assert len(prof.decode_samples) == 6 + 2 and prof.decode_samples[5].sum_ctx == 4 * 64
    mixed = prof.decode_samples[-1]  # one sequence of the longest context, the others of the shortest
    assert (mixed.batch, mixed.sum_ctx, mixed.max_ctx) == (4, 64 + 3 * 16, 64)
    assert all(s.seconds > 0 for s in prof.prefill_samples + prof.decode_samples)
    assert prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 and prof.block_size == 16
    assert all(c >= 0 for c in prof.prefill.coef + prof.decode.coef)
    assert prof.prefill.r2 <= 1.0 and prof.decode.r2 <= 1.0  # timings on a shared 2-core machine are noisy


def test_profile_command_writes_json(tmp_path) -> None:
    write_hf_config(TINY, tmp_path, "llama")
    out = tmp_path / "prof.json"
    rc = main(["profile", "--hf-config", str(tmp_path), "--device", "cpu", "--prefill-lens", "8,32", "--prefill-batches", "1,2",
               "--decode-batches", "1,2", "--decode-ctxs", "16,32", "--repeats", "1", "--output", str(out)])
    assert rc == 0
    raw = json.loads(out.read_text())
    assert raw["model"] == tmp_path.name and set(raw["prefill_fit"]) >= {"sum_tokens", "sum_attn", "const", "r2"}
    assert set(raw["decode_fit"]) >= {"sum_ctx", "pad_ctx", "batch", "const", "r2"}
    assert len(raw["decode_samples"]) == 4 + 1  # 2 batches × 2 contexts, and one mixed batch (32 + 16)


def test_profile_shows_progress_and_warns_on_a_poor_fit(tmp_path, capsys) -> None:
    from dataclasses import replace

    from pdserve.planner.profile import Profile, fit_warnings

    write_hf_config(TINY, tmp_path, "llama")
    out = tmp_path / "prof.json"
    assert main(["profile", "--hf-config", str(tmp_path), "--device", "cpu", "--prefill-lens", "8,32",
                 "--prefill-batches", "1,2", "--decode-batches", "1,2", "--decode-ctxs", "16,32", "--repeats", "1",
                 "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "prefill shapes: 100%" in err and "decode shapes: 100%" in err, err
    profile = Profile.load(out)
    poor = replace(profile, decode=replace(profile.decode, r2=0.38), prefill=replace(profile.prefill, r2=0.99))
    [warning] = fit_warnings(poor)
    assert warning.startswith(f"warning: the decode fit explains only R² = 0.38 of the {len(profile.decode_samples)} measured decode times")
    assert "Profile again on a quiet machine" in warning and "--repeats" in warning
