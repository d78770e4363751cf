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

Each set's rows also remember which copy they hold and how much of it (a row keeps its request from step to
step while the batch is unchanged), so a row whose list is the one it held, no longer, is not written at all, a
grown one gets its new blocks only, and only rows that held something longer are zeroed past their table: no
memset of the whole set and no per-row memcpy each step, and the scalars go in as one list each.
`benchmarks/decode_staging_cpu.py --against 4f8d99b` on a 2-core host, side by side: 64 rows at ctx 4,096
275 -> 135 us a fill (2.0x), ctx 512 227 -> 137, 256 rows at ctx 4,096 1,005 -> 363 (2.8x), 8,192 1,119 -> 413
(results/decode_staging_held_cpu.json); on an H100 host's CPU 201.7 -> 93.6 us at 64 rows, ctx 4,096
(results/decode_staging_held_h100_host.json).

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
        # what each table row holds: the first held_n[i] entries of held[i] (None: a table that was not a list),
        # zeros from width[i] on; so a row whose table only grew since this set's last fill copies what is new
        self.held: list[_Table | None] = [None] * rows
        self.held_n, self.width = [0] * rows, [0] * rows


class _Table:
    """A block table's int32 copy: its first `n` entries are table[:n] of the list `source` (held, so that its
    id is not reused while the copy is kept)."""

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.n = 0

    def update(self) -> np.ndarray:
        """The copy of the whole table now: the entries appended since the last call converted, the rest kept
        (the list must not be shorter than n: HostStaging._table starts a new copy then)."""
        length = len(self.source)
        if length > self.array.shape[0]:
            grown = np.empty(2 * length, dtype=np.int32)
            grown[:self.n] = self.array[:self.n]
            self.array = grown
        if length > self.n:
            self.array[self.n:length] = self.source[self.n:length]
            self.n = length
        return self.array[:length]


class HostStaging:
    def __init__(self, rows: int, max_blocks: int, block_size: int, device: torch.device,
                 sets: int | None = None) -> None:
        """sets: how many staging sets are used in turn (default: two on CUDA, one elsewhere)."""
        self.block_size = block_size
        self.device = device
        pinned = device.type == "cuda"
        self._sets = [_Set(rows, max_blocks, pinned) for _ in range(sets or (_SETS if pinned else 1))]
        self._turn = 0
        self.max_blocks = max_blocks
        self._tables: dict[int, _Table] = {}  # id(list) -> its copy, for the lists of the last fill

    def _table(self, table: Sequence[int], seen: dict[int, _Table]) -> _Table | None:
        """The list's copy, brought up to date (None for a table that is not a list)."""
        if type(table) is not list:
            return None
        copy = self._tables.get(id(table))
        if copy is None or copy.source is not table or len(table) < copy.n:  # new, or not append-only after all
            copy = _Table(table)  # (a new object: no staging row holds it)
        seen[id(table)] = copy
        copy.update()
        return copy

    def _stage_table(self, staged: _Set, i: int, table: Sequence[int], seen: dict[int, _Table]) -> None:
        """Row i of the set's tables := table, zeros after it, writing only what differs from what it holds."""
        length = len(table)
        if length > self.max_blocks:
            raise ValueError(f"block table of {length} blocks exceeds the limit {self.max_blocks}")
        copy = self._table(table, seen)
        row = staged.table[i]
        if copy is not None and staged.held[i] is copy and staged.held_n[i] <= length:
            if staged.held_n[i] < length:  # the same list, grown: its new entries only
                row[staged.held_n[i]:length] = copy.array[staged.held_n[i]:length]
        else:
            row[:length] = table if copy is None else copy.array[:length]
            if staged.width[i] > length:
                row[length:staged.width[i]] = 0
        staged.held[i], staged.held_n[i], staged.width[i] = copy, length, length

    def fill(self, rows: Sequence[StagedRow], bucket: int) -> tuple[_Set, bool]:
        """Fill the next set for `rows` padded to `bucket` (padding: slot -1, seq_len 0, an empty table);
        returns it and whether any row is carried."""
        staged = self._sets[self._turn]
        self._turn = (self._turn + 1) % len(self._sets)
        if staged.copied is not None:
            staged.copied.synchronize()
        n, bs = len(rows), self.block_size
        seen: dict[int, _Table] = {}
        tables, held, held_n = self._tables, staged.held, staged.held_n
        for i, row in enumerate(rows):
            table = row.block_table
            copy = tables.get(id(table))  # the common case first, inline: the row holds this list, unchanged
            if copy is not None and held[i] is copy and copy.source is table and held_n[i] == len(table) == copy.n:
                seen[id(table)] = copy
            else:
                self._stage_table(staged, i, table, seen)
        for i in range(n, min(bucket, len(held))):  # padding rows: an empty table
            if staged.width[i]:
                staged.table[i, :staged.width[i]] = 0
            staged.held[i], staged.held_n[i], staged.width[i] = None, 0, 0
        staged.num_blocks[:n] = staged.width[:n]
        staged.ids[:n] = [row.token_id for row in rows]
        staged.pos[:n] = [row.position for row in rows]
        staged.src[:n] = [row.source_row for row in rows]
        carried = bool((staged.src[:n] >= 0).any())
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
