"""The check that treadle's trio API is called from trio.

docs/asyncio.md, "Calling treadle from asyncio" says what to do instead.

Called from asyncio, a trio function fails deep inside trio with ``RuntimeError: Task got
bad yield: ... CancelShieldedCheckpoint``. The public entry points (`treadle.open_run`,
`treadle.open_fleet`, the store openers ...) call `require_trio` first, which costs one
thread-local lookup, and raise an error that names the bridge instead.
"""

from __future__ import annotations

import trio

from treadle._exceptions import UsageError


def require_trio(api: str) -> None:
    """Raise `UsageError` naming ``treadle.asyncio`` unless called inside a trio task.

    Raises:
        UsageError: the caller is not a trio task (an asyncio task, say).
    """
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        raise UsageError(
            f"{api} runs on trio, and it was called from {_library()}: an asyncio "
            "application reaches treadle through the bridge treadle.asyncio "
            "(treadle.asyncio.open_runs or open_portal; see docs/asyncio.md)"
        ) from None


def _library() -> str:
    try:
        import sniffio

        return sniffio.current_async_library()
    except Exception:  # sniffio cannot tell: no async library it knows runs this call
        return "outside any trio task"


def in_run_of(token: trio.lowlevel.TrioToken) -> bool:
    """Whether the caller runs in the trio run ``token`` belongs to (in that run's thread).

    ``False`` in a thread of no trio run (a plain thread, an asyncio loop's) and in another
    trio run's thread: neither may touch that run's trio objects (events, channels).
    """
    try:
        return trio.lowlevel.current_trio_token() is token
    except RuntimeError:
        return False
