"""Structured output: Agent(output_type=...) end to end through the scripted model.

The final answer is validated against the output type; one that does not fit is an invalid
decision whose feedback lists the errors, and the run goes on; the output is stored in the
final step record and in run-finished, and `RunResult.output` is typed where the type is known.
"""

from __future__ import annotations

import functools
import json
import typing
from enum import Enum, IntEnum

import attrs
import pytest
from click.testing import CliRunner

import treadle
from treadle._exceptions import RunInterrupted, SnapshotMismatch, UsageError
from treadle.cli import main
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run, run, wait_result
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.types import (
    DecisionKind,
    ModelIntent,
    ModelReply,
    ModelResult,
    RunResult,
    RunState,
    StepRecord,
    StopReason,
    ToolCall,
)


class Sky(Enum):
    CLEAR = "clear"
    FOG = "fog"


@attrs.frozen
class Place:
    name: str
    country: str


@attrs.frozen
class Forecast:
    """A day's forecast.

    Attributes:
        place: where.
        high_c: the day's high, degrees Celsius.
        sky: what the sky does.
        notes: anything else worth saying.
    """

    place: Place
    high_c: int
    sky: Sky
    notes: list[str] = attrs.Factory(list)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "high_c": {"type": "integer"}},
    "required": ["city", "high_c"],
    "additionalProperties": False,
}

GOOD = {"place": {"name": "Paris", "country": "FR"}, "high_c": 18, "sky": "fog"}
STORED = {**GOOD, "notes": []}
TYPED = Forecast(place=Place(name="Paris", country="FR"), high_c=18, sky=Sky.FOG)


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def lookup(city: str) -> str:
    """Look a city's weather up."""
    return f"{city}: 18 C, fog"


def agent(turns, *, output_type=Forecast, mode="tool", parser=None, tools=(lookup,), **kw):
    return treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox(list(tools)),
        parser=parser or treadle.NativeToolCallParser(),
        output_type=output_type,
        output_mode=mode,
        **kw,
    )


async def run_log(definition, run_id="r", store=None):
    store = store or MemoryStore()
    result = await run(definition, "Weather in Paris?", store=store, run_id=run_id)
    return result, await store.read_log(run_id)


# --------------------------------------------------------------------------- valid output


@attrs.frozen
class Price:
    """A price."""

    cents: int = attrs.field(converter=lambda value: value * 100)


@attrs.frozen
class Name:
    """A name."""

    name: str = attrs.field(converter=str.strip)


async def test_an_output_that_reads_back_otherwise_than_it_was_validated_is_never_stored():
    # The stored output is read back into the class for RunResult.output: a converter ran
    # again there, and a run answered cents=5 returned Price(cents=50000) (stored: 500).
    definition = agent([call("final_answer", cents=5)] * 3, output_type=Price)
    result, log = await run_log(definition)
    assert result.stop_reason is StopReason.INVALID_DECISIONS and result.output is None
    assert all(step.output is None for step in log.steps)
    assert "does not read back as it was validated" in (log.steps[0].feedback or "")
    # A converter that gives the same value again is fine: stored and returned alike.
    stripped = agent([call("final_answer", name="  Ada ")], output_type=Name)
    named, named_log = await run_log(stripped, run_id="n")
    assert named.output == Name(name="Ada") and named_log.finished is not None
    assert named_log.finished.output == {"name": "Ada"}


async def test_a_final_answer_tool_call_is_the_typed_output():
    definition = agent([call("lookup", city="Paris"), call("final_answer", **GOOD)])
    result, log = await run_log(definition)
    assert result.state is RunState.SUCCEEDED
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.output == TYPED and isinstance(result.output, Forecast)
    assert log.finished is not None and log.finished.output == STORED
    assert log.steps[-1].decision is DecisionKind.FINAL_ANSWER
    assert log.steps[-1].output == STORED
    # The final-answer tool is declared to the model after the executor's tools, with the
    # output schema as its arguments; it never reaches the executor.
    request = definition.model.requests[0]
    assert [t.name for t in request.tools] == ["lookup", "final_answer"]
    assert request.tools[-1].parameters == definition.snapshot()["output"]["schema"]
    assert request.output is None
    assert [r.tool for r in log.records if hasattr(r, "tool")] == ["lookup", "lookup"]


class Unit(str, Enum):  # noqa: UP042 (a str-mixin enum, as StrEnum is not)
    CELSIUS = "C"
    FAHRENHEIT = "F"


class Confidence(IntEnum):
    LOW = 1
    HIGH = 2


@attrs.frozen
class Reading:
    """A reading."""

    unit: Unit
    confidence: Confidence


async def test_an_int_or_str_enum_field_is_its_member_and_stored_as_its_value():
    """An output's enum field holds the member, and the log holds its value.

    Such a field took any int or str and gave it as is, never the member; once it gives the
    member, the log still holds the value (cattrs writes a str subclass as itself).
    """
    definition = agent([call("final_answer", unit="F", confidence=2)], output_type=Reading)
    result, log = await run_log(definition)
    assert result.output is not None
    assert type(result.output.unit) is Unit and type(result.output.confidence) is Confidence
    assert result.output == Reading(unit=Unit.FAHRENHEIT, confidence=Confidence.HIGH)
    assert log.finished is not None and log.finished.output == {"unit": "F", "confidence": 2}
    stored = log.finished.output
    assert isinstance(stored, dict) and [type(v) for v in stored.values()] == [str, int]
    refused = agent([call("final_answer", unit="K", confidence=3)] * 3, output_type=Reading)
    _, refused_log = await run_log(refused, run_id="k")
    assert refused_log.steps[0].feedback is not None
    assert "expected one of 'C', 'F', got 'K' @ $.unit" in refused_log.steps[0].feedback
    assert "expected one of 1, 2, got 3 @ $.confidence" in refused_log.steps[0].feedback


