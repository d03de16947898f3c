"""Decision parsers: native tool calls, JSON in text, repairs, and the never-raise contract."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle import _repair
from treadle.parsers import JsonToolCallParser, NativeToolCallParser, synthesise_call_id
from treadle.ports import DecisionParser
from treadle.types import (
    DecisionKind,
    InvalidToolCall,
    ModelReply,
    ParsedReply,
    ToolCall,
    ToolSpec,
)

TOOLS = (
    ToolSpec(name="get_weather"),
    ToolSpec(name="read_file"),
    ToolSpec(name="list_open_tickets"),
)


def native(reply: ModelReply, tools: tuple[ToolSpec, ...] = TOOLS) -> ParsedReply:
    return NativeToolCallParser().parse(reply, tools)


def text_json(reply: ModelReply, tools: tuple[ToolSpec, ...] = TOOLS) -> ParsedReply:
    return JsonToolCallParser().parse(reply, tools)


def bad(raw: str, *, reason: str = "unparseable", name: str = "read_file") -> ModelReply:
    return ModelReply(
        invalid_tool_calls=(InvalidToolCall(id="c1", name=name, raw_arguments=raw, reason=reason),)
    )


def test_parsers_satisfy_the_protocol() -> None:
    assert isinstance(NativeToolCallParser(), DecisionParser)
    assert isinstance(JsonToolCallParser(), DecisionParser)


# --------------------------------------------------------------------------- native: text


def test_text_only_reply_is_the_final_answer() -> None:
    parsed = native(ModelReply(text="It is sunny.", finish_reason="stop"))
    assert parsed.kind is DecisionKind.FINAL_ANSWER
    assert parsed.text == "It is sunny."
    assert parsed.history_message.content == "It is sunny."
    assert parsed.history_message.tool_calls == ()


@pytest.mark.parametrize("text", [None, "", "  \n\t"])
def test_empty_reply_is_invalid_with_feedback(text: str | None) -> None:
    parsed = native(ModelReply(text=text, finish_reason="stop"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "empty_reply"
    assert parsed.feedback is not None
    assert "get_weather" in parsed.feedback
    assert parsed.history_message.content is None


def test_empty_reply_cut_by_the_output_limit_says_so() -> None:
    parsed = native(ModelReply(text=None, reasoning="thinking...", finish_reason="length"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "truncated"
    assert "output token limit" in (parsed.feedback or "")
    assert parsed.history_message.reasoning == "thinking..."


def test_text_alongside_calls_is_kept() -> None:
    call = ToolCall(id="c1", name="get_weather", arguments={"city": "Oslo"})
    parsed = native(ModelReply(text="Let me check.", tool_calls=(call,)))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions == (call,)
    assert parsed.text == "Let me check."
    assert parsed.history_message.content == "Let me check."
    assert parsed.history_message.tool_calls == (call,)


def test_a_call_whose_id_stands_is_the_models_own_object() -> None:
    # The run's history keeps every call: a copy per step would be kept twice.
    kept = ToolCall(id="c1", name="get_weather", arguments={"city": "Oslo"})
    renamed = ToolCall(id="c1", name="read_file", arguments={})  # duplicate id: a new one
    parsed = native(ModelReply(tool_calls=(kept, renamed)))
    assert parsed.actions[0] is kept
    assert parsed.actions[1] is not renamed
    assert parsed.actions[1].id != "c1"
    assert parsed.history_message.tool_calls[0] is kept


def test_null_content_never_becomes_the_string_none() -> None:
    call = ToolCall(id="c1", name="get_weather", arguments={"city": "Oslo"})
    parsed = native(ModelReply(text=None, tool_calls=(call,)))
    assert parsed.text is None
    assert parsed.history_message.content is None


def test_reasoning_goes_into_the_history_message() -> None:
    call = ToolCall(id="c1", name="get_weather", arguments={"city": "Oslo"})
    parsed = native(ModelReply(reasoning="weather needs a tool", tool_calls=(call,)))
    assert parsed.history_message.reasoning == "weather needs a tool"


def test_unknown_tool_names_are_parsed_as_actions() -> None:
    call = ToolCall(id="c1", name="launch_rocket", arguments={})
    parsed = native(ModelReply(tool_calls=(call,)))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions == (call,)


# --------------------------------------------------------------------------- native: text tool


def test_text_reply_tool_turns_text_into_an_action() -> None:
    parser = NativeToolCallParser(text_reply_tool="respond")
    parsed = parser.parse(ModelReply(text="Your flight is booked."), TOOLS)
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions == (
        ToolCall(id="", name="respond", arguments={"content": "Your flight is booked."}),
    )
    assert parsed.text == "Your flight is booked."
    assert parsed.history_message.content == "Your flight is booked."
    assert parsed.history_message.tool_calls == ()


def test_text_reply_tool_leaves_native_calls_alone() -> None:
    call = ToolCall(id="c1", name="get_weather", arguments={"city": "Oslo"})
    parser = NativeToolCallParser(text_reply_tool="respond")
    parsed = parser.parse(ModelReply(text="One moment.", tool_calls=(call,)), TOOLS)
    assert parsed.actions == (call,)


def test_text_reply_tool_does_not_make_an_empty_reply_valid() -> None:
    parser = NativeToolCallParser(text_reply_tool="respond")
    assert parser.parse(ModelReply(text=""), TOOLS).kind is DecisionKind.INVALID


# --------------------------------------------------------------------------- native: repairs


@pytest.mark.parametrize(
    ("raw", "arguments", "repairs"),
    [
        ("", {}, ("empty_arguments_as_empty_object",)),
        ("  \n ", {}, ("empty_arguments_as_empty_object",)),
        ('```json\n{"path": "a"}\n```', {"path": "a"}, ("unwrapped_code_fence",)),
        ('```\n{"path": "a"}\n```', {"path": "a"}, ("unwrapped_code_fence",)),
        ('```{"path": "a"}```', {"path": "a"}, ("unwrapped_code_fence",)),
        ("{'path': 'it\\'s', 'x': None}", {"path": "it's", "x": None}, ("python_literal",)),
        ('"{\\"path\\": \\"a\\"}"', {"path": "a"}, ("decoded_json_string",)),
        (
            "```python\n{'path': True}\n```",
            None,
            None,
        ),
        (
            "```json\n{'path': True}\n```",
            {"path": True},
            ("unwrapped_code_fence", "python_literal"),
        ),
    ],
)
def test_argument_repairs(
    raw: str, arguments: dict[str, Any] | None, repairs: tuple[str, ...] | None
) -> None:
    parsed = native(bad(raw))
    if arguments is None:
        assert parsed.kind is DecisionKind.INVALID
        return
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions == (ToolCall(id="c1", name="read_file", arguments=arguments),)
    assert parsed.repairs == repairs


def test_null_arguments_mean_no_arguments_only_for_a_tool_without_required_ones() -> None:
    parsed = native(bad("null", name="get_weather"))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions[0].arguments == {}
    assert parsed.repairs == ("null_arguments_as_empty_object",)
    needs_path = ToolSpec(
        name="read_file",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    )
    refused = native(bad("null"), (needs_path,))
    assert refused.kind is DecisionKind.INVALID
    assert refused.reason == "arguments_not_object"
    assert refused.actions == ()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('{"path": "a.rs"}{"path": "b.rs"}', "multiple_json_values"),
        ('{"path": "a.rs"}\n{"path": "b.rs"}\n{"path": "c.rs"}', "multiple_json_values"),
        ('```json\n{"a": 1} {"b": 2}\n```', "multiple_json_values"),
        ('{"path": "a.rs"', "unparseable"),
        ("[1, 2]", "arguments_not_object"),
        ("{'tags': {1, 2}}", "unparseable"),
        ("{'pair': (1, 2)}", "unparseable"),
        ("{'data': b'x'}", "unparseable"),
        ("{'z': 1j}", "unparseable"),
        ('{"x": NaN}', "unparseable"),
        ("{'x': 1e999}", "unparseable"),
        ("{1: 'a'}", "unparseable"),
        ("__import__('os').system('true')", "unparseable"),
        ("[" * 100_000, "unparseable"),
    ],
)
def test_unusable_arguments_are_invalid_never_guessed(raw: str, reason: str) -> None:
    parsed = native(bad(raw))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == reason
    assert parsed.actions == ()
    assert parsed.feedback is not None
    assert "c1" in parsed.feedback
    assert "read_file" in parsed.feedback
    assert parsed.history_message.tool_calls == (ToolCall(id="c1", name="read_file"),)


def test_unparseable_feedback_carries_the_parse_error() -> None:
    parsed = native(bad('{"path": "a.rs" "b"}'))
    assert "Expecting ',' delimiter" in (parsed.feedback or "")


def test_multiple_values_feedback_counts_the_objects() -> None:
    parsed = native(bad('{"a": 1}{"a": 2}{"a": 3}'))
    assert (parsed.feedback or "").startswith(
        "Tool call c1 (read_file) had three argument objects in one call."
    )


def test_truncated_call_is_never_executed() -> None:
    parsed = native(bad('{"path": "very/long', reason="truncated"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "truncated"
    assert "cut off" in (parsed.feedback or "")


def test_truncated_call_that_happens_to_parse_is_still_not_executed() -> None:
    parsed = native(bad('{"path": "a"}', reason="truncated"))
    assert parsed.kind is DecisionKind.INVALID


def test_unknown_invalid_reason_is_reported_as_is() -> None:
    parsed = native(bad('{"path": "a"}', reason="no_name"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "no_name"


def test_one_bad_call_stops_the_whole_batch_and_keeps_every_id() -> None:
    good = ToolCall(id="c0", name="get_weather", arguments={"city": "Oslo"})
    reply = ModelReply(
        text="Two things.",
        tool_calls=(good,),
        invalid_tool_calls=(
            InvalidToolCall(id="c1", name="read_file", raw_arguments="{", reason="unparseable"),
        ),
    )
    parsed = native(reply)
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.actions == ()
    assert [c.id for c in parsed.history_message.tool_calls] == ["c0", "c1"]
    assert parsed.history_message.tool_calls[0] == good
    assert parsed.history_message.tool_calls[1].arguments == {}
    assert parsed.history_message.content == "Two things."
    assert "None of the 2 tool calls" in (parsed.feedback or "")


def test_repaired_calls_follow_complete_ones() -> None:
    reply = ModelReply(
        tool_calls=(ToolCall(id="a", name="get_weather", arguments={"city": "X"}),),
        invalid_tool_calls=(
            InvalidToolCall(
                id="b", name="list_open_tickets", raw_arguments="", reason="unparseable"
            ),
        ),
    )
    parsed = native(reply)
    assert [a.id for a in parsed.actions] == ["a", "b"]
    assert parsed.repairs == ("empty_arguments_as_empty_object",)


def test_non_object_arguments_on_a_complete_call_are_invalid() -> None:
    call = ToolCall(id="c1", name="read_file", arguments=["a"])  # type: ignore[arg-type]
    parsed = native(ModelReply(tool_calls=(call,)))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "arguments_not_object"


def test_missing_and_repeated_call_ids_are_synthesised_deterministically() -> None:
    reply = ModelReply(
        response_id="resp-1",
        tool_calls=(
            ToolCall(id="", name="get_weather", arguments={"city": "A"}),
            ToolCall(id="x", name="get_weather", arguments={"city": "B"}),
            ToolCall(id="x", name="get_weather", arguments={"city": "C"}),
        ),
    )
    first, second = native(reply), native(reply)
    ids = [a.id for a in first.actions]
    assert ids == [a.id for a in second.actions]
    assert len(set(ids)) == 3
    assert ids[1] == "x"
    assert ids[0].startswith("call_")
    assert first.repairs == ("synthesised_call_id",)


# --------------------------------------------------------------------------- native: content


@pytest.mark.parametrize(
    "content",
    [
        '{"name": "get_weather", "arguments": {"city": "Lyon"}}',
        '  ```json\n{"name": "get_weather", "parameters": {"city": "Lyon"}}\n```  ',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}',
    ],
)
def test_tool_call_written_in_content_becomes_a_call(content: str) -> None:
    parsed = native(ModelReply(text=content, finish_reason="stop"))
    assert parsed.kind is DecisionKind.ACTIONS
    assert [(a.name, dict(a.arguments)) for a in parsed.actions] == [
        ("get_weather", {"city": "Lyon"})
    ]
    assert parsed.repairs == ("tool_call_from_content",)
    assert parsed.text is None


@pytest.mark.parametrize(
    "content",
    [
        '{"name": "Ada", "arguments": {"x": 1}}',
        '{"name": "get_weather", "arguments": ["Lyon"]}',
        '{"name": "get_weather"}',
        'Call: {"name": "get_weather", "arguments": {"city": "Lyon"}}',
        '{"name": "get_weather", "arguments": {}}{"name": "get_weather", "arguments": {}}',
        '[{"name": "get_weather", "arguments": {}}]',
    ],
)
def test_other_json_content_stays_a_final_answer(content: str) -> None:
    parsed = native(ModelReply(text=content))
    assert parsed.kind is DecisionKind.FINAL_ANSWER
    assert parsed.text == content


# --------------------------------------------------------------------------- JSON in text


def test_json_bare_call() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
    parsed = text_json(ModelReply(text=text))
    assert parsed.kind is DecisionKind.ACTIONS
    assert [(a.name, dict(a.arguments)) for a in parsed.actions] == [
        ("get_weather", {"city": "Lyon"})
    ]
    assert parsed.text is None
    assert parsed.history_message.content == text
    assert parsed.history_message.tool_calls == ()


def test_json_fenced_call_after_prose() -> None:
    text = 'I will look.\n```json\n{"name": "read_file", "arguments": {"path": "a"}}\n```\nDone.'
    parsed = text_json(ModelReply(text=text))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions[0].arguments == {"path": "a"}
    assert parsed.text == "I will look.\nDone."


def test_json_bare_call_after_prose() -> None:
    text = 'Checking now.\n{"name": "read_file", "arguments": {"path": "a"}}'
    parsed = text_json(ModelReply(text=text))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.text == "Checking now."


def test_json_list_and_sequence_are_several_calls_with_distinct_ids() -> None:
    for text in (
        '[{"name": "read_file", "arguments": {"path": "a"}},'
        ' {"name": "read_file", "arguments": {"path": "b"}}]',
        '{"name": "read_file", "arguments": {"path": "a"}}\n'
        '{"name": "read_file", "arguments": {"path": "b"}}',
    ):
        parsed = text_json(ModelReply(text=text))
        assert [a.arguments["path"] for a in parsed.actions] == ["a", "b"]
        assert len({a.id for a in parsed.actions}) == 2


def test_json_given_ids_are_kept_and_repeats_replaced() -> None:
    text = (
        '[{"id": "k", "name": "read_file", "arguments": {}},'
        ' {"id": "k", "name": "read_file", "arguments": {}}]'
    )
    parsed = text_json(ModelReply(text=text))
    assert parsed.actions[0].id == "k"
    assert parsed.actions[1].id not in ("k", "")


def test_json_declared_tool_without_arguments_and_undeclared_tool_with_them() -> None:
    parsed = text_json(ModelReply(text='{"name": "list_open_tickets"}'))
    assert parsed.actions == (ToolCall(id=parsed.actions[0].id, name="list_open_tickets"),)
    parsed = text_json(ModelReply(text='{"name": "launch", "parameters": {"n": 1}}'))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.actions[0].name == "launch"


def test_json_python_literal_is_repaired() -> None:
    parsed = text_json(ModelReply(text="{'name': 'read_file', 'arguments': {'path': 'x'}}"))
    assert parsed.kind is DecisionKind.ACTIONS
    assert parsed.repairs == ("python_literal",)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"temperature": 21, "unit": "C"}',
        '```json\n{"name": "Ada", "age": 36}\n```',
        "```python\nprint({'name': 'read_file', 'arguments': {}})\n```",
        "Use {braces} like this.",
    ],
)
def test_json_other_text_is_a_final_answer(text: str) -> None:
    parsed = text_json(ModelReply(text=text))
    assert parsed.kind is DecisionKind.FINAL_ANSWER
    assert parsed.text == text


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "read_file", "arguments": {"path": "a"',
        '```json\n{"name": "get_weather", arguments: {}}\n```',
        '{"name": "read_file", "arguments": ["a"]}',
        '[{"name": "read_file", "arguments": {}}, 42]',
    ],
)
def test_json_broken_call_is_invalid_with_the_error(text: str) -> None:
    parsed = text_json(ModelReply(text=text, finish_reason="stop"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "unparseable"
    assert "could not be read" in (parsed.feedback or "")
    assert parsed.history_message.content == text


def test_json_broken_call_feedback_has_the_parse_error() -> None:
    parsed = text_json(ModelReply(text='{"name": "read_file", "arguments": {"path": "a" "b"}}'))
    assert "Expecting ',' delimiter" in (parsed.feedback or "")


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "read_file", "arguments": {"path": "a"}}\nI will wait for the result.',
        'Let me read.\n{"name": "read_file", "arguments": {"path": "a"}}\nThen I answer.',
        '[{"name": "read_file", "arguments": {"path": "a"}}] and that is all',
    ],
)
def test_json_call_followed_by_prose_is_said_to_be(text: str) -> None:
    # The feedback read "it is not valid JSON (Expecting value: line 2 column 1 (char 47))"
    # of a call whose JSON was valid: the text after it was the problem.
    parsed = text_json(ModelReply(text=text, finish_reason="stop"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "unparseable"
    feedback = parsed.feedback or ""
    assert "its JSON is followed by text that is not JSON" in feedback
    assert "Expecting value" not in feedback


def test_json_broken_second_call_keeps_the_parse_error() -> None:
    text = '{"name": "read_file", "arguments": {}}\n{"name": "read_file", "arguments": {x}}'
    parsed = text_json(ModelReply(text=text))
    assert parsed.kind is DecisionKind.INVALID
    assert "it is not valid JSON (Expecting property name" in (parsed.feedback or "")


def test_json_call_cut_by_the_output_limit_is_truncated() -> None:
    text = '```json\n{"name": "read_file", "arguments": {"path": "a'
    parsed = text_json(ModelReply(text=text, finish_reason="length"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "truncated"


def test_json_parser_empty_reply_and_native_calls() -> None:
    assert text_json(ModelReply(text="")).reason == "empty_reply"
    call = ToolCall(id="c1", name="read_file", arguments={"path": "a"})
    assert text_json(ModelReply(tool_calls=(call,))).actions == (call,)


# --------------------------------------------------------------------------- properties

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_data = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=8), json_data, max_size=5)
tool_names = st.sampled_from(["get_weather", "read_file", "list_open_tickets", ""]) | st.text(
    max_size=12
)


@st.composite
def model_texts(draw: st.DrawFn) -> str:
    """Text a model might write: free text, JSON, fenced JSON, Python reprs, fragments."""
    call = {
        "name": draw(tool_names),
        draw(st.sampled_from(["arguments", "parameters"])): draw(json_data),
    }
    pieces = [
        draw(st.text()),
        json.dumps(call),
        json.dumps([call, call]),
        repr(call),
        "```json\n" + json.dumps(call) + "\n```",
        json.dumps(call)[: draw(st.integers(0, 40))],
        json.dumps(draw(json_data)),
    ]
    chosen = draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=3))
    return draw(st.sampled_from(["", "\n", " "])).join(chosen)


raw_arguments = st.one_of(
    st.text(),
    model_texts(),
    json_objects.map(json.dumps),
    json_objects.map(repr),
    json_objects.map(lambda o: "```json\n" + json.dumps(o) + "\n```"),
    st.lists(json_objects, min_size=2, max_size=3).map(lambda os: "".join(map(json.dumps, os))),
)
tool_calls = st.builds(
    ToolCall,
    id=st.text(max_size=6),
    name=tool_names,
    arguments=json_objects | st.sampled_from([[], "x", 3, None]),
)
invalid_calls = st.builds(
    InvalidToolCall,
    id=st.text(max_size=6),
    name=tool_names,
    raw_arguments=raw_arguments,
    reason=st.sampled_from(["unparseable", "truncated", "", "other"]),
)
replies = st.builds(
    ModelReply,
    text=st.none() | model_texts(),
    reasoning=st.none() | st.text(max_size=20),
    tool_calls=st.lists(tool_calls, max_size=3).map(tuple),
    invalid_tool_calls=st.lists(invalid_calls, max_size=3).map(tuple),
    finish_reason=st.sampled_from([None, "stop", "tool_calls", "length"]),
    response_id=st.none() | st.text(max_size=8),
)
tool_lists = st.lists(st.builds(ToolSpec, name=tool_names), max_size=4).map(tuple)
parsers = st.sampled_from(
    [NativeToolCallParser(), NativeToolCallParser(text_reply_tool="respond"), JsonToolCallParser()]
)


def check_well_formed(reply: ModelReply, parsed: ParsedReply) -> None:
    assert isinstance(parsed, ParsedReply)
    history = parsed.history_message
    assert history.role == "assistant"
    assert history.content is None or history.content == reply.text
    assert history.reasoning == reply.reasoning
    ids = [c.id for c in history.tool_calls]
    assert len(ids) == len(set(ids))
    assert all(ids)
    assert all(isinstance(c.arguments, Mapping) for c in history.tool_calls)
    if parsed.kind is DecisionKind.ACTIONS:
        assert parsed.actions
        assert all(isinstance(a.arguments, Mapping) for a in parsed.actions)
        assert parsed.feedback is None
    elif parsed.kind is DecisionKind.FINAL_ANSWER:
        assert parsed.text
        assert parsed.text.strip()
        assert not parsed.actions
    else:
        assert parsed.feedback
        assert parsed.reason
        assert not parsed.actions


@settings(max_examples=400)
@given(parser=parsers, reply=replies, tools=tool_lists)
def test_parsers_never_raise_and_return_well_formed_decisions(
    parser: NativeToolCallParser | JsonToolCallParser,
    reply: ModelReply,
    tools: tuple[ToolSpec, ...],
) -> None:
    parsed = parser.parse(reply, tools)
    check_well_formed(reply, parsed)
    assert parser.parse(reply, tools) == parsed


@given(reply=replies, tools=tool_lists)
def test_native_actions_come_from_the_reply_only(
    reply: ModelReply, tools: tuple[ToolSpec, ...]
) -> None:
    parsed = NativeToolCallParser().parse(reply, tools)
    if parsed.kind is DecisionKind.ACTIONS and (reply.tool_calls or reply.invalid_tool_calls):
        assert len(parsed.actions) == len(reply.tool_calls) + len(reply.invalid_tool_calls)
        assert not any(c.reason == "truncated" for c in reply.invalid_tool_calls)


@given(arguments=json_objects, style=st.sampled_from(["json", "fenced", "python", "spaced"]))
def test_decoding_round_trips_every_safe_encoding(arguments: dict[str, Any], style: str) -> None:
    raw = {
        "json": json.dumps(arguments),
        "fenced": "```json\n" + json.dumps(arguments, indent=2) + "\n```",
        "python": repr(arguments),
        "spaced": "\n  " + json.dumps(arguments, ensure_ascii=False) + "  \n",
    }[style]
    decoded = _repair.decode_arguments(raw)
    assert decoded.arguments == arguments


@given(objects=st.lists(json_objects, min_size=2, max_size=4))
def test_concatenated_objects_are_never_split_or_merged(objects: list[dict[str, Any]]) -> None:
    decoded = _repair.decode_arguments("".join(json.dumps(o) for o in objects))
    assert decoded.arguments is None
    assert decoded.reason == "multiple_json_values"
    assert decoded.count == len(objects)


@given(text=st.text())
def test_decode_arguments_is_total(text: str) -> None:
    decoded = _repair.decode_arguments(text)
    assert (decoded.arguments is None) == (decoded.reason is not None)


def test_synthesised_ids_are_deterministic_and_distinct() -> None:
    assert synthesise_call_id("a", "b") == synthesise_call_id("a", "b")
    assert synthesise_call_id("a", "b") != synthesise_call_id("ab")
    assert synthesise_call_id("\ud800").startswith("call_")
