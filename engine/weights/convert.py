"""One-time conversion of a GGUF file into a cached Hugging Face model directory.

Reading SmolLM2's Q4_1 GGUF (gguf_file.read_gguf) and dequantising it takes ~1.5 CPU-s, writing it 0.4, and
building its tokenizer through transformers 4-6 s (which parses the file again with gguf.GGUFReader, ~2.7 of
them; 2-core host, 2026-12-07); the converted directory (fp32 model.safetensors, config.json,
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, pdserve.json) then loads
like any HF directory in ~1 s.
fp32 because dequantised Q4_1 values (d * q + m) are not all representable in fp16; the loader casts.

Concurrent workers converting the same file: a lock file serialises them, and the directory is built under
a temporary name and renamed into place, so a directory that exists is complete.

Progress: a bar over the tensors (then one step for the tokenizer) on stderr, and a log line when done; a
process waiting on another's conversion says so.

What reads (dequantises) and writes the tensors imports torch and the gguf package (~0.5 s) when a conversion
runs, not with this module: a process that only finds the converted directory (the router, the launcher, every
worker after the first start) imports neither.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from pdserve.engine.weights.hf_config import write_hf_config

CONVERSION_INFO = "pdserve.json"
_FORMAT_VERSION = 1
logger = logging.getLogger(__name__)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_converted(gguf_path: Path, out_dir: Path, name: str, progress: bool = True) -> Path:
    """Return out_dir, converting gguf_path into it first unless an earlier run did."""
    if (out_dir / CONVERSION_INFO).is_file():
        return out_dir
    lock = out_dir.with_name(out_dir.name + ".lock")
    if lock.exists():  # maybe held: a worker started beside another waits here silently otherwise
        logger.info("waiting for the conversion of %s into %s (another process may be converting it)",
                    gguf_path.name, out_dir)
    with file_lock(lock):
        if (out_dir / CONVERSION_INFO).is_file():  # another process finished while we waited
            return out_dir
        tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            seconds = convert_gguf(gguf_path, tmp, name, progress)
            if out_dir.exists():  # left over without pdserve.json: an interrupted older layout
                shutil.rmtree(out_dir)
            tmp.rename(out_dir)
            logger.info("converted %s into %s in %.1f s", gguf_path.name, out_dir, seconds)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def convert_gguf(gguf_path: Path, out_dir: Path, name: str, progress: bool = True) -> float:
    """Write the HF layout of `gguf_path` into `out_dir`; returns the seconds it took."""
    from safetensors.torch import save_file

    from pdserve.engine.weights.gguf_model import field, gguf_config, gguf_tensors, has_tokenizer, open_gguf

    start = time.perf_counter()
    reader = open_gguf(gguf_path)
    config = gguf_config(reader, name)
    tokenizer = has_tokenizer(reader)
    with tqdm(total=len(reader.tensors) + int(tokenizer), unit="step", disable=not progress,
              desc=f"converting {gguf_path.name} (once)") as bar:
        weights = {}
        for hf_name, tensor in gguf_tensors(reader, config):
            weights[hf_name] = tensor
            bar.update()
        save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        del weights
        write_hf_config(config, out_dir, str(field(reader, "general.architecture")))
        if tokenizer:
            bar.set_postfix_str("tokenizer")
            convert_gguf_tokenizer(gguf_path, out_dir)
        bar.n = bar.total  # tensors that are no weights (tied head, rope tables) were skipped
        bar.refresh()
    seconds = round(time.perf_counter() - start, 1)
    info = {"name": name, "source": str(gguf_path), "format_version": _FORMAT_VERSION, "convert_seconds": seconds}
    (out_dir / CONVERSION_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return seconds


def convert_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """transformers' GGUF tokenizer converter (vocab, merges, pre-tokenizer, special tokens, chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
