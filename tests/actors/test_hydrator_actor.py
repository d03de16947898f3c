"""The context hydrator alone: a real `ContextHydrator` served through its inbox.

The test plays the coordinator (`Hydrate` requests with `treadle.actors._rpc.request`); the
only thing on the hydrator's other side is the store it reads a predecessor's history from
(docs/design.md, "The five actors"). The hydrator writes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
from actor_fakes import TS, started

from treadle._exceptions import StoreError
from treadle.actors import Compaction, ContextHydrator, Hydrate, read_chain, request
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.supervisors import run
from treadle.testing import ScriptedModel, say
from treadle.tools import Toolbox
from treadle.types import (
    DecisionKind,
    Message,
    ModelRequest,
    RunStarted,
    StepRecord,
    SyntheticObservations,
    ToolCall,
    ToolSpec,
)

SYNTHETIC = SyntheticObservations()
TOOLS = (ToolSpec(name="add"),)


def _hydrator(first: RunStarted | None = None, **options: object) -> ContextHydrator:
    return ContextHydrator(
        started=first or started(),
        system_prompt="be brief",
        tools=TOOLS,
        model="m",
        max_output_tokens=100,
        params={"temperature": 0.0},
        synthetic=SYNTHETIC,
        **options,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def _alone(hydrator: ContextHydrator) -> AsyncIterator[trio.MemorySendChannel[Hydrate]]:
    """The hydrator started alone; on exit its inbox is closed and it returns on its own."""
    # 0: the hydrator's inbox is unbuffered (docs/design.md, "The five actors").
    send, recv = trio.open_memory_channel[Hydrate](0)
    async with trio.open_nursery() as nursery:
        await nursery.start(hydrator.run, recv)
        async with send:
            yield send


async def _ask(
    inbox: trio.MemorySendChannel[Hydrate], *steps: StepRecord, **fields: object
) -> ModelRequest | Compaction:
    answer: ModelRequest | Compaction = await request(
        inbox,
        lambda reply_to: Hydrate(new_steps=steps, reply_to=reply_to, **fields),  # type: ignore[arg-type]
    )
    return answer


def _step(number: int, *observations: str, calls: tuple[ToolCall, ...] | None = None) -> StepRecord:
    """A step that called ``add`` once per observation (or ``calls``) and saw them."""
    if calls is None:
        calls = tuple(
            ToolCall(id=f"c{number}-{i}", name="add", arguments={"a": i})
            for i in range(len(observations))
        )
    return StepRecord(
        run_id="r",
        step=number,
        ts=TS,
        model_intent_id=f"r/s{number}/m1",
        decision=DecisionKind.ACTIONS,
        history_message=Message(role="assistant", tool_calls=calls),
        observations=observations,
    )


def _roles(answer: ModelRequest | Compaction) -> list[str]:
    assert isinstance(answer, ModelRequest)
    return [m.role for m in answer.messages]


async def test_the_first_request_is_the_system_prompt_and_the_input_with_the_definition():
    async with _alone(_hydrator()) as inbox:
        answer = await _ask(inbox)
    assert isinstance(answer, ModelRequest)
    assert [(m.role, m.content) for m in answer.messages] == [
        ("system", "be brief"),
        ("user", "hello"),
    ]
    assert (answer.tools, answer.model, answer.max_output_tokens) == (TOOLS, "m", 100)
    assert answer.params == {"temperature": 0.0}


async def test_each_request_adds_only_the_new_steps_as_they_entered_history():
    async with _alone(_hydrator()) as inbox:
        await _ask(inbox)
        second = await _ask(inbox, _step(1, "3"))
        third = await _ask(inbox, _step(2, "5", "7"))
    assert _roles(second) == ["system", "user", "assistant", "tool"]
    assert _roles(third) == [*_roles(second), "assistant", "tool", "tool"]
    assert isinstance(third, ModelRequest)
    tool_messages = [m for m in third.messages if m.role == "tool"]
    assert [(m.tool_call_id, m.content) for m in tool_messages] == [
        ("c1-0", "3"),
        ("c2-0", "5"),
        ("c2-1", "7"),
    ]


async def test_a_call_the_log_holds_no_observation_for_is_answered_as_unknown():
    cut = _step(1, calls=(ToolCall(id="c1", name="add"),))  # a step cut before its result
    async with _alone(_hydrator()) as inbox:
        answer = await _ask(inbox, cut)
    assert isinstance(answer, ModelRequest)
    last = answer.messages[-1]
    assert (last.role, last.tool_call_id) == ("tool", "c1")
    assert last.content == SYNTHETIC.unknown.format(tool="add", detail="")


async def test_a_requester_that_went_away_does_not_stop_the_hydrator():
    """Cancellation on the requester's side: the reply is dropped, the next one is served."""
    async with _alone(_hydrator()) as inbox:
        reply_to, gone = trio.open_memory_channel[ModelRequest | Compaction](1)
        gone.close()
        await inbox.send(Hydrate(new_steps=(_step(1, "3"),), reply_to=reply_to))
        answer = await _ask(inbox)
    assert _roles(answer) == ["system", "user", "assistant", "tool"]  # the step was kept


