"""Replaying recorded airline conversations through treadle, with real crashes, and reporting.

`replay_recordings` serves the recordings from a `ReplayServer` in this process and drives
each one's run (``airline-<task>-<trial>``) in a child process
(``python -m treadle.demo.airline.driver``), several at a time. With crashes, the first child
of a run SIGKILLs itself at a store write chosen from the seed (`crash_point`); a new child
then resumes the run from the log. Once the run has finished, it is scored and compared with
the recording (`ReplayReport`).

Everything a replay keeps lives next to the run store, in a `Workspace`: the fresh airline
database, one database per conversation, each run's crash and resume counts and the history
mismatches the server saw. Running again with the same store resumes unfinished runs and
reports finished ones without running them again.

`run_live` runs the same agent definition against a real endpoint, with a person as the
customer.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import attrs
import trio

from treadle.demo._defaults import DEFAULT_CONCURRENCY as DEFAULT_CONCURRENCY
from treadle.demo.airline.agent import (
    RESPOND_TOOL,
    AirlineExecutor,
    ReadLine,
    TerminalCustomer,
    airline_agent,
)
from treadle.demo.airline.data import (
    DATA_ENV_VAR,
    AirlineDataNotFound,
    AirlineTask,
    Recording,
    _recording_from_json,
    download_data,
    find_data_dir,
    load_data,
)
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.replay_server import HistoryMismatch, open_replay_server, recording_key
from treadle.demo.airline.scoring import (
    expected_data_hash,
    recorded_tool_calls,
    replay_tool_calls,
    score,
)
from treadle.demo.airline.tools import WRITE_TOOLS
from treadle.ports import ModelClient, RunStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors.run import run
from treadle.types import (
    Action,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    DecisionKind,
    RunLog,
    StopReason,
)

RUN_ID_PREFIX: Final = "airline"
"""Run ids are ``airline-<task_id>-<trial>``."""

MAX_CHILDREN: Final = 5
"""Driver processes started for one run in one invocation before giving up on it."""

STDERR_TAIL_BYTES: Final = 4096
"""How much of a failed driver's standard error is kept for the report."""

DEMO_RECORDING: Final = "30-1"
"""The recording `treadle demo` replays: two cancellations, 16 steps, recorded reward 1."""

CrashMode = Literal["none", "random"]


def run_id_of(recording: Recording) -> str:
    """The run id of a recording's replay: ``airline-<task_id>-<trial>``."""
    return f"{RUN_ID_PREFIX}-{recording.task_id}-{recording.trial}"


def load_trajectories(path: str | os.PathLike[str]) -> tuple[Recording, ...]:
    """Read a recordings file (the format of the workload's ``trajectories.json``).

    Raises:
        FileNotFoundError: no such file.
        TypeError: JSON, but not a list.
        ValueError: not JSON, a recording without a needed field, or two recordings with the
            same task and trial.
    """
    with Path(path).open(encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, list):
        raise TypeError(f"{path}: expected a JSON list of recordings")
    try:
        recordings = tuple(_recording_from_json(item) for item in raw)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: a recording lacks a field: {exc!r}") from exc
    keys = [recording_key(r) for r in recordings]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"{path}: several recordings for task-trial {', '.join(duplicates)}")
    return recordings


def find_recording(recordings: Sequence[Recording], key: str) -> Recording:
    """The recording with key ``<task_id>-<trial>``.

    Raises:
        LookupError: when there is none.
    """
    for recording in recordings:
        if recording_key(recording) == key:
            return recording
    raise LookupError(f"no recording {key!r} (keys are <task_id>-<trial>)")