async def test_native_mode_asks_for_the_schema_on_every_request_and_reads_the_text():
    definition = agent(
        [call("lookup", city="Paris"), say(json.dumps(GOOD))], mode="native", tools=(lookup,)
    )
    result, _ = await run_log(definition)
    assert result.output == TYPED
    assert result.final_answer == json.dumps(GOOD)
    for request in definition.model.requests:
        assert request.output is not None
        assert request.output.name == "Forecast"
        assert request.output.description == "A day's forecast."
        assert request.output.schema["properties"]["high_c"]["description"].startswith("the day")
        assert [t.name for t in request.tools] == ["lookup"]


async def test_a_json_schema_output_is_its_json_value():
    definition = agent([say('```json\n{"city": "Paris", "high_c": 18}\n```')], output_type=SCHEMA)
    result, log = await run_log(definition)
    assert result.output == {"city": "Paris", "high_c": 18}
    assert log.finished is not None and log.finished.output == {"city": "Paris", "high_c": 18}
    assert definition.snapshot()["output"]["strict"] is True  # closed, all required


async def test_the_json_tool_call_parser_reads_a_final_answer_written_as_text():
    text = json.dumps({"name": "final_answer", "arguments": GOOD})
    result, _ = await run_log(agent([say(text)], parser=treadle.JsonToolCallParser()))
    assert result.output == TYPED


PROPOSAL = {
    "type": "object",
    "description": "The tool call you propose for a human to review.",
    "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("mode", ["native", "tool"])
async def test_an_answer_shaped_like_a_tool_call_is_the_answer_and_runs_nothing(mode):
    # A text answer {"name": <a declared tool>, "arguments": {...}} was read as a tool call
    # written in the content: lookup ran (twice) and the run ended max_steps without output.
    answer = {"name": "lookup", "arguments": {"city": "Paris"}}
    definition = agent(
        [say(json.dumps(answer))] * 2,
        output_type=PROPOSAL,
        mode=mode,
        budgets=treadle.Budgets(max_steps=2),
    )
    result, log = await run_log(definition)
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.output == answer
    assert [s.decision for s in log.steps] == [DecisionKind.FINAL_ANSWER]
    assert log.steps[0].repairs == ()
    assert not [r for r in log.records if type(r).__name__ == "ActionIntent"]


async def test_a_tool_call_written_in_the_content_that_is_no_answer():
    # Tool mode: a call in the content that does not fit the output is still the call.
    in_content = say(json.dumps({"name": "lookup", "arguments": {"city": "Paris"}}))
    result, log = await run_log(agent([in_content, call("final_answer", **GOOD)]))
    assert result.output == TYPED
    assert log.steps[0].decision is DecisionKind.ACTIONS
    assert log.steps[0].repairs == ("tool_call_from_content",)
    # Native mode: the text is the answer, so it is checked as one and fed back.
    native = agent([in_content, say(json.dumps(GOOD))], mode="native")
    result, log = await run_log(native)
    assert result.output == TYPED
    assert log.steps[0].decision is DecisionKind.INVALID
    assert "does not fit the output schema" in (log.steps[0].feedback or "")
    assert not [r for r in log.records if type(r).__name__ == "ActionIntent"]


async def test_a_call_written_in_the_content_runs_when_the_output_takes_any_object():
    # Tool mode, an output with no required property: {"name": "lookup", "arguments": ...}
    # fitted it, so the call was taken as the final answer and lookup never ran.
    loose = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "sources": {"type": "array"}},
    }
    in_content = say(json.dumps({"name": "lookup", "arguments": {"city": "Paris"}}))
    answer = {"answer": "mild", "sources": ["lookup"]}
    result, log = await run_log(
        agent([in_content, call("final_answer", **answer)], output_type=loose)
    )
    assert result.output == answer
    assert log.steps[0].decision is DecisionKind.ACTIONS
    assert log.steps[0].repairs == ("tool_call_from_content",)
    assert [r for r in log.records if type(r).__name__ == "ActionIntent"]


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def respond(content: str) -> str:
    """Say something to the user."""
    return "the user read it"


async def test_a_text_reply_tool_takes_text_but_not_the_answer():
    # With a text-reply tool, a text reply is a message; one that is the answer (tool mode:
    # a JSON object fitting the output) was a message too, and the run never ended.
    parser = treadle.NativeToolCallParser(text_reply_tool="respond")
    turns = [say("Let me check."), say(json.dumps(GOOD))]
    result, log = await run_log(agent(turns, parser=parser, tools=(respond,)))
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.output == TYPED
    assert [s.decision for s in log.steps] == [DecisionKind.ACTIONS, DecisionKind.FINAL_ANSWER]
    # Native mode: every text reply would be a message, and no answer could ever be given.
    with pytest.raises(UsageError, match="text_reply_tool"):
        agent([], parser=parser, mode="native", tools=(respond,))


