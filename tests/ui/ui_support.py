"""Shared pieces of the run console's tests: agents, a driver process, the served console."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import treadle
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import Usage

MARKUP = '<script>window.pwned = true</script><img src="x" id="pwned-img"><b>bold</b>'
"""An observation that holds markup: the page must show it as text."""


@treadle.tool
async def fetch_page(url: str) -> str:
    """Fetch a page (returns markup)."""
    return MARKUP


@treadle.tool(requires_approval=True)
async def transfer(amount: int) -> str:
    """Move money."""
    return f"moved {amount}"


def markup_agent() -> treadle.Agent:
    """Fetches a page whose text is markup, then answers."""
    return treadle.Agent(
        model=ScriptedModel(
            turns=[
                call("fetch_page", url="http://example.invalid/", call_id="f1"),
                say("done", usage=Usage(input_tokens=40, output_tokens=7)),
            ]
        ),
        executor=treadle.Toolbox([fetch_page]),
        parser=treadle.NativeToolCallParser(),
    )


def approval_agent() -> treadle.Agent:
    """Asks to transfer 5 (a call that needs approval), then answers."""
    return treadle.Agent(
        model=ScriptedModel(turns=[call("transfer", amount=5, call_id="t1"), say("paid")]),
        executor=treadle.Toolbox([transfer]),
        parser=treadle.NativeToolCallParser(),
    )


DRIVER = """
import sys
from pathlib import Path

import trio

import treadle
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel, call, say

db, run_id, gate, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
approvals = int(sys.argv[5])


@treadle.tool
async def wait_gate() -> str:
    \"\"\"Wait until the test opens the gate.\"\"\"
    while not gate.exists():
        await trio.sleep(0.02)
    return "<script>window.pwned = true</script>gate opened"


@treadle.tool(requires_approval=True)
async def transfer(amount: int) -> str:
    \"\"\"Move money.\"\"\"
    with marker.open("a") as out:
        out.write(f"{amount}\\n")
    return f"moved {amount}"


async def main():
    agent = treadle.Agent(
        model=ScriptedModel(
            turns=[call("wait_gate", call_id="g1")]
            + [call("transfer", amount=4 + n, call_id=f"t{n}") for n in range(1, approvals + 1)]
            + [say("paid")]
        ),
        executor=treadle.Toolbox([wait_gate, transfer]),
        parser=treadle.NativeToolCallParser(),
    )
    async with open_sqlite_store(db) as store:
        async with open_run(agent, "pay 5", store=store, run_id=run_id, control_poll_s=0.05) as h:
            result = await h.wait()
    print(result.state.value, flush=True)


trio.run(main)
"""
"""A process driving one run: step 1 waits on a gate file, each next step needs an approval
(of ``transfer``, amount 5 as call ``t1``, then 6 as ``t2``, ...)."""


def start_driver(
    tmp: Path, db: Path, run_id: str, *, approvals: int = 1
) -> tuple[subprocess.Popen[str], Path, Path]:
    """Start a driver process for ``run_id`` asking ``approvals`` approvals after its gate.

    Returns the process, its gate file and its marker file (each transfer run adds a line).
    """
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    gate, marker = tmp / f"{run_id}.gate", tmp / f"{run_id}.executed"
    process = subprocess.Popen(
        [sys.executable, str(script), str(db), run_id, str(gate), str(marker), str(approvals)],
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
    )
    return process, gate, marker


def env() -> dict[str, str]:
    """The environment of a child process: this tree's treadle importable."""
    src = str(Path(treadle.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def start_console(store: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Run ``treadle ui --port 0`` on ``store``; returns the process and the URL it serves."""
    process = subprocess.Popen(
        [sys.executable, "-m", "treadle", "ui", "--store", str(store), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env(),
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # the server prints its URL once it listens
    if not line.startswith("treadle ui: serving "):
        process.kill()
        process.wait(timeout=60)
        raise AssertionError(f"treadle ui did not start: {line!r}")
    return process, line.removeprefix("treadle ui: serving ").strip()


def stop(process: subprocess.Popen[str]) -> int:
    """Stop a process started here (SIGTERM, then SIGKILL after 30 s); returns its status."""
    process.terminate()
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=30)
    finally:
        if process.stdout is not None:
            process.stdout.close()


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its unencrypted key, made by ``openssl``.

    Returns the certificate's and the key's PEM files in ``folder``. Without ``openssl`` the
    test skips, except in CI (``CI`` set), where it fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the console's TLS tests: openssl is missing")
        pytest.skip("openssl is missing")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt"),
            *("ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
