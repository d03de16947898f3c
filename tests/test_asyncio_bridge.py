"""The asyncio bridge (docs/asyncio.md): trio in a thread behind a portal, runs driven from
asyncio, and a clear error for the trio API called from asyncio directly.

Each test runs its own asyncio loop with ``asyncio.run`` (pytest-trio runs these plain
functions as they are).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

import treadle
import treadle.approvals
from treadle.asyncio import Runs, event_data, open_portal, open_runs, resume_after, sse_frame
from treadle.stores.memory import MemoryStore
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import ApprovalDecided, CancelRequested, EventKind, RunState, StopReason


@treadle.tool(requires_approval=True)
async def wire(amount: int) -> str:
    """Send money."""
    return f"sent {amount}"


@treadle.tool(timeout_s=600)
async def slow(seconds: float) -> str:
    """Take a while."""
    await trio.sleep(seconds)
    return "slept"


def wire_agent() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("wire", amount=5, call_id="p1"), say("paid")]),
        executor=treadle.Toolbox([wire]),
        parser=treadle.NativeToolCallParser(),
    )


def slow_agent() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("slow", seconds=600), say("woke")]),
        executor=treadle.Toolbox([slow]),
        parser=treadle.NativeToolCallParser(),
        limits=treadle.Limits(tool_timeout_s=600),
    )


def sqlite(path: Path):
    return lambda: treadle.open_sqlite_store(path)


def run_asyncio(main):
    return asyncio.run(asyncio.wait_for(main(), 60))


# --------------------------------------------------------------------------- the clear error


@pytest.mark.parametrize(
    "entry",
    [
        lambda tmp: treadle.run(wire_agent(), "pay", store=treadle.MemoryStore()),
        lambda tmp: treadle.open_run(wire_agent(), "pay", store=treadle.MemoryStore()),
        lambda tmp: treadle.open_sqlite_store(tmp / "r.db"),
        lambda tmp: treadle.open_jsonl_store(tmp / "j"),
        lambda tmp: treadle.open_fleet(treadle.MemoryStore(), {"a": wire_agent}),
        lambda tmp: treadle.wait_result(treadle.MemoryStore(), "r"),
        lambda tmp: treadle.resume_unfinished(wire_agent(), store=treadle.MemoryStore()),
        # They failed with asyncio's "Task got bad yield: ... CancelShieldedCheckpoint".
        lambda tmp: treadle.approvals.decide(treadle.MemoryStore(), "r"),
        lambda tmp: treadle.approvals.request_cancel(treadle.MemoryStore(), "r", reason="x"),
    ],
)
def test_the_trio_api_called_from_asyncio_names_the_bridge(entry, tmp_path: Path):
    async def main():
        made = entry(tmp_path)
        with pytest.raises(treadle.UsageError) as raised:
            if hasattr(made, "__aenter__"):
                async with made:
                    pass
            else:
                await made
        return str(raised.value)

    message = run_asyncio(main)
    assert "called from asyncio" in message
    assert "treadle.asyncio" in message and "docs/asyncio.md" in message
    assert not (tmp_path / "r.db").exists()  # refused before anything was opened


# --------------------------------------------------------------------------- the portal


def test_the_portal_calls_trio_and_hands_back_results_and_errors():
    async def answer(x: int) -> tuple[int, str]:
        await trio.lowlevel.checkpoint()
        return x + 1, trio.lowlevel.current_task().name

    async def fail() -> None:
        await trio.lowlevel.checkpoint()
        raise KeyError("inside trio")

    async def main():
        async with open_portal() as portal:
            value, task = await portal.call(answer, 41)
            with pytest.raises(KeyError, match="inside trio"):
                await portal.call(fail)
        with pytest.raises(treadle.UsageError, match="closed"):
            await portal.call(answer, 1)
        return value, task

    value, task = run_asyncio(main)
    assert value == 42 and "answer" in task


class Unusual(BaseException):
    """A library's own BaseException (neither trio's nor Python's exit)."""


def test_a_call_raising_a_base_exception_hands_it_back_unchanged():
    # Before, any BaseException ended the portal's trio thread, and its caller was told
    # "the call was cancelled in trio: the portal closed".
    async def odd() -> None:
        await trio.lowlevel.checkpoint()
        raise Unusual("odd")

    async def leave(code: int) -> None:
        await trio.lowlevel.checkpoint()
        raise SystemExit(code)

    async def ok() -> str:
        return "still serving"

    async def main():
        async with open_portal() as portal:
            with pytest.raises(Unusual, match="odd"):
                await portal.call(odd)
            assert await portal.call(ok) == "still serving"  # only the call ended
            with pytest.raises(SystemExit) as left:
                await portal.call(leave, 3)
            assert left.value.code == 3
            with pytest.raises(treadle.UsageError, match=r"closed|stopped"):
                await portal.call(ok)  # an exit ends the trio thread, as it ends a trio run

    with pytest.raises(SystemExit) as ended:  # itself, as a trio run raises it: not a group
        run_asyncio(main)  # leaving the block raises what ended the thread
    assert ended.value.code == 3


