"""Crashes at every write of a compacting run: a resumed run reuses every durable summary.

The crash kit's `CrashingStore` kills the process before or after each store write; the run
is then resumed on the same store by a new "process" (a new agent, a new summariser). A
summary whose result was durable is read from the log and never asked for again; one whose
intent was durable but not its result is abandoned and asked for once more (docs/context.md,
"Summaries and resume").
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import trio
from tests.fixtures.dense_provider import DenseProvider, dense_tokens

from treadle import Agent, MemoryStore, RunInterrupted, Toolbox, run, tool
from treadle.ports import RunStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing import CrashingStore, SimulatedCrash
from treadle.testing.crashes import compare_trajectories
from treadle.testing.invariants import check_invariants
from treadle.testing.windowed import WindowedModel, windowed_agent
from treadle.types import (
    ActionResult,
    Attempt,
    ContextUsed,
    ModelIntent,
    ModelResult,
    ReplayPolicy,
    RunLog,
    StopReason,
)

WINDOW = 800
GOAL = 16
OWNER = "context-crash-test"


def _summaries(log: RunLog) -> list[ModelResult]:
    return [
        r
        for r in log.records
        if isinstance(r, ModelResult) and r.summary_through is not None and r.reply is not None
    ]


def _agent(summariser: WindowedModel):
    return windowed_agent(
        WindowedModel(window=WINDOW, goal=GOAL), window=WINDOW, summariser=summariser
    )


async def _baseline() -> tuple[RunLog, CrashingStore]:
    counting = CrashingStore(inner=MemoryStore(), crash_at=10**9)
    await run(_agent(WindowedModel(window=WINDOW, goal=GOAL)), "count", store=counting, run_id="b")
    return await counting.inner.read_log("b"), counting


async def _crash_then_resume(store: RunStore, reopen, at: int, when: str, run_id: str):
    crashed = WindowedModel(window=WINDOW, goal=GOAL)
    dying = CrashingStore(inner=store, crash_at=at, when=when)  # type: ignore[arg-type]
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(_agent(crashed), "count", store=dying, run_id=run_id, owner=OWNER)
    async with reopen() as again:
        survived = await again.read_log(run_id)
        resumed = WindowedModel(window=WINDOW, goal=GOAL)
        with trio.fail_after(60):
            result = await run(_agent(resumed), "count", store=again, run_id=run_id, owner=OWNER)
        log = await again.read_log(run_id)
    return survived, log, result, resumed


def _check(
    survived: RunLog, log: RunLog, result, resumed: WindowedModel, point: str, baseline: RunLog
) -> None:
    assert result.stop_reason is StopReason.FINAL_ANSWER, point
    # what the model saw and decided is the uninterrupted run's (the crash kit's comparison)
    assert compare_trajectories(log, baseline) == [], point
    assert result.final_answer == f"done at n={GOAL}", point
    assert check_invariants(log) == [], point
    before = {r.intent_id for r in _summaries(survived)}
    new = [r for r in _summaries(log) if r.intent_id not in before]
    # the resumed process asked only for the summaries the log did not hold yet
    assert resumed.summaries == len(new), point
    throughs = [r.summary_through for r in _summaries(log)]
    assert len(throughs) == len(set(throughs)), point  # never a summary computed twice
    for old in _summaries(survived):
        assert old in log.records, point  # the durable summary is the one the run kept


async def test_a_crash_at_every_write_resumes_without_recomputing_a_summary():
    baseline, counting = await _baseline()
    assert len(_summaries(baseline)) >= 2
    writes = counting.writes
    assert writes > 60
    abandoned = kept = 0
    for at in range(1, writes + 1):
        for when in ("before", "after"):
            store = MemoryStore()

            def reopen(store=store):
                return _Same(store)

            point = f"crash {when} write {at}"
            survived, log, result, resumed = await _crash_then_resume(
                store, reopen, at, when, f"r-{at}-{when}"
            )
            _check(survived, log, result, resumed, point, baseline)
            kept += bool(_summaries(survived))
            abandoned += any(
                isinstance(r, ModelResult) and r.abandoned and r.intent_id.endswith("/m1")
                for r in log.records[len(survived.records) :]
            ) and any(isinstance(r, ModelIntent) and r.compaction for r in survived.records[-1:])
    # both sides of the summary's result were hit: a crash after its intent (asked again)
    # and crashes after its result (reused)
    assert kept > 0 and abandoned > 0, (kept, abandoned)


async def test_crashes_at_the_summary_writes_on_sqlite(tmp_path):
    baseline, _ = await _baseline()
    # the write numbers of the compaction intents and the summary results (one write each
    # here: the writer sends intents as barriers and a result on its own)
    points = [
        n
        for n, record in enumerate(baseline.records, start=1)
        if (isinstance(record, ModelIntent) and record.compaction)
        or (isinstance(record, ModelResult) and record.summary_through is not None)
    ]
    assert points
    reused = 0
    for at in points:
        for when in ("before", "after"):
            path = tmp_path / f"{at}-{when}.db"
            async with open_sqlite_store(path) as store:
                survived, log, result, resumed = await _crash_then_resume(
                    store,
                    lambda path=path: open_sqlite_store(path),
                    _write_number(baseline, at),
                    when,
                    "run",
                )
            _check(survived, log, result, resumed, f"sqlite crash {when} record {at}", baseline)
            if _summaries(survived):
                reused += 1
    assert reused > 0  # some crash points left a durable summary, which resume reused


def _write_number(log: RunLog, record_number: int) -> int:
    """The store write that carries record ``record_number`` (a step and its action results
    are one write)."""
    write = 0
    for seq, record in enumerate(log.records, start=1):
        if not isinstance(record, ActionResult):
            write += 1
        if seq == record_number:
            return write
    raise AssertionError(record_number)


class _Same:
    """Reopen a memory store: the same object (what it holds survives the "crash")."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    async def __aenter__(self) -> MemoryStore:
        return self.store

    async def __aexit__(self, *exc: object) -> None:
        return None


