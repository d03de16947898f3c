from __future__ import annotations

import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

import treadle
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run, run
from treadle.testing.scripted import ScriptedModel, calls, say
from treadle.types import ActionResult, EventKind, StepRecord, ToolCall


def agent(turns, **kw):
    return treadle.Agent(
        model=ScriptedModel(turns=turns, **kw),
        executor=LedgerTools(),
        parser=SimpleParser(),
        budgets=treadle.Budgets(max_steps=1000),
    )


class SlowSink:
    def __init__(self):
        self.events = []

    async def send(self, event):
        await trio.sleep(3600)


class FailingSink:
    async def send(self, event):
        raise RuntimeError("sink is down")


class ListSink:
    def __init__(self):
        self.events = []

    async def send(self, event):
        self.events.append(event)


async def test_slow_and_failing_sinks_never_stall_the_run():
    good = ListSink()
    turns = [
        calls(ToolCall(id=f"c{i}", name="add", arguments={"a": i, "b": 1})) for i in range(100)
    ] + [say("done")]
    store = MemoryStore()
    with trio.fail_after(30):
        async with open_run(
            agent(turns), "x", store=store, run_id="r", sinks=[SlowSink(), FailingSink(), good]
        ) as handle:
            result = await handle.wait()
            stats = handle.statistics()
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    log = await store.read_log("r")
    assert stats.sink_failures > 0
    assert stats.sink_drops > 0  # the slow sink's buffer overflowed, events were dropped
    assert [e.seq for e in good.events if e.durable] == list(range(1, len(log.records) + 1))


class BridgedSink:
    """What a sink bridged to asyncio raises when its exporter's call was cancelled there."""

    async def send(self, event):
        import asyncio

        raise asyncio.CancelledError()


async def test_a_sink_raising_a_base_exception_is_a_counted_failure():
    """asyncio's CancelledError is a BaseException: it stopped the run with a raw
    exception group, though docs/events.md says a sink's failure is counted and the run
    goes on."""
    good = ListSink()
    turns = [calls(ToolCall(id="c1", name="add", arguments={"a": 1, "b": 1})), say("done")]
    store = MemoryStore()
    async with open_run(
        agent(turns), "x", store=store, run_id="r", sinks=[BridgedSink(), good]
    ) as handle:
        result = await handle.wait()
        stats = handle.statistics()
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert stats.sink_failures > 0 and good.events  # counted; the other sink fed on


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text for this one")


class UnprintableSink:
    async def send(self, event):
        raise Unprintable()


async def test_a_sink_raising_an_exception_that_cannot_be_printed_is_a_counted_failure():
    """Its warning formatted the exception's text inside the handler: the ``__str__`` that
    raised there interrupted the run (docs/seams.md, "Event sink": never)."""
    good = ListSink()
    turns = [calls(ToolCall(id="c1", name="add", arguments={"a": 1, "b": 1})), say("done")]
    store = MemoryStore()
    async with open_run(
        agent(turns), "x", store=store, run_id="r", sinks=[UnprintableSink(), good]
    ) as handle:
        events = [e async for e in handle.events()]
        result = await handle.wait()
        stats = handle.statistics()
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert stats.sink_failures > 0 and good.events
    (warning,) = [e.text for e in events if e.kind is EventKind.WARNING]
    assert warning.startswith(
        "sink UnprintableSink failed: Unprintable: (its message could not be read: RuntimeError)"
    )


