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


@treadle.tool(isolation="process", timeout_s=60)
def spawn_in_own_group(directory: str) -> str:
    """Start a command in a process group of its own (as coreutils ``timeout`` does) and wait.

    The command starts a sleeper and writes ``started`` (its pid and the sleeper's); when the
    sleeper ends, the command writes ``done``: killed after its sleeper, it would still write it.
    """
    import subprocess
    import sys

    script = (
        "import os, pathlib, subprocess, sys\n"
        "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"folder = pathlib.Path({directory!r})\n"
        "(folder / 'started.part').write_text(f'{os.getpid()} {sleeper.pid}')\n"
        "(folder / 'started.part').rename(folder / 'started')\n"
        "sleeper.wait()\n"
        "(folder / 'done').write_text('done')\n"
    )
    subprocess.run([sys.executable, "-c", script], process_group=0, check=False)
    return "waited"


@treadle.tool(isolation="process")
async def deadline_left_async(ctx: treadle.ToolContext) -> float:
    """Seconds left before the run's time budget ends, on this process's trio clock."""
    import trio

    return ctx.deadline - trio.current_time()


@treadle.tool(isolation="process")
def deadline_left(ctx: treadle.ToolContext) -> float:
    """Seconds left before the run's time budget ends, on `time.monotonic`."""
    return ctx.deadline - time.monotonic()


class Scaler:
    """Methods to declare as process tools."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def scale(self, n: int) -> int:
        """``n`` times the factor."""
        return n * self.factor

    @classmethod
    def offset(cls, n: int) -> int:
        """``n`` plus 100."""
        return n + 100


scaler = Scaler(7)


class Unprintable(Exception):
    """An error whose message cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


@treadle.tool(isolation="process")
def fail_unprintably(directory: str) -> str:
    """Write ``done``, then raise an error whose ``__str__`` fails."""
    (Path(directory) / "done").write_text("done")
    raise Unprintable()


class TwoPart(Exception):
    """Pickles (as its message) but cannot be unpickled: it is re-created with one argument."""

    def __init__(self, first: int, second: int) -> None:
        super().__init__(f"{first}-{second}")


@treadle.tool(isolation="process")
def return_unreadable(directory: str) -> str:
    """Write ``done``, then return a value that cannot be unpickled."""
    (Path(directory) / "done").write_text("done")
    return TwoPart(1, 2)  # type: ignore[return-value]


@treadle.tool(isolation="process", timeout_s=60)
def fork_chain(directory: str) -> str:
    """Write ``started`` (the call's session id), then start a fork chain and wait.

    Each process of the chain forks the next and exits at once, so the chain has a new pid
    all the time; its last one, alive after its sleep, writes ``done``.
    """
    folder = Path(directory)
    if os.fork():
        (folder / "started").write_text(str(os.getsid(0)))
        time.sleep(60)
        return "waited"
    for _ in range(1_000_000):
        if os.fork():
            os._exit(0)
    time.sleep(60)
    (folder / "done").write_text("done")
    os._exit(0)