async def _summary_crash_on(open_store) -> None:
    """Crash right after the first summary's result is durable; resume on a reopened store."""
    baseline, _ = await _baseline()
    first = next(
        n
        for n, r in enumerate(baseline.records, start=1)
        if isinstance(r, ModelResult) and r.summary_through is not None
    )
    async with open_store() as store:
        survived, log, result, resumed = await _crash_then_resume(
            store, open_store, _write_number(baseline, first), "after", "store-kind"
        )
    _check(survived, log, result, resumed, "crash after the first summary", baseline)
    assert _summaries(survived)  # the summary was durable before the crash ...
    assert _summaries(survived)[0] == _summaries(log)[0]  # ... and is the one the run kept


async def test_a_summary_survives_a_crash_on_jsonl(tmp_path):
    from treadle.stores.jsonl import open_jsonl_store

    await _summary_crash_on(lambda: open_jsonl_store(tmp_path / "runs"))


async def test_a_summary_survives_a_crash_on_postgres(postgres_dsn, postgres_schema):
    from treadle.stores.postgres import open_postgres_store

    await _summary_crash_on(lambda: open_postgres_store(postgres_dsn, schema=postgres_schema))


DENSE_WINDOW = 4000
DENSE_GOAL = 4


def _replayed_fetch(payload_chars: int) -> Toolbox:
    """``fetch(n)`` as the windowed agent's, read-only: a crash never leaves it unknown."""

    @tool(replay=ReplayPolicy.SAFE)
    async def fetch(n: int) -> str:
        """Fetch record ``n`` (a call a crash left without an outcome runs again).

        Args:
            n: the record number.
        """
        return f"n={n} " + "data " * (payload_chars // 5)

    return Toolbox([fetch])


def _dense_agent() -> tuple[Agent, DenseProvider]:
    """An agent whose newest observation (12,000 characters) is cut to fit at every step."""
    provider = DenseProvider(window=DENSE_WINDOW, goal=DENSE_GOAL)
    agent = windowed_agent(provider, window=DENSE_WINDOW, token_counter=dense_tokens)
    return attrs.evolve(agent, executor=_replayed_fetch(12_000)), provider


@attrs.define(eq=False)
class _Overlong:
    """A summariser that ignores its output cap: each summary has some 4,000 tokens more."""

    inner: WindowedModel

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        reply = await self.inner.complete(request, on_delta=on_delta, attempt=attempt)
        return attrs.evolve(reply, text=(reply.text or "") + " detail" * 2300)


def _overlong_agent() -> tuple[Agent, WindowedModel]:
    """An agent whose summaries are longer than their room, cut to it in every request."""
    summariser = WindowedModel(window=WINDOW, goal=GOAL)
    agent = windowed_agent(
        WindowedModel(window=WINDOW, goal=GOAL), window=WINDOW, summariser=_Overlong(summariser)
    )
    return attrs.evolve(agent, executor=_replayed_fetch(400)), summariser


def _plans(log: RunLog) -> list[tuple[int, int | None, ContextUsed]]:
    """What each answered model call was given: its step, what it summarised, its context.

    The estimate is left out (a resumed run has no reported prefix to start its first one
    from), and so is the summary's intent id (a summary asked again has a new one).
    """
    return [
        (
            r.step,
            r.summary_through,
            attrs.evolve(r.context, estimated_input_tokens=0, summary_intent_id=None),
        )
        for r in log.records
        if isinstance(r, ModelResult) and r.reply is not None and r.context is not None
    ]


async def _plans_after_a_crash_at_every_write(
    make: Callable[[], tuple[Agent, DenseProvider | WindowedModel]],
) -> list[tuple[int, int | None, ContextUsed]]:
    """Crash before and after each write of ``make``'s run, resume it, compare the plans.

    ``make`` returns a new agent and the model that answers its summaries (its ``summaries``
    counts them). Each resumed run must finish as the uninterrupted one did, give every
    model call the same plan, and ask only for the summaries its log did not hold.

    Returns:
        The uninterrupted run's plans (`_plans`).
    """
    counting = CrashingStore(inner=MemoryStore(), crash_at=10**9)
    await run(make()[0], "count", store=counting, run_id="planned")
    baseline = await counting.inner.read_log("planned")
    planned = _plans(baseline)
    assert _summaries(baseline)
    for at in range(1, counting.writes + 1):
        for when in ("before", "after"):
            point = f"crash {when} write {at}"
            store = MemoryStore()
            dying = CrashingStore(inner=store, crash_at=at, when=when)
            with pytest.raises((RunInterrupted, SimulatedCrash)):
                await run(make()[0], "count", store=dying, run_id="planned", owner=OWNER)
            survived = await store.read_log("planned")
            agent, summariser = make()
            result = await run(agent, "count", store=store, run_id="planned", owner=OWNER)
            log = await store.read_log("planned")
            assert result.stop_reason is StopReason.FINAL_ANSWER, (point, result.error)
            assert compare_trajectories(log, baseline) == [], point
            assert check_invariants(log) == [], point
            assert _plans(log) == planned, point
            new = len(_summaries(log)) - len(_summaries(survived))
            assert summariser.summaries == new, point
    return planned


async def test_a_crash_at_every_write_plans_cuts_by_the_counter_as_the_uninterrupted_run():
    # Truncation and the summariser's request measure their cuts with the token counter in
    # use: a resumed run must cut and summarise exactly as the uninterrupted one did.
    planned = await _plans_after_a_crash_at_every_write(_dense_agent)
    assert any(context.truncated for _, _, context in planned)


async def test_a_crash_at_every_write_plans_overlong_summaries_as_the_uninterrupted_run():
    # An overlong summary is measured cut to its room, and a compaction leaves room for the
    # next steps: a resumed run must plan both exactly as the uninterrupted one did.
    planned = await _plans_after_a_crash_at_every_write(_overlong_agent)
    assert len([t for _, t, _ in planned if t is not None]) >= 2  # several summaries ...
    assert any(t is None and c.summary_through for _, t, c in planned)  # ... sent cut in steps


_KILLED_AFTER_SUMMARY = """
import os, signal, sys
import trio
from treadle import run
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing import InterceptingStore
from treadle.testing.windowed import WindowedModel, windowed_agent
from treadle.types import ModelResult


class KillAfterSummary(InterceptingStore):
    seen = False

    async def before_write(self, op, records, seq):
        if any(isinstance(r, ModelResult) and r.summary_through is not None for r in records):
            self.seen = True
            return False
        return self.seen and op.barrier

    def after_write(self, act, op, records, seq):
        # The first barrier after the summary's result (the step's own intent) is durable,
        # and with it everything written before it: die at once, as kill -9 would.
        if act:
            os.kill(os.getpid(), signal.SIGKILL)


async def main():
    async with open_sqlite_store(sys.argv[1]) as store:
        model = WindowedModel(window={window}, goal={goal})
        summariser = WindowedModel(window={window}, goal={goal})
        agent = windowed_agent(model, window={window}, summariser=summariser)
        await run(agent, "count", store=KillAfterSummary(store), run_id="killed", owner="{owner}")


trio.run(main)
"""


async def test_a_process_killed_after_its_summary_resumes_without_recomputing_it(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    db = tmp_path / "runs.db"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_AFTER_SUMMARY.format(window=WINDOW, goal=GOAL, owner=OWNER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, str(script), str(db)], env=env, capture_output=True, timeout=120
        )
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    baseline, _ = await _baseline()
    async with open_sqlite_store(db) as store:
        survived = await store.read_log("killed")
        assert len(_summaries(survived)) == 1  # it died right after the first summary
        # the next barrier: the intent of the next call (here the next summary, of the steps
        # the first one left), whose outcome the crash made unknown
        assert isinstance(survived.records[-1], ModelIntent)
        resumed = WindowedModel(window=WINDOW, goal=GOAL)
        with trio.fail_after(60):
            result = await run(_agent(resumed), "count", store=store, run_id="killed", owner=OWNER)
        log = await store.read_log("killed")
    _check(survived, log, result, resumed, "SIGKILL after the first summary", baseline)
    assert _summaries(survived)[0] in log.records
