"""The tool host: where tool calls run, outside the nursery of the run that made them.

See docs/decisions/0025-tool-host.md and docs/concepts.md, "Tools and cancellation".

A run waits for a tool call; it does not contain it. The call runs as a task of the host (one
per trio run, a system task holding a nursery, started on first use), and the run's tool
executor waits for it with a cancellable wait. When the run gives up on the call (a cancel
after its grace period, the time budget, the call's timeout) it cancels the call and stops
waiting: the run ends on time whatever the call does (a shielded cleanup, a thread that
cannot be interrupted), and the straggler finishes in the host. What it returns then is
reported as a diagnostic only (a warning on the ``treadle.tools`` logger, a live warning event
of the run while the run lasts, `HostStatistics`), never as a result. A call sees the context
variables of the task that started it, as a task it spawned would (a fleet worker's drive
reaches a child-run tool that way: docs/child-runs.md, "In a fleet").

The host's nursery ends with the trio run: it is cancelled when the main task returns, and
`trio.run` waits for the calls still in it.
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeAlias, TypeVar

import attrs
import outcome
import trio

from treadle._exceptions import StrayCancellation, only_cancelled, raised

T = TypeVar("T")

LOG = logging.getLogger("treadle.tools")


@attrs.define(kw_only=True)
class HostStatistics:
    """Counters of a tool host (all since it started).

    Attributes:
        calls: calls started in the host.
        running: calls that have not ended yet (abandoned ones included).
        abandoned: calls whose run stopped waiting for them before they ended.
        late_returns: abandoned calls, and stray threads, that ended afterwards (their
            outcome went to diagnostics only).
        stray_threads: worker threads still running that their call left behind when it
            gave up on them (a plain ``def`` tool past its timeout): Python cannot stop a
            thread, so it runs until the function returns, holding its place among the tool
            threads (`treadle.tools.TOOL_THREADS`) until then.
    """

    calls: int = 0
    running: int = 0
    abandoned: int = 0
    late_returns: int = 0
    stray_threads: int = 0


def cancelled_here() -> bool:
    """Whether the current task is in a cancelled scope (its cancellation is due here).

    A `trio.Cancelled` raised where this is false belongs to no scope around the code that
    sees it: a cancellation caught earlier, in a scope since left, and raised again.
    """
    return trio.current_effective_deadline() == -math.inf


class _Done:
    """Set once when a call ends; its waiters are woken (a light `trio.Event`)."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[trio.lowlevel.Task] = []

    def is_set(self) -> bool:
        return self._set

    @trio.lowlevel.enable_ki_protection
    def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, []
        for task in waiters:
            trio.lowlevel.reschedule(task)

    @trio.lowlevel.enable_ki_protection
    async def wait(self) -> None:
        if self._set:
            await trio.lowlevel.checkpoint()
            return
        task = trio.lowlevel.current_task()
        self._waiters.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiters.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class HostedCall(Generic[T]):
    """One call running in a `ToolHost`; the run waits on it with `wait`.

    Attributes:
        description: what the call is (for diagnostics), e.g. ``"run r, call a1 (sleep)"``.
    """

    def __init__(
        self, description: str, on_late: Callable[[str], None] | None, stats: HostStatistics
    ) -> None:
        self.description = description
        self._stats = stats
        self._scope = trio.CancelScope()
        self._done = _Done()
        self._result: outcome.Outcome[T] | None = None
        self._abandoned = False
        self._left_running = False
        self._on_late = on_late
        self._started = 0.0
        self._context = contextvars.copy_context()  # the caller's, seen by the call

    @property
    def done(self) -> bool:
        """Whether the call has ended (returned, raised or honoured its cancellation)."""
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait until the call ends (a checkpoint; cancelling the wait leaves the call running)."""
        await self._done.wait()

    def result(self) -> outcome.Outcome[T] | None:
        """The call's outcome once it ended; ``None`` when it is running or was cancelled."""
        return self._result

    @property
    def left_running(self) -> bool:
        """Whether the call gave up on a worker thread that still ran (`leave_thread`).

        Such a call ended, yet part of it runs on: its result is ``late``
        (`treadle.types.ActionResult`).
        """
        return self._left_running

    def cancel(self) -> None:
        """Deliver a trio cancellation to the call (it may shield itself from it)."""
        self._scope.cancel()

    def abandon(self) -> None:
        """Stop caring about the call: cancel it; whatever it returns later is a diagnostic."""
        self._scope.cancel()
        if not self._done.is_set() and not self._abandoned:
            self._abandoned = True
            self._stats.abandoned += 1

    # Protected from Ctrl-C as the host's own system task is: a signal landing in a call is
    # delivered to the trio run's main task instead; raised here, it would escape into the
    # system task and end the trio run with a TrioInternalError.
    @trio.lowlevel.enable_ki_protection
    async def _run(self, fn: Callable[[], Awaitable[T]]) -> None:
        self._started = trio.current_time()
        for variable, value in self._context.items():  # as if the caller had spawned it
            variable.set(value)
        _CALL.set(self)
        try:
            with self._scope:
                try:
                    self._result = outcome.Value(await fn())
                except BaseException as exc:
                    if only_cancelled(exc) and cancelled_here():
                        # The call's own scope takes it (cancelled: no result), also from
                        # a nursery of the call's, or it is the host's end.
                        raise
                    if raised(exc, trio.Cancelled) is not None and not cancelled_here():
                        # Nothing cancelled the call: a cancellation the call caught earlier
                        # and raised again. Raised on, it would end the host; returned as
                        # is, it would pass for the waiting run's own cancellation.
                        exc = self._stray(exc)
                    # The run waiting on the call raises it (an abandoned call's is reported).
                    # Any other BaseException too (asyncio's CancelledError from a bridged
                    # call, GeneratorExit, a subclass of the caller's): raised in this system
                    # task it would end the trio run with TrioInternalError.
                    self._result = outcome.Error(exc)
        finally:
            self._stats.running -= 1
            self._done.set()
            if self._abandoned:
                self._report_late()

    def _stray(self, exc: BaseException) -> StrayCancellation:
        stray = StrayCancellation(
            f"{self.description} raised a trio.Cancelled that no cancel scope of its own "
            "took (one caught earlier and raised again)"
        )
        stray.__cause__ = exc
        return stray

    def _report_late(self) -> None:
        self._stats.late_returns += 1
        took = trio.current_time() - self._started
        _report_late(self.description, took, self._result, self._on_late)


