"""Usage extraction from every shape kvwarm meets, with unknown kept apart from zero."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.core.usage import Usage, extract_usage, is_usage_only_chunk, merge_usage

OPENAI_BODY: dict[str, Any] = {
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "object": "chat.completion",
    "created": 1741569952,
    "model": "gpt-4o-2024-08-06",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi.", "refusal": None, "annotations": []},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 2006,
        "completion_tokens": 300,
        "total_tokens": 2306,
        "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 64,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    },
    "service_tier": "default",
    "system_fingerprint": "fp_fc9f1d7035",
}

OPENAI_USAGE_CHUNK: dict[str, Any] = {
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "object": "chat.completion.chunk",
    "created": 1741569952,
    "model": "gpt-4o-mini-2024-07-18",
    "system_fingerprint": "fp_06737a9306",
    "choices": [],
    "usage": {
        "prompt_tokens": 1337,
        "completion_tokens": 12,
        "total_tokens": 1349,
        "prompt_tokens_details": {"cached_tokens": 1152, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    },
}

OPENAI_CONTENT_CHUNK: dict[str, Any] = {
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "object": "chat.completion.chunk",
    "created": 1741569952,
    "model": "gpt-4o-mini-2024-07-18",
    "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}],
    "usage": None,
}


def test_openai_body() -> None:
    assert extract_usage(OPENAI_BODY) == Usage(
        prompt_tokens=2006,
        completion_tokens=300,
        cached_tokens=1920,
        cache_write_tokens=None,
        reasoning_tokens=64,
        billed_usd=None,
        source="openai",
    )


def test_openai_final_stream_chunk_is_usage_only() -> None:
    usage = extract_usage(OPENAI_USAGE_CHUNK)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (1337, 12, 1152)
    assert usage.reasoning_tokens == 0
    assert is_usage_only_chunk(OPENAI_USAGE_CHUNK)


def test_content_chunk_has_no_usage_and_is_not_usage_only() -> None:
    assert extract_usage(OPENAI_CONTENT_CHUNK) is None
    assert not is_usage_only_chunk(OPENAI_CONTENT_CHUNK)


def test_is_usage_only_chunk_edges() -> None:
    assert not is_usage_only_chunk({**OPENAI_USAGE_CHUNK, "usage": None})
    assert not is_usage_only_chunk({**OPENAI_USAGE_CHUNK, "usage": {}})
    assert not is_usage_only_chunk({**OPENAI_USAGE_CHUNK, "object": "chat.completion"})
    assert not is_usage_only_chunk({"usage": {"prompt_tokens": 1}})  # no choices key at all
    assert not is_usage_only_chunk(
        {**OPENAI_USAGE_CHUNK, "choices": [OPENAI_CONTENT_CHUNK["choices"][0]]}
    )
    assert is_usage_only_chunk({"choices": [], "usage": {"prompt_tokens": 1}})  # object omitted
    assert not is_usage_only_chunk([])  # type: ignore[arg-type]


def test_openai_without_cache_details_is_unknown_not_zero() -> None:
    # vLLM without --enable-prompt-tokens-details, and most local servers.
    body = {
        "usage": {
            "prompt_tokens": 812,
            "total_tokens": 840,
            "completion_tokens": 28,
            "prompt_tokens_details": None,
        }
    }
    usage = extract_usage(body)
    assert usage is not None
    assert usage.prompt_tokens == 812
    assert usage.cached_tokens is None
    assert usage.reasoning_tokens is None
    assert usage.source == "openai"


def test_openhuman_blocks_win_and_bill() -> None:
    body = {
        **OPENAI_BODY,
        "openhuman": {
            "usage": {
                "input_tokens": 5000,
                "output_tokens": 1200,
                "total_tokens": 6200,
                "cached_input_tokens": 3500,
            },
            "billing": {"charged_amount_usd": 0.0045, "currency": "USD"},
        },
    }
    usage = extract_usage(body)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (5000, 1200, 3500)
    assert usage.billed_usd == 0.0045
    assert usage.source == "openhuman"
    assert usage.reasoning_tokens == 64  # only the standard block reports it


def test_openhuman_missing_field_falls_back_to_standard_usage() -> None:
    body = {**OPENAI_BODY, "openhuman": {"usage": {"input_tokens": 2006}, "billing": {}}}
    usage = extract_usage(body)
    assert usage is not None
    assert usage.cached_tokens == 1920 and usage.source == "openai"
    assert usage.completion_tokens == 300
    assert usage.billed_usd is None


def test_openhuman_billing_alone_is_usage() -> None:
    usage = extract_usage({"openhuman": {"billing": {"charged_amount_usd": 0.12}}})
    assert usage == Usage(billed_usd=0.12)


def test_anthropic_style_normalizes_prompt_to_include_cache_reads_and_writes() -> None:
    body = {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "model": "claude-sonnet-4-20250514",
        "usage": {
            "input_tokens": 50,
            "cache_creation_input_tokens": 248,
            "cache_read_input_tokens": 10000,
            "output_tokens": 503,
            "service_tier": "standard",
        },
    }
    assert extract_usage(body) == Usage(
        prompt_tokens=10298,
        completion_tokens=503,
        cached_tokens=10000,
        cache_write_tokens=248,
        reasoning_tokens=None,
        billed_usd=None,
        source="anthropic",
    )


def test_anthropic_fields_next_to_openai_prompt_tokens_do_not_double_count() -> None:
    # A router (LiteLLM-style) that reports OpenAI totals and Anthropic cache fields.
    body = {
        "usage": {
            "prompt_tokens": 10298,
            "completion_tokens": 503,
            "cache_read_input_tokens": 10000,
            "cache_creation_input_tokens": 248,
        }
    }
    usage = extract_usage(body)
    assert usage is not None
    assert usage.prompt_tokens == 10298
    assert (usage.cached_tokens, usage.cache_write_tokens, usage.source) == (
        10000,
        248,
        "anthropic",
    )


def test_responses_api_input_tokens_include_cached() -> None:
    body = {
        "usage": {
            "input_tokens": 3000,
            "input_tokens_details": {"cached_tokens": 2048},
            "output_tokens": 100,
            "output_tokens_details": {"reasoning_tokens": 40},
            "total_tokens": 3100,
        }
    }
    usage = extract_usage(body)
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.reasoning_tokens) == (3000, 2048, 40)


def test_deepseek() -> None:
    body = {
        "id": "930c60df-bf64-41c9-a88e-3ec75f81e00e",
        "object": "chat.completion",
        "model": "deepseek-reasoner",
        "usage": {
            "prompt_tokens": 1500,
            "completion_tokens": 120,
            "total_tokens": 1620,
            "prompt_tokens_details": {"cached_tokens": 1280},
            "completion_tokens_details": {"reasoning_tokens": 80},
            "prompt_cache_hit_tokens": 1280,
            "prompt_cache_miss_tokens": 220,
        },
    }
    assert extract_usage(body) == Usage(
        prompt_tokens=1500, completion_tokens=120, cached_tokens=1280, reasoning_tokens=80, source="deepseek"
    )


def test_deepseek_prompt_from_hit_and_miss() -> None:
    usage = extract_usage(
        {
            "usage": {
                "completion_tokens": 5,
                "prompt_cache_hit_tokens": 64,
                "prompt_cache_miss_tokens": 9,
            }
        }
    )
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.source) == (73, 64, "deepseek")


def test_openrouter_cost_and_cache_writes() -> None:
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": 194,
            "completion_tokens": 2,
            "total_tokens": 196,
            "cost": 0.00095,
            "is_byok": False,
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "cache_write_tokens": 100,
                "audio_tokens": 0,
            },
            "cost_details": {"upstream_inference_cost": None},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    usage = extract_usage(chunk)
    assert usage is not None
    assert usage.billed_usd == 0.00095
    assert usage.cached_tokens == 0  # reported zero is a known zero
    assert usage.cache_write_tokens == 100
    byok = extract_usage({**chunk, "usage": {**chunk["usage"], "is_byok": True}})
    assert byok is not None and byok.billed_usd is None


LLAMACPP_TIMINGS = {
    "cache_n": 1000,
    "prompt_n": 24,
    "prompt_ms": 30.512,
    "prompt_per_token_ms": 1.271,
    "prompt_per_second": 786.6,
    "predicted_n": 12,
    "predicted_ms": 120.25,
    "predicted_per_token_ms": 10.02,
    "predicted_per_second": 99.8,
}


def test_llamacpp_body_with_timings() -> None:
    body = {
        "choices": [
            {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "ok"}}
        ],
        "created": 1735689600,
        "model": "SmolLM2-135M-Instruct",
        "object": "chat.completion",
        "usage": {"completion_tokens": 12, "prompt_tokens": 1024, "total_tokens": 1036},
        "timings": LLAMACPP_TIMINGS,
    }
    usage = extract_usage(body)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (1024, 12, 1000)
    assert usage.source == "llamacpp"
    assert usage.timings is not None and usage.timings["prompt_ms"] == 30.512


def test_llamacpp_stream_usage_split_across_chunks_merges() -> None:
    finish_chunk = {
        "choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
        "object": "chat.completion.chunk",
        "timings": LLAMACPP_TIMINGS,
    }
    usage_chunk = {
        "choices": [],
        "object": "chat.completion.chunk",
        "usage": {"completion_tokens": 12, "prompt_tokens": 1024, "total_tokens": 1036},
    }
    first = extract_usage(finish_chunk)
    assert first is not None
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (1024, 12, 1000)
    second = extract_usage(usage_chunk)
    assert second is not None and second.cached_tokens is None
    merged = merge_usage(first, second)
    assert merged is not None
    assert (merged.prompt_tokens, merged.completion_tokens, merged.cached_tokens) == (
        1024,
        12,
        1000,
    )
    assert merged.source == "llamacpp"
    assert merged.timings == {k: float(v) for k, v in LLAMACPP_TIMINGS.items()}


def test_timings_without_cache_n_leave_cache_unknown() -> None:
    usage = extract_usage({"timings": {"prompt_n": 24, "predicted_n": 3, "prompt_ms": 1.0}})
    assert usage is not None
    assert usage.cached_tokens is None
    assert usage.prompt_tokens is None  # prompt_n alone is only the uncached part
    assert usage.completion_tokens == 3


def test_merge_later_known_fields_win() -> None:
    a = Usage(prompt_tokens=100, cached_tokens=50, cache_write_tokens=10, cache_write_5m_tokens=10, source="deepseek",
              timings={"cache_n": 1.0, "prompt_n": 2.0})
    b = Usage(prompt_tokens=120, completion_tokens=7, cache_write_tokens=13, cache_write_1h_tokens=3, reasoning_tokens=2,
              billed_usd=0.5, source="openai", timings={"prompt_n": 9.0})
    merged = merge_usage(a, b)
    assert merged == Usage(prompt_tokens=120, completion_tokens=7, cached_tokens=50, cache_write_tokens=13,
                           cache_write_5m_tokens=10, cache_write_1h_tokens=3, reasoning_tokens=2, billed_usd=0.5,
                           source="deepseek", timings={"cache_n": 1.0, "prompt_n": 9.0})
    assert merge_usage(None, b) is b and merge_usage(a, None) is a
    assert merge_usage(None, None) is None
    c = Usage(prompt_tokens=1, completion_tokens=1, cached_tokens=0)
    merged_c = merge_usage(a, c)
    assert merged_c is not None and (merged_c.cached_tokens, merged_c.source) == (0, "openai")


def test_garbage_fields_are_ignored_one_by_one() -> None:
    body = {
        "usage": {
            "prompt_tokens": "2006",
            "completion_tokens": -5,
            "prompt_tokens_details": {"cached_tokens": True},
            "completion_tokens_details": ["reasoning_tokens", 3],
            "cache_read_input_tokens": math.nan,
            "prompt_cache_hit_tokens": 1.5,
        },
        "openhuman": {"usage": "lots", "billing": {"charged_amount_usd": "0.01"}},
        "timings": [1, 2],
    }
    assert extract_usage(body) is None
    body["usage"]["output_tokens"] = 7.0  # an integral float is a count
    usage = extract_usage(body)
    assert usage == Usage(completion_tokens=7)
    assert extract_usage({"openhuman": {"billing": {"charged_amount_usd": -1}}}) is None
    assert extract_usage({"openhuman": {"billing": {"charged_amount_usd": math.inf}}}) is None
    assert extract_usage({"timings": {"cache_n": math.nan, "prompt_n": False}}) is None


def test_non_mapping_inputs_do_not_raise() -> None:
    for obj in ([], "usage", None, 3, {"usage": [1, 2]}, {"usage": None}, {"openhuman": "x"}, {}):
        assert extract_usage(obj) is None  # type: ignore[arg-type]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "usage",
                    "prompt_tokens",
                    "completion_tokens",
                    "prompt_tokens_details",
                    "cached_tokens",
                    "input_tokens",
                    "output_tokens",
                    "cache_read_input_tokens",
                    "cache_creation_input_tokens",
                    "cache_creation",
                    "ephemeral_5m_input_tokens",
                    "ephemeral_1h_input_tokens",
                    "input_tokens_details",
                    "cache_write_tokens",
                    "cache_write_tokens_details",
                    "ttl_30m_tokens",
                    "ttl_12h_tokens",
                    "openhuman",
                    "billing",
                    "charged_amount_usd",
                    "cached_input_tokens",
                    "timings",
                    "cache_n",
                    "prompt_n",
                    "cost",
                    "choices",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(obj=_json)
def test_never_raises_and_counts_are_sane(obj: Any) -> None:
    for candidate in (obj, {"usage": obj}, {"openhuman": {"usage": obj}}, {"timings": obj}):
        usage = extract_usage(candidate)
        is_usage_only_chunk(candidate)
        if usage is None:
            continue
        for value in (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
            usage.cache_write_tokens,
            usage.cache_write_5m_tokens,
            usage.cache_write_1h_tokens,
            usage.cache_write_30m_tokens,
            usage.cache_write_12h_tokens,
            usage.reasoning_tokens,
        ):
            assert value is None or (type(value) is int and value >= 0)
        writes = usage.writes_by_ttl()
        assert (usage.cache_write_tokens is None) == (writes == [])
        assert sum(n for _, n in writes) == (usage.cache_write_tokens or 0)
        assert usage.billed_usd is None or (
            math.isfinite(usage.billed_usd) and usage.billed_usd >= 0
        )
        assert usage.source in {"openai", "openhuman", "anthropic", "deepseek", "llamacpp"}


_count_value = st.one_of(
    st.integers(min_value=-3, max_value=10**12), st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3)
)


def _block(keys: list[str], values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys), values, max_size=len(keys))


_plain_count = st.one_of(st.integers(min_value=-1, max_value=10**6), _count_value)
_openai_like = st.fixed_dictionaries(
    {"prompt_tokens": _plain_count, "completion_tokens": _plain_count},
    optional={
        "total_tokens": _plain_count,
        "prompt_tokens_details": st.one_of(
            _block(["cached_tokens", "cache_write_tokens", "audio_tokens"], _plain_count), st.none(), _count_value
        ),
        "completion_tokens_details": st.one_of(
            _block(["reasoning_tokens", "audio_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"], _plain_count),
            st.none(),
        ),
    },
)
"""OpenAI's block, its counts mostly plain; the other shapes' keys come as ``noise``."""
_responses_like = st.fixed_dictionaries(
    {"input_tokens": _plain_count, "output_tokens": _plain_count},
    optional={
        "total_tokens": _plain_count,
        "input_tokens_details": st.one_of(_block(["cached_tokens", "cache_write_tokens"], _plain_count), st.none(), _count_value),
        "output_tokens_details": st.one_of(_block(["reasoning_tokens", "audio_tokens"], _plain_count), st.none()),
    },
)
"""The Responses API's block, the same way."""
_noise = st.one_of(
    st.just({}),
    _block(["input_tokens", "cost", "is_byok", "cache_read_input_tokens", "prompt_cache_hit_tokens"], _count_value),
    st.fixed_dictionaries({"input_tokens_details": _block(["cached_tokens"], _count_value)}),
    st.fixed_dictionaries({"prompt_tokens_details": _block(["cached_tokens", "cache_write_tokens"], _plain_count)}),
    _block(["cache_creation_input_tokens", "cache_creation"], st.one_of(_count_value, _block(
        ["ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"], _plain_count))),
    st.fixed_dictionaries({"input_tokens_details": _block(
        ["cache_write_tokens", "cache_write_tokens_details"],
        st.one_of(_plain_count, _block(["ttl_30m_tokens", "ttl_12h_tokens"], _plain_count)),
    )}),
)


