"""Values a model or a tool may produce that no encoder, decoder or validator can follow.

Arguments nested too deeply (or holding themselves), a streamed event nested past the JSON
decoder's limit, a tool raising a `BaseException` that is not trio's, a tool returning a value
that holds itself: each is an outcome of its call, recorded, and the run goes on; none
crashes the run (which would crash again at every resume) or the trio run.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel

import treadle
from treadle.parsers import MAX_ARGUMENT_DEPTH, NESTED_TOO_DEEP, argument_problem
from treadle.stores.memory import MemoryStore
from treadle.testing.loopback import CannedResponse, open_loopback_server
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionOutcome,
    ActionResult,
    ActionStatus,
    DecisionKind,
    ModelReply,
    ModelResult,
    ToolCall,
)

CALLS: list[object] = []


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def store_value(value: list[int]) -> str:
    """Store a value.

    Args:
        value: a list of numbers.
    """
    CALLS.append(value)
    return "stored"


def nested(depth: int) -> list[Any]:
    """``depth`` lists, one inside the other (``[[[]]]`` is 3)."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def agent(model: Any, *tools: Any) -> treadle.Agent:
    return treadle.Agent(
        model=model,
        executor=treadle.Toolbox(list(tools) or [store_value]),
        parser=treadle.NativeToolCallParser(),
        model_name="m",
        limits=treadle.Limits(retry_initial_s=0.001, retry_max_s=0.001, max_model_retries=0),
    )


def test_argument_depth_is_measured_without_recursion():
    arguments = {"value": nested(MAX_ARGUMENT_DEPTH - 1)}  # the object is level 1
    assert argument_problem(arguments) is None
    assert argument_problem({"value": nested(MAX_ARGUMENT_DEPTH)}) == NESTED_TOO_DEEP
    assert argument_problem({"value": nested(100_000)}) == NESTED_TOO_DEEP
    itself: dict[str, Any] = {}
    itself["again"] = itself
    assert argument_problem(itself) == NESTED_TOO_DEEP


