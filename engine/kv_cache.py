"""The paged KV pool's tensors: one per layer, [2, num_blocks, block_size, num_kv_heads, head_dim].

Index 0 holds rotated keys, index 1 values. Token t of a sequence lives in block block_table[t // block_size]
at offset t % block_size, i.e. in flat slot block_table[t // block_size] * block_size + t % block_size. Which
block belongs to which sequence is cache_store's business; the engine only reads and writes the slots given.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import CacheConfig, ModelConfig


def kv_cache_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, int, int, int, int]:
    return (2, cache.num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)


def allocate_kv_caches(
    model: ModelConfig, cache: CacheConfig, device: torch.device | str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Zeroed, so a padded decode slot that reads an unwritten block sees zeros, never NaN garbage. Written now on
    the CPU too: zeros from the OS as pages are first touched (numpy's calloc; tried 2026-12-07) start a
    default-model worker ~0.7 CPU-s sooner and 1 GB smaller, but its RSS then grows as requests first reach
    blocks (60-66 MB a decode worker in tests/reliability/test_overload.py's burst), which a leak check cannot
    tell from a leak."""
    shape = kv_cache_shape(model, cache)
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(model.num_layers)]


def kv_cache_bytes(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Bytes of all layers' KV tensors."""
    bytes_per_token = model.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size())
    return bytes_per_token * cache.num_blocks * cache.block_size


def blocks_for_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in budget_bytes (all layers, K and V)."""
    per_block = model.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()) * block_size
    return budget_bytes // per_block


# Left free on a GPU besides the weights and the KV pool, for Llama-3-8B in bf16: a 2,048-token prefill's
# temporaries (gate|up output 2048 x 28672 x 2 B = 117 MB, q/k/v and hidden ~60 MB), the fp32 logits of up to
# 256 sampled rows (131 MB), the decode graphs' pool (every bucket's fp32 logits, 1+2+..+256 rows = 262 MB,
# plus the 256-row bucket's temporaries) and what torch does not count (CUDA context and cuBLAS workspaces,
# ~0.6 GB): ~1.4 GB, rounded up to 2 GiB.
ACTIVATION_RESERVE_BYTES = 2 << 30


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def gpu_kv_budget(total: int, free: int, used: int, utilization: float,
                  reserve: int = ACTIVATION_RESERVE_BYTES) -> int:
    """Bytes the KV pool may take on a GPU (vLLM's --gpu-memory-utilization): this worker's share of the
    device, `utilization * total`, less what it already holds (`used`: weights, measured after loading) and
    `reserve` (activations, graphs, CUDA context); never more than is `free` on the device now less `reserve`
    (other processes, e.g. the other role's worker on the same GPU, hold the rest). Raises, naming the
    numbers, when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    share = int(total * utilization) - used - reserve
    budget = min(share, free - reserve)
    if budget > 0:
        return budget
    if share <= 0:
        raise ValueError(
            f"no GPU memory left for the KV pool: {utilization:g} x {_gib(total)} = {_gib(int(total * utilization))} "
            f"for this worker, less {_gib(used)} it holds (weights) and {_gib(reserve)} kept for activations, "
            f"leaves {_gib(share)}; raise --gpu-memory-utilization or give --kv-cache-memory / --num-blocks"
        )
    raise ValueError(
        f"no GPU memory left for the KV pool: the device has {_gib(free)} free of {_gib(total)} (other processes "
        f"hold the rest) and {_gib(reserve)} must stay free for activations; lower the other workers' "
        f"--gpu-memory-utilization or give --kv-cache-memory / --num-blocks"
    )
