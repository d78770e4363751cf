"""Sampling: per-request parameters, validated on construction, and a batched sampler.

One sampler pass over a batch of logits rows, in vLLM's order:

    raw logits ─▶ repetition, frequency, presence penalties ─▶ grammar mask ─▶ greedy rows: argmax
                                                          └─▶ / temperature ─▶ min-p ─▶ top-k ─▶ top-p ─▶ draw

Every stage is one vectorised op over the whole batch (a row whose parameter is neutral is left unchanged),
and a stage runs only when some row needs it. The draw is the exponential race `argmax(p / E)`, E ~ Exp(1):
for a seeded request E comes from a generator seeded with hash(seed, number of tokens already generated), so
a seeded request draws the same token whether it runs alone, batched, or with its first token sampled on a
prefill worker and the rest on a decode worker.

Two halves, so a decode loop can overlap the host with the device (decode_node/engine.py):

    pending = sampler.sample(logits, requests)   all on the device; ids (and logprobs) copied to pinned host
                                                 memory without blocking; returns at once
    ... the host prepares and launches the next step, which may read pending.tokens on the device ...
    out = pending.result()                       waits for that copy only; SamplerOutput (host lists)

`sampler(logits, requests)` is both at once. A request with a grammar matcher (structured outputs,
engine/grammar.py) has its row masked on the device from the matcher's state when `sample` is called: a loop that
overlaps steps calls it once the previous step's tokens were accepted (decode_node/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling_params import SamplingParams  # tests and benchmarks import it from here too
from pdserve.kernels.host_copy import to_device

if TYPE_CHECKING:  # xgrammar is imported only once a constrained request is sampled
    from pdserve.engine.grammar import Matcher, TokenBitmasks


@dataclass(frozen=True)
class SamplingRequest:
    """What the sampler needs about one row: its parameters and the tokens it has seen so far.
    `num_pending`: tokens already sampled for it on the device but not yet in `output_token_ids` (an
    overlapped decode loop); seeded draws count them, so a token's draw depends only on its index."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_pending: int = 0
    grammar: Matcher | None = None  # structured outputs: masks this row by the matcher's state at sample()


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob (raw model distribution) and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for a request's step-th sampled token (63 bits, what manual_seed takes)."""
    return _splitmix64(_splitmix64(seed & 0xFFFFFFFFFFFFFFFF) ^ step) >> 1


class PendingSample:
    """A batch's draw on the device, its host copy on the way (pinned memory on CUDA: no blocking copy)."""

    def __init__(self, tokens: torch.Tensor, requests: list[SamplingRequest], logprobs: _DeviceLogprobs | None) -> None:
        self.tokens = tokens  # [B] int64 on the device: the next step may feed these straight back in
        self.requests = requests
        pinned = tokens.device.type == "cuda"
        self._host_tokens = _to_host(tokens, pinned)
        self._logprobs = logprobs.to_host(pinned) if logprobs is not None else None
        self._event: torch.cuda.Event | None = None
        if pinned:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()  # this batch's copies only; later work on the stream keeps running
        token_ids = self._host_tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(self.requests)
        if self._logprobs is not None:
            logprobs = self._logprobs.entries(token_ids, self.requests)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