def default_cache_dir() -> Path:
    """Where downloaded workload files go: ``$XDG_CACHE_HOME/treadle/airline``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "treadle" / "airline"


def locate_workload(
    explicit: str | os.PathLike[str] | None = None,
    *,
    download: bool = True,
    cache_dir: Path | None = None,
    notify: Callable[[str], None] | None = None,
) -> Path:
    """Find the workload folder, downloading it when it is nowhere to be found.

    The search is `find_data_dir`'s (the explicit folder, else ``TREADLE_AIRLINE_DATA``, else
    ``shared/workloads/airline`` above the working directory or this package). When neither
    an explicit folder nor the environment variable was given and nothing was found, the
    files are fetched once from the public tau-bench repository into ``cache_dir`` (default
    `default_cache_dir`), with the address-key alignment applied.

    Raises:
        AirlineDataNotFound: not found, and downloading is off or not applicable.
        httpx.HTTPError: the download failed (nothing partial is left behind).
    """
    try:
        return find_data_dir(explicit)
    except AirlineDataNotFound:
        if explicit is not None or os.environ.get(DATA_ENV_VAR) or not download:
            raise
    cache = cache_dir or default_cache_dir()
    if (cache / "data" / "users.json").is_file() and (cache / "trajectories.json").is_file():
        return cache
    if notify is not None:
        notify(f"airline workload not found locally; downloading it into {cache}")
    return download_data(cache)


def recorded_steps(recording: Recording) -> int:
    """The number of assistant messages (treadle steps) of a recording."""
    return sum(1 for m in recording.messages if m.get("role") == "assistant")


def expected_writes(recording: Recording) -> int:
    """Store writes of an uninterrupted replay: run-started, four per step, run-finished."""
    return 4 * recorded_steps(recording) + 2


# --------------------------------------------------------------------------- crash points


@attrs.frozen(kw_only=True)
class CrashPoint:
    """Where a driver process SIGKILLs itself.

    Attributes:
        write: the store write of that process (1-based) the crash is tied to.
        when: ``after`` that write was acknowledged, or ``before`` it was handed over.
    """

    write: int
    when: Literal["after", "before"] = "after"

    def driver_args(self) -> list[str]:
        """The driver's command-line option for this crash point."""
        flag = "--crash-after-writes" if self.when == "after" else "--crash-before-write"
        return [flag, str(self.write)]

    def describe(self) -> str:
        """E.g. ``right after store write 17``."""
        return f"right {self.when} store write {self.write}"


def crash_point(seed: int, recording: Recording) -> CrashPoint:
    """The crash point of a recording's first driver process, chosen from ``seed``.

    Uniform over the points between the first write and the last one of an uninterrupted
    replay (so the run is always unfinished when killed): after write ``1 .. W-1`` or before
    write ``2 .. W``, ``W`` being `expected_writes`. The random source is
    ``random.Random(f"{seed}-{task_id}-{trial}")``: the same seed gives the same points.
    """
    rng = random.Random(f"{seed}-{recording.task_id}-{recording.trial}")
    total = expected_writes(recording)
    write = rng.randint(1, total - 1)
    if rng.random() < 0.5:
        return CrashPoint(write=write, when="after")
    return CrashPoint(write=write + 1, when="before")


def first_change_step(recording: Recording) -> int | None:
    """The step (1-based) of the recording's first database-changing tool call, if any."""
    for step, message in enumerate(
        (m for m in recording.messages if m.get("role") == "assistant"), start=1
    ):
        names = {(c.get("function") or {}).get("name") for c in message.get("tool_calls") or ()}
        if names & WRITE_TOOLS:
            return step
    return None


