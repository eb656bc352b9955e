"""The generated reply, assembled exactly from a body or from stream deltas."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core.record import Reply, ReplyAssembler, reply_from_body
from proxy.core.sse import SSEDecoder

# Argument strings as generated: non-ASCII, escaped quotes and backslashes, odd spacing.
ARGS_A = '{"path": "src/m\\u00e9moire.py", "pattern": "say \\"hi\\"\\\\n",  "n":1.0}'
ARGS_B = '{ "cmd" : "echo \\"€\\" > /tmp/x\\tdone" }'


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-AZ9",
        "object": "chat.completion.chunk",
        "created": 1741569952,
        "model": "gpt-4.1-2025-04-14",
        "choices": [
            {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        ],
    }


def sse(chunks: list[dict[str, Any]], done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def assemble_stream(stream: bytes) -> Reply | None:
    """The proxy's side path: SSE bytes -> events -> parsed chunks -> assembler."""
    decoder = SSEDecoder()
    assembler = ReplyAssembler()
    for event in [*decoder.feed(stream), *decoder.flush()]:
        if event.data is None:
            continue
        if event.data == "[DONE]":
            assembler.done()
        else:
            assembler.feed(json.loads(event.data))
    return assembler.result()


def tool_call_stream() -> list[dict[str, Any]]:
    """Content, then two parallel tool calls whose argument fragments interleave,
    split inside escapes (between a backslash and the character it escapes)."""
    a_cut = ARGS_A.index('\\"hi') + 1  # after the backslash of \"
    b_cut = ARGS_B.index('\\"€') + 1
    return [
        chunk({"role": "assistant", "content": "", "refusal": None}),
        chunk({"content": "Let me look"}),
        chunk({"content": " \u00e0 la fois.\n"}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_Ab1",
                        "type": "function",
                        "function": {"name": "grep", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGS_A[:a_cut]}}]}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_Cd2",
                        "type": "function",
                        "function": {"name": "shell", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": ARGS_B[:b_cut]}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGS_A[a_cut:]}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": ARGS_B[b_cut:]}}]}),
        chunk({}, finish="tool_calls"),
    ]


EXPECTED_TOOL_MESSAGE = {
    "role": "assistant",
    "content": "Let me look \u00e0 la fois.\n",
    "tool_calls": [
        {"id": "call_Ab1", "type": "function", "function": {"name": "grep", "arguments": ARGS_A}},
        {"id": "call_Cd2", "type": "function", "function": {"name": "shell", "arguments": ARGS_B}},
    ],
}


def test_streamed_content_and_parallel_tool_calls_are_exact() -> None:
    reply = assemble_stream(sse(tool_call_stream()))
    assert reply == Reply(
        message=EXPECTED_TOOL_MESSAGE,
        finish_reason="tool_calls",
        partial=False,
        model="gpt-4.1-2025-04-14",
    )
    # Exact bytes, not just equal values: serialization of the stored reply is what is restored.
    assert json.dumps(reply.message["tool_calls"]) == json.dumps(
        EXPECTED_TOOL_MESSAGE["tool_calls"]
    )


def test_streamed_reply_matches_the_same_reply_from_a_body() -> None:
    body = {
        "id": "chatcmpl-AZ9",
        "object": "chat.completion",
        "model": "gpt-4.1-2025-04-14",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Let me look \u00e0 la fois.\n",
                    "refusal": None,
                    "annotations": [],
                    "tool_calls": [
                        {
                            "id": "call_Ab1",
                            "type": "function",
                            "function": {"name": "grep", "arguments": ARGS_A},
                        },
                        {
                            "index": 1,
                            "id": "call_Cd2",
                            "type": "function",
                            "function": {"name": "shell", "arguments": ARGS_B},
                        },
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
    from_body = reply_from_body(body)
    from_stream = assemble_stream(sse(tool_call_stream()))
    assert from_body == from_stream


def test_body_plain_content_and_reasoning() -> None:
    body = {
        "model": "deepseek-reasoner",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "  42\n",
                    "reasoning_content": "Think: 6*7.",
                },
                "finish_reason": "stop",
            }
        ],
    }
    assert reply_from_body(body) == Reply(
        message={"role": "assistant", "content": "  42\n", "reasoning_content": "Think: 6*7."},
        finish_reason="stop",
        partial=False,
        model="deepseek-reasoner",
    )


