"""The router's conditional-disaggregation choice (router/decode_reuse.py): the decode worker holding the longest
prefix prefills a short suffix itself, unless it is too busy against the least loaded decode worker."""

from __future__ import annotations

from pdserve.cache_store.hashing import block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.prefix_summary import encode_summary
from pdserve.router.decode_reuse import DecodeReuse
from pdserve.router.plan import SubRequest
from pdserve.router.policies import Prompt
from pdserve.router.registry import Worker, WorkerLoad

FP = "model-fp"
BS = 16
HISTORY = list(range(100, 100 + 4 * BS))  # 4 full blocks a decode worker may hold
PROMPT = Prompt(HISTORY + list(range(500, 520)))  # + 20 new tokens


def _decode(name: str, holds: int = 0, **load: int) -> Worker:
    worker = Worker(worker_id=name, url=f"http://{name}", roles=("decode",), static=False, last_seen=0.0,
                    load=WorkerLoad(**load), fingerprint=FP)
    if holds:
        worker.prefixes.report(encode_summary(block_hashes(HISTORY, BS, FP)[:holds]))
    return worker


def _sub(**sampling: object) -> SubRequest:
    return SubRequest("r-0", 0, 0, list(PROMPT.token_ids), SamplingParams(max_tokens=4, **sampling), None)


def test_the_worker_holding_the_history_prefills_the_short_suffix() -> None:
    reuse = DecodeReuse(BS, threshold=256)
    holder, other = _decode("holder", holds=4), _decode("other", holds=1)
    assert reuse.local_choice([other, holder], _sub(), PROMPT) is holder
    assert DecodeReuse(BS, threshold=20).local_choice([other, holder], _sub(), PROMPT) is None  # 20 left: not < 20
    assert reuse.local_choice([_decode("cold")], _sub(), PROMPT) is None  # nothing held: through a P


def test_a_busy_holder_is_passed_over_beyond_the_imbalance() -> None:
    reuse = DecodeReuse(BS, threshold=256, max_imbalance=4)
    idle = _decode("idle")
    assert reuse.local_choice([idle, _decode("holder", holds=4, num_running=4)], _sub(), PROMPT).worker_id == "holder"
    busy = _decode("holder", holds=4, num_running=5)  # 5 > 0 + 4: a shared prefix would pile every request here
    assert reuse.local_choice([idle, busy], _sub(), PROMPT) is None
    assert reuse.local_choice([busy], _sub(), PROMPT) is busy  # the only decode worker: no one less loaded


def _prefill(name: str, backlog: int) -> Worker:
    worker = Worker(worker_id=name, url=f"http://{name}", roles=("prefill",), static=False, last_seen=0.0,
                    load=WorkerLoad(), fingerprint=FP)
    worker.inflight_prompt_tokens = backlog
    return worker


def test_a_fresh_short_prompt_goes_to_a_decode_worker_when_the_prefill_pool_lost_a_worker_and_is_busy() -> None:
    reuse = DecodeReuse(BS, threshold=0, busy_tokens=256, busy_backlog=1024)  # reuse off: the busy rule alone
    idle_d, busy_d = _decode("idle-d"), _decode("busy-d", num_running=3)
    decode = [busy_d, idle_d]
    # 2 of 3 registered Ps left (one lost or failed for this request)
    assert reuse.busy_choice([_prefill("p0", 1024), _prefill("p1", 1023)], 3, decode, _sub(), PROMPT) is None
    assert reuse.busy_choice([_prefill("p0", 1024), _prefill("p1", 5000)], 3, decode, _sub(), PROMPT) is idle_d
    # the whole pool up and busy (a burst): P keeps it
    assert reuse.busy_choice([_prefill("p0", 1024), _prefill("p1", 5000)], 2, decode, _sub(), PROMPT) is None
    assert reuse.busy_choice([], 2, decode, _sub(), PROMPT) is idle_d  # no prefill worker up (or all failed)
    assert reuse.busy_choice([], 0, decode, _sub(), PROMPT) is idle_d  # none registered at all
    assert reuse.busy_choice([], 2, [], _sub(), PROMPT) is None


def test_the_busy_rule_keeps_long_prompts_logprobs_and_colocated_workers_on_their_path() -> None:
    reuse = DecodeReuse(BS, threshold=0, busy_tokens=len(PROMPT.token_ids), busy_backlog=1)
    decode = [_decode("d")]
    assert reuse.busy_choice([], 1, decode, _sub(), PROMPT) is None  # 84 tokens: not < 84
    wide = DecodeReuse(BS, threshold=0, busy_tokens=1000, busy_backlog=1)
    assert wide.busy_choice([], 1, decode, _sub(prompt_logprobs=1), PROMPT) is None  # only P computes them
    colocated = Worker(worker_id="c", url="http://c", roles=("prefill", "decode"), static=False, last_seen=0.0,
                       load=WorkerLoad(), fingerprint=FP)
    assert wide.busy_choice([], 1, [colocated], _sub(), PROMPT) is None
    assert DecodeReuse(BS, threshold=0, busy_tokens=0).busy_choice([], 1, decode, _sub(), PROMPT) is None  # off
