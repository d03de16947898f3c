"""Realistic Anthropic Messages event streams (as the API sends them), and the pure helpers.

The builders here are shared by the other Anthropic test modules.
"""

from __future__ import annotations

import json

import pytest

from treadle._exceptions import ModelCallError
from treadle.models._anthropic_stream import MessageAccumulator, classify_anthropic, usage_from
from treadle.types import Usage

SSE = {"content-type": "text/event-stream; charset=utf-8"}


def event(payload: dict, name: str | None = None) -> bytes:
    """One SSE event, named like the API does (``event: <type>``)."""
    return f"event: {name or payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def message_start(input_tokens: int | None = 25, output_tokens: int | None = 1, **usage) -> bytes:
    counts = {"input_tokens": input_tokens, "output_tokens": output_tokens, **usage}
    counts = {k: v for k, v in counts.items() if v is not None}
    message = {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-sonnet-4-5",
        "stop_reason": None,
        "stop_sequence": None,
        **({"usage": counts} if counts else {}),
    }
    return event({"type": "message_start", "message": message})


def block_start(index: int, block: dict) -> bytes:
    return event({"type": "content_block_start", "index": index, "content_block": block})


def delta(index: int, body: dict) -> bytes:
    return event({"type": "content_block_delta", "index": index, "delta": body})


def text_delta(index: int, text: str) -> bytes:
    return delta(index, {"type": "text_delta", "text": text})


def json_delta(index: int, partial: str) -> bytes:
    return delta(index, {"type": "input_json_delta", "partial_json": partial})


def block_stop(index: int) -> bytes:
    return event({"type": "content_block_stop", "index": index})


def message_delta(stop_reason: str, output_tokens: int | None = 15) -> bytes:
    payload: dict = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": None},
    }
    if output_tokens is not None:
        payload["usage"] = {"output_tokens": output_tokens}
    return event(payload)


PING = event({"type": "ping"})
MESSAGE_STOP = event({"type": "message_stop"})


def error_event(type_: str, message: str) -> bytes:
    return event({"type": "error", "error": {"type": type_, "message": message}})


def text_reply(*fragments: str, output_tokens: int = 15) -> list[bytes]:
    """A plain text answer: start, ping, one text block, end_turn, stop."""
    return [
        message_start(),
        block_start(0, {"type": "text", "text": ""}),
        PING,
        *(text_delta(0, f) for f in fragments),
        block_stop(0),
        message_delta("end_turn", output_tokens),
        MESSAGE_STOP,
    ]


def tool_reply(
    name: str = "get_weather", partials=('{"location": "San Fra', 'ncisco, CA"}')
) -> list[bytes]:
    """Text, then one tool_use block whose input streams as input_json_delta fragments."""
    return [
        message_start(472, 2),
        block_start(0, {"type": "text", "text": ""}),
        text_delta(0, "Okay, let me check."),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "toolu_01T1x", "name": name, "input": {}}),
        json_delta(1, ""),
        *(json_delta(1, p) for p in partials),
        block_stop(1),
        message_delta("tool_use", 89),
        MESSAGE_STOP,
    ]


def thinking_reply() -> list[bytes]:
    """Extended thinking: a thinking block (with signature) before the text block."""
    return [
        message_start(),
        block_start(0, {"type": "thinking", "thinking": ""}),
        delta(0, {"type": "thinking_delta", "thinking": "Let me solve this: "}),
        delta(0, {"type": "thinking_delta", "thinking": "27 * 453 = 12231."}),
        delta(0, {"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"}),
        block_stop(0),
        block_start(1, {"type": "text", "text": ""}),
        text_delta(1, "27 * 453 = 12,231"),
        block_stop(1),
        message_delta("end_turn", 120),
        MESSAGE_STOP,
    ]


# --------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("status", "type_", "message", "kind", "retryable"),
    [
        (None, "overloaded_error", "Overloaded", "server_error", True),
        (None, "rate_limit_error", "slow down", "rate_limited", True),
        (None, "api_error", "internal", "server_error", True),
        (None, "invalid_request_error", "bad field", "bad_request", False),
        (None, "invalid_request_error", "prompt is too long: 208310 tokens > 200000 maximum",
         "context_length_exceeded", False),
        (None, "authentication_error", "invalid x-api-key", "auth", False),
        (None, "something_new", "odd", "upstream_error", True),
        (529, "overloaded_error", "Overloaded", "server_error", True),
        (400, "invalid_request_error", "prompt is too long: 9 tokens > 8 maximum",
         "context_length_exceeded", False),
        (403, "permission_error", "no", "auth", False),
        (413, "request_too_large", "too big", "bad_request", False),
    ],
)  # fmt: skip
def test_classify_anthropic(status, type_, message, kind, retryable):
    assert classify_anthropic(status=status, type_=type_, message=message) == (kind, retryable)


