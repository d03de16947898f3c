"""Running one tool call in a child process (``@tool(isolation="process")``).

See docs/concepts.md, "Tools and cancellation".

The parent starts ``python -m treadle._toolproc LIFELINE`` in a session of its own, with its
``sys.path`` as ``PYTHONPATH``, and writes one pickled request to its stdin: the tool
function's module and qualified name (it is imported in the child, so it must be importable)
and the validated arguments. ``LIFELINE`` is the read end of a pipe whose write end only the
parent holds, for as long as it waits for the call: its end of file means the parent is gone.

The process started is the call's **keeper**, the leader of the call's process group. It forks
a **worker** that runs the function (an ``async def`` one under its own `trio.run`) and writes
one pickled reply to what was the keeper's stdout; the function's own prints go to stderr. The
keeper runs no code of the tool: it waits for the worker and exits as the worker did (the same
signal, or the same status), and when the lifeline breaks first (the parent was killed, even
with SIGKILL) it kills the whole group, itself, the worker and every process the tool started
in it, so nothing of the call runs on after the parent died (docs/crash-safety.md). The parent
kills the same group (SIGKILL) when the call is cancelled or times out. On Linux the worker also
dies with its keeper (``PR_SET_PDEATHSIG``).

Processes the tool starts do not hold the reply pipe (it is closed in forked children and not
inherited across ``exec``), so a background process left running does not keep the reply from
arriving.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Any, NoReturn

REPLY_OK = "ok"
REPLY_ERROR = "error"
REPLY_STALE = "stale"
"""The function raised `treadle.revisions.StaleWrite`: ``(REPLY_STALE, current, message)``."""

_PR_SET_PDEATHSIG = 1
"""``prctl`` option (Linux): the signal this process gets when its parent thread ends."""


def resolve(module: str, qualname: str) -> Any:
    """The function named ``module:qualname`` (the function of a `treadle.Tool` found there).

    Raises:
        ImportError, AttributeError: it cannot be found.
    """
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    inner = getattr(found, "fn", None)
    if inner is not None and callable(inner):
        return inner
    return found


def _call(request: dict[str, Any]) -> Any:
    fn = resolve(request["module"], request["qualname"])
    kwargs = request["kwargs"]
    if inspect.iscoroutinefunction(fn):
        import functools

        import trio

        return trio.run(functools.partial(fn, **kwargs))
    return fn(**kwargs)


def _reply_of(request: bytes) -> bytes:
    try:
        value = _call(pickle.loads(request))
    except Exception as exc:
        from treadle._exceptions import EnvironmentFailure, raised
        from treadle.revisions import StaleWrite

        stale = raised(exc, StaleWrite)
        if stale is not None:
            return pickle.dumps((REPLY_STALE, stale.current, stale.message))
        failure = raised(exc, EnvironmentFailure) is not None
        return pickle.dumps((REPLY_ERROR, type(exc).__name__, str(exc), failure))
    try:
        return pickle.dumps((REPLY_OK, value))
    except Exception as exc:
        text = f"the result could not be sent back from the tool's process: {exc}"
        return pickle.dumps((REPLY_ERROR, type(exc).__name__, text, False))


def main() -> None:
    """Keep the call: fork its worker, and kill the call's process group if the parent dies.

    ``sys.argv[1]`` is the lifeline's file descriptor; stdin holds the request; the reply goes
    to the original stdout, written by the worker.
    """
    lifeline = int(sys.argv[1])
    reply_fd = os.dup(1)  # not inherited across exec
    os.dup2(2, 1)  # the function's prints must not mix with the reply
    sys.stdout = sys.stderr
    request = sys.stdin.buffer.read()
    keeper = os.getpid()
    worker = os.fork()
    if worker == 0:
        os.close(lifeline)
        _work(keeper, request, reply_fd)
        return
    os.close(reply_fd)
    threading.Thread(target=_watch, args=(lifeline,), daemon=True).start()
    _, status = os.waitpid(worker, 0)
    _exit_as(status)


def _work(keeper: int, request: bytes, reply_fd: int) -> None:
    """The worker: run the call and write its reply; it ends as a Python process does."""
    _die_with(keeper)

    def close_reply() -> None:  # in a process the tool forks: it must not hold the reply
        with contextlib.suppress(OSError):
            os.close(reply_fd)

    os.register_at_fork(after_in_child=close_reply)
    data = _reply_of(request)
    with os.fdopen(reply_fd, "wb") as out:
        out.write(data)


def _die_with(keeper: int) -> None:
    """On Linux, have the kernel kill this process when its keeper ends (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the keeper's group kill covers it
        return
    if os.getppid() != keeper:  # the keeper ended before the signal was armed
        os._exit(1)


def _watch(lifeline: int) -> None:
    """Wait for the lifeline's end of file (the parent is gone), then kill the call's group."""
    try:
        while os.read(lifeline, 4096):
            pass
    except OSError:
        traceback.print_exc()
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _exit_as(status: int) -> NoReturn:
    """End the keeper as its worker ended (``status`` from `os.waitpid`)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal that does not end a process
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