async def test_parallel_batch_is_one_step_with_results_in_call_order():
    batch = calls(
        ToolCall(id="a", name="add", arguments={"a": 1, "b": 1}),
        ToolCall(id="b", name="add", arguments={"a": 2, "b": 2}),
        ToolCall(id="c", name="nope", arguments={}),
    )
    model = ScriptedModel(turns=[batch, say("ok")])
    store = MemoryStore()
    result = await run(
        treadle.Agent(model=model, executor=LedgerTools(), parser=SimpleParser()),
        "x",
        store=store,
        run_id="r",
    )
    assert result.totals.steps == 2
    log = await store.read_log("r")
    results = [r for r in log.records if isinstance(r, ActionResult)]
    assert [r.call_id for r in results] == ["a", "b", "c"]
    step = next(r for r in log.records if isinstance(r, StepRecord))
    assert step.observations[:2] == ("2", "4")
    assert step.action_result_ids == tuple(r.intent_id for r in results)
    tool_messages = [m for m in model.requests[1].messages if m.role == "tool"]
    assert [m.tool_call_id for m in tool_messages] == ["a", "b", "c"]


async def test_reconnect_at_every_seq_gives_the_same_events():
    store = MemoryStore()
    await run(
        agent([calls(ToolCall(id="a", name="add", arguments={"a": 1, "b": 1})), say("2")]),
        "x",
        store=store,
        run_id="r",
    )
    async with open_run(agent([]), store=store, run_id="r") as handle:
        full = [e async for e in handle.events()]
        for start in range(1, len(full) + 1):
            tail = [e async for e in handle.events(from_seq=start)]
            assert tail == [e for e in full if e.seq >= start]
    assert full[-1].kind is EventKind.RUN_FINISHED
    assert [e.step for e in full if e.kind is EventKind.STEP_STARTED] == [1, 2]


async def test_live_subscriber_joining_mid_run_sees_no_gap(autojump_clock):
    turns = [calls(ToolCall(id=f"c{i}", name="sleep", arguments={"s": 1})) for i in range(5)] + [
        say("done")
    ]
    store = MemoryStore()
    async with open_run(agent(turns), "x", store=store, run_id="r") as handle:
        await trio.sleep(2.5)
        seen = [e.seq async for e in handle.events(from_seq=1) if e.durable]
    log = await store.read_log("r")
    assert seen == list(range(1, len(log.records) + 1))


async def test_text_deltas_are_numbered_after_the_durable_event(autojump_clock):
    model = ScriptedModel(turns=[say("hello there, friend")], stream_chunk_chars=3)
    store = MemoryStore()
    deltas = []
    async with open_run(
        treadle.Agent(model=model, executor=LedgerTools(), parser=SimpleParser()),
        "x",
        store=store,
        run_id="r",
    ) as handle:
        async for event in handle.events():
            if event.kind is EventKind.TEXT_DELTA:
                deltas.append(event)
    assert "".join(d.text for d in deltas) == "hello there, friend"
    assert all(d.seq == 2 for d in deltas)  # after the model-call intent (seq 2)
    assert [d.ordinal for d in deltas] == list(range(1, len(deltas) + 1))


async def test_a_subscriber_cut_off_for_falling_behind_still_gets_every_durable_event(
    autojump_clock,
):
    turns = [
        calls(ToolCall(id=f"c{i}", name="add", arguments={"a": i, "b": 1})) for i in range(200)
    ] + [say("done")]
    store = MemoryStore()
    seen = []
    async with open_run(agent(turns), "x", store=store, run_id="r") as handle:
        async for event in handle.events():
            if event.durable:
                seen.append(event.seq)
            await trio.sleep(1)  # far slower than the run: its buffer overflows
        stats = handle.statistics()
    log = await store.read_log("r")
    assert stats.subscriber_drops >= 1  # it was cut off at least once ...
    assert seen == list(range(1, len(log.records) + 1))  # ... and lost no durable event


class LaterFailingSink:
    """Fails from its 50th event on (a subscriber is listening by then)."""

    def __init__(self):
        self.seen = 0

    async def send(self, event):
        self.seen += 1
        if self.seen >= 50:
            raise RuntimeError("sink is down")