@attrs.define
class Doubled:
    """A total and its double, computed."""

    total: int
    doubled: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.doubled = self.total * 2


async def test_a_field_the_class_computes_is_not_asked_of_the_model():
    # The schema listed doubled as required (strict: true) while validation refused it as
    # an extra field: a strict server could never give an answer that fits.
    definition = agent([call("final_answer", total=2)], output_type=Doubled)
    schema = definition.snapshot()["output"]["schema"]
    assert schema["properties"] == {"total": {"type": "integer"}}
    assert schema["required"] == ["total"] and definition.snapshot()["output"]["strict"]
    result, log = await run_log(definition)
    assert result.output == Doubled(total=2) and result.output.doubled == 4
    assert log.steps[-1].output == {"total": 2}


def test_a_computed_field_nothing_sets_is_refused():
    # The answer was stored, and RunResult.output held attrs' NOTHING in its place.
    unset = attrs.make_class(
        "Unset", {"total": attrs.field(type=int), "note": attrs.field(init=False, type=str)}
    )
    with pytest.raises(UsageError, match="'note' is init=False with no default"):
        agent([], output_type=unset)
    inner = attrs.make_class(
        "Inner", {"a": attrs.field(type=int), "b": attrs.field(init=False, default=0, type=int)}
    )
    outer = attrs.make_class("Outer", {"inner": attrs.field(type=inner)})
    with pytest.raises(UsageError, match="'b' of Inner is init=False"):
        agent([], output_type=outer)


# --------------------------------------------------------------------------- invalid output


async def test_a_schema_violation_is_an_invalid_decision_listing_every_error():
    bad = {"place": {"name": "Paris"}, "high_c": "warm", "sky": "rain", "wind": 3}
    definition = agent([call("final_answer", **bad), call("final_answer", **GOOD)])
    result, log = await run_log(definition)
    assert result.output == TYPED
    first = log.steps[0]
    assert first.decision is DecisionKind.INVALID and first.output is None
    feedback = first.feedback or ""
    assert "does not fit the output schema" in feedback
    for error in (
        "required field missing @ $.place.country",
        "expected an integer, got string @ $.high_c",
        "expected one of 'clear', 'fog', got 'rain' @ $.sky",
        "wind",
    ):
        assert error in feedback
    # The model sees the feedback as the answer to its final-answer call.
    second = definition.model.requests[1].messages
    assert second[-1].role == "tool" and second[-1].content == feedback
    assert second[-2].tool_calls[0].name == "final_answer"


async def test_text_that_is_not_json_is_an_invalid_decision_then_a_valid_answer_ends_the_run():
    definition = agent(
        [say("It is foggy."), say('{"city": "Paris", "high_c": "18"}'), say(json.dumps(GOOD))],
        mode="native",
    )
    result, log = await run_log(definition)
    assert result.output == TYPED
    assert [s.decision for s in log.steps] == [DecisionKind.INVALID] * 2 + [
        DecisionKind.FINAL_ANSWER
    ]
    not_json, wrong = (s.feedback or "" for s in log.steps[:2])
    assert "not one JSON object" in not_json and "Expecting value" in not_json
    assert "Answer with one JSON object that fits the schema" in not_json
    assert "required field missing @ $.place" in wrong and "city" in wrong
    assert definition.model.requests[1].messages[-1].content == not_json


async def test_a_json_schema_violation_lists_the_validators_errors():
    definition = agent(
        [say('{"city": 3, "high_c": 1.5, "extra": true}'), say('{"city": "P", "high_c": 1}')],
        output_type=SCHEMA,
        mode="native",
    )
    result, log = await run_log(definition)
    assert result.output == {"city": "P", "high_c": 1}
    feedback = log.steps[0].feedback or ""
    assert "3 is not of type 'string' @ $.city" in feedback
    assert "1.5 is not of type 'integer' @ $.high_c" in feedback
    assert "Additional properties are not allowed ('extra' was unexpected) @ $" in feedback


async def test_an_output_schemas_patterns_are_left_to_the_provider():
    # They were matched with Python's re on the run's thread: against ^(a+)+$ an answer of
    # 30 a's and a "!" held every run of the process for longer than a lease lasts.
    schema = {
        "type": "object",
        "properties": {
            "v": {"type": "string", "pattern": "^(a+)+$"},
            "tags": {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}},
            "size": {"type": "number"},
        },
        "required": ["v"],
        "additionalProperties": False,
    }
    answers = [
        say(json.dumps({"v": "aaaaa!", "tags": {"x-a": "no"}, "size": 10**400})),
        say(json.dumps({"v": "aaaaa!", "tags": {"x-a": "no"}, "size": 1.5})),
    ]
    result, log = await run_log(agent(answers, output_type=schema, mode="native"))
    assert result.output == {"v": "aaaaa!", "tags": {"x-a": "no"}, "size": 1.5}
    # Every other keyword is checked: a number is one a float holds, as a float field's.
    assert [step.decision for step in log.steps] == [
        DecisionKind.INVALID,
        DecisionKind.FINAL_ANSWER,
    ]
    assert "is not of type 'number' @ $.size" in (log.steps[0].feedback or "")


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ('{"x": 1e400}', "a number JSON cannot represent (NaN or infinity, such as 1e400) @ $"),
        ('{"x":' + '{"x":' * 80 + "1" + "}" * 81, "nest deeper than 64 levels @ $"),
    ],
)
async def test_an_answer_the_log_cannot_keep_as_it_is_is_refused(tmp_path, answer, said):
    # 1e400 decodes to infinity: the run returned {'x': inf} and stored {'x': null}, which
    # the schema refuses. An answer nested 400 deep was stored, and `treadle show --json`
    # died on it with a RecursionError. Both are refused as tool arguments are.
    definition = agent(
        [say(answer), say('{"x": 2.5}')], output_type={"type": "object"}, mode="native"
    )
    async with treadle.open_sqlite_store(str(tmp_path / "runs.db")) as store:
        result, log = await run_log(definition, store=store)
        assert result.output == {"x": 2.5}
        assert (await wait_result(store, "r")).output == {"x": 2.5}
    assert log.steps[0].decision is DecisionKind.INVALID and said in (log.steps[0].feedback or "")