def demo_crash_point(recording: Recording) -> CrashPoint:
    """The demo's crash point: after the first database change ran, before its result is logged.

    That is before the step write of the step making the change (write ``4 * step + 1``):
    the airline database has committed the change, the run's log has its intent but not its
    result. Without such a step, the middle of the run.
    """
    step = first_change_step(recording)
    if step is None:
        return CrashPoint(write=expected_writes(recording) // 2, when="after")
    return CrashPoint(write=4 * step + 1, when="before")


def pick_demo_recording(recordings: Sequence[Recording]) -> Recording:
    """`DEMO_RECORDING` when present, else the first reward-1 recording that books or cancels.

    Raises:
        LookupError: no recording books or cancels anything with reward 1.
    """
    with contextlib.suppress(LookupError):
        return find_recording(recordings, DEMO_RECORDING)
    for recording in recordings:
        tools = {tool for _, tool, _, _ in recorded_tool_calls(recording)}
        if recording.reward == 1.0 and tools & {"book_reservation", "cancel_reservation"}:
            return recording
    raise LookupError("no recording with reward 1 books or cancels a reservation")


# --------------------------------------------------------------------------- workspace


def _write_json_atomically(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    tmp.replace(path)


@attrs.frozen(kw_only=True)
class RunCounts:
    """Driver processes of one run: how many were killed, and how many resumed it."""

    crashes: int = 0
    resumes: int = 0


@attrs.frozen(kw_only=True)
class Workspace:
    """The files of a replay: the run store and, beside it, ``<store>.airline/``.

    Attributes:
        store: the SQLite run store file.
        root: the folder holding ``fresh.sqlite3`` (the database every conversation starts
            from), ``conversations/<run_id>.sqlite3``, ``runs/<run_id>.json`` (crash and
            resume counts) and ``mismatches/<run_id>.jsonl`` (one history mismatch a line).
    """

    store: Path
    root: Path

    @classmethod
    def beside(cls, store: str | os.PathLike[str]) -> Workspace:
        """The workspace of a store file: ``<store>.airline/`` next to it (created)."""
        path = Path(store).absolute()
        root = path.with_name(path.name + ".airline")
        root.mkdir(parents=True, exist_ok=True)
        return cls(store=path, root=root)

    def fresh_database(self, data_dir: Path) -> AirlineDatabase:
        """The database every conversation starts from, built from the JSON files once."""
        path = self.root / "fresh.sqlite3"
        if not path.is_file():
            tmp = path.with_name(f".fresh.{os.getpid()}.sqlite3")
            tmp.unlink(missing_ok=True)
            AirlineDatabase.create(tmp, load_data(data_dir))
            tmp.replace(path)
        return AirlineDatabase(path)

    def conversation_path(self, run_id: str) -> Path:
        """The database file of one conversation."""
        return self.root / "conversations" / f"{run_id}.sqlite3"

    def conversation(self, run_id: str, fresh: AirlineDatabase) -> AirlineDatabase:
        """The conversation's database; a copy of ``fresh`` made (atomically) if missing."""
        path = self.conversation_path(run_id)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{run_id}.{os.getpid()}.sqlite3")
            tmp.unlink(missing_ok=True)
            fresh.copy_to(tmp)
            tmp.replace(path)
        return AirlineDatabase(path)

    def counts(self, run_id: str) -> RunCounts:
        """The run's crash and resume counts so far (zeros for a run never driven)."""
        path = self.root / "runs" / f"{run_id}.json"
        if not path.is_file():
            return RunCounts()
        raw = json.loads(path.read_text(encoding="utf-8"))
        return RunCounts(crashes=int(raw["crashes"]), resumes=int(raw["resumes"]))

    def save_counts(self, run_id: str, counts: RunCounts) -> None:
        """Store the run's counts (atomically)."""
        value = {"crashes": counts.crashes, "resumes": counts.resumes}
        _write_json_atomically(self.root / "runs" / f"{run_id}.json", value)

    def record_mismatch(self, run_id: str, mismatch: HistoryMismatch) -> None:
        """Append one history mismatch to the run's file."""
        path = self.root / "mismatches" / f"{run_id}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(mismatch.to_json(), ensure_ascii=False) + "\n")

    def mismatches(self, run_id: str) -> list[dict[str, Any]]:
        """Every history mismatch recorded for the run, oldest first."""
        path = self.root / "mismatches" / f"{run_id}.jsonl"
        if not path.is_file():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]


@contextlib.contextmanager
def open_workspace(store: str | os.PathLike[str] | None) -> Iterator[Workspace]:
    """The workspace of ``store``; without a store, a temporary one removed afterwards."""
    if store is not None:
        yield Workspace.beside(store)
        return
    with tempfile.TemporaryDirectory(prefix="treadle-airline-") as tmp:
        yield Workspace.beside(Path(tmp) / "runs.db")


# --------------------------------------------------------------------------- reports


@attrs.frozen(kw_only=True)
class ReplayReport:
    """How a recording's replay went.

    Attributes:
        task_id / trial: the recording.
        recorded_reward: the benchmark's score of the recording.
        reward: our score of the replay (`treadle.demo.airline.scoring.score`).
        tool_calls: airline tool calls the run made (replies to the customer not counted).
        observations_matching: those whose output equals the recorded output exactly (the
            n-th call of the run is compared with the n-th recorded call: same call id, same
            tool, same output text).
        history_mismatches: model requests whose history differed from the recording's,
            over every invocation that drove the run.
        crashes: driver processes of the run killed with SIGKILL.
        resumes: driver processes that resumed the run from its log.
        run_id: ``airline-<task_id>-<trial>``.
        stop_reason: why the run ended.
        recorded_tool_calls: tool calls in the recording.
        writes_applied: database changes in the conversation's ``applied_actions``.
        writes_in_log: executed database-changing actions in the run's log.
        applied_once: every change in the database belongs to exactly one logged action,
            and every logged change is in the database once.
        db_matches_recording: the final database equals a fresh one to which the recorded
            tool calls were applied directly.
        error: why the run could not be replayed; ``None`` when it was.
    """

    task_id: int
    trial: int
    recorded_reward: float
    reward: float
    tool_calls: int
    observations_matching: int
    history_mismatches: int
    crashes: int
    resumes: int
    run_id: str
    stop_reason: str | None
    recorded_tool_calls: int
    writes_applied: int
    writes_in_log: int
    applied_once: bool
    db_matches_recording: bool
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object: the nine summary fields first, then the details."""
        return attrs.asdict(self)


def _write_results(log: RunLog) -> list[ActionResult]:
    return [
        r
        for r in log.records
        if isinstance(r, ActionResult)
        and r.tool in WRITE_TOOLS
        and r.outcome.status is ActionStatus.EXECUTED
    ]


def _observations(log: RunLog) -> dict[str, str]:
    """Intent id -> the observation text that entered history."""
    found: dict[str, str] = {}
    for step in log.steps:
        found.update(zip(step.action_result_ids, step.observations, strict=False))
    return found


def agent_replies(log: RunLog) -> list[str]:
    """What the agent said to the customer in a run: text replies without tool calls."""
    replies = []
    for step in log.steps:
        message = step.history_message
        if step.decision is DecisionKind.INVALID or message is None:
            continue
        if message.content and not message.tool_calls:
            replies.append(message.content)
    return replies


@attrs.frozen(kw_only=True)
class _Expected:
    """What a recording's replay is compared with."""

    data_hash: str
    recorded_calls_hash: str


def expected_for(
    recording: Recording, fresh: AirlineDatabase, *, task_hash: str | None = None
) -> _Expected:
    """The ground-truth hash of the task and the hash after the recorded calls (slow-ish).

    ``task_hash`` is the task's ground-truth hash when already known (the same for every
    trial of a task).
    """
    with tempfile.TemporaryDirectory(prefix="treadle-airline-") as tmp:
        copy = fresh.copy_to(Path(tmp) / "recorded.sqlite3")
        replay_tool_calls(recording, copy)
        recorded = copy.data_hash()
    expected = task_hash if task_hash is not None else expected_data_hash(recording.task, fresh)
    return _Expected(data_hash=expected, recorded_calls_hash=recorded)


def build_report(
    recording: Recording,
    log: RunLog,
    db: AirlineDatabase,
    fresh: AirlineDatabase,
    *,
    counts: RunCounts,
    mismatches: int,
    expected: _Expected,
) -> ReplayReport:
    """Score a finished replay and compare it with the recording (reads both databases)."""
    finished = log.finished
    tool_results = [
        r for r in log.records if isinstance(r, ActionResult) and r.tool != RESPOND_TOOL
    ]
    recorded = recorded_tool_calls(recording)
    observations = _observations(log)
    # Call ids repeat within some recordings, so calls are paired by position.
    matching = sum(
        1
        for r, (call_id, tool, _, output) in zip(tool_results, recorded, strict=False)
        if (r.call_id, r.tool, observations.get(r.intent_id)) == (call_id, tool, output)
    )
    completed = finished is not None and finished.stop_reason is StopReason.TASK_COMPLETED
    result = score(
        db,
        recording.task,
        agent_replies(log),
        completed=completed,
        fresh=fresh,
        expected_hash=expected.data_hash,
    )
    applied = db.applied_actions()
    logged = _write_results(log)
    applied_ids = sorted(intent for intent, _, _ in applied)
    return ReplayReport(
        task_id=recording.task_id,
        trial=recording.trial,
        recorded_reward=recording.reward,
        reward=result.reward,
        tool_calls=len(tool_results),
        observations_matching=matching,
        history_mismatches=mismatches,
        crashes=counts.crashes,
        resumes=counts.resumes,
        run_id=run_id_of(recording),
        stop_reason=finished.stop_reason.value if finished else None,
        recorded_tool_calls=len(recorded),
        writes_applied=len(applied),
        writes_in_log=len(logged),
        applied_once=applied_ids == sorted(r.intent_id for r in logged),
        db_matches_recording=result.data_hash == expected.recorded_calls_hash,
    )


def failed_report(recording: Recording, counts: RunCounts, error: str) -> ReplayReport:
    """The report of a recording whose run could not be driven to its end."""
    return ReplayReport(
        task_id=recording.task_id,
        trial=recording.trial,
        recorded_reward=recording.reward,
        reward=0.0,
        tool_calls=0,
        observations_matching=0,
        history_mismatches=0,
        crashes=counts.crashes,
        resumes=counts.resumes,
        run_id=run_id_of(recording),
        stop_reason=None,
        recorded_tool_calls=len(recorded_tool_calls(recording)),
        writes_applied=0,
        writes_in_log=0,
        applied_once=False,
        db_matches_recording=False,
        error=error,
    )


# --------------------------------------------------------------------------- child processes


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
    # a last line without newline was cut by the kill: it is not an event


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


# --------------------------------------------------------------------------- orchestration


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
        run_id = run_id_of(recording)
        log = await self.store.read_log(run_id)
        if log.finished is None:
            error = await self._drive(recording, log)
            if error is not None:
                return failed_report(recording, self.workspace.counts(run_id), error)
            log = await self.store.read_log(run_id)
        return await trio.to_thread.run_sync(self._report, recording, log)

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
        crash = self.crash_points.get(recording_key(recording)) if counts.crashes == 0 else None
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


# --------------------------------------------------------------------------- live mode


@attrs.frozen(kw_only=True)
class LiveReport:
    """How a live conversation went.

    Attributes:
        run_id: the run.
        store: the run store file.
        state / stop_reason: how the run ended.
        steps: steps taken.
        tool_calls: airline tool calls made.
        reward: the score against ``task_id``'s ground truth; ``None`` without a task.
        task_id: the task played, if any.
    """

    run_id: str
    store: str
    state: str
    stop_reason: str
    steps: int
    tool_calls: int
    reward: float | None
    task_id: int | None

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object."""
        return attrs.asdict(self)


def policy_text(data_dir: Path, recordings: Sequence[Recording]) -> str:
    """The airline policy: ``policy.md``, else the recordings' system message."""
    path = data_dir / "policy.md"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if recordings:
        return str(recordings[0].messages[0].get("content") or "")
    raise AirlineDataNotFound([path])


def live_run_id(task_id: int | None, now: datetime.datetime | None = None) -> str:
    """``airline-live-[<task_id>-]<UTC timestamp>``."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%S%f")
    middle = f"{task_id}-" if task_id is not None else ""
    return f"{RUN_ID_PREFIX}-live-{middle}{stamp}"


def tasks_by_id(recordings: Sequence[Recording]) -> dict[int, AirlineTask]:
    """Task id -> its task (the same for every trial of a task)."""
    return {r.task_id: r.task for r in recordings}


LiveShow = Callable[[str, str], None]
"""Shows a line of a live conversation: ``(kind, text)``, kind ``agent`` or ``tool``."""


async def run_live(
    *,
    client: ModelClient,
    model: str,
    workspace: Workspace,
    data_dir: Path,
    system: str,
    read_line: ReadLine,
    show: LiveShow,
    task: AirlineTask | None = None,
    task_id: int | None = None,
) -> LiveReport | None:
    """Hold one conversation between a live model and the person at the terminal.

    The agent definition is the replay's (`airline_agent`), over a fresh copy of the airline
    database, on the workspace's SQLite store. The person's first message is the run input;
    each reply of the agent is shown and the person's next line is its observation.

    Args:
        client: the model client (e.g. `treadle.OpenAIChatClient` on the live endpoint).
        model: the model name sent with every request.
        workspace: where the store and the conversation's database go.
        data_dir: the workload folder (its ``data/*.json`` build the database).
        system: the system prompt (the airline policy, see `policy_text`).
        read_line: reads one line typed by the person; ``None`` at end of input.
        show: prints the agent's replies and the tool calls as they happen.
        task: a task to score the conversation against (the person plays its customer).
        task_id: that task's id (in the run id and the report).

    Returns:
        The report, or ``None`` when input ended before the first message.

    Raises:
        treadle.RunInterrupted: the run could not continue (it stays resumable).
        treadle.StoreError: the store failed.
    """
    fresh = await trio.to_thread.run_sync(workspace.fresh_database, data_dir)
    run_id = live_run_id(task_id)
    customer = TerminalCustomer(read_line, lambda text: show("agent", text))
    first = await customer.first_message()
    if first is None:
        return None
    db = await trio.to_thread.run_sync(workspace.conversation, run_id, fresh)

    def observe(action: Action, outcome: ActionOutcome) -> None:
        if action.tool != RESPOND_TOOL:
            arguments = json.dumps(dict(action.arguments), ensure_ascii=False)
            show("tool", f"{action.tool}({arguments}) -> {outcome.observation}")

    executor = AirlineExecutor(db, customer, observer=observe)
    agent = airline_agent(model=client, executor=executor, system=system, model_name=model)
    async with open_sqlite_store(workspace.store) as store:
        result = await run(agent, first, store=store, run_id=run_id)
        log = await store.read_log(run_id)
    reward = None
    if task is not None:
        completed = result.stop_reason is StopReason.TASK_COMPLETED
        found = await trio.to_thread.run_sync(
            functools.partial(score, db, task, agent_replies(log), completed=completed, fresh=fresh)
        )
        reward = found.reward
    tool_calls = sum(
        1 for r in log.records if isinstance(r, ActionResult) and r.tool != RESPOND_TOOL
    )
    return LiveReport(
        run_id=run_id,
        store=str(workspace.store),
        state=result.state.value,
        stop_reason=result.stop_reason.value,
        steps=result.totals.steps,
        tool_calls=tool_calls,
        reward=reward,
        task_id=task_id,
    )