def test_usage_counts_cache_tokens_as_input_and_keeps_what_later_events_omit():
    first = usage_from(
        {"input_tokens": 10, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 100,
         "output_tokens": 1},
        Usage(),
    )  # fmt: skip
    assert (first.input_tokens, first.output_tokens, first.total_tokens) == (115, 1, 116)
    later = usage_from({"output_tokens": 40}, first)
    assert (later.input_tokens, later.output_tokens, later.total_tokens) == (115, 40, 155)
    assert usage_from(None, Usage()) == Usage()
    assert usage_from({"output_tokens": 3}, Usage()) == Usage(output_tokens=3)


@pytest.mark.parametrize("absent", [{}, {"cache_read_input_tokens": None}])
def test_a_later_input_count_without_the_cache_counts_keeps_them_in_the_prompt(absent):
    # message_start gave the cache counts; a message_delta repeats input_tokens alone (its
    # usage fields are nullable running counts): the prompt still holds the cached tokens
    first = usage_from(
        {"input_tokens": 10, "cache_read_input_tokens": 5000, "output_tokens": 1}, Usage()
    )
    later = usage_from({"input_tokens": 10, "output_tokens": 7, **absent}, first)
    assert later == Usage(
        input_tokens=5010, output_tokens=7, total_tokens=5017, cached_input_tokens=5000
    )
    fresh = usage_from({"input_tokens": 12, "cache_read_input_tokens": 0}, later)
    assert (fresh.input_tokens, fresh.cached_input_tokens) == (12, 0)  # a count given counts


def test_events_orjson_refuses_still_decode_and_tool_inputs_stay_exact():
    acc = MessageAccumulator()
    acc.add(json.dumps({"type": "message_start", "message": {"id": "m"}}))
    acc.add('{"type": "ping", "x": NaN}')  # orjson refuses NaN; the stdlib reads it
    start = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    acc.add(json.dumps({"type": "content_block_start", "index": 0, "content_block": start}))
    big = 2**70
    partial = {"type": "input_json_delta", "partial_json": json.dumps({"n": big})}
    acc.add(json.dumps({"type": "content_block_delta", "index": 0, "delta": partial}))
    acc.add(json.dumps({"type": "message_delta", "delta": {"stop_reason": "tool_use"}}))
    assert acc.reply().tool_calls[0].arguments == {"n": big}
    with pytest.raises(ModelCallError) as info:
        acc.add("{not json")
    assert info.value.info.kind == "invalid_response"


def _started(*blocks: dict) -> MessageAccumulator:
    acc = MessageAccumulator()
    acc.add(json.dumps({"type": "message_start", "message": {"id": "m"}}))
    for index, block in blocks:
        acc.add(json.dumps({"type": "content_block_start", "index": index, "content_block": block}))
    return acc


TOOL = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
TEXT = {"type": "text", "text": ""}


def test_a_second_block_at_one_index_breaks_the_protocol_and_drops_no_call():
    # The second start replaced the first block: its call vanished, and the run went on.
    acc = _started((0, TOOL))
    delta = {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    acc.add(json.dumps({"type": "content_block_delta", "index": 0, "delta": delta}))
    second = {**TOOL, "id": "toolu_2"}
    with pytest.raises(ModelCallError) as info:
        acc.add(json.dumps({"type": "content_block_start", "index": 0, "content_block": second}))
    assert info.value.info.kind == "invalid_response"
    assert "block 0 twice" in info.value.info.message


@pytest.mark.parametrize(
    ("block", "delta"),
    [
        (TEXT, {"type": "input_json_delta", "partial_json": '{"a": 1}'}),  # became text
        (TOOL, {"type": "text_delta", "text": '{"a": 1}'}),  # became the call's arguments
        (TEXT, {"type": "thinking_delta", "thinking": "hmm"}),
    ],
)
def test_a_delta_of_another_kind_of_block_breaks_the_protocol(block, delta):
    acc = _started((0, block))
    with pytest.raises(ModelCallError) as info:
        acc.add(json.dumps({"type": "content_block_delta", "index": 0, "delta": delta}))
    assert info.value.info.kind == "invalid_response"


def test_a_block_index_of_true_is_no_index():
    acc = MessageAccumulator()
    acc.add(json.dumps({"type": "message_start", "message": {"id": "m"}}))
    with pytest.raises(ModelCallError) as info:
        acc.add(json.dumps({"type": "content_block_start", "index": True, "content_block": TEXT}))
    assert info.value.info.kind == "invalid_response"
