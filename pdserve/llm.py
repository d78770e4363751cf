"""The offline API: load a model once, generate for a list of prompts with continuous batching.

    llm = LLM()                                          # the embedded SmolLM2-135M-Instruct, fp32 on CPU
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    outs[0].text, outs[0].finish_reason

A call runs the pieces of a colocated worker on this thread (pdserve/offline_worker.py): the decode scheduler
reserves blocks for each prompt (its cached prefix from the prefix cache), the prefill batcher computes the rest
into them (the `local` KV transfer: nothing is copied) and samples the first token, then the scheduler decodes
under continuous batching with the finish checks of engine/output.py. So a prompt's output here is the one
`pdserve serve` gives, by the same policy. Blocks come from cache_store's pool; full prompt blocks go to its
prefix cache, so a later prompt (in this call or the next) with the same prefix skips computing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.decode_node.request import DecodeRequest
from pdserve.engine.config import CacheConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.grammar import GrammarBackend, Matcher
from pdserve.engine.kv_scale_calibration import calibrated_kv_scales
from pdserve.engine.model import fuse_weights
from pdserve.engine.output import OutputProcessor, logprobs_from_wire
from pdserve.engine.prompt_logprobs import PromptLogprobs
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import DEFAULT_MODEL, ModelSpec, load_model, parse_dtype
from pdserve.engine.weights.hub import HubOptions
from pdserve.engine.weights.kv_scales import load_kv_cache_spec
from pdserve.offline_worker import OfflineLimits, OfflineStats, OfflineWorker
from pdserve.protocol.messages import TokenDelta
from pdserve.settings import canonical_kv_cache_dtype


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) | "length" (max_tokens or max_model_len)
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens read from the prefix cache instead of computed
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # [None, {token_id, logprob, rank, top}, ...] when asked for


@dataclass
class _Collected:
    """One prompt's output, gathered from its deltas as the steps produce them."""

    request: DecodeRequest
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    def add(self, delta: TokenDelta) -> None:
        if delta.finish_reason in ("abort", "error"):
            raise RuntimeError(f"prompt {delta.request_id} ended with {delta.finish_reason}: {delta.error}")
        self.text += delta.text
        if delta.logprobs is None:  # not asked for
            self.logprobs += [None] * len(delta.token_ids)
        else:
            self.logprobs += [logprobs_from_wire(entry) for entry in delta.logprobs]
        self.finish_reason = delta.finish_reason or self.finish_reason


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: torch.dtype | str | None = None,
        device: str = "cpu",
        load_format: str = "auto",
        num_blocks: int = 1024,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 1024,
        chunk_size: int | None = None,
        enable_prefix_caching: bool = True,
        cache_dir: str | Path | None = None,
        progress: bool = True,
        enforce_eager: bool = False,
        hub: HubOptions | None = None,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        calculate_kv_scales: bool = False,
    ) -> None:
        """`max_num_seqs` prompts are live at once (reserved, prefilling or decoding); one prefill forward packs
        at most min(`max_num_batched_tokens`, `chunk_size`) prompt tokens (longer prompts take several).
        `kv_cache_dtype`: auto (the weights' dtype) or fp8 (float8_e4m3fn, engine/kv_cache_spec.py; fp8_e4m3 too);
        `quantization`: fp8 linears, none, or None (as the checkpoint is); `calculate_kv_scales`: an fp8 cache's
        scales computed once from the built-in text (engine/kv_scale_calibration.py), as every worker does."""
        kv_cache_dtype = canonical_kv_cache_dtype(kv_cache_dtype)
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(f"need max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) > 0")
        spec = ModelSpec(model, load_format, hub=hub or HubOptions(), quantization=quantization)
        loaded = load_model(spec, dtype=dtype, device=device, cache_dir=cache_dir,
                            progress=progress)
        if loaded.tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer; the offline LLM needs one")
        self.config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        torch_dtype = parse_dtype(dtype, device)
        if calculate_kv_scales and kv_cache_dtype != "fp8":
            raise ValueError(f"--calculate-kv-scales needs --kv-cache-dtype fp8, not {kv_cache_dtype!r}")
        weights = fuse_weights(loaded.config, loaded.weights, torch.device(device), torch_dtype, loaded.quantization)
        loaded.weights = {}
        calibrated = calibrated_kv_scales(loaded.config, weights, loaded.tokenizer) if calculate_kv_scales else None
        kv_spec = load_kv_cache_spec(kv_cache_dtype, torch_dtype, loaded, calibrated)
        self.fingerprint = kv_spec.fingerprint(loaded.fingerprint)  # prefix-cache keys: fp8 and bf16 never mix
        self.cache_config = CacheConfig(num_blocks=num_blocks, block_size=block_size)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.config.eos_token_ids)
        self.output = OutputProcessor(tuple(sorted(self.eos_token_ids)), self.config.max_model_len)
        self.runner = ModelRunner(self.config, self.cache_config, weights, device, torch_dtype,
                                  max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, kv_spec=kv_spec)
        self.sampler = Sampler(device)
        self.pool = BlockPool(num_blocks)
        # the batcher commits to it always; with prefix caching off no prompt is hashed, so nothing is named
        self.prefix_cache = PrefixCache(self.pool, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size or max_num_batched_tokens
        self.stats = OfflineStats()
        self._grammars: GrammarBackend | None = None  # built on the first constrained request

    def generate(
        self,
        prompts: list[str | list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        use_chat: bool = False,
    ) -> list[GenerationOutput]:
        """One output per prompt, in order. A str prompt is tokenized (as one user message with use_chat);
        a list of ints is used as given."""
        collected, worker = self._start(prompts, sampling, use_chat)
        for _ in self._steps(worker, collected):
            pass
        return [self._result(c, worker) for c in collected]

    def stream(self, prompt: str | list[int], sampling: SamplingParams | None = None,
               use_chat: bool = False) -> Iterator[str]:
        """The continuation of one prompt as text deltas, each yielded as soon as it is final (an incomplete
        character or a possible stop-string prefix is held back). Closing the iterator early frees the
        blocks."""
        collected, worker = self._start([prompt], sampling, use_chat)
        emitted = 0
        for _ in self._steps(worker, collected):
            text = collected[0].text
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)

    def _start(self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams] | None,
               use_chat: bool) -> tuple[list[_Collected], OfflineWorker]:
        params = self._per_prompt(sampling, len(prompts))
        token_lists = [self._tokenize(p, use_chat) for p in prompts]
        requests = [self._new_request(i, ids, p) for i, (ids, p) in enumerate(zip(token_lists, params))]
        limits = OfflineLimits(self.max_num_seqs, min(self.max_num_batched_tokens, self.chunk_size))
        worker = OfflineWorker(self.runner, self.sampler, self.pool, self.prefix_cache,
                               self.prefix_cache if self.enable_prefix_caching else None, self.output, limits)
        for request in requests:
            worker.submit(request)
        return [_Collected(r) for r in requests], worker

    def _steps(self, worker: OfflineWorker, collected: list[_Collected]) -> Iterator[None]:
        """Run steps until every prompt finished, pausing after each; blocks are released however it ends
        (an exception, or the caller closing the generator)."""
        try:
            while worker.has_work:
                for output in worker.step():
                    collected[int(output.request_id)].add(output.delta)
                yield
        finally:
            self.stats.add(worker)
            worker.close()

    def _matcher(self, params: SamplingParams) -> Matcher | None:
        if params.structured is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarBackend(self.tokenizer, self.config.vocab_size, sorted(self.eos_token_ids))
        return self._grammars.matcher(params.structured)

    @staticmethod
    def _per_prompt(sampling: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if isinstance(sampling, list):
            if len(sampling) != n:
                raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
            return sampling
        return [sampling or SamplingParams()] * n

    def _tokenize(self, prompt: str | list[int], use_chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if use_chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def _new_request(self, index: int, token_ids: list[int], params: SamplingParams) -> DecodeRequest:
        limit, n = self.config.max_model_len, len(token_ids)
        if n == 0:
            raise ValueError(f"prompt {index} is empty")
        if n >= limit:
            raise ValueError(f"prompt {index} has {n} tokens; the model's limit is {limit} tokens "
                             f"(prompt plus at least one generated token)")
        bs, room = self.cache_config.block_size, self.cache_config.num_blocks * self.cache_config.block_size
        longest = min(n + params.max_tokens, limit)
        if blocks_needed(longest, bs) > self.cache_config.num_blocks:
            raise ValueError(f"prompt {index}: {n} tokens + max_tokens {params.max_tokens} need "
                             f"{blocks_needed(longest, bs)} KV blocks; the pool holds {room} tokens "
                             f"({self.cache_config.num_blocks} blocks of {bs})")
        hashes = block_hashes(token_ids, bs, self.fingerprint) if self.enable_prefix_caching else []
        return DecodeRequest(str(index), token_ids, params, IncrementalDetokenizer(self.tokenizer, token_ids),
                             StopChecker(params.stop), block_hashes=hashes, grammar=self._matcher(params))

    def _result(self, collected: _Collected, worker: OfflineWorker) -> GenerationOutput:
        request, params = collected.request, collected.request.sampling
        assert collected.finish_reason is not None
        return GenerationOutput(
            token_ids=list(request.output_token_ids), text=collected.text, finish_reason=collected.finish_reason,
            num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=request.cached_tokens,
            logprobs=collected.logprobs if params.logprobs is not None else None,
            prompt_logprobs=worker.prompt_logprobs.get(request.request_id) if params.prompt_logprobs is not None
            else None,
        )
