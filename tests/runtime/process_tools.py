"""Process tools for tests/runtime/test_stubborn_tools.py (imported again in their child).

Each writes ``<dir>/started`` (its pid) when it begins and ``<dir>/done`` after its sleep: a
process killed during the sleep never writes ``done``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import treadle


@treadle.tool(isolation="process", timeout_s=30)
def slow_write(directory: str, seconds: float) -> str:
    """Sleep, then write a marker file."""
    folder = Path(directory)
    (folder / "started").write_text(str(os.getpid()))
    time.sleep(seconds)
    (folder / "done").write_text("done")
    return "written"


@treadle.tool(isolation="process")
def double(n: int) -> int:
    """Twice ``n``, computed in a child process."""
    print("this goes to stderr, not into the reply")
    return 2 * n


@treadle.tool(isolation="process")
def fail(message: str) -> str:
    """Raise ValueError(message)."""
    raise ValueError(message)


@treadle.tool(isolation="process", writes="res:{rid}", base_revision="base")
def stale_write(rid: str, base: int) -> str:
    """A write that finds its resource changed since it was read."""
    raise treadle.StaleWrite(current=base + 1)


@treadle.tool(isolation="process")
def whoami(ctx: treadle.ToolContext) -> str:
    """Say which call this is (its context crossed into the child process)."""
    return f"{ctx.intent_id} {ctx.forward_event} {ctx.run_cancelled}"


@treadle.tool(isolation="process", timeout_s=30)
def spawn_and_wait(directory: str) -> str:
    """Start a grandchild that sleeps, then write its pid as ``started`` and wait for it."""
    import subprocess
    import sys

    folder = Path(directory)
    script = f"import time, pathlib; time.sleep(60); pathlib.Path({str(folder / 'done')!r}).write_text('done')"
    grandchild = subprocess.Popen([sys.executable, "-c", script])
    (folder / "started").write_text(str(grandchild.pid))
    grandchild.wait()
    return "waited"


@treadle.tool(isolation="process", timeout_s=60)
def spawn_then_sleep(directory: str) -> str:
    """Start a grandchild that sleeps, write ``started`` (both pids), then sleep too.

    Either one, still alive after its sleep, writes its own ``done-<pid>`` marker.
    """
    import subprocess
    import sys

    folder = Path(directory)
    script = (
        "import os, time, pathlib; time.sleep(60); "
        f"pathlib.Path({str(folder)!r}, f'done-{{os.getpid()}}').write_text('done')"
    )
    grandchild = subprocess.Popen([sys.executable, "-c", script])
    (folder / "started").write_text(f"{os.getpid()} {grandchild.pid}")
    time.sleep(60)
    (folder / f"done-{os.getpid()}").write_text("done")
    return "slept"


@treadle.tool(isolation="process")
def effect_then_killed(directory: str) -> str:
    """Write ``done``, then die of SIGKILL (as by the OOM killer) before returning."""
    import signal

    (Path(directory) / "done").write_text("done")
    os.kill(os.getpid(), signal.SIGKILL)
    return "never"


@treadle.tool(isolation="process", timeout_s=20)
def fork_and_return(directory: str) -> str:
    """Fork a background process that sleeps (its pid in ``background``), and return at once."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    (Path(directory) / "background").write_text(str(pid))
    return "returned"
