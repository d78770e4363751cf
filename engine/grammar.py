"""Structured outputs on a worker: xgrammar compiles a request's `StructuredOutput` once per worker (cached), each
request gets its own matcher, and the sampler masks the logits rows of constrained requests on the device.

    spec (SamplingParams.structured) ─▶ GrammarBackend.compile (cached per worker, off the event loop)
                                       └▶ GrammarBackend.matcher: one xgrammar GrammarMatcher per request
    every sampled token ─▶ OutputProcessor.append_token ─▶ matcher.accept_token (engine/output.py)
    every sampling pass  ─▶ TokenBitmasks.fill: one row per constrained request, on the host (all ones elsewhere)
                           ─▶ one non-blocking copy ─▶ apply_token_bitmask on the device (no per-row sync)

Across the P/D split the matcher never travels: P builds one from the spec and masks the first token; D builds
its own from the same spec (it arrives in RESERVE's sampling) and accepts P's first token from the KV "done"
frame, which leaves it in the state P's matcher reached. A D-side recompute (lost KV) masks the first token
itself with a fresh matcher. Logprobs stay those of the raw model distribution (before the mask), as vLLM's
default `raw_logprobs`, so P and D report the same numbers whichever samples.

JSON is generated compact (`any_whitespace=False`: separators ", " and ": "), since a small model given free
whitespace can spend its whole budget on it.

xgrammar is loaded on a worker's first constrained request, not at start (as vLLM's structured-output manager
does): the import (it pulls in transformers) and the vocabulary's TokenizerInfo cost ~1.4 s of CPU, which a
worker that never sees a constraint does not spend. Until then `GrammarBackend.ready` is False; the decode
node's reservation does not wait for that first load (decode_node/node.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from pdserve.engine.structured_output import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

Matcher: TypeAlias = "xgr.GrammarMatcher"  # xgrammar is not analysed (pyproject [tool.mypy])


class GrammarError(ValueError):
    """The spec does not compile (a bad schema, regex or grammar): the request gets a 400."""


class GrammarBackend:
    """One per worker: the tokenizer's vocabulary for xgrammar and a cache of compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int = 2, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: Any = None  # xgr.GrammarCompiler, built by the first compile (`load`)
        self._cache: dict[StructuredOutput, Any] = {}  # spec -> xgr.CompiledGrammar
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self.num_compiled = 0

    @property
    def ready(self) -> bool:
        """xgrammar and the vocabulary are loaded: a compile costs milliseconds, not the first load's ~1.4 s."""
        return self._compiler is not None

    def load(self) -> Any:
        """The grammar compiler over this tokenizer's vocabulary, built once (thread-safe; blocks while another
        thread builds it)."""
        with self._load_lock:
            if self._compiler is None:
                import xgrammar as xgr

                backend = self.tokenizer.backend
                encoded = [""] * self.vocab_size
                for token, index in backend.get_vocab(with_added_tokens=True).items():
                    if index < self.vocab_size:
                        encoded[index] = token
                metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
                info = xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=self.vocab_size,
                                         stop_token_ids=self.stop_token_ids or None,
                                         add_prefix_space=metadata["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=True)
            return self._compiler

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Thread-safe; a spec seen before costs a dict lookup (a JSON schema's first compile: ~8 ms on CPU)."""
        with self._lock:
            cached = self._cache.get(spec)
        if cached is not None:
            return cached
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for bad specs derive from these
            raise GrammarError(f"cannot compile the {spec.kind} constraint: {exc}") from exc
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
            self.num_compiled += 1
        return compiled

    def matcher(self, spec: StructuredOutput) -> Matcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self.load()
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.spec))
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(spec.spec)


class TokenBitmasks:
    """Host bitmask buffers [rows, ceil(V / 32)] int32 (pinned on CUDA), two used in turn: a step's mask is
    filled while the previous one's copy to the device may still be queued."""

    def __init__(self, vocab_size: int, device: torch.device, rows: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows = rows
        self._buffers = [self._allocate(rows), self._allocate(rows)]
        self._turn = 0

    def _allocate(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        return mask.pin_memory() if self.device.type == "cuda" else mask

    def fill(self, matchers: Sequence[Matcher | None]) -> torch.Tensor | None:
        """The mask of a batch on the device (a row of -1 is unconstrained), or None when no row is."""
        if all(m is None for m in matchers):
            return None
        n = len(matchers)
        if n > self._rows:
            self._rows = max(n, 2 * self._rows)
            self._buffers = [self._allocate(self._rows), self._allocate(self._rows)]
        host = self._buffers[self._turn][:n]
        self._turn ^= 1
        host.fill_(-1)
        for row, matcher in enumerate(matchers):
            if matcher is not None and not matcher.is_terminated():  # a finished one's row is wasted anyway
                matcher.fill_next_token_bitmask(host, row)
        return host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Masked copy of fp32 logits [B, V]: tokens whose bit is 0 get -inf (xgrammar's kernel on the device)."""
    import xgrammar as xgr

    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    return masked
