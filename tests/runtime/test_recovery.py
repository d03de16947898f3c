"""`treadle.resume_unfinished`: resume every unfinished run of a store, at most N at a time."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

import treadle
from treadle.approvals import request_cancel
from treadle.stores.jsonl import open_jsonl_store
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import Attempt, ModelReply, ModelRequest, RunStarted

TURNS = [call("add", a=1, b=2, call_id="c1"), call("add", a=3, b=4, call_id="c2"), say("done")]


@attrs.define(eq=False)
class CountingModel:
    """A scripted model that records how many calls are in flight at once."""

    inner: ScriptedModel
    now: int = 0
    most: int = 0

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: object = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await trio.sleep(1.0)
            return await self.inner.complete(request, attempt=attempt)
        finally:
            self.now -= 1


def make_agent(model: object = None, tools: LedgerTools | None = None) -> treadle.Agent:
    return treadle.Agent(
        model=model or ScriptedModel(turns=TURNS),  # type: ignore[arg-type]
        executor=tools or LedgerTools(),
        parser=SimpleParser(),
    )


async def crash(store: treadle.MemoryStore, run_id: str, at: int | None) -> None:
    """Run ``run_id``, crashing after store write ``at`` (``None``: run to the end)."""
    target = store if at is None else CrashingStore(inner=store, crash_at=at, when="after")
    try:
        await treadle.run(make_agent(), "go", store=target, run_id=run_id)
    except (treadle.RunInterrupted, SimulatedCrash):
        assert at is not None


async def test_every_unfinished_run_is_resumed_and_finished_ones_are_left(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = treadle.MemoryStore()
    for run_id, at in [("a", 3), ("done", None), ("b", 7), ("c", 1), ("d", 11)]:
        await crash(store, run_id, at)
    finished = await store.read_log("done")
    tools = LedgerTools()
    results = await treadle.resume_unfinished(make_agent(tools=tools), store=store)
    assert [r.run_id for r in results] == ["a", "b", "c", "d"]  # list_runs order
    assert all(r.state is treadle.RunState.SUCCEEDED and r.final_answer == "done" for r in results)
    assert await store.read_log("done") == finished  # untouched
    assert await treadle.resume_unfinished(make_agent(), store=store) == []  # nothing left
    # never re-run: "a" crashed before its first action, "b" after its first action ran
    assert len({(a.run_id, a.call_id) for a in tools.executed}) == len(tools.executed)


async def test_concurrency_is_limited(autojump_clock: trio.abc.Clock) -> None:
    store = treadle.MemoryStore()
    for n in range(6):
        await crash(store, f"r{n}", 2)
    model = CountingModel(ScriptedModel(turns=TURNS))
    results = await treadle.resume_unfinished(make_agent(model), store=store, max_concurrent=2)
    assert len(results) == 6
    assert model.most == 2
    with pytest.raises(treadle.UsageError, match="at least 1"):
        await treadle.resume_unfinished(make_agent(), store=store, max_concurrent=0)


async def test_an_agent_factory_chooses_by_the_stored_run(autojump_clock: trio.abc.Clock) -> None:
    store = treadle.MemoryStore()
    await crash(store, "r", 2)
    seen: list[RunStarted] = []

    def choose(started: RunStarted) -> treadle.Agent:
        seen.append(started)
        return make_agent()

    (result,) = await treadle.resume_unfinished(choose, store=store, rng=random.Random(7))
    assert result.state is treadle.RunState.SUCCEEDED
    assert [s.run_id for s in seen] == ["r"]

    def broken(started: RunStarted) -> treadle.Agent:
        return "not an agent"  # type: ignore[return-value]

    await crash(store, "s", 2)
    with pytest.raises(ExceptionGroup) as info:
        await treadle.resume_unfinished(broken, store=store)
    assert info.group_contains(treadle.UsageError, match="the agent factory returned")


async def test_runs_that_cannot_be_resumed_do_not_stop_the_others(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = treadle.MemoryStore()
    for run_id in ("a", "b", "c"):
        await crash(store, run_id, 4)
    other = attrs.evolve(make_agent(), system_prompt="different")

    def choose(started: RunStarted) -> treadle.Agent:
        return other if started.run_id == "b" else make_agent()

    with pytest.raises(ExceptionGroup) as info:
        await treadle.resume_unfinished(choose, store=store)
    (error,) = info.value.exceptions
    assert isinstance(error, treadle.SnapshotMismatch) and error.keys == ["system_prompt"]
    assert error.__notes__ == ["while resuming run 'b'"]
    for run_id in ("a", "c"):  # driven to the end all the same
        assert (await store.read_log(run_id)).finished is not None
    assert (await store.read_log("b")).finished is None  # left as it was, resumable


async def test_a_cancel_requested_while_no_one_drove_the_run(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as store:
        await crash(store, "r", 4)  # type: ignore[arg-type]
        await crash(store, "s", 4)  # type: ignore[arg-type]
        await request_cancel(store, "r", reason="stop it", canceller="ops")
        assert await store.list_runs() == ("r", "s")  # the control stream is not a run
        assert [e.record.reason for e in await store.read_control("r")] == ["stop it"]
        results = {r.run_id: r for r in await treadle.resume_unfinished(make_agent(), store=store)}
    assert sorted(results) == ["r", "s"]
    assert results["r"].state is treadle.RunState.CANCELLED
    assert results["s"].state is treadle.RunState.SUCCEEDED


class InterruptingModel:
    """Raises KeyboardInterrupt where the model is called, as Ctrl-C landing there does."""

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: object = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        await trio.lowlevel.checkpoint()
        raise KeyboardInterrupt


async def test_ctrl_c_reaches_the_caller_as_itself_and_the_runs_stay_resumable() -> None:
    """The interrupt left `resume_unfinished` inside the exception group of the nursery that
    drove the runs, so an ``except KeyboardInterrupt`` around the call missed it
    (docs/crash-safety.md, "What is guaranteed", item 8)."""
    store = treadle.MemoryStore()
    for run_id in ("a", "b"):
        await crash(store, run_id, 4)
    with pytest.raises(KeyboardInterrupt):
        await treadle.resume_unfinished(make_agent(InterruptingModel()), store=store)
    for run_id in ("a", "b"):
        assert (await store.read_log(run_id)).finished is None
    results = await treadle.resume_unfinished(make_agent(), store=store)
    assert [r.state for r in results] == [treadle.RunState.SUCCEEDED] * 2
