"""Token-stream frame decoding: any chunking of the byte stream gives the same frames."""

from __future__ import annotations

import struct

import pytest

from pdserve.router.frames import MAX_FRAME_BYTES, FrameDecoder, encode_frame


def _frame(i: int, finish: str | None = None) -> dict:
    return {"token_ids": [i], "text": f"t{i}é", "finish_reason": finish, "logprobs": None, "prompt_tokens": 3,
            "completion_tokens": i + 1, "cached_tokens": 0, "error": None}


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_frames_survive_any_chunking(chunk_size: int) -> None:
    stream = b"".join(encode_frame(_frame(i, "stop" if i == 4 else None)) for i in range(5))
    decoder = FrameDecoder()
    frames = [f for start in range(0, len(stream), chunk_size) for f in decoder.feed(stream[start:start + chunk_size])]
    assert [f.token_ids for f in frames] == [[i] for i in range(5)]
    assert frames[1].text == "t1é" and frames[4].finish_reason == "stop" and frames[4].completion_tokens == 5
    assert decoder.pending_bytes == 0


def test_missing_fields_default_and_partial_frames_wait() -> None:
    decoder = FrameDecoder()
    data = encode_frame({"token_ids": [1], "text": "a"})
    assert decoder.feed(data[:-1]) == [] and decoder.pending_bytes == len(data) - 1
    (frame,) = decoder.feed(data[-1:])
    assert (frame.finish_reason, frame.logprobs, frame.error, frame.cached_tokens) == (None, None, None, 0)


def test_corrupt_length_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        FrameDecoder().feed(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x")
