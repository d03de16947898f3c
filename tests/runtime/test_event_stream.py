from __future__ import annotations

from contextlib import aclosing

import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

from treadle._exceptions import UsageError
from treadle.agent import Agent
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run
from treadle.supervisors import run as run_to_end
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import Attempt, EventKind, ModelErrorInfo, ModelReply, ModelResult, Usage

TURNS = [call("sleep", s=1, call_id=f"c{i}") for i in range(4)] + [say("done")]


def make(turns=TURNS):
    model = ScriptedModel(turns=turns, latency_s=0.5)
    return Agent(model=model, executor=LedgerTools(), parser=SimpleParser())


async def collect(handle, from_seq, into):
    into[from_seq] = [e async for e in handle.events(from_seq=from_seq) if e.durable]


async def subscribe_at_every_seq(handle, last_seq):
    """Open one subscriber per seq 1..last_seq at once; each reads to the end of the run."""
    seen: dict[int, list] = {}
    async with trio.open_nursery() as nursery:
        for start in range(1, last_seq + 1):
            nursery.start_soon(collect, handle, start, seen)
    return seen


def stored(log):
    return list(log.records)


@pytest.mark.parametrize("moment", [0.2, 0.7, 1.3, 2.6, 4.1, 5.9])
async def test_reconnect_at_every_seq_in_the_middle_of_a_run(moment, autojump_clock):
    store = MemoryStore()
    async with open_run(make(), "x", store=store, run_id="r") as handle:
        await trio.sleep(moment)
        assert handle.result is None
        seen = await subscribe_at_every_seq(handle, handle.statistics().last_seq)
    log = await store.read_log("r")
    assert log.finished is not None
    for start, events in seen.items():
        assert [e.seq for e in events] == list(range(start, len(log.records) + 1))
        assert [e.record for e in events] == stored(log)[start - 1 :]
    assert seen[1][-1].kind is EventKind.RUN_FINISHED


async def test_reconnect_at_every_seq_after_a_restart(autojump_clock):
    store = MemoryStore()
    with trio.CancelScope() as crash:
        async with open_run(make(), "x", store=store, run_id="r"):
            await trio.sleep(2.2)
            crash.cancel()
    before = len((await store.read_log("r")).records)
    assert before > 3
    async with open_run(make(), store=store, run_id="r") as handle:
        seen = await subscribe_at_every_seq(handle, before)
    log = await store.read_log("r")
    assert log.finished is not None
    for start, events in seen.items():
        assert [e.seq for e in events] == list(range(start, len(log.records) + 1))
        assert [e.record for e in events] == stored(log)[start - 1 :]


async def test_a_subscriber_joining_at_a_future_seq_gets_events_from_there(autojump_clock):
    store = MemoryStore()
    async with open_run(make(), "x", store=store, run_id="r") as handle:
        events = [e async for e in handle.events(from_seq=10) if e.durable]
    log = await store.read_log("r")
    assert [e.seq for e in events] == list(range(10, len(log.records) + 1))


async def test_model_call_finished_events_carry_the_usage(autojump_clock):
    usage = Usage(input_tokens=12, output_tokens=3)
    turns = [ModelReply(text="hi", finish_reason="stop", usage=usage)]
    store = MemoryStore()
    await run_to_end(make(turns), "x", store=store, run_id="r")
    async with open_run(make(turns), store=store, run_id="r") as handle:
        finished = [e async for e in handle.events() if e.kind is EventKind.MODEL_CALL_FINISHED]
    (event,) = finished
    assert isinstance(event.record, ModelResult)
    assert event.record.usage == usage


def step_outline(events):
    """(kind, step) of the step-started events and the model intents, in order."""
    return [
        (e.kind, e.step if e.record is None else e.record.attempt)
        for e in events
        if e.kind in (EventKind.STEP_STARTED, EventKind.MODEL_CALL_STARTED)
    ]


async def test_step_started_precedes_each_step_once_live_and_read_back(autojump_clock):
    store = MemoryStore()
    model = ScriptedModel(
        turns=TURNS,
        latency_s=0.5,
        failures={1: [ModelErrorInfo(kind="server_error", retryable=True, status=503)]},
    )
    agent = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        live = [e async for e in handle.events() if e.kind is not EventKind.TEXT_DELTA]
    async with open_run(make(), store=store, run_id="r") as finished:
        stored_back = [e async for e in finished.events()]
    assert live == stored_back
    outline = step_outline(live)
    S, M = EventKind.STEP_STARTED, EventKind.MODEL_CALL_STARTED
    # Step 2's first attempt failed with a 503: its retry is not a new step.
    expected = [(S, 1), (M, 1), (S, 2), (M, 1), (M, 2), (S, 3), (M, 1), (S, 4), (M, 1)]
    assert outline == [*expected, (S, 5), (M, 1)]
    for event in (e for e in live if e.kind is EventKind.STEP_STARTED):
        following = next(e for e in live if e.seq == event.seq + 1)
        assert following.kind is M and following.record.step == event.step
        assert event.ordinal == 1 and event.record is None and not event.durable


