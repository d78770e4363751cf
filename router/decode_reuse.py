"""What the router knows of the decode workers' prefix caches, and the choice it makes with it: conditional
disaggregation (a request whose uncached suffix on some decode worker is short is prefilled by that worker).

A decode worker names every finished sequence's blocks (prompt + output, decode_node/prefix.py), so the next
turn of a conversation finds its whole history there. The router's view of it, per worker (router/prefix_index.py):

    reported   the worker's own block-hash events, through its heartbeats (at most one interval old)
    finished   the blocks of every sequence this router saw end there with stop or length (`finished`): the
               next turn is usually sent within milliseconds of the last one's answer, before any heartbeat

    local_choice(candidates, sub, prompt) ─▶ the decode-only worker holding the longest cached prefix of the
        prompt, when that is at least one block and leaves fewer than `threshold` tokens to compute, and that
        worker runs at most `max_imbalance` sequences more than the least loaded one (else a prefix every
        request shares, a chat template's system prompt, would send them all to one worker); else None
        (then P prefills, as always). The relay asks it with RESERVE.max_local_prefill = threshold: D itself
        checks against what it holds, and prefills locally only if the suffix is still short; else it reserves
        as usual and the relay hands the prefill to a P (a fallback, counted).

    busy_choice(prefill_candidates, prefill_registered, decode_candidates, sub, prompt) ─▶ for a fresh prompt
        shorter than `busy_tokens`, when the prefill pool is short of a worker (fewer `prefill_candidates`,
        reachable and not failed for this request, than the `prefill_registered` count) and none of those left
        can take it soon: each has `busy_backlog` prompt tokens or more in prefill (the router's own count,
        router/channel.py: current to the request, not a heartbeat old), or there is none: the least loaded
        decode-only worker; else None. This keeps short requests answered within a D step or two while a P is
        lost and the survivors work through its long prompts (docs/reliability.md). A whole pool that is merely
        busy (a burst) keeps its prompts: prefilling them on D would turn the deployment colocated exactly when
        the decode batch is largest.

Otherwise a fresh prompt (nothing cached on any decode worker) goes through a prefill worker, however short:
this keeps prefills off the decode batch unless they are the small remainder of a reused history or P cannot
take them soon. Prompts asking for prompt logprobs never go local (only P computes them), nor do colocated
workers (their prefill side shares the pool already).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.cache_store.hashing import block_hashes
from pdserve.router.plan import SubRequest
from pdserve.router.policies import LeastKV, Prompt, decode_load, matched_blocks
from pdserve.router.registry import Worker

FINISH_REASONS_COMMITTED = ("stop", "length")  # a decode worker commits these sequences' blocks, not the others


class DecodeReuse:
    def __init__(self, block_size: int, threshold: int, max_imbalance: int = 4, busy_tokens: int = 0,
                 busy_backlog: int = 2048) -> None:
        if threshold < 0 or busy_tokens < 0 or busy_backlog < 1:
            raise ValueError(f"local_prefill_threshold ({threshold}) and busy_local_prefill_tokens ({busy_tokens}) "
                             f"must be >= 0, busy_prefill_backlog ({busy_backlog}) >= 1")
        self.block_size = block_size
        self.threshold = threshold  # 0: never prefill on a decode worker
        self.max_imbalance = max_imbalance  # --cache-aware-max-imbalance, as the cache-aware policies take it
        self.busy_tokens = busy_tokens  # --busy-local-prefill-tokens; 0: never for a fresh prompt
        self.busy_backlog = busy_backlog  # --busy-prefill-backlog

    def busy_choice(self, prefill_candidates: list[Worker], prefill_registered: int, decode_candidates: list[Worker],
                    sub: SubRequest, prompt: Prompt) -> Worker | None:
        """The decode worker that should prefill this fresh prompt because the prefill pool lost a worker and no
        P left can take it soon, or None."""
        if len(prompt.token_ids) >= self.busy_tokens or sub.needs_prefill_answer:
            return None
        if prefill_candidates and len(prefill_candidates) >= prefill_registered:
            return None  # the whole pool is up: its queue is the deployment's to keep
        if any(w.inflight_prompt_tokens < self.busy_backlog for w in prefill_candidates):
            return None
        decode_only = [w for w in decode_candidates if "prefill" not in w.roles]
        ordered = LeastKV().order(decode_only, len(prompt.token_ids))
        return ordered[0] if ordered else None

    def local_choice(self, candidates: list[Worker], sub: SubRequest, prompt: Prompt) -> Worker | None:
        """The decode worker that should prefill this request itself, or None (see the module docstring)."""
        if self.threshold <= 0 or sub.needs_prefill_answer:
            return None
        decode_only = [w for w in candidates if "prefill" not in w.roles]
        best, best_blocks = None, 0
        for worker in LeastKV().order(decode_only, len(prompt.token_ids)):  # least busy first among equals
            blocks = matched_blocks(worker, prompt, self.block_size)
            if blocks > best_blocks:
                best, best_blocks = worker, blocks
        if best is None or len(prompt.token_ids) - best_blocks * self.block_size >= self.threshold:
            return None
        if decode_load(best) > min(decode_load(w) for w in decode_only) + self.max_imbalance:
            return None  # through a P to the decode policy's choice
        return best

    def finished(self, worker: Worker, sub: SubRequest, output_token_ids: Sequence[int], finish_reason: str) -> None:
        """A sequence ended on `worker`: note the full blocks it commits there (all its tokens but the last,
        which has no KV), so a follow-up finds them before the worker's next heartbeat reports them."""
        if finish_reason not in FINISH_REASONS_COMMITTED or worker.fingerprint is None:
            return
        tokens = [*sub.prompt_token_ids, *output_token_ids][:-1]
        worker.prefixes.note_routed(block_hashes(tokens, self.block_size, worker.fingerprint, sub.cache_salt))
