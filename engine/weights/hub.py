"""Hugging Face repo ids (`HuggingFaceTB/SmolLM2-135M-Instruct`): found in the local hub cache, else downloaded.

The cache is huggingface_hub's own layout, so a repo fetched with `hf download` (or by vLLM, transformers) is
used as it is:

    <hub cache>/models--HuggingFaceTB--SmolLM2-135M-Instruct/
        refs/main                      the commit the branch `main` (or any --revision name) points at
        snapshots/<commit>/config.json, model.safetensors, tokenizer.json, ...   (links into blobs/)
        blobs/<sha256>

<hub cache> is `HubOptions.cache_dir` (`--download-dir`) or huggingface_hub's default, which that library
reads from HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub. The local lookup never touches the
network; a miss downloads (with huggingface_hub's progress bars) unless downloads are off
(`allow_download=False`, or HF_HUB_OFFLINE=1 for huggingface_hub), and a miss that cannot be downloaded raises
`ModelNotFoundError` naming the repo, the revision, the directory looked in and why the download failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# org/name as the hub spells them: letters, digits, '-', '_', '.'; neither part starts with '.' or '-'
_REPO_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# what a pdserve worker or router reads from a repo: weights, configs, tokenizer, chat templates
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


class ModelNotFoundError(FileNotFoundError):
    """A repo id that is neither in the local cache nor downloadable; the message says where it looked."""


@dataclass(frozen=True)
class HubOptions:
    """Where repo ids are looked up and whether a miss may be downloaded."""

    revision: str | None = None  # branch, tag or commit; None: main
    cache_dir: str | None = None  # None: huggingface_hub's default (HF_HUB_CACHE / HF_HOME/hub)
    allow_download: bool = True

    @property
    def revision_name(self) -> str:
        return self.revision or "main"


def looks_like_repo_id(text: str) -> bool:
    """`org/name` with no path syntax (a leading '.', '/', '~', or a .gguf suffix means a path)."""
    return bool(_REPO_ID.fullmatch(text)) and not text.endswith(".gguf")


def hub_cache_dir(options: HubOptions) -> Path:
    if options.cache_dir is not None:
        return Path(options.cache_dir).expanduser()
    from huggingface_hub import constants  # here only: it reads HF_HOME / HF_HUB_CACHE when imported

    return Path(constants.HF_HUB_CACHE)


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    return cache_dir / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(repo_id: str, options: HubOptions) -> Path | None:
    """The snapshot directory of `repo_id` at the revision, if the cache holds one with a config.json."""
    folder = repo_folder(hub_cache_dir(options), repo_id)
    revision = options.revision_name
    ref = folder / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.fullmatch(revision):
        commit = revision
    else:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def snapshot_dir(repo_id: str, options: HubOptions, progress: bool = True) -> Path:
    """A local directory holding `repo_id` at the revision: from the cache, else downloaded into it."""
    found = cached_snapshot(repo_id, options)
    if found is not None:
        return found
    cache = hub_cache_dir(options)
    where = (f"{repo_id!r} (revision {options.revision_name}) is not in the Hugging Face cache {cache} "
             f"(looked for {repo_folder(cache, repo_id).name}/snapshots/ with a config.json)")
    if not options.allow_download:
        raise ModelNotFoundError(f"{where}, and downloads are off. {_ADVICE}")
    return _download(repo_id, options, cache, where, progress)


_ADVICE = ("Fetch it where the hub is reachable (`pdserve model fetch REPO_ID`, or `hf download REPO_ID`) and "
           "copy the cache over, point HF_HOME or --download-dir at a cache that holds it, or give a local "
           "model directory or .gguf file instead")


def _download(repo_id: str, options: HubOptions, cache: Path, where: str, progress: bool) -> Path:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils.tqdm import disable_progress_bars, enable_progress_bars

    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{where}, and HF_HUB_OFFLINE is set. {_ADVICE}")
    if not progress:
        disable_progress_bars()
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=options.revision, cache_dir=str(cache),
                                                 allow_patterns=ALLOW_PATTERNS)
    except Exception as exc:  # network, auth, a missing repo: all end the same way, with the cause
        raise ModelNotFoundError(f"{where}, and downloading it from {constants.ENDPOINT} failed: "
                                 f"{type(exc).__name__}: {_first_line(exc)}. {_ADVICE}") from exc
    finally:
        if not progress:
            enable_progress_bars()
    return Path(str(path))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