def _report_late(
    description: str,
    took: float,
    found: outcome.Outcome[Any] | None,
    on_late: Callable[[str], None] | None,
) -> None:
    """Report what an abandoned call (or its stray thread) did after ``took`` seconds."""
    if isinstance(found, outcome.Value):
        observation = getattr(found.value, "observation", None)  # an ActionOutcome
        shown = observation if isinstance(observation, str) else found.value
        what = f"returned {shown!r:.200}"
    elif isinstance(found, outcome.Error):
        what = f"raised {type(found.error).__name__}: {found.error}"
    else:
        what = "was cancelled"
    text = f"{description} ended {took:.3f} s after it started, abandoned: it {what}"
    if found is None:  # it honoured the cancellation, later: nothing it did is lost
        LOG.debug("%s", text)
        return
    LOG.warning("%s (not recorded: the call already has its result)", text)
    if on_late is not None:
        try:
            on_late(text)
        except Exception:  # a diagnostic must never fail the host
            LOG.exception("reporting a late tool return failed")


class StrayThread:
    """A worker thread that the current call left running (`leave_thread`).

    Counted in `HostStatistics.stray_threads` until it ends; what it returns then is
    reported as an abandoned call's late return is (docs/decisions/0025-tool-host.md).
    """

    def __init__(self, stats: HostStatistics, call: HostedCall[Any] | None, what: str) -> None:
        self._stats = stats
        self._token = trio.lowlevel.current_trio_token()
        self._description = what if call is None else call.description
        self._on_late = None if call is None else call._on_late
        self._started = trio.current_time() if call is None else call._started
        if call is not None:
            call._left_running = True
        stats.stray_threads += 1

    def ended(self, found: outcome.Outcome[Any]) -> None:
        """Report the thread's end (from any thread; never blocks)."""
        try:
            self._token.run_sync_soon(self._report, found)
        except trio.RunFinishedError:  # the trio run is over: its host's counters with it
            LOG.warning("%s ended in its worker thread after its trio run", self._description)

    def _report(self, found: outcome.Outcome[Any]) -> None:
        self._stats.stray_threads -= 1
        self._stats.late_returns += 1
        took = trio.current_time() - self._started
        _report_late(self._description, took, found, self._on_late)