async def test_a_run_continuing_another_starts_from_its_recorded_history(autojump_clock):
    store = MemoryStore()
    earlier = Agent(
        model=ScriptedModel(turns=[say("noted")]),
        executor=Toolbox([]),
        parser=NativeToolCallParser(),
        model_name="m",
    )
    await run(earlier, "remember 42", store=store, run_id="t")
    continuing = started("t.2", text="what was it?", thread="t", continues="t")
    async with _alone(_hydrator(continuing, store=store)) as inbox:
        answer = await _ask(inbox)
    assert isinstance(answer, ModelRequest)
    assert [(m.role, m.content) for m in answer.messages] == [
        ("system", "be brief"),
        ("user", "remember 42"),
        ("assistant", "noted"),
        ("user", "what was it?"),
    ]


async def test_a_hydrator_given_its_chain_reads_no_log_and_another_chain_is_not_taken(
    autojump_clock,
):
    """The chain the check before the run's start read is the hydrator's history: it reads
    no log for it (it has no store here). A chain of another run is not taken: the history
    is read from the store (here: none, so the hydrator refuses, naming the missing store)."""
    store = MemoryStore()
    earlier = Agent(
        model=ScriptedModel(turns=[say("noted")]),
        executor=Toolbox([]),
        parser=NativeToolCallParser(),
        model_name="m",
    )
    await run(earlier, "remember 42", store=store, run_id="t")
    chain = await read_chain(store, "t", successor="t.2")
    continuing = started("t.2", text="what was it?", thread="t", continues="t")
    hydrator = _hydrator(continuing, chain=chain)
    async with _alone(hydrator) as inbox:
        answer = await _ask(inbox)
    assert isinstance(answer, ModelRequest) and hydrator.chain is None  # taken once
    assert [(m.role, m.content) for m in answer.messages] == [
        ("system", "be brief"),
        ("user", "remember 42"),
        ("assistant", "noted"),
        ("user", "what was it?"),
    ]
    other = started("u.2", thread="u", continues="u")
    with pytest.raises(StoreError, match="no store"):
        await _hydrator(other, chain=chain).inherit()
    forked = await read_chain(store, "t", before_step=1, successor="g")
    with pytest.raises(StoreError, match="no store"):  # the same run, another step
        await _hydrator(started("g", continues="t", fork_step=2), chain=forked).inherit()


async def test_a_predecessor_that_cannot_be_read_stops_the_hydrator_before_it_serves():
    continuing = started("t.2", thread="t", continues="t")
    send, recv = trio.open_memory_channel[Hydrate](0)
    async with trio.open_nursery() as nursery:
        with pytest.raises(StoreError, match="whose log is missing"):
            await nursery.start(_hydrator(continuing, store=MemoryStore()).run, recv)
        with pytest.raises(StoreError, match="no store"):
            await nursery.start(_hydrator(continuing).run, recv)
    send.close()


async def test_a_refused_request_is_answered_with_a_compaction_of_all_but_the_newest_step():
    """``force`` (the provider refused the last attempt for its context length): the answer
    is the summariser's request, not the step's (docs/context.md, "Context-length errors")."""
    hydrator = _hydrator(context_window=4000, summary_model="small")
    steps = [_step(n, "x" * 300) for n in (1, 2, 3)]
    async with _alone(hydrator) as inbox:
        fits = await _ask(inbox, *steps)
        answer = await _ask(inbox, force=True, refused_tokens=600)
    assert isinstance(fits, ModelRequest) and fits.context is not None
    assert isinstance(answer, Compaction)
    assert 1 <= answer.through < 3  # oldest first, and the newest step stays verbatim
    assert answer.request.model == "small" and answer.request.tools == ()
    assert answer.request.context is not None and answer.request.context.forced
