from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from kv_helpers import Outcomes, start_receiver

from pdserve.kv_transfer.tcp import TcpKVReceiver


@pytest.fixture
def outcomes() -> Outcomes:
    return Outcomes()


@pytest.fixture
async def receiver(outcomes: Outcomes) -> AsyncIterator[TcpKVReceiver]:
    receiver = await start_receiver(outcomes)
    yield receiver
    await receiver.close()
