"""The reference upstream's chat template: faithful where prompt caching cares."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.sim.render import (
    IM_END,
    IM_START,
    generation_prompt_segments,
    get_encoding,
    message_segments,
    render,
    render_tokens,
    reply_segments,
)
from tests.sim.conftest import SEARCH_TOOL, WEATHER_TOOL


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant_call(arguments: str, **extra: Any) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call], **extra}


def test_encoding_is_offline_cl100k_and_loaded_once() -> None:
    assert get_encoding() is get_encoding()
    assert get_encoding().encode_ordinary("hello world") == [15339, 1917]


def test_string_and_one_text_part_render_the_same() -> None:
    as_string = [user("Hello  there\n")]
    as_part = [user([{"type": "text", "text": "Hello  there\n"}])]
    as_part_with_cache_control = [
        user([{"type": "text", "text": "Hello  there\n", "cache_control": {"type": "ephemeral"}}])
    ]
    expected = render_tokens(as_string, None)
    assert render_tokens(as_part, None) == expected
    assert render_tokens(as_part_with_cache_control, None) == expected
    assert render_tokens([user("Hello there\n")], None) != expected


def test_null_empty_and_transport_fields_render_nothing() -> None:
    bare = [user("hi"), assistant_call('{"a":1}')]
    noisy = copy.deepcopy(bare)
    noisy[0].update(name=None, audio=None)
    noisy[1].update(refusal=None, annotations=[], audio=None, function_call=None, name="")
    noisy[1]["tool_calls"][0]["index"] = 0
    noisy[1]["content"] = ""
    assert render_tokens(noisy, None) == render_tokens(bare, None)
    assert render_tokens(bare, []) == render_tokens(bare, None)
    assert render_tokens([user(None)], None) == render_tokens([user([])], None)
    assert render_tokens([user(None)], None) == render_tokens([user("")], None)


def test_argument_strings_render_raw() -> None:
    compact = render_tokens([user("x"), assistant_call('{"a":1,"b":"é"}')], None)
    spaced = render_tokens([user("x"), assistant_call('{"a": 1, "b": "é"}')], None)
    reordered = render_tokens([user("x"), assistant_call('{"b":"é","a":1}')], None)
    escaped = render_tokens([user("x"), assistant_call('{"a":1,"b":"\\u00e9"}')], None)
    assert len({tuple(compact), tuple(spaced), tuple(reordered), tuple(escaped)}) == 4
    assert '{"name": "f", "arguments": {"a":1,"b":"é"}}' in render(
        [assistant_call('{"a":1,"b":"é"}')], None
    )


def test_whitespace_and_trailing_newline_matter() -> None:
    base = render_tokens([user("x"), {"role": "assistant", "content": "Done.\n"}], None)
    stripped = render_tokens([user("x"), {"role": "assistant", "content": "Done."}], None)
    padded = render_tokens([user(" x"), {"role": "assistant", "content": "Done.\n"}], None)
    assert base != stripped
    assert base != padded


def test_tool_order_and_schema_key_order_change_tokens() -> None:
    messages = [user("weather?")]
    base = render_tokens(messages, [WEATHER_TOOL, SEARCH_TOOL])
    assert render_tokens(messages, copy.deepcopy([WEATHER_TOOL, SEARCH_TOOL])) == base
    assert render_tokens(messages, [SEARCH_TOOL, WEATHER_TOOL]) != base

    shuffled = copy.deepcopy(WEATHER_TOOL)
    properties = shuffled["function"]["parameters"]["properties"]
    shuffled["function"]["parameters"]["properties"] = dict(reversed(properties.items()))
    assert shuffled == WEATHER_TOOL  # equal as Python values: only the key order differs
    assert render_tokens(messages, [shuffled, SEARCH_TOOL]) != base


def test_tools_render_first_one_per_line_in_client_key_order() -> None:
    text = render(
        [{"role": "system", "content": "You are terse."}, user("hi")], [WEATHER_TOOL, SEARCH_TOOL]
    )
    assert text.startswith("<|im_start|>system\n# Tools")
    assert text.index("get_weather") < text.index("You are terse.")
    lines = text.split("\n")
    tool_lines = [line for line in lines if line.startswith('{"type":"function"')]
    assert len(tool_lines) == 2
    assert tool_lines[0].startswith(
        '{"type":"function","function":{"name":"get_weather","description"'
    )
    assert '"properties":{"city":{"type":"string"},"days":' in tool_lines[0]
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_reasoning_renders_in_think_block() -> None:
    with_reasoning = {
        "role": "assistant",
        "content": "42\n",
        "reasoning_content": "Six times seven.",
    }
    text = render([user("q"), with_reasoning], None, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\nSix times seven.\n</think>\n\n42\n<|im_end|>" in text
    without = {"role": "assistant", "content": "42\n"}
    assert render_tokens([user("q"), without], None) != render_tokens(
        [user("q"), with_reasoning], None
    )


def test_multi_part_content_concatenates_text_and_marks_images() -> None:
    parts = [
        {"type": "text", "text": "Look at "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": " please."},
    ]
    assert "<|im_start|>user\nLook at <image> please.<|im_end|>" in render([user(parts)], None)
    other_image = copy.deepcopy(parts)
    other_image[1]["image_url"]["url"] = "https://example.com/cat.png"
    assert render_tokens([user(parts)], None) == render_tokens([user(other_image)], None)


def test_special_tokens_are_ids_and_lookalike_text_is_plain() -> None:
    tokens = render_tokens([user("<|im_start|> and <|endoftext|>")], None)
    assert tokens.count(IM_START) == 2  # the user block and the generation prompt
    assert tokens.count(IM_END) == 1
    assert 100257 not in tokens  # <|endoftext|> in a text stays text


def test_prompt_tokens_extend_the_previous_turn() -> None:
    first = [{"role": "system", "content": "Be brief."}, user("Hi!")]
    reply = {"role": "assistant", "content": "Hello! How can I help?\n"}
    second = [*first, reply, user("Weather?")]
    prompt1 = render_tokens(first, [WEATHER_TOOL])
    prompt2 = render_tokens(second, [WEATHER_TOOL])
    assert prompt2[: len(prompt1)] == prompt1
    # The generation prompt plus the reply's tail is the reply as echoed in history.
    assert generation_prompt_segments() + reply_segments(reply) == message_segments(reply)
    history = render_tokens([*first, reply], [WEATHER_TOOL], add_generation_prompt=False)
    assert prompt2[: len(history)] == history


@pytest.mark.parametrize(
    "message",
    [
        {"content": "no role"},
        {"role": "user", "content": {"text": "a dict"}},
        {"role": "user", "content": [42]},
        {"role": "assistant", "tool_calls": "not a list"},
        "not an object",
    ],
)
def test_unrenderable_messages_raise_value_error(message: Any) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        render([user("ok"), message], None)
