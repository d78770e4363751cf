"""Sampling: per-request parameters, validated on construction, and a batched sampler.

One sampler pass over a batch of logits rows, in vLLM's order:

    raw logits ─▶ repetition, frequency, presence penalties ─▶ greedy rows: argmax
                                                          └─▶ / temperature ─▶ min-p ─▶ top-k ─▶ top-p ─▶ draw

Every stage is one vectorised op over the whole batch (a row whose parameter is neutral is left unchanged),
and a stage runs only when some row needs it. The draw is the exponential race `argmax(p / E)`, E ~ Exp(1):
for a seeded request E comes from a generator seeded with hash(seed, number of tokens already generated), so
a seeded request draws the same token whether it runs alone, batched, or with its first token sampled on a
prefill worker and the rest on a decode worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class SamplingRequest:
    """What the sampler needs about one row: its parameters and the tokens it has seen so far."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


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


class Sampler:
    """Picks one token per logits row. Stateless between calls apart from a reusable generator."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        """logits: [B, V] (any float dtype), one row per request -> one token per row."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"got {logits.shape[0]} logits rows for {len(requests)} sampling requests")
        raw = logits.float()
        penalised = apply_penalties(raw, requests)
        tokens = penalised.argmax(dim=-1)
        if not all(r.params.greedy for r in requests):
            sampled = self._sample(penalised, requests)
            greedy = torch.tensor([r.params.greedy for r in requests], device=raw.device)
            tokens = torch.where(greedy, tokens, sampled)
        token_ids = tokens.tolist()  # the step's one device -> host sync (without logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=compute_logprobs(raw, tokens, requests, token_ids))

    def _sample(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        params = [r.params for r in requests]
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=logits.device))
        if any(p.top_k != -1 or p.top_p < 1 for p in params):
            vocab = logits.shape[1]
            top_k = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params],
                                 device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        return probs.div_(self._exponentials(probs, requests)).argmax(dim=-1)

    def _exponentials(self, probs: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        """E ~ Exp(1) per vocab entry; seeded rows from their own (seed, step) stream."""
        noise = torch.empty_like(probs).exponential_()
        for row, request in enumerate(requests):
            if request.params.seed is not None and not request.params.greedy:
                self._generator.manual_seed(step_seed(request.params.seed, len(request.output_token_ids)))
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
    counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    out_rows, out_tokens, prompt_rows, prompt_tokens = [], [], [], []
    for i in rows:
        out_rows += [i] * len(requests[i].output_token_ids)
        out_tokens += requests[i].output_token_ids
        prompt_rows += [i] * len(requests[i].prompt_token_ids)
        prompt_tokens += requests[i].prompt_token_ids
    out_index = (torch.tensor(out_rows, dtype=torch.long, device=device),
                 torch.tensor(out_tokens, dtype=torch.long, device=device))
    counts.index_put_(out_index, torch.ones(len(out_rows), device=device), accumulate=True)
    seen[torch.tensor(prompt_rows, dtype=torch.long, device=device),
         torch.tensor(prompt_tokens, dtype=torch.long, device=device)] = True
    seen |= counts > 0
    params = [r.params for r in requests]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
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


def compute_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, requests: list[SamplingRequest], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Logprobs from the raw model distribution (before penalties and temperature), for the rows that ask.
    `token_ids` is `tokens` on the host already: two more syncs for the whole batch, none per row."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(requests)
    if not rows:
        return out
    index = torch.tensor(rows, device=raw.device)
    logprobs = raw[index].log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[index][:, None])
    k = max(requests[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values = torch.cat([chosen, top_values], dim=1).tolist()  # one copy for the chosen and the top values
    top_ids = top_ids.tolist()
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs or 0
        top = list(zip(top_ids[j][:n], values[j][1:n + 1], strict=True))
        out[i] = TokenLogprobs(token_id=token_ids[i], logprob=values[j][0], top=top)
    return out
