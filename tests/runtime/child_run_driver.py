"""A parent run with a child run on a SQLite store, in a process a test kills (SIGKILL).

``python child_run_driver.py STORE LEDGER block``: the child records its ``note`` effect in
LEDGER, then blocks in ``wait``; the process prints ``child running`` and waits to be killed.
``python child_run_driver.py STORE LEDGER resume``: resumes the parent (it re-attaches to the
child), prints the parent's state and exits. Both runs' leases last 2 s: a killed driver's
lapse soon.
"""

from __future__ import annotations

import os
import sys

import trio

from treadle import agent_tool
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.stores.sqlite import SqliteStore
from treadle.supervisors import run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import ReplayPolicy

PARENT_OWNER = "child-run-driver"
CHILD_LEASE_TTL_S = 2.0


def child(ledger: str, block: bool) -> Agent:
    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Record a note (an effect that must happen once).

        Args:
            text: the note.
            ctx: the call.
        """
        fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {ctx.intent_id}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return f"noted {text}"

    @tool(replay=ReplayPolicy.SAFE)
    async def wait(ctx: ToolContext) -> str:
        """Wait for the world (read-only)."""
        if block:
            print("child running", flush=True)
            await trio.sleep_forever()
        return "the world is ready"

    return Agent(
        model=ScriptedModel(
            turns=[call("note", text="hi", call_id="n1"), call("wait", call_id="w1"), say("done")]
        ),
        executor=Toolbox([note, wait]),
        parser=NativeToolCallParser(),
        model_name="child-model",
    )


def parent(store: SqliteStore, ledger: str, block: bool) -> Agent:
    helper = agent_tool(
        child(ledger, block),
        store=store,
        name="helper",
        description="Ask the helper.",
        lease_ttl_s=CHILD_LEASE_TTL_S,
    )
    return Agent(
        model=ScriptedModel(turns=[call("helper", task="help", call_id="h1"), say("thanks")]),
        executor=Toolbox([helper]),
        parser=NativeToolCallParser(),
        model_name="parent-model",
    )


async def main(path: str, ledger: str, mode: str) -> None:
    store = await SqliteStore.open(path)
    try:
        result = await run(
            parent(store, ledger, mode == "block"),
            "go",
            store=store,
            run_id="p",
            owner=PARENT_OWNER,
            lease_ttl_s=CHILD_LEASE_TTL_S,
        )
        print(result.state.value, result.final_answer, flush=True)
    finally:
        await store.aclose()


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:4])
