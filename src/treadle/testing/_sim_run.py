"""Driving the simulated runs: `simulate`, the crash-and-resume driver and the simulated human.

Part of `treadle.testing.simulation`, which re-exports the public names (docs/simulation.md).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import trio
import trio.testing

from treadle._clock import FixedStepClock
from treadle._exceptions import (
    LeaseError,
    ModelCallError,
    RunInterrupted,
    StoreError,
    UsageError,
    one_error,
)
from treadle.approvals import Decision, current_snapshot, decide, decision_for
from treadle.redaction import Redaction
from treadle.stores.memory import MemoryStore
from treadle.supervisors import Actors, RunHandle, open_run, thread_run_id
from treadle.testing._intercept import InterceptingStore
from treadle.testing._sim_checks import (
    _compare_with_twin,
    _inherited,
    _unanswered_calls,
    check_child_runs,
    log_digest,
)
from treadle.testing._sim_faults import (
    ApprovalPlan,
    FaultPlan,
    _CancelAt,
    _LeaseClock,
    _TakenOver,
    with_latency,
)
from treadle.testing._sim_ledger import CONTROL_POLL_S, LedgerScenario
from treadle.testing._sim_scenario import Scenario, _scenario_actors, _scenario_agent
from treadle.testing.faults import CrashingStore, FailingStore, SimulatedCrash
from treadle.testing.invariants import VIRTUAL_TIME_SLACK_S, check_invariants
from treadle.testing.scripted import ScriptedModel, say
from treadle.tools import call_tools_inline
from treadle.types import (
    ApprovalRequested,
    Record,
    RunLog,
    RunState,
    StoreOp,
)

APPROVER_POLL_S = 0.5
"""Virtual seconds between two looks of the simulated human at the run's pending approval."""


MAX_RESTARTS = 20
"""Incarnations a simulated run may go through before the simulation gives up on it (the
seed then fails, naming what interrupted the run when it was not an injected fault)."""


