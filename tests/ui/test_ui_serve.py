"""The served console as a process: it stops on SIGINT or SIGTERM whatever a client does."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
import trio
from click.testing import CliRunner
from ui_support import self_signed, start_console, stop

import treadle
from treadle.cli import main
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


TOKEN = "tls-t0ken"
HANG_S = 60
"""The hang limit of each request of the TLS tests (no speed check)."""


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files (`self_signed`)."""
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("files", ["certificate and key", "one file"])
def test_with_a_certificate_the_console_serves_https_and_http2(
    tmp_path: Path, certificate: tuple[Path, Path], files: str
) -> None:
    """Served over plain HTTP/1.1 only, the console could take no more than six live pages of
    one browser (its connections to a host); given a certificate it serves HTTPS, and HTTP/2
    to a client that offers it, which carries every page, stream and action on one
    connection (docs/ui.md, "Many tabs")."""
    db = tmp_path / "runs.db"
    queued = CliRunner().invoke(
        main, ["submit", "--store", str(db), "--agent", "nobody", "--run-id", "q", "hi"]
    )
    assert queued.exit_code == 0, queued.output
    cert, key = certificate
    if files == "one file":
        both = tmp_path / "both.pem"
        both.write_text(cert.read_text() + key.read_text())
        tls = ["--certfile", str(both)]
    else:
        tls = ["--certfile", str(cert), "--keyfile", str(key)]
    process, url = start_console(db, "--token", TOKEN, *tls)
    try:
        assert url.startswith("https://127.0.0.1:")
        with httpx.Client(
            http2=True,
            verify=ssl.create_default_context(cafile=str(cert)),
            base_url=url,
            timeout=HANG_S,
        ) as http:
            entered = http.get("/", params={"token": TOKEN}, follow_redirects=True)
            cancelled = http.post(
                "/runs/q/cancel",
                data={"token": TOKEN, "reason": "over h2"},
                headers={"origin": url, "accept": "application/json"},
            )
    finally:
        status = stop(process)
    assert [r.http_version for r in (*entered.history, entered)] == ["HTTP/2", "HTTP/2"]
    assert entered.status_code == 200 and 'data-run="q"' in entered.text
    cookie = entered.history[0].headers["set-cookie"].lower().split("; ")
    assert "secure" in cookie  # the console's own HTTPS
    assert cancelled.status_code == 200 and cancelled.json()["ok"] is True, cancelled.text
    assert status == 0

    async def state() -> treadle.RunState | None:
        async with treadle.open_sqlite_store(db) as store:
            summary = await store.read_summary("q")
        return summary.state if summary else None

    assert trio.run(state) is treadle.RunState.CANCELLED


def test_tls_files_that_do_not_load_are_refused_before_serving(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    """Files that do not load as a certificate and its key are told at start, before the
    console binds anything; a key with a passphrase is refused, never asked for."""
    cert, key = certificate
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    locked = tmp_path / "locked.pem"  # the key under a passphrase
    subprocess.run(
        ["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:s3", "-out", str(locked)],
        check=True,
        capture_output=True,
    )
    refusals = {
        "a key with a passphrase": ["--certfile", str(cert), "--keyfile", str(locked)],
        "keyfile alone": ["--keyfile", str(key)],
        "garbage": ["--certfile", str(garbage), "--keyfile", str(key)],
        "no key": ["--certfile", str(cert)],
        "a key for a certificate": ["--certfile", str(key), "--keyfile", str(key)],
    }
    for why, args in refusals.items():
        refused = CliRunner().invoke(main, ["ui", "--store", str(tmp_path / "x.db"), *args])
        assert refused.exit_code == 2, (why, refused.output)
        assert "--certfile" in refused.output, (why, refused.output)
