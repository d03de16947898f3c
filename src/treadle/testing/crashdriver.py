"""A driver process for real-crash tests: the scripted scenario on a real store, killable.

It runs (or resumes) the runs of the scenario of `treadle.testing.crashes` concurrently on a
SQLite or JSONL store, and can SIGKILL itself at a chosen store write, so that a test can kill
it at any point, start a new process that resumes, and check what survived::

    python -m treadle.testing.crashdriver --kind jsonl --store runs/ --ledger ledger.jsonl
        --runs r1,r2,r3 --kill-after-writes 17 --kill-when before

The process exits 0 once every run has finished (a finished run just returns its stored
result), and dies by SIGKILL at the chosen write: ``before`` it reaches the store, or
``after`` the store accepted it (for a barrier: after it is durable). The tools count their
executions in the ``--ledger`` file (appended and synced by the tool itself; see
`treadle.testing.crashes.read_ledger`).

`child_main` is the same driver as a `multiprocessing` target: tests start it through a
forkserver that has imported treadle once, so hundreds of kills stay cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

from treadle.ports import RunStore
from treadle.stores.jsonl import JsonlStore
from treadle.stores.sqlite import SqliteStore
from treadle.supervisors import run
from treadle.testing._intercept import InterceptingStore
from treadle.testing.crashes import RUN_INPUT, make_agent
from treadle.testing.faults import check_ordinal, check_when
from treadle.types import Record, RunResult, StoreOp

StoreKind = Literal["sqlite", "jsonl"]

CRASH_DRIVER_OWNER = "treadle-crashdriver"
"""The lease owner of every driver incarnation (one incarnation at a time, by construction)."""

CRASH_DRIVER_TTL_S = 2.0
"""The drivers' lease TTL: another owner (``treadle resume --wait``) takes over this soon."""


@asynccontextmanager
async def open_store(kind: StoreKind, path: str | os.PathLike[str]) -> AsyncIterator[RunStore]:
    """Open a SQLite (a file) or JSONL (a directory) store for a block, then close it."""
    store: SqliteStore | JsonlStore
    if kind == "sqlite":
        store = await SqliteStore.open(path)
    else:
        store = await JsonlStore.open(path)
    try:
        yield store
    finally:
        await store.aclose()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@attrs.frozen(kw_only=True)
class KillNote:
    """What a `KillingStore` wrote down just before it killed its process.

    Attributes:
        run_id: the run of the write it died at.
        seq: the seq of that write's first record.
        records: how many records the write held.
        barrier: whether the write was a barrier.
        when: ``before`` (the write never reached the store) or ``after`` (it returned).
    """

    run_id: str
    seq: int
    records: int
    barrier: bool
    when: Literal["before", "after"]


def read_kill_note(path: str | os.PathLike[str]) -> KillNote | None:
    """The note a killed driver left, or ``None`` when it left none."""
    try:
        return KillNote(**json.loads(Path(path).read_text()))
    except FileNotFoundError:
        return None


def _note(
    op: StoreOp, records: tuple[Record, ...], seq: int, when: Literal["before", "after"]
) -> KillNote:
    return KillNote(
        run_id=records[0].run_id, seq=seq, records=len(records), barrier=op.barrier, when=when
    )


