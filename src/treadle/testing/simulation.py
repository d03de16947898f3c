"""Deterministic simulation of runs under a seeded fault plan, with invariant checks.

`simulate(seed)` runs one or more scripted runs on trio's virtual clock (``MockClock`` with
autojump), drives them through the real actors and a memory store, injects the faults of a
`FaultPlan` chosen from the seed (process crashes before or after store writes, store write
failures, model errors, tool exceptions, timeouts, ENV_ERROR, cancellation), resumes every
crashed run from its log as a restarted process would, and checks the invariants of DESIGN
§4–§6 on what was written (`check_invariants`). The same seed gives a byte-identical log: ids
and timestamps come from an injected clock and the run's seeded random source, and trio's own
scheduling randomness is seeded too.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
import trio
import trio.testing

from treadle._clock import FixedStepClock
from treadle._exceptions import ModelCallError, RunInterrupted, StoreError
from treadle.agent import Agent, RunInput
from treadle.parsers import NativeToolCallParser
from treadle.stores._codec import encode
from treadle.stores.memory import MemoryStore
from treadle.supervisors.run import open_run
from treadle.testing.faults import CrashingStore, FailingStore, SimulatedCrash
from treadle.testing.scripted import STALLED, ScriptedModel, call, say
from treadle.tools import EnvironmentFailure, Toolbox, ToolContext, tool
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Budgets,
    Limits,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelResult,
    ReplayPolicy,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
)

FAULT_KINDS = (
    "crash",
    "store_error",
    "model_429",
    "model_5xx",
    "model_reset",
    "model_truncated",
    "model_stalled",
    "model_context_length",
    "tool_exception",
    "tool_timeout",
    "env_error",
    "cancel",
)
"""Every fault kind a `FaultPlan` can switch on."""

MAX_RESTARTS = 20
"""Crashes a simulated run may go through before the simulation gives up on it."""


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Which faults are on and how often (probability per opportunity, 0..1).

    Attributes:
        rates: fault kind -> rate. A kind not present is off.
    """

    rates: dict[str, float] = attrs.field(factory=dict)

    @classmethod
    def default(cls) -> FaultPlan:
        """Every kind on, at rates that let most runs reach their end.

        Crashes are frequent (0.5 per process incarnation); fatal model and environment
        faults are rare.
        """
        return cls(
            rates={
                "crash": 0.5,
                "store_error": 0.1,
                "model_429": 0.05,
                "model_5xx": 0.05,
                "model_reset": 0.05,
                "model_truncated": 0.05,
                "model_stalled": 0.03,
                "model_context_length": 0.01,
                "tool_exception": 0.1,
                "tool_timeout": 0.05,
                "env_error": 0.02,
                "cancel": 0.05,
            }
        )

    @classmethod
    def of(cls, kinds: Iterable[str] = FAULT_KINDS, *, rate: float = 0.1) -> FaultPlan:
        """A plan with ``kinds`` switched on at ``rate``.

        Raises:
            ValueError: an unknown kind, or a rate outside 0..1.
        """
        kinds = tuple(kinds)
        unknown = sorted(set(kinds) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds: {', '.join(unknown)}")
        if not 0 <= rate <= 1:
            raise ValueError(f"rate must be within 0..1, got {rate}")
        return cls(rates=dict.fromkeys(kinds, rate))

    def roll(self, rng: random.Random, kind: str) -> bool:
        """Whether fault ``kind`` happens at this opportunity."""
        rate = self.rates.get(kind, 0.0)
        return rate > 0 and rng.random() < rate


@attrs.define(eq=False)
class Ledger:
    """The simulated environment's side effects, which survive every crash.

    Attributes:
        effects: intent id -> how many times a ``never``-policy tool applied its effect.
    """

    effects: dict[str, int] = attrs.Factory(dict)
    total: int = 0


@attrs.frozen(kw_only=True)
class SimulationResult:
    """The outcome of one seed.

    Attributes:
        seed: the seed.
        ok: no invariant was violated.
        violations: what broke, one sentence each.
        faults_injected: fault kind -> count.
        steps: steps over all runs.
        log_digest: sha256 of every run's encoded log, in run order.
    """

    seed: int
    ok: bool
    violations: tuple[str, ...]
    faults_injected: dict[str, int]
    steps: int
    log_digest: str

    def to_json(self) -> dict[str, Any]:
        """The JSON line `treadle simulate` prints."""
        return {
            "seed": self.seed,
            "ok": self.ok,
            "violations": list(self.violations),
            "faults_injected": self.faults_injected,
            "steps": self.steps,
            "log_digest": self.log_digest,
        }


def _ledger_tools(ledger: Ledger) -> Toolbox:
    async def reconcile(action: Action) -> ActionOutcome | None:
        await trio.lowlevel.checkpoint()
        if ledger.effects.get(action.intent_id):
            return ActionOutcome(status=ActionStatus.EXECUTED, observation="deposit applied")
        return None

    @tool(reconcile=reconcile)
    async def deposit(amount: int, ctx: ToolContext) -> str:
        """Add ``amount`` to the account (a side effect that must happen at most once)."""
        ledger.effects[ctx.intent_id] = ledger.effects.get(ctx.intent_id, 0) + 1
        ledger.total += amount
        return f"balance {ledger.total}"

    @tool(replay=ReplayPolicy.SAFE)
    async def balance() -> str:
        """Read the balance."""
        return f"balance {ledger.total}"

    @tool
    async def flaky(fail: bool) -> str:
        """A tool that raises when asked to."""
        if fail:
            raise RuntimeError("flaky tool failed")
        return "fine"

    @tool
    async def slow(seconds: float) -> str:
        """A tool that takes ``seconds`` (virtual)."""
        await trio.sleep(seconds)
        return "slow done"

    @tool
    async def outage(down: bool) -> str:
        """A tool whose environment can go away."""
        if down:
            raise EnvironmentFailure("the environment is gone")
        return "up"

    @tool(completes_task=True)
    async def finish() -> str:
        """Mark the task done."""
        return "done"

    return Toolbox([deposit, balance, flaky, slow, outage, finish], default_timeout_s=5.0)


@attrs.define(eq=False)
class _Script:
    """The scripted conversation and its injected model failures for one run."""

    turns: list[ModelReply]
    failures: dict[int, list[ModelErrorInfo]]


_MODEL_FAULTS: dict[str, ModelErrorInfo] = {
    "model_429": ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=2.0, status=429),
    "model_5xx": ModelErrorInfo(kind="server_error", retryable=True, status=503),
    "model_reset": ModelErrorInfo(kind="connection", retryable=True),
    "model_truncated": ModelErrorInfo(kind="incomplete_stream", retryable=True),
    "model_stalled": ModelErrorInfo(kind=STALLED),
    "model_context_length": ModelErrorInfo(kind="context_length_exceeded", status=400),
}


