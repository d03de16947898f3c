"""examples/stale_booking.py: a booking changed between read and write, with and without a crash.

The crash is real: the example's own process SIGKILLs itself at a chosen store write
(`treadle.testing.crashdriver.KillingStore`), and a new process resumes the run from its log.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from examples.stale_booking import RUN_ID, Bookings, main

from treadle.stores.jsonl import JsonlStore
from treadle.types import ActionIntent, ActionResult, ActionStatus, RunLog

ROOT = Path(__file__).resolve().parents[1]
STALE = (
    "Error: the call to change_seat was not executed: reservation:R1 changed since you read "
    "it (you read revision 0; it is now at revision 1). Read it again, then decide again from "
    "what you read."
)
FINAL = {"id": "R1", "flight": "TR105", "seat": "4C", "revision": 2}


def example(directory: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "examples.stale_booking", "--dir", str(directory), *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def read_log(directory: Path) -> RunLog:
    store = await JsonlStore.open(directory / "runs")
    try:
        return await store.read_log(RUN_ID)
    finally:
        await store.aclose()


def observations(log: RunLog) -> list[str]:
    return [o for step in log.steps for o in step.observations]


async def test_the_stale_seat_change_is_refused_and_the_model_reads_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await main(tmp_path)
    printed = capsys.readouterr().out
    assert f"step 2: {STALE}" in printed
    log = await read_log(tmp_path)
    assert observations(log) == [
        '{"id":"R1","flight":"TR101","seat":"12A","revision":0}',
        STALE,
        '{"id":"R1","flight":"TR105","seat":"","revision":1}',
        "R1 is now in seat 4C",
    ]
    moves = [r for r in log.records if isinstance(r, ActionResult) and r.tool == "change_seat"]
    assert [m.outcome.status for m in moves] == [ActionStatus.NOT_EXECUTED, ActionStatus.EXECUTED]
    assert moves[0].outcome.stale_resource == "reservation:R1"
    assert Bookings(tmp_path / "bookings.sqlite").read("R1") == FINAL
    import io

    from rich.console import Console

    from treadle._cli_store import trajectory_table

    console = Console(width=300, record=True, file=io.StringIO())
    console.print(trajectory_table(log))
    shown = console.export_text()
    assert "(read reservation:R1@0)" in shown  # `treadle show` displays what was read
    assert "(stale: reservation:R1 changed since it was read)" in shown


@pytest.mark.parametrize("kill_at", [5, 6, 7, 8])
def test_a_process_killed_between_read_and_write_resumes_from_the_log(
    tmp_path: Path, kill_at: int
) -> None:
    # Writes: 1 run-started, 2 model intent, 3 model result, 4 read intent, 5 the read's
    # result and step, 6 model intent, 7 model result, 8 the seat change's intent.
    killed = example(tmp_path, "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    before = trio.run(read_log, tmp_path)
    assert not [
        r for r in before.records if isinstance(r, ActionIntent) and r.tool == "change_seat"
    ]
    resumed = example(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    log = trio.run(read_log, tmp_path)
    # Whatever the killed process had written, the resumed one saw revision 0 in the log
    # (or read it again), and so refused the write as stale instead of as unread.
    assert observations(log)[1] == STALE
    assert Bookings(tmp_path / "bookings.sqlite").read("R1") == FINAL
    assert "succeeded final_answer" in resumed.stdout
