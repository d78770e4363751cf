"""The simulated prefill and decode workers: the policies of prefill_node/batcher.py and decode_node/scheduler.py,
with step times from a fitted Profile.

Where the policy is the same code: the chunk a prompt gets in a forward (`chunk_tokens`, prefill_node/chunking.py:
the budget's rest, cut back to a block edge when one is in reach), the cached prefix a prompt may use
(`num_lookup_blocks`, cache_store/hashing.py: never the block of its last token), and D's admission and
preemption (`DecodeAdmission`, decode_node/admission.py: reservation size and watermark, no reservation while a
preempted request waits, resume rule, running slots, newest preempted first). Those are called here, not copied.

Where it cannot be, and why: the simulator does not run `Batcher` and `Scheduler` themselves. They hold a
request object per sequence (token lists, detokenizer, block ids) over a real `BlockPool` (free list, ref counts,
eviction), so a decode step costs O(batch) Python work, and the plan sweeps clusters of hundreds of workers over
tens of thousands of requests (tests/planner/test_simulator.py: 200 workers, 20,000 requests in seconds). Here a
worker is counters: free blocks, a prompt's group instead of its hashes (a workload has lengths and group ids,
not tokens: a group's prefix counts as cached on a P once it finished a prompt of the group, and is never
evicted). Not simulated at all: D's own prefix cache at reservation, host RAM / Redis tiers, the batcher's
limit on prefilling requests and its refusal of prompts that can never fit, the decode engine's overlap of
step N+1's scheduling with step N (same tokens, less host time), local prefill on D and KV-load failures.

Prefill: FIFO queue; one iteration packs at most max_num_batched_tokens prompt tokens, requests already
prefilling first, then queued ones in arrival order, the last possibly a partial chunk. Only the suffix after
a cached prefix is computed (a group's prefix is cached once the worker finished a prompt of that group).

Decode: reserve blocks for prompt + 1 at routing time (refused if that would leave less than the watermark, or
while a preempted request waits); a request whose KV arrived waits for a running slot (max_num_seqs); before
each step every running request gets room for its next token, the newest being preempted (and later
recomputed on D) when blocks run out.

A step's time is the profile's decode model at the batch's Σctx and longest context (the CPU attention pads
every row to the longest: profile.py). A decode step costs O(1) + O(finished) here, not O(batch): a request's
block needs and its finishing step are arithmetic in the worker's step counter (see `DecodeWorker._due_over`),
the longest context comes from a heap, so clusters of hundreds of workers simulate in seconds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from pdserve.cache_store.hashing import num_lookup_blocks
from pdserve.decode_node.admission import DecodeAdmission
from pdserve.planner.profile import Profile
from pdserve.prefill_node.chunking import QueuedAdmission, chunk_tokens

DecodeCoef = tuple[float, float, float, float, float]  # Profile.decode_coef(): Σctx, batch·max(ctx), batch, const, [batch > 1]


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Chunk:
    rid: int
    start: int
    end: int


class PrefillWorker:
    def __init__(self, max_num_batched_tokens: int, block_size: int) -> None:
        self.budget = max_num_batched_tokens
        self.block_size = block_size
        self.queue: deque[int] = deque()
        self.prefilling: dict[int, int] = {}  # rid -> tokens computed (insertion order = admission order)
        self.cached_groups: set[int] = set()
        self.busy = False
        self.plan: list[Chunk] = []

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.prefilling)

    def schedule(self, input_len: list[int], prefix_len: list[int], group: list[int]) -> list[Chunk]:
        budget, plan = self.budget, []
        for rid, done in self.prefilling.items():
            if budget <= 0:
                break
            take = chunk_tokens(done, input_len[rid] - done, budget, self.block_size)
            plan.append(Chunk(rid, done, done + take))
            budget -= take
        order, partial = QueuedAdmission(budget), None
        while self.queue and order.room() and order.goes_before_partial(input_len[self.queue[0]]):
            rid = self.queue.popleft()
            cached = self._cached_tokens(input_len[rid], prefix_len[rid], group[rid])
            self.prefilling[rid] = cached
            if not order.takes_now(input_len[rid] - cached):
                partial = (rid, cached)
                continue
            take = chunk_tokens(cached, input_len[rid] - cached, order.budget, self.block_size)
            plan.append(Chunk(rid, cached, cached + take))
            order.spend(take)
        if partial is not None:
            rid, cached = partial
            take = chunk_tokens(cached, input_len[rid] - cached, order.budget, self.block_size)
            plan.append(Chunk(rid, cached, cached + take))
        self.plan = plan
        return plan

    def _cached_tokens(self, n: int, prefix: int, group: int) -> int:
        """Full blocks of the group's prefix, never the prompt's last token (its logits give the first token)."""
        if prefix <= 0 or group not in self.cached_groups:
            return 0
        return min(prefix // self.block_size, num_lookup_blocks(n, self.block_size)) * self.block_size

    def finish_iteration(self, input_len: list[int], group: list[int], prefix_len: list[int]) -> list[int]:
        """Advance the plan's requests; returns those whose whole prompt is now computed."""
        done = []
        for c in self.plan:
            self.prefilling[c.rid] = c.end
            if c.end == input_len[c.rid]:
                del self.prefilling[c.rid]
                if prefix_len[c.rid] >= self.block_size:
                    self.cached_groups.add(group[c.rid])
                done.append(c.rid)
        self.plan = []
        return done

    def iteration_time(self, plan: list[Chunk], profile: Profile, overhead_s: float, scale: float = 1.0) -> float:
        return profile.prefill_time([c.end - c.start for c in plan], [c.start for c in plan]) * scale + overhead_s