def _script(rng: random.Random, plan: FaultPlan, counts: dict[str, int], steps: int) -> _Script:
    turns: list[ModelReply] = []
    failures: dict[int, list[ModelErrorInfo]] = {}
    for turn in range(steps):
        turns.append(_turn(rng, plan, counts, turn))
        for kind, info in _MODEL_FAULTS.items():
            if plan.roll(rng, kind):
                failures.setdefault(turn, []).append(info)
                counts[kind] = counts.get(kind, 0) + 1
    turns.append(call("finish", call_id="c-finish") if rng.random() < 0.5 else say("all done"))
    return _Script(turns=turns, failures=failures)


def _turn(rng: random.Random, plan: FaultPlan, counts: dict[str, int], turn: int) -> ModelReply:
    for kind, name, arguments in (
        ("tool_exception", "flaky", {"fail": True}),
        ("tool_timeout", "slow", {"seconds": 60.0}),
        ("env_error", "outage", {"down": True}),
    ):
        if plan.roll(rng, kind):
            counts[kind] = counts.get(kind, 0) + 1
            return call(name, call_id=f"c{turn}", **arguments)
    if rng.random() < 0.3:
        return call("balance", call_id=f"c{turn}")
    return call("deposit", call_id=f"c{turn}", amount=rng.randrange(1, 100))