def test_an_iterator_raising_a_base_exception_ends_only_its_iteration():
    # Before, the pump let it into the portal's nursery: every call and run of the process
    # was told "the portal closed".
    async def items():
        yield 1
        raise Unusual("odd")

    async def ok() -> str:
        return "still serving"

    async def main():
        seen = []
        async with open_portal() as portal:
            with pytest.raises(Unusual, match="odd"):
                async for item in portal.iterate(items):
                    seen.append(item)
            assert await portal.call(ok) == "still serving"
        return seen

    assert run_asyncio(main) == [1]


async def _raise_a_stray_cancellation() -> None:
    """Raise a `trio.Cancelled` caught in a cancel scope since left: nothing cancels the caller."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            caught = exc
    raise caught


def test_a_stray_trio_cancellation_reaches_its_caller_and_ends_only_its_call(tmp_path: Path):
    """Any trio.Cancelled a called function raised went into the portal's nursery: the runs
    of the block were cut without a drain, and that call and every later one failed with
    "its treadle.asyncio block was left" while the block was open."""

    async def grouped() -> None:
        try:
            await _raise_a_stray_cancellation()
        except trio.Cancelled as stray:
            raise BaseExceptionGroup("both", [ValueError("real"), stray]) from None

    async def stray_items() -> AsyncIterator[int]:
        yield 1
        await _raise_a_stray_cancellation()

    async def main():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            await runs.start("pay", run_id="w1")
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)
            with pytest.raises(trio.Cancelled):
                await runs.portal.call(_raise_a_stray_cancellation)
            with pytest.raises(BaseExceptionGroup) as group:
                await runs.portal.call(grouped)
            items = []
            with pytest.raises(trio.Cancelled):
                async for item in runs.portal.iterate(stray_items):
                    items.append(item)
            await runs.approve("w1")  # the run was not cut: it still waits here
            return group.value, items, await runs.result("w1")

    group, items, result = run_asyncio(main)
    assert group.subgroup(ValueError) is not None and items == [1]
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"


class _Loud:
    """A callable whose repr is what a host's bound method's repr was: costly, here counted."""

    def __init__(self) -> None:
        self.reprs = 0

    async def __call__(self) -> str:
        await trio.lowlevel.checkpoint()
        return "answered"

    def __repr__(self) -> str:
        self.reprs += 1
        return "x" * 1000


def test_a_call_never_builds_its_functions_repr():
    """The task name was ``getattr(fn, "__qualname__", repr(fn))``, whose default is always
    evaluated: the repr of a `Runs` host method holds every run it drives, and each call
    cost time in proportion (22 ms with 300 runs), the asyncio loop blocked meanwhile."""
    loud = _Loud()

    async def main():
        async with open_portal() as portal:
            return await portal.call(loud)

    assert run_asyncio(main) == "answered"
    assert loud.reprs == 0


def test_a_call_that_reaches_a_closing_portal_is_refused_not_an_internal_error():
    """A call made as the trio thread ends (a SystemExit of an earlier call is ending it)
    reached a nursery that takes no more tasks: the refusal, raised in a callback of the
    trio run, ended it with TrioInternalError. It now fails that call alone."""
    from treadle.asyncio import TrioPortal

    async def main() -> list[bool]:
        async with trio.open_nursery() as nursery:
            pass  # closed: it takes no more tasks
        loop = asyncio.new_event_loop()
        try:
            portal = TrioPortal(loop, trio.lowlevel.current_trio_token(), nursery)
            refused: list[bool] = []
            portal._spawn(nursery, trio.sleep_forever, "late", lambda: refused.append(True))
        finally:
            loop.close()
        return refused

    assert trio.run(main) == [True]


def test_cancelling_the_asyncio_caller_cancels_the_call_in_trio():
    async def main():
        started, ended = asyncio.Event(), asyncio.Event()
        outcome: list[str] = []
        loop = asyncio.get_running_loop()

        async def forever() -> None:
            try:
                loop.call_soon_threadsafe(started.set)
                await trio.sleep_forever()
            except trio.Cancelled:
                outcome.append("cancelled in trio")
                raise
            finally:
                loop.call_soon_threadsafe(ended.set)

        async with open_portal() as portal:
            waiting = asyncio.create_task(portal.call(forever))
            await started.wait()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await ended.wait()
        return outcome

    assert run_asyncio(main) == ["cancelled in trio"]


def test_iterating_from_asyncio_and_leaving_early_stops_the_trio_iterator():
    async def main():
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def numbers():
            try:
                for n in range(10_000):
                    await trio.lowlevel.checkpoint()
                    yield n
            finally:
                loop.call_soon_threadsafe(stopped.set)

        async def broken():
            yield 1
            raise ValueError("the iterator failed")

        async with open_portal() as portal:
            seen = []
            async for n in portal.iterate(numbers, buffer=2):
                seen.append(n)
                if n == 4:
                    break
            await stopped.wait()
            got = []
            with pytest.raises(ValueError, match="the iterator failed"):
                async for n in portal.iterate(broken):
                    got.append(n)
        return seen, got

    seen, got = run_asyncio(main)
    assert seen == [0, 1, 2, 3, 4] and got == [1]


# --------------------------------------------------------------------------- runs from asyncio


async def _until(runs: Runs, run_id: str, kind: EventKind) -> list:
    seen = []
    async for event in runs.events(run_id):
        seen.append(event)
        if event.kind is kind:
            return seen
    raise AssertionError(f"no {kind} in {[e.kind for e in seen]}")


def test_runs_start_stream_approve_and_finish_from_asyncio(tmp_path: Path):
    async def main():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            assert runs.resumed == ()
            run_id = await runs.start("pay", run_id="w1")
            assert await runs.start("pay", run_id="w1") == "w1"  # driven here already
            before = await _until(runs, run_id, EventKind.APPROVAL_REQUESTED)
            decided = await runs.approve(run_id)
            result = await runs.result(run_id)
            events = [e async for e in runs.events(run_id)]
            resumed = [e async for e in runs.events(run_id, after=(1, 0))]
        return before, decided, result, events, resumed

    before, decided, result, events, resumed = run_asyncio(main)
    assert before[-1].record.tool == "wire" and decided.decision == "approve"
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"
    durable = [e.seq for e in events if e.record is not None]
    assert durable == list(range(1, len(durable) + 1)) and events[-1].kind is EventKind.RUN_FINISHED
    frame = sse_frame(events[-1], run_id="w1").decode()
    assert frame.startswith(f"id: {events[-1].seq}\nevent: run_finished\ndata: {{")
    assert event_data(events[-1])["state"] == "succeeded"
    # A step-started event has the seq of the durable event before it: its id names its
    # ordinal too, so a browser that reconnects after either of them misses neither.
    step_started = next(e for e in events if e.kind is EventKind.STEP_STARTED)
    frame = sse_frame(step_started, run_id="w1").decode()
    assert frame.startswith(f"id: {step_started.seq}.1\nevent: step_started\n")
    assert resume_after(f"{step_started.seq}.1") == (step_started.seq, 1)
    assert resume_after(str(events[-1].seq)) == (events[-1].seq, 0)
    for bad in ("", "-1", "1.", "x", "1.2.3", " 1"):
        with pytest.raises(treadle.UsageError):
            resume_after(bad)
    delta = attrs.evolve(step_started, kind=EventKind.TEXT_DELTA, text="x", ordinal=2)
    assert not sse_frame(delta, run_id="w1").startswith(b"id:")
    assert resumed == events[1:] and resumed[0] == step_started  # after run_started (1, 0)


@pytest.mark.parametrize(
    "bad",
    ["1" * 5000, "7." + "1" * 5000, "1" * 20, "\u0663", "\u0663.\u0661"],
    ids=["5000-digits", "5000-digit-ordinal", "20-digits", "arabic-indic", "arabic-indic-ordinal"],
)
def test_resume_after_refuses_an_id_of_too_many_or_non_ascii_digits(bad: str):
    """A 5000-digit ``Last-Event-ID`` raised int()'s ValueError (the FastAPI example answered
    500), and ``\\d`` read Arabic-Indic digits as a seq: both are a UsageError (a 400)."""
    with pytest.raises(treadle.UsageError, match=r"an event id is <seq> or <seq>\.<ordinal>"):
        resume_after(bad)
    assert resume_after("9" * 19 + "." + "9" * 19) == (10**19 - 1, 10**19 - 1)


def test_text_no_utf8_encoder_takes_is_framed_with_u_fffd_not_an_encode_error(tmp_path: Path):
    """A server's escaped lone surrogate reaches the live deltas as it came (a pair split
    across two chunks gives two deltas of one half each), and a log written before text
    entering it was repaired may hold one: `sse_frame` raised UnicodeEncodeError on them,
    breaking the stream after its 200. They are framed with U+FFFD, as ``treadle tail``
    prints them."""
    agent = treadle.Agent(
        model=ScriptedModel(
            turns=[call("wire", amount=5, call_id="p1"), say("smile \ud800 ok")],
            stream_chunk_chars=1,
        ),
        executor=treadle.Toolbox([wire]),
        parser=treadle.NativeToolCallParser(),
    )

    async def main():
        async with open_runs(agent, store=sqlite(tmp_path / "r.db")) as runs:
            await runs.start("pay", run_id="u1")
            events = await _until(runs, "u1", EventKind.APPROVAL_REQUESTED)
            await runs.approve("u1")  # the answer streams to a subscriber live since before
            async with aclosing(runs.events("u1", after=(events[-1].seq, 0))) as more:
                events += [event async for event in more]
        return events

    events = run_asyncio(main)
    deltas = [e for e in events if e.kind is EventKind.TEXT_DELTA]
    assert "".join(e.text for e in deltas) == "smile \ud800 ok"  # live, as the server sent it
    half = attrs.evolve(deltas[-1], text="\ude00 ok")  # the second half of a split pair
    older = treadle.Event(
        run_id="u1",
        seq=9,
        kind=EventKind.CANCEL_REQUESTED,
        record=CancelRequested(run_id="u1", ts="2026-01-01T00:00:00+00:00", reason="a\ud800b"),
    )
    data = [
        json.loads(sse_frame(event, run_id="u1").decode("utf-8").split("\ndata: ", 1)[1])
        for event in [*events, half, older]
    ]
    assert "".join(d["text"] for d in data[:-2] if d["kind"] == "text_delta") == "smile \ufffd ok"
    assert data[-3]["kind"] == "run_finished" and data[-3]["final_answer"] == "smile \ufffd ok"
    assert data[-2]["text"] == "\ufffd ok" and data[-1]["reason"] == "a\ufffdb"
    assert event_data(older)["reason"] == "a\ufffdb"


@treadle.tool
async def look_up(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def planner_agent(store: MemoryStore) -> treadle.Agent:
    """A planner that asks a child run for the weather, after a payment waiting for approval.

    The approval lets a stream be live before the child starts; the child looks the weather
    up three times, then the planner looks it up once more and answers.
    """
    researcher = treadle.Agent(
        model=ScriptedModel(
            turns=[*(call("look_up", city=c) for c in ("Oslo", "Bergen", "Rome")), say("sunny")]
        ),
        executor=treadle.Toolbox([look_up]),
        parser=treadle.NativeToolCallParser(),
    )
    ask = treadle.agent_tool(researcher, store=store, name="research", description="Ask.")
    return treadle.Agent(
        model=ScriptedModel(
            turns=[
                call("wire", amount=5, call_id="p1"),
                call("research", task="weather?"),
                call("look_up", city="Paris"),
                say("Pack sunglasses."),
            ]
        ),
        executor=treadle.Toolbox([wire, ask, look_up]),
        parser=treadle.NativeToolCallParser(),
    )


def _frame_id(frame: bytes) -> str | None:
    """The ``id:`` of an SSE frame, or ``None`` when it has none."""
    ids = [line[4:] for line in frame.decode().split("\n") if line.startswith("id: ")]
    return ids[0] if ids else None


def test_a_child_runs_events_carry_no_sse_id_so_a_reconnect_resumes_the_parent_where_it_was():
    """A reconnect after a child run's events resumes the parent after its own last event.

    The child's events of a parent's stream had ``id: <child seq>``: a browser whose stream
    broke after the child's seq 3 sent ``Last-Event-ID: 3`` and the parent resumed after its
    own seq 3 (events sent twice), or, after a child seq past the parent's, skipped the
    parent's events up to it.
    """
    store = MemoryStore()

    @asynccontextmanager
    async def opened() -> AsyncIterator[MemoryStore]:
        yield store

    async def main():
        async with open_runs(planner_agent(store), store=opened, park_after_s=None) as runs:
            run_id = await runs.start("Plan", run_id="trip")
            first: list[tuple[treadle.Event, str | None]] = []
            last_id = None
            child_durable = 0
            async with aclosing(runs.events(run_id)) as events:
                async for event in events:  # the browser's first connection
                    event_id = _frame_id(sse_frame(event, run_id=run_id))
                    last_id = last_id if event_id is None else event_id
                    first.append((event, event_id))
                    if event.kind is EventKind.APPROVAL_REQUESTED:
                        await runs.approve(run_id)  # the child then runs while it listens
                    child_durable += event.run_id != run_id and event.durable
                    if child_durable == 3:
                        break  # the connection breaks after the child's seq 3
            assert last_id is not None
            again = [e async for e in runs.events(run_id, after=resume_after(last_id))]
            assert (await runs.result(run_id)).final_answer == "Pack sunglasses."
            stored = [e async for e in runs.events(run_id)]
        return first, again, stored

    first, again, stored = run_asyncio(main)
    child = [(e, i) for e, i in first if e.run_id != "trip"]
    assert [e.seq for e, _ in child if e.durable] == [1, 2, 3]
    assert all(i is None for _, i in child)  # the browser's cursor stays the parent's
    # and the page tells the child's events from the parent's by their data's run id, a
    # step-started event's too (it had none: the child's looked like the parent's)
    data = [json.loads(sse_frame(e, run_id="trip").split(b"\ndata: ", 1)[1]) for e, _ in first]
    assert [d["run_id"] for d in data] == [e.run_id for e, _ in first]
    assert any(e.kind is EventKind.STEP_STARTED for e, _ in child)

    def kept(e: treadle.Event) -> bool:  # the parent's events a reconnect must not lose
        return e.run_id == "trip" and (e.durable or e.kind is EventKind.STEP_STARTED)

    marked = [(e.seq, e.ordinal) for e, i in first if e.run_id == "trip" and i is not None]
    assert marked == [(e.seq, e.ordinal) for e, _ in first if kept(e)]
    assert all(kept(e) for e in stored)
    # every parent event across both connections, once, in order
    seen = [e for e, _ in first] + again
    assert [(e.seq, e.ordinal) for e in seen if kept(e)] == [(e.seq, e.ordinal) for e in stored]


def test_two_starts_of_one_run_at_once_make_one_driver(tmp_path: Path):
    # A client retrying `POST /runs` with the same id, under a fixed owner: both starts
    # passed the check for runs driven here before either had registered, the lease let the
    # same owner in twice, and the run died with LeaseLost (one start got a ConflictError).
    async def main():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db"), owner="app-1") as runs:
            started = await asyncio.gather(*(runs.start("pay", run_id="w1") for _ in range(3)))
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)
            await runs.approve("w1")
            return started, await runs.result("w1")

    started, result = run_asyncio(main)
    assert started == ["w1", "w1", "w1"]
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"


def test_a_start_with_another_input_under_a_run_id_driven_here_is_refused(tmp_path: Path):
    """It returned the id, and the result of the run started on the first input."""

    async def main():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            await runs.start("pay", run_id="w1")
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)  # driven here
            assert await runs.start("pay", run_id="w1") == "w1"  # the same again: its id
            assert await runs.start(run_id="w1") == "w1"  # no input: whatever it was
            with pytest.raises(treadle.UsageError, match="the input differs"):
                await runs.start("pay twice", run_id="w1")
            await runs.approve("w1")
            return await runs.result("w1")

    result = run_asyncio(main)
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"


def test_a_start_with_neither_input_nor_run_id_names_no_run_id_of_its_own(tmp_path: Path):
    """It was refused for a run id made up inside the start: "run 'run-039426ec27a1b7d0' does
    not exist; a new run needs an input", an id the caller never gave nor could know."""

    async def main():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            with pytest.raises(treadle.UsageError) as refused:
                await runs.start()
            with pytest.raises(treadle.UsageError, match="'ghost' does not exist"):
                await runs.start(run_id="ghost")  # an id given: that one is named
            return str(refused.value)

    message = run_asyncio(main)
    assert "a new run needs an input" in message and "run-" not in message, message


