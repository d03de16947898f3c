"""The asyncio bridge: run treadle from an asyncio application (docs/asyncio.md).

treadle runs on trio. An asyncio program (FastAPI on uvicorn, say) runs it in a thread of its
own, reached through a portal (docs/decisions/0075-asyncio-bridge-trio-thread.md):

* `open_portal` starts trio in a daemon thread for the duration of an ``async with`` block;
  `TrioPortal.call` runs a trio async function there and awaits its result from asyncio,
  and `TrioPortal.iterate` iterates a trio async iterator from asyncio;
* `open_runs` builds on it: a store opened inside trio and an asyncio face, `Runs`, to start
  (or resume) runs, stream their events, approve, cancel and wait for results.

Nothing of trio is touched from the asyncio thread: every call crosses by
``TrioToken.run_sync_soon`` one way and ``loop.call_soon_threadsafe`` the other. Values
crossing are treadle's frozen records (events, results, decisions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, TypeVar

import attrs
import trio

from treadle._exceptions import RunLeased, TreadleError, UsageError, only_cancelled
from treadle._ids import check_run_id, new_run_id
from treadle._text import read_count, valid_unicode
from treadle._toolhost import cancelled_here
from treadle.actors import resume_from, stored_events
from treadle.agent import Agent, RunInput, check_input
from treadle.approvals import check_cancel_text, decide, request_cancel
from treadle.metrics import MetricsRecorder
from treadle.ports import EventSink, RunIndex, RunStore
from treadle.stores import LEASE_TTL_S, event_to_dict
from treadle.supervisors import PARK_AFTER_S, RunHandle, open_run, wait_result
from treadle.types import ApprovalDecided, Event, EventKind, Liveness, RunResult, RunState

T = TypeVar("T")

ITERATE_BUFFER: Final = 64
"""Items a trio iterator may run ahead of its asyncio consumer before it waits."""

DRAIN_S: Final = 10.0
"""Seconds `open_runs` gives its runs to reach a safe point when the block ends."""

_LOG = logging.getLogger("treadle.asyncio")

_LEFT = (
    "the call was cancelled in trio: its treadle.asyncio block was left "
    '(docs/asyncio.md, "What crosses the threads")'
)

_STOPS = (
    "the treadle.asyncio trio thread is stopped by an exception raised in it (a "
    "KeyboardInterrupt or SystemExit, as a trio run is; leaving the block raises it) "
    '(docs/asyncio.md, "What crosses the threads")'
)
"""Why a call is refused or cut while its block is open: the trio thread ends."""


class TrioPortal:
    """A trio run in its own thread, reached from one asyncio event loop; made by `open_portal`.

    Every method is awaited in the asyncio loop that opened it; awaited in another one it
    raises `UsageError` before anything crosses to trio.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        token: trio.lowlevel.TrioToken,
        nursery: trio.Nursery,
    ) -> None:
        self._loop = loop
        self._token = token
        self._nursery = nursery
        self._closing = trio.Event()
        self._closed = False
        # Set in the asyncio thread before the request that leaves the block crosses. A call
        # refused or cut in trio while it is unset was cut because the trio thread stops.
        self._leaving = False
        self._pending: set[asyncio.Future[Any]] = set()

    def _check_loop(self) -> None:
        """Refuse a call awaited outside the asyncio loop that opened the portal.

        A future of that loop cannot be awaited in another one: the call would have
        crossed to trio, and acted, before the await failed (docs/asyncio.md, "What crosses
        the threads").

        Raises:
            UsageError: the caller runs in another event loop (a second thread's
                ``asyncio.run``, say), or in none.
        """
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise UsageError(
                "a treadle.asyncio call is awaited in the asyncio loop that opened its block, "
                f"and this one was awaited {'in another loop' if running else 'outside it'}: "
                "from another thread, hand it to that loop "
                "(asyncio.run_coroutine_threadsafe(runs.start(...), loop)); nothing was done "
                '(docs/asyncio.md, "What crosses the threads")'
            )

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        """In the asyncio thread: have the trio thread call ``fn(*args)`` soon.

        Raises:
            UsageError: the block was left (the portal is closed), or the trio thread ended
                on an exception of its own.
        """
        if self._closed and self._leaving:
            raise UsageError("the treadle.asyncio portal is closed (docs/asyncio.md)")
        if self._closed:  # the trio thread ended by itself (`_abandon`)
            raise UsageError(f"the call is refused: {_STOPS}")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise UsageError(f"the call is refused: {_STOPS}") from None

    def _spawn(
        self,
        nursery: trio.Nursery,
        fn: Callable[[], Awaitable[None]],
        name: str,
        refused: Callable[[], object],
    ) -> None:
        """In the trio thread: start ``fn`` in ``nursery``, or call ``refused``.

        A nursery refuses new tasks once it is closing (the portal's when a call raised
        `SystemExit` and the thread is ending before the portal was closed; the calls
        nursery of `open_runs` once its store is closing): raised here, in a callback of the
        run, that refusal would end it with `trio.TrioInternalError`.
        """
        try:
            nursery.start_soon(fn, name=name)
        except RuntimeError:
            refused()

    def _ended(self) -> str:
        """Why a call was refused or cut in trio (or left waiting as the thread ended)."""
        return _LEFT if self._leaving else f"the call was cancelled in trio: {_STOPS}"

    def _reply(self, fn: Callable[..., object], *args: object) -> None:
        """In the trio thread: run ``fn(*args)`` in the asyncio loop (if it still runs)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(fn, *args)

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the trio thread and return (or raise) what it did.

        Raises:
            BaseException: whatever ``fn`` raised, unchanged, a `trio.Cancelled` that no
                cancel scope around the call cancelled included (one caught earlier and
                raised again). A `KeyboardInterrupt` or `SystemExit` also ends the portal's
                trio thread (as it ends a trio run); any other exception ends only the call.
            UsageError: the portal is closed, or closed while the call ran (the call was
                cancelled in trio); or the call is awaited in another event loop than the
                one that opened the portal (nothing crossed to trio).

        Cancellation:
            Cancelling the awaiting asyncio task cancels the call in trio (a trio
            cancellation at its next checkpoint) and does not wait for it to end.
        """
        return await self._call_in(self._nursery, fn, *args)

    async def _call_in(
        self, nursery: trio.Nursery, fn: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        """`call`, run as a task of ``nursery`` (the portal's, or one inside it).

        A call its nursery refuses (closing) or cancels fails with `UsageError`, as does
        one awaited in another event loop (`_check_loop`, before anything crosses).
        """
        self._check_loop()
        future: asyncio.Future[T] = self._loop.create_future()
        scope = trio.CancelScope()

        async def task() -> None:
            outcome: tuple[Any, BaseException | None] | None = None
            try:
                with scope:
                    outcome = (await fn(*args), None)
            except BaseException as exc:
                if only_cancelled(exc) and cancelled_here():
                    raise  # the portal closes (also out of fn's nursery): the caller is told so
                # The caller's, whatever it is: a library's own kind, or a trio.Cancelled
                # that nothing around the call cancelled (one caught earlier and raised
                # again), which raised on would end every call and run of the portal.
                outcome = (None, exc)
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise  # it also ends the trio thread, as it ends a trio run
            finally:
                self._reply(_settle, future, outcome, self._ended())

        # Not repr(fn) as a getattr default (always evaluated): the repr of a bound method of
        # an attrs object holds the whole object, every run a host drives included.
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        self._soon(
            self._spawn,
            nursery,
            task,
            name,
            lambda: self._reply(_settle, future, None, self._ended()),
        )
        # Only a call that crossed waits for the trio thread (`_abandon` fails it if that
        # ends first); the answer cannot come before this: it comes by the loop.
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        try:
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(UsageError):
                self._soon(scope.cancel)
            raise

    def iterate(
        self, fn: Callable[..., AsyncIterator[T]], *args: Any, buffer: int = ITERATE_BUFFER
    ) -> AsyncIterator[T]:
        """Iterate ``fn(*args)`` (a trio async iterator) from asyncio.

        The trio side runs up to ``buffer`` items ahead and then waits for the consumer.

        Raises:
            BaseException: whatever the trio iterator raised, after the items before it,
                unchanged (a stray `trio.Cancelled` included, as in `call`); as in `call`,
                only a `KeyboardInterrupt` or `SystemExit` also ends the portal's trio thread.
            UsageError: the portal is closed, or the iteration runs in another event loop
                than the one that opened the portal (nothing crossed to trio).

        Resource handling:
            Leaving the loop early (break, an error, cancellation) cancels the trio
            iterator.
        """
        return self._iterate_in(self._nursery, fn, *args, buffer=buffer)

    async def _iterate_in(
        self,
        nursery: trio.Nursery,
        fn: Callable[..., AsyncIterator[T]],
        *args: Any,
        buffer: int = ITERATE_BUFFER,
    ) -> AsyncIterator[T]:
        """`iterate`, the trio iterator run by a task of ``nursery``.

        The iteration ends (after the items sent before) when ``nursery`` cancels that task;
        it raises `UsageError` when ``nursery`` refuses it (closing), or at once when it is
        iterated in another event loop (`_check_loop`).
        """
        self._check_loop()
        send, receive = trio.open_memory_channel[tuple[Any, BaseException | None]](buffer)
        scope = trio.CancelScope()
        refused: str | None = None

        def refuse() -> None:
            nonlocal refused
            refused = self._ended()
            send.close()

        async def pump() -> None:
            with scope, send:
                try:
                    async with _closing(fn(*args)) as items:
                        async for item in items:
                            await send.send((item, None))
                except BaseException as exc:
                    if only_cancelled(exc) and cancelled_here():
                        raise  # the consumer left, or the portal closes
                    # The consumer's, whatever it is, as in `call`; the send itself raises
                    # the cancellation of an iteration cancelled meanwhile (the consumer
                    # left, or the portal closes).
                    await send.send((None, exc))
                    if isinstance(exc, KeyboardInterrupt | SystemExit):
                        raise  # it also ends the trio thread, as it ends a trio run

        self._soon(self._spawn, nursery, pump, "pump", refuse)
        try:
            while True:
                got = await self.call(_next, receive)
                if got is None:
                    if refused is not None:  # seen by this thread once the channel's end crossed
                        raise UsageError(refused)
                    return
                item, error = got
                if error is not None:
                    raise error
                yield item
        finally:
            with contextlib.suppress(UsageError):
                self._soon(scope.cancel)
                self._soon(receive.close)

    def _abandon(self) -> None:
        """In the asyncio loop, once the trio thread ended: fail the calls still waiting."""
        self._closed = True
        for future in list(self._pending):
            _settle(future, None, self._ended())

    def _close(self) -> None:
        self._leaving = True
        if not self._closed:
            with contextlib.suppress(UsageError):  # the thread stopped: nothing to close
                self._soon(self._closing.set)
            self._closed = True


@asynccontextmanager
async def _closing(items: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """``items``, closed at the end when it can be (an async generator can)."""
    try:
        yield items
    finally:
        close = getattr(items, "aclose", None)
        if close is not None:
            await close()


async def _next(
    receive: trio.MemoryReceiveChannel[tuple[Any, BaseException | None]],
) -> tuple[Any, BaseException | None] | None:
    try:
        return await receive.receive()
    except trio.EndOfChannel:
        return None


def _settle(
    future: asyncio.Future[Any], outcome: tuple[Any, BaseException | None] | None, ended: str
) -> None:
    """In the asyncio loop: hand ``outcome`` to ``future`` unless its waiter gave up.

    ``None`` (the call was refused or cut in trio) fails it with `UsageError` saying
    ``ended``, why (`TrioPortal._ended`).
    """
    if future.done():
        return
    if outcome is None:
        future.set_exception(UsageError(ended))
    elif outcome[1] is not None:
        future.set_exception(outcome[1])
    else:
        future.set_result(outcome[0])


@asynccontextmanager
async def open_portal() -> AsyncIterator[TrioPortal]:
    """Run trio in a daemon thread for the duration of the block (from asyncio).

    Yields:
        The portal. Leaving the block cancels whatever still runs in it (a trio
        cancellation) and waits for the trio thread to end.

    Raises:
        BaseException: what the trio thread itself failed with (never a call's error:
            those go to the call's caller).
    """
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[TrioPortal] = loop.create_future()
    done: asyncio.Future[None] = loop.create_future()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            portal = TrioPortal(loop, trio.lowlevel.current_trio_token(), nursery)
            loop.call_soon_threadsafe(_resolve, ready, portal)
            await portal._closing.wait()
            nursery.cancel_scope.cancel()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail, done, _exit_of(exc))
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, done, None)

    threading.Thread(target=thread, name="treadle-trio", daemon=True).start()
    await asyncio.wait((ready, done), return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        await done  # raises what trio failed with
        raise UsageError("the trio thread of the treadle.asyncio portal ended at once")
    portal = ready.result()
    done.add_done_callback(lambda _: portal._abandon())
    try:
        yield portal
    finally:
        portal._close()
        await asyncio.shield(done)


def _exit_of(exc: BaseException) -> BaseException:
    """The `KeyboardInterrupt` or `SystemExit` that ended the trio thread, out of its group.

    The portal's nursery wraps what ended it in an exception group; an exit alone leaves
    the block as itself, as it leaves a trio run (docs/asyncio.md, "The bridge"), so that
    ``except KeyboardInterrupt`` around the block catches it. A group holding other errors
    too is left as it is.
    """
    if isinstance(exc, BaseExceptionGroup):
        exits, rest = exc.split((KeyboardInterrupt, SystemExit))
        if exits is not None and rest is None:
            found: BaseException = exits
            while isinstance(found, BaseExceptionGroup):
                found = found.exceptions[0]
            return found
    return exc


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


StoreOpener = Callable[[], AbstractAsyncContextManager[RunStore]]
"""Opens the store inside trio, e.g. ``lambda: treadle.open_sqlite_store(path)``."""


@attrs.define(eq=False)
class _Host:
    """The trio side of `Runs`: the store, the runs driven here and their nurseries.

    Both nurseries live inside the store's block: ``nursery`` drives the runs, ``calls``
    runs every call of `Runs` (event streams included), so that none reads the store after
    it closed.
    """

    agent: Agent
    store: RunStore
    nursery: trio.Nursery
    calls: trio.Nursery
    options: Mapping[str, Any]
    handles: dict[str, RunHandle] = attrs.Factory(dict)
    stopped: dict[str, RunHandle] = attrs.Factory(dict)
    """Run id -> the handle of its drive here that stopped unfinished (an actor failed), until
    it is started here again: `result` raises its error rather than wait for another driver."""
    starting: dict[str, trio.Event] = attrs.Factory(dict)
    """Run id -> set once its start here ended (started or failed)."""
    closing: bool = False
    """The block is being left: no run is started any more, every run driven is drained."""

    async def start(self, input: RunInput | None, run_id: str | None) -> str:
        """Start (or resume) a run driven here: `Runs.start`.

        Raises:
            UsageError: neither ``input`` nor ``run_id`` was given (before an id is made
                up: a new run needs an input, only an existing one resumes without), and as
                `Runs.start`.
        """
        if input is None and run_id is None:
            raise UsageError(
                "a new run needs an input: start(input), or start(run_id=...) to resume an "
                'unfinished run (docs/asyncio.md, "The bridge")'
            )
        chosen = check_run_id(run_id) if run_id is not None else new_run_id()
        # A second start of a run being started here waits for the first, then finds it
        # driven (or starts it itself if the first failed): two drivers of one run in one
        # process would share its lease (docs/asyncio.md, "The bridge").
        while (pending := self.starting.get(chosen)) is not None:
            await pending.wait()
        # Cancelled (the calls end: the trio thread stops), the call ends as cancelled.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_taking(chosen)  # no checkpoint from here to the run's nursery taking it
        if chosen in self.handles:
            if input is not None:  # the same run again, not another input under its id
                await self._check_input(chosen, input)
            return chosen
        ended = self.starting[chosen] = trio.Event()
        try:
            started: str = await self.nursery.start(self._drive, input, chosen)
        finally:
            del self.starting[chosen]
            ended.set()
        return started

    def _check_taking(self, run_id: str) -> None:
        """Refuse to start ``run_id`` once the runs' nursery takes no more runs.

        It takes none once the block is being left, nor once a run ended it with an
        exception of its own (a tool's `KeyboardInterrupt` or `SystemExit`, which stop the
        trio thread: docs/asyncio.md, "What crosses the threads").

        Raises:
            UsageError: either.
        """
        if self.closing:
            raise UsageError(
                f"run {run_id!r} is not started: the treadle.asyncio block is being left "
                '(docs/asyncio.md, "The bridge")'
            )
        if self.nursery.cancel_scope.cancel_called:
            raise UsageError(f"run {run_id!r} is not started: {_STOPS}")

    async def _check_input(self, run_id: str, input: RunInput) -> None:
        """Refuse ``input`` when the run driven here was started on another one.

        As `treadle.open_run` refuses it for a run that is not driven here (docs/concepts.md,
        "Run ids"). Reads the run's log: this is the path of a repeated start only.

        Raises:
            UsageError: the input differs from the stored input.
        """
        started = (await self.store.read_log(run_id)).started
        if started is not None:
            check_input(started, input)

    async def _drive(
        self, input: RunInput | None, run_id: str, *, task_status: trio.TaskStatus[str]
    ) -> None:
        handle: RunHandle | None = None
        started = False
        try:
            async with open_run(
                self.agent, input, store=self.store, run_id=run_id, **self.options
            ) as handle:
                if handle.state is RunState.INTERRUPTED:  # it could not start (a mismatch)
                    await handle.wait()  # raises its error, to the caller of start
                self.handles[run_id] = handle
                self.stopped.pop(run_id, None)
                if self.closing:  # started while the block is left: drained like the others
                    handle.drain()
                task_status.started(run_id)
                started = True
            await handle.wait()
        except Exception as exc:
            if not started:
                raise  # to the caller of start (nothing is driven)
            assert handle is not None
            if handle.left is not None:  # drained or parked: it resumes from its log
                _LOG.info("run %r left %s: it resumes from its log", run_id, handle.left)
            else:
                _LOG.warning("run %r stopped unfinished: %s", run_id, exc)
                self.stopped[run_id] = handle
        finally:
            if handle is not None and self.handles.get(run_id) is handle:
                del self.handles[run_id]

    async def resume_unfinished(self) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        """Resume the store's unfinished runs: ``(resumed ids, (id, why not) pairs)``."""
        resumed: list[str] = []
        refused: list[tuple[str, str]] = []
        for run_id in await self._unfinished():
            try:
                resumed.append(await self.start(None, run_id))
            except RunLeased as exc:
                _LOG.info("run %r is driven elsewhere: %s", run_id, exc)
            except TreadleError as exc:  # another agent's run, a damaged log: the others go on
                _LOG.warning("run %r cannot be resumed here: %s", run_id, exc)
                refused.append((run_id, f"{type(exc).__name__}: {exc}"))
        return tuple(resumed), tuple(refused)

    async def _unfinished(self) -> list[str]:
        store = self.store
        if isinstance(store, RunIndex):
            return [
                s.run_id
                for s in await store.list_summaries()
                if s.liveness not in (Liveness.FINISHED, Liveness.QUEUED) and s.error is None
            ]
        found = []
        for run_id in await store.list_runs():
            log = await store.read_log(run_id)
            if log.finished is None and log.records:
                found.append(run_id)
        return found

    async def events(
        self, run_id: str, from_seq: int | None, after: tuple[int, int] | None
    ) -> AsyncIterator[Event]:
        first, last = resume_from(from_seq, after)
        handle = self.handles.get(run_id)
        if handle is not None:
            async with _closing(handle.events(from_seq=from_seq, after=after)) as events:
                async for event in events:
                    yield event
            return
        log = await self.store.read_log(run_id)
        if not log.records:
            raise UsageError(f"there is no run {run_id!r} in this store")
        for event in stored_events(log, first, len(log.records)):
            if (event.seq, event.ordinal) > last:
                yield event

    def _driven(self, run_id: str) -> RunHandle | None:
        """The handle of ``run_id`` while this process drives it (parked here included).

        ``None`` for a run not driven here, or one that left (drained, or parked away on
        child runs): whoever drives it next reads its control stream.
        """
        handle = self.handles.get(run_id)
        return handle if handle is not None and handle.left is None else None

    async def approve(
        self,
        run_id: str,
        call_id: str | None,
        reject: str | None,
        edit: Mapping[str, Any] | None,
    ) -> ApprovalDecided:
        """Decide through the handle while the run is driven here, else the control stream.

        Through the handle only: the store cannot see a decision the handle handed over
        and the run has not recorded yet, so a second decision (or one after a cancel)
        would be taken there and never applied (docs/events.md, "Human approval").
        """
        handle = self._driven(run_id)
        if handle is not None:
            decided = handle.approve(call_id, reject=reject, edit=edit)
            await trio.lowlevel.checkpoint()
            return decided
        return await decide(self.store, run_id, call_id=call_id, reject=reject, edit=edit)

    async def cancel(self, run_id: str, reason: str, canceller: str) -> None:
        """Cancel through the handle while the run is driven here, else the control stream.

        A no-op for a finished run, wherever it finished, as `RunHandle.cancel` (the
        handle is forgotten soon after its run finished: the store's refusal of a finished
        run would otherwise depend on that moment).
        """
        handle = self._driven(run_id)
        if handle is not None:
            handle.cancel(reason, canceller=canceller)
            await trio.lowlevel.checkpoint()
            return
        check_run_id(run_id)
        check_cancel_text(reason, canceller)
        try:
            await request_cancel(self.store, run_id, reason=reason, canceller=canceller)
        except UsageError:
            if (await self.store.read_log(run_id)).finished is None:
                raise  # no such run (or no control streams)

    async def result(self, run_id: str) -> RunResult:
        """`Runs.result`: the handle's while driven here, else the store's once it finished.

        A run whose drive here stopped unfinished raises that drive's error (`stopped`),
        unless its log finished since (another process resumed it), however late the call
        comes: it waited for a driver that may never come.
        """
        handle = self.handles.get(run_id)
        if handle is not None:
            return await handle.wait()
        stopped = self.stopped.get(run_id)
        if stopped is not None and (await self.store.read_log(run_id)).finished is None:
            return await stopped.wait()  # raises its RunInterrupted
        return await wait_result(self.store, run_id, output_type=self.agent.output_type)

    def close(self, drain_s: float) -> None:
        """Start leaving: refuse new runs, drain those driven here, cut them in ``drain_s``.

        A run whose start was under way is drained as it registers. The calls go on until
        the runs stopped (a wait for a result gets `RunInterrupted`); ``open_runs`` then
        cancels those left (docs/asyncio.md, "The bridge").
        """
        self.closing = True
        for handle in list(self.handles.values()):
            handle.drain()
        self.nursery.cancel_scope.deadline = trio.current_time() + drain_s


@attrs.define(eq=False)
class Runs:
    """The asyncio face of runs driven in a trio thread; made by `open_runs`.

    Every method is a coroutine of the asyncio loop that opened it; each call crosses to
    trio and back (docs/asyncio.md, "The bridge"). Awaited in another event loop (a second
    thread's ``asyncio.run``), a method raises `UsageError` before anything crosses: no run
    is started, approved or cancelled.

    Attributes:
        portal: the portal the runs live behind (for calls of your own into trio).
        resumed: the run ids resumed when the block opened (``resume=True``).
        not_resumed: unfinished runs that could not be resumed then, each with the error
            (``SnapshotMismatch: ...`` for a run of another agent definition, say); a run
            another live driver holds is in neither.
    """

    portal: TrioPortal
    _host: _Host
    resumed: tuple[str, ...] = ()
    not_resumed: tuple[tuple[str, str], ...] = ()

    async def start(self, input: RunInput | None = None, *, run_id: str | None = None) -> str:
        """Start a run on ``input`` (or resume the unfinished ``run_id``) in the background.

        Returns once the run is driven here (its lease taken); a run already driven here
        is left as it is.

        Returns:
            The run id (a fresh one when ``run_id`` is omitted).

        Raises:
            RunLeased: another live driver holds the run.
            UsageError: neither ``input`` nor ``run_id`` was given; the block is being left
                (no run is started then: leaving drains the runs, docs/asyncio.md, "The
                bridge"); the trio thread is stopped by an exception raised in it (a run's
                `KeyboardInterrupt` or `SystemExit`); or as `treadle.open_run`.
            InvalidRunId, SnapshotMismatch, SchemaTooNew: as `treadle.open_run`.
        """
        return await self._call(self._host.start, input, run_id)

    def events(
        self, run_id: str, *, from_seq: int | None = None, after: tuple[int, int] | None = None
    ) -> AsyncIterator[Event]:
        """The run's events from ``from_seq`` or after ``after``, as `RunHandle.events` does.

        Given neither, from seq 1. ``after`` is the ``(seq, ordinal)`` of the last event a
        reader saw (docs/events.md, "Reading events"; `resume_after` reads it from a
        ``Last-Event-ID``). For a run driven here: stored events, then live ones (text
        deltas included), with no gap and no duplicate, ending after ``run_finished`` (or
        when the run stops being driven here; leaving the block ends every stream by
        ``drain_s`` at the latest). For any other run of the store: its stored events, then
        the end.

        Raises:
            UsageError: ``from_seq`` is not a whole number of 1 or more, ``after`` is not a
                ``(seq, ordinal)`` of whole numbers of 0 or more (or comes with a
                ``from_seq``, ``1`` too), the store has no such run, the block was left
                before the stream began, or the stream is iterated in another event loop
                than the one that opened the block.
            StoreError: the stored prefix could not be read.
        """
        return self.portal._iterate_in(self._host.calls, self._host.events, run_id, from_seq, after)

    async def approve(
        self,
        run_id: str,
        call_id: str | None = None,
        *,
        reject: str | None = None,
        edit: Mapping[str, Any] | None = None,
    ) -> ApprovalDecided:
        """Decide the run's pending approval (docs/events.md, "Human approval").

        A run driven here (parked here included) gets the decision from its handle, which
        refuses a second decision and one after a cancel at once; any other run through
        its control stream (`treadle.approvals.decide`).

        Raises:
            UsageError: as `treadle.RunHandle.approve` and `treadle.approvals.decide`.
        """
        return await self._call(self._host.approve, run_id, call_id, reject, edit)

    async def cancel(self, run_id: str, reason: str = "", *, canceller: str = "") -> None:
        """Cancel the run (docs/events.md, "Cancellation").

        A no-op once the run finished, here or anywhere (as `treadle.RunHandle.cancel`).
        A run driven here is cancelled through its handle; any other one through its
        control stream (`treadle.approvals.request_cancel`).

        Raises:
            InvalidRunId: not an allowed run id.
            UsageError: the store has no such run (or no control streams), or ``reason`` or
                ``canceller`` is not a ``str``.
        """
        await self._call(self._host.cancel, run_id, reason, canceller)

    async def result(self, run_id: str) -> RunResult:
        """Wait for the run to finish (driven here or anywhere) and return its result.

        Raises:
            RunInterrupted: the run stopped unfinished here (it stays resumable).
            UsageError: the store has no such run.
        """
        return await self._call(self._host.result, run_id)

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``portal.call`` in the host's calls nursery (docs/asyncio.md, "The bridge").

        Raises:
            UsageError: the block is being left and the store closes (or closed): the call
                was refused, or cancelled in trio; or the call is awaited in another event
                loop than the one that opened the block (refused before it crossed).
        """
        return await self.portal._call_in(self._host.calls, fn, *args)


@asynccontextmanager
async def open_runs(
    agent: Agent,
    *,
    store: StoreOpener,
    resume: bool = True,
    owner: str | None = None,
    lease_ttl_s: float = LEASE_TTL_S,
    park_after_s: float | None = PARK_AFTER_S,
    sinks: Sequence[EventSink] = (),
    metrics: MetricsRecorder | None = None,
    drain_s: float = DRAIN_S,
) -> AsyncIterator[Runs]:
    """Drive runs of ``agent`` in a trio thread for the duration of the block (from asyncio).

    Args:
        agent: the agent definition of every run.
        store: opens the store inside trio (``lambda: treadle.open_sqlite_store(path)``).
        resume: resume every unfinished run of the store that no other live driver holds,
            before the block starts (after a restart of the application); those that fail
            to resume (`Runs.not_resumed`) are logged and left as they are.
        owner: the lease owner id (default ``host:pid:random``). An application restarted
            under the owner id of its dead predecessor resumes its runs at once instead of
            waiting for their leases to expire: use a fixed one only for a single instance
            (docs/fleet.md, "Leases"). One of a cancel's form is refused
            (`treadle.stores.driver_owner`).
        lease_ttl_s: the lease duration in seconds.
        park_after_s: as `treadle.open_run`.
        sinks: event sinks of every run.
        metrics: counts every run's records and the store's commits (docs/metrics.md).
        drain_s: when the block ends, the seconds runs get to stop at a safe point (they
            stay resumable, their leases released) before they are cut.

    Yields:
        The `Runs` face.

    Raises:
        UsageError: ``drain_s`` is negative or not finite.
        StoreError: the store cannot be opened.
    """
    if not (drain_s >= 0 and math.isfinite(drain_s)):
        raise UsageError(f"drain_s must be a finite number >= 0, not {drain_s}")
    options = {
        "owner": owner,
        "lease_ttl_s": lease_ttl_s,
        "park_after_s": park_after_s,
        "sinks": sinks,
        "metrics": metrics,
    }
    async with open_portal() as portal:
        stop = trio.Event()
        stopped = trio.Event()

        async def serve(*, task_status: trio.TaskStatus[_Host]) -> None:
            try:
                async with store() as opened:
                    if metrics is not None:
                        metrics.watch(opened)
                    async with trio.open_nursery() as calls:
                        async with trio.open_nursery() as nursery:
                            host = _Host(
                                agent=agent,
                                store=opened,
                                nursery=nursery,
                                calls=calls,
                                options=options,
                            )
                            task_status.started(host)
                            await stop.wait()
                            host.close(drain_s)
                        # The runs stopped: the calls left end (a call with UsageError, an
                        # event stream as when its run stops) before the store closes.
                        calls.cancel_scope.cancel()
            finally:
                stopped.set()

        async def begin() -> _Host:
            host: _Host = await portal._nursery.start(serve)
            return host

        async def end() -> None:
            stop.set()
            await stopped.wait()

        host = await portal.call(begin)
        try:
            resumed, refused = (
                await portal._call_in(host.calls, host.resume_unfinished) if resume else ((), ())
            )
            yield Runs(portal=portal, host=host, resumed=resumed, not_resumed=refused)
        finally:
            portal._leaving = True
            await asyncio.shield(portal.call(end))


def event_data(event: Event) -> dict[str, Any]:
    """One event as JSON data, ``{"seq", "kind", "run_id", ...}``: as ``treadle tail --json``.

    A durable event has its record's fields after ``seq``, ``kind`` and ``run_id`` (the event
    kinds of docs/events.md, "Event types"); a delta or a warning has ``ordinal`` and
    ``text``; a step-started event ``step`` and ``ordinal`` (`treadle.stores.event_to_dict`).
    Every event names its run: a child run's events, which a parent's stream carries live,
    have the child's run id (docs/child-runs.md, "Events"). Its text is valid Unicode, which
    UTF-8 encodes: a lone surrogate is U+FFFD, as ``treadle tail`` prints it (a delta's half
    of a surrogate pair that the server split across two chunks, a record of a log written
    before text entering it was repaired: docs/crash-safety.md, "Text that is not Unicode").
    """
    data, _ = valid_unicode(event_to_dict(event))
    return data


def sse_frame(event: Event, *, run_id: str) -> bytes:
    """One Server-Sent Events frame of ``event``, in the stream of run ``run_id``.

    ``event:`` is the event kind and ``data:`` its `event_data` as one line of JSON (valid
    UTF-8: a lone surrogate is U+FFFD). An event of ``run_id`` that is durable carries
    ``id: <seq>``, a step-started one ``id: <seq>.<ordinal>`` (it has the seq of the durable
    event before it): a browser's ``EventSource`` reconnects with ``Last-Event-ID`` set to
    the last of them it saw, and `resume_after` turns that into the ``after`` of
    `Runs.events` for ``run_id``. Deltas and warnings (live only) carry no id and leave the
    last id as it was; so do the events of another run the stream carries (a child run's,
    live, numbered in the child's log: docs/child-runs.md, "Events"), whose seq would move
    the browser's cursor in ``run_id``'s log (docs/asyncio.md, "Streaming to a browser").

    Args:
        event: the event to frame.
        run_id: the run whose events the stream serves (the ``run_id`` given to
            `Runs.events`).
    """
    body = json.dumps(event_data(event), ensure_ascii=False, separators=(",", ":"))
    return f"{_sse_id(event, run_id)}event: {event.kind.value}\ndata: {body}\n\n".encode()


def _sse_id(event: Event, run_id: str) -> str:
    """The ``id:`` line of `sse_frame` (with its newline), or ``""`` for an event without one."""
    if event.run_id != run_id:
        return ""
    if event.record is not None:
        return f"id: {event.seq}\n"
    if event.kind is EventKind.STEP_STARTED:
        return f"id: {event.seq}.{event.ordinal}\n"
    return ""


def resume_after(last_event_id: str) -> tuple[int, int]:
    """The ``(seq, ordinal)`` an `sse_frame` id names: ``"6"`` is (6, 0), ``"6.1"`` is (6, 1).

    Pass it as ``after`` to `Runs.events` to resume a stream after the last event a
    browser saw (its ``Last-Event-ID``; docs/asyncio.md, "Streaming to a browser"). The
    run console reads its streams' ``Last-Event-ID`` with it too (docs/ui.md).

    Raises:
        UsageError: ``last_event_id`` is no such id: anything but ASCII digits, one optional
            ``.`` and more digits, or a part of more than 19 digits (more than a 64-bit seq
            has).
    """
    seq_text, dot, ordinal_text = last_event_id.partition(".")
    seq, ordinal = read_count(seq_text), read_count(ordinal_text) if dot else 0
    if seq is None or ordinal is None:
        raise UsageError(f"an event id is <seq> or <seq>.<ordinal>, not {last_event_id!r:.60}")
    return seq, ordinal


__all__ = [
    "ITERATE_BUFFER",
    "Runs",
    "StoreOpener",
    "TrioPortal",
    "event_data",
    "open_portal",
    "open_runs",
    "resume_after",
    "sse_frame",
]
