"""The child process that drives one airline replay run: ``python -m treadle.demo.airline.driver``.

It runs (or resumes, when the store already holds it) the run ``airline-<task>-<trial>`` of one
recording against the replay server's URL, over the SQLite store and the conversation's
airline database, and exits 0 once the run has finished (whatever its outcome).

While it drives the run it holds an exclusive ``flock`` on ``<db>.lock``, so a run (and its
airline database) is never driven by two processes at once. Every driver of a run uses the
same lease owner id (`DEMO_OWNER`): since the lock guarantees the one before is dead, a driver
started after a crash continues that driver's lease at once instead of waiting for it to
expire.

Crashes are real: with ``--crash-after-writes N`` the process sends itself SIGKILL right after
the store acknowledged its N-th write; with ``--crash-before-write N`` right before it hands
over its N-th write. A crash point counts the writes of a run from its start, so it is armed
only in the process that begins the run: a driver that finds the run's log not empty (begun by
a process that died or was stopped) resumes it without crashing. ``--die-with-parent`` makes
it SIGKILL itself when its standard input reaches end of file (the parent holds the other end
of that pipe, so the child never outlives it). ``--events`` prints one JSON object per durable
run event on standard output.

Exit codes: 0 run finished; 1 the run could not be driven (error on standard error); 2 bad
arguments; killed by SIGKILL when a crash was asked for (and armed).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import trio

from treadle._exceptions import TreadleError
from treadle.demo.airline._discovery import find_recording, load_trajectories, run_id_of
from treadle.demo.airline.agent import (
    AirlineExecutor,
    RecordedCustomer,
    airline_agent,
    first_customer_message,
    respond_positions,
    system_prompt,
)
from treadle.demo.airline.data import AirlineDataNotFound, Recording, find_data_dir
from treadle.demo.airline.db import AirlineDatabase
from treadle.models.openai import OpenAIChatClient
from treadle.ports import RunStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import open_run
from treadle.testing.crashdriver import KillingStore
from treadle.types import (
    ActionIntent,
    ActionResult,
    Event,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunResult,
    StepRecord,
)

T = TypeVar("T")

CLIP_CHARS: Final = 400
"""Event texts printed with ``--events`` are cut to this many characters."""

LOCK_WAIT_S: Final = 60.0
"""Seconds a driver waits for another process driving the same run to let go (or die)."""

LOCK_POLL_S: Final = 0.05
"""Seconds between two attempts to take the run's lock."""


DEMO_OWNER: Final = "treadle-demo-driver"
"""The lease owner id of every driver process (see the module docstring)."""


class RunLocked(OSError):
    """Another process kept driving the run for longer than `LOCK_WAIT_S`."""