class DecodeWorker:
    """Running requests are (ctx0, s0, last_step): ctx0 tokens before their first step s0 here, last step
    index last_step. Before step j a request holds ctx0 + (j - s0) tokens and needs that many tokens of blocks;
    a new block is due at step j > s0 when (ctx0 + j - s0 - 1) % block_size == 0, i.e. when
    (ctx0 - s0 - 1) % block_size == (-j) % block_size: `due[r]` counts running requests of residue r."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, watermark_blocks: int = 1) -> None:
        self.total = num_blocks
        self.free = num_blocks
        self.block_size = block_size
        self.admission = DecodeAdmission(block_size, max_num_seqs, watermark_blocks)
        self.waiting: deque[tuple[int, int, int]] = deque()  # (rid, ctx0, steps) with KV present
        self.preempted: deque[tuple[int, int, int]] = deque()
        self.running: dict[int, tuple[int, int, int]] = {}
        self.finishing: list[tuple[int, int]] = []  # heap of (last_step, rid)
        self._longest: list[tuple[int, int]] = []  # heap of (s0 - ctx0, rid): the longest context on top
        self.due = [0] * block_size
        self.sum_ctx = 0
        self.step = 0
        self.busy = False
        self.num_preemptions = 0
        self.recompute_tokens: list[int] = []  # contexts recomputed in the step being run
        self.run_len = 1  # steps simulated as one event (see _plan_run)
        self.run_taken = 1
        self.run_start_t = 0.0
        self.run_scale = 1.0  # model time × this for the run's steps (a prefill running beside them: simulator)
        self.run_beside = 0.0  # the prefill pool's busy fraction when the run started
        self.version = 0  # bumped when a run is cut short: its old end event is stale

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free / self.total

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.preempted)

    def reserve(self, prompt_len: int) -> bool:
        needed = self.admission.reservation_blocks(prompt_len)
        if not self.admission.may_reserve(needed, len(self.preempted), lambda n: n <= self.free):
            return False
        self.free -= needed
        return True

    def kv_arrived(self, rid: int, prompt_len: int, output_len: int) -> None:
        self.waiting.append((rid, prompt_len + 1, output_len - 1))

    def start_step(self) -> None:
        """Resume preempted, admit waiting, then make room for this step's new blocks."""
        self.recompute_tokens = []
        joined: list[tuple[int, int, int]] = []
        while self.preempted and self.admission.has_slot(len(self.running) + len(joined)):
            rid, ctx0, steps = self.preempted[0]
            needed = blocks_for(ctx0, self.block_size)
            if self.free < self.admission.resume_blocks(needed, len(self.running) + len(joined)):
                break
            self.preempted.popleft()
            self.free -= needed
            self.recompute_tokens.append(ctx0 - 1)
            joined.append((rid, ctx0, steps))
        while self.waiting and self.admission.has_slot(len(self.running) + len(joined)):
            joined.append(self.waiting.popleft())
        self._grow()
        for rid, ctx0, steps in joined:
            self._join(rid, ctx0, steps)
        self.run_len = self._plan_run(bool(joined))

    def _plan_run(self, joined: bool) -> int:
        """Steps that can be simulated as one event: nobody joins (none waiting, or no free slot), nobody
        leaves before the last of them, and the blocks due meanwhile are free. Those blocks are taken as
        the steps start (`sync_to`), so a reservation sees what it would see step by step; one that leaves
        too few cuts the run (`rest_fits`), and so does a KV arrival that could join (`cut_run`)."""
        self.run_taken = 1  # the first step's blocks were taken by _grow
        if joined or self.preempted or not self.finishing or (self.waiting and self.admission.has_slot(len(self.running))):
            return 1
        k = self.finishing[0][0] - self.step + 1
        while k > 1 and self._due_over(self.step + 1, k - 1) > self.free:
            k //= 2
        return max(1, k)

    def sync_to(self, m: int) -> None:
        """The run's first m steps have started: take the blocks due at their starts."""
        if m > self.run_taken:
            self.free -= self._due_over(self.step + self.run_taken, m - self.run_taken)
            self.run_taken = m

    def rest_fits(self) -> bool:
        return self._due_over(self.step + self.run_taken, self.run_len - self.run_taken) <= self.free

    def _due_over(self, start: int, n: int) -> int:
        """Blocks due over steps start .. start + n - 1."""
        if n <= 0:
            return 0
        bs = self.block_size
        total = (n // bs) * sum(self.due)
        return total + sum(self.due[(-j) % bs] for j in range(start, start + n % bs))

    @property
    def max_ctx(self) -> int:
        """The longest running context at the current step (the CPU attention pads every row to it): the
        request of largest ctx0 - s0, found in a heap whose entries of requests gone since are dropped here."""
        heap = self._longest
        while heap:
            key, rid = heap[0]
            entry = self.running.get(rid)
            if entry is not None and entry[1] - entry[0] == key:
                return self.step - key
            heapq.heappop(heap)
        return 0

    def _step_cost(self, decode_coef: DecodeCoef, overhead_s: float) -> tuple[float, float]:
        """(first step's time, how much each later step of the run adds): all contexts grow by one a step."""
        a, p, b, c, multi = decode_coef
        batch = len(self.running)
        model = a * self.sum_ctx + p * batch * self.max_ctx + b * batch + c + multi * (batch > 1)
        return model * self.run_scale + overhead_s, (a + p) * batch * self.run_scale

    def run_time(self, m: int, decode_coef: DecodeCoef, profile: Profile, overhead_s: float) -> float:
        """Time of the run's first m steps: step i has context sum_ctx + i·batch, longest max_ctx + i."""
        first, growth = self._step_cost(decode_coef, overhead_s)
        t = m * first + growth * m * (m - 1) / 2
        if self.recompute_tokens:
            t += sum(profile.prefill_time([n]) for n in self.recompute_tokens)
        return t

    def steps_done_by(self, elapsed: float, decode_coef: DecodeCoef, overhead_s: float) -> int:
        """The step of the current run in progress after `elapsed` s, counted from 1."""
        first, growth = self._step_cost(decode_coef, overhead_s)
        quad, lin = growth / 2, first - growth / 2
        m = elapsed / lin if quad <= 0 else (-lin + (lin * lin + 4 * quad * elapsed) ** 0.5) / (2 * quad)
        return min(self.run_len, max(1, math.ceil(m - 1e-9)))

    def cut_run(self, m: int) -> None:
        """Stop the run after its m-th step (m >= the steps already started)."""
        self.run_len = max(m, self.run_taken)
        self.version += 1

    def _grow(self) -> None:
        need = self.due[(-self.step) % self.block_size]
        while need > self.free and self.running:
            need -= self._preempt_newest()
        self.free -= need

    def _join(self, rid: int, ctx0: int, steps: int) -> None:
        s0 = self.step
        self.running[rid] = (ctx0, s0, s0 + steps - 1)
        heapq.heappush(self.finishing, (s0 + steps - 1, rid))
        self.due[(ctx0 - s0 - 1) % self.block_size] += 1
        self.sum_ctx += ctx0
        heapq.heappush(self._longest, (s0 - ctx0, rid))

    def _leave(self, rid: int) -> tuple[int, int]:
        """Remove a running request; returns (tokens it holds now, blocks it holds)."""
        ctx0, s0, _ = self.running.pop(rid)
        self.due[(ctx0 - s0 - 1) % self.block_size] -= 1
        tokens = ctx0 + self.step - s0
        self.sum_ctx -= tokens
        return tokens, blocks_for(max(ctx0, tokens - 1), self.block_size)

    def _preempt_newest(self) -> int:
        """Free the newest request's blocks; returns how many of this step's due blocks it no longer needs."""
        rid = self.admission.victim(self.running)
        ctx0, s0, last = self.running[rid]
        was_due = int(self.step > s0 and (ctx0 + self.step - s0 - 1) % self.block_size == 0)
        tokens, held = self._leave(rid)
        self.free += held  # this step's due block was not taken yet
        self.preempted.append((rid, tokens, last - self.step + 1))
        self.num_preemptions += 1
        return was_due

    def finish_run(self) -> list[int]:
        """The run's steps ran: every running request gained run_len tokens; returns those that finished."""
        self.sync_to(self.run_len)
        self.sum_ctx += len(self.running) * self.run_len
        self.step += self.run_len - 1  # the run's last step
        done = []
        while self.finishing and self.finishing[0][0] <= self.step:
            last, rid = heapq.heappop(self.finishing)
            entry = self.running.get(rid)
            if entry is None or entry[2] != last:
                continue  # preempted since: a stale entry
            self.step += 1  # _leave counts the tokens after this step
            _tokens, held = self._leave(rid)
            self.step -= 1
            self.free += held
            done.append(rid)
        self.step += 1
        return done

    def release_reservation(self, prompt_len: int) -> None:
        """A request that finished at its first token (output_len 1) frees its reservation."""
        self.free += self.admission.reservation_blocks(prompt_len)