@settings(max_examples=1000, deadline=None)
@example(usage={"prompt_tokens": 1, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": -1}}, noise={}, extra={})
@example(usage={"prompt_tokens": 1, "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": True}}, noise={}, extra={})
@example(usage={"prompt_tokens": 1.0, "completion_tokens": 2}, noise={}, extra={})



@example(usage={"input_tokens": 5, "output_tokens": 2, "input_tokens_details": {}}, noise={}, extra={})
@example(usage={"input_tokens": 5, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 4}}, noise={"cache_read_input_tokens": 1}, extra={})
@given(
    usage=st.one_of(_openai_like, _responses_like),
    noise=_noise,
    extra=st.sampled_from([{}, {}, {"timings": {"cache_n": 5, "prompt_n": 2}}, {"openhuman": {"usage": {"input_tokens": 9}}}]),
)
def test_the_openai_fast_path_reads_what_the_general_path_reads(
    usage: dict[str, Any], noise: dict[str, Any], extra: dict[str, Any]
) -> None:
    """``extract_usage`` reads the plain OpenAI block directly: the same ``Usage`` as the reader of
    every shape, for every block (the fast path declines what it does not know)."""
    from proxy.core.usage import _extract

    body = {"id": "x", "choices": [], "usage": {**usage, **noise}, **extra}
    assert extract_usage(body) == _extract(body)