async def hold_run_lock(path: Path) -> int:
    """Take an exclusive ``flock`` on ``path`` for the rest of this process's life.

    The kernel releases it when the process dies, however it dies, so a driver started
    while a killed parent's driver is still dying waits for it: one run, one driver.

    Returns:
        The locked file descriptor (left open on purpose).

    Raises:
        RunLocked: the lock was not free within `LOCK_WAIT_S` seconds.
        OSError: the lock file cannot be opened.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with trio.move_on_after(LOCK_WAIT_S):
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                await trio.sleep(LOCK_POLL_S)
                continue
            return fd
    os.close(fd)
    raise RunLocked(f"{path}: another process kept driving this run for {LOCK_WAIT_S:g} s")


def _kill_self() -> None:
    """Die at once, as ``kill -9`` would: no cleanup, no flush, nothing written after."""
    os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- events


def _clip(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= CLIP_CHARS else text[: CLIP_CHARS - 1] + "…"


def _record_fields(record: Record) -> dict[str, Any]:
    if isinstance(record, ModelIntent):
        return {"step": record.step, "attempt": record.attempt}
    if isinstance(record, ModelResult):
        reply = record.reply
        return {
            "step": record.step,
            "abandoned": record.abandoned,
            "error": record.error.kind if record.error else None,
            "text": _clip(reply.text) if reply else None,
            "tools": [c.name for c in reply.tool_calls] if reply else [],
        }
    if isinstance(record, ActionIntent):
        return {
            "step": record.step,
            "tool": record.tool,
            "intent_id": record.intent_id,
            "arguments": dict(record.arguments),
        }
    if isinstance(record, ActionResult):
        return {
            "step": record.step,
            "tool": record.tool,
            "intent_id": record.intent_id,
            "status": record.outcome.status.value,
            "observation": _clip(record.outcome.observation),
            "task_completed": record.outcome.task_completed,
        }
    if isinstance(record, StepRecord):
        return {
            "step": record.step,
            "decision": record.decision.value if record.decision else None,
            "task_completed": record.task_completed,
        }
    if isinstance(record, RunFinished):
        return {
            "state": record.state.value,
            "stop_reason": record.stop_reason.value,
            "steps": record.totals.steps,
        }
    return {}


def event_line(event: Event) -> dict[str, Any]:
    """A durable run event as a small JSON object: ``seq``, ``kind`` and its main fields."""
    line: dict[str, Any] = {"seq": event.seq, "kind": event.kind.value}
    if event.record is not None:
        line.update(_record_fields(event.record))
    return line


def _emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- driving


async def _die_with_parent() -> None:
    """SIGKILL this process once standard input ends (the parent died or let go)."""
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass
    _kill_self()


def _store_wrapper(store: RunStore, args: argparse.Namespace, log: RunLog) -> RunStore:
    """The store this process writes through: killing it at the crash point, if it has one.

    The crash point is armed only when ``log`` (the run's, read under the run's lock) is
    empty: it counts writes from the run's start, and a process resuming a begun run
    counts from where it resumes, so it would die elsewhere than asked or never (see the
    module docstring).
    """
    if log.records:
        return store
    if args.crash_after_writes is not None:
        return KillingStore(store, kill_at=args.crash_after_writes, when="after")
    if args.crash_before_write is not None:
        return KillingStore(store, kill_at=args.crash_before_write, when="before")
    return store


async def drive(args: argparse.Namespace, recording: Recording) -> RunResult:
    """Run or resume the recording's run to its end; see the module docstring.

    Raises:
        treadle.TreadleError: the run could not be driven (store failure, interrupted run,
            a definition differing from the stored one).
        FileNotFoundError: the conversation database does not exist.
    """
    db = AirlineDatabase(args.db)
    if not db.path.is_file():
        raise FileNotFoundError(f"{db.path}: no airline database there")
    async with trio.open_nursery() as nursery:
        if args.die_with_parent:
            nursery.start_soon(_die_with_parent)
        await hold_run_lock(db.path.with_name(db.path.name + ".lock"))
        async with open_sqlite_store(args.store) as sqlite:
            log = await sqlite.read_log(run_id_of(recording))
            executor = AirlineExecutor(
                db, RecordedCustomer(recording), respond_positions=respond_positions(log)
            )
            client = OpenAIChatClient(base_url=args.base_url)
            agent = airline_agent(model=client, executor=executor, system=system_prompt(recording))
            try:
                result = await _run(agent, recording, _store_wrapper(sqlite, args, log), log, args)
            finally:
                await client.aclose()
        nursery.cancel_scope.cancel(reason="the run finished")
    return result


async def _run(
    agent: Any, recording: Recording, store: RunStore, log: RunLog, args: argparse.Namespace
) -> RunResult:
    run_id = run_id_of(recording)
    stored = len(log.records)
    if args.events:
        steps = len(log.steps)
        _emit({"kind": "driver", "pid": os.getpid(), "stored_records": stored, "steps": steps})
    async with open_run(
        agent, first_customer_message(recording), store=store, run_id=run_id, owner=DEMO_OWNER
    ) as handle:
        if args.events:
            try:
                async for event in handle.events(from_seq=stored + 1):
                    if event.durable:
                        _emit(event_line(event))
            except trio.EndOfChannel:
                # The run's event writer stopped before the subscription was served (the
                # run failed); the run's own error is raised by `wait` below.
                pass
    return await handle.wait()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m treadle.demo.airline.driver",
        description="Drive one airline replay run (a child process of `treadle demo`).",
    )
    parser.add_argument("--recording-key", required=True, help="<task_id>-<trial>")
    parser.add_argument("--store", required=True, type=Path, help="SQLite store file")
    parser.add_argument("--db", required=True, type=Path, help="the conversation's database")
    parser.add_argument("--base-url", required=True, help="the replay server's API root")
    parser.add_argument(
        "--trajectories",
        type=Path,
        default=None,
        help="recordings file (default: the workload's trajectories.json)",
    )
    crash = parser.add_mutually_exclusive_group()
    crash.add_argument(
        "--crash-after-writes",
        type=int,
        default=None,
        metavar="N",
        help="SIGKILL this process right after its N-th store write",
    )
    crash.add_argument(
        "--crash-before-write",
        type=int,
        default=None,
        metavar="N",
        help="SIGKILL this process right before its N-th store write",
    )
    parser.add_argument("--events", action="store_true", help="print run events as JSON lines")
    parser.add_argument(
        "--die-with-parent",
        action="store_true",
        help="SIGKILL this process when standard input ends",
    )
    return parser


def _unwrapped(fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn``; a group holding one exception is re-raised as that exception."""
    try:
        return fn(*args)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from group
        raise


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, drive the run, and return the exit code (see the module docstring)."""
    args = _parser().parse_args(argv)
    for value in (args.crash_after_writes, args.crash_before_write):
        if value is not None and value < 1:
            _parser().error("a crash point is a write number, 1 or more")
    try:
        path = args.trajectories or find_data_dir() / "trajectories.json"
        recording = find_recording(load_trajectories(path), args.recording_key)
        result = _unwrapped(trio.run, drive, args, recording)
    except (TreadleError, OSError, AirlineDataNotFound, LookupError, ValueError) as exc:
        print(f"driver: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.events:
        _emit({"kind": "driver_done", "state": result.state.value})
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
