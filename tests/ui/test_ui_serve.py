"""The served console as a process: it stops on SIGINT or SIGTERM whatever a client does."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import pytest
import trio
from ui_support import start_console

import treadle
from treadle.testing.scripted import ScriptedModel, calls, say
from treadle.types import ToolCall

PART_CHARS = 16_000
"""The length of each observation of the long run: shown whole (below the page's cut)."""


@treadle.tool
async def page_part(n: int) -> str:
    """A long part of a page."""
    return f"{n} " + "x" * PART_CHARS


@pytest.fixture(scope="module")
def long_run_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store with run ``long``, whose page (13 MB) is more than a socket buffers."""
    db = tmp_path_factory.mktemp("serve") / "runs.db"
    turns = [
        calls(*(ToolCall(id=f"p{s}-{i}", name="page_part", arguments={"n": i}) for i in range(100)))
        for s in range(8)
    ]
    agent = treadle.Agent(
        model=ScriptedModel(turns=[*turns, say("done")]),
        executor=treadle.Toolbox([page_part]),
        parser=treadle.NativeToolCallParser(),
    )

    async def make() -> None:
        async with treadle.open_sqlite_store(db) as store:
            await treadle.run(agent, "read", store=store, run_id="long")

    trio.run(make)
    return db


@pytest.mark.parametrize(
    "signals",
    [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]],
    ids=["sigterm", "two-sigints"],
)
def test_a_client_that_stops_reading_does_not_hold_a_stopping_console(
    long_run_store: Path, signals: list[signal.Signals]
) -> None:
    """A client that asked for a big page and stopped reading held the console: it still
    served 60 s after SIGTERM, and two SIGINTs never stopped it (Hypercorn waits on the
    page's write as long as the client does not read)."""
    process, url = start_console(long_run_store)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.settimeout(120)
        stalled.connect((host, int(port)))
        stalled.sendall(b"GET /runs/long HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        received = stalled.recv(1)  # the page is being sent; from now on nothing is read
        try:
            for sent in signals:
                process.send_signal(sent)
            status = process.wait(timeout=60)  # only a hang goes past this
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            raise AssertionError(f"the console still served 60 s after {signals}") from None
        finally:
            assert process.stdout is not None
            process.stdout.close()
        while chunk := stalled.recv(1 << 20):
            received += chunk
    assert status == 128 + signals[0]
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    assert len(body) < length  # the client held the page's write when the console stopped