def test_the_openai_fast_path_is_taken_for_the_openai_shapes() -> None:
    """It must be able to fail: the fast path reads OpenAI's documented blocks itself."""
    from proxy.core.usage import _openai_usage

    responses = {"usage": {"input_tokens": 3000, "input_tokens_details": {"cached_tokens": 2048}, "output_tokens": 100,
                           "output_tokens_details": {"reasoning_tokens": 40}, "total_tokens": 3100}}
    for body in (OPENAI_BODY, OPENAI_USAGE_CHUNK, responses, GPT56_CHAT_BODY):
        fast = _openai_usage(body["usage"])
        assert fast is not None and fast == extract_usage(body)
    assert _openai_usage(GPT56_RESPONSE["usage"]) is None  # a TTL split: the general path reads it
    assert _openai_usage({"prompt_tokens": 1, "completion_tokens": 2, "cost": 0.1}) is None


@settings(max_examples=300, deadline=None)
@example(obj={"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]})
@example(obj={"choices": [], "usage": None, "timings": {"cache_n": 3, "prompt_n": 1}})
@given(obj=_json)
def test_every_shortcut_reads_what_the_general_path_reads(obj: Any) -> None:
    """A stream's content chunk (no usage at all) and the plain blocks are answered without the
    reader of every shape: the same answer as that reader, for any object."""
    from proxy.core.usage import _extract

    for candidate in (obj, {"choices": [], "usage": obj}, {"choices": [], "usage": None, "x": obj}):
        if isinstance(candidate, dict):
            assert extract_usage(candidate) == _extract(candidate)


# -- cache writes -------------------------------------------------------------------------------

GPT56_CHAT_BODY: dict[str, Any] = {
    "id": "chatcmpl-C1",
    "object": "chat.completion",
    "model": "gpt-5.6-terra",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {
        "prompt_tokens": 5200,
        "completion_tokens": 80,
        "total_tokens": 5280,
        "prompt_tokens_details": {"cached_tokens": 4096, "cache_write_tokens": 1024, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 32, "audio_tokens": 0},
    },
}
"""GPT-5.6 chat: the writes beside the reads, both inside the prompt tokens."""

GPT56_RESPONSE: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "gpt-5.6-sol",
    "output": [],
    "usage": {
        "input_tokens": 9000,
        "input_tokens_details": {
            "cached_tokens": 6000,
            "cache_write_tokens": 2500,
            "cache_write_tokens_details": {"ttl_30m_tokens": 2000, "ttl_12h_tokens": 500},
        },
        "output_tokens": 120,
        "output_tokens_details": {"reasoning_tokens": 64},
        "total_tokens": 9120,
    },
}
"""GPT-5.6 Responses: the writes split by TTL."""

ANTHROPIC_MESSAGE: dict[str, Any] = {
    "id": "msg_01",
    "type": "message",
    "model": "claude-sonnet-4-6",
    "usage": {
        "input_tokens": 50,
        "cache_creation_input_tokens": 1248,
        "cache_read_input_tokens": 10000,
        "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 248},
        "output_tokens": 503,
        "service_tier": "standard",
    },
}
"""Anthropic: ``input_tokens`` counts only what was neither read nor written."""


def test_gpt56_chat_reports_writes_beside_reads() -> None:
    usage = extract_usage(GPT56_CHAT_BODY)
    assert usage == Usage(
        prompt_tokens=5200, completion_tokens=80, cached_tokens=4096, cache_write_tokens=1024, reasoning_tokens=32
    )
    assert usage.writes_by_ttl() == [("unknown", 1024)]  # chat does not say for how long


def test_gpt56_chat_stream_final_chunk_reports_writes() -> None:
    chunk = {"id": "chatcmpl-C1", "object": "chat.completion.chunk", "model": "gpt-5.6-terra", "choices": [],
             "usage": GPT56_CHAT_BODY["usage"]}
    assert is_usage_only_chunk(chunk)
    assert extract_usage(chunk) == extract_usage(GPT56_CHAT_BODY)


def test_gpt56_responses_split_the_writes_by_ttl() -> None:
    usage = extract_usage(GPT56_RESPONSE)
    assert usage == Usage(
        prompt_tokens=9000,
        completion_tokens=120,
        cached_tokens=6000,
        cache_write_tokens=2500,
        cache_write_30m_tokens=2000,
        cache_write_12h_tokens=500,
        reasoning_tokens=64,
    )
    assert usage.writes_by_ttl() == [("30m", 2000), ("12h", 500)]


def test_responses_stream_completed_event_carries_the_same_usage() -> None:
    """A Responses stream's usage arrives in ``response.completed``; the observer reads its
    ``response`` object, the same shape as a body."""
    event = {"type": "response.completed", "sequence_number": 41, "response": GPT56_RESPONSE}
    assert extract_usage(event["response"]) == extract_usage(GPT56_RESPONSE)
    assert extract_usage({"type": "response.output_text.delta", "delta": "hi"}) is None


def test_anthropic_writes_split_into_five_minutes_and_an_hour() -> None:
    usage = extract_usage(ANTHROPIC_MESSAGE)
    assert usage == Usage(
        prompt_tokens=50 + 10000 + 1248,
        completion_tokens=503,
        cached_tokens=10000,
        cache_write_tokens=1248,
        cache_write_5m_tokens=1000,
        cache_write_1h_tokens=248,
        source="anthropic",
    )
    assert usage.writes_by_ttl() == [("5m", 1000), ("1h", 248)]


def test_anthropic_fields_at_the_top_of_chat_usage() -> None:
    """A router (OpenRouter, LiteLLM, the reference upstream's ``anthropic_usage``) that adds
    Anthropic's fields to OpenAI's chat usage: the prompt is OpenAI's, counted once, and the
    writes are read once although both spellings carry them."""
    body = {
        "object": "chat.completion",
        "usage": {
            "prompt_tokens": 11298,
            "completion_tokens": 503,
            "total_tokens": 11801,
            "prompt_tokens_details": {"cached_tokens": 10000, "cache_write_tokens": 1248},
            "cache_read_input_tokens": 10000,
            "cache_creation_input_tokens": 1248,
            "cache_creation": {"ephemeral_5m_input_tokens": 1248, "ephemeral_1h_input_tokens": 0},
        },
    }
    usage = extract_usage(body)
    assert usage is not None
    assert (usage.prompt_tokens, usage.cached_tokens, usage.cache_write_tokens) == (11298, 10000, 1248)
    assert usage.writes_by_ttl() == [("5m", 1248), ("1h", 0)]


def test_openrouter_reads_and_writes_in_prompt_details() -> None:
    usage = extract_usage({
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 10339, "completion_tokens": 60, "total_tokens": 10399, "cost": 0.0041,
                  "prompt_tokens_details": {"cached_tokens": 10318, "cache_write_tokens": 0}},
    })
    assert usage is not None
    assert (usage.cached_tokens, usage.cache_write_tokens, usage.billed_usd) == (10318, 0, 0.0041)
    assert usage.writes_by_ttl() == [("unknown", 0)]  # a reported zero is a known zero