@attrs.frozen
class Bounded:
    """A range, checked by a validator and by ``__attrs_post_init__``."""

    low: int = attrs.field(validator=attrs.validators.ge(-50))
    high: int

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low must not exceed high")


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"low": -100, "high": 1}, "'low' must be >= -50: -100"),
        ({"low": 5, "high": 1}, "low must not exceed high"),
    ],
)
async def test_what_an_output_class_validator_says_reaches_the_model(bad, said):
    # The feedback was only "invalid value @ $": the model could not tell what to fix.
    definition = agent(
        [call("final_answer", **bad), call("final_answer", low=1, high=5)], output_type=Bounded
    )
    result, log = await run_log(definition)
    assert result.output == Bounded(low=1, high=5)
    assert f"invalid value: {said} @ $" in (log.steps[0].feedback or "")


@attrs.frozen
class Graded:
    """A grade, a code, and a lookup done when made."""

    grade: str = attrs.field(validator=attrs.validators.in_(["A", "B"]))
    code: str = attrs.field(validator=attrs.validators.matches_re(r"[A-Z]{3}"))
    points: list[Bounded] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        {"A": 1, "B": 2}[self.grade + "-" + self.code[:0]]  # raises KeyError("A-")


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (
            {"grade": "Z", "code": "ABC"},
            "invalid value: 'grade' must be in ['A', 'B'] (got 'Z') @ $.grade",
        ),
        (
            {"grade": "A", "code": "abc"},
            "invalid value: 'code' must match regex '[A-Z]{3}' ('abc' doesn't) @ $.code",
        ),
        ({"grade": "A", "code": "ABC"}, "invalid value: KeyError: A- @ $"),
        (
            {"grade": "A", "code": "ABC", "points": [{"low": 1, "high": 2}, {"low": 3, "high": 2}]},
            "invalid value: low must not exceed high @ $.points[1]",
        ),
    ],
)
async def test_attrs_validators_say_what_is_wrong_and_where(bad, said):
    # An in_ or matches_re validator reached the model as the repr of its arguments
    # ("(\"'grade' must be in ...\", Attribute(name='grade', ...), ...) @ $"), and a KeyError
    # raised by __attrs_post_init__ read "required field missing @ $".
    definition = agent(
        [call("final_answer", **bad)],
        output_type=Graded,
        limits=treadle.Limits(invalid_decisions=1),
    )
    _, log = await run_log(definition)
    feedback = log.steps[0].feedback or ""
    assert said in feedback
    assert "Attribute(" not in feedback and "required field missing" not in feedback


async def test_invalid_answers_are_bounded_by_the_invalid_decisions_limit():
    definition = agent([say("no")] * 5, mode="native")
    result, log = await run_log(definition)
    assert result.stop_reason is StopReason.INVALID_DECISIONS
    assert result.output is None and len(log.steps) == 3
    assert log.finished is not None and log.finished.output is None


async def test_the_final_answer_tool_called_with_other_tools_runs_none_of_them():
    both = calls(
        ToolCall(id="c1", name="lookup", arguments={"city": "Paris"}),
        ToolCall(id="c2", name="final_answer", arguments=GOOD),
    )
    definition = agent([both, call("final_answer", **GOOD)])
    result, log = await run_log(definition)
    assert result.output == TYPED
    assert log.steps[0].decision is DecisionKind.INVALID
    assert "must be called alone" in (log.steps[0].feedback or "")
    assert not [r for r in log.records if type(r).__name__ == "ActionIntent"]


async def test_a_refusal_ends_the_run_without_output():
    refused = ModelReply(refusal="I can't help with that.", finish_reason="stop")
    result, _ = await run_log(agent([refused], mode="native"))
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.output is None
    assert result.final_answer == "I can't help with that."


# --------------------------------------------------------------------------- the definition


def test_the_snapshot_has_an_output_key_only_with_an_output_type():
    plain = treadle.Agent(
        model=ScriptedModel(turns=[]),
        executor=treadle.Toolbox([lookup]),
        parser=treadle.NativeToolCallParser(),
    )
    assert "output" not in plain.snapshot()
    assert plain.model_tools() == plain.executor.tool_specs()
    with_output = attrs.evolve(plain, output_type=Forecast)
    assert set(with_output.snapshot()) - set(plain.snapshot()) == {"output"}
    output = with_output.snapshot()["output"]
    assert output["mode"] == "tool" and output["name"] == "final_answer"
    assert output["strict"] is False  # notes has a default
    assert output["schema"]["required"] == ["place", "high_c", "sky"]
    assert output["schema"]["$defs"]["Place"]["additionalProperties"] is False
    assert with_output.version_label != plain.version_label


