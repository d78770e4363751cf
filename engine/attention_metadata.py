"""Per-sequence inputs (plain Python) and the packed tensors the forwards read.

A prefill batch packs chunks of several sequences into one token axis; a chunk may follow tokens that are
already in the cache (a cached prefix, earlier chunks):

    sequence 0: |== cached (start_pos 32) ==|-- chunk (16) --|        seq_lens[0] = 48
    sequence 1: |-- chunk (5) --|                                      seq_lens[1] = 5
    packed q:   [ s0 t32 .. s0 t47 | s1 t0 .. s1 t4 ]                  cu_seqlens_q = [0, 16, 21]

Position p of a sequence is written to slot block_table[p // block_size] * block_size + p % block_size.
A decode batch has one token per sequence and is padded up to a bucket size (a CUDA graph is captured per
bucket); padded rows have slot -1 (nothing written) and seq_len 0 (attention yields zeros).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.decode_staging import HostStaging
from pdserve.kernels.prefill_attention import PrefillShape


@dataclass(frozen=True)
class PrefillChunk:
    """token_ids: this chunk; start_pos: tokens of the sequence already in the cache; block_table covers
    start_pos + len(token_ids) tokens; need_logits: sample after this chunk (the prompt's last chunk);
    all_logits: logits of every row of the chunk (prompt logprobs), not only its last."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    need_logits: bool = True
    all_logits: bool = False


@dataclass(frozen=True)
class DecodeInput:
    """One sequence's next step: token_id sits at `position` (= tokens already cached); its K/V goes there.
    `source_row` >= 0: the token is the one the previous step sampled in that row, still on the device
    (an overlapped decode loop); `token_id` is then ignored."""

    token_id: int
    position: int
    block_table: Sequence[int]
    source_row: int = -1


@dataclass(frozen=True)
class PrefillBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [N] int64: packed rows whose logits are computed (last row of a chunk, or
    # every row of an `all_logits` chunk), in chunk order
    shape: PrefillShape  # host-side: the chunks' lengths and whether any follows cached tokens


@dataclass(frozen=True)
class DecodeBatch:
    """Views of the first `bucket` rows of DecodeBuffers; rows past num_seqs are padding."""

    num_seqs: int
    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slot_mapping: torch.Tensor  # [bucket] int64
    seq_lens: torch.Tensor  # [bucket] int32
    block_tables: torch.Tensor  # [bucket, max_blocks] int32


def _check_covers(what: str, block_table: Sequence[int], num_tokens: int, block_size: int) -> None:
    if len(block_table) * block_size < num_tokens:
        raise ValueError(
            f"{what}: block table has {len(block_table)} blocks ({len(block_table) * block_size} slots of "
            f"{block_size}) but {num_tokens} tokens must be cached"
        )


_ALIGN = 16  # elements: every packed segment starts 64/128 bytes in, as 16-byte aligned as a fresh allocation
# (Triton compiles per pointer alignment class: kernels/specialization.py; the warm-up's keys must hold)


def _segments(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of consecutive segments of `sizes` elements, each rounded up to _ALIGN, and the total."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def _logit_rows(chunks: list[PrefillChunk], ends: np.ndarray) -> np.ndarray:
    """Packed rows whose logits are computed: the last of each chunk that needs them, every row of an
    `all_logits` chunk; `ends[i]` is chunk i's end row (exclusive)."""
    rows = [np.arange(ends[i] - len(c.token_ids), ends[i]) if c.all_logits else ends[i:i + 1] - 1
            for i, c in enumerate(chunks) if c.all_logits or c.need_logits]
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


def build_prefill_batch(chunks: list[PrefillChunk], block_size: int, device: torch.device) -> PrefillBatch:
    """The packed tensors, computed on the host (numpy) into one int64 and one int32 buffer, each moved by
    one copy. On CUDA the buffers are pinned and copied non_blocking, so building a batch never waits for
    the GPU: the 7 pageable `.to(device)` copies this replaced each synchronized the host with the device
    (set_sync_debug_mode counted them; benchmarks/prefill_4096_gpu.py). The pinned blocks come from torch's
    caching host allocator, which records each copy's event and hands a block out again only once that copy
    completed: refilling can never race a queued copy. The device tensors are views of two allocations."""
    if not chunks:
        raise ValueError("a prefill batch needs at least one chunk")
    lengths = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    for i, c in enumerate(chunks):
        if not len(c.token_ids):
            raise ValueError(f"prefill chunk {i} has no tokens (start_pos {c.start_pos})")
        _check_covers(f"prefill chunk {i}", c.block_table, c.start_pos + int(lengths[i]), block_size)
    b, t = len(chunks), int(lengths.sum())
    ends = np.cumsum(lengths)
    logit_rows = _logit_rows(chunks, ends)
    width = max(1, max(len(c.block_table) for c in chunks))
    off64, size64 = _segments([t, t, t, len(logit_rows)])  # input_ids, positions, slot_mapping, logits_indices
    off32, size32 = _segments([b + 1, b, b * width])  # cu_seqlens_q, seq_lens, block_tables
    pinned = torch.device(device).type == "cuda"
    host64 = torch.empty(size64, dtype=torch.int64, pin_memory=pinned)
    host32 = torch.empty(size32, dtype=torch.int32, pin_memory=pinned)
    a64, a32 = host64.numpy(), host32.numpy()
    ids, pos, slots = (a64[o:o + t] for o in off64[:3])
    a64[off64[3]:off64[3] + len(logit_rows)] = logit_rows
    cu, seq_lens = a32[off32[0]:off32[0] + b + 1], a32[off32[1]:off32[1] + b]
    table = a32[off32[2]:off32[2] + b * width].reshape(b, width)
    ids[:] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=t)
    cu[0], cu[1:] = 0, ends
    starts = np.array([c.start_pos for c in chunks], dtype=np.int64)
    seq_index = np.repeat(np.arange(b), lengths)
    pos[:] = np.arange(t) + (starts - (ends - lengths))[seq_index]
    table[:] = 0
    for i, c in enumerate(chunks):
        table[i, :len(c.block_table)] = c.block_table
    slots[:] = table[seq_index, pos // block_size].astype(np.int64) * block_size + pos % block_size
    seq_lens[:] = starts + lengths
    dev64, dev32 = host64.to(device, non_blocking=pinned), host32.to(device, non_blocking=pinned)
    return PrefillBatch(
        input_ids=dev64[off64[0]:off64[0] + t],
        positions=dev64[off64[1]:off64[1] + t],
        slot_mapping=dev64[off64[2]:off64[2] + t],
        cu_seqlens_q=dev32[off32[0]:off32[0] + b + 1],
        seq_lens=dev32[off32[1]:off32[1] + b],
        block_tables=dev32[off32[2]:off32[2] + b * width].view(b, width),
        logits_indices=dev64[off64[3]:off64[3] + len(logit_rows)],
        shape=PrefillShape(tuple(int(n) for n in lengths), any(c.start_pos > 0 for c in chunks)),
    )


class DecodeBuffers:
    """Static decode inputs, allocated once: a captured CUDA graph reads exactly these tensors."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 buckets: list[int]) -> None:
        if not buckets or max(buckets) < max_num_seqs:
            raise ValueError(f"decode buckets {buckets} must reach max_num_seqs {max_num_seqs}")
        self.buckets = sorted(buckets)
        self.block_size = block_size
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.device = torch.device(device)
        self.staging = HostStaging(size, max_blocks_per_seq, block_size, self.device)

    def bucket_for(self, num_seqs: int) -> int:
        i = bisect.bisect_left(self.buckets, num_seqs)
        if i == len(self.buckets):
            raise ValueError(f"decode batch of {num_seqs} exceeds the largest bucket {self.buckets[-1]}")
        return self.buckets[i]

    def padding_batch(self, bucket: int) -> DecodeBatch:
        """A batch of `bucket` padding rows (slot -1: nothing written; seq_len 0: attention yields zeros), what
        a CUDA graph is warmed up and captured on: running it changes no KV."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not one of the decode buckets {self.buckets}")
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].zero_()
        self.block_tables[:bucket].zero_()
        return self._batch(0, bucket)

    def _batch(self, num_seqs: int, bucket: int) -> DecodeBatch:
        return DecodeBatch(num_seqs, self.input_ids[:bucket], self.positions[:bucket], self.slot_mapping[:bucket],
                           self.seq_lens[:bucket], self.block_tables[:bucket])

    def prepare(self, items: list[DecodeInput], carried: torch.Tensor | None = None) -> DecodeBatch:
        """Stage the items on the host, copy them into the buffers' first rows without blocking, pad up to
        the bucket. `carried`: the previous step's sampled tokens [B_prev] (on the device), which items
        with a `source_row` take as their input."""
        n = len(items)
        bucket = self.bucket_for(n)
        staged, any_carried = self.staging.fill(items, bucket)
        if any_carried and carried is None:
            raise ValueError("decode items carry the previous step's tokens, but none were given")
        copy = self.device.type == "cuda"
        self.positions[:bucket].copy_(staged.pos_t[:bucket], non_blocking=copy)
        self.slot_mapping[:bucket].copy_(staged.slots_t[:bucket], non_blocking=copy)
        self.seq_lens[:bucket].copy_(staged.lens_t[:bucket], non_blocking=copy)
        self.block_tables[:bucket].copy_(staged.table_t[:bucket], non_blocking=copy)
        ids = self.input_ids[:bucket]
        ids.copy_(staged.ids_t[:bucket], non_blocking=copy)
        if any_carried:
            assert carried is not None
            src = staged.src_t[:n].to(self.device, non_blocking=copy)
            taken = carried[src.clamp(min=0)]
            ids[:n] = torch.where(src >= 0, taken, ids[:n])
        self.staging.mark_copied(staged)
        return self._batch(n, bucket)