@attrs.define(eq=False)
class KillingStore(InterceptingStore):
    """A `treadle.ports.RunStore` that SIGKILLs its process at write number ``kill_at``.

    Args:
        inner: the real store.
        kill_at: the write (1-based, over all runs) at which the process dies; ``None``:
            never.
        when: ``before`` the write reaches the store, or ``after`` the store accepted it (for a
            barrier, once it is durable; for the other writes, once queued).
        note: a file to write a `KillNote` to (synced) just before dying.

    Raises:
        UsageError: when made, the operation to hit is not a whole number from 1, or
            ``when`` is neither ``before`` nor ``after``.
    """

    inner: RunStore
    kill_at: int | None = attrs.field(default=None, validator=check_ordinal)
    when: Literal["before", "after"] = attrs.field(default="after", validator=check_when)
    note: str | None = None
    writes: int = 0

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        """Count the write; die before it at the kill point, or say to die after it."""
        self.writes += 1
        dies = self.writes == self.kill_at
        if dies and self.when == "before":
            self._die(_note(op, records, seq, "before"))
        return dies

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        """Die once the store accepted the write at the kill point."""
        if act:
            self._die(_note(op, records, seq, "after"))

    def _die(self, note: KillNote) -> None:
        if self.note is not None:
            fd = os.open(self.note, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, json.dumps(attrs.asdict(note)).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        _die()


@attrs.frozen(kw_only=True)
class DriverSpec:
    """What one driver process does.

    Attributes:
        kind: ``sqlite`` (``store`` is a file) or ``jsonl`` (``store`` is a directory).
        store: the store's path.
        ledger: the file the tools record their executions in (all runs share it).
        run_ids: the runs to start or resume, concurrently.
        kill_after_writes: the store write at which the process SIGKILLs itself.
        kill_when: ``before`` or ``after`` that write.
        note: where the process writes a `KillNote` before it kills itself.
    """

    kind: StoreKind
    store: str
    ledger: str
    run_ids: tuple[str, ...]
    kill_after_writes: int | None = None
    kill_when: Literal["before", "after"] = "after"
    note: str | None = None


async def drive(spec: DriverSpec, *, on_ready: Callable[[], None] | None = None) -> list[RunResult]:
    """Start or resume every run of ``spec`` and wait for them all.

    Args:
        spec: the store, runs and kill point.
        on_ready: called once the store is open, before the runs start.

    Returns:
        The runs' results, in ``spec.run_ids`` order.
    """
    results: dict[str, RunResult] = {}
    async with open_store(spec.kind, spec.store) as inner:
        store = KillingStore(
            inner, kill_at=spec.kill_after_writes, when=spec.kill_when, note=spec.note
        )
        if on_ready is not None:
            on_ready()

        async def one(run_id: str) -> None:
            agent = make_agent(spec.ledger)
            # One owner id for every incarnation: each starts after the one before died, so
            # it continues that driver's lease at once instead of waiting for it to expire.
            results[run_id] = await run(
                agent,
                RUN_INPUT,
                store=store,
                run_id=run_id,
                owner=CRASH_DRIVER_OWNER,
                lease_ttl_s=CRASH_DRIVER_TTL_S,
            )

        async with trio.open_nursery() as nursery:
            for run_id in spec.run_ids:
                nursery.start_soon(one, run_id)
    return [results[run_id] for run_id in spec.run_ids]


def child_main(spec: DriverSpec, ready: Any = None) -> None:
    """The driver as a `multiprocessing` target; ``ready`` (an Event) is set once open."""
    trio.run(lambda: drive(spec, on_ready=ready.set if ready is not None else None))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m treadle.testing.crashdriver")
    parser.add_argument("--kind", choices=["sqlite", "jsonl"], required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--runs", required=True, help="comma-separated run ids")
    parser.add_argument("--kill-after-writes", type=int, default=None)
    parser.add_argument("--kill-when", choices=["before", "after"], default="after")
    parser.add_argument("--note", default=None, help="file for the kill note")
    args = parser.parse_args(argv)
    spec = DriverSpec(
        kind=args.kind,
        store=args.store,
        ledger=args.ledger,
        run_ids=tuple(args.runs.split(",")),
        kill_after_writes=args.kill_after_writes,
        kill_when=args.kill_when,
        note=args.note,
    )

    def ready() -> None:
        print("ready", flush=True)

    for result in trio.run(lambda: drive(spec, on_ready=ready)):
        print(f"{result.run_id} {result.state.value} {result.stop_reason.value}", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