def closed(**properties):
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("schema", "strict"),
    [
        (closed(city={"type": "string"}), True),
        # open objects behind a list of types, or a schema that takes anything
        (closed(meta={"type": ["object", "null"]}), False),
        (closed(meta={}), False),
        (closed(meta={"description": "anything"}), False),
        (closed(meta={**closed(a={"type": "integer"}), "type": ["object", "null"]}), True),
        # a property named like a keyword is a property, not a schema's keyword
        (closed(properties={"type": "string"}), True),
        (closed(required={"type": "string"}, items={"type": "integer"}), True),
        (closed(tags={"type": "array", "items": {"type": "object"}}), False),
        (
            closed(x={"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]})
            | {"$defs": {"A": closed(a={"type": "integer"})}},
            True,
        ),
        (closed(x={"$ref": "#/$defs/A"}) | {"$defs": {"A": {"type": "object"}}}, False),
        (closed(x={"enum": [{"any": "object"}]}), True),
        (closed() | {"patternProperties": {"^x": {"type": "integer"}}}, False),
    ],
)
def test_strict_is_true_exactly_when_every_object_is_closed_and_fully_required(schema, strict):
    # {"type": ["object", "null"]} and {} were sent strict (objects found by type ==
    # "object" alone); a property named "properties" was walked as if it were a schema.
    assert agent([], output_type=schema, mode="native").output.strict is strict


def test_auto_mode_follows_the_clients_native_output():
    openai = treadle.OpenAIChatClient(base_url="http://127.0.0.1:1/v1")
    anthropic = treadle.AnthropicMessagesClient(api_key="k")
    plain_openai = treadle.OpenAIChatClient(base_url="http://127.0.0.1:1/v1", native_output=False)
    modes = [
        treadle.Agent(
            model=client,
            executor=treadle.Toolbox([lookup]),
            parser=treadle.NativeToolCallParser(),
            output_type=Forecast,
        ).snapshot()["output"]["mode"]
        for client in (openai, anthropic, plain_openai, ScriptedModel(turns=[]))
    ]
    assert modes == ["native", "tool", "tool", "tool"]
    with pytest.raises(UsageError, match="native structured output"):
        treadle.Agent(
            model=anthropic,
            executor=treadle.Toolbox([]),
            parser=treadle.NativeToolCallParser(),
            output_type=Forecast,
            output_mode="native",
        )


MIXED = Enum("MIXED", {"RED": "red", "ONE": 1})


@treadle.tool(name="final_answer")
async def clashing(text: str) -> str:
    """A tool named like the final-answer tool."""
    return text


@pytest.mark.parametrize(
    ("output_type", "mode", "tools", "said"),
    [
        ({"type": "array"}, "tool", (), "top level must be"),
        ({"type": "object", "properties": 3}, "tool", (), "not a valid JSON schema"),
        (  # passed check_schema; the first answer then interrupted the run at every resume
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
            "native",
            (),
            r"\$ref '#/\$defs/Missing' names nothing in the schema",
        ),
        (
            {"type": "object", "anyOf": [{"$ref": "https://example.com/s.json"}]},
            "tool",
            (),
            "a reference must point inside it",
        ),
        (str, "tool", (), "attrs class or a JSON schema"),
        # a RecursionError at Agent(): objects nested 100 deep
        (
            functools.reduce(
                lambda inner, _: {"type": "object", "properties": {"a": inner}},
                range(100),
                {"type": "integer"},
            ),
            "tool",
            (),
            "the schema nests too deeply to be checked",
        ),
        (Forecast, "sometimes", (), "output_mode must be"),
        (Forecast, "tool", (clashing,), "a tool named 'final_answer'"),
        (attrs.make_class("Bad", {"when": attrs.field(type=set)}), "tool", (), "unsupported"),
        (  # its schema held inf, which no request and no snapshot can carry
            attrs.make_class("Capped", {"cap": attrs.field(type=float, default=float("nan"))}),
            "tool",
            (),
            "output_type Capped, field 'cap': the default nan has no JSON form",
        ),
        (  # was "tool 'Mixed': cannot describe the arguments", naming no field
            attrs.make_class("Mixed", {"c": attrs.field(type=MIXED)}),
            "tool",
            (),
            r"output_type Mixed, field 'c': unsupported type <enum 'MIXED'> \(enum values must "
            r"be all str or all int, not both: 'red', 1\)",
        ),
    ],
)
def test_unusable_output_types_are_refused_when_the_agent_is_built(output_type, mode, tools, said):
    with pytest.raises(UsageError, match=said):
        agent([], output_type=output_type, mode=mode, tools=tools)


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        (
            {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/required"}}},
            """$ref '#/required' names ["a"], which is no schema""",
        ),
        (
            {
                "type": "object",
                "properties": {"n": {"maximum": 5}, "a": {"$ref": "#/properties/n/maximum"}},
            },
            "$ref '#/properties/n/maximum' names 5, which is no schema",
        ),
        (
            {"type": "object", "properties": {"a": {"$dynamicRef": "#/type"}}},
            """$dynamicRef '#/type' names "object", which is no schema""",
        ),
        (  # an object, but in no schema's place: check_schema never looked at it
            {
                "type": "object",
                "properties": {
                    "e": {"enum": [{"type": 5}]},
                    "a": {"$ref": "#/properties/e/enum/0"},
                },
            },
            """names {"type": 5}, which is no valid schema (5 is not valid""",
        ),
    ],
)
def test_references_to_what_is_no_schema_are_refused(schema, said):
    # Accepted before: validating any answer then raised AttributeError or TypeError inside
    # jsonschema, interrupting the run at every attempt and every resume.
    with pytest.raises(UsageError) as refused:
        agent([], output_type=schema)
    assert said in str(refused.value)
    assert "a reference must point at a schema" in str(refused.value)


