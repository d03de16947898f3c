"""A booking that changes between the agent's read and its write (docs/concepts.md, "Stale writes").

Run it with:

    python3 -m examples.stale_booking --dir /tmp/stale-booking

The customer asks to be moved to seat 3A. The agent reads reservation R1 (flight TR101, seat
12A, revision 0). While the model thinks, the schedule desk moves the booking to flight TR105,
whose aircraft has no row 3: the reservation is now at revision 1. The agent's `change_seat`
call carries the revision the model saw (0), the tool compares it with the current one in its
own database transaction, and refuses: the model is told the reservation changed since it
read it. It reads again, sees the new flight, and picks a seat that exists on it.

The reservations live in SQLite (``bookings.sqlite``) and the run's log in a JSONL store
(``runs/``), both in ``--dir``, so the example survives a real crash: ``--kill-at N`` SIGKILLs
the process at the run's N-th store write, and running it again resumes the run from its log.
Killed just before the write's intent (``--kill-at 8``), the resumed process knows only from
the log which revision the model saw, and refuses the stale write all the same.

The model is scripted (`treadle.testing.ScriptedModel`) so the example runs offline; the
tools and the agent are what a real deployment would use.
"""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

import treadle
from treadle.testing import ScriptedModel, call, say
from treadle.testing.crashdriver import KillingStore
from treadle.types import Attempt, ModelReply, ModelRequest

RUN_ID = "booking-R1"
OWNER = "stale-booking-example"

TURNS = [
    call("get_reservation", reservation_id="R1", call_id="read-1"),
    call("change_seat", reservation_id="R1", seat="3A", call_id="move-1"),
    call("get_reservation", reservation_id="R1", call_id="read-2"),
    call("change_seat", reservation_id="R1", seat="4C", call_id="move-2"),
    say("Your flight was changed to TR105, which has no row 3; you are in seat 4C now."),
]
"""What the model says, turn by turn (a real model would decide from the observations)."""


@attrs.define(eq=False)
class Bookings:
    """The airline's reservations: one SQLite file, every change in one transaction."""

    path: Path

    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection in autocommit mode (transactions are explicit), closed after."""
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute(
                "CREATE TABLE IF NOT EXISTS reservations"
                " (id TEXT PRIMARY KEY, flight TEXT, seat TEXT, revision INTEGER)"
            )
            db.execute("INSERT OR IGNORE INTO reservations VALUES ('R1', 'TR101', '12A', 0)")
            yield db
        finally:
            db.close()

    def read(self, reservation_id: str) -> dict[str, Any]:
        """The reservation as it is now, with its revision."""
        with self.connect() as db:
            flight, seat, revision = db.execute(
                "SELECT flight, seat, revision FROM reservations WHERE id = ?", (reservation_id,)
            ).fetchone()
        return {"id": reservation_id, "flight": flight, "seat": seat, "revision": revision}

    def change_seat(self, reservation_id: str, seat: str, seen: int) -> int:
        """Move to ``seat`` if the reservation is still at revision ``seen``; the new revision.

        Raises:
            treadle.StaleWrite: it changed since (nothing was written).
        """
        with self.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            (current,) = db.execute(
                "SELECT revision FROM reservations WHERE id = ?", (reservation_id,)
            ).fetchone()
            if current != seen:
                db.execute("ROLLBACK")
                raise treadle.StaleWrite(current=current)
            db.execute(
                "UPDATE reservations SET seat = ?, revision = ? WHERE id = ?",
                (seat, current + 1, reservation_id),
            )
            db.execute("COMMIT")
        return int(current + 1)

    def schedule_change(self) -> None:
        """The schedule desk moves R1 to flight TR105 (once; a no-op when already done)."""
        with self.connect() as db:
            db.execute(
                "UPDATE reservations SET flight = 'TR105', seat = '', revision = revision + 1"
                " WHERE id = 'R1' AND flight = 'TR101'"
            )


def toolbox(bookings: Bookings) -> treadle.Toolbox:
    """The two tools: a read that reports the revision, a write that checks it."""

    @treadle.tool(reads="reservation:{reservation_id}", replay=treadle.ReplayPolicy.SAFE)
    async def get_reservation(reservation_id: str) -> treadle.Observed[dict[str, Any]]:
        """Look up a reservation: its flight, seat and revision.

        Args:
            reservation_id: the booking reference, e.g. R1.
        """
        await trio.lowlevel.checkpoint()
        found = bookings.read(reservation_id)
        return treadle.Observed(found, revision=found["revision"])

    @treadle.tool(writes="reservation:{reservation_id}")
    async def change_seat(
        reservation_id: str, seat: str, context: treadle.ToolContext
    ) -> treadle.Observed[str]:
        """Move a reservation to another seat on its flight.

        Args:
            reservation_id: the booking reference.
            seat: the new seat, e.g. 4C.
            context: the call's context: the revision the model saw (not shown to it).
        """
        await trio.lowlevel.checkpoint()
        assert context.seen_revision is not None  # a writing tool always gets one
        revision = bookings.change_seat(reservation_id, seat, context.seen_revision)
        return treadle.Observed(f"{reservation_id} is now in seat {seat}", revision=revision)

    return treadle.Toolbox([get_reservation, change_seat])


@attrs.define(eq=False)
class ScheduleDesk:
    """The model, during whose second call the schedule desk changes the booking."""

    bookings: Bookings
    inner: ScriptedModel = attrs.Factory(lambda: ScriptedModel(turns=TURNS))

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: Any = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        """The scripted reply; the booking changes as the second call comes in."""
        if sum(m.role == "assistant" for m in request.messages) == 1:
            self.bookings.schedule_change()
        return await self.inner.complete(request, on_delta=on_delta, attempt=attempt)


def make_agent(bookings: Bookings) -> treadle.Agent:
    """The booking agent on ``bookings``."""
    return treadle.Agent(
        model=ScheduleDesk(bookings),
        executor=toolbox(bookings),
        parser=treadle.NativeToolCallParser(),
        system_prompt="You are an airline's booking assistant.",
    )


async def main(directory: Path, kill_at: int | None = None) -> None:
    """Run (or resume) the booking run in ``directory`` and print what the model saw."""
    bookings = Bookings(directory / "bookings.sqlite")
    async with treadle.open_jsonl_store(directory / "runs") as jsonl:
        store = (
            jsonl if kill_at is None else KillingStore(inner=jsonl, kill_at=kill_at, when="before")
        )
        result = await treadle.run(
            make_agent(bookings),
            "Please move me to seat 3A on booking R1.",
            store=store,
            run_id=RUN_ID,
            owner=OWNER,
        )
        log = await jsonl.read_log(RUN_ID)
    for step in log.steps:
        for observation in step.observations:
            print(f"step {step.step}: {observation}")
    print(result.state, result.stop_reason, result.final_answer)
    print("reservation:", bookings.read("R1"))


def cli(argv: Sequence[str] | None = None) -> None:
    """``python3 -m examples.stale_booking --dir DIR [--kill-at N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the data and log live")
    parser.add_argument("--kill-at", type=int, help="SIGKILL the process at this store write")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    trio.run(main, args.dir, args.kill_at)


if __name__ == "__main__":
    cli(sys.argv[1:])
