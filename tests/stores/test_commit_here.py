"""A barrier met by an idle commit engine commits in the trio thread (docs/decisions/0093).

Which thread committed a batch is read from the backend's ``commit`` (wrapped per test): the
trio thread's commits skip two cross-thread wake-ups, the committer's keep the run loop free.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

import treadle
from treadle._exceptions import StoreError
from treadle.metrics import BARRIER_LATENCY, MetricsRecorder
from treadle.ports import RunStore
from treadle.stores import _engine, _jsonl_backend, postgres
from treadle.stores import sqlite as sqlite_module
from treadle.testing.scripted import ScriptedModel, say
from treadle.types import (
    ActionIntent,
    Message,
    ModelIntent,
    ModelReply,
    ModelResult,
    RunFinished,
    RunStarted,
    RunState,
    StopReason,
    Totals,
)

TS = "2026-01-01T00:00:00+00:00"
BACKENDS = {
    "sqlite": sqlite_module.SqliteBackend,
    "jsonl": _jsonl_backend.JsonlBackend,
    "postgres": postgres.PostgresBackend,
}


def started(run_id: str) -> RunStarted:
    return RunStarted(run_id=run_id, ts=TS, input=(), snapshot={"k": "v"})


def intent(run_id: str, step: int) -> ModelIntent:
    return ModelIntent(run_id=run_id, step=step, intent_id=f"m{step}", attempt=1, ts=TS)


def result(run_id: str, step: int) -> ModelResult:
    return ModelResult(run_id=run_id, step=step, intent_id=f"m{step}", ts=TS)


class Commits:
    """Records which thread committed each batch, and how many writes it held."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []  # (thread ident, writes)
        self.trio_thread = threading.get_ident()
        self.slow_once_s = 0.0
        self.bug: BaseException | None = None

    def wrap(self, monkeypatch: pytest.MonkeyPatch, backend: type) -> None:
        original: Callable[..., Any] = backend.commit

        def commit(this: object, batch: list[_engine.Write]) -> object:
            self.batches.append((threading.get_ident(), len(batch)))
            if self.bug is not None:
                raise self.bug
            if self.slow_once_s:
                time.sleep(self.slow_once_s)
                self.slow_once_s = 0.0
            return original(this, batch)

        monkeypatch.setattr(backend, "commit", commit)

    def threads(self) -> list[str]:
        return ["trio" if t == self.trio_thread else "committer" for t, _ in self.batches]


@pytest.fixture
def commits(monkeypatch: pytest.MonkeyPatch) -> Commits:
    """The thread of each commit; a real sync counts as quick unless it takes 0.5 s."""
    monkeypatch.setattr(_engine, "COMMIT_HERE_MAX_S", 0.5)
    found = Commits()
    for backend in BACKENDS.values():
        found.wrap(monkeypatch, backend)
    return found


