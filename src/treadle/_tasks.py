"""Starting trio tasks so that a Ctrl-C cannot strand them (docs/crash-safety.md, item 8).

trio (0.35) moves a task between its bookkeeping sets in plain Python inside
`trio.Nursery.start_soon`, `trio.Nursery.start` and `trio.TaskStatus.started`, and does not
protect those calls from `KeyboardInterrupt` as it protects its channels, events and cancel
scopes. A SIGINT that lands halfway through one of them, in a task that is not protected,
raises there and leaves the bookkeeping half done. Seen with 60 runs starting at once: the
interrupt struck inside ``started()`` after the new actor had moved to its nursery but before
the temporary nursery of ``start()`` was told it had no children left, so ``start()`` never
returned, the run's nursery never ended, the interrupt sat in it unseen, and the process went
on driving its other runs as if no Ctrl-C had come.

The functions here make those calls from a protected frame. A signal that lands inside one of
them is delivered to the trio run's main task instead (trio's rule for its own protected
code), which ends the runs as any Ctrl-C does. Only the call itself is protected: the task it
starts runs unprotected, as it would have.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


@trio.lowlevel.enable_ki_protection
def start_soon(
    nursery: trio.Nursery, fn: Callable[..., Awaitable[object]], *args: object, name: object = None
) -> None:
    """``nursery.start_soon(fn, *args, name=name)``, protected from Ctrl-C.

    Raises:
        RuntimeError: ``nursery`` is closed (as `trio.Nursery.start_soon` raises).
    """
    nursery.start_soon(fn, *args, name=name)


@trio.lowlevel.enable_ki_protection
async def start(
    nursery: trio.Nursery, fn: Callable[..., Awaitable[object]], *args: object, name: object = None
) -> Any:
    """``await nursery.start(fn, *args, name=name)``, protected from Ctrl-C; what it returns.

    Raises:
        RuntimeError: ``nursery`` is closed, or ``fn`` returned without reporting its start.
        BaseException: whatever ``fn`` raised before it reported its start.
    """
    return await nursery.start(fn, *args, name=name)


@trio.lowlevel.enable_ki_protection
def started(task_status: trio.TaskStatus[T], value: T | None = None) -> None:
    """``task_status.started(value)``, protected from Ctrl-C.

    Raises:
        RuntimeError: ``task_status`` reported its start already.
    """
    task_status.started(value)  # type: ignore[arg-type]