async def test_subscribers_are_warned_once_when_a_sink_fails_or_falls_behind(autojump_clock):
    turns = [
        calls(ToolCall(id=f"c{i}", name="add", arguments={"a": i, "b": 1})) for i in range(100)
    ] + [say("done")]
    store = MemoryStore()
    sinks = [SlowSink(), LaterFailingSink()]
    async with open_run(agent(turns), "x", store=store, run_id="r", sinks=sinks) as handle:
        events = [e async for e in handle.events()]
    warnings = [e for e in events if e.kind is EventKind.WARNING]
    texts = sorted(w.text for w in warnings)
    assert len(texts) == 2
    assert texts[0].startswith("sink LaterFailingSink failed: RuntimeError: sink is down")
    assert texts[1].startswith("sink SlowSink fell behind")
    keys = [(e.seq, e.ordinal) for e in events]
    assert keys == sorted(keys)  # (seq, ordinal) never goes backwards


@pytest.mark.parametrize("read_first", range(7))
async def test_a_cut_off_subscriber_gets_the_same_events_as_a_reader_of_the_log(
    read_first, autojump_clock
):
    turns = [
        calls(ToolCall(id=f"c{i}", name="add", arguments={"a": i, "b": 1})) for i in range(80)
    ] + [say("done")]
    store = MemoryStore()
    async with open_run(agent(turns), "x", store=store, run_id="r") as handle:
        events = handle.events()
        live = [await events.__anext__() for _ in range(1 + read_first)]
        await handle.wait()  # it stopped reading: cut off somewhere in the run
        live += [e async for e in events]
    async with open_run(agent(turns), store=store, run_id="r") as finished:
        stored = [e async for e in finished.events()]
    log = await store.read_log("r")
    assert log.finished.subscriber_drops == 1
    assert live == stored


class KeepingSink:
    def __init__(self) -> None:
        self.events: list[treadle.Event] = []

    async def send(self, event: treadle.Event) -> None:
        self.events.append(event)


async def test_a_run_drained_between_steps_hands_its_last_step_to_its_sinks(tmp_path):
    """A step's results and record are written without a barrier, and their events wait for
    the next one; a drain between steps writes none, so the sink never got that step (and a
    later drive of the run starts after it). The drive's end now hands them out once the
    store committed them."""

    @treadle.tool
    async def slow(x: int) -> int:
        """Take a moment."""
        await trio.sleep(0.3)
        return x

    turns = [calls(ToolCall(id="c1", name="slow", arguments={"x": 1})), say("done")]
    sink = KeepingSink()
    async with treadle.open_sqlite_store(tmp_path / "s.db") as store:
        agent_ = treadle.Agent(
            model=ScriptedModel(turns=turns),
            executor=treadle.Toolbox([slow]),
            parser=treadle.NativeToolCallParser(),
        )
        async with open_run(agent_, "go", store=store, run_id="r", sinks=[sink]) as handle:
            await trio.sleep(0.15)  # in the tool call
            handle.drain()
            with pytest.raises(treadle.RunInterrupted):
                await handle.wait()
        log = await store.read_log("r")
    assert isinstance(log.records[-1], StepRecord)  # stopped after the step, no barrier
    shown = [e.seq for e in sink.events if e.durable]
    assert shown == list(range(1, len(log.records) + 1))


async def test_every_event_a_subscriber_gets_is_already_in_the_database_file(tmp_path):
    """docs/events.md, "Numbering": an event is handed out once its record is durable. A
    second connection to the SQLite file, opened as each event arrives, must already find
    its record there: before, a model result's event went out while the record was queued,
    and a crash then could take back what the subscriber had been shown."""
    import contextlib
    import sqlite3

    turns = [calls(ToolCall(id=f"c{i}", name="add", arguments={"a": i, "b": 1})) for i in range(5)]
    path = tmp_path / "s.db"
    late: list[tuple[int, int]] = []
    async with treadle.open_sqlite_store(path) as store:
        async with open_run(agent([*turns, say("done")]), "x", store=store, run_id="r") as handle:
            async for event in handle.events():
                if not event.durable:
                    continue
                with contextlib.closing(sqlite3.connect(path)) as conn:  # committed rows only
                    (stored,) = conn.execute(
                        "SELECT COALESCE(MAX(seq), 0) FROM records WHERE run_id = 'r'"
                    ).fetchone()
                if stored < event.seq:
                    late.append((event.seq, stored))
        log = await store.read_log("r")
    assert len(log.records) > 20
    assert late == []