def _model(script: _Script) -> ScriptedModel:
    """The simulated provider.

    It belongs to the environment, so its state (which scripted failures it already served)
    survives our process's crashes.
    """
    return ScriptedModel(turns=script.turns, failures=script.failures, latency_s=0.05)


def _agent(model: ScriptedModel, ledger: Ledger, max_steps: int) -> Agent:
    return Agent(
        model=model,
        executor=_ledger_tools(ledger),
        parser=NativeToolCallParser(),
        model_name="simulated",
        budgets=Budgets(max_steps=max_steps, max_model_attempts=max_steps * 4, time_budget_s=600),
        limits=Limits(
            tool_timeout_s=5.0, retry_initial_s=0.5, retry_max_s=4.0, model_attempt_s=30.0
        ),
    )


class Scenario(Protocol):
    """What a simulation runs: users implement this to simulate their own agents and tools.

    A *world* is everything outside our process: the environment the tools act on and the
    model provider. It survives every simulated crash; each process incarnation builds a
    fresh `Agent` on it.
    """

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Any:
        """Build a world from ``rng``, injecting the plan's model and tool faults into it.

        Each injected fault is counted in ``counts`` (kind -> count).

        The same ``rng`` state must give the same world (the fault-free twin is built so).
        """
        ...

    def agent(self, world: Any) -> Agent:
        """A fresh agent definition acting on ``world`` (one per process incarnation)."""
        ...

    def input(self, world: Any) -> RunInput:
        """The run's input."""
        ...

    def check(self, log: RunLog, world: Any) -> list[str]:
        """Scenario invariants, one sentence per violation.

        For example: no ``never``-policy effect applied twice, read off the world's ledger.
        """
        ...

    def changed_observation(self, result: ActionResult) -> bool:
        """Whether ``result`` was established by ``reconcile`` after a crash.

        The model then saw something its fault-free twin did not.
        """
        ...


@attrs.define(eq=False)
class _LedgerWorld:
    script: _Script
    provider: ScriptedModel
    ledger: Ledger


