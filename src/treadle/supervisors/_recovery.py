"""Recovery: resume every unfinished run of a store, as a process does after a crash.

`resume_unfinished` lists the store's runs, skips the finished ones, those another live
driver holds the lease of and child runs whose parent is unfinished (the parent's resume
re-attaches to its child, with the child's own agent: docs/child-runs.md), and drives each
other unfinished run to its end with `treadle.run`
(the resume table of docs/crash-safety.md applies: finished intents are reused, an interrupted
model call is abandoned and made afresh, an interrupted action follows its tool's replay
policy), at most ``max_concurrent`` at a time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import trio

from treadle._clock import Clock
from treadle._exceptions import RunLeased, StoreError, UsageError, raised
from treadle._trio_only import require_trio
from treadle.agent import Agent
from treadle.ports import EventSink, RunStore
from treadle.supervisors._child_links import run_finished
from treadle.supervisors._run import run
from treadle.types import RunResult, RunStarted

AgentFor = Callable[[RunStarted], Agent]
"""Chooses the agent definition for a run from its stored run-started record."""


@trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
async def resume_unfinished(
    agent: Agent | AgentFor,
    *,
    store: RunStore,
    max_concurrent: int = 16,
    sinks: Sequence[EventSink] = (),
    clock: Clock | None = None,
    rng: random.Random | None = None,
) -> list[RunResult]:
    """Resume every unfinished run of ``store`` and wait for them all.

    Args:
        agent: the agent definition, or a function choosing it from a run's run-started
            record (its snapshot and input), for stores that hold runs of several agents.
        store: the run store; its runs are taken in `list_runs` order. A run another live
            driver holds the lease of is left to it (neither resumed nor an error), as is a
            child run whose parent is unfinished (the parent's resume re-attaches to it).
        max_concurrent: runs driven at the same time (at least 1).
        sinks: event sinks given to every resumed run.
        clock: wall clock for record timestamps (default: the system clock).
        rng: seeds one random source per run (retry jitter), in list order; default: fresh
            unseeded sources.

    Returns:
        The result of every run that was unfinished and has now finished, in `list_runs`
        order. Finished runs are not touched and not returned.

    Raises:
        ExceptionGroup: some runs could not be resumed (`treadle.SnapshotMismatch`,
            `treadle.SchemaTooNew`, `treadle.LogCorrupted`, `treadle.RunInterrupted`,
            `treadle.StoreError` ...): every other run was still driven to its end first.
            Each error carries a note naming its run (and its file, for a damaged one); the
            results of the runs that finished are in the store.
        UsageError: ``max_concurrent`` is below 1.
        StoreError: the store cannot list its runs.
        KeyboardInterrupt: Ctrl-C while runs went (or `SystemExit`), as itself, not in an
            exception group; the runs are left unfinished and resumable
            (docs/crash-safety.md, "What is guaranteed", item 8).

    Cancellation:
        Cancelling the call cancels every run it drives; they stay unfinished and
        resumable.
    """
    require_trio("treadle.resume_unfinished")
    if max_concurrent < 1:
        raise UsageError(f"max_concurrent must be at least 1, got {max_concurrent}")
    run_ids = list(await store.list_runs())
    limiter = trio.CapacityLimiter(max_concurrent)
    results: dict[str, RunResult] = {}
    errors: list[Exception] = []
    seeds = [rng.random() for _ in run_ids] if rng is not None else [None] * len(run_ids)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def resume_one(run_id: str, seed: float | None) -> None:
        async with limiter:
            try:
                result = await _resume(agent, store, run_id, sinks, clock, seed)
            except RunLeased:
                return  # another driver drives it: not ours to resume, and not a failure
            except Exception as exc:  # collected: one bad run must not stop the others
                exc.add_note(_resume_note(run_id))  # how `resume --all` tells it
                errors.append(exc)
                return
        if result is not None:
            results[run_id] = result

    try:
        async with trio.open_nursery() as nursery:
            for run_id, seed in zip(run_ids, seeds, strict=True):
                nursery.start_soon(resume_one, run_id, seed)
    except BaseExceptionGroup as group:
        stopping = _stopping(group)
        if stopping is None:
            raise
        raise stopping from None
    if errors:
        raise ExceptionGroup(f"{len(errors)} of the unfinished runs could not be resumed", errors)
    return [results[run_id] for run_id in run_ids if run_id in results]


def _stopping(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The `KeyboardInterrupt` (else `SystemExit`) in the nursery's ``group``, or ``None``.

    Ctrl-C while runs go reaches the caller as itself, not in the group of the nursery that
    drove them (docs/crash-safety.md, "What is guaranteed", item 8): the runs' own errors
    are collected, not raised, so an interrupt leaves beside it only the cancellations it
    caused.
    """
    return raised(group, KeyboardInterrupt) or raised(group, SystemExit)


async def _resume(
    agent: Agent | AgentFor,
    store: RunStore,
    run_id: str,
    sinks: Sequence[EventSink],
    clock: Clock | None,
    seed: float | None,
) -> RunResult | None:
    log = await store.read_log(run_id)
    if log.finished is not None:
        return None
    started = log.started
    if started is None:
        raise StoreError(f"run {run_id!r}: its log does not start with run-started")
    parent = started.parent_run_id
    if parent is not None and not await run_finished(store, parent):
        return None  # the parent's resume re-attaches to it, with the child's own agent
    definition = agent if isinstance(agent, Agent) else agent(started)
    if not isinstance(definition, Agent):
        raise UsageError(f"run {run_id!r}: the agent factory returned {definition!r}")
    return await run(
        definition,
        store=store,
        run_id=run_id,
        sinks=sinks,
        clock=clock,
        rng=random.Random(seed) if seed is not None else None,
    )


def _resume_note(run_id: str) -> str:
    """The note `resume_unfinished` adds to the error of ``run_id``'s resume."""
    return f"while resuming run {run_id!r}"


def resume_failed(error: BaseException, run_id: str) -> bool:
    """Whether ``error``, one of `resume_unfinished`'s, is what the resume of ``run_id`` raised.

    Each error carries a note naming its run (docs/crash-safety.md, "Resume"); an error's own
    ``run_id`` attribute may name another run (a child's) or be missing (a store's error).
    """
    return _resume_note(run_id) in getattr(error, "__notes__", ())
