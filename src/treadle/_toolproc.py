"""Running one tool call in a child process (``@tool(isolation="process")``).

See docs/concepts.md, "Tools and cancellation".

The parent starts ``python -m treadle._toolproc`` with its ``sys.path`` as ``PYTHONPATH`` and
writes one pickled request to its stdin: the tool function's module and qualified name (it is
imported in the child, so it must be importable) and the validated arguments. The child runs
the function (an ``async def`` one under its own `trio.run`) and writes one pickled reply to
what was its stdout; the function's own prints go to stderr. The parent kills the child
(SIGKILL) when the call is cancelled or times out.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import sys
from typing import Any

REPLY_OK = "ok"
REPLY_ERROR = "error"
REPLY_STALE = "stale"
"""The function raised `treadle.revisions.StaleWrite`: ``(REPLY_STALE, current, message)``."""


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


def _reply_of(request: dict[str, Any]) -> bytes:
    try:
        value = _call(request)
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
    """Read one request from stdin, run it, write one reply to the original stdout."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # the function's prints must not mix with the reply
    sys.stdout = sys.stderr
    request = pickle.loads(sys.stdin.buffer.read())
    data = _reply_of(request)
    with os.fdopen(reply_fd, "wb") as out:
        out.write(data)


if __name__ == "__main__":
    main()
