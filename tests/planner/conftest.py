from __future__ import annotations

import pytest

from pdserve.planner.profile import DECODE_TERMS, PREFILL_TERMS, LinearFit, Profile


@pytest.fixture(scope="session")
def gpu_like_profile() -> Profile:
    """Round numbers of the order of an 8B model on one H200 (bf16): 22 us/token prefill, 6 ms decode step."""
    return Profile("synthetic-8b", "cuda", "bfloat16", kv_bytes_per_token=131072, block_size=16,
                   prefill=LinearFit(PREFILL_TERMS, (2.2e-5, 2e-10, 0.004), 1.0),
                   decode=LinearFit(DECODE_TERMS, (1e-8, 0.0, 3e-5, 0.006, 0.0), 1.0))


@pytest.fixture(scope="session")
def cpu_like_profile() -> Profile:
    """The shape of SmolLM2-135M on one CPU thread: decode attention padded to the batch's longest context."""
    return Profile("synthetic-cpu", "cpu", "float32", kv_bytes_per_token=46080, block_size=16,
                   prefill=LinearFit(PREFILL_TERMS, (1.2e-3, 1e-6, 0.03), 1.0),
                   decode=LinearFit(DECODE_TERMS, (0.0, 2e-5, 1e-3, 0.05, 0.0), 1.0))
