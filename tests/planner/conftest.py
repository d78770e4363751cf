from __future__ import annotations

import pytest

from pdserve.planner.profile import DECODE_TERMS, PREFILL_TERMS, LinearFit, Profile


@pytest.fixture(scope="session")
def gpu_like_profile() -> Profile:
    """Round numbers of the order of an 8B model on one H200 (bf16): 22 us/token prefill, 6 ms decode step."""
    return Profile("synthetic-8b", "cuda", "bfloat16", kv_bytes_per_token=131072, block_size=16,
                   prefill=LinearFit(PREFILL_TERMS, (2.2e-5, 2e-10, 0.004), 1.0),
                   decode=LinearFit(DECODE_TERMS, (1e-8, 3e-5, 0.006), 1.0))
