"""A run whose process tool sleeps, in a driver process a test kills (SIGKILL).

``python process_tool_driver.py DIR``: the run calls `process_tools.spawn_then_sleep` with DIR;
the tool writes ``DIR/started`` (its pid and its own child's) and sleeps for a minute.
"""

from __future__ import annotations

import sys

import trio
from process_tools import spawn_then_sleep

from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.supervisors import run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox


async def main(directory: str) -> None:
    agent = Agent(
        model=ScriptedModel(turns=[call("spawn_then_sleep", directory=directory), say("done")]),
        executor=Toolbox([spawn_then_sleep]),
        parser=NativeToolCallParser(),
    )
    await run(agent, "go", store=MemoryStore(), run_id="r")


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
