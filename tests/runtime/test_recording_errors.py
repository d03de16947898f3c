"""Small recording errors: seam violations, non-finite tool arguments."""

from __future__ import annotations

import math
from typing import Any

import pytest

import treadle
from treadle.stores._codec import decode, record_to_json
from treadle.stores.memory import MemoryStore
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionStatus,
    DecisionKind,
    ModelErrorInfo,
    ModelReply,
    ModelResult,
    ParsedReply,
    RunFinished,
    StepRecord,
    ToolCall,
    Usage,
)

CALLS: list[tuple[Any, ...]] = []


@treadle.tool
async def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    CALLS.append((a, b))
    return a + b


def agent(model: Any, **kwargs: Any) -> treadle.Agent:
    return treadle.Agent(
        model=model,
        executor=kwargs.pop("executor", treadle.Toolbox([add])),
        parser=kwargs.pop("parser", treadle.NativeToolCallParser()),
        model_name="scripted",
        **kwargs,
    )


class NoneModel:
    """A model client that breaks its seam: it returns ``None``."""

    async def complete(self, request: Any, *, on_delta: Any = None, attempt: Any = None) -> Any:
        return None


class NoneParser:
    """A decision parser that breaks its seam."""

    def parse(self, reply: Any, tools: Any) -> Any:
        return None


class NoneExecutor:
    """An executor whose ``execute`` returns a string instead of an outcome."""

    def __init__(self) -> None:
        self._tools = treadle.Toolbox([add])

    def tool_specs(self) -> Any:
        return self._tools.tool_specs()

    def replay_policy(self, tool: str) -> Any:
        return self._tools.replay_policy(tool)

    async def execute(self, action: Any) -> Any:
        return "3"

    async def reconcile(self, action: Any) -> ActionOutcome | None:
        return None


class ReplyModel:
    """A model client whose every reply is ``reply``; ``report`` is reported as usage first."""

    def __init__(self, reply: Any, report: Any = None) -> None:
        self.reply, self.report = reply, report

    async def complete(self, request: Any, *, on_delta: Any = None, attempt: Any = None) -> Any:
        if self.report is not None:
            attempt.report_usage(self.report)
        return self.reply


class FailingModel:
    """A model client whose every attempt fails with a retryable error carrying ``usage``."""

    def __init__(self, usage: Any) -> None:
        self.usage = usage

    async def complete(self, request: Any, *, on_delta: Any = None, attempt: Any = None) -> Any:
        info = ModelErrorInfo(kind="server_error", message="boom", retryable=True)
        raise treadle.ModelCallError(info, usage=self.usage)


class OutcomeExecutor(NoneExecutor):
    """An executor whose ``execute`` returns ``outcome``."""

    def __init__(self, outcome: Any) -> None:
        super().__init__()
        self.outcome = outcome

    async def execute(self, action: Any) -> Any:
        return self.outcome


def _reply(**fields: Any) -> ModelReply:
    return ModelReply(
        tool_calls=(ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2}),), **fields
    )


def _outcome(**fields: Any) -> ActionOutcome:
    return ActionOutcome(**{"status": ActionStatus.EXECUTED, "observation": "3", **fields})


TURNS = [call("add", a=1, b=2, call_id="c1"), say("3")]


