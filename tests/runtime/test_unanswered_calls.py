"""Every tool call in a model request has its tool message, whatever the log holds.

The case that broke it: a crash after a cancelled step's late results and step record were
written, before the cancel record. The resumed run's history held the step's assistant tool
calls with no observation, a request OpenAI and Anthropic refuse (docs/crash-safety.md,
"Resume").
"""

from __future__ import annotations

import trio

import treadle
from treadle.actors import ContextHydrator
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_tool_replies
from treadle.testing.scripted import ScriptedModel, calls, say
from treadle.types import (
    ActionResult,
    CancelRequested,
    Message,
    ModelRequest,
    RunStarted,
    StepRecord,
    SyntheticObservations,
    ToolCall,
)

STARTED: list[str] = []
BOTH_STARTED = trio.Event()


@treadle.tool
async def slow(n: int) -> str:
    """A call that takes long.

    Args:
        n: which call.
    """
    STARTED.append(f"slow {n}")
    if len(STARTED) == 2:
        BOTH_STARTED.set()
    await trio.sleep_forever()
    return "never"


def agent(model: ScriptedModel) -> treadle.Agent:
    return treadle.Agent(
        model=model,
        executor=treadle.Toolbox([slow]),
        parser=treadle.NativeToolCallParser(),
        model_name="scripted",
    )


UNKNOWN = SyntheticObservations().unknown.format(tool="slow", detail="")


async def test_a_crash_between_the_late_step_and_the_cancel_record_resumes_with_every_call_answered(
    autojump_clock,
):
    global BOTH_STARTED
    STARTED.clear()
    BOTH_STARTED = trio.Event()
    store = MemoryStore()
    first = ScriptedModel(
        turns=[
            calls(
                ToolCall(id="c1", name="slow", arguments={"n": 1}),
                ToolCall(id="c2", name="slow", arguments={"n": 2}),
            )
        ]
    )
    # Writes: 1 run started, 2 model intent, 3 model result, 4-5 action intents,
    # 6 the late results with their step record, 7 the cancel record (never written).
    crashing = CrashingStore(inner=store, crash_at=6, when="after")
    crashed = False
    try:
        async with open_run(agent(first), "go", store=crashing, run_id="r") as handle:
            await BOTH_STARTED.wait()
            handle.cancel("stop")
            await handle.wait()
    except* (treadle.RunInterrupted, SimulatedCrash):
        crashed = True
    assert crashed
    log = await store.read_log("r")
    *_, late_a, late_b, step = log.records
    assert isinstance(late_a, ActionResult) and late_a.late
    assert isinstance(late_b, ActionResult) and late_b.late
    # the cut step's history says what each call's late result says
    observed = (late_a.outcome.observation, late_b.outcome.observation)
    assert isinstance(step, StepRecord) and step.observations == observed
    assert not any(isinstance(r, CancelRequested) for r in log.records)

    second = ScriptedModel(turns=[say("unused: turn 0 was answered before the crash"), say("done")])
    result = await treadle.run(agent(second), store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert check_tool_replies(second.requests) == []
    [request] = second.requests
    answers = [(m.tool_call_id, m.content) for m in request.messages if m.role == "tool"]
    assert answers == [("c1", UNKNOWN), ("c2", UNKNOWN)]
    assert sorted(STARTED) == ["slow 1", "slow 2"]  # neither call was run again


def test_a_run_input_ending_on_an_unanswered_call_is_answered():
    call = ToolCall(id="t1", name="lookup", arguments={})
    started = RunStarted(
        run_id="r",
        ts="2024-01-01T00:00:00+00:00",
        input=(
            Message(role="user", content="hi"),
            Message(role="assistant", content=None, tool_calls=(call,)),
        ),
        snapshot={},
    )
    hydrator = ContextHydrator(
        started=started, system_prompt=None, tools=(), model="m", max_output_tokens=None, params={}
    )
    request = hydrator.build(())
    assert check_tool_replies([request]) == []
    assert request.messages[-1] == Message(
        role="tool",
        content=SyntheticObservations().unknown.format(tool="lookup", detail=""),
        tool_call_id="t1",
        name="lookup",
    )


def test_the_check_names_unanswered_and_stray_tool_messages():
    call = ToolCall(id="a", name="f", arguments={})
    bad = ModelRequest(
        messages=(
            Message(role="assistant", tool_calls=(call, ToolCall(id="b", name="g"))),
            Message(role="tool", content="x", tool_call_id="a"),
            Message(role="user", content="next"),
            Message(role="tool", content="y", tool_call_id="z"),
        )
    )
    assert check_tool_replies([bad]) == [
        "request 0: tool call 'b' (g) has no tool message",
        "request 0: tool message for call 'z' answers no call of the assistant message before it",
    ]
