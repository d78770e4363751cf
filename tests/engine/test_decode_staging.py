"""The decode staging's block tables (engine/decode_staging.py): converted incrementally and written into a
staging row only where it does not hold them already, always equal to a fresh conversion of the rows' tables,
step after step, as tables grow, are replaced, reorder, shrink."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve.engine.attention_metadata import DecodeInput
from pdserve.engine.decode_staging import HostStaging

MAX_BLOCKS, BLOCK = 64, 4


def check(staging: HostStaging, tables: list[list[int]] | list[tuple[int, ...]]) -> None:
    rows = [DecodeInput(7, len(t) * BLOCK - 1, t) for t in tables]
    bucket = len(rows) + 1
    staged, _ = staging.fill(rows, bucket)
    for i, table in enumerate(tables):
        assert staged.table[i, :len(table)].tolist() == list(table), f"row {i}"
        assert not staged.table[i, len(table):].any(), f"row {i} past its table"
        assert staged.slots[i] == table[-1] * BLOCK + BLOCK - 1
    assert not staged.table[len(tables):bucket].any(), "padding rows hold no table"


@pytest.mark.parametrize("sets", [1, 2, 3])
def test_tables_that_grow_are_replaced_reorder_and_shrink_stage_as_a_fresh_conversion(sets: int) -> None:
    """Each set's rows keep what they held at its last fill (two sets in turn on CUDA): whatever happened to the
    tables since, a fill leaves every row equal to a fresh conversion, zeros after it and in the padding rows."""
    staging = HostStaging(8, MAX_BLOCKS, BLOCK, torch.device("cpu"), sets=sets)
    rng = random.Random(0)
    tables = [[rng.randrange(1000) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    for step in range(60):
        check(staging, tables)
        i = rng.randrange(len(tables))
        change = step % 6
        if change in (0, 1, 2):  # a decode step crossing a block boundary: the same list extended
            tables[i].extend(rng.randrange(1000) for _ in range(rng.randrange(1, 40)))
            del tables[i][MAX_BLOCKS:]  # (kept under the limit: may shrink it back)
        elif change == 3:  # re-allocated (preemption, a new request): a new list in the row
            tables[i] = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        elif change == 4:  # rows reorder as requests finish and join
            rng.shuffle(tables)
        else:  # truncated in place (not what the scheduler does, but a shorter table is converted whole)
            del tables[i][max(1, len(tables[i]) // 2):]
        if len(tables) < 7 and step % 10 == 0:
            tables.append([rng.randrange(1000) for _ in range(3)])
        if len(tables) > 2 and step % 13 == 0:
            tables.pop(rng.randrange(len(tables)))


def test_the_same_list_in_two_rows_and_tables_that_are_not_lists() -> None:
    staging = HostStaging(4, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    shared = [3, 4, 5]
    check(staging, [shared, shared, (9, 8)])
    shared.append(6)
    check(staging, [shared, (9, 8, 7), shared])
    check(staging, [np.array([1, 2], dtype=np.int64).tolist(), shared])


def test_a_freed_lists_copy_is_dropped_so_a_new_list_at_its_address_is_converted() -> None:
    staging = HostStaging(2, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    for n in range(1, 40):  # new lists each step: whatever addresses they get, each is converted afresh
        check(staging, [list(range(n, 2 * n)), [n]])
    assert len(staging._tables) == 2, "only the last fill's lists keep a copy"


def test_each_rows_scalars_the_padding_rows_carried_tokens_and_the_limits() -> None:
    """Token, position, source row, seq_len and slot of every row, the padding rows' (-1 slot, seq_len 0, no
    source), whether any token is carried from the previous step, and the two refusals."""
    staging = HostStaging(4, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    staged, carried = staging.fill([DecodeInput(11, 5, [1, 2]), DecodeInput(12, 0, [3], source_row=1)], 4)
    assert staged.ids[:4].tolist() == [11, 12, 0, 0] and staged.pos[:4].tolist() == [5, 0, 0, 0]
    assert staged.src[:4].tolist() == [-1, 1, -1, -1] and staged.lens[:4].tolist() == [6, 1, 0, 0]
    assert staged.slots[:4].tolist() == [2 * BLOCK + 1, 3 * BLOCK, -1, -1]
    assert carried
    assert not staging.fill([DecodeInput(11, 6, [1, 2])], 2)[1]
    with pytest.raises(ValueError, match=f"{MAX_BLOCKS + 1} blocks exceeds the limit {MAX_BLOCKS}"):
        staging.fill([DecodeInput(1, 0, [0]), DecodeInput(1, 0, list(range(MAX_BLOCKS + 1)))], 2)
    with pytest.raises(ValueError, match="decode item 1: block table has 1 blocks"):
        staging.fill([DecodeInput(1, 0, [0]), DecodeInput(1, BLOCK, [0])], 2)
