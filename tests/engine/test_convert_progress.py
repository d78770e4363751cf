"""A GGUF's one-time conversion shows its progress (a bar on stderr, a log line with its time) instead of ~15 s
of silence."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pdserve.engine.weights.convert import CONVERSION_INFO, ensure_converted


def test_conversion_shows_progress(default_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.engine.weights.convert")
    out = ensure_converted(default_model_path, tmp_path / "converted", "smollm2-test")
    err = capsys.readouterr().err
    assert f"converting {default_model_path.name} (once)" in err and "100%" in err, err
    seconds = json.loads((out / CONVERSION_INFO).read_text())["convert_seconds"]
    assert any(r.getMessage() == f"converted {default_model_path.name} into {out} in {seconds:.1f} s"
               for r in caplog.records), [r.getMessage() for r in caplog.records]