def test_body_without_choices_or_message() -> None:
    assert reply_from_body({"choices": []}) is None
    assert reply_from_body({"error": {"message": "nope"}}) is None
    assert reply_from_body({"choices": [{"index": 0, "message": "x"}]}) is None
    assert reply_from_body([]) is None  # type: ignore[arg-type]


def test_streamed_reasoning_both_spellings_and_whitespace_kept() -> None:
    chunks = [
        chunk({"role": "assistant", "content": None, "reasoning_content": ""}),
        chunk({"reasoning_content": "Let me"}),
        chunk({"reasoning_content": " think.\n\n", "reasoning": "r1"}),
        chunk({"content": "\n\nAnswer: "}),
        chunk({"content": "yes  "}),
        chunk({"reasoning": "r2"}, finish="stop"),
    ]
    reply = assemble_stream(sse(chunks))
    assert reply is not None
    assert reply.message == {
        "role": "assistant",
        "content": "\n\nAnswer: yes  ",
        "reasoning_content": "Let me think.\n\n",
        "reasoning": "r1r2",
    }


def test_interrupted_stream_is_partial_with_what_was_delivered() -> None:
    chunks = tool_call_stream()[:5]  # cut in the middle of the first tool call's arguments
    reply = assemble_stream(sse(chunks, done=False))
    assert reply is not None
    assert reply.partial is True and reply.finish_reason is None
    assert reply.message["content"] == "Let me look \u00e0 la fois.\n"
    assert (
        reply.message["tool_calls"][0]["function"]["arguments"]
        == ARGS_A[: ARGS_A.index('\\"hi') + 1]
    )


def test_done_after_an_error_chunk_is_still_partial() -> None:
    # vLLM sends an error object and then [DONE] when generation fails mid-stream.
    stream = sse([chunk({"role": "assistant", "content": "Hal"})], done=False)
    stream += b'data: {"error": {"message": "engine died", "code": 500}}\n\ndata: [DONE]\n\n'
    reply = assemble_stream(stream)
    assert reply is not None and reply.partial and reply.message["content"] == "Hal"


def test_nothing_assembled_is_none() -> None:
    assembler = ReplyAssembler()
    assert assembler.result() is None
    assembler.feed(
        {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 3}}
    )
    assembler.feed(chunk({"role": "assistant"}))
    assembler.done()
    assert assembler.result() is None
    assert assembler.saw_done


def test_empty_generation_with_finish_is_a_reply() -> None:
    assembler = ReplyAssembler()
    assembler.feed(chunk({"role": "assistant", "content": ""}))
    assembler.feed(chunk({}, finish="length"))
    assert assembler.result() == Reply(
        message={"role": "assistant", "content": ""},
        finish_reason="length",
        partial=False,
        model="gpt-4.1-2025-04-14",
    )


def test_other_choices_are_ignored() -> None:
    assembler = ReplyAssembler()
    assembler.feed(chunk({"content": "zero"}, index=0))
    assembler.feed(chunk({"content": "ONE"}, index=1))
    assembler.feed(
        chunk({"tool_calls": [{"index": 0, "id": "x", "function": {"name": "n"}}]}, index=1)
    )
    assembler.feed(chunk({}, finish="stop", index=0))
    reply = assembler.result()
    assert reply is not None and reply.message == {"role": "assistant", "content": "zero"}


def test_tool_calls_come_out_in_index_order() -> None:
    assembler = ReplyAssembler()
    assembler.feed(
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "b",
                        "type": "function",
                        "function": {"name": "second", "arguments": "{}"},
                    }
                ]
            }
        )
    )
    assembler.feed(
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "a",
                        "type": "function",
                        "function": {"name": "first", "arguments": "{}"},
                    }
                ]
            }
        )
    )
    assembler.feed(chunk({}, finish="tool_calls"))
    reply = assembler.result()
    assert reply is not None
    assert [c["id"] for c in reply.message["tool_calls"]] == ["a", "b"]
    assert reply.message["content"] is None
    assert all("index" not in c for c in reply.message["tool_calls"])


def test_tool_calls_without_index_and_repeated_names() -> None:
    # Some OpenAI-compatible servers omit `index` and repeat id/name on every delta.
    assembler = ReplyAssembler()
    assembler.feed(
        chunk(
            {
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a":'},
                    }
                ]
            }
        )
    )
    assembler.feed(
        chunk({"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": " 1}"}}]})
    )
    assembler.feed(
        chunk(
            {
                "tool_calls": [
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
                ]
            }
        )
    )
    assembler.feed(chunk({}, finish="tool_calls"))
    reply = assembler.result()
    assert reply is not None
    assert reply.message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


