"""The run API: `open_run` (a run in the background, and its handle) and `run` (to the end).

`open_run` starts a new run or resumes an unfinished one (docs/crash-safety.md, "Resume"): it
reads the log, checks the parameter snapshot, folds the log into the coordinator's view, and
starts the event writer, context hydrator, model gateway and tool executor with
`nursery.start` before the coordinator runs (the driver, `treadle.supervisors._driver`; the
actors come from the factories of an `Actors` record, `treadle.supervisors._factories`).
Cancelling the run's nursery cancels all five. An actor that fails leaves the run
`interrupted` with its error on the handle; the log stays resumable (docs/fleet.md). A run that
waits long for an approval is parked: its actors stop and it resumes from its log once
decided (docs/decisions/0010-parking-waiting-runs.md).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import attrs
import trio

from treadle._clock import Clock, SystemClock, check_seconds
from treadle._exceptions import UsageError
from treadle._ids import check_run_id, new_run_id
from treadle._trio_only import require_trio
from treadle.actors import Chain, read_chain
from treadle.agent import Agent, RunInput
from treadle.approvals import ApprovalPolicy, policy_name
from treadle.metrics import MetricsRecorder
from treadle.ports import EventSink, RunStore
from treadle.stores import LEASE_TTL_S, check_ttl, driver_owner
from treadle.supervisors._driver import (
    CONTROL_POLL_S,
    PARK_AFTER_S,
    DriveOptions,
    drive_run,
)
from treadle.supervisors._factories import (
    DEFAULT_ACTORS,
    Actors,
)
from treadle.supervisors._handle import RunHandle
from treadle.supervisors._leasing import LeaseHold, leases_of
from treadle.supervisors._threads import (
    Lineage,
    check_thread_name_free,
    fork_lineage,
    known_fork,
    next_in_thread,
    run_in_thread,
    thread_named,
)
from treadle.types import (
    RunLog,
    RunResult,
)


def open_run(
    agent: Agent,
    input: RunInput | None = None,
    *,
    store: RunStore,
    run_id: str | None = None,
    sinks: Sequence[EventSink] = (),
    clock: Clock | None = None,
    rng: random.Random | None = None,
    approval_policy: ApprovalPolicy | None = None,
    control_poll_s: float | None = CONTROL_POLL_S,
    actors: Actors = DEFAULT_ACTORS,
    park_after_s: float | None = PARK_AFTER_S,
    lease_ttl_s: float = LEASE_TTL_S,
    owner: str | None = None,
    accept_definition_change: bool = False,
    metrics: MetricsRecorder | None = None,
    thread_id: str | None = None,
    fork_of: str | None = None,
    at_step: int | None = None,
) -> AbstractAsyncContextManager[RunHandle]:
    """Start (or resume) a run in the background and yield its handle.

    A new ``run_id`` starts a run on ``input``. An existing unfinished ``run_id`` is resumed
    (``input`` may be omitted; when given it must equal the stored input). A finished one
    yields a handle whose result is already set: nothing is re-run.

    In a store with leases (`treadle.ports.LeaseStore`), the run is driven only while this
    call holds the run's lease (docs/fleet.md, "Leases"): it is taken before the log is read,
    renewed every ``lease_ttl_s / 3`` seconds, and released when the run finishes, parks or
    the block ends. If another driver takes the run over (after the lease expired), this one
    stops without writing more and its handle reports `LeaseLost`.

    Leaving the block waits for the run to finish; an exception in the block cancels the
    run's actors and leaves the run unfinished (resumable), not ``cancelled``.

    Args:
        agent: the agent definition.
        input: the run input (text or messages); required for a new run.
        store: the run store.
        run_id: the run's id (docs/concepts.md, "Run ids"); when omitted, a thread's run is
            named by its thread, any other run (a fork included) gets a fresh random one, so
            the same call again starts another run: a call that must be safe to retry after a
            crash names its run.
        sinks: event sinks fed through bounded buffers.
        clock: wall clock for record timestamps (default: the system clock).
        rng: random source for retry jitter (default: one unseeded source the runs share).
        approval_policy: ``policy(tool, arguments) -> bool``: calls it selects wait for a
            human decision, as do tools declared with ``requires_approval=True``. The same
            as the agent's `treadle.Agent.approval_policy` (the run goes on with ``agent``
            given this policy): it is part of the run's definition, recorded in its
            parameter snapshot, and a resume without it is refused (docs/events.md, "Human
            approval").
        control_poll_s: seconds (a finite number > 0) between reads of the run's control
            stream (cancel and approval decisions from other processes, see
            `treadle.approvals`); ``None`` reads it only when the run starts, before it
            takes a decision handed to its handle, and before it ends. Whatever the
            interval, the run reads it once more before it ends, so a cancel written
            before then is applied (docs/events.md, "Cancellation").
        actors: the factories of the run's five actors (default: the real ones); replace
            one to swap that actor alone (see `Actors`).
        park_after_s: seconds a run waits for an approval decision with its actors running;
            after that it is parked: its actors stop, its lease is released, and only the
            handle stays in memory until a decision, a cancel or the deadline resumes it from
            its log (docs/decisions/0010). ``None`` never parks.
        lease_ttl_s: the lease duration in seconds (default 15).
        owner: the lease owner id (default: a fresh ``host:pid:random``). A process restarted
            under the owner id of one that died continues its leases at once. One of a
            cancel's form is refused (`treadle.stores.driver_owner`).
        accept_definition_change: resume even though the agent definition's snapshot
            differs from the run's: the difference is written to the log first (a
            `treadle.types.DefinitionAccepted` record, docs/fleet.md "Deploys"); without it,
            `SnapshotMismatch` is raised.
        metrics: counts the run's records (docs/metrics.md, "What is counted"); ``None``
            (the default) counts nothing. The store's commits are counted only once
            `treadle.metrics.MetricsRecorder.watch` watches the store.
        thread_id: continue the thread of this id (the id of its first run) with ``input``
            as the new user message: the new run ``<thread_id>.<n>`` starts from the history
            the thread's latest run ended with, read from the store (docs/threads.md,
            "Threads"). When the latest run is unfinished and was started with the same
            input, that run is resumed instead. ``run_id``, when given, names the run: an
            existing run of the thread is resumed (or its result returned), which makes a
            retry after a crash start nothing twice; a new one must be the thread's next.
        fork_of: fork this run: the new run starts from its history before step
            ``at_step`` and tries that step again (docs/threads.md, "Forks"); nothing
            before it is executed again. ``input``, when given, is added after that history.
            Without ``run_id`` each call is a new fork; with it, the same call again resumes
            that fork or returns its result (a fork that must survive a crash names its run,
            docs/decisions/0109-a-fork-is-retried-by-its-run-id.md).
        at_step: the step of ``fork_of`` to try again (1 to its step count).

    Raises:
        RunLeased: another live driver holds the run's lease (the error names it and the
            expiry); nothing was read or written.
        InvalidRunId: ``run_id`` is not an allowed run id.
        UsageError: no input for a new run, or an input that differs from the stored one
            (for a thread's next run, another caller started it first with its message: the
            message says the thread moved on, and the same call again continues after it);
            a ``control_poll_s`` or ``lease_ttl_s`` that is not a finite number > 0, a
            ``park_after_s`` that is not one >= 0; a thread that does not exist or whose
            latest run is not finished (started with another input), a fork of a missing run
            or at a step it does not have, a fork whose ``run_id`` is ``fork_of``, both
            ``thread_id`` and ``fork_of``, a ``run_id`` that exists with another lineage, or
            a new fork or run named as a run of an existing thread (``T.n``: docs/threads.md,
            "Threads"; "When a thread cannot go on"). Nothing is written then.
        SnapshotMismatch: resuming with a definition whose snapshot differs (names the keys):
            one without the approval policy the run was started with among them.
        SchemaTooNew: the log was written by a newer treadle.
    """
    return _Opening(
        "treadle.open_run",
        functools.partial(
            _prepared,
            agent,
            input,
            wait=False,
            store=store,
            run_id=run_id,
            sinks=sinks,
            clock=clock,
            rng=rng,
            approval_policy=approval_policy,
            control_poll_s=control_poll_s,
            actors=actors,
            park_after_s=park_after_s,
            lease_ttl_s=lease_ttl_s,
            owner=owner,
            accept_definition_change=accept_definition_change,
            metrics=metrics,
            thread_id=thread_id,
            fork_of=fork_of,
            at_step=at_step,
        ),
    )


class _Opening:
    """The block `open_run` returns: the run prepared on entry, then `drive_run`'s block.

    A class rather than a generator-based context manager: a parked run keeps its block for
    as long as it waits, and each generator frame would hold every argument of the call
    (docs/performance.md, "Memory").
    """

    __slots__ = ("_driving", "_name", "_prepare")

    def __init__(
        self,
        name: str,
        prepare: Callable[[], Awaitable[AbstractAsyncContextManager[RunHandle]]],
    ) -> None:
        self._name = name
        self._prepare: Callable[[], Awaitable[AbstractAsyncContextManager[RunHandle]]] | None
        self._prepare = prepare
        self._driving: AbstractAsyncContextManager[RunHandle] | None = None

    # Protected from Ctrl-C, as the run's tasks are (decision 0097): an interrupt between this
    # block and `drive_run`'s would leave the run's nursery entered and never left.
    @trio.lowlevel.enable_ki_protection
    async def __aenter__(self) -> RunHandle:
        require_trio(self._name)
        if self._prepare is None:
            raise UsageError(f"the block of {self._name}(...) can be entered only once")
        prepare, self._prepare = self._prepare, None  # let the arguments go
        self._driving = await prepare()
        return await self._driving.__aenter__()

    @trio.lowlevel.enable_ki_protection
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        assert self._driving is not None
        return await self._driving.__aexit__(exc_type, exc_value, traceback)


async def _prepared(
    agent: Agent,
    input: RunInput | None,
    *,
    wait: bool,
    store: RunStore,
    run_id: str | None,
    sinks: Sequence[EventSink],
    clock: Clock | None,
    rng: random.Random | None,
    approval_policy: ApprovalPolicy | None,
    control_poll_s: float | None,
    actors: Actors,
    park_after_s: float | None,
    lease_ttl_s: float,
    owner: str | None,
    accept_definition_change: bool,
    metrics: MetricsRecorder | None,
    thread_id: str | None,
    fork_of: str | None,
    at_step: int | None,
) -> AbstractAsyncContextManager[RunHandle]:
    """The block of `open_run` (`drive_run`'s, not yet entered): its lineage, lease and options.

    With ``wait`` the run is driven in the calling task, and the block is entered once it
    stopped: `run` waits (it has nothing else to do meanwhile), so the run takes no task of
    its own besides its actors' (docs/performance.md, "Memory").
    """
    check_seconds(park_after_s=park_after_s)
    check_seconds(above_zero=True, control_poll_s=control_poll_s)
    check_ttl(lease_ttl_s)
    agent = _with_policy(agent, approval_policy)
    lineage: Lineage | None = None
    chain: Chain | None = None
    if thread_id is not None or fork_of is not None:
        run_id, lineage, chain = await _lineage(store, input, run_id, thread_id, fork_of, at_step)
    elif at_step is not None:
        raise UsageError("at_step is the step of the run named by fork_of, which is missing")
    elif run_id is not None:
        await _check_plain_name(store, check_run_id(run_id))
    run_id = check_run_id(run_id) if run_id is not None else new_run_id()
    hold = LeaseHold(
        run_id=run_id, owner=driver_owner(owner), ttl_s=lease_ttl_s, store=leases_of(store)
    )
    options = DriveOptions(
        clock=clock or SystemClock(),
        rng=rng,
        control_poll_s=control_poll_s,
        actors=actors,
        park_after_s=park_after_s,
        accept_definition_change=accept_definition_change,
        metrics=metrics,
        lineage=lineage,
    )
    return drive_run(
        agent, input, store=store, hold=hold, sinks=sinks, options=options, wait=wait, chain=chain
    )


def _with_policy(agent: Agent, policy: ApprovalPolicy | None) -> Agent:
    """``agent`` with the approval policy given to `open_run` or `run`, if any.

    The policy is part of the definition (`treadle.Agent.approval_policy`), so the run's
    parameter snapshot records it and a resume without it is refused.

    Raises:
        UsageError: ``agent`` has another policy already (give it once), or ``policy`` is
            not callable.
    """
    if policy is None or policy is agent.approval_policy:
        return agent
    if agent.approval_policy is not None:
        raise UsageError(
            "the agent has an approval policy of its own (Agent.approval_policy "
            f"{policy_name(agent.approval_policy)!r}); give the run one policy, not also "
            f"approval_policy={policy_name(policy)!r}"
        )
    return attrs.evolve(agent, approval_policy=policy)


async def _lineage(
    store: RunStore,
    input: RunInput | None,
    run_id: str | None,
    thread_id: str | None,
    fork_of: str | None,
    at_step: int | None,
) -> tuple[str, Lineage, Chain | None]:
    """The run id and lineage of a run continuing ``thread_id`` or forking ``fork_of``.

    A thread names its run (`next_in_thread`); a fork is named by ``run_id``, or by a fresh
    random id: a new fork at each call (docs/threads.md, "Forks"). A run ``run_id`` names
    that exists is checked to be the one asked for and taken as it is, before anything of
    the run it continues is read (`run_in_thread`, `known_fork`): a retry of a finished run
    returns its result even when that history is gone.

    Returns:
        The run id, its lineage, and for a new run the chain it inherits, read and checked
        (`_check_chain`; its hydrator takes it); ``None`` for a run that exists.
    """
    if thread_id is not None and fork_of is not None:
        raise UsageError("give thread_id (continue a thread) or fork_of (fork a run), not both")
    if thread_id is not None:
        if at_step is not None:
            raise UsageError("at_step goes with fork_of; a thread continues its whole history")
        if run_id is not None:
            known = await run_in_thread(store, thread_id, check_run_id(run_id), input)
            if known is not None:  # a retry naming its run: resume it or return its result
                return run_id, known, None
        next_id, lineage, read = await next_in_thread(store, thread_id, input)
        if run_id is not None and run_id != next_id:
            raise UsageError(
                f"thread {thread_id!r} goes on as run {next_id!r}, not {run_id!r} (a thread "
                'names its runs, docs/threads.md, "Threads")'
            )
        return next_id, lineage, await _check_chain(store, next_id, lineage, read)
    assert fork_of is not None
    if run_id is not None:
        known = await known_fork(store, fork_of, at_step, check_run_id(run_id))
        if known is not None:  # a retry naming its run: resume it or return its result
            return run_id, known, None
    fork_id = run_id if run_id is not None else new_run_id()
    lineage, forked = await fork_lineage(store, fork_of, at_step, fork_id)
    if run_id is not None:  # a new fork (`known_fork` found none) named by its caller
        await check_thread_name_free(store, fork_id, read=(forked,))
    return fork_id, lineage, await _check_chain(store, fork_id, lineage, (forked,))


async def _check_plain_name(store: RunStore, run_id: str) -> None:
    """Refuse a new run of no lineage named as a thread's run (`check_thread_name_free`).

    A run of that name that exists is resumed (or its result returned) as before. Reads
    nothing for an id of another form (`thread_named`).

    Raises:
        UsageError: as `check_thread_name_free`.
    """
    if thread_named(run_id) is None:
        return
    if (await store.read_log(run_id)).started is None:
        await check_thread_name_free(store, run_id)


async def _check_chain(
    store: RunStore, run_id: str, lineage: Lineage, read: tuple[RunLog, ...]
) -> Chain | None:
    """Refuse to start ``run_id`` when the history it would inherit cannot be read.

    Only for a run that does not exist yet: its run-started must not be written over a
    chain whose runs are missing, damaged or unfinished (docs/threads.md, "When a thread
    cannot go on"; docs/decisions/0080-check-the-chain-before-a-new-run.md). A run that
    exists reads its chain when its hydrator starts, as every resume does.

    Args:
        store: the store.
        run_id: the run to start.
        lineage: what it continues.
        read: logs read already (finding ``lineage``), not read again (`read_chain`).

    Returns:
        The chain read (each of its logs once), for the new run's hydrator; ``None`` when
        ``run_id`` exists.

    Raises:
        StoreError: as `treadle.actors.read_chain` (nothing is written).
    """
    log = next((log for log in read if log.run_id == run_id), None)
    if log is None:
        log = await store.read_log(run_id)
    if log.started is not None:
        return None
    return await read_chain(
        store, lineage.continues, before_step=lineage.fork_step, successor=run_id, read=read
    )


# Protected from Ctrl-C, as the run's tasks are (decision 0097): it drives the run in the
# calling task, and an interrupt arrives as a cancellation of the caller's nursery.
@trio.lowlevel.enable_ki_protection
async def run(
    agent: Agent,
    input: RunInput | None = None,
    *,
    store: RunStore,
    run_id: str | None = None,
    sinks: Sequence[EventSink] = (),
    clock: Clock | None = None,
    rng: random.Random | None = None,
    approval_policy: ApprovalPolicy | None = None,
    control_poll_s: float | None = CONTROL_POLL_S,
    actors: Actors = DEFAULT_ACTORS,
    park_after_s: float | None = PARK_AFTER_S,
    lease_ttl_s: float = LEASE_TTL_S,
    owner: str | None = None,
    accept_definition_change: bool = False,
    metrics: MetricsRecorder | None = None,
    thread_id: str | None = None,
    fork_of: str | None = None,
    at_step: int | None = None,
) -> RunResult:
    """Run ``agent`` on ``input`` to the end and return the result.

    The same call resumes an unfinished ``run_id`` (without repeating any finished model call
    or action) and returns the stored result of a finished one. With ``thread_id`` it
    continues a thread, with ``fork_of`` and ``at_step`` it forks a run (docs/threads.md).
    Arguments as in `open_run`.

    Raises:
        RunInterrupted: an actor failed; the run is left resumable.
        StoreError: the store failed; the run stopped.
        RunLeased: another live driver holds the run's lease.
        LeaseLost: another driver took the run over while this call drove it.
        UsageError, SnapshotMismatch, SchemaTooNew: as in `open_run`.
    """
    require_trio("treadle.run")
    driving = await _prepared(
        agent,
        input,
        wait=True,
        store=store,
        run_id=run_id,
        sinks=sinks,
        clock=clock,
        rng=rng,
        approval_policy=approval_policy,
        control_poll_s=control_poll_s,
        actors=actors,
        park_after_s=park_after_s,
        lease_ttl_s=lease_ttl_s,
        owner=owner,
        accept_definition_change=accept_definition_change,
        metrics=metrics,
        thread_id=thread_id,
        fork_of=fork_of,
        at_step=at_step,
    )
    async with driving as handle:
        pass  # entered once the run stopped being driven
    return await handle.wait()
