"""A run whose process tool sleeps, in a driver process a test kills (SIGKILL).

``python process_tool_driver.py DIR [TOOL]``: the run calls TOOL of `process_tools` with DIR
(`process_tools.spawn_then_sleep` by default): the tool writes ``DIR/started`` (two pids of
processes of the call) and sleeps for a minute.
"""

from __future__ import annotations

import sys

import process_tools
import trio

from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.supervisors import run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox


async def main(directory: str, name: str) -> None:
    agent = Agent(
        model=ScriptedModel(turns=[call(name, directory=directory), say("done")]),
        executor=Toolbox([getattr(process_tools, name)]),
        parser=NativeToolCallParser(),
    )
    await run(agent, "go", store=MemoryStore(), run_id="r")


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "spawn_then_sleep")