async def test_step_started_is_not_repeated_for_a_step_resumed_after_a_crash(autojump_clock):
    store = MemoryStore()
    with trio.CancelScope() as crash:
        async with open_run(make(), "x", store=store, run_id="r") as handle:
            # Step 2's model call is in flight (intent written, no result) when the process dies.
            async for event in handle.events():
                if event.kind is EventKind.MODEL_CALL_STARTED and event.record.step == 2:
                    crash.cancel()
    async with open_run(make(), store=store, run_id="r") as resumed:
        events = [e async for e in resumed.events()]
    starts = [e.step for e in events if e.kind is EventKind.STEP_STARTED]
    assert starts == [1, 2, 3, 4, 5]
    attempts = [
        e.record.attempt
        for e in events
        if e.kind is EventKind.MODEL_CALL_STARTED and e.record.step == 2
    ]
    assert attempts == [1, 2]  # the abandoned attempt and the fresh one, in one step


class PausingModel:
    """Streams "Hel", "lo", pauses 5 s (virtual), then "!" and answers."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        for piece, pause in (("Hel", 0.001), ("lo", 5.0), ("!", 0.0)):
            on_delta("text", piece)
            await trio.sleep(pause)
        return ModelReply(text="Hello!", finish_reason="stop")


async def test_a_delta_is_flushed_within_30_ms_when_the_stream_pauses(autojump_clock):
    agent = Agent(model=PausingModel(), executor=LedgerTools(), parser=SimpleParser())
    received = []
    async with open_run(agent, "x", store=MemoryStore(), run_id="r") as handle:
        start = trio.current_time()
        async for event in handle.events():
            if event.kind is EventKind.TEXT_DELTA:
                received.append((event.text, trio.current_time() - start))
    assert [text for text, _ in received] == ["Hello", "!"]
    assert received[0][1] < 0.05  # not held until the stream resumed 5 s later
    assert received[1][1] >= 5.0


async def collect_after(handle, after, into):
    """The events (no deltas) ``handle.events(after=after)`` yields, to the run's end."""
    events = handle.events(after=after)
    into[after] = [e async for e in events if e.kind is not EventKind.TEXT_DELTA]


async def test_a_reader_resuming_after_any_event_gets_the_rest_once(autojump_clock):
    """A reader that saw a step_completed and resumed from its seq + 1 (the documented
    cursor) never got the next step's step_started event: it has the seq of the
    step_completed. Resuming ``after`` the (seq, ordinal) of any event it saw gives every
    event after it, step-started ones included, once: live and read back."""
    store = MemoryStore()
    seen: list = []
    resumed: dict = {}
    async with (
        open_run(make(), "x", store=store, run_id="r") as handle,
        trio.open_nursery() as nursery,
    ):
        async for event in handle.events():
            if event.kind is not EventKind.TEXT_DELTA:
                seen.append(event)
                nursery.start_soon(collect_after, handle, (event.seq, event.ordinal), resumed)
    async with open_run(make(), store=store, run_id="r") as finished:
        whole = [e async for e in finished.events()]
        assert seen == whole
        for i, event in enumerate(whole):
            assert resumed[event.seq, event.ordinal] == whole[i + 1 :]
            await collect_after(finished, (event.seq, event.ordinal), resumed)
            assert resumed[event.seq, event.ordinal] == whole[i + 1 :]
        with pytest.raises(UsageError):
            await anext(aiter(finished.events(from_seq=3, after=(2, 0))))


@pytest.mark.parametrize("from_seq", [1, 2])
async def test_from_seq_with_after_is_refused_even_when_it_is_1(from_seq, autojump_clock):
    """``from_seq`` and ``after`` are not given together (docs/events.md, "Reading events").

    ``from_seq=1`` with ``after`` was taken for ``after`` alone (1 was the default, so it
    could not be told from no ``from_seq``): ``after`` was honoured, ``from_seq`` ignored.
    """
    store = MemoryStore()
    await run_to_end(make(), "x", store=store, run_id="r")
    async with open_run(make(), store=store, run_id="r") as finished:
        whole = [e async for e in finished.events()]
        assert whole == [e async for e in finished.events(from_seq=1)]
        assert [e async for e in finished.events(after=(3, 0))] == [
            e for e in whole if (e.seq, e.ordinal) > (3, 0)
        ]
        both = finished.events(from_seq=from_seq, after=(3, 0))
        with pytest.raises(UsageError, match="give from_seq or after, not both"):
            async with aclosing(both):
                await anext(both)