def looping(**defs):
    return {"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize(
    ("schema", "loop"),
    [
        (looping(a={"$ref": "#/$defs/b"}, b={"$ref": "#/$defs/a"}), "#/$defs/a → #/$defs/b"),
        (looping(a={"allOf": [{"$ref": "#/$defs/a"}]}), "#/$defs/a → #/$defs/a/allOf/0"),
        (
            looping(a={"anyOf": [{"type": "string"}, {"$ref": "#/$defs/a"}]}),
            "#/$defs/a → #/$defs/a/anyOf/1",
        ),
        ({"type": "object", "$ref": "#"}, "#"),
    ],
)
def test_references_looping_without_descending_into_the_value_are_refused(schema, loop):
    # Accepted before: every attempt and every resume then died of RecursionError while
    # validating the answer, as a→b→a applies itself to the same value without end.
    with pytest.raises(UsageError) as refused:
        agent([], output_type=schema)
    start = loop.split()[0]
    expected = f"references loop without descending into the value ({loop} → {start})"
    assert expected in str(refused.value)


def chained(length, tail):
    """A schema applying ``length`` references in a row to the answer, then ``tail``."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = tail
    return {"type": "object", "$ref": "#/$defs/d0", "$defs": defs}


TREE = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
}


async def test_references_chained_too_deep_for_the_validator_are_refused():
    # A chain of 600 references (no loop) was accepted, then every answer raised
    # RecursionError inside the run: it was interrupted, and again at every resume.
    with pytest.raises(UsageError) as refused:
        agent([], output_type=chained(600, {"type": "object"}))
    said = str(refused.value)
    assert "could apply 602 schemas one within another (at most 300" in said
    assert "is # → … → #/$defs/d600 (602 schemas)" in said
    # A chain short enough alone, applied again at each level of an answer nested as deep
    # as an answer may be, would exhaust the stack as surely.
    tree = {**TREE, "properties": {**TREE["properties"], "kids": {"items": {"$ref": "#/$defs/d0"}}}}
    with pytest.raises(UsageError, match="could apply 329 schemas"):
        agent([], output_type=chained(7, tree))
    # Within the bound (296 schemas), the deepest answer the log can keep is checked.
    deepest: dict = {"x": 1, "kids": []}
    for _ in range(31):  # an object and an array a level: 64 levels
        deepest = {"x": 1, "kids": [deepest]}
    definition = agent([call("final_answer", **deepest)], output_type=chained(6, tree))
    result, _ = await run_log(definition)
    assert result.output == deepest


JSON_VALUE = {
    "$defs": {
        "v": {
            "anyOf": [
                {"type": "string"},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {"$ref": "#/$defs/obj"},
                {"$ref": "#/$defs/arr"},
            ]
        },
        "obj": {"type": "object", "additionalProperties": {"$ref": "#/$defs/v"}},
        "arr": {"type": "array", "items": {"$ref": "#/$defs/v"}},
    },
    "type": "object",
    "properties": {"value": {"$ref": "#/$defs/v"}},
    "required": ["value"],
}


@pytest.mark.parametrize("container", ["array", "object"])
async def test_the_usual_recursive_json_value_schema_is_accepted_and_checks_the_deepest_answer(
    container,
):
    # It was refused when the agent was built ("could apply 257 schemas ... at most 250"),
    # yet an answer nested as deep as the log keeps validates well inside the stack.
    value: object = 1
    for _ in range(63):  # with the top-level object: 64 levels
        value = [value] if container == "array" else {"k": value}
    result, _ = await run_log(agent([call("final_answer", value=value)], output_type=JSON_VALUE))
    assert result.output == {"value": value}


async def test_a_recursive_schema_descending_into_the_value_validates_a_tree():
    node = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        },
        "required": ["name"],
    }
    schema = {
        "type": "object",
        "$defs": {"node": node},
        "properties": {"tree": {"$ref": "#/$defs/node"}, "same": {"$ref": "#"}},
    }
    bad = {"tree": {"name": "a", "children": [{"name": "b", "children": [{"name": 3}]}]}}
    good = {"tree": {"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]}}
    definition = agent(
        [call("final_answer", **bad), call("final_answer", **good)], output_type=schema
    )
    result, log = await run_log(definition)
    assert result.output == good
    assert "3 is not of type 'string' @ $.tree.children[0].children[0].name" in (
        log.steps[0].feedback or ""
    )


# A quoted name inside a type, as a module without ``from __future__ import annotations``
# writes a recursive class (``kids: list["Tree"]``) or one defined further down
# (``best: Optional["Pick"]``): the type holds the name, not the class.
Tree = attrs.make_class(
    "Tree",
    {"name": attrs.field(type=str), "kids": attrs.field(type=list["Tree"], factory=list)},
    frozen=True,
)
Pick = attrs.make_class("Pick", {"a": attrs.field(type=int)}, frozen=True)
Best = attrs.make_class("Best", {"best": attrs.field(type=typing.Optional["Pick"])}, frozen=True)


async def test_an_output_class_naming_a_class_in_quotes_inside_a_type_validates_answers():
    # The schema read the resolved types, the validation did not: the recursive class
    # interrupted every run (StructureHandlerNotFoundError) at every resume, and the
    # optional one refused every answer ("unknown error (Unsupported type: ForwardRef").
    tree = agent([call("final_answer", name="r", kids=[{"name": "k"}])], output_type=Tree)
    result, log = await run_log(tree)
    assert result.output == Tree(name="r", kids=[Tree(name="k")])
    assert log.finished is not None
    assert log.finished.output == {"name": "r", "kids": [{"name": "k", "kids": []}]}
    answers = [call("final_answer", best={"a": "1"}), call("final_answer", best={"a": 1})]
    result, log = await run_log(agent(answers, output_type=Best))
    assert result.output == Best(best=Pick(a=1))
    assert log.steps[0].feedback is not None
    assert "expected an integer, got string @ $.best.a" in log.steps[0].feedback


def test_an_ecma_262_pattern_re_cannot_compile_is_a_valid_output_schema():
    # The meta-schema's "regex" format was checked with Python's re: named groups and
    # Unicode property escapes, valid JSON Schema, were refused as "not a 'regex'".
    version = {"type": "string", "pattern": r"^(?<major>\d+)\.(?<minor>\d+)$"}
    emoji = {"type": "string", "pattern": r"^\p{Extended_Pictographic}+$"}
    schema = {
        "type": "object",
        "properties": {"v": version, "e": {"$ref": "#/$defs/emoji"}},
        "$defs": {"emoji": emoji},
    }
    assert agent([], output_type=schema).output_type == schema
    with pytest.raises(UsageError, match="not a valid JSON schema: 3 is not of type 'string'"):
        agent([], output_type={"type": "object", "properties": {"v": {"pattern": 3}}})


def test_references_inside_the_schema_are_accepted():
    defs = {"Temp": {"type": "number"}}
    nested = {"$id": "https://example.com/n.json", "$defs": {"Z": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "t": {"$ref": "#/$defs/Temp"},
            "n": {**nested, "$ref": "#/$defs/Z"},  # resolved from its own $id
            "again": {"items": {"$ref": "#"}},
        },
        "$defs": defs,
    }
    assert agent([], output_type=schema).output_type == schema


async def test_changing_the_output_type_of_an_unfinished_run_is_a_snapshot_mismatch():
    memory = MemoryStore()
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent([call("final_answer", **GOOD)]),
            "Weather in Paris?",
            store=CrashingStore(inner=memory, crash_at=3),
            run_id="r",
        )
    with pytest.raises(SnapshotMismatch) as info:
        await run(agent([], output_type=SCHEMA), "Weather in Paris?", store=memory, run_id="r")
    assert info.value.keys == ["output"]


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("mode", ["tool", "native"])
async def test_a_crash_right_after_the_final_model_result_resumes_to_the_same_output(mode):
    final = call("final_answer", **GOOD) if mode == "tool" else say(json.dumps(GOOD))
    turns = [call("lookup", city="Paris"), final]
    expected, baseline = await run_log(agent(turns, mode=mode))
    # The write that stores the final step's model result.
    ops = _write_ops(baseline)
    crash_at = max(i for i, kinds in enumerate(ops, start=1) if kinds == ("ModelResult",))
    memory = MemoryStore()
    crashed = agent(turns, mode=mode)
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            crashed,
            "Weather in Paris?",
            store=CrashingStore(inner=memory, crash_at=crash_at, when="after"),
            run_id="r",
        )
    log = await memory.read_log("r")
    assert isinstance(log.records[-1], ModelResult) and log.records[-1].reply is not None
    resumed = agent(turns, mode=mode)
    result = await run(resumed, "Weather in Paris?", store=memory, run_id="r")
    # The stored reply is parsed and checked again: no new model call.
    assert resumed.model.requests == []
    assert result.output == expected.output == TYPED
    log = await memory.read_log("r")
    assert log.finished is not None and log.finished.output == STORED
    assert sum(isinstance(r, ModelIntent) for r in log.records) == 2


def _write_ops(log):
    """The baseline's store writes as tuples of record class names (one step write is one)."""
    ops: list[tuple[str, ...]] = []
    pending: list[str] = []
    for record in log.records:
        name = type(record).__name__
        if name == "ActionResult":
            pending.append(name)
            continue
        ops.append((*pending, name))
        pending = []
    return ops


