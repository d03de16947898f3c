"""Calls `process_tools.double` with 21 and writes how it went to the file ``sys.argv[1]``.

tests/runtime/test_process_tool_replies.py starts it with stdin, stdout and stderr closed.
"""

from __future__ import annotations

import sys

import trio
from process_tools import double

from treadle.tools import Toolbox
from treadle.types import Action


async def main(result: str) -> None:
    action = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="double", arguments={"n": 21}
    )
    outcome = await Toolbox([double]).execute(action)
    await trio.Path(result).write_text(f"{outcome.status.value} {outcome.observation}")


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