def test_a_cancel_from_asyncio_ends_the_run_cancelled(tmp_path: Path):
    async def main():
        async with open_runs(slow_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            run_id = await runs.start("sleep")
            await _until(runs, run_id, EventKind.ACTION_REQUESTED)
            await runs.cancel(run_id, "no time", canceller="test")
            return await runs.result(run_id)

    result = run_asyncio(main)
    assert result.state is RunState.CANCELLED and result.stop_reason is StopReason.CANCELLED


def _in_another_loop(make: Callable[[], Awaitable[object]]) -> BaseException | None:
    """Await ``make()`` in a fresh ``asyncio.run`` of the calling thread; what it raised."""

    async def attempt() -> BaseException | None:
        try:
            await make()
        except BaseException as exc:
            return exc
        return None

    return asyncio.run(attempt())


def test_calls_awaited_in_another_event_loop_are_refused_before_they_act(tmp_path: Path):
    """Awaited in a second thread's own loop, a call crossed to trio and acted (the run was
    started, the approval applied and the tool ran) before its await failed with asyncio's
    "got Future attached to a different loop"."""

    async def main():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            refused = {
                "start": await asyncio.to_thread(
                    _in_another_loop, lambda: runs.start("pay", run_id="w1")
                )
            }
            with pytest.raises(treadle.UsageError, match="no run 'w1'"):  # never started
                async for _ in runs.events("w1"):
                    pass
            await runs.start("pay", run_id="w1")
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)
            elsewhere = {
                "approve": lambda: runs.approve("w1"),
                "cancel": lambda: runs.cancel("w1", "from elsewhere"),
                "result": lambda: runs.result("w1"),
                "events": lambda: anext(aiter(runs.events("w1"))),
                "portal": lambda: runs.portal.call(trio.lowlevel.checkpoint),
            }
            for name, made in elsewhere.items():
                refused[name] = await asyncio.to_thread(_in_another_loop, made)
            decided = await runs.approve("w1")  # the run still waits for its decision
            return refused, decided, await runs.result("w1"), len(runs.portal._pending)

    refused, decided, result, pending = run_asyncio(main)
    for name, error in refused.items():
        assert isinstance(error, treadle.UsageError), (name, error)
        assert "asyncio loop that opened" in str(error) and "nothing was done" in str(error)
    assert decided.decision == "approve" and pending == 0
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"  # not cancelled