@attrs.frozen(kw_only=True)
class SimulationResult:
    """The outcome of one seed.

    Attributes:
        seed: the seed.
        ok: no invariant was violated.
        violations: what broke, one sentence each.
        faults_injected: fault kind -> how many fired (a crash whose write was reached, a
            cancel the run took in ...; docs/simulation.md, "Faults"); the
            world's faults as the scenario counted them.
        steps: steps over all runs.
        log_digest: sha256 of every run's encoded log, in run order.
        logs: every simulated run's log as the store held it at the end, in run order (not
            the logs of child runs); not compared by ``==``, which the digest covers.
        skipped: what was not checked or injected, one sentence per run: the thread fault
            and the tool-reply check need the agent's model to be a `ScriptedModel` the
            world holds (docs/simulation.md, "Simulating your own agent").
    """

    seed: int
    ok: bool
    violations: tuple[str, ...]
    faults_injected: dict[str, int]
    steps: int
    log_digest: str
    logs: tuple[RunLog, ...] = attrs.field(default=(), eq=False, repr=False)
    skipped: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The JSON line `treadle simulate` prints."""
        return {
            "seed": self.seed,
            "ok": self.ok,
            "violations": list(self.violations),
            "faults_injected": self.faults_injected,
            "steps": self.steps,
            "log_digest": self.log_digest,
            "skipped": list(self.skipped),
        }


_SCENARIO_METHODS = ("world", "agent", "input", "check")
"""What `simulate` calls on a scenario (`treadle.testing.Scenario`)."""


def simulate(
    seed: int,
    *,
    plan: FaultPlan | None = None,
    runs: int = 1,
    steps: int = 10,
    scenario: Scenario | None = None,
) -> SimulationResult:
    """Simulate ``runs`` concurrent runs of a scenario under seed ``seed``.

    Args:
        seed: drives every choice: the worlds, the faults and trio's scheduling order.
        plan: the fault plan (default: `FaultPlan.default`).
        runs: concurrent runs sharing one store.
        steps: scripted tool steps per run of the default `LedgerScenario`.
        scenario: what to run (default: ``LedgerScenario(steps=steps)``).

    Returns:
        The result, with ``ok`` false and violations listed when an invariant broke.

    Raises:
        UsageError: ``seed`` is not a whole number of 0 or more (a seed must reproduce the
            simulation; ``treadle simulate --from`` takes the same), ``runs`` or ``steps`` is
            not a whole number of 1 or more, ``plan`` is no `FaultPlan`,
            ``scenario`` lacks a method of `Scenario`, or it is called inside a trio run (an
            ``async`` test): it is its own trio run, and has no ``async`` form.
    """
    _refuse_inside_trio("simulate")
    for name, value, least in (("seed", seed, 0), ("runs", runs, 1), ("steps", steps, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise UsageError(
                f"simulate: {name} must be a whole number of {least} or more, not {value!r}"
            )
    if plan is not None and not isinstance(plan, FaultPlan):
        raise UsageError(
            f"simulate: plan must be a FaultPlan (e.g. FaultPlan.of(['crash'])), not {plan!r}"
        )
    plan = plan if plan is not None else FaultPlan.default()
    scenario = scenario if scenario is not None else LedgerScenario(steps=steps)
    lacking = [m for m in _SCENARIO_METHODS if not callable(getattr(scenario, m, None))]
    if lacking:
        raise UsageError(
            "simulate: scenario must be a Scenario (docs/simulation.md, 'Simulating your own "
            f"agent'): {scenario!r} has no method {', '.join(lacking)}"
        )
    trio._core._run._r.seed(seed)  # trio's own scheduling randomness, seeded too
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(_simulate, seed, plan, runs, scenario, clock=clock)


def _refuse_inside_trio(name: str) -> None:
    """Refuse a call from inside a trio run, before it starts a trio run of its own.

    Raises:
        UsageError: there is a trio run in this thread (docs/simulation.md, "Simulating your
            own agent").
    """
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return
    raise UsageError(
        f"{name} was called inside a trio run (an async function or test): each seed is a "
        "trio run of its own on a virtual clock, and there is no async form; call it from "
        "plain code or a plain (not async) test function"
    )


class _RegistrationOrderDeadlines(trio._core._run.Deadlines):
    """trio's deadline heap, ties broken by the order deadlines were set, not by ``id()``.

    trio orders cancel scopes that share a deadline by their ``id()``, a memory address: on
    the virtual clock deadlines tie exactly (a child run's time budget ends where its
    parent's step does), and which scope expired first then changed from one simulation of
    a seed to the next, and with it the log (docs/simulation.md, "Determinism").
    """

    _order = itertools.count()

    def add(self, deadline: float, cancel_scope: trio.CancelScope) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), cancel_scope))
        self._active += 1


def _order_deadline_ties() -> None:
    """Give this trio run `_RegistrationOrderDeadlines` (before any deadline is set)."""
    runner = trio._core._run.GLOBAL_RUN_CONTEXT.runner
    old = runner.deadlines
    if type(old) is not trio._core._run.Deadlines or old._active:
        raise RuntimeError(f"simulate: trio's deadlines are not as expected: {old!r}")
    runner.deadlines = _RegistrationOrderDeadlines()


async def _simulate(seed: int, plan: FaultPlan, runs: int, scenario: Scenario) -> SimulationResult:
    _order_deadline_ties()
    call_tools_inline()  # a worker thread or a child process would race the virtual clock
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    lease_clock = _LeaseClock()
    store = MemoryStore(clock=lease_clock.now)
    world_seeds = [rng.randrange(2**32) for _ in range(runs)]
    worlds = [scenario.world(random.Random(ws), plan, counts) for ws in world_seeds]
    models = [_scripted_model(scenario, world) for world in worlds]
    threads = [
        f"sim-{seed}-{index}" if model is not None and plan.roll(rng, "thread") else None
        for index, model in enumerate(models)
    ]
    drive_seeds = [rng.randrange(2**32) for _ in range(runs)]
    run_ids = [
        thread_run_id(thread, 2) if thread else f"sim-{seed}-{index}"
        for index, thread in enumerate(threads)
    ]
    for thread, model in zip(threads, models, strict=True):
        if thread is not None and model is not None:
            _count(counts, "thread")
            model.turn_offset = 1
    # The twins first: how many writes each run takes without faults sets where its
    # crashes, store errors and takeovers may land (`_Driver._write_number`).
    twins = [
        await _fault_free_twin(scenario, plan, world_seeds[index], run_ids[index], threads[index])
        for index in range(runs)
    ]
    drivers = []
    async with one_error(), trio.open_nursery() as nursery:
        for index in range(runs):
            driver = _Driver(
                scenario=scenario,
                run_id=run_ids[index],
                world=worlds[index],
                store=store,
                plan=plan,
                rng=random.Random(drive_seeds[index]),
                counts=counts,
                lease_clock=lease_clock,
                thread=threads[index],
                expected_writes=twins[index].writes,
            )
            drivers.append(driver)
            nursery.start_soon(driver.drive)
    logs = [await store.read_log(run_id) for run_id in run_ids]
    violations: list[str] = []
    for index, log in enumerate(logs):
        violations.extend(drivers[index].violations())
        budgets = scenario.agent(worlds[index]).budgets
        violations.extend(check_invariants(log, budgets=budgets, time_slack_s=VIRTUAL_TIME_SLACK_S))
        violations.extend(scenario.check(log, worlds[index]))
        model = models[index]
        if model is not None:
            violations.extend(_unanswered_calls(run_ids[index], model))
        thread = threads[index]
        if thread is not None and model is not None:
            violations.extend(await _inherited(store, thread, run_ids[index], model))
        violations.extend(_compare_with_twin(log, twins[index].log, scenario))
    violations.extend(await check_child_runs(store, logs))
    return SimulationResult(
        seed=seed,
        ok=not violations,
        violations=tuple(violations),
        faults_injected=dict(sorted(counts.items())),
        steps=sum(len(log.steps) for log in logs),
        log_digest=log_digest(logs),
        logs=tuple(logs),
        skipped=tuple(
            _skipped(run_id, plan)
            for run_id, model in zip(run_ids, models, strict=True)
            if model is None
        ),
    )


def _scripted_model(scenario: Scenario, world: Any) -> ScriptedModel | None:
    """The world's model provider, when the simulation can follow its requests.

    That is the agent's ``model`` when it is a `ScriptedModel` the world holds: every
    ``scenario.agent(world)`` gives the same one (docs/simulation.md, "Simulating your own
    agent"). Its requests are checked for unanswered tool calls, and a run on it can
    continue a thread (its ``turn_offset`` skips the inherited turn).
    """
    first, second = scenario.agent(world).model, scenario.agent(world).model
    return first if isinstance(first, ScriptedModel) and first is second else None


def _skipped(run_id: str, plan: FaultPlan) -> str:
    """What was not done for a run whose world's model is no shared `ScriptedModel`."""
    thread = " and it did not continue a thread" if plan.rates.get("thread", 0) > 0 else ""
    return (
        f"{run_id}: the agent's model is not one ScriptedModel held by the world, so its "
        f"requests were not checked for unanswered tool calls{thread}"
    )


THREAD_FIRST_ANSWER = "Noted; ask me again."
"""The final answer of a simulated thread's first run (its only step)."""


async def _start_thread(store: Any, scenario: Scenario, world: Any, thread: str) -> None:
    """Drive thread ``thread``'s first run to its end, without faults (once per thread)."""
    if (await store.read_log(thread)).finished is not None:
        return
    first = attrs.evolve(
        scenario.agent(world), model=ScriptedModel(turns=[say(THREAD_FIRST_ANSWER)])
    )
    async with open_run(
        first,
        "earlier",
        store=store,
        run_id=thread,
        clock=FixedStepClock(),
        rng=random.Random(0),
        control_poll_s=None,
        actors=_scenario_actors(scenario, world),
    ) as handle:
        pass
    await handle.wait()


def _count(counts: dict[str, int], kind: str) -> None:
    counts[kind] = counts.get(kind, 0) + 1


@attrs.define(eq=False)
class _Approver:
    """The simulated human who decides a run's approval requests (outside our process).

    It looks at the run's pending request every `APPROVER_POLL_S`, waits the scenario's
    delay, and decides through the handle or the control log. Its memory of which calls
    already went through a restart survives the driving process's crashes.
    """

    scenario: Scenario
    world: Any
    run_id: str
    store: MemoryStore
    may_restart: bool
    clock: FixedStepClock = attrs.Factory(FixedStepClock)
    restarted: set[str] = attrs.Factory(set)

    async def serve(self, handle: RunHandle) -> None:
        """Answer each request the run waits on, until cancelled."""
        ask = getattr(self.scenario, "approval", None)
        while True:
            request = handle.pending_approval
            if request is None:
                await trio.sleep(APPROVER_POLL_S)
                continue
            plan: ApprovalPlan | None = ask(self.world, request) if ask is not None else None
            if plan is not None:
                await self._answer(handle, request, plan)
            await self._until_answered(handle, request)

    async def _answer(
        self, handle: RunHandle, request: ApprovalRequested, plan: ApprovalPlan
    ) -> None:
        restart = plan.restart and self.may_restart and request.call_id not in self.restarted
        if restart and plan.via == "handle":
            await self._deliberate(handle, request, plan.delay_s / 2)
            self.restarted.add(request.call_id)
            raise SimulatedCrash("the process died while the run awaited approval")
        await self._deliberate(handle, request, plan.delay_s)
        reject = plan.message if plan.decision == Decision.REJECT else None
        edit = plan.edit if plan.decision == Decision.EDIT else None
        if edit is not None:
            await self._check_edit(request, edit)
        try:
            if plan.via == "control":
                await decide(
                    self.store,
                    self.run_id,
                    call_id=request.call_id,
                    reject=reject,
                    edit=edit,
                    clock=self.clock,
                )
            else:
                handle.approve(request.call_id, reject=reject, edit=edit)
        except UsageError:
            return  # too late: the deadline (or a cancel) ended the wait first
        if restart:
            self.restarted.add(request.call_id)
            raise SimulatedCrash("the process died right after the decision was written")

    async def _check_edit(self, request: ApprovalRequested, edit: Mapping[str, Any]) -> None:
        """Refuse a scenario's edit that no run would take, whenever it comes.

        The run would refuse it too, with the same `UsageError`, which the approver must not
        mistake for lateness (docs/simulation.md, "Simulating your own agent").

        Raises:
            UsageError: the edited arguments do not fit the tool's schema (or are no JSON
                data): the scenario's `ApprovalPlan` is wrong.
        """
        log = await self.store.read_log(self.run_id)
        try:
            decision_for(
                self.run_id,
                request,
                self.clock,
                edit=edit,
                snapshot=current_snapshot(log),
                redaction=Redaction.of_log(log),
            )
        except UsageError as exc:
            raise UsageError(
                f"simulate: the scenario's ApprovalPlan edits call {request.call_id!r} of "
                f"{request.tool} with arguments the run refuses: {exc}"
            ) from exc

    async def _deliberate(
        self, handle: RunHandle, request: ApprovalRequested, delay_s: float
    ) -> None:
        """Take ``delay_s``, or less when the wait ends first (the decision is then late).

        Each request's delay counts from when it appears, however late the previous
        decision was: the human is not a queue.
        """
        with trio.move_on_after(delay_s):
            await self._until_answered(handle, request)

    @staticmethod
    async def _until_answered(handle: RunHandle, request: ApprovalRequested) -> None:
        while True:
            pending = handle.pending_approval
            if pending is None or (pending.step, pending.call_id) != (
                request.step,
                request.call_id,
            ):
                return
            await trio.sleep(APPROVER_POLL_S)


@attrs.define(eq=False)
class _Driver:
    """Drives one run through crashes (each one a "process restart") until it finishes.

    ``expected_writes`` is the number of store writes the run's fault-free twin made (its
    child runs' included): the writes a crash, store error or takeover is drawn from.
    """

    scenario: Scenario
    run_id: str
    world: Any
    store: MemoryStore
    plan: FaultPlan
    rng: random.Random
    counts: dict[str, int]
    lease_clock: _LeaseClock
    thread: str | None = None
    expected_writes: int = 1
    interruptions: list[str] = attrs.Factory(list)
    gave_up: bool = False

    async def drive(self) -> None:
        """Run incarnations until one ends the run (or `MAX_RESTARTS` is reached).

        An incarnation interrupted by something other than an injected fault (a bug in a
        tool's ``reconcile``, an actor that raised) is noted in `interruptions`; when the
        driver gives up, `gave_up` is set (see `violations`).
        """
        if self.thread is not None:
            await _start_thread(self.store, self.scenario, self.world, self.thread)
        clock = FixedStepClock()
        approver = _Approver(
            scenario=self.scenario,
            world=self.world,
            run_id=self.run_id,
            store=self.store,
            may_restart=True,
        )
        for _attempt in range(MAX_RESTARTS):
            faulty = self._faulty_store()
            cancel = self._cancelling(faulty)
            store = faulty if cancel is None else cancel
            # Each incarnation is a fresh process: a new agent (actors, tool objects) on the
            # same world (environment and provider).
            agent = _scenario_agent(self.scenario, self.world, store)
            try:
                async with open_run(
                    agent,
                    self.scenario.input(self.world),
                    store=store,
                    run_id=self.run_id,
                    clock=clock,
                    rng=random.Random(self.rng.randrange(2**32)),
                    control_poll_s=CONTROL_POLL_S,
                    actors=self._actors(),
                    thread_id=self.thread,
                ) as handle:
                    await _watch(handle, cancel, approver, self._on_cancel)
            except (RunInterrupted, StoreError, SimulatedCrash, ModelCallError, LeaseError) as exc:
                # the process died: the next incarnation resumes from the log
                if not self._count_fired(faulty) and not isinstance(exc, SimulatedCrash):
                    self.interruptions.append(f"{type(exc).__name__}: {exc}")
                continue
            self._count_fired(faulty)
            return
        self.gave_up = True

    def violations(self) -> list[str]:
        """Why the driver gave up on its run, if it did: the restarts and their causes.

        The causes are the interruptions that were no injected fault, each with how often
        it happened (an injected crash, store error or takeover is expected, and counted in
        ``faults_injected`` instead).
        """
        if not self.gave_up:
            return []
        causes = collections.Counter(self.interruptions)
        named = "; ".join(f"{cause} (x{n})" for cause, n in causes.most_common())
        return [
            f"{self.run_id}: the driver gave up after {MAX_RESTARTS} restarts; "
            + (
                f"what interrupted its runs, not an injected fault: {named}"
                if named
                else "every incarnation was stopped by an injected fault"
            )
        ]

    def _on_cancel(self) -> None:
        _count(self.counts, "cancel")

    def _count_fired(self, faulty: Any) -> bool:
        """Count the fault ``faulty`` injected, if it fired; whether it did."""
        kind = _fired(faulty)
        if kind is not None:
            _count(self.counts, kind)
        return kind is not None

    def _faulty_store(self) -> Any:
        if self.plan.roll(self.rng, "crash"):
            crash_at = self._write_number()
            after = self.rng.random() < 0.5
            return CrashingStore(
                inner=self.store, crash_at=crash_at, when="after" if after else "before"
            )
        if self.plan.roll(self.rng, "store_error"):
            return FailingStore(inner=self.store, fail_at=self._write_number())
        if self.plan.roll(self.rng, "takeover"):
            at = self._write_number(least=2)
            return _TakenOver(inner=self.store, at=at, clock=self.lease_clock)
        return self.store

    def _cancelling(self, faulty: Any) -> _CancelAt | None:
        """``faulty`` cancelling the run after one of its writes, when the cancel fault rolls.

        The write is drawn uniformly from the writes of the whole fault-free run, as a
        crash's (`_write_number`), but its last, the run's finish: a cancel lands between
        steps, in a model call or a tool call, late in a long run as often as early, whatever
        virtual time the run spends (docs/simulation.md, "Faults").
        """
        if not self.plan.roll(self.rng, "cancel"):
            return None
        before_last = self.rng.randrange(1, max(self.expected_writes - 1, 1) + 1)
        return _CancelAt(inner=faulty, run_id=self.run_id, at=before_last)

    def _write_number(self, least: int = 1) -> int:
        """The write of an incarnation a fault hits (counted from 1, its child runs' included).

        Drawn uniformly from ``least`` to the writes of the whole fault-free run
        (`expected_writes`), so faults land anywhere in a run of any length (docs/simulation.md,
        "Faults"). An incarnation that resumed has fewer writes left: a write drawn beyond its
        last is never reached, and the run goes on unfaulted.
        """
        return self.rng.randrange(least, max(self.expected_writes, least) + 1)

    def _actors(self) -> Actors:
        """The scenario's actors; the gateway and executor behind seeded latency when on."""
        base = _scenario_actors(self.scenario, self.world)
        rate = self.plan.rates.get("latency", 0.0)
        if rate <= 0:
            return base
        counts = self.counts

        def on_delay(_seconds: float) -> None:
            _count(counts, "latency")

        return attrs.evolve(
            base,
            gateway=with_latency(
                base.gateway,
                seed=self.rng.randrange(2**32),
                rate=rate,
                on_delay=on_delay,
            ),
            executor=with_latency(
                base.executor,
                seed=self.rng.randrange(2**32),
                rate=rate,
                on_delay=on_delay,
            ),
        )


def _fired(faulty: Any) -> str | None:
    """The fault kind an incarnation's store injected, if its fault point was reached.

    A crash or store error planned for a write the incarnation never made, or a takeover
    at such a write, was not injected (docs/simulation.md, "Faults").
    """
    if isinstance(faulty, CrashingStore):
        return "crash" if faulty.crashed else None
    if isinstance(faulty, FailingStore):
        return "store_error" if faulty.failed_runs else None
    if isinstance(faulty, _TakenOver):
        return "takeover" if faulty.writes >= faulty.at else None
    return None


async def _watch(
    handle: RunHandle,
    cancel: _CancelAt | None,
    approver: _Approver,
    on_cancel: Callable[[], None] | None = None,
) -> None:
    """Wait for the run while the human decides and the cancel fault fires.

    The run is cancelled right after ``cancel``'s write reached the store. ``on_cancel`` is
    called when the run took the cancel in: it ended cancelled, or this incarnation ended
    unfinished after the cancel (a crash, a store error). A cancel that came after the run
    ended, or while it finished otherwise (after the step that answered, which ends it at
    once), is not counted.
    """
    sent = False

    def cancel_run() -> None:
        nonlocal sent
        if handle.result is None:
            handle.cancel("simulated cancel")
            sent = True

    try:
        async with one_error(), trio.open_nursery() as nursery:
            nursery.start_soon(approver.serve, handle)
            if cancel is not None:
                cancel.arm(cancel_run)
            await handle.wait()
            nursery.cancel_scope.cancel()
    finally:
        ended = handle.result
        if sent and on_cancel is not None and (ended is None or ended.state is RunState.CANCELLED):
            on_cancel()


@attrs.frozen
class _Twin:
    """A run's fault-free twin: its log, and the store writes it made (its children's too)."""

    log: RunLog
    writes: int


class _CountingStore(InterceptingStore):
    """Forwards to ``inner``, counting the log writes (`writes`)."""

    writes: int = 0

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        """Count the write."""
        self.writes += 1
        return False


async def _fault_free_twin(
    scenario: Scenario, plan: FaultPlan, world_seed: int, run_id: str, thread: str | None
) -> _Twin:
    """The same world (model and tool faults, approvals included), without crashes or cancels.

    The world is built anew from ``world_seed``, as the simulated run's was.
    """
    world = scenario.world(random.Random(world_seed), plan, {})
    model = _scripted_model(scenario, world)
    if thread is not None and model is not None:
        model.turn_offset = 1
    bare = MemoryStore()
    if thread is not None:
        await _start_thread(bare, scenario, world, thread)
    store = _CountingStore(bare)
    approver = _Approver(
        scenario=scenario, world=world, run_id=run_id, store=bare, may_restart=False
    )
    async with open_run(
        _scenario_agent(scenario, world, store),
        scenario.input(world),
        store=store,
        run_id=run_id,
        clock=FixedStepClock(),
        rng=random.Random(0),
        control_poll_s=CONTROL_POLL_S,
        actors=_scenario_actors(scenario, world),
        thread_id=thread,
    ) as handle:
        await _watch(handle, None, approver)
    return _Twin(log=await bare.read_log(run_id), writes=store.writes)


def run_seeds(
    seeds: Iterable[int],
    *,
    plan: FaultPlan | None = None,
    runs: int = 1,
    steps: int = 10,
    scenario: Scenario | None = None,
    on_result: Callable[[SimulationResult], None] | None = None,
) -> list[SimulationResult]:
    """Simulate every seed in turn (see `simulate`); ``on_result`` sees each as it ends.

    Raises:
        UsageError: ``seeds`` is a single seed, not an iterable of them (``range(5)`` for
            five), an argument `simulate` refuses, or it is called inside a trio run.
    """
    _refuse_inside_trio("run_seeds")
    if not isinstance(seeds, Iterable) or isinstance(seeds, str | bytes):
        raise UsageError(
            f"run_seeds: seeds must be an iterable of ints (e.g. range(5)), not {seeds!r}"
        )
    results = []
    for seed in seeds:
        result = simulate(seed, plan=plan, runs=runs, steps=steps, scenario=scenario)
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results