@pytest.fixture(params=["sqlite", "jsonl"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[RunStore]:
    if request.param == "sqlite":
        async with treadle.open_sqlite_store(tmp_path / "s.db") as opened:
            yield opened
    else:
        async with treadle.open_jsonl_store(tmp_path / "runs") as opened:
            yield opened


async def lease(store: Any, run_id: str) -> int:
    return int((await store.acquire_lease(run_id, owner="me", ttl_s=60.0)).generation)


async def test_an_idle_engine_commits_a_barrier_and_what_lingers_in_the_trio_thread(
    store: Any, commits: Commits
) -> None:
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)  # lingers, no wake-up
    await store.write_intent(intent("r", 1), seq=2, generation=g)  # the barrier takes it along
    assert commits.batches == [(commits.trio_thread, 2)]
    stats = store.statistics()
    assert (stats.commits, stats.writes_committed, stats.pending) == (1, 2, 0)
    assert (await store.read_log("r")).records == (started("r"), intent("r", 1))


def big_result(run_id: str, step: int, chars: int) -> ModelResult:
    return ModelResult(
        run_id=run_id, step=step, intent_id=f"m{step}", ts=TS, reply=ModelReply(text="x" * chars)
    )


def big_action(run_id: str, step: int, chars: int) -> ActionIntent:
    return ActionIntent(
        run_id=run_id,
        step=step,
        intent_id=f"a{step}",
        call_id=f"c{step}",
        tool="t",
        arguments={"x": "x" * chars},
        ts=TS,
    )


async def test_a_barrier_whose_batch_carries_many_bytes_goes_to_the_committer(
    store: Any, commits: Commits
) -> None:
    """A tool's 50 MB result, lingering in the step write, was committed on the trio thread
    by the next barrier: the run loop stood still for two seconds. A batch of more than
    `COMMIT_HERE_MAX_BYTES` now goes to the committer, whether a lingering write or the
    barrier itself carries the bytes; the next small barrier commits here again."""
    limit = _engine.COMMIT_HERE_MAX_BYTES
    g = await lease(store, "r")
    wrote: list[object] = [started("r"), intent("r", 1), big_result("r", 1, limit // 2)]
    wrote += [intent("r", 2), big_result("r", 2, limit), intent("r", 3), intent("r", 4)]
    wrote += [big_action("r", 5, limit)]
    await store.write_run_started(wrote[0], seq=1, generation=g)
    await store.write_intent(wrote[1], seq=2, generation=g)  # here
    await store.write_model_result(wrote[2], seq=3, generation=g)  # lingers, under the bound
    await store.write_intent(wrote[3], seq=4, generation=g)  # here, with it
    await store.write_model_result(wrote[4], seq=5, generation=g)  # lingers, over the bound
    await store.write_intent(wrote[5], seq=6, generation=g)  # the committer, with it
    await store.write_intent(wrote[6], seq=7, generation=g)  # small again: here
    await store.write_intent(wrote[7], seq=8, generation=g)  # a large barrier: the committer
    assert commits.threads() == ["trio", "trio", "committer", "trio", "committer"]
    assert [n for _, n in commits.batches] == [2, 2, 2, 1, 1]
    assert (await store.read_log("r")).records == tuple(wrote)
    stats = store.statistics()
    assert (stats.commits, stats.writes_committed, stats.pending) == (5, 8, 0)


class Waits:
    """A metrics output that keeps each barrier latency observed, in seconds."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def observe(self, metric: object, value: float, labels: tuple[str, ...]) -> None:
        if metric is BARRIER_LATENCY:
            self.seconds.append(value)

    def add(self, metric: object, value: float, labels: tuple[str, ...]) -> None:
        pass

    set = add


async def test_a_barrier_committed_here_counts_its_commit_in_its_latency(
    store: Any, commits: Commits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A barrier committed in the trio thread started its clock only once the commit was
    done: an idle store's barrier latency came out near zero, however long its syncs took.
    On a clock that moves one second per commit, each barrier now waits one second, on
    either path."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(_engine, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    backend = type(store._engine._backend)
    counted = backend.commit

    def one_second(this: object, batch: list[_engine.Write]) -> object:
        clock.now += 1.0
        return counted(this, batch)

    monkeypatch.setattr(backend, "commit", one_second)
    waits = Waits()
    assert MetricsRecorder(outputs=(waits,)).watch(store)
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)  # lingers: no wait
    await store.write_intent(intent("r", 1), seq=2, generation=g)  # here
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.lowlevel.checkpoint)  # runnable: the committer commits it
        await store.write_intent(intent("r", 2), seq=3, generation=g)
    await store.write_intent(intent("r", 3), seq=4, generation=g)  # here
    assert commits.threads() == ["trio", "committer", "trio"]
    assert waits.seconds == [1.0, 1.0, 1.0]


async def test_a_runnable_task_sends_the_barrier_to_the_committer(
    store: Any, commits: Commits
) -> None:
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.lowlevel.checkpoint)  # runnable: it waits for the run loop
        await store.write_intent(intent("r", 1), seq=2, generation=g)
    assert commits.threads() == ["committer"]
    await store.write_intent(intent("r", 2), seq=3, generation=g)  # idle again: here
    assert commits.threads() == ["committer", "trio"]
    assert len((await store.read_log("r")).records) == 3


async def test_after_a_slow_commit_the_next_barrier_goes_to_the_committer(
    store: Any, commits: Commits
) -> None:
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)
    commits.slow_once_s = 0.6  # above the 0.5 s the fixture allows
    await store.write_intent(intent("r", 1), seq=2, generation=g)  # here, and slow
    await store.write_intent(intent("r", 2), seq=3, generation=g)  # so: the committer
    await store.write_intent(intent("r", 3), seq=4, generation=g)  # that was quick: here
    assert commits.threads() == ["trio", "committer", "trio"]
    assert len((await store.read_log("r")).records) == 4


async def test_another_connections_write_lock_hands_the_barrier_to_the_committer(
    tmp_path: Path, commits: Commits
) -> None:
    path = tmp_path / "s.db"
    async with treadle.open_sqlite_store(path) as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # holds the write lock
        done = trio.Event()

        async def write() -> None:
            await store.write_intent(intent("r", 1), seq=2, generation=g)
            done.set()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                # The run loop is not blocked while the lock is held: this task keeps running.
                for _ in range(20):
                    await trio.sleep(0.01)
                assert not done.is_set() and store.statistics().pending == 2
                blocker.execute("COMMIT")
                blocker.close()
        # the attempt here gave up at once, the committer waited for the lock and committed
        assert commits.threads() == ["trio", "committer"]
        assert (await store.read_log("r")).records == (started("r"), intent("r", 1))
        stats = store.statistics()
        assert (stats.commits, stats.writes_committed, stats.pending) == (1, 2, 0)


async def test_a_bug_in_a_commit_here_fails_the_batch_and_stops_the_engine(
    store: Any, commits: Commits
) -> None:
    g, g_other = await lease(store, "r"), await lease(store, "other")
    await store.write_run_started(started("r"), seq=1, generation=g)
    commits.bug = RuntimeError("a bug in the backend")
    with pytest.raises(StoreError) as info:
        await store.write_intent(intent("r", 1), seq=2, generation=g)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert commits.threads() == ["trio"]
    # nothing more is accepted, and a write that comes after the stop says why it stopped
    with pytest.raises(treadle.StoreStopped, match="RuntimeError: a bug in the backend") as late:
        await store.write_intent(intent("other", 1), seq=1, generation=g_other)
    assert isinstance(late.value.__cause__, RuntimeError)
    with pytest.raises(treadle.StoreStopped, match="a bug in the backend"):
        store._engine.check_writable()
    engine = store._engine
    with trio.fail_after(20):
        await store.aclose()  # both failures were reported to their writers
    assert not engine._committer._thread.is_alive()


async def test_a_bug_in_the_committers_commit_reaches_every_waiting_write_by_name(
    store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit in the committer thread that raised anything but a `StoreError` (a psycopg
    error the backend let out) ended the thread with the raw traceback of an uncaught thread
    exception, and the writes queued behind its batch failed with "the committer thread
    stopped", naming nothing."""
    backend = type(store._engine._backend)
    entered, go = threading.Event(), threading.Event()

    def commit(this: object, batch: list[_engine.Write]) -> object:
        entered.set()
        go.wait(30)
        raise RuntimeError("a bug in the backend")

    uncaught: list[object] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    monkeypatch.setattr(backend, "commits_here", False)
    g, g_other = await lease(store, "r"), await lease(store, "other")
    monkeypatch.setattr(backend, "commit", commit)
    failures: dict[str, BaseException] = {}

    async def write(run_id: str, generation: int) -> None:
        try:
            await store.write_intent(intent(run_id, 1), seq=1, generation=generation)
        except StoreError as exc:
            failures[run_id] = exc

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, "r", g)
            assert await trio.to_thread.run_sync(entered.wait, 20)  # the committer holds r
            nursery.start_soon(write, "other", g_other)  # queued behind r's batch
            await trio.testing.wait_all_tasks_blocked()
            go.set()
    assert set(failures) == {"r", "other"}
    for error in failures.values():
        assert isinstance(error, treadle.StoreStopped)
        assert "RuntimeError: a bug in the backend" in str(error), error
        assert isinstance(error.__cause__, RuntimeError)
    assert uncaught == []  # no thread ended by an exception nobody caught
    logged = [r for r in caplog.records if r.name == "treadle.stores" and r.exc_info]
    assert len(logged) == 1 and "a bug in the backend" in logged[0].getMessage()
    engine = store._engine
    with trio.fail_after(20), contextlib.suppress(StoreError):
        await store.aclose()
    assert not engine._committer._thread.is_alive()


async def _stop_the_committer_beside_a_queued_run(store: Any, commits: Commits) -> None:
    """Queue run ``queued``, then make a bug in a commit of run ``r`` stop the committer."""
    await store.submit("queued", agent="a", input=(Message(role="user", content="x"),))
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)
    commits.bug = RuntimeError("a bug in the backend")
    with pytest.raises(StoreError):
        await store.write_intent(intent("r", 1), seq=2, generation=g)


async def test_a_store_whose_committer_stopped_claims_no_run(
    tmp_path: Path, commits: Commits
) -> None:
    """Its committer gone (a database out of reach for good, a bug), a fleet worker went on
    claiming runs it could never write: each failed, its lease expired, and the runs were
    quarantined one takeover at a time. Now the claim is refused and the runs stay queued
    for other workers."""
    async with treadle.open_sqlite_store(tmp_path / "s.db") as store:
        await _stop_the_committer_beside_a_queued_run(store, commits)
        with pytest.raises(treadle.StoreStopped, match="no write can be committed"):
            await store.claim(
                owner="w", agents={"a": ("",)}, limit=1, ttl_s=10, max_takeovers=3, backoff_s=0
            )
        summary = await store.read_summary("queued")
        assert summary is not None and summary.liveness is treadle.Liveness.QUEUED
        with trio.fail_after(20), contextlib.suppress(StoreError):
            await store.aclose()  # reports the write that failed


async def test_a_worker_whose_committer_stopped_ends_and_leaves_its_queue_to_others(
    tmp_path: Path, commits: Commits
) -> None:
    """A worker that only refused each claim stayed up for good, so nothing restarted it:
    now the refusal ends the worker, with `StoreStopped`, and the queued run stays queued."""
    agent = treadle.Agent(
        model=ScriptedModel(turns=[say("done")]),
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
    )
    async with treadle.open_sqlite_store(tmp_path / "s.db") as store:
        await _stop_the_committer_beside_a_queued_run(store, commits)
        with (
            trio.fail_after(20),
            pytest.RaisesGroup(treadle.StoreStopped, allow_unwrapped=True, flatten_subgroups=True),
        ):
            async with treadle.open_fleet(store, {"a": agent}, claim_poll_s=0.05):
                await trio.sleep_forever()  # the worker ends by itself
        summary = await store.read_summary("queued")
        assert summary is not None and summary.liveness is treadle.Liveness.QUEUED
        with trio.fail_after(20), contextlib.suppress(StoreError):
            await store.aclose()


async def test_postgres_never_commits_in_the_trio_thread(
    postgres_dsn: str, postgres_schema: str, commits: Commits
) -> None:
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
        await store.write_intent(intent("r", 1), seq=2, generation=g)
        assert commits.threads() == ["committer"]
        assert (await store.read_log("r")).records == (started("r"), intent("r", 1))


@pytest.mark.parametrize("seed", range(4))
async def test_runs_interleaved_on_both_paths_each_commit_every_write_once_in_order(
    store: Any, commits: Commits, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Barriers and lingering writes of 12 runs, with other tasks runnable at random moments,
    some commits slow: whichever thread commits, each run's log is exactly what it wrote."""
    rng = random.Random(seed)
    monkeypatch.setattr(_engine, "COMMIT_HERE_MAX_S", 0.05)
    runs = {f"r{i}": await lease(store, f"r{i}") for i in range(12)}
    wrote: dict[str, list[object]] = {run_id: [] for run_id in runs}

    async def one_run(run_id: str, nursery: trio.Nursery) -> None:
        g = runs[run_id]
        await store.write_run_started(started(run_id), seq=1, generation=g)
        wrote[run_id].append(started(run_id))
        for step in range(1, 16):
            if rng.random() < 0.3:
                nursery.start_soon(trio.lowlevel.checkpoint)
            if rng.random() < 0.05:
                commits.slow_once_s = 0.08
            await store.write_intent(intent(run_id, step), seq=2 * step, generation=g)
            await store.write_model_result(result(run_id, step), seq=2 * step + 1, generation=g)
            wrote[run_id] += [intent(run_id, step), result(run_id, step)]
            if rng.random() < 0.5:
                await trio.lowlevel.checkpoint()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for run_id in runs:
                nursery.start_soon(one_run, run_id, nursery)
    await store._engine.settle()
    for run_id, g in runs.items():  # one at a time, on an idle engine
        await store.write_intent(intent(run_id, 16), seq=32, generation=g)
        wrote[run_id].append(intent(run_id, 16))
    for run_id, records in wrote.items():
        assert (await store.read_log(run_id)).records == tuple(records)
    assert store.statistics().pending == 0
    assert {"trio", "committer"} <= set(commits.threads())  # both paths were taken


async def test_writes_lingering_between_barriers_committed_here_wake_nobody(
    store: Any, commits: Commits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committer, left nothing by barriers committed here, naps on while writes come:
    the non-barrier writes between them wake it at most once, not once each."""
    monkeypatch.setattr(_engine, "NAP_FOR_S", 60.0)  # however slow this machine's syncs
    wakes = 0
    put = _engine._Inbox.put

    def counted(inbox: _engine._Inbox, write: _engine.Write, *, flush: bool) -> None:
        nonlocal wakes
        if inbox._sleep == _engine._ASLEEP:  # this put wakes the committer
            wakes += 1
        put(inbox, write, flush=flush)

    monkeypatch.setattr(_engine._Inbox, "put", counted)
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)
    for step in range(1, 31):
        await store.write_intent(intent("r", step), seq=2 * step, generation=g)
        await store.write_model_result(result("r", step), seq=2 * step + 1, generation=g)
    assert commits.threads().count("trio") >= 25
    assert wakes <= 2, wakes  # the first lingering write (the committer slept), maybe one more
    assert len((await store.read_log("r")).records) == 61


def finished(run_id: str) -> RunFinished:
    return RunFinished(
        run_id=run_id,
        ts=TS,
        state=RunState.SUCCEEDED,
        stop_reason=StopReason.FINAL_ANSWER,
        totals=Totals(),
    )


async def test_a_finished_run_leaves_nothing_in_the_engine_on_either_path(
    store: Any, commits: Commits
) -> None:
    """A store object serving runs for days keeps nothing of the runs that finished, whichever
    thread committed their run-finished record; a run still going keeps its next seq."""
    for run_id in ("here", "there", "going"):
        g = await lease(store, run_id)
        await store.write_run_started(started(run_id), seq=1, generation=g)
        await store.write_intent(intent(run_id, 1), seq=2, generation=g)
        if run_id == "going":
            continue
        if run_id == "there":
            async with trio.open_nursery() as nursery:  # runnable: the committer commits it
                nursery.start_soon(trio.lowlevel.checkpoint)
                await store.write_run_finished(finished(run_id), seq=3, generation=g)
        else:
            await store.write_run_finished(finished(run_id), seq=3, generation=g)
    assert commits.threads()[-3:] == ["trio", "committer", "trio"]
    assert set(store._engine._runs) == {"going"}
    for run_id in ("here", "there"):  # read back from the store, not from the engine
        assert (await store.read_log(run_id)).records[-1] == finished(run_id)
    going = await store.read_lease("going")
    await store.release_lease(going)  # parked, or left to another process: forgotten too
    assert store._engine._runs == {}
    g = await lease(store, "going")  # and loaded again when it goes on
    await store.write_intent(intent("going", 2), seq=3, generation=g)
    assert len((await store.read_log("going")).records) == 3