class Sampler:
    """Picks one token per logits row. Stateless between calls apart from a reusable generator."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._generator = torch.Generator(device=device)
        self._bitmasks: TokenBitmasks | None = None

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        """logits: [B, V] (any float dtype), one row per request -> one token per row."""
        return self.sample(logits, requests).result()

    def sample(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> PendingSample:
        """Launch the draw; nothing here waits for the device."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"got {logits.shape[0]} logits rows for {len(requests)} sampling requests")
        raw = logits.float()
        penalised = self._mask(apply_penalties(raw, requests), requests)
        tokens = penalised.argmax(dim=-1)
        if not all(r.params.greedy for r in requests):
            sampled = self._sample(penalised, requests)
            greedy = to_device([r.params.greedy for r in requests], torch.bool, raw.device)
            tokens = torch.where(greedy, tokens, sampled)
        return PendingSample(tokens, requests, device_logprobs(raw, tokens, requests))

    def _mask(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        """Constrained rows masked by their grammars (a masked copy: logprobs read the raw logits)."""
        if all(r.grammar is None for r in requests):
            return logits
        from pdserve.engine.grammar import TokenBitmasks, apply_token_bitmask

        if self._bitmasks is None or self._bitmasks.vocab_size != logits.shape[1]:
            self._bitmasks = TokenBitmasks(logits.shape[1], logits.device)
        bitmask = self._bitmasks.fill([r.grammar for r in requests])
        assert bitmask is not None
        return apply_token_bitmask(logits, bitmask)

    def _sample(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        params = [r.params for r in requests]
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, logits.device)
        logits = logits / temps[:, None]
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, to_device([p.min_p for p in params], torch.float32, logits.device))
        if any(p.top_k != -1 or p.top_p < 1 for p in params):
            vocab = logits.shape[1]
            top_k = to_device([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], torch.int64,
                              logits.device)
            top_p = to_device([p.top_p for p in params], torch.float32, logits.device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        return probs.div_(self._exponentials(probs, requests)).argmax(dim=-1)

    def _exponentials(self, probs: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        """E ~ Exp(1) per vocab entry; seeded rows from their own (seed, step) stream."""
        noise = torch.empty_like(probs).exponential_()
        for row, request in enumerate(requests):
            if request.params.seed is not None and not request.params.greedy:
                step = len(request.output_token_ids) + request.num_pending
                self._generator.manual_seed(step_seed(request.params.seed, step))
                noise[row].exponential_(generator=self._generator)
        # an exact 0 would turn p / E into inf (or nan for p == 0); 1e-20 is far below any real draw
        return noise.clamp_(min=1e-20)


def apply_penalties(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output tokens, frequency and presence over output tokens."""
    rows = [i for i, r in enumerate(requests)
            if r.params.repetition_penalty != 1 or r.params.presence_penalty or r.params.frequency_penalty]
    if not rows:
        return logits
    device = logits.device
    counts = torch.zeros(logits.shape, dtype=logits.dtype, device=device)  # contiguous: viewed flat below
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    # flat row * vocab + token indices, so index_add_/index_fill_ launch without a host sync (index_put_ with a
    # Python value copies it pageably: the host would wait for the previous step's forward)
    vocab = logits.shape[-1]
    out_flat, prompt_flat = [], []
    for i in rows:
        out_flat += [i * vocab + t for t in requests[i].output_token_ids]
        prompt_flat += [i * vocab + t for t in requests[i].prompt_token_ids]
    counts.view(-1).index_add_(0, to_device(out_flat, torch.long, device),
                               torch.ones(len(out_flat), device=device, dtype=counts.dtype))
    seen.view(-1).index_fill_(0, to_device(prompt_flat, torch.long, device), True)
    seen |= counts > 0
    params = [r.params for r in requests]
    rep = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
    freq = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
    pres = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p × the top token's. min_p: [B]."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens (ties with the k-th kept), then the smallest set whose mass reaches top_p.

    One ascending sort for the whole batch: row r keeps sorted positions >= V - top_k[r], and of those the
    ones whose cumulative mass from the bottom exceeds 1 - top_p[r] (the top token is always kept).
    """
    vocab = logits.shape[1]
    ordered, order = logits.sort(dim=-1)
    kth = ordered.gather(1, (vocab - top_k).long()[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)[:, None]
    drop[:, -1] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass(frozen=True)
class _DeviceLogprobs:
    """Logprobs of the rows that asked (raw model distribution, before penalties and temperature)."""

    rows: list[int]
    values: torch.Tensor  # [R, 1 + k]: the chosen token's logprob, then the top k
    top_ids: torch.Tensor  # [R, k]

    def to_host(self, pinned: bool) -> _DeviceLogprobs:
        return _DeviceLogprobs(self.rows, _to_host(self.values, pinned), _to_host(self.top_ids, pinned))

    def entries(self, token_ids: list[int], requests: list[SamplingRequest]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(requests)
        values, top_ids = self.values.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.rows):
            n = requests[i].params.logprobs or 0
            top = list(zip(top_ids[j][:n], values[j][1:n + 1], strict=True))
            out[i] = TokenLogprobs(token_id=token_ids[i], logprob=values[j][0], top=top)
        return out


def device_logprobs(raw: torch.Tensor, tokens: torch.Tensor, requests: list[SamplingRequest]) -> _DeviceLogprobs | None:
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return None
    index = to_device(rows, torch.long, raw.device)
    logprobs = raw[index].log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[index][:, None])
    k = max(requests[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return _DeviceLogprobs(rows, torch.cat([chosen, top_values], dim=1), top_ids)