def test_unfinished_runs_resume_when_the_bridge_opens_again(tmp_path: Path):
    async def first():
        async with open_runs(
            wire_agent(), store=sqlite(tmp_path / "r.db"), park_after_s=None
        ) as runs:
            await runs.start("pay", run_id="w1")
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)
        # leaving the block drained the run: unfinished, its lease released
        async with open_runs(
            slow_agent(), store=sqlite(tmp_path / "r.db"), resume=False, drain_s=0
        ) as runs:
            await runs.start("sleep", run_id="other-agent")
            await _until(runs, "other-agent", EventKind.ACTION_REQUESTED)

    async def second():
        async with open_runs(wire_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            resumed, refused = runs.resumed, runs.not_resumed
            await runs.approve("w1")
            return resumed, refused, await runs.result("w1")

    run_asyncio(first)
    resumed, refused, result = run_asyncio(second)
    assert resumed == ("w1",) and result.final_answer == "paid"
    # a run of another agent definition is not resumed under this one, and does not stop it
    ((run_id, why),) = refused
    assert run_id == "other-agent" and why.startswith("SnapshotMismatch")


def test_events_of_runs_not_driven_here_come_from_the_store(tmp_path: Path):
    db = tmp_path / "r.db"

    async def finish_one() -> None:
        async with treadle.open_sqlite_store(db) as store:
            run = treadle.run(
                treadle.Agent(
                    model=ScriptedModel(turns=[say("hi")]),
                    executor=treadle.Toolbox([]),
                    parser=treadle.NativeToolCallParser(),
                ),
                "hello",
                store=store,
                run_id="done",
            )
            assert (await run).final_answer == "hi"

    trio.run(finish_one)

    async def main():
        async with open_runs(wire_agent(), store=sqlite(db)) as runs:
            stored = [e.kind async for e in runs.events("done", from_seq=2)]
            with pytest.raises(treadle.UsageError, match="must be a whole number"):
                [e async for e in runs.events("done", from_seq=2.5)]  # type: ignore[arg-type]
            with pytest.raises(treadle.UsageError, match="give from_seq or after, not both"):
                [e async for e in runs.events("done", from_seq=1, after=(1, 0))]
            with pytest.raises(treadle.UsageError, match="no run 'nope'"):
                async for _ in runs.events("nope"):
                    pass
            return stored

    stored = run_asyncio(main)
    # from seq 2: the step-started event carries seq 1 (the event before it), so it is not
    assert stored[0] is EventKind.MODEL_CALL_STARTED and stored[-1] is EventKind.RUN_FINISHED


def say_agent() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[say("hi")]),
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
    )


