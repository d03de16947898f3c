"""The real-world parser cases 24-30 (tests/fixtures/cases), replayed through the parsers.

Each case holds an OpenAI-shaped assistant message. The reply is built the way the model
client hands it over: an argument string that decodes to a JSON object becomes
``ToolCall.arguments``; any other argument text becomes an ``InvalidToolCall`` with its raw
text (reason ``truncated`` when the finish reason is ``length``, else ``unparseable``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from treadle.parsers import NativeToolCallParser
from treadle.types import (
    DecisionKind,
    InvalidToolCall,
    Message,
    ModelReply,
    ParsedReply,
    ToolCall,
    ToolSpec,
)

CASES_DIR = Path(__file__).parent / "fixtures" / "cases"
CASE_FILES = sorted(CASES_DIR.glob("2[4-9]-parser-*.json")) + sorted(
    CASES_DIR.glob("30-parser-*.json")
)
KINDS = {
    "tool_calls": DecisionKind.ACTIONS,
    "final_answer": DecisionKind.FINAL_ANSWER,
    "invalid": DecisionKind.INVALID,
}


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def tool_specs(case: dict[str, Any]) -> tuple[ToolSpec, ...]:
    return tuple(
        ToolSpec(name=t["name"], description=t.get("description", ""), parameters=t["parameters"])
        for t in case["context"]["tools"]
    )


def _object_or_none(raw: str) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def reply_of(case: dict[str, Any]) -> ModelReply:
    """Build the `ModelReply` the model client would hand over for the case's message."""
    output = case["model_output"]
    message = output["message"]
    finish = output.get("finish_reason")
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for call in message.get("tool_calls") or []:
        raw = call["function"]["arguments"]
        arguments = _object_or_none(raw)
        if arguments is None:
            reason = "truncated" if finish == "length" else "unparseable"
            invalid.append(
                InvalidToolCall(
                    id=call["id"], name=call["function"]["name"], raw_arguments=raw, reason=reason
                )
            )
        else:
            calls.append(
                ToolCall(id=call["id"], name=call["function"]["name"], arguments=arguments)
            )
    return ModelReply(
        text=message.get("content"),
        tool_calls=tuple(calls),
        invalid_tool_calls=tuple(invalid),
        finish_reason=finish,
    )


def wire_message(message: Message) -> dict[str, Any]:
    """The assistant message in OpenAI wire shape, arguments decoded for comparison."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "name": c.name, "arguments": dict(c.arguments)}
            for c in message.tool_calls
        ]
    return out


def expected_wire(expected: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": expected["role"], "content": expected["content"]}
    if expected.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": c["type"],
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"]),
            }
            for c in expected["tool_calls"]
        ]
    return out


def parse_case(path: Path) -> tuple[dict[str, Any], ParsedReply]:
    case = load(path)
    return case, NativeToolCallParser().parse(reply_of(case), tool_specs(case))


def test_every_parser_case_is_present() -> None:
    numbers = sorted(int(p.name[:2]) for p in CASE_FILES)
    assert numbers == [24, 25, 26, 28, 29, 30]


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: p.stem)
def test_case_decision(path: Path) -> None:
    case, parsed = parse_case(path)
    expected = case["expected_decision"]
    assert parsed.kind is KINDS[expected["type"]]
    if parsed.kind is DecisionKind.ACTIONS:
        assert parsed.text == expected["text"]
        assert list(parsed.repairs) == expected["repairs"]
        assert len(parsed.actions) == len(expected["calls"])
        for action, call in zip(parsed.actions, expected["calls"], strict=True):
            assert action.name == call["name"]
            assert dict(action.arguments) == call["arguments"]
            if call["id"] is None:
                assert action.id.startswith("call_")
                assert len(action.id) > len("call_")
            else:
                assert action.id == call["id"]
    if parsed.kind is DecisionKind.INVALID:
        assert parsed.reason == expected["reason"]
        assert parsed.actions == ()
        assert parsed.feedback


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: p.stem)
def test_case_history_message(path: Path) -> None:
    case, parsed = parse_case(path)
    expected = case["expected_decision"].get("history_message")
    if expected is not None:
        assert wire_message(parsed.history_message) == expected_wire(expected)
    # Whatever the case, every call in history can be answered and none carries raw text.
    ids = [c.id for c in parsed.history_message.tool_calls]
    assert len(ids) == len(set(ids))
    assert all(c.id for c in parsed.history_message.tool_calls)
    assert parsed.history_message.content != "None"


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: p.stem)
def test_case_parse_is_deterministic(path: Path) -> None:
    _, first = parse_case(path)
    _, second = parse_case(path)
    assert first == second


def test_case_24_null_content_stays_null() -> None:
    _, parsed = parse_case(CASES_DIR / "24-parser-null-content-with-tool-calls.json")
    assert parsed.text is None
    assert parsed.history_message.content is None


def test_case_25_empty_string_content_is_no_text() -> None:
    _, parsed = parse_case(CASES_DIR / "25-parser-args-empty-string.json")
    assert parsed.text is None
    assert parsed.history_message.content is None
    assert parsed.history_message.tool_calls[0].arguments == {}


def test_case_28_feedback_names_call_and_tool() -> None:
    case, parsed = parse_case(CASES_DIR / "28-parser-args-concatenated-objects.json")
    expected = case["expected_decision"]["feedback"]
    first_sentence = expected.split(". ")[0] + "."
    assert parsed.feedback is not None
    assert parsed.feedback.startswith(first_sentence)
    assert "one tool call per" in parsed.feedback
    # The sanitised call keeps the model's id, so the hydrator can answer it with the feedback.
    assert [c.id for c in parsed.history_message.tool_calls] == ["call_case28"]


def test_case_30_synthesised_id_is_stable_and_in_history() -> None:
    _, first = parse_case(CASES_DIR / "30-parser-toolcall-json-in-content.json")
    _, second = parse_case(CASES_DIR / "30-parser-toolcall-json-in-content.json")
    assert first.actions[0].id == second.actions[0].id
    assert first.history_message.content is None
    assert first.history_message.tool_calls == first.actions


def test_case_30_undeclared_name_stays_a_final_answer() -> None:
    case = load(CASES_DIR / "30-parser-toolcall-json-in-content.json")
    tools = tuple(s for s in tool_specs(case) if s.name != "get_weather")
    reply = reply_of(case)
    parsed = NativeToolCallParser().parse(reply, tools)
    assert parsed.kind is DecisionKind.FINAL_ANSWER
    assert parsed.text == reply.text
