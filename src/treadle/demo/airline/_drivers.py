"""Driving replays in child processes: spawning drivers, resuming after crashes, in order.

Part of `treadle.demo.airline.replay`, which re-exports the public names (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import trio

from treadle.demo._defaults import DEFAULT_CONCURRENCY
from treadle.demo.airline._crash_points import CrashMode, CrashPoint, crash_point
from treadle.demo.airline._discovery import RUN_ID_PREFIX, run_id_of
from treadle.demo.airline._report import (
    ReplayReport,
    _Expected,
    build_report,
    expected_for,
    failed_report,
)
from treadle.demo.airline._workspace import Workspace
from treadle.demo.airline.data import (
    Recording,
)
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.replay_server import HistoryMismatch, open_replay_server, recording_key
from treadle.ports import RunStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.types import (
    RunLog,
)

MAX_CHILDREN: Final = 5
"""Driver processes started for one run in one invocation before giving up on it."""


STDERR_TAIL_BYTES: Final = 4096
"""How much of a failed driver's standard error is kept for the report."""


@attrs.frozen(kw_only=True)
class ChildExit:
    """How a driver process ended.

    Attributes:
        pid: its process id.
        returncode: its exit status; ``-9`` when killed with SIGKILL.
        stderr: the end of its standard error (at most `STDERR_TAIL_BYTES`).
    """

    pid: int
    returncode: int
    stderr: str

    @property
    def killed(self) -> bool:
        """True when the process died of SIGKILL."""
        return self.returncode == -signal.SIGKILL