class HeldControl(MemoryStore):
    """Holds the first write of a ``held`` record (to the log or the control stream).

    ``holding`` is set once that write waits; it goes on when ``release`` is set.
    """

    held: type
    holding: trio.Event
    release: trio.Event

    async def _hold(self, record: object) -> None:
        if isinstance(record, self.held) and not self.holding.is_set():
            self.holding.set()
            await self.release.wait()

    async def write_control(self, record, *, seq, generation):
        await self._hold(record)
        await super().write_control(record, seq=seq, generation=generation)

    async def append_control(self, record):
        await self._hold(record)
        return await super().append_control(record)


def held_store(
    held: type, kept: list[HeldControl]
) -> Callable[[], AbstractAsyncContextManager[MemoryStore]]:
    """An opener of a `HeldControl` store (made in the trio thread), kept in ``kept``."""

    @asynccontextmanager
    async def opened() -> AsyncIterator[MemoryStore]:
        store = HeldControl()
        store.held, store.holding, store.release = held, trio.Event(), trio.Event()
        kept.append(store)
        try:
            yield store
        finally:
            await store.aclose()

    return opened


async def _parked(runs: Runs, run_id: str) -> None:
    assert await runs._host.handles[run_id].wait_parked()


async def _set(event: trio.Event) -> None:
    event.set()


