"""BASELINE, benchmark only: engine/attention_metadata.py's build_prefill_batch as it was before the pinned,
non_blocking staging (main at 5f7bc8d), so benchmarks/prefill_4096_gpu.py's `baseline` variants time the
old batch build against the new one in the same run. Not for the product: its 7 pageable .to(device) copies
each synchronize the host with the device."""

from __future__ import annotations

import torch

from pdserve.engine.attention_metadata import PrefillBatch, PrefillChunk, _check_covers
from pdserve.kernels.prefill_attention import PrefillShape


def build_prefill_batch_baseline(chunks: list[PrefillChunk], block_size: int, device: torch.device) -> PrefillBatch:
    """BASELINE, benchmark only: engine/attention_metadata.py's build_prefill_batch as it was before the pinned
    staging (main at 5f7bc8d): CPU torch ops, then 7 pageable .to(device) copies (each one a host sync)."""
    lengths = [len(c.token_ids) for c in chunks]
    for i, c in enumerate(chunks):
        _check_covers(f"prefill chunk {i}", c.block_table, c.start_pos + lengths[i], block_size)
    lens = torch.tensor(lengths)
    seq_index = torch.repeat_interleave(torch.arange(len(chunks)), lens)
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    starts = torch.tensor([c.start_pos for c in chunks])
    positions = starts[seq_index] + torch.arange(int(cu[-1])) - cu[:-1].long()[seq_index]
    width = max(1, max(len(c.block_table) for c in chunks))
    block_tables = torch.tensor([[*c.block_table] + [0] * (width - len(c.block_table)) for c in chunks],
                                dtype=torch.int32)
    slots = block_tables[seq_index, positions // block_size].long() * block_size + positions % block_size
    if any(c.all_logits for c in chunks):
        ends = cu.tolist()
        last_rows = torch.tensor([r for i, c in enumerate(chunks)
                                  for r in (range(ends[i], ends[i + 1]) if c.all_logits
                                            else [ends[i + 1] - 1] if c.need_logits else [])], dtype=torch.long)
    else:
        last_rows = (cu[1:].long() - 1)[torch.tensor([c.need_logits for c in chunks])]
    return PrefillBatch(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids]).to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=(starts + lens).to(torch.int32).to(device),
        block_tables=block_tables.to(device),
        logits_indices=last_rows.to(device),
        shape=PrefillShape(tuple(lengths), any(c.start_pos > 0 for c in chunks)),
    )