def test_a_missing_write_count_is_unknown_not_zero() -> None:
    for body in (OPENAI_BODY, OPENAI_USAGE_CHUNK, {"usage": {"input_tokens": 10, "output_tokens": 1}}):
        usage = extract_usage(body)
        assert usage is not None and usage.cache_write_tokens is None
        assert usage.writes_by_ttl() == []


def test_a_split_without_its_total_or_above_it_gives_the_total() -> None:
    split_only = extract_usage({"usage": {"input_tokens": 5, "output_tokens": 1, "cache_read_input_tokens": 0,
                                          "cache_creation": {"ephemeral_1h_input_tokens": 300}}})
    assert split_only is not None
    assert (split_only.cache_write_tokens, split_only.prompt_tokens) == (300, 305)
    assert split_only.writes_by_ttl() == [("1h", 300)]
    below = extract_usage({"usage": {"input_tokens": 10, "output_tokens": 1,
                                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 4,
                                                              "cache_write_tokens_details": {"ttl_30m_tokens": 6}}}})
    assert below is not None and below.cache_write_tokens == 6
    partial = extract_usage({"usage": {"input_tokens": 10, "output_tokens": 1,
                                       "input_tokens_details": {"cache_write_tokens": 9,
                                                                "cache_write_tokens_details": {"ttl_12h_tokens": 4}}}})
    assert partial is not None and partial.writes_by_ttl() == [("12h", 4), ("unknown", 5)]


