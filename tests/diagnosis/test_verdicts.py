"""Reading the provider's verdict (proxy/core/provider_misses.py) and naming the comparison in the
client's bytes (proxy/wire/responses.py:with_comparison). Pure: no event loop, no sockets."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.provider_misses import (
    CLIENT_MISS,
    HIT,
    PROVIDER_MISS,
    REASONS,
    UNKNOWN,
    CacheVerdict,
    anthropic_verdict,
    openai_verdict,
)
from proxy.request.diagnosis import ProviderDiagnosis, asked, verdict_of
from proxy.wire.responses import with_comparison


def verdict(diagnostics: Any) -> tuple[str, str, str]:
    found = openai_verdict(diagnostics)
    assert found is not None
    return found.verdict, found.side, found.reason


# -- OpenAI's prompt_cache_diagnostics ------------------------------------------------------------


@pytest.mark.parametrize(
    ("diagnostics", "expected"),
    [
        ({"type": "cache_hit"}, (HIT, "", "")),
        (
            {"type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 40, "comparison_reusable_tokens": 2000},
            (CLIENT_MISS, "client", "input_changed"),
        ),
        ({"type": "cache_miss", "reason": "prompt_cache_key_changed"}, (CLIENT_MISS, "client", "prompt_cache_key_changed")),
        ({"type": "cache_miss", "reason": "a_reason_openai_adds_later"}, (CLIENT_MISS, "client", "other")),
        ({"type": "unavailable", "sim_reason": "expired", "cache_missed_tokens": 2100}, (PROVIDER_MISS, "provider", "expired")),
        ({"type": "unavailable", "sim_reason": "evicted"}, (PROVIDER_MISS, "provider", "evicted")),
        ({"type": "unavailable"}, (PROVIDER_MISS, "provider", "unavailable")),  # OpenAI's own: no detail
        ({"type": "unavailable", "sim_reason": "unknown"}, (PROVIDER_MISS, "provider", "unavailable")),
        ({"type": "unavailable", "sim_reason": "not_written"}, (UNKNOWN, "", "not_written")),
        ({"type": "comparison_response_not_found"}, (UNKNOWN, "", "comparison_not_found")),
        ({"type": "something_new"}, (UNKNOWN, "", "other")),
    ],
)
def test_openai_diagnostics_become_a_verdict_with_a_bounded_reason(diagnostics: Any, expected: tuple[str, str, str]) -> None:
    assert verdict(diagnostics) == expected
    assert verdict(diagnostics)[2] in REASONS | {""}


@pytest.mark.parametrize("garbage", [None, "cache_hit", [], {"reason": "input_changed"}, {"type": 3}])
def test_no_verdict_from_what_is_no_diagnostics(garbage: Any) -> None:
    assert openai_verdict(garbage) is None


def test_missed_tokens_are_kept_and_garbage_counts_dropped() -> None:
    miss = openai_verdict({"type": "cache_miss", "reason": "tools_changed", "cache_missed_tokens": 12})
    assert miss == CacheVerdict(verdict=CLIENT_MISS, reason="tools_changed", missed_tokens=12)
    assert openai_verdict({"type": "unavailable", "cache_missed_tokens": -1}) == CacheVerdict(
        verdict=PROVIDER_MISS, reason="unavailable"
    )


def test_the_log_label_says_whose_miss_it_was() -> None:
    labels = [
        openai_verdict(d).label  # type: ignore[union-attr]
        for d in (
            {"type": "cache_hit"},
            {"type": "cache_miss", "reason": "input_changed"},
            {"type": "unavailable", "sim_reason": "expired"},
            {"type": "comparison_response_not_found"},
        )
    ]
    assert labels == ["hit", "client:input_changed", "provider:expired", "unknown:comparison_not_found"]


# -- Anthropic's diagnostics (the Messages API's seam) --------------------------------------------


def test_anthropic_changes_are_the_clients_and_an_unexplained_empty_read_the_providers() -> None:
    changed = anthropic_verdict({"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 900}}, 0)
    assert changed == CacheVerdict(verdict=CLIENT_MISS, reason="system_changed", missed_tokens=900)
    assert anthropic_verdict({"cache_miss_reason": {"type": "previous_message_not_found"}}, 0) == CacheVerdict(
        verdict=UNKNOWN, reason="comparison_not_found"
    )
    assert anthropic_verdict({"cache_miss_reason": None}, 0) == CacheVerdict(verdict=UNKNOWN, reason="pending")
    # No diagnostics: no divergence was found. A read is a hit; reading nothing is the provider's loss,
    # unless the prompt was too short to be cached at all.
    assert anthropic_verdict(None, 3000, prompt_tokens=3100) == CacheVerdict(verdict=HIT)
    assert anthropic_verdict(None, 0, prompt_tokens=3100) == CacheVerdict(
        verdict=PROVIDER_MISS, reason="not_reused", missed_tokens=3100
    )
    assert anthropic_verdict(None, 0, prompt_tokens=200) == CacheVerdict(verdict=UNKNOWN, reason="not_written")
    assert anthropic_verdict(None, None) is None


# -- the comparison, in the client's bytes --------------------------------------------------------


def test_the_comparison_is_the_bodys_first_member_and_every_other_byte_stays() -> None:
    raw = b'{ "model":"gpt-5.6",\n  "input":[{"role":"user","content":"Hi"}]}'
    out = with_comparison(raw, orjson.loads(raw), "resp_1")
    assert out == b'{"prompt_cache_options":{"comparison_response_id":"resp_1"}, "model":"gpt-5.6",\n  "input":[{"role":"user","content":"Hi"}]}'


def test_the_comparison_goes_inside_the_clients_own_options() -> None:
    raw = b'{"model":"m","prompt_cache_options":{"ttl":"12h"},"input":"Hi"}'
    out = with_comparison(raw, orjson.loads(raw), "resp_1")
    assert orjson.loads(out)["prompt_cache_options"] == {"comparison_response_id": "resp_1", "ttl": "12h"}
    assert out.replace(b'"comparison_response_id":"resp_1",', b"") == raw
    empty = b'{"prompt_cache_options":{},"input":"Hi"}'
    assert orjson.loads(with_comparison(empty, orjson.loads(empty), "r"))["prompt_cache_options"] == {"comparison_response_id": "r"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt_cache_options":{"comparison_response_id":"resp_mine"},"input":"Hi"}',  # the client's own
        b'{"prompt_cache_options":{"comparison_response_id":null},"input":"Hi"}',
        b'{"prompt_cache_retention":"24h","input":"Hi"}',  # never both options and retention
        b'{"prompt_cache_retention":null,"input":"Hi"}',
        b'{"prompt_cache_options":null,"input":"Hi"}',
        b'{"prompt_cache_options":"implicit","input":"Hi"}',
        b'{"input":"Hi","input":"Hello"}',  # duplicate keys: the splice refuses, the bytes go as they came
    ],
)
def test_the_clients_bytes_go_as_they_came_where_a_comparison_has_no_place(raw: bytes) -> None:
    assert with_comparison(raw, orjson.loads(raw), "resp_kvwarm") is raw


def test_only_a_wire_that_can_ask_is_asked() -> None:
    raw = b'{"model":"m","messages":[]}'
    assert asked("chat", raw, orjson.loads(raw), "resp_1") is raw
    assert b"resp_1" in asked("responses", raw, orjson.loads(raw), "resp_1")


# -- which response: the deepest recorded reply in the matched prefix -----------------------------


class _Match:
    def __init__(self, keys: tuple[bytes, ...], matched: int) -> None:
        self.keys, self.matched = keys, matched


class _Plan:
    def __init__(self, keys: tuple[bytes, ...], matched: int) -> None:
        self.match = _Match(keys, matched)


class _Observer:
    def __init__(self, response_id: str | None, verdict: Any = None) -> None:
        self.response_id, self.verdict = response_id, verdict


def test_the_comparison_is_the_deepest_recorded_reply_in_the_matched_prefix() -> None:
    diagnosis = ProviderDiagnosis(True)
    diagnosis.remember(b"k2", _Observer("resp_1"))
    diagnosis.remember(b"k4", _Observer("resp_2"))
    keys = (b"k0", b"k1", b"k2", b"k3", b"k4", b"k5")
    assert diagnosis.comparison("responses", {}, _Plan(keys, 6)) == "resp_2"  # type: ignore[arg-type]
    assert diagnosis.comparison("responses", {}, _Plan(keys, 4)) == "resp_1"  # type: ignore[arg-type]  # a break before resp_2's reply
    assert diagnosis.comparison("responses", {}, _Plan(keys, 2)) is None  # type: ignore[arg-type]
    assert diagnosis.comparison("chat", {}, _Plan(keys, 6)) is None  # type: ignore[arg-type]
    assert diagnosis.comparison("responses", {"previous_response_id": "resp_9"}, None) == "resp_9"
    assert diagnosis.comparison("responses", {}, None) is None


def test_off_remembers_and_names_nothing_and_the_memory_is_bounded() -> None:
    off = ProviderDiagnosis(False)
    off.remember(b"k", _Observer("resp_1"))
    assert len(off) == 0 and off.comparison("responses", {"previous_response_id": "r"}, None) is None
    bounded = ProviderDiagnosis(True, capacity=2)
    for i in range(3):
        bounded.remember(b"k%d" % i, _Observer(f"resp_{i}"))
    bounded.remember(b"none", _Observer(None))
    assert len(bounded) == 2
    assert bounded.comparison("responses", {}, _Plan((b"k0",), 1)) is None  # type: ignore[arg-type]  # forgotten first


def test_an_observer_that_reads_no_verdict_has_none() -> None:
    assert verdict_of(object()) is None
    assert verdict_of(_Observer("r", "cache_hit")) is None
    hit = CacheVerdict(verdict=HIT)
    assert verdict_of(_Observer("r", hit)) is hit