@pytest.mark.parametrize("park_after_s", [None, 0.0])
def test_a_second_decision_through_the_bridge_is_refused_before_the_first_is_recorded(
    park_after_s: float | None,
):
    """Runs.approve used the run's handle only while it reported a pending approval: once
    the first decision was handed over, a second one went to treadle.approvals.decide,
    which cannot see a decision the run has not recorded yet, and was returned as taken
    while the run applied the first (docs/events.md, "Human approval", 2.)."""
    kept: list[HeldControl] = []

    async def main():
        async with open_runs(
            wire_agent(), store=held_store(ApprovalDecided, kept), park_after_s=park_after_s
        ) as runs:
            await runs.start("pay", run_id="w1")
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)
            if park_after_s is not None:
                await runs.portal.call(_parked, runs, "w1")
            first = await runs.approve("w1")
            (store,) = kept
            await runs.portal.call(store.holding.wait)  # the first is being recorded
            with pytest.raises(treadle.UsageError, match=r"handed to it already|not waiting"):
                await runs.approve("w1", reject="do not pay")
            await runs.portal.call(_set, store.release)
            result = await runs.result("w1")
            events = [e async for e in runs.events("w1")]
        return first, result, events

    first, result, events = run_asyncio(main)
    assert first.decision == "approve"
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"
    decided = [e.record.decision for e in events if e.kind is EventKind.APPROVAL_DECIDED]
    assert decided == ["approve"]


@pytest.mark.parametrize("park_after_s", [None, 0.0])
def test_an_approve_after_a_cancel_through_the_bridge_is_refused(park_after_s: float | None):
    """The approve went to treadle.approvals.decide once the handle stopped reporting a
    pending approval, and was returned as taken; the run ended cancelled without it."""
    kept: list[HeldControl] = []

    async def main():
        async with open_runs(
            wire_agent(), store=held_store(CancelRequested, kept), park_after_s=park_after_s
        ) as runs:
            await runs.start("pay", run_id="w1")
            await _until(runs, "w1", EventKind.APPROVAL_REQUESTED)
            if park_after_s is not None:
                await runs.portal.call(_parked, runs, "w1")
            await runs.cancel("w1", "withdrawn")
            (store,) = kept
            await runs.portal.call(store.holding.wait)  # the cancel is being recorded
            with pytest.raises(treadle.UsageError, match=r"being cancelled|not waiting"):
                await runs.approve("w1")
            await runs.portal.call(_set, store.release)
            result = await runs.result("w1")
            events = [e async for e in runs.events("w1")]
        return result, events

    result, events = run_asyncio(main)
    assert result.state is RunState.CANCELLED
    assert not [e for e in events if e.kind is EventKind.APPROVAL_DECIDED]