async def test_a_crash_after_the_final_step_record_finishes_with_the_stored_output():
    turns = [call("final_answer", **GOOD)]
    memory = MemoryStore()
    # Writes: run-started, model intent, model result, step (crash after it), run-finished.
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent(turns),
            "Weather in Paris?",
            store=CrashingStore(inner=memory, crash_at=4, when="after"),
            run_id="r",
        )
    assert isinstance((await memory.read_log("r")).records[-1], StepRecord)
    resumed = agent(turns)
    result = await run(resumed, "Weather in Paris?", store=memory, run_id="r")
    assert resumed.model.requests == []
    assert result.output == TYPED


# --------------------------------------------------------------------------- read back


async def test_a_finished_run_read_back_gives_its_output_typed_or_as_json(tmp_path):
    db = tmp_path / "runs.db"
    async with treadle.open_sqlite_store(db) as store:
        await run(agent([call("final_answer", **GOOD)]), "Weather?", store=store, run_id="r")
    async with treadle.open_sqlite_store(db) as store:
        again = agent([])
        async with open_run(again, store=store, run_id="r") as handle:
            result = await handle.wait()
        assert result.output == TYPED  # the agent knows its output type
        assert again.model.requests == []
        stored = await wait_result(store, "r")
        assert stored.output == STORED  # read without the agent: JSON data
        typed = await wait_result(store, "r", output_type=Forecast)
        assert typed.output == TYPED
        finished = (await store.read_log("r")).finished
    assert finished is not None
    assert RunResult.from_finished(finished).output == STORED
    assert RunResult.from_finished(finished, output_type=SCHEMA).output == STORED
    assert RunResult.from_finished(finished, output_type=Forecast).output == TYPED
    with pytest.raises(UsageError, match="does not fit Place"):
        RunResult.from_finished(finished, output_type=Place)


