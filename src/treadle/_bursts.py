"""Taking a burst of queued items from a trio memory channel in one scheduler pass.

A fast model stream hands the event writer's readers (sinks, `RunHandle.events`
subscribers) a hundred deltas per pass. A reader that took one item per ``receive`` (each a
scheduler pass) would see its bounded buffer overflow while keeping up; taking what the
buffer holds already, without a pass for each, keeps it drained
(docs/events.md, "Sinks and subscribers never stall a run").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import trio

T = TypeVar("T")


def and_buffered(first: T, channel: trio.MemoryReceiveChannel[T]) -> Iterator[T]:
    """``first``, then what ``channel`` holds already, without a scheduler pass for each.

    The burst is bounded by the channel's buffer; it ends at the first empty read, or when
    the channel is closed.
    """
    yield first
    while True:
        try:
            yield channel.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return
