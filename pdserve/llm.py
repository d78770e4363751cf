"""The offline API: load a model once, generate for a list of prompts with continuous batching.

    llm = LLM()                                          # the embedded SmolLM2-135M-Instruct, fp32 on CPU
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    outs[0].text, outs[0].finish_reason

Every step runs one decode forward over the sequences that are generating and one packed prefill forward over
prompt chunks (offline_scheduler.py decides which), then samples all rows that produced logits in one
sampler call. Blocks come from cache_store's pool; full prompt blocks go to its prefix cache, so a later
prompt (in this call or the next) with the same prefix skips computing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.grammar import GrammarBackend, Matcher
from pdserve.engine.prompt_logprobs import PromptLogprobs, chunk_entries
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingRequest, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import DEFAULT_MODEL, ModelSpec, load_model, parse_dtype
from pdserve.engine.weights.hub import HubOptions
from pdserve.engine.weights.kv_scales import load_kv_cache_spec
from pdserve.offline_scheduler import OfflineScheduler, OfflineSequence, SchedulerStats, StepPlan


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
class _Output:
    """Text and finish state of one sequence; the checks run in decode_node/output.py's order."""

    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs = field(default_factory=lambda: [None])
    grammar: Matcher | None = None  # structured outputs: the sequence's matcher

    def flush(self) -> None:
        tail = self.detokenizer.flush()
        released = self.stop_checker.push(tail) if tail else None
        if released is not None:
            self.text += released.text
            if released.stop is not None:
                return
        self.text += self.stop_checker.flush()


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
    ) -> None:
        """`kv_cache_dtype`: auto (the weights' dtype) or fp8 (float8_e4m3fn, engine/kv_cache_spec.py)."""
        if max_num_seqs <= 0 or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"need 0 < max_num_seqs ({max_num_seqs}) <= max_num_batched_tokens "
                             f"({max_num_batched_tokens}): every running sequence decodes one token per step")
        spec = ModelSpec(model, load_format, hub=hub or HubOptions(), quantization=quantization)
        loaded = load_model(spec, dtype=dtype, device=device, cache_dir=cache_dir,
                            progress=progress)
        if loaded.tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer; the offline LLM needs one")
        self.config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        torch_dtype = parse_dtype(dtype, device)
        kv_spec = load_kv_cache_spec(kv_cache_dtype, torch_dtype, loaded)
        self.fingerprint = kv_spec.fingerprint(loaded.fingerprint)  # prefix-cache keys: fp8 and bf16 never mix
        self.cache_config = CacheConfig(num_blocks=num_blocks, block_size=block_size)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.config.eos_token_ids)
        self.runner = ModelRunner(self.config, self.cache_config, loaded.weights, device,
                                  torch_dtype, max_num_seqs=max_num_seqs,
                                  enforce_eager=enforce_eager, kv_spec=kv_spec, quantization=loaded.quantization)
        self.sampler = Sampler(device)
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size or max_num_batched_tokens
        self.stats = SchedulerStats()
        self._grammars: GrammarBackend | None = None  # built on the first constrained request

    def generate(
        self,
        prompts: list[str | list[int]],
        sampling: SamplingParams | list[SamplingParams] | None = None,
        use_chat: bool = False,
    ) -> list[GenerationOutput]:
        """One output per prompt, in order. A str prompt is tokenized (as one user message with use_chat);
        a list of ints is used as given."""
        seqs, outputs, scheduler = self._start(prompts, sampling, use_chat)
        for _ in self._steps(scheduler, outputs):
            pass
        return [self._result(s, o) for s, o in zip(seqs, outputs, strict=True)]

    def stream(self, prompt: str | list[int], sampling: SamplingParams | None = None,
               use_chat: bool = False) -> Iterator[str]:
        """The continuation of one prompt as text deltas, each yielded as soon as it is final (an incomplete
        character or a possible stop-string prefix is held back). Closing the iterator early frees the
        blocks."""
        _, outputs, scheduler = self._start([prompt], sampling, use_chat)
        emitted = 0
        for _ in self._steps(scheduler, outputs):
            text = outputs[0].text
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)

    def _start(self, prompts: list[str | list[int]], sampling: SamplingParams | list[SamplingParams] | None,
               use_chat: bool) -> tuple[list[OfflineSequence], list[_Output], OfflineScheduler]:
        params = self._per_prompt(sampling, len(prompts))
        token_lists = [self._tokenize(p, use_chat) for p in prompts]
        seqs = [self._new_sequence(i, ids, p) for i, (ids, p) in enumerate(zip(token_lists, params))]
        scheduler = OfflineScheduler(self.pool, self.prefix_cache, self.cache_config.block_size, self.max_num_seqs,
                                     self.max_num_batched_tokens, self.chunk_size, self.stats)
        for seq in seqs:
            scheduler.add(seq)
        return seqs, [self._new_output(s) for s in seqs], scheduler

    def _steps(self, scheduler: OfflineScheduler, outputs: list[_Output]) -> Iterator[None]:
        """Run steps until every sequence finished, pausing after each; blocks are released however it ends
        (an exception, or the caller closing the generator)."""
        try:
            while scheduler.has_work:
                self._step(scheduler, outputs)
                yield
        finally:
            for seq in list(scheduler.running):
                scheduler.finish(seq)

    def _new_output(self, seq: OfflineSequence) -> _Output:
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        return _Output(detokenizer, StopChecker(seq.params.stop), grammar=self._matcher(seq.params))

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

    def _new_sequence(self, index: int, token_ids: list[int], params: SamplingParams) -> OfflineSequence:
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
        hashes = block_hashes(token_ids, bs, self.fingerprint) if self.prefix_cache is not None else []
        return OfflineSequence(index, token_ids, params, prompt_hashes=hashes)

    def _step(self, scheduler: OfflineScheduler, outputs: list[_Output]) -> None:
        plan = scheduler.schedule()
        if plan.empty:
            raise RuntimeError(f"no progress possible: {len(scheduler.waiting)} waiting, "
                               f"{self.pool.num_free} of {self.pool.num_total} blocks free")
        sampled, logits = self._forward(plan, outputs)
        scheduler.advance(plan)
        if not sampled:
            return
        requests = [SamplingRequest(s.params, s.prompt_token_ids, s.output_token_ids, 0, outputs[s.index].grammar)
                    for s in sampled]
        result = self.sampler(logits, requests)
        for seq, token, logprobs in zip(sampled, result.token_ids, result.logprobs, strict=True):
            if self._append(seq, token, logprobs, outputs[seq.index]):
                scheduler.finish(seq)

    def _forward(self, plan: StepPlan, outputs: list[_Output]) -> tuple[list[OfflineSequence], torch.Tensor]:
        """Run the plan's decode and prefill batches; the sequences that sample and their logits rows."""
        rows, sampled = [], []
        if plan.decodes:
            items = [DecodeInput(s.output_token_ids[-1], s.num_computed, s.block_ids) for s in plan.decodes]
            rows.append(self.runner.decode(items))
            sampled += plan.decodes
        if plan.prefills:
            wanted = [self._wants_prompt_logprobs(c.seq, c.start, outputs[c.seq.index]) for c in plan.prefills]
            chunks = [PrefillChunk(c.seq.all_token_ids[c.start:c.end], c.start, c.seq.block_ids, c.samples, all_rows)
                      for c, all_rows in zip(plan.prefills, wanted, strict=True)]
            out = self.runner.prefill(chunks)
            for i, all_logits in out.all_logits.items():
                c = plan.prefills[i]
                k = c.seq.params.prompt_logprobs or 0
                outputs[c.seq.index].prompt_logprobs += chunk_entries(all_logits, c.seq.prompt_token_ids, c.start, k)
            rows.append(out.logits)
            sampled += [plan.prefills[i].seq for i in out.chunk_indices]
        return sampled, torch.cat(rows) if len(rows) > 1 else rows[0]

    @staticmethod
    def _wants_prompt_logprobs(seq: OfflineSequence, start: int, out: _Output) -> bool:
        """The chunk continues the prompt logprobs collected so far (not a recompute after preemption)."""
        return (seq.params.prompt_logprobs is not None and start < len(seq.prompt_token_ids)
                and len(out.prompt_logprobs) == start + 1)

    def _append(self, seq: OfflineSequence, token: int, logprobs: TokenLogprobs | None, out: _Output) -> bool:
        """Record a sampled token; True when the sequence is finished."""
        seq.output_token_ids.append(token)
        out.logprobs.append(logprobs)
        params = seq.params
        grammar_ended = out.grammar is not None and (not out.grammar.accept_token(token)
                                                     or out.grammar.is_terminated())
        if (token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
                or grammar_ended):
            out.finish_reason = "stop"
            out.flush()
            return True
        delta = out.detokenizer.add_token(token)
        released = out.stop_checker.push(delta) if delta else None
        if released is not None:
            out.text += released.text
            if released.stop is not None:
                out.text += released.stop if params.include_stop_str_in_output else ""
                out.finish_reason = "stop"
                return True
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            out.finish_reason = "length"
            out.flush()
            return True
        return False

    def _result(self, seq: OfflineSequence, out: _Output) -> GenerationOutput:
        assert out.finish_reason is not None
        return GenerationOutput(
            token_ids=list(seq.output_token_ids), text=out.text, finish_reason=out.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids), num_cached_tokens=seq.num_cached_tokens,
            logprobs=out.logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=out.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
        )