@attrs.frozen(kw_only=True)
class LedgerScenario:
    """The built-in scenario: ``steps`` scripted steps, then a final answer or completion.

    Tools: deposits to a ledger (``never`` policy with a reconcile check), balance reads
    (``safe``), a flaky tool, a slow tool, an environment outage, and a completion tool.
    """

    steps: int = 10

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Any:
        """A scripted provider and an empty ledger."""
        script = _script(rng, plan, counts, self.steps)
        return _LedgerWorld(script=script, provider=_model(script), ledger=Ledger())

    def agent(self, world: Any) -> Agent:
        """The ledger agent on ``world``."""
        return _agent(world.provider, world.ledger, self.steps + 2)

    def input(self, world: Any) -> RunInput:
        """A fixed instruction."""
        return "simulate"

    def check(self, log: RunLog, world: Any) -> list[str]:
        """No deposit applied twice; no more steps than the budget."""
        problems = check_invariants(log, ledger=world.ledger, max_steps=self.steps + 2)
        return [p for p in problems if "applied twice" in p or "exceed" in p]

    def changed_observation(self, result: ActionResult) -> bool:
        """The deposit's reconcile text marks an outcome established after a crash."""
        return result.outcome.observation == "deposit applied"


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
    """
    plan = plan if plan is not None else FaultPlan.default()
    scenario = scenario if scenario is not None else LedgerScenario(steps=steps)
    trio._core._run._r.seed(seed)  # trio's own scheduling randomness (see module docstring)
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(_simulate, seed, plan, runs, scenario, clock=clock)


async def _simulate(seed: int, plan: FaultPlan, runs: int, scenario: Scenario) -> SimulationResult:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    store = MemoryStore()
    world_seeds = [rng.randrange(2**32) for _ in range(runs)]
    worlds = [scenario.world(random.Random(ws), plan, counts) for ws in world_seeds]
    drive_seeds = [rng.randrange(2**32) for _ in range(runs)]
    run_ids = [f"sim-{seed}-{index}" for index in range(runs)]
    async with trio.open_nursery() as nursery:
        for index in range(runs):
            nursery.start_soon(
                _drive,
                scenario,
                run_ids[index],
                worlds[index],
                store,
                plan,
                random.Random(drive_seeds[index]),
                counts,
            )
    logs = [await store.read_log(run_id) for run_id in run_ids]
    violations: list[str] = []
    for index, log in enumerate(logs):
        violations.extend(check_invariants(log))
        violations.extend(scenario.check(log, worlds[index]))
        twin_world = scenario.world(random.Random(world_seeds[index]), plan, {})
        twin = await _fault_free_twin(scenario, run_ids[index], twin_world)
        violations.extend(_compare_with_twin(log, twin, scenario))
    return SimulationResult(
        seed=seed,
        ok=not violations,
        violations=tuple(violations),
        faults_injected=dict(sorted(counts.items())),
        steps=sum(len(log.steps) for log in logs),
        log_digest=log_digest(logs),
    )


def log_digest(logs: Iterable[RunLog]) -> str:
    """sha256 over every record of ``logs``, encoded as stored, in order."""
    digest = hashlib.sha256()
    for log in logs:
        for record in log.records:
            digest.update(encode(record).encode("utf-8"))
            digest.update(b"\n")
    return digest.hexdigest()


async def _drive(
    scenario: Scenario,
    run_id: str,
    world: Any,
    store: MemoryStore,
    plan: FaultPlan,
    rng: random.Random,
    counts: dict[str, int],
) -> None:
    """Drive one run through crashes (each one a "process restart") until it finishes."""
    clock = FixedStepClock()
    for _attempt in range(MAX_RESTARTS):
        faulty: Any = store
        if plan.roll(rng, "crash"):
            counts["crash"] = counts.get("crash", 0) + 1
            crash_at = rng.randrange(1, 40)
            after = rng.random() < 0.5
            faulty = CrashingStore(
                inner=store, crash_at=crash_at, when="after" if after else "before"
            )
        elif plan.roll(rng, "store_error"):
            counts["store_error"] = counts.get("store_error", 0) + 1
            faulty = FailingStore(inner=store, fail_at=rng.randrange(1, 40))
        cancel_after = rng.uniform(0.0, 2.0) if plan.roll(rng, "cancel") else None
        if cancel_after is not None:
            counts["cancel"] = counts.get("cancel", 0) + 1
        # Each incarnation is a fresh process: a new agent (actors, tool objects) on the same
        # world (environment and provider).
        agent = scenario.agent(world)
        try:
            await _incarnation(
                agent, scenario.input(world), run_id, faulty, clock, rng, cancel_after
            )
        except (RunInterrupted, StoreError, SimulatedCrash, ModelCallError):
            continue  # the process died: the next incarnation resumes from the log
        return


async def _incarnation(
    agent: Agent,
    run_input: RunInput,
    run_id: str,
    store: Any,
    clock: FixedStepClock,
    rng: random.Random,
    cancel_after: float | None,
) -> None:
    async with open_run(
        agent,
        run_input,
        store=store,
        run_id=run_id,
        clock=clock,
        rng=random.Random(rng.randrange(2**32)),
    ) as handle:
        if cancel_after is not None:
            with trio.move_on_after(cancel_after):
                await handle.wait()
            handle.cancel("simulated cancel")
        await handle.wait()


async def _fault_free_twin(scenario: Scenario, run_id: str, world: Any) -> RunLog:
    """The same world (model and tool faults included), run without crashes or cancels."""
    store = MemoryStore()
    async with open_run(
        scenario.agent(world),
        scenario.input(world),
        store=store,
        run_id=run_id,
        clock=FixedStepClock(),
        rng=random.Random(0),
    ) as handle:
        await handle.wait()
    return await store.read_log(run_id)


def _trajectory(log: RunLog) -> list[tuple[Any, ...]]:
    return [(s.decision, s.history_message, s.observations) for s in log.steps]


def _compare_with_twin(log: RunLog, twin: RunLog, scenario: Scenario) -> list[str]:
    """Where the faults did not change what the model saw, the trajectory is the twin's.

    An action whose outcome was reconciled or recorded as unknown after a crash changes
    what the model saw from its step on, and a cancel ends the run early: the comparison
    covers the steps before either.
    """
    changed_at = min(
        (
            r.step
            for r in log.records
            if isinstance(r, ActionResult)
            and (r.outcome.status is ActionStatus.UNKNOWN or scenario.changed_observation(r))
        ),
        default=None,
    )
    ours, theirs = _trajectory(log), _trajectory(twin)
    cancelled = log.finished is not None and log.finished.stop_reason.value == "cancelled"
    limit = len(ours) if changed_at is None else changed_at - 1
    if cancelled:
        limit = min(limit, len(ours))
    elif changed_at is None and len(ours) != len(theirs):
        return [f"{log.run_id}: {len(ours)} steps, its fault-free twin took {len(theirs)}"]
    for index in range(min(limit, len(theirs))):
        if ours[index] != theirs[index]:
            return [f"{log.run_id}: step {index + 1} differs from the fault-free twin's"]
    return []


def check_invariants(
    log: RunLog, *, ledger: Ledger | None = None, max_steps: int | None = None
) -> list[str]:
    """Check a finished run's log (and its environment's ledger) against DESIGN §4–§6.

    Returns:
        One sentence per violation; empty when every invariant holds.
    """
    problems: list[str] = []
    records = log.records
    if not records or not isinstance(records[0], RunStarted):
        return [f"{log.run_id}: the log does not start with run-started"]
    problems.extend(_results_have_intents(log.run_id, records))
    problems.extend(_steps_contiguous(log.run_id, records))
    finished = [r for r in records if isinstance(r, RunFinished)]
    if len(finished) != 1 or not isinstance(records[-1], RunFinished):
        problems.append(f"{log.run_id}: expected exactly one run-finished, last ({len(finished)})")
    elif not finished[0].state.is_terminal:
        problems.append(f"{log.run_id}: finished in a non-terminal state {finished[0].state}")
    if max_steps is not None and len(log.steps) > max_steps:
        problems.append(f"{log.run_id}: {len(log.steps)} steps exceed the budget of {max_steps}")
    if ledger is not None:
        twice = sorted(k for k, n in ledger.effects.items() if n > 1)
        if twice:
            problems.append(f"{log.run_id}: never-policy actions applied twice: {twice}")
    return problems


def _results_have_intents(run_id: str, records: Sequence[Any]) -> list[str]:
    problems: list[str] = []
    model_intents: set[str] = set()
    action_intents: set[str] = set()
    for index, record in enumerate(records):
        if isinstance(record, ModelIntent):
            model_intents.add(record.intent_id)
        elif isinstance(record, ActionIntent):
            action_intents.add(record.intent_id)
        elif isinstance(record, ModelResult) and record.intent_id not in model_intents:
            problems.append(f"{run_id}: model result {record.intent_id} has no intent")
        elif isinstance(record, ActionResult):
            if record.intent_id not in action_intents:
                problems.append(f"{run_id}: action result {record.intent_id} has no intent")
            following = records[index + 1] if index + 1 < len(records) else None
            if not isinstance(following, ActionResult | StepRecord):
                problems.append(f"{run_id}: action result {record.intent_id} without step record")
    return problems


def _steps_contiguous(run_id: str, records: Sequence[Any]) -> list[str]:
    numbers = [r.step for r in records if isinstance(r, StepRecord)]
    if numbers != list(range(1, len(numbers) + 1)):
        return [f"{run_id}: step records are not contiguous: {numbers}"]
    return []


def run_seeds(
    seeds: Iterable[int],
    *,
    plan: FaultPlan | None = None,
    runs: int = 1,
    steps: int = 10,
    scenario: Scenario | None = None,
    on_result: Callable[[SimulationResult], None] | None = None,
) -> list[SimulationResult]:
    """Simulate every seed in turn (see `simulate`); ``on_result`` sees each as it ends."""
    results = []
    for seed in seeds:
        result = simulate(seed, plan=plan, runs=runs, steps=steps, scenario=scenario)
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results