async def test_a_sink_is_told_once_when_the_drive_here_stops_with_the_run_unfinished(
    autojump_clock,
):
    """docs/events.md, "Sinks and subscribers never stall a run": a drive that stopped
    without a run-finished record (drained here) gave its sinks no sign of it, so a sink
    keeping something open for the run (a span) kept it open for ever. Now the sinks get one
    ``run_left`` event after the drive's last one; the drive that finishes the run, none."""
    entered, gate = trio.Event(), trio.Event()

    @treadle.tool
    async def hold(x: int) -> int:
        """Wait for the gate."""
        entered.set()
        await gate.wait()
        return x

    agent_ = treadle.Agent(
        model=ScriptedModel(
            turns=[calls(ToolCall(id="c1", name="hold", arguments={"x": 1})), say("done")]
        ),
        executor=treadle.Toolbox([hold]),
        parser=treadle.NativeToolCallParser(),
    )
    store, sink = MemoryStore(), KeepingSink()
    with trio.fail_after(60):
        async with open_run(agent_, "go", store=store, run_id="r", sinks=[sink]) as handle:
            await entered.wait()
            handle.drain()
            gate.set()
            with pytest.raises(treadle.RunInterrupted):
                await handle.wait()
    drained = len((await store.read_log("r")).records)
    *events, left = sink.events
    assert left.kind is EventKind.RUN_LEFT and left.text == "drained" and left.record is None
    assert (left.run_id, left.seq, left.ordinal) == ("r", drained, 0)
    assert [e.seq for e in events if e.durable] == list(range(1, drained + 1))
    sink.events.clear()
    with trio.fail_after(60):
        async with open_run(agent_, "go", store=store, run_id="r", sinks=[sink]) as again:
            await again.wait()
    assert [e.kind for e in sink.events][-1] is EventKind.RUN_FINISHED
    assert EventKind.RUN_LEFT not in [e.kind for e in sink.events]


class BurstyModel:
    """Streams its reply as a network would: bursts of 100 pieces of 100 characters, one
    scheduler pass apart (the writer joins pieces into deltas of up to 1 KiB)."""

    def __init__(self, bursts: int) -> None:
        self.text = "".join(f"{i:>99}\n" for i in range(100 * bursts))
        self.inner = ScriptedModel(turns=[say(self.text)])

    async def complete(self, request, *, on_delta=None, attempt=None):
        for start in range(0, len(self.text), 100 * 100):
            for offset in range(start, start + 100 * 100, 100):
                on_delta("text", self.text[offset : offset + 100])
            await trio.lowlevel.checkpoint()
        return await self.inner.complete(request)


async def test_a_subscriber_that_keeps_up_takes_a_burst_of_deltas_in_one_pass():
    """A reader of `RunHandle.events` doing nothing else was cut off for falling behind a
    fast stream and lost deltas: it took one event per scheduler pass while the writer handed
    it a hundred per pass."""
    model = BurstyModel(bursts=100)  # 1 MB
    seen = []
    async with open_run(
        treadle.Agent(model=model, executor=LedgerTools(), parser=SimpleParser()),
        "x",
        store=MemoryStore(),
        run_id="r",
    ) as handle:
        async for event in handle.events():
            if event.kind is EventKind.TEXT_DELTA:
                seen.append(event.text)
        stats = handle.statistics()
    assert stats.subscriber_drops == 0
    assert "".join(seen) == model.text