@pytest.mark.parametrize(
    ("seam", "broken"),
    [
        ("model client", {"model": NoneModel()}),
        ("decision parser", {"parser": NoneParser()}),
        ("action executor", {"executor": NoneExecutor()}),
        # Shapes the memory store kept but a durable store cannot encode, or that unbind a
        # budget or end a run: each reached the log (docs/seams.md).
        ("model client", {"model": ReplyModel(_reply(usage=Usage(input_tokens=-972100)))}),
        ("model client", {"model": ReplyModel(_reply(), report=Usage(output_tokens=-5))}),
        ("model client", {"model": ReplyModel(_reply(), report="lots")}),
        ("model client", {"model": ReplyModel(_reply(text=42))}),
        # The usage a failed attempt carries is held to the same rule as a reply's.
        ("model client", {"model": FailingModel(Usage(input_tokens=2.5))}),  # type: ignore[arg-type]
        ("model client", {"model": FailingModel(Usage(input_tokens="lots"))}),  # type: ignore[arg-type]
        ("model client", {"model": FailingModel(Usage(input_tokens=-1000))}),
        (
            "model client",
            {
                "model": ReplyModel(
                    ModelReply(tool_calls=(ToolCall(id="c1", name="add", arguments=[1, 2]),))
                )
            },  # type: ignore[arg-type]
        ),
        (
            "model client",
            {
                "model": ReplyModel(
                    ModelReply(
                        tool_calls=(
                            ToolCall(id="c1", name="add", arguments={"a": object(), "b": 2}),
                        )
                    )
                )
            },
        ),
        ("action executor", {"executor": OutcomeExecutor(_outcome(task_completed="false"))}),
        (
            "action executor",
            {"executor": OutcomeExecutor(_outcome(observation_truncated_chars=-1))},
        ),
        ("action executor", {"executor": OutcomeExecutor(_outcome(observation=3))}),
    ],
)
async def test_a_seam_returning_what_its_contract_excludes_interrupts_the_run(seam, broken):
    store = MemoryStore()
    model = broken.pop("model", ScriptedModel(turns=TURNS))
    with pytest.raises(treadle.RunInterrupted) as info:
        await treadle.run(agent(model, **broken), "1+2?", store=store, run_id="r")
    assert isinstance(info.value.__cause__, treadle.SeamViolation)
    assert info.value.__cause__.seam == seam
    assert f"the {seam} returned" in str(info.value)
    log = await store.read_log("r")
    assert log.finished is None  # never a made-up stop reason: the log is left resumable
    assert not [r for r in log.records if isinstance(r, ModelResult) and r.error]
    for record in log.records:  # what was written, a durable store can encode and read back
        assert decode(record_to_json(record)) == record
    # Fixed (a parser is part of the definition: its change is accepted), the run resumes.
    fixed = agent(ScriptedModel(turns=TURNS))
    result = await treadle.run(fixed, store=store, run_id="r", accept_definition_change=True)
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
async def test_non_finite_tool_arguments_are_an_invalid_decision_and_stored_as_validated(number):
    CALLS.clear()
    store = MemoryStore()
    turns = [call("add", a=number, b=2, call_id="c1"), call("add", a=1, b=2, call_id="c2")]
    result = await treadle.run(
        agent(ScriptedModel(turns=[*turns, say("3")])), "1+2?", store=store, run_id="r"
    )
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert CALLS == [(1, 2)]  # the call with a non-finite number never ran
    log = await store.read_log("r")
    first = log.steps[0]
    assert first.decision is DecisionKind.INVALID
    assert "NaN or infinity" in (first.feedback or "")
    intents = [r for r in log.records if isinstance(r, ActionIntent)]
    assert [i.call_id for i in intents] == ["c2"]
    # Every record reads back as it was written: nothing was changed by the encoding.
    for record in log.records:
        assert decode(record_to_json(record)) == record
    # And a resume re-parsing the stored reply decides the same.
    stored = next(r for r in log.records if isinstance(r, ModelResult) and r.reply)
    parsed = treadle.NativeToolCallParser().parse(stored.reply, ())
    assert parsed.kind is DecisionKind.INVALID


def test_a_parser_producing_non_finite_arguments_is_refused_by_the_check():
    from treadle.parsers import refuse_non_finite

    calls = (
        ToolCall(id="a", name="add", arguments={"a": [math.inf], "b": 1}),
        ToolCall(id="b", name="add", arguments={"a": 1, "b": 1}),
    )
    parsed = ParsedReply(
        kind=DecisionKind.ACTIONS,
        actions=calls,
        history_message=treadle.Message(role="assistant", tool_calls=calls),
    )
    refused = refuse_non_finite(parsed)
    assert refused.kind is DecisionKind.INVALID
    assert refused.reason == "non_finite_number"
    assert [c.arguments for c in refused.history_message.tool_calls] == [{}, {"a": 1, "b": 1}]
    assert "None of the 2 tool calls" in (refused.feedback or "")


async def test_a_seam_violation_never_records_a_time_budget():
    store = MemoryStore()
    with pytest.raises(treadle.RunInterrupted):
        await treadle.run(agent(NoneModel()), "1+2?", store=store, run_id="r")
    log = await store.read_log("r")
    assert not any(isinstance(r, RunFinished | StepRecord) for r in log.records)
    assert not any(isinstance(r, ModelResult) for r in log.records)
