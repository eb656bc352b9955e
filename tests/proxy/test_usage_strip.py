"""Removing the ``"usage": null`` members kvwarm caused, byte for byte, and nothing else."""

from __future__ import annotations

import orjson
import pytest

from proxy.wire.chat import without_null_usage


def chunk_of(raw: bytes) -> dict[str, object]:
    data = b"\n".join(line[5:].lstrip() for line in raw.splitlines() if line.startswith(b"data:"))
    value: dict[str, object] = orjson.loads(data)
    return value


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # the common shape: last member of a one-line object (fast path)
        (b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}\n\n',
         b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'),
        (b'data: {"id":"c","choices":[],"usage":null}\r\n\r\n', b'data: {"id":"c","choices":[]}\r\n\r\n'),
        # elsewhere in the object, with spaces (regex path, verified by parsing)
        (b'data: {"id": "c", "usage": null, "choices": []}\n\n', b'data: {"id": "c", "choices": []}\n\n'),
        (b'data: {"usage":null,"id":"c","choices":[]}\n\n', b'data: {"id":"c","choices":[]}\n\n'),
    ],
)
def test_top_level_null_usage_is_removed_exactly(raw: bytes, expected: bytes) -> None:
    assert without_null_usage(raw, chunk_of(raw)) == expected


def test_a_nested_usage_is_never_touched() -> None:
    raw = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x","usage":null}}],"usage":null}\n\n'
    out = without_null_usage(raw, chunk_of(raw))
    assert out == b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x","usage":null}}]}\n\n'
    only_nested = b'data: {"id":"c","choices":[{"index":0,"delta":{"usage":null,"content":"x"}}],"usage":null,"x":1}\n\n'
    out = without_null_usage(only_nested, chunk_of(only_nested))
    assert out is None or orjson.loads(out[6:]) == {k: v for k, v in chunk_of(only_nested).items() if k != "usage"}


def test_a_string_containing_the_bytes_is_not_a_member() -> None:
    raw = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"say ,\\"usage\\":null}"}}],"usage":null}\n\n'
    out = without_null_usage(raw, chunk_of(raw))
    assert isinstance(out, bytes)
    assert orjson.loads(out[6:]) == {k: v for k, v in chunk_of(raw).items() if k != "usage"}
