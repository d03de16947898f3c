"""The per-attempt usage and deadline context the model gateway sets for a model client.

Kept apart from the HTTP transport so that the runtime (the gateway) loads without httpx:
a run whose model client is not an HTTP client never imports it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from treadle.types import ImageRef, Usage

ImageSource = Callable[[ImageRef], bytes]
"""Resolves a ``ref:<name>`` image to its bytes; raises `LookupError` or `OSError` if missing."""

UsageObserver = Callable[[Usage], None]
"""Receives the usage reported so far in the current attempt (running counts, tokens).

It may raise `treadle.ModelCallError` to end the attempt (the model gateway does so when the
reported usage crosses the run's remaining token budget); clients let that error propagate.
"""

_usage_observer: contextvars.ContextVar[UsageObserver | None] = contextvars.ContextVar(
    "treadle_usage_observer", default=None
)


@contextlib.contextmanager
def observe_usage(observer: UsageObserver) -> Iterator[None]:
    """Route `report_usage` calls made by the current task to ``observer`` inside the block.

    The model gateway wraps each attempt in this block, so a client needs no extra argument
    (the `treadle.ports.ModelClient` seam is unchanged).
    """
    token = _usage_observer.set(observer)
    try:
        yield
    finally:
        _usage_observer.reset(token)


_attempt_deadlines: contextvars.ContextVar[tuple[float, float, float] | None] = (
    contextvars.ContextVar("treadle_attempt_deadlines", default=None)
)


@contextlib.contextmanager
def attempt_deadlines(*, connect_s: float, first_byte_s: float, idle_s: float) -> Iterator[None]:
    """Tighten the connect, first-byte and stream-idle deadlines of attempts made in the block.

    A client applies the smaller of these and its own settings (seconds). The model gateway
    sets them from the agent's `treadle.types.Limits` for each attempt.
    """
    token = _attempt_deadlines.set((connect_s, first_byte_s, idle_s))
    try:
        yield
    finally:
        _attempt_deadlines.reset(token)


def current_deadlines() -> tuple[float, float, float] | None:
    """``(connect_s, first_byte_s, idle_s)`` set by `attempt_deadlines`, or ``None``."""
    return _attempt_deadlines.get()


def report_usage(usage: Usage) -> None:
    """Report the usage the server has reported so far in this attempt.

    A client calls this each time the server reports (running or final) usage. Without an
    observer (outside a gateway attempt) it does nothing.

    Raises:
        treadle.ModelCallError: the observer ended the attempt (e.g. kind ``token_budget``).
    """
    observer = _usage_observer.get()
    if observer is not None:
        observer(usage)


_run_images: contextvars.ContextVar[ImageSource | None] = contextvars.ContextVar(
    "treadle_run_images", default=None
)


@contextlib.contextmanager
def run_images(source: ImageSource | None) -> Iterator[None]:
    """Make ``source`` the run's own image source for attempts made in the block.

    The model gateway sets the agent's executor's ``image_source`` here (an MCP session's
    images, docs/models.md, "Images returned by tools"); a client resolves a ``ref:`` image
    through its own ``image_source`` first and through this one when that does not hold it.
    ``None`` leaves the run without one.
    """
    token = _run_images.set(source)
    try:
        yield
    finally:
        _run_images.reset(token)


def current_image_source() -> ImageSource | None:
    """The run's image source set by `run_images`, or ``None``."""
    return _run_images.get()
