"""Host-side staging of a decode step's inputs: preallocated arrays (pinned on CUDA), filled from the rows
and copied to the device buffers without blocking.

    rows ──fill──▶ staging set k (numpy views of pinned tensors) ──non_blocking copy──▶ DecodeBuffers
                   slots / seq_lens computed vectorised from the block table          (the graph's inputs)
    carried rows (source_row >= 0): their input id is the previous step's sampled token, gathered on the
    device (`torch.where(src >= 0, prev[src], ids)`): the host never waits for it

Block tables are converted incrementally: a table is the scheduler's list for its request, which only grows
while it is the same object (extended by a block every block_size tokens, or replaced by a new list on
(re)allocation), so the staging keeps each table's int32 copy from the last step it saw and converts only the
blocks appended since; a step's rows then cost a memcpy each, not a Python-list conversion (64 rows of 257
blocks: ~0.9 ms of an H100 host's time per step; the synchronised fp8 KV step at b64 ctx 4,096 went 13.39 ->
12.80 ms, benchmarks/results/engine_gpu_staging_{before,after}_h100.json). A table that is not a list, or is
shorter than its copy, is converted whole.

Two sets, used in turn: the host fills set k for step N+1 while set k-1's copies may still be queued behind
step N; before refilling a set, the event recorded after its last copies is waited on (by then it has long
completed: the loop consumed that step's tokens in between, so the wait costs nothing in practice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

_SETS = 2


class StagedRow(Protocol):  # read-only: DecodeInput is a frozen dataclass
    @property
    def token_id(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def block_table(self) -> Sequence[int]: ...  # a list only grows while it is the same object (above)
    @property
    def source_row(self) -> int: ...


class _Set:
    def __init__(self, rows: int, max_blocks: int, pinned: bool) -> None:
        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pinned)

        self.ids_t, self.pos_t = host(rows, dtype=torch.long), host(rows, dtype=torch.long)
        self.slots_t, self.lens_t = host(rows, dtype=torch.long), host(rows, dtype=torch.int32)
        self.src_t, self.table_t = host(rows, dtype=torch.long), host(rows, max_blocks, dtype=torch.int32)
        self.ids, self.pos, self.slots = self.ids_t.numpy(), self.pos_t.numpy(), self.slots_t.numpy()
        self.lens, self.src, self.table = self.lens_t.numpy(), self.src_t.numpy(), self.table_t.numpy()
        self.num_blocks: np.ndarray = np.zeros(rows, dtype=np.int64)
        self.copied: torch.cuda.Event | None = None


class _Table:
    """A block table's int32 copy: its first `n` entries are table[:n] of the list `source` (held, so that its
    id is not reused while the copy is kept)."""

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.n = 0

    def update(self) -> np.ndarray:
        """The copy of the whole table now: the entries appended since the last call converted, the rest kept."""
        length = len(self.source)
        if length < self.n:  # not append-only after all: start again
            self.n = 0
        if length > self.array.shape[0]:
            grown = np.empty(2 * length, dtype=np.int32)
            grown[:self.n] = self.array[:self.n]
            self.array = grown
        if length > self.n:
            self.array[self.n:length] = self.source[self.n:length]
            self.n = length
        return self.array[:length]


class HostStaging:
    def __init__(self, rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        pinned = device.type == "cuda"
        self._sets = [_Set(rows, max_blocks, pinned) for _ in range(_SETS if pinned else 1)]
        self._turn = 0
        self.max_blocks = max_blocks
        self._tables: dict[int, _Table] = {}  # id(list) -> its copy, for the lists of the last fill

    def _table(self, table: Sequence[int], seen: dict[int, _Table]) -> Sequence[int] | np.ndarray:
        if type(table) is not list:
            return table
        copy = self._tables.get(id(table))
        if copy is None or copy.source is not table:
            copy = _Table(table)
        seen[id(table)] = copy
        return copy.update()

    def fill(self, rows: Sequence[StagedRow], bucket: int) -> tuple[_Set, bool]:
        """Fill the next set for `rows` padded to `bucket` (padding: slot -1, seq_len 0, an empty table);
        returns it and whether any row is carried."""
        staged = self._sets[self._turn]
        self._turn = (self._turn + 1) % len(self._sets)
        if staged.copied is not None:
            staged.copied.synchronize()
        n, bs = len(rows), self.block_size
        staged.table[:bucket] = 0  # 512 KB at 256 rows x 8,192 tokens: a memset, not a per-row loop
        carried = False
        seen: dict[int, _Table] = {}
        for i, row in enumerate(rows):
            table = row.block_table
            if len(table) > self.max_blocks:
                raise ValueError(f"block table of {len(table)} blocks exceeds the limit {self.max_blocks}")
            staged.table[i, :len(table)] = self._table(table, seen)
            staged.num_blocks[i] = len(table)
            staged.ids[i] = row.token_id
            staged.pos[i] = row.position
            staged.src[i] = row.source_row
            carried |= row.source_row >= 0
        pos = staged.pos[:n]
        short = pos >= staged.num_blocks[:n] * bs
        if short.any():
            bad = int(np.argmax(short))
            raise ValueError(f"decode item {bad}: block table has {len(rows[bad].block_table)} blocks ("
                             f"{len(rows[bad].block_table) * bs} slots of {bs}) but {int(pos[bad]) + 1} tokens "
                             "must be cached")
        staged.slots[:n] = staged.table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        staged.lens[:n] = pos + 1
        staged.ids[n:bucket], staged.pos[n:bucket], staged.src[n:bucket] = 0, 0, -1
        staged.slots[n:bucket], staged.lens[n:bucket] = -1, 0
        self._tables = seen  # the copies of tables no row uses any more go
        return staged, carried

    def mark_copied(self, staged: _Set) -> None:
        if self.device.type == "cuda":
            staged.copied = torch.cuda.Event()
            staged.copied.record()
