from __future__ import annotations

import json

import pytest

from pdserve.kv_transfer.target import TransferTarget


def make_target(**overrides: object) -> TransferTarget:
    fields: dict[str, object] = {
        "backend": "tcp", "request_id": "r1", "block_ids": (4, 2, 7), "num_layers": 2, "block_size": 16,
        "dtype": "bfloat16", "host": "10.0.0.2", "port": 7100,
    }
    fields.update(overrides)
    return TransferTarget(**fields)  # type: ignore[arg-type]


def test_json_round_trip() -> None:
    target = make_target()
    assert TransferTarget.from_dict(json.loads(json.dumps(target.to_dict()))) == target
    local = make_target(backend="local", host=None, port=None)
    assert TransferTarget.from_dict(json.loads(json.dumps(local.to_dict()))) == local
    assert target.address == ("10.0.0.2", 7100)
    with pytest.raises(ValueError, match="no network address"):
        local.address  # noqa: B018


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("block_ids", "1,2", "block_ids"),
        ("block_ids", [1, -2], "non-negative"),
        ("block_ids", [1, True], "non-negative"),
        ("num_layers", "2", "num_layers"),
        ("port", "7100", "address"),
        ("request_id", None, "request_id"),
    ],
)
def test_from_dict_rejects_bad_fields(key: str, value: object, message: str) -> None:
    data = make_target().to_dict()
    data[key] = value
    with pytest.raises(ValueError, match=message):
        TransferTarget.from_dict(data)


def test_invariants() -> None:
    with pytest.raises(ValueError, match="no blocks"):
        make_target(block_ids=())
    with pytest.raises(ValueError, match="host and port go together"):
        make_target(port=None)