@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH, 5_000])
async def test_arguments_nested_too_deeply_are_an_invalid_decision_and_the_run_goes_on(depth):
    CALLS.clear()
    store = MemoryStore()
    turns = [
        call("store_value", value=nested(depth), call_id="deep"),
        call("store_value", value=[1], call_id="flat"),
        say("done"),
    ]
    result = await treadle.run(agent(ScriptedModel(turns=turns)), "go", store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert CALLS == [[1]]  # the deep call never ran
    log = await store.read_log("r")
    assert log.steps[0].decision is DecisionKind.INVALID
    assert f"deeper than {MAX_ARGUMENT_DEPTH} levels" in (log.steps[0].feedback or "")
    stored = next(r for r in log.records if isinstance(r, ModelResult) and r.reply)
    assert stored.reply is not None
    assert [c.reason for c in stored.reply.invalid_tool_calls] == [NESTED_TOO_DEEP]


async def test_arguments_that_hold_themselves_are_refused():
    itself: dict[str, Any] = {}
    itself["value"] = itself
    reply = ModelReply(
        tool_calls=(ToolCall(id="c1", name="store_value", arguments=itself),),
        finish_reason="tool_calls",
    )
    store = MemoryStore()
    model = ScriptedModel(turns=[reply, say("done")])
    result = await treadle.run(agent(model), "go", store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    log = await store.read_log("r")
    assert log.steps[0].decision is DecisionKind.INVALID


def _sse(*events: bytes) -> CannedResponse:
    chunks = [b"data: " + event + b"\n\n" for event in events] + [b"data: [DONE]\n\n"]
    return CannedResponse(chunks=chunks, headers={"content-type": "text/event-stream"})


def _call_event(arguments: str) -> bytes:
    function = {"name": "store_value", "arguments": arguments}
    delta = {"role": "assistant", "tool_calls": [{"index": 0, "id": "c1", "function": function}]}
    choice = {"index": 0, "delta": delta, "finish_reason": "tool_calls"}
    return json.dumps({"id": "x", "choices": [choice]}).encode()


def _text_event(text: str) -> bytes:
    choice = {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    return json.dumps({"id": "x", "choices": [choice]}).encode()


async def test_argument_text_too_deep_to_decode_is_unparseable_not_a_crash():
    deep = '{"value": ' + "[" * 5_000 + "]" * 5_000 + "}"
    answers = [_sse(_call_event(deep)), _sse(_text_event("done"))]
    store = MemoryStore()
    async with (
        open_loopback_server(lambda request: answers.pop(0)) as server,
        treadle.OpenAIChatClient(base_url=server.base_url, api_key="k") as client,
    ):
        result = await treadle.run(agent(client), "go", store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    log = await store.read_log("r")
    assert log.steps[0].decision is DecisionKind.INVALID
    stored = next(r for r in log.records if isinstance(r, ModelResult) and r.reply)
    assert stored.reply is not None
    assert [c.reason for c in stored.reply.invalid_tool_calls] == ["unparseable"]


async def test_a_streamed_event_too_deep_to_decode_is_an_invalid_response():
    event = b'{"id":"x","choices":[{"index":0,"delta":{"content":"hi","x":' + b"[" * 5_000
    event += b"]" * 5_000 + b'},"finish_reason":"stop"}]}'
    store = MemoryStore()
    async with (
        open_loopback_server(lambda request: _sse(event)) as server,
        treadle.OpenAIChatClient(base_url=server.base_url, api_key="k") as client,
    ):
        result = await treadle.run(agent(client), "go", store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.MODEL_ERROR
    log = await store.read_log("r")
    failed = [r for r in log.records if isinstance(r, ModelResult)]
    assert failed and failed[-1].error is not None
    assert failed[-1].error.kind == "invalid_response"
    assert "nests too deeply" in failed[-1].error.message


async def the_one_result(tool: Any) -> ActionResult:
    """Run one call of ``tool`` then an answer; the call's result (the run must finish)."""
    store = MemoryStore()
    model = ScriptedModel(turns=[call(tool.name, call_id="c1"), say("done")])
    result = await treadle.run(agent(model, tool), "go", store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    log = await store.read_log("r")
    (found,) = [r for r in log.records if isinstance(r, ActionResult)]
    return found


class Unusual(BaseException):
    """A `BaseException` a library might raise (neither trio's nor Python's exit)."""


@pytest.mark.parametrize(
    "raised",
    [
        asyncio.CancelledError("bridged"),
        GeneratorExit(),
        Unusual("odd"),
        BaseExceptionGroup("out of the tool's nursery", [Unusual("odd")]),
    ],
)
async def test_a_tool_raising_a_base_exception_is_an_error_observation(raised):
    @treadle.tool(replay=treadle.ReplayPolicy.SAFE)
    async def fragile() -> str:
        """Fail oddly."""
        raise raised

    found = await the_one_result(fragile)
    assert found.outcome.status is treadle.ActionStatus.EXECUTED
    assert found.outcome.observation.startswith(f"Error: {type(raised).__name__}")


async def test_a_base_exception_from_a_hosted_call_never_ends_the_trio_run():
    """An executor that is not a `Toolbox` gets the exception back: the run is interrupted."""

    class Raising:
        def __init__(self) -> None:
            self.tools = treadle.Toolbox([store_value])

        def tool_specs(self) -> Any:
            return self.tools.tool_specs()

        def replay_policy(self, tool: str) -> treadle.ReplayPolicy:
            return self.tools.replay_policy(tool)

        async def execute(self, action: Any) -> treadle.ActionOutcome:
            raise Unusual("from the executor")

        async def reconcile(self, action: Any) -> treadle.ActionOutcome | None:
            return None

    model = ScriptedModel(turns=[call("store_value", value=1, call_id="c1"), say("done")])
    runner = treadle.Agent(
        model=model, executor=Raising(), parser=treadle.NativeToolCallParser(), model_name="m"
    )
    with pytest.RaisesGroup(Unusual, flatten_subgroups=True, allow_unwrapped=True):
        await treadle.run(runner, "go", store=MemoryStore(), run_id="r")
    await trio.lowlevel.checkpoint()  # the trio run (the tool host's system task) is still alive


@pytest.mark.parametrize("shape", ["itself", "deep"])
async def test_a_tool_result_that_cannot_be_written_as_json_is_an_error_observation(shape):
    value: list[Any] = nested(100_000)
    if shape == "itself":
        value = []
        value.append(value)

    @treadle.tool(replay=treadle.ReplayPolicy.SAFE)
    async def odd() -> Any:
        """Return an odd value."""
        return value

    found = await the_one_result(odd)
    assert "could not be written as JSON" in found.outcome.observation
    assert "nests too deeply" in found.outcome.observation


async def test_an_observation_over_the_limit_is_cut_between_json_elements_with_a_marker():
    # It was cut at the limit, in the middle of a value, with nothing to tell the model; the
    # context window's own cut then could not keep it valid JSON either.
    rows = [{"k": i, "v": "x" * 20} for i in range(100)]

    @treadle.tool(replay=treadle.ReplayPolicy.SAFE)
    async def listing() -> list[dict[str, Any]]:
        """List the rows."""
        return rows

    store = MemoryStore()
    model = ScriptedModel(turns=[call("listing", call_id="c1"), say("done")])
    definition = attrs.evolve(
        agent(model, listing), limits=treadle.Limits(max_observation_chars=500)
    )
    await treadle.run(definition, "go", store=store, run_id="r")
    log = await store.read_log("r")
    (found,) = [r for r in log.records if isinstance(r, ActionResult)]
    observation = found.outcome.observation
    assert len(observation) <= 500
    head, mark = observation.rsplit("\n", 1)
    assert mark == "[cut: the result is longer than 500 characters]"
    kept = json.loads(head)
    assert kept == rows[: len(kept)] and 0 < len(kept) < len(rows)
    whole = len(json.dumps(rows, ensure_ascii=False, separators=(",", ":")))
    assert found.outcome.observation_truncated_chars == whole - len(head)


@pytest.mark.parametrize("status", ["executed", "not_executed"])
async def test_an_observation_flagged_synthetic_is_cut_at_the_limit_too(status):
    """An executor's outcome flagged ``observation_is_synthetic`` entered history whole,
    100,000 characters past the 500 the limit allows; so did a refusal's long detail."""
    said = "z" * 100_000

    @treadle.tool(replay=treadle.ReplayPolicy.SAFE)
    async def big() -> ActionOutcome:
        """Answer with a long outcome of its own."""
        if status == "executed":
            return ActionOutcome(
                status=ActionStatus.EXECUTED,
                observation=said,
                observation_is_synthetic=True,
            )
        return ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=said, detail=said)

    store = MemoryStore()
    model = ScriptedModel(turns=[call("big", call_id="c1"), say("done")])
    definition = attrs.evolve(agent(model, big), limits=treadle.Limits(max_observation_chars=500))
    await treadle.run(definition, "go", store=store, run_id="r")
    log = await store.read_log("r")
    (found,) = [r for r in log.records if isinstance(r, ActionResult)]
    observation = found.outcome.observation
    assert len(observation) <= 500 and log.steps[0].observations == (observation,)
    assert observation.endswith("\n[cut: the result is longer than 500 characters]")
    assert found.outcome.observation_truncated_chars > 99_000
    assert found.outcome.observation_is_synthetic


@treadle.tool
async def take(data: str) -> str:
    """Take some data."""
    return "took"


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
async def test_a_reply_the_store_cannot_encode_interrupts_the_run_naming_that_cause(tmp_path, kind):
    """An integer past Python's 4,300 digits (a custom model client can hand one over): the
    error's message was built from the records' repr, which failed again, so about half the
    runs reported another actor's `BrokenResourceError` as the cause."""
    agent_ = agent(ScriptedModel(turns=[call("take", data=10**5000), say("ok")]), take)
    for attempt in range(6):
        path = tmp_path / f"{attempt}"
        opened = (
            treadle.open_sqlite_store(path.with_suffix(".db"))
            if kind == "sqlite"
            else treadle.open_jsonl_store(path)
        )
        async with opened as store:
            with pytest.raises(treadle.UsageError) as info:
                await treadle.run(agent_, "go", store=store, run_id="r")
        assert "cannot encode ModelResult (seq 3): ValueError: Exceeds the limit" in str(info.value)
