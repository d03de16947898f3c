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


@treadle.tool(isolation="process", timeout_s=60)
def link_of_a_group(directory: str) -> str:
    """Start a process group whose only link to the call is its leader, then wait.

    The leader, a child of the worker, makes a process group of its own, and in it starts a
    watcher through a process that exits at once, so the watcher's parent is outside the
    session. The watcher ignores SIGHUP (as under ``nohup``) and writes ``started`` (its pid
    and the leader's); once the leader has died, it writes ``acted``.
    """
    if os.fork() != 0:  # the worker
        time.sleep(60)
        return "waited"
    os.setpgid(0, 0)
    leader = os.getpid()
    between = os.fork()
    if between == 0:
        if os.fork() == 0:
            _watch_for_death(Path(directory), leader)
        os._exit(0)
    os.waitpid(between, 0)
    time.sleep(60)
    os._exit(0)


def _watch_for_death(folder: Path, leader: int) -> None:
    """Ignore SIGHUP, write ``started``, and write ``acted`` once ``leader`` has died."""
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    (folder / "started.part").write_text(f"{os.getpid()} {leader}")
    (folder / "started.part").rename(folder / "started")
    while running(leader):
        time.sleep(0.001)
    (folder / "acted").write_text("acted")
    os._exit(0)


def running(pid: int) -> bool:
    """Whether ``pid`` is there and not a zombie (Linux: its state in ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def _keep_running(directory: str) -> None:
    """Wait a minute, or until ``<directory>/release`` exists (a test's cleanup writes it)."""
    release = Path(directory) / "release"
    for _ in range(1200):
        if release.exists():
            return
        time.sleep(0.05)


@treadle.tool(isolation="process", timeout_s=20)
def leave_a_thread(directory: str) -> str:
    """Start a non-daemon thread that keeps running, and return at once."""
    import threading

    threading.Thread(target=_keep_running, args=(directory,)).start()
    return "returned"


@treadle.tool(isolation="process", timeout_s=20)
def leave_a_multiprocessing_child(directory: str) -> str:
    """Start a `multiprocessing.Process` (fork) that keeps running (its pid in ``background``),
    and return at once: multiprocessing joins it when the interpreter exits."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_keep_running, args=(directory,))
    child.start()
    (Path(directory) / "background").write_text(str(child.pid))
    return "returned"


@treadle.tool(isolation="process", timeout_s=20)
def leave_a_slow_exit_handler(directory: str) -> str:
    """Register an `atexit` handler that keeps running, and return at once."""
    import atexit

    atexit.register(_keep_running, directory)
    return "returned"


@treadle.tool(isolation="process", timeout_s=20)
def exit_leaving_a_thread(directory: str, how: str) -> str:
    """Start a non-daemon thread that keeps running and register an `atexit` handler that
    writes ``<directory>/atexit``, then exit: ``sys.exit(3)`` (``how`` "exit") or
    `KeyboardInterrupt` ("interrupt")."""
    import atexit
    import sys
    import threading

    threading.Thread(target=_keep_running, args=(directory,)).start()
    atexit.register((Path(directory) / "atexit").write_text, "ran")
    if how == "exit":
        sys.exit(3)
    raise KeyboardInterrupt


@treadle.tool(isolation="process", timeout_s=20)
def fork_without_hooks(directory: str) -> str:
    """Fork with libc's ``fork`` (Python's at-fork hooks do not run, so the child keeps the
    reply pipe); the child leaves the session and keeps running (its pid in ``background``)."""
    import ctypes

    pid = ctypes.CDLL(None).fork()
    if pid == 0:
        os.setsid()
        _keep_running(directory)
        os._exit(0)
    (Path(directory) / "background").write_text(str(pid))
    return "returned"


@treadle.tool(isolation="process", timeout_s=3)
def stop_the_keeper() -> str:
    """Stop (SIGSTOP) the process that waits for this one, and return."""
    import signal

    os.kill(os.getppid(), signal.SIGSTOP)
    return "returned"


class Teller:
    """A classmethod tool that reads its class's ``bank``."""

    bank = "base bank"

    @classmethod
    def pay(cls, amount: int) -> str:
        """Pay ``amount`` through the class's bank."""
        return f"paid {amount} via {cls.bank}"


class SandboxTeller(Teller):
    """`Teller` with a bank of its own."""

    bank = "sandbox bank"


class Uncaught(BaseException):
    """A `BaseException` that is neither `KeyboardInterrupt` nor `SystemExit`."""


@treadle.tool(isolation="process")
def raise_base(kind: str) -> str:
    """Raise a `BaseException` of ``kind`` that `except Exception` does not catch."""
    import asyncio

    if kind == "custom":
        raise Uncaught("custom")
    if kind == "generator_exit":
        raise GeneratorExit("generator exit")
    raise asyncio.CancelledError("asyncio cancel")


@treadle.tool(isolation="process")
def close_then_log(directory: str) -> str:
    """Close every file descriptor from 3 up, then open log files and keep them open.

    It opens as many as it takes for one to get the number the reply pipe had (the child's
    second argument), and writes their count to ``count``.
    """
    import sys

    os.closerange(3, 4096)
    global LOGS
    LOGS = []
    while not LOGS or LOGS[-1].fileno() < int(sys.argv[2]):
        LOGS.append(open(Path(directory) / f"log{len(LOGS)}.txt", "ab", buffering=0))  # noqa: SIM115
    (Path(directory) / "count").write_text(str(len(LOGS)))
    return "logged"


class ExitsWhenRead:
    """Unpickles by calling ``sys.exit(7)``."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        import sys

        return (sys.exit, (7,))


class RaisesWhenRead:
    """Unpickles by raising `Uncaught`."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_raise_uncaught, ("read",))


def _raise_uncaught(message: str) -> None:
    raise Uncaught(message)


@treadle.tool(isolation="process")
def return_exiting(kind: str) -> str:
    """Return a value whose unpickling raises `SystemExit` (``exit``) or `Uncaught`."""
    return ExitsWhenRead() if kind == "exit" else RaisesWhenRead()  # type: ignore[return-value]