def test_a_cancel_of_a_finished_run_is_a_no_op_wherever_it_finished(tmp_path: Path):
    """A cancel of a run that finished here was a no-op while its handle was still held and
    a UsageError ("already finished") a moment later, once it was forgotten."""
    db = tmp_path / "r.db"

    async def finish_one() -> None:
        async with treadle.open_sqlite_store(db) as store:
            done = await treadle.run(say_agent(), "hello", store=store, run_id="done")
            assert done.state is RunState.SUCCEEDED

    trio.run(finish_one)

    async def main():
        async with open_runs(say_agent(), store=sqlite(db)) as runs:
            await runs.start("hello", run_id="here")
            await runs.result("here")
            await runs.cancel("here", "late")  # its handle held or forgotten: no matter
            await runs.cancel("done", "late")  # finished before: the same
            with pytest.raises(treadle.UsageError, match="no run 'nope'"):
                await runs.cancel("nope", "late")
            return await runs.result("here"), await runs.result("done")

    here, done = run_asyncio(main)
    assert here.state is RunState.SUCCEEDED and done.state is RunState.SUCCEEDED


def test_leaving_the_block_refuses_new_starts_and_is_not_held_open_by_them(tmp_path: Path):
    """A client starting runs while the block was left had them started (and waited for)
    past drain_s, so the exit lasted as long as the client went on, or its start failed
    with trio's "Nursery is closed to new arrivals"."""

    async def main():
        block = open_runs(slow_agent(), store=sqlite(tmp_path / "r.db"), drain_s=0)
        runs = await block.__aenter__()
        await runs.start("sleep", run_id="first")
        await _until(runs, "first", EventKind.ACTION_REQUESTED)
        leaving = asyncio.create_task(block.__aexit__(None, None, None))
        started = []
        for n in range(500):  # a client that keeps starting runs until it is refused
            try:
                started.append(await runs.start("sleep", run_id=f"late-{n}"))
            except treadle.UsageError as exc:
                refusal = str(exc)
                break
        else:
            raise AssertionError(f"{len(started)} runs started while the block was left")
        await leaving
        return started, refusal

    started, refusal = run_asyncio(main)
    assert len(started) < 500
    assert "is being left" in refusal or "treadle.asyncio" in refusal, refusal

    async def unfinished() -> list[str]:
        async with treadle.open_sqlite_store(tmp_path / "r.db") as store:
            return [r for r in started if (await store.read_log(r)).finished is None]

    assert trio.run(unfinished) == started  # drained or cut: resumable, not run on


def test_calls_after_the_block_are_refused_and_leave_nothing_waiting(tmp_path: Path):
    """A call refused by the closed portal left its future in the portal's pending set
    (one per call, for ever); the portal's end then failed them with nobody waiting
    ("Future exception was never retrieved")."""

    async def main():
        async with open_runs(say_agent(), store=sqlite(tmp_path / "r.db")) as runs:
            await runs.start("hello", run_id="a")
            await runs.result("a")
        for n in range(3):
            with pytest.raises(treadle.UsageError, match="closed"):
                await runs.start("hello", run_id=f"b{n}")
        with pytest.raises(treadle.UsageError, match="closed"):
            async for _ in runs.events("a"):
                pass
        return len(runs.portal._pending)

    assert run_asyncio(main) == 0


@treadle.tool
async def leave_process(code: int) -> str:
    """End the process."""
    await trio.lowlevel.checkpoint()
    raise SystemExit(code)


def test_calls_while_a_runs_exit_stops_the_trio_thread_are_refused_with_usage_error(
    tmp_path: Path,
):
    """A tool's SystemExit (or KeyboardInterrupt) stops the trio thread. A start made while
    the runs' nursery wound down was taken into it and reported started (its run cut at
    once), or, once that nursery had closed, failed with trio's raw "Nursery is closed to
    new arrivals"; a call cut then was told that its block was left, which it was not."""
    release = trio.Event()
    outcomes: dict[str, BaseException] = {}

    async def main():
        loop = asyncio.get_running_loop()
        cut = asyncio.Event()

        async def hold_the_runs_nursery(*, task_status: trio.TaskStatus[None]) -> None:
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:  # cancelled as the runs' nursery ends: it waits here until released
                loop.call_soon_threadsafe(cut.set)
                with trio.CancelScope(shield=True):
                    await release.wait()

        agent = treadle.Agent(
            model=ScriptedModel(turns=[call("leave_process", code=3), say("left")]),
            executor=treadle.Toolbox([leave_process]),
            parser=treadle.NativeToolCallParser(),
        )
        async with open_runs(agent, store=sqlite(tmp_path / "r.db"), drain_s=0) as runs:
            host = runs._host
            await runs.portal.call(host.nursery.start, hold_the_runs_nursery)
            waiting = asyncio.create_task(runs.portal._call_in(host.calls, trio.sleep_forever))
            await runs.start("leave", run_id="x")  # its tool raises SystemExit
            await cut.wait()
            try:
                await runs.start("again", run_id="r2")
            except BaseException as exc:
                outcomes["start"] = exc
            await runs.portal.call(_set, release)
            try:
                await waiting
            except BaseException as exc:
                outcomes["waiting call"] = exc

    with pytest.raises(SystemExit) as ended:
        run_asyncio(main)
    assert ended.value.code == 3
    assert set(outcomes) == {"start", "waiting call"}
    for name, error in outcomes.items():
        assert isinstance(error, treadle.UsageError), (name, error)
        assert "trio thread is stopped by an exception" in str(error), (name, error)
        assert "block was left" not in str(error), (name, error)


