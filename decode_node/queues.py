"""The decode scheduler's queues, and the one place a request's state changes: `DecodeQueues.move`.

    state            queue            entering it also
    WAITING_FOR_KV   (none)           (`add` at reserve; like every live request it is in `requests`)
    WAITING          waiting          -
    RUNNING          running          -  admission order: the newest is last, the first one preempted
    PREEMPTED        preempted        frees its blocks (its resume recomputes into fresh ones)
    LOCAL_PREFILL    local_prefills   -
    FINISHED_*       (none)           STOPPED / LENGTH: commits the sequence to the tiered cache first; frees
                                      its blocks unless a launched step may still write them (that step's
                                      update frees them) or its KV sender may (`held`, until `release_held`);
                                      drops it from `requests`; then `on_finish(request)`

The scheduler (decode_node/scheduler.py) decides the moves; a move not in `TRANSITIONS` (decode_node/request.py)
raises. Not thread-safe: used under the scheduler's lock, as the scheduler is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pdserve.cache_store.block_pool import BlockPool
from pdserve.decode_node.prefix import DecodePrefix
from pdserve.decode_node.request import TRANSITIONS, DecodeRequest, RequestState


class DecodeQueues:
    def __init__(self, pool: BlockPool, prefix: DecodePrefix) -> None:
        self.pool = pool
        self.prefix = prefix  # a finished sequence is committed through it (the next turn's cached prefix)
        self.requests: dict[str, DecodeRequest] = {}  # every request not finished
        self.waiting: deque[DecodeRequest] = deque()
        self.running: list[DecodeRequest] = []
        self.preempted: deque[DecodeRequest] = deque()
        self.local_prefills: deque[DecodeRequest] = deque()  # LOCAL_PREFILL, oldest first
        self.held: dict[str, DecodeRequest] = {}  # finished, blocks kept while P may still write them
        self.num_finished = 0
        self.on_finish: Callable[[DecodeRequest], None] = lambda request: None

    @property
    def num_waiting_for_kv(self) -> int:
        return sum(r.state == RequestState.WAITING_FOR_KV for r in self.requests.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.preempted) + len(self.local_prefills) + self.num_waiting_for_kv

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.preempted or self.local_prefills)

    def add(self, request: DecodeRequest) -> None:
        """A reservation: the request is live, WAITING_FOR_KV."""
        self.requests[request.request_id] = request

    def move(self, request: DecodeRequest, state: RequestState) -> None:
        if state not in TRANSITIONS.get(request.state, frozenset()):
            raise RuntimeError(f"request {request.request_id}: illegal move {request.state.name} -> {state.name}")
        self._leave_queue(request)
        request.state = state
        if state == RequestState.WAITING:
            self.waiting.append(request)
        elif state == RequestState.RUNNING:
            self.running.append(request)
        elif state == RequestState.PREEMPTED:
            self.release_blocks(request)
            self.preempted.append(request)
        elif state == RequestState.LOCAL_PREFILL:
            self.local_prefills.append(request)
        elif state.finished:
            if state in (RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH):
                self.prefix.commit(request)
            if not request.num_pending and not request.held_by_sender:  # else freed by the last launched step's
                self.release_blocks(request)                           # update, or by release_held
            del self.requests[request.request_id]
            self.num_finished += 1
            self.on_finish(request)

    def _leave_queue(self, request: DecodeRequest) -> None:
        queue = {RequestState.WAITING: self.waiting, RequestState.RUNNING: self.running,
                 RequestState.PREEMPTED: self.preempted,
                 RequestState.LOCAL_PREFILL: self.local_prefills}.get(request.state)
        if queue is not None:
            queue.remove(request)

    def hold(self, request: DecodeRequest) -> None:
        """Its KV sender may still write its blocks (cuda_ipc): once finished, they stay until `release_held`."""
        request.held_by_sender = True
        self.held[request.request_id] = request

    def release_held(self, request_id: str) -> None:
        """The KV sender of an aborted request can write its blocks no more: free them."""
        request = self.held.pop(request_id, None)
        if request is not None:
            request.held_by_sender = False
            self.release_blocks(request)

    def release_blocks(self, request: DecodeRequest) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