def test_show_and_wait_display_the_output(tmp_path):
    import trio

    db = tmp_path / "runs.db"

    async def go():
        async with treadle.open_sqlite_store(db) as store:
            await run(agent([call("final_answer", **GOOD)]), "Weather?", store=store, run_id="r")

    trio.run(go)
    runner = CliRunner()
    shown = runner.invoke(main, ["show", "r", "--store", str(db)], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    assert "output" in shown.output and '"high_c": 18' in shown.output
    events = runner.invoke(main, ["show", "r", "--store", str(db), "--json"])
    finished = json.loads(events.output.splitlines()[-1])
    assert finished["kind"] == "run_finished" and finished["output"] == STORED
    waited = runner.invoke(main, ["wait", "r", "--store", str(db), "--json"])
    assert waited.exit_code == 0, waited.output
    assert json.loads(waited.output)["output"] == STORED
    plain = runner.invoke(main, ["wait", "r", "--store", str(db)])
    assert '"sky": "fog"' in plain.output


# --------------------------------------------------------------------------- real crashes

DRIVER = '''
import json, sys
import attrs, trio
import treadle
from treadle.testing.crashdriver import CRASH_DRIVER_OWNER, KillingStore
from treadle.testing.scripted import ScriptedModel, call

@attrs.frozen
class Answer:
    city: str
    high_c: int

@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def lookup(city: str) -> str:
    """Look a city's weather up."""
    return "18 C"

class SettlingKiller(KillingStore):
    """Dies before write ``kill_at``, after a pause that lets the committer's linger commit
    the writes queued before it (so that they are durable when the process dies)."""

    async def before_write(self, op, records, seq):
        if self.writes + 1 == self.kill_at and self.when == "before":
            await trio.sleep(0.2)
        return await super().before_write(op, records, seq)

async def main(db, kill_at, when):
    model = ScriptedModel(turns=[call("lookup", city="Paris"), call("final_answer", city="Paris", high_c=18)])
    agent = treadle.Agent(
        model=model,
        executor=treadle.Toolbox([lookup]),
        parser=treadle.NativeToolCallParser(),
        output_type=Answer,
    )
    async with treadle.open_sqlite_store(db) as sqlite:
        store = SettlingKiller(inner=sqlite, kill_at=kill_at or None, when=when)
        # One owner for every incarnation: each starts after the one before died.
        result = await treadle.run(
            agent, "Weather?", store=store, run_id="r", owner=CRASH_DRIVER_OWNER
        )
    print(json.dumps({"output": repr(result.output), "requests": len(model.requests)}))

trio.run(main, sys.argv[1], int(sys.argv[2]), sys.argv[3])
'''


@pytest.mark.parametrize(
    ("kill_at", "when"),
    [
        (7, "after"),  # right after the final model result was queued
        (8, "before"),  # the final model result committed, the step record never written
        (8, "after"),  # right after the final step record was queued
        (9, "after"),  # run-finished durable: the stored result, nothing re-run
    ],
)
def test_a_process_killed_in_the_final_step_resumes_to_the_same_output(tmp_path, kill_at, when):
    import subprocess
    import sys

    import trio

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    db = tmp_path / "runs.db"
    killed = subprocess.run(
        [sys.executable, str(script), str(db), str(kill_at), when],
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr.decode()

    async def read():
        async with treadle.open_sqlite_store(db) as store:
            return await store.read_log("r")

    before = trio.run(read)
    assert (before.finished is not None) == (kill_at == 9)
    resumed = subprocess.run(
        [sys.executable, str(script), str(db), "0", "after"], capture_output=True, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr.decode()
    outcome = json.loads(resumed.stdout)
    assert outcome["output"] == "Answer(city='Paris', high_c=18)"
    after = trio.run(read)
    assert after.finished is not None
    assert after.finished.output == {"city": "Paris", "high_c": 18}
    # The resume table: a stored model reply is parsed again and never asked for again; a
    # model intent whose result the kill lost is abandoned and asked once more.
    finals = [r for r in before.records if isinstance(r, ModelResult) and r.step == 2]
    assert outcome["requests"] == (0 if finals else 1)
    abandoned = [r for r in after.records if isinstance(r, ModelResult) and r.abandoned]
    assert len(abandoned) == (0 if finals else 1)
    assert [s.decision for s in after.steps] == [DecisionKind.ACTIONS, DecisionKind.FINAL_ANSWER]
