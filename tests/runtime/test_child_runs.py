"""Child runs (docs/child-runs.md): a tool call that runs another agent, end to end.

Every test drives a real parent run whose tool call starts a real child run on a real store,
through the five actors of each.
"""

from __future__ import annotations

import math

import attrs

import pytest
import trio

from treadle import agent_tool, child_run_id
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import SqliteStore
from treadle.supervisors.run import open_run, run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import (
    ActionIntent,
    ActionResult,
    Budgets,
    CancelRequested,
    EventKind,
    Limits,
    ModelReply,
    RunFinished,
    RunStarted,
    RunState,
    StopReason,
    Usage,
)

USAGE = Usage(input_tokens=10, output_tokens=5)


def use(name: str, call_id: str, **arguments) -> ModelReply:
    """A one-call reply that reports ``USAGE``."""
    return attrs.evolve(call(name, call_id=call_id, **arguments), usage=USAGE)


def child_agent(*, gate: trio.Event | None = None, executed: list[str] | None = None, turns=None):
    """The child: one tool call (``note``, recorded in ``executed``), then its answer."""
    done = executed if executed is not None else []

    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Write a note (an effect).

        Args:
            text: the note.
            ctx: the call.
        """
        if gate is not None:
            await gate.wait()
        done.append(ctx.intent_id)
        return f"noted {text}"

    script = turns or [
        use("note", "n1", text="hello"),
        say("the child's answer", usage=USAGE),
    ]
    return Agent(
        model=ScriptedModel(turns=script),
        executor=Toolbox([note]),
        parser=NativeToolCallParser(),
        model_name="child-model",
        system_prompt="You are the child.",
    )


def parent_agent(store, child: Agent, *, budgets=Budgets(), limits=Limits(), turns=None):
    helper = agent_tool(child, store=store, name="helper", description="Ask the helper agent.")
    script = turns or [
        use("helper", "h1", task="do the thing"),
        say("the parent's answer", usage=USAGE),
    ]
    return Agent(
        model=ScriptedModel(turns=script),
        executor=Toolbox([helper]),
        parser=NativeToolCallParser(),
        model_name="parent-model",
        system_prompt="You are the parent.",
        budgets=budgets,
        limits=limits,
    )


def test_child_run_id_is_derived_from_the_intent_id():
    assert child_run_id("p/s1/a2") == "p/s1/a2/child"
    long = "r" * 195 + "/s1/a1"
    derived = child_run_id(long)
    assert derived.startswith("child-") and len(derived) == 38
    assert derived == child_run_id(long) != child_run_id("r" * 195 + "/s1/a2")


async def test_a_tool_call_runs_a_child_and_returns_its_answer():
    store = MemoryStore()
    executed: list[str] = []
    result = await run(parent_agent(store, child_agent(executed=executed)), "go", store=store, run_id="p")
    assert result.state is RunState.SUCCEEDED
    kid = child_run_id("p/s1/a1")
    assert executed == [f"{kid}/s1/a1"]
    child = await store.read_log(kid)
    assert child.finished is not None and child.finished.state is RunState.SUCCEEDED
    started = child.records[0]
    assert isinstance(started, RunStarted)
    assert (started.parent_run_id, started.parent_intent_id) == ("p", "p/s1/a1")
    assert started.input[0].content == "do the thing"
    parent = await store.read_log("p")
    action = next(r for r in parent.records if isinstance(r, ActionResult))
    assert action.outcome.observation == "the child's answer"
    assert action.outcome.child_run_id == kid
    # The child's tokens count in the parent's totals; none of its records are in the parent's log.
    assert result.totals.input_tokens == 2 * 10 + 2 * 10
    assert all(r.run_id == "p" for r in parent.records)