def test_garbage_in_the_write_fields_drops_them_one_by_one() -> None:
    usage = extract_usage({"usage": {
        "input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 2,
        "cache_creation_input_tokens": "lots",
        "cache_creation": {"ephemeral_5m_input_tokens": -1, "ephemeral_1h_input_tokens": 3},
    }})
    assert usage is not None
    assert (usage.cache_write_tokens, usage.cache_write_5m_tokens, usage.cache_write_1h_tokens) == (3, None, 3)
    assert usage.prompt_tokens == 10 + 2 + 3
    assert extract_usage({"usage": {"cache_creation": [1, 2], "prompt_tokens_details": {"cache_write_tokens": True}}}) is None


def test_the_reference_upstreams_usage_blocks_are_read_whole() -> None:
    """The blocks proxy/sim reports in its breakpoint modes, built by its own accounting."""
    from proxy.sim.accounting import Accounting

    spent = Accounting(prompt_tokens=4000, cached_tokens=1500, completion_tokens=30, reasoning_tokens=0,
                       cache_write_tokens=2400, long_write_tokens=400, cache_mode="openai-breakpoints")
    chat = extract_usage({"choices": [], "usage": spent.usage()})
    assert chat is not None
    assert (chat.prompt_tokens, chat.cached_tokens, chat.cache_write_tokens) == (4000, 1500, 2400)
    responses = extract_usage({"usage": spent.response_usage()})
    assert responses is not None and responses.writes_by_ttl() == [("30m", 2000), ("12h", 400)]
    anthropic = Accounting(prompt_tokens=4000, cached_tokens=1500, completion_tokens=30, reasoning_tokens=0,
                           cache_write_tokens=2400, long_write_tokens=400, cache_mode="anthropic", anthropic_usage=True)
    both = extract_usage({"choices": [], "usage": anthropic.usage()})
    assert both is not None
    assert (both.prompt_tokens, both.cached_tokens, both.cache_write_tokens, both.source) == (4000, 1500, 2400, "anthropic")
