"""`pdserve model fetch | list` as a user runs them: a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300, check=False)


def test_model_list_names_default_and_presets() -> None:
    out = run_cli("model", "list")
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m-instruct  (default)" in out.stdout
    assert "llama3-8b" in out.stdout


def test_model_fetch_prints_converted_dir(default_model_dir: Path, model_cache_dir: Path) -> None:
    out = run_cli("model", "fetch", env={"PDSERVE_CACHE_DIR": str(model_cache_dir)})
    assert out.returncode == 0, out.stderr
    fetched = Path(out.stdout.strip().splitlines()[-1])
    assert fetched == default_model_dir
    assert (fetched / "model.safetensors").is_file() and (fetched / "config.json").is_file()