_piece_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def _fragments(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces, last = [], 0
    for cut in cuts:
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    return pieces


@st.composite
def generations(draw: st.DrawFn) -> tuple[str, list[str], list[dict[str, Any]]]:
    content = draw(_piece_text)
    arguments = [
        json.dumps(
            draw(st.dictionaries(st.text(max_size=5), _piece_text, max_size=3)),
            ensure_ascii=draw(st.booleans()),
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": piece} for piece in _fragments(draw, content)]
    for i, args in enumerate(arguments):
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": f"t{i}", "arguments": ""},
                    }
                ]
            }
        )
        deltas += [
            {"tool_calls": [{"index": i, "function": {"arguments": p}}]}
            for p in _fragments(draw, args)
        ]
    return content, arguments, deltas


@settings(max_examples=200, deadline=None)
@given(generation=generations(), cuts=st.lists(st.integers(0, 5000), max_size=10))
def test_assembly_is_exact_for_any_fragmentation_and_any_transport_split(
    generation: tuple[str, list[str], list[dict[str, Any]]], cuts: list[int]
) -> None:
    content, arguments, deltas = generation
    stream = sse([chunk(d) for d in deltas] + [chunk({}, finish="stop")])
    decoder = SSEDecoder()
    assembler = ReplyAssembler()
    last = 0
    events = []
    for cut in [*sorted(c for c in cuts if c < len(stream)), len(stream)]:
        events += decoder.feed(stream[last:cut])
        last = max(last, cut)
    events += decoder.flush()
    for event in events:
        if event.data and event.data != "[DONE]":
            assembler.feed(json.loads(event.data))
    reply = assembler.result()
    assert reply is not None and not reply.partial
    assert reply.message["content"] == content
    calls = reply.message.get("tool_calls", [])
    assert [c["function"]["arguments"] for c in calls] == arguments


_odd = st.sampled_from([None, 0, 1, False, True, 0.0, "", "stop", "x", [], {}])
_delta = st.one_of(
    st.fixed_dictionaries({"content": st.one_of(_piece_text, _odd)}),
    st.dictionaries(st.sampled_from(["content", "role", "reasoning_content", "reasoning", "refusal"]), st.one_of(_piece_text, _odd), max_size=3),
    st.fixed_dictionaries({"tool_calls": st.just([{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}])}),
    _odd,
)
_choice = st.one_of(
    st.fixed_dictionaries({"index": st.just(0), "delta": _delta}),
    st.fixed_dictionaries({"delta": _delta}, optional={"index": _odd, "finish_reason": _odd}),
    _odd,
)
_chunk = st.fixed_dictionaries(
    {"choices": st.one_of(st.lists(_choice, max_size=2), _odd)}, optional={"model": st.sampled_from(["m", "m", "m", "", None, 3])}
)
_FIRST = {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


@settings(max_examples=500, deadline=None)
@example(chunks=[_FIRST, {"choices": [{"index": False, "delta": {"content": "x"}}]}])
@example(chunks=[_FIRST, {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}])
@example(chunks=[_FIRST, {"choices": [{"index": 1, "delta": {"content": "x"}}]}])
@example(chunks=[_FIRST, {"choices": [{"index": 0, "delta": {"content": "x", "reasoning_content": "y"}}]}])
@given(chunks=st.lists(_chunk, max_size=8))
def test_a_tokens_short_path_assembles_what_the_general_path_does(chunks: list[dict[str, Any]]) -> None:
    """A model's token (one choice, a text-only delta) is read in a few dict reads: any chunks,
    odd ones included, assemble to the reply the general reading gives."""
    fast, general = ReplyAssembler(), ReplyAssembler()
    for c in chunks:
        fast.feed(c)
        general._feed(c)
    assert fast.result() == general.result()


def test_the_tokens_short_path_is_taken() -> None:
    """It must be able to fail: a token after the first chunk never reaches the general reading."""
    class TokensOnly(ReplyAssembler):
        __slots__ = ()

        def _feed(self, chunk: Any) -> None:
            raise AssertionError(f"the general reading got {chunk}")

    assembler = TokensOnly()
    ReplyAssembler._feed(assembler, {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assembler.feed({"model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    assert assembler._content == ["", "Hi"]