async def _read_lines(
    stream: trio.abc.ReceiveStream, on_line: Callable[[dict[str, Any]], None]
) -> None:
    pending = b""
    while chunk := await stream.receive_some(65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                on_line(json.loads(line))


async def _read_tail(stream: trio.abc.ReceiveStream, tail: bytearray) -> None:
    while chunk := await stream.receive_some(65536):
        tail.extend(chunk)
        del tail[:-STDERR_TAIL_BYTES]


async def spawn_driver(
    argv: Sequence[str],
    *,
    on_line: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> ChildExit:
    """Run one driver process to its end.

    The child's standard input is a pipe whose other end only this process holds: with
    ``--die-with-parent`` the child kills itself when this process dies.

    Args:
        argv: the command line.
        on_line: called with each JSON line the child prints (its run events).
        on_start: called with the child's pid once it started.

    Returns:
        How the child ended.

    Raises:
        OSError: the child could not be started.

    Cancellation:
        Cancelling kills the child (SIGKILL) and waits for it to be gone.
    """
    read_end, write_end = os.pipe()
    try:
        process = await trio.lowlevel.open_process(
            list(argv),
            stdin=read_end,
            stdout=subprocess.PIPE if on_line is not None else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    tail = bytearray()
    try:
        if on_start is not None:
            on_start(process.pid)
        async with trio.open_nursery() as nursery:
            assert process.stderr is not None
            nursery.start_soon(_read_tail, process.stderr, tail)
            if on_line is not None:
                assert process.stdout is not None
                nursery.start_soon(_read_lines, process.stdout, on_line)
            returncode = await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()
        os.close(write_end)
    return ChildExit(
        pid=process.pid, returncode=returncode, stderr=tail.decode("utf-8", "replace").strip()
    )


class ReplayObserver(Protocol):
    """Follows the driver processes of a replay (for progress output)."""

    def child_started(
        self, recording: Recording, pid: int, *, resume: bool, crash: CrashPoint | None
    ) -> None:
        """A driver process started (``resume``: the run's log is not empty)."""
        ...

    def event(self, recording: Recording, line: Mapping[str, Any]) -> None:
        """A driver printed a run event (see `treadle.demo.airline.driver.event_line`)."""
        ...

    def child_exited(self, recording: Recording, exit: ChildExit, log: RunLog) -> None:
        """A driver process ended; ``log`` is the run's log as stored at that point."""
        ...


@attrs.define(eq=False)
class _Replayer:
    """The shared state of one `replay_recordings` call."""

    workspace: Workspace
    store: RunStore
    base_url: Callable[[str], str]
    trajectories: Path
    fresh: AirlineDatabase
    crash_points: Mapping[str, CrashPoint]
    observer: ReplayObserver | None
    task_hashes: dict[int, str] = attrs.Factory(dict)

    async def replay(self, recording: Recording) -> ReplayReport:
        """The recording's report; its run is driven to its end first when unfinished.

        The report is built from the run's log and database as stored once its drivers
        ended, whether they finished the run or not: a run that could not be driven to its
        end has its figures so far and ``error`` saying why (docs/demo.md, "The JSON
        fields").
        """
        run_id = run_id_of(recording)
        log = await self.store.read_log(run_id)
        error = None
        if log.finished is None:
            error = await self._drive(recording, log)
            log = await self.store.read_log(run_id)
        report = await trio.to_thread.run_sync(self._report, recording, log)
        return report if error is None else attrs.evolve(report, error=error)

    def _expected(self, recording: Recording) -> _Expected:
        expected = expected_for(
            recording, self.fresh, task_hash=self.task_hashes.get(recording.task_id)
        )
        self.task_hashes[recording.task_id] = expected.data_hash
        return expected

    def _report(self, recording: Recording, log: RunLog) -> ReplayReport:
        run_id = run_id_of(recording)
        path = self.workspace.conversation_path(run_id)
        if not path.is_file():
            return failed_report(recording, self.workspace.counts(run_id), f"{path} is missing")
        return build_report(
            recording,
            log,
            AirlineDatabase(path),
            self.fresh,
            counts=self.workspace.counts(run_id),
            mismatches=len(self.workspace.mismatches(run_id)),
            expected=self._expected(recording),
        )

    async def _drive(self, recording: Recording, log: RunLog) -> str | None:
        """Drive the run to its end in child processes; an error text when that failed."""
        run_id = run_id_of(recording)
        db = await trio.to_thread.run_sync(self.workspace.conversation, run_id, self.fresh)
        counts = self.workspace.counts(run_id)
        # A crash point counts a run's writes from its start: only a driver beginning the
        # run can die at it (the driver checks again under the run's lock).
        crash = None if log.records else self.crash_points.get(recording_key(recording))
        for started in range(MAX_CHILDREN):
            resume = started > 0 or bool(log.records)
            if resume:
                counts = attrs.evolve(counts, resumes=counts.resumes + 1)
                self.workspace.save_counts(run_id, counts)
            exit = await self._child(recording, db, crash if started == 0 else None, resume)
            log = await self.store.read_log(run_id)
            if self.observer is not None:
                self.observer.child_exited(recording, exit, log)
            if exit.killed:
                counts = attrs.evolve(counts, crashes=counts.crashes + 1)
                self.workspace.save_counts(run_id, counts)
                continue
            if exit.returncode == 0 and log.finished is not None:
                return None
            return f"driver exited with {exit.returncode}: {exit.stderr or '(no output)'}"
        return f"the run was not finished after {MAX_CHILDREN} driver processes"

    async def _child(
        self, recording: Recording, db: AirlineDatabase, crash: CrashPoint | None, resume: bool
    ) -> ChildExit:
        key = recording_key(recording)
        argv = [
            sys.executable, "-m", "treadle.demo.airline.driver",
            "--recording-key", key,
            "--store", str(self.workspace.store),
            "--db", str(db.path),
            "--base-url", self.base_url(key),
            "--trajectories", str(self.trajectories),
            "--die-with-parent",
        ]  # fmt: skip
        if crash is not None:
            argv += crash.driver_args()
        observer = self.observer
        if observer is None:
            return await spawn_driver(argv)
        argv.append("--events")
        return await spawn_driver(
            argv,
            on_line=lambda line: observer.event(recording, line),
            on_start=lambda pid: observer.child_started(recording, pid, resume=resume, crash=crash),
        )


class _InOrder:
    """Hands reports to ``emit`` in recording order, each as soon as all before it are done."""

    def __init__(self, emit: Callable[[ReplayReport], None] | None) -> None:
        self._emit = emit
        self._done: dict[int, ReplayReport] = {}
        self._next = 0

    def add(self, index: int, report: ReplayReport) -> None:
        self._done[index] = report
        while self._next in self._done:
            if self._emit is not None:
                self._emit(self._done[self._next])
            self._next += 1


async def replay_recordings(
    recordings: Sequence[Recording],
    *,
    workspace: Workspace,
    trajectories: Path,
    data_dir: Path,
    crash: CrashMode = "none",
    seed: int = 0,
    concurrency: int = DEFAULT_CONCURRENCY,
    crash_points: Mapping[str, CrashPoint] | None = None,
    emit: Callable[[ReplayReport], None] | None = None,
    observer: ReplayObserver | None = None,
) -> list[ReplayReport]:
    """Replay recordings through treadle, each in driver processes, and report on each.

    Unfinished runs in the workspace's store are resumed; finished ones are only reported.

    Args:
        recordings: what to replay (as found in ``trajectories``).
        workspace: the store and its files (see `Workspace`).
        trajectories: the recordings file, read again by each driver process (an absolute
            path, or one relative to the working directory of this process and its children).
        data_dir: the workload folder holding ``data/*.json``.
        crash: ``random`` kills each run's first driver at its `crash_point`.
        seed: the seed of the crash points.
        concurrency: runs driven at once (each by one process at a time).
        crash_points: recording key -> crash point, overriding ``crash`` for those keys.
        emit: receives each report, in recording order, as soon as it is known.
        observer: follows the driver processes (their run events are then printed).

    Returns:
        One report per recording, in order.

    Raises:
        ValueError: ``concurrency`` below 1.
        treadle.StoreError: the store cannot be opened or read.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be 1 or more, got {concurrency}")
    points = dict(crash_points or {})
    if crash == "random":
        for recording in recordings:
            points.setdefault(recording_key(recording), crash_point(seed, recording))
    reports: list[ReplayReport | None] = [None] * len(recordings)
    ordered = _InOrder(emit)

    def on_mismatch(mismatch: HistoryMismatch) -> None:
        workspace.record_mismatch(f"{RUN_ID_PREFIX}-{mismatch.key}", mismatch)

    fresh = await trio.to_thread.run_sync(workspace.fresh_database, data_dir)
    async with (
        open_sqlite_store(workspace.store) as store,
        open_replay_server(recordings, on_mismatch=on_mismatch) as server,
    ):
        replayer = _Replayer(
            workspace=workspace,
            store=store,
            base_url=server.base_url,
            trajectories=trajectories,
            fresh=fresh,
            crash_points=points,
            observer=observer,
        )
        queue = iter(enumerate(recordings))

        async def worker() -> None:
            # Workers take recordings in file order, so reports come out steadily.
            for index, recording in queue:
                report = await replayer.replay(recording)
                reports[index] = report
                ordered.add(index, report)

        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, len(recordings))):
                nursery.start_soon(worker)
    return [r for r in reports if r is not None]