class SlowClose(MemoryStore):
    """Its `aclose` sets ``closing`` and waits for ``release``."""

    closing: trio.Event
    release: trio.Event

    async def aclose(self):
        self.closing.set()
        await self.release.wait()
        await super().aclose()


def test_calls_made_while_the_store_closes_are_refused_with_usage_error():
    """Between the runs' nursery closing and the portal closing (the store closing), a
    start failed with trio's RuntimeError "Nursery is closed to new arrivals", and the
    other calls went on against the store being closed."""
    kept: list[SlowClose] = []

    @asynccontextmanager
    async def opened() -> AsyncIterator[MemoryStore]:
        store = SlowClose()
        store.closing, store.release = trio.Event(), trio.Event()
        kept.append(store)
        try:
            yield store
        finally:
            await store.aclose()

    async def main():
        block = open_runs(say_agent(), store=opened, drain_s=0)
        runs = await block.__aenter__()
        await runs.start("hello", run_id="a")
        await runs.result("a")
        leaving = asyncio.create_task(block.__aexit__(None, None, None))
        (store,) = kept
        await runs.portal.call(store.closing.wait)
        calls = {
            "start": lambda: runs.start("hello", run_id="b"),
            "result": lambda: runs.result("a"),
            "cancel": lambda: runs.cancel("a"),
            "approve": lambda: runs.approve("a"),
        }
        refused = []
        for name, made in calls.items():
            with pytest.raises(treadle.UsageError, match="block was left"):
                await made()
            refused.append(name)
        with pytest.raises(treadle.UsageError, match="block was left"):
            async for _ in runs.events("a"):
                pass
        await runs.portal.call(_set, store.release)
        await leaving
        return refused, len(runs.portal._pending)

    refused, pending = run_asyncio(main)
    assert refused == ["start", "result", "cancel", "approve"] and pending == 0


class ReadsRefusedAfterClose(MemoryStore):
    """Refuses reads after `aclose`, as a durable store does; once ``hold_reads`` is set, a
    read waits for the close first."""

    hold_reads: bool = False
    closed: trio.Event

    async def read_log(self, run_id):
        if self.hold_reads:
            await self.closed.wait()
        self._check_open()
        return await super().read_log(run_id)

    async def aclose(self):
        await super().aclose()
        self.closed.set()


def test_an_event_stream_open_while_the_block_is_left_ends_without_reading_a_closed_store():
    """The streams ran in the portal's nursery, which outlives the store: a stream whose run
    stopped as the block was left read the closed store ("the SQLite store ... is closed")."""
    kept: list[ReadsRefusedAfterClose] = []

    @asynccontextmanager
    async def opened() -> AsyncIterator[MemoryStore]:
        store = ReadsRefusedAfterClose()
        store.closed = trio.Event()
        kept.append(store)
        try:
            yield store
        finally:
            await store.aclose()

    async def hold_reads() -> None:
        await trio.lowlevel.checkpoint()
        kept[0].hold_reads = True

    async def main():
        live = asyncio.Event()
        subscribers = []
        following: list[str] = []

        async def follow(run_id: str) -> list[EventKind]:
            seen = []
            async for event in runs.events(run_id):
                seen.append(event.kind)
                if event.kind is EventKind.ACTION_REQUESTED:
                    following.append(run_id)
                    if len(following) == len(subscribers):  # every stream is open
                        live.set()
            return seen

        async with open_runs(slow_agent(), store=opened, drain_s=0) as runs:
            await runs.start("sleep", run_id="s1")
            await _until(runs, "s1", EventKind.ACTION_REQUESTED)
            subscribers = [asyncio.create_task(follow("s1")) for _ in range(3)]
            await live.wait()
            await runs.portal.call(hold_reads)  # a read from now on comes after the close
        return await asyncio.gather(*subscribers)

    for seen in run_asyncio(main):
        assert EventKind.ACTION_REQUESTED in seen and EventKind.RUN_FINISHED not in seen


class _BrokenModel(ScriptedModel):
    """A model client that fails as no model call may (a bug): its run is interrupted."""

    async def complete(self, *args, **kwargs):
        raise RuntimeError("the client broke")


def test_a_result_asked_after_the_run_stopped_unfinished_here_raises_its_interruption(
    tmp_path: Path,
):
    """Once a run's drive here had stopped unfinished, its handle was forgotten and
    ``runs.result`` waited for another driver to finish the run, forever (a result asked
    before the drive stopped raised `RunInterrupted`)."""
    agent = treadle.Agent(
        model=_BrokenModel(turns=[say("never")]),
        executor=treadle.Toolbox([wire]),
        parser=treadle.NativeToolCallParser(),
    )

    async def main():
        async with open_runs(agent, store=sqlite(tmp_path / "r.db")) as runs:
            await runs.start("pay", run_id="b1")
            with pytest.raises(treadle.RunInterrupted, match="the client broke"):
                await runs.result("b1")  # while driven, or once stopped: either way
            for _ in range(3):  # asked again once the drive surely stopped
                with pytest.raises(treadle.RunInterrupted, match="the client broke"):
                    await runs.result("b1")

    run_asyncio(main)
