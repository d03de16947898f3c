"""Starting treadle's tasks so that a Ctrl-C cannot tear them (docs/crash-safety.md, item 8).

trio delivers a SIGINT by raising `KeyboardInterrupt` wherever the main thread happens to be,
unless that code is protected (trio's own internals, its system tasks), in which case it
delivers the interrupt to the trio run's main task at its next wait. An interrupt raised in
the middle of bookkeeping that is not protected leaves it half done. Two such places were
seen with 60 runs starting and stepping at once:

* inside trio's `trio.TaskStatus.started` (trio 0.35 protects neither it nor
  `trio.Nursery.start` and `trio.Nursery.start_soon`): the new actor had moved to its nursery
  but the temporary nursery of ``start()`` was never told it had no children left, so
  ``start()`` never returned, the run's nursery never ended, the interrupt sat in it unseen,
  and the process went on driving its other runs as if no Ctrl-C had come;
* between leaving a step's bound cancel scope in treadle's own bookkeeping and leaving the
  trio cancel scope under it, so trio found its cancel scope stack corrupted.

So treadle's own tasks run protected, as trio's system tasks do: the actors' ``run`` methods,
the drive of a run, the lease renewal, the control reading, the fleet's claims and runs (each
marked with `trio.lowlevel.enable_ki_protection`, which costs nothing per call), and the
calls that start tasks (the functions here). A Ctrl-C is then delivered to the main task,
whose nursery cancels the runs, and a run stops at its next checkpoint, unfinished and
resumable. What those tasks call (a model client, a sink, a hook) runs protected too: it is
stopped by the cancellation that follows, not by an interrupt raised in the middle of it.
Code that never reaches a checkpoint cannot be interrupted (a tight loop in a model client,
say). An actor a user supplies runs as its author wrote it.
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