def leave_thread(what: str) -> StrayThread:
    """Count a worker thread the current call gives up on while it runs (in trio's thread).

    Args:
        what: names the call in diagnostics when it does not run in the host (its own
            description is used when it does).
    """
    return StrayThread(current_host().stats, _CALL.get(), what)


_Queued: TypeAlias = tuple[HostedCall[Any], Callable[[], Awaitable[Any]]]


class ToolHost:
    """Runs tool calls in a nursery that outlives the runs waiting on them."""

    def __init__(self) -> None:
        send, recv = trio.open_memory_channel[_Queued](math.inf)
        self._send = send
        self._recv = recv
        self._nursery: trio.Nursery | None = None
        self.stats = HostStatistics()
        """This host's counters (`host_statistics` gives a copy)."""

    def start(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        description: str,
        on_late: Callable[[str], None] | None = None,
    ) -> HostedCall[T]:
        """Start ``fn()`` in the host and return the call to wait on (never blocks).

        Args:
            fn: the call, e.g. ``functools.partial(executor.execute, action)``.
            description: names the call in diagnostics.
            on_late: called with a sentence when an abandoned call ends.
        """
        call: HostedCall[T] = HostedCall(description, on_late, self.stats)
        self.stats.calls += 1
        self.stats.running += 1
        if self._nursery is not None:  # serving: straight into its nursery (no hand-off)
            self._nursery.start_soon(call._run, fn)
        else:
            self._send.send_nowait((call, fn))
        return call

    async def serve(self) -> None:
        """Run the calls handed to `start` until cancelled (the end of the trio run)."""
        async with trio.open_nursery() as nursery:
            try:
                for call, fn in _drain(self._recv):  # handed over before it served
                    nursery.start_soon(call._run, fn)
                self._nursery = nursery
                await trio.sleep_forever()
            finally:
                self._nursery = None


def _drain(queued: trio.MemoryReceiveChannel[_Queued]) -> list[_Queued]:
    drained: list[_Queued] = []
    while True:
        try:
            drained.append(queued.receive_nowait())
        except trio.WouldBlock:
            return drained


_CURRENT: trio.lowlevel.RunVar[ToolHost] = trio.lowlevel.RunVar("treadle_tool_host")
_CALL: contextvars.ContextVar[HostedCall[Any] | None] = contextvars.ContextVar(
    "treadle_hosted_call", default=None
)
"""The hosted call the current task runs (in the call's own task only)."""


def current_host() -> ToolHost:
    """The tool host of the current trio run, started on first use (a system task)."""
    try:
        return _CURRENT.get()
    except LookupError:
        pass
    host = ToolHost()
    _CURRENT.set(host)
    trio.lowlevel.spawn_system_task(host.serve, name="treadle tool host")
    return host


def host_statistics() -> HostStatistics:
    """The counters of the current trio run's tool host (a copy; all zero before its first call).

    Kept with the host, not in the process: each trio run has its own.
    """
    try:
        return attrs.evolve(_CURRENT.get().stats)
    except LookupError:
        return HostStatistics()
