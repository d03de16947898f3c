"""Deterministic simulation of runs under a seeded fault plan, with invariant checks.

`simulate(seed)` runs one or more scripted runs on trio's virtual clock (``MockClock`` with
autojump), drives them through the real actors and a memory store, injects the faults of a
`FaultPlan` chosen from the seed (process crashes before or after store writes, store write
failures, model errors, tool exceptions, timeouts, ENV_ERROR, cancellation, approval decisions
at random delays, latency between the coordinator and the actors, runs that continue a
thread), resumes every crashed run
from its log as a restarted process would, and checks the invariants of docs/crash-safety.md on what
was written (`check_invariants`, from `treadle.testing.invariants`). The same seed gives a
byte-identical log: ids and timestamps come from an injected clock and the run's seeded random
source, and trio's own scheduling randomness is seeded too.

Actors are swapped through `treadle.Actors`: `with_latency` wraps any actor's factory so that
its requests arrive after a seeded delay on the virtual clock.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio
import trio.testing

from treadle._clock import FixedStepClock
from treadle._exceptions import LeaseError, ModelCallError, RunInterrupted, StoreError, UsageError
from treadle.actors._rpc import StepScope
from treadle.agent import Agent, RunInput
from treadle.approvals import Decision, decide
from treadle.parsers import NativeToolCallParser
from treadle.ports import RunStore
from treadle.stores._codec import encode
from treadle.stores._leases import LEASE_TTL_S
from treadle.stores.memory import MemoryStore
from treadle.supervisors.children import agent_tool, child_run_id
from treadle.supervisors.run import DEFAULT_ACTORS, Actors, InboxActor, RunHandle, open_run
from treadle.supervisors.threads import history, thread_run_id
from treadle.testing._intercept import InterceptingStore
from treadle.testing.faults import FAULT_KINDS as FAULT_KINDS
from treadle.testing.faults import CrashingStore, FailingStore, SimulatedCrash
from treadle.testing.invariants import TIME_SLACK_S as TIME_SLACK_S
from treadle.testing.invariants import EffectLedger as EffectLedger
from treadle.testing.invariants import _refused
from treadle.testing.invariants import check_approvals as check_approvals
from treadle.testing.invariants import check_budgets as check_budgets
from treadle.testing.invariants import check_invariants as check_invariants
from treadle.testing.invariants import check_tool_replies as check_tool_replies
from treadle.testing.scripted import STALLED, ScriptedModel, call, say
from treadle.tools import EnvironmentFailure, Tool, Toolbox, ToolContext, tool
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    Budgets,
    Limits,
    ModelErrorInfo,
    ModelReply,
    Record,
    ReplayPolicy,
    RunLog,
    StopReason,
    StoreOp,
    Usage,
)

APPROVAL_TIMEOUT_S = 20.0
"""The simulated agent's approval deadline (virtual seconds)."""

APPROVER_POLL_S = 0.5
"""Virtual seconds between two looks of the simulated human at the run's pending approval."""

CONTROL_POLL_S = 1.0
"""Virtual seconds between two reads of a simulated run's control log (decisions written
there are picked up within this long; the approval delays are far from the deadline)."""

LATENCY_MAX_S = 0.2
"""The longest delay `with_latency` adds to one request in the simulation (virtual seconds)."""

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
        faults are rare. ``approval`` is the rate of steps calling a tool that needs a human
        decision; ``latency`` the rate of requests to the gateway and executor delayed;
        ``takeover`` the rate of incarnations whose lease another driver takes over at a
        seeded write (the incarnation is refused and stops, as a paused process woken after a
        takeover would); ``thread`` the rate of simulated runs that continue a thread (see
        `FaultPlan.threads`); ``child_run`` the rate of steps handing a task to a child run
        (`treadle.agent_tool`, docs/child-runs.md), whose writes go through the same faulty
        store, so crashes, store errors, takeovers and cancels hit the child too.
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
                "tool_stuck": 0.03,
                "bad_text": 0.05,
                "env_error": 0.02,
                "cancel": 0.05,
                "approval": 0.1,
                "latency": 0.2,
                "takeover": 0.1,
                "child_run": 0.1,
                "thread": 0.2,
            }
        )

    @classmethod
    def compaction(cls) -> FaultPlan:
        """The faults that meet compaction: for `treadle.testing.windowed.ContextScenario`.

        Crashes at any write (so at every write of a summary's intent and result), failed
        store writes, lease takeovers, latency, retryable provider errors (a summary call
        retried), and ``model_context_length``: the provider's real window is smaller than
        the agent declares, so it refuses requests and the step compacts and retries
        (docs/context.md, "Context-length errors"). Every log is checked by
        `treadle.testing.invariants.check_context` besides the usual invariants.
        """
        return cls(
            rates={
                "crash": 0.7,
                "store_error": 0.1,
                "takeover": 0.1,
                "latency": 0.2,
                "model_5xx": 0.05,
                "model_context_length": 0.3,
            }
        )

    @classmethod
    def threads(cls) -> FaultPlan:
        """The default plan with every simulated run continuing a thread.

        Before such a run, its thread's first run (``sim-<seed>-<i>``, a final answer of the
        same agent) is driven to its end without faults; the simulated run is the thread's
        second (``sim-<seed>-<i>.2``), started with ``thread_id`` and resumed by its id
        after every crash. On top of the other checks, every request the model received in
        it must start with the first run's recorded history (docs/threads.md). Only worlds
        whose ``provider`` is a `treadle.testing.ScriptedModel` can be continued so (its
        ``turn_offset`` skips the inherited turn); others run as single runs.
        """
        default = cls.default()
        return cls(rates={**default.rates, "thread": 1.0})

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
    arguments: dict[str, dict[str, Any]] = attrs.Factory(dict)
    """intent id -> the arguments the effect was last applied with."""


@attrs.frozen(kw_only=True)
class ApprovalPlan:
    """How the simulated human decides one tool call that needs approval.

    Attributes:
        delay_s: virtual seconds from seeing the request to deciding. Longer than the
            agent's approval deadline means the deadline ends the wait first.
        decision: ``approve``, ``reject`` or ``edit``.
        via: ``handle`` (`RunHandle.approve`, in-process) or ``control`` (`decide` on the
            run's control log, as another process would).
        restart: the driving process dies once while the call waits (before the decision
            for ``handle``, right after writing it for ``control``); the next incarnation
            gets the decision.
        message: the rejection message.
        edit: the edited arguments.
    """

    delay_s: float
    decision: str = Decision.APPROVE.value
    via: str = "handle"
    restart: bool = False
    message: str = ""
    edit: Mapping[str, Any] | None = None


C_contra = TypeVar("C_contra", contravariant=True)


Q = TypeVar("Q")
C = TypeVar("C")


@attrs.define(eq=False)
class DelayedActor(Generic[Q]):
    """Forwards each request to ``inner`` after a seeded delay on the trio clock.

    A request that carries a step scope (model calls, actions) waits inside that scope: a
    cancel or the active-time deadline ends the wait, and the inner actor then sees the step
    cut exactly as if the request had come at once. Requests keep their order.

    Attributes:
        inner: the wrapped actor.
        rng: draws whether a request is delayed (probability ``rate``) and by how long
            (uniform in ``0..max_s`` seconds).
        on_delay: called with each delay drawn (e.g. to count injected faults).
    """

    inner: InboxActor[Q]
    rng: random.Random
    rate: float
    max_s: float
    on_delay: Callable[[float], None] | None = None

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[Q],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``inbox`` through the delay until it ends; then the inner actor ends too."""
        # 0: the inner actor takes one request at a time, like the coordinator's inboxes.
        send, recv = trio.open_memory_channel[Q](0)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.inner.run, recv)
            task_status.started()
            async with inbox, send:
                async for message in inbox:
                    await self._delay(message)
                    await send.send(message)

    async def _delay(self, message: Q) -> None:
        if not (self.rate > 0 and self.rng.random() < self.rate):
            return
        delay = self.rng.uniform(0.0, self.max_s)
        if self.on_delay is not None:
            self.on_delay(delay)
        scope = getattr(message, "scope", None)
        if isinstance(scope, StepScope):
            with scope.open():
                await trio.sleep(delay)
        else:
            await trio.sleep(delay)


def with_latency(
    factory: Callable[[C], InboxActor[Q]],
    *,
    seed: int,
    rate: float = 1.0,
    max_s: float = LATENCY_MAX_S,
    on_delay: Callable[[float], None] | None = None,
) -> Callable[[C], DelayedActor[Q]]:
    """Wrap an actor factory so its requests arrive after seeded delays (virtual seconds).

    Use on any role served from an inbox, e.g.
    ``Actors(gateway=with_latency(real_gateway, seed=7))``; the other actors stay as they
    are. The same seed draws the same delays for the same sequence of requests.

    Args:
        factory: the actor factory to wrap (e.g. `treadle.supervisors.run.real_gateway`).
        seed: seeds the delays.
        rate: the probability (0..1) that a request is delayed.
        max_s: the longest delay, seconds.
        on_delay: called with each delay drawn.

    Raises:
        ValueError: ``rate`` outside 0..1 or a negative ``max_s``.
    """
    if not 0 <= rate <= 1 or max_s < 0:
        raise ValueError(f"rate must be within 0..1 and max_s >= 0, got {rate}, {max_s}")

    def build(context: C) -> DelayedActor[Q]:
        return DelayedActor(
            inner=factory(context),
            rng=random.Random(seed),
            rate=rate,
            max_s=max_s,
            on_delay=on_delay,
        )

    return build


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


RECONCILED = "applied (reconciled)"
"""The observation of a ledger effect established by ``reconcile`` after a crash."""


def _ledger_tools(ledger: Ledger, *extra: Tool) -> Toolbox:
    async def reconcile(action: Action) -> ActionOutcome | None:
        await trio.lowlevel.checkpoint()
        if ledger.effects.get(action.intent_id):
            return ActionOutcome(status=ActionStatus.EXECUTED, observation=RECONCILED)
        return None

    def apply(intent_id: str, amount: int) -> None:
        ledger.effects[intent_id] = ledger.effects.get(intent_id, 0) + 1
        ledger.arguments[intent_id] = {"amount": amount}
        ledger.total += amount

    @tool(reconcile=reconcile)
    async def deposit(amount: int, ctx: ToolContext) -> str:
        """Add ``amount`` to the account (a side effect that must happen at most once)."""
        apply(ctx.intent_id, amount)
        return f"balance {ledger.total}"

    @tool(reconcile=reconcile, requires_approval=True)
    async def withdraw(amount: int, ctx: ToolContext) -> str:
        """Take ``amount`` from the account; a human approves, rejects or edits each call."""
        apply(ctx.intent_id, -amount)
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
    async def stuck(seconds: float) -> str:
        """A tool that ignores cancellation: it shields a wait of ``seconds`` (virtual)."""
        with trio.CancelScope(shield=True):
            await trio.sleep(seconds)
        return "stuck done"

    @tool(replay=ReplayPolicy.SAFE)
    async def listing(folder: str) -> str:
        """List a folder: a name decoded with surrogateescape is not valid Unicode."""
        return f"{folder}/caf\udce9.txt"

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

    return Toolbox(
        [deposit, withdraw, balance, flaky, slow, stuck, listing, outage, finish, *extra],
        default_timeout_s=5.0,
    )


CHILD_ANSWER = "the child deposited"
"""The final answer of every child run of the simulation (`FaultPlan` kind ``child_run``)."""


def _child_agent(world: _LedgerWorld) -> Agent:
    """The child agent of a ``delegate`` call: a deposit, a balance read, its answer.

    It acts on a ledger of its own, so that what a crash does to a child's effect (reconciled
    or unknown) never changes what the parent reads.
    """
    return attrs.evolve(
        _agent(world.child_provider, world.child_ledger, Budgets()),
        system_prompt="You deposit what you are asked to.",
    )


def _delegate(world: _LedgerWorld, store: RunStore) -> Tool:
    return agent_tool(
        _child_agent(world),
        store=store,
        name="delegate",
        description="Hand a task to a child agent.",
        control_poll_s=CONTROL_POLL_S,
    )


@attrs.define(eq=False)
class _Script:
    """The scripted conversation, its injected model failures, approvals and budgets."""

    turns: list[ModelReply]
    failures: dict[int, list[ModelErrorInfo]]
    approvals: dict[str, ApprovalPlan] = attrs.Factory(dict)
    budgets: Budgets = Budgets()


_MODEL_FAULTS: dict[str, ModelErrorInfo] = {
    "model_429": ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=2.0, status=429),
    "model_5xx": ModelErrorInfo(kind="server_error", retryable=True, status=503),
    "model_reset": ModelErrorInfo(kind="connection", retryable=True),
    "model_truncated": ModelErrorInfo(kind="incomplete_stream", retryable=True),
    "model_stalled": ModelErrorInfo(kind=STALLED),
    "model_context_length": ModelErrorInfo(kind="context_length_exceeded", status=400),
}


_PERSISTENT = 1_000
"""Attempts a persistent scripted model failure lasts (more than any budget allows)."""


def _script(rng: random.Random, plan: FaultPlan, counts: dict[str, int], steps: int) -> _Script:
    turns: list[ModelReply] = []
    failures: dict[int, list[ModelErrorInfo]] = {}
    approvals: dict[str, ApprovalPlan] = {}
    for turn in range(steps):
        reply = _turn(rng, plan, counts, turn)
        if reply.tool_calls and reply.tool_calls[0].name == "withdraw":
            approvals[reply.tool_calls[0].id] = _approval_plan(rng, turn)
        turns.append(attrs.evolve(reply, usage=_usage(rng, turn)))
        for kind, info in _MODEL_FAULTS.items():
            if plan.roll(rng, kind):
                # A request too long for the context stays too long: every attempt of that
                # turn fails (a crash must not make it go away). The others are transient.
                repeat = _PERSISTENT if kind == "model_context_length" else 1
                failures.setdefault(turn, []).extend([info] * repeat)
                counts[kind] = counts.get(kind, 0) + 1
    final = call("finish", call_id="c-finish") if rng.random() < 0.5 else say("all done")
    turns.append(attrs.evolve(final, usage=_usage(rng, steps)))
    return _Script(
        turns=turns, failures=failures, approvals=approvals, budgets=_budgets(rng, steps)
    )


def _usage(rng: random.Random, turn: int) -> Usage:
    """What the provider reports for one turn; sometimes nothing (unknown, never 0)."""
    if rng.random() < 0.1:
        return Usage()
    return Usage(input_tokens=200 + 50 * turn, output_tokens=rng.randrange(10, 60))


def _budgets(rng: random.Random, steps: int) -> Budgets:
    """Step and attempt budgets, and in some worlds token and time budgets that bind."""
    tokens = (
        rng.randrange(300, 260 * (steps + 1) + 25 * steps * (steps + 1))
        if rng.random() < 0.25
        else None
    )
    seconds = round(rng.uniform(0.1, 4.0), 3) if rng.random() < 0.25 else 600.0
    return Budgets(
        max_steps=steps + 2,
        max_model_attempts=(steps + 2) * 4,
        token_budget=tokens,
        time_budget_s=seconds,
    )


def _approval_plan(rng: random.Random, turn: int) -> ApprovalPlan:
    roll = rng.random()
    decision = Decision.APPROVE if roll < 0.4 else Decision.REJECT if roll < 0.7 else Decision.EDIT
    # Well inside or well past the deadline, so the crash-free twin decides the same.
    if rng.random() < 0.15:
        delay = rng.uniform(1.5 * APPROVAL_TIMEOUT_S, 2 * APPROVAL_TIMEOUT_S)
    else:
        delay = rng.uniform(0.0, 0.5 * APPROVAL_TIMEOUT_S)
    return ApprovalPlan(
        delay_s=round(delay, 3),
        decision=decision.value,
        via="control" if rng.random() < 0.5 else "handle",
        restart=rng.random() < 0.25,
        message=f"not this one (turn {turn})",
        edit={"amount": rng.randrange(1, 50)} if decision is Decision.EDIT else None,
    )


def _turn(rng: random.Random, plan: FaultPlan, counts: dict[str, int], turn: int) -> ModelReply:
    for kind, name, arguments in (
        ("tool_exception", "flaky", {"fail": True}),
        ("tool_timeout", "slow", {"seconds": 60.0}),
        ("tool_stuck", "stuck", {"seconds": 60.0}),
        ("bad_text", "listing", {"folder": "inbox\ud800"}),
        ("env_error", "outage", {"down": True}),
        ("approval", "withdraw", {"amount": 1 + turn}),
        ("child_run", "delegate", {"task": f"deposit for turn {turn}"}),
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


def _agent(model: ScriptedModel, ledger: Ledger, budgets: Budgets) -> Agent:
    return Agent(
        model=model,
        executor=_ledger_tools(ledger),
        parser=NativeToolCallParser(),
        model_name="simulated",
        budgets=budgets,
        limits=Limits(
            tool_timeout_s=5.0,
            retry_initial_s=0.5,
            retry_max_s=4.0,
            model_attempt_s=30.0,
            approval_timeout_s=APPROVAL_TIMEOUT_S,
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


class ApprovingScenario(Scenario, Protocol):
    """A `Scenario` whose tools need human approval: it says how the human decides.

    The simulation's driver plays that human for the run and for its fault-free twin alike
    (so both take the same decisions); a scenario without this method gets no decisions,
    and the approval deadline ends every wait.
    """

    def approval(self, world: Any, request: ApprovalRequested) -> ApprovalPlan | None:
        """How the human decides ``request``; ``None``: nobody decides (the deadline will)."""
        ...


class StoreScenario(Scenario, Protocol):
    """A `Scenario` whose agent needs the store its run is written to.

    A child-run tool does: the children go to the same store, through the same faults.
    """

    def agent_on(self, world: Any, store: RunStore) -> Agent:
        """A fresh agent definition acting on ``world``, writing child runs to ``store``."""
        ...


def _scenario_agent(scenario: Scenario, world: Any, store: RunStore) -> Agent:
    """The scenario's agent on ``store`` (`StoreScenario`), else ``scenario.agent(world)``."""
    on = getattr(scenario, "agent_on", None)
    if on is None:
        return scenario.agent(world)
    agent: Agent = on(world, store)
    return agent


class ActorScenario(Scenario, Protocol):
    """A `Scenario` that swaps some of the run's actors (see `treadle.Actors`).

    The simulation uses these actors for every incarnation of the run and for its fault-free
    twin; with the ``latency`` fault on, it puts seeded latency in front of their gateway and
    executor.
    """

    def actors(self, world: Any) -> Actors:
        """The actor factories for runs on ``world`` (e.g. a fake executor on its ledger)."""
        ...


def _scenario_actors(scenario: Scenario, world: Any) -> Actors:
    """The scenario's actors (`ActorScenario`), else the real ones."""
    factory = getattr(scenario, "actors", None)
    if factory is None:
        return DEFAULT_ACTORS
    actors: Actors = factory(world)
    return actors


def _child_provider() -> ScriptedModel:
    """The child runs' provider (one for all of a world's children: it answers by turn)."""
    turns = [
        call("deposit", call_id="k1", amount=7),
        call("balance", call_id="k2"),
        say(CHILD_ANSWER),
    ]
    return ScriptedModel(
        turns=[attrs.evolve(t, usage=Usage(input_tokens=20, output_tokens=5)) for t in turns],
        latency_s=0.05,
    )


@attrs.define(eq=False)
class _LedgerWorld:
    script: _Script
    provider: ScriptedModel
    ledger: Ledger
    child_provider: ScriptedModel = attrs.Factory(_child_provider)
    child_ledger: Ledger = attrs.Factory(Ledger)

    @property
    def delegates(self) -> bool:
        """Whether the script hands a task to a child run."""
        return any(c.name == "delegate" for t in self.script.turns for c in t.tool_calls)


@attrs.frozen(kw_only=True)
class LedgerScenario:
    """The built-in scenario: ``steps`` scripted steps, then a final answer or completion.

    Tools: deposits to a ledger (``never`` policy with a reconcile check), withdrawals that
    need a human's approval (approved, rejected or edited at a seeded delay), balance reads
    (``safe``), a flaky tool, a slow tool, an environment outage, and a completion tool.
    Replies report token usage (sometimes none), and some worlds set token and time budgets
    tight enough to end the run.
    """

    steps: int = 10

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Any:
        """A scripted provider, its approvals and budgets, and an empty ledger."""
        script = _script(rng, plan, counts, self.steps)
        return _LedgerWorld(script=script, provider=_model(script), ledger=Ledger())

    def agent(self, world: Any) -> Agent:
        """The ledger agent on ``world``."""
        return _agent(world.provider, world.ledger, world.script.budgets)

    def agent_on(self, world: Any, store: RunStore) -> Agent:
        """The ledger agent; with ``delegate`` when the script hands tasks to child runs.

        The child runs are written to ``store``.
        """
        if not world.delegates:
            return self.agent(world)
        tools = _ledger_tools(world.ledger, _delegate(world, store))
        return attrs.evolve(self.agent(world), executor=tools)

    def input(self, world: Any) -> RunInput:
        """A fixed instruction."""
        return "simulate"

    def approval(self, world: Any, request: ApprovalRequested) -> ApprovalPlan | None:
        """The scripted human's decision on a withdrawal."""
        plan: ApprovalPlan | None = world.script.approvals.get(request.call_id)
        return plan

    def check(self, log: RunLog, world: Any) -> list[str]:
        """No effect applied twice (the children's included); decisions are the ledger's."""
        problems = check_invariants(log, ledger=world.ledger)
        problems += check_invariants(log, ledger=world.child_ledger)
        problems = [p for p in problems if "applied twice" in p]
        return problems + check_ledger_approvals(log, world.ledger, approval_tools={"withdraw"})

    def changed_observation(self, result: ActionResult) -> bool:
        """Whether a crash changed what ``result`` told the model.

        The reconcile text marks an outcome established after a crash. A child run that
        did not succeed under a parent that went on was cut by the faults (e.g. cancelled by
        an incarnation that died before its own cancel was durable; docs/child-runs.md,
        "Cancellation").
        """
        outcome = result.outcome
        if outcome.child_run_id is not None:
            return outcome.observation.startswith(f"Error: the child run {outcome.child_run_id}")
        return outcome.observation == RECONCILED


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


@attrs.define(eq=False)
class _LeaseClock:
    """The simulated store's clock: trio's virtual time, which a takeover fault moves ahead."""

    ahead_s: float = 0.0

    def now(self) -> float:
        return 1_800_000_000.0 + trio.current_time() + self.ahead_s


@attrs.define(eq=False)
class _TakenOver(InterceptingStore):
    """At write ``at``, another driver takes the run's lease over (after letting it expire).

    The write then reaches the store with the old generation and is refused (`LeaseLost`):
    the incarnation stops, and the next one takes the run over again from its log.
    """

    inner: MemoryStore
    at: int
    clock: _LeaseClock
    writes: int = 0

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        self.writes += 1
        if self.writes == self.at:
            run_id = records[0].run_id
            self.clock.ahead_s += LEASE_TTL_S + 1.0  # the driver looked dead for a TTL
            thief = await self.inner.acquire_lease(run_id, owner="another-driver", ttl_s=1.0)
            await self.inner.release_lease(thief)
        return False


async def _simulate(seed: int, plan: FaultPlan, runs: int, scenario: Scenario) -> SimulationResult:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    lease_clock = _LeaseClock()
    store = MemoryStore(clock=lease_clock.now)
    world_seeds = [rng.randrange(2**32) for _ in range(runs)]
    worlds = [scenario.world(random.Random(ws), plan, counts) for ws in world_seeds]
    threads = [
        f"sim-{seed}-{index}" if _threadable(world) and plan.roll(rng, "thread") else None
        for index, world in enumerate(worlds)
    ]
    drive_seeds = [rng.randrange(2**32) for _ in range(runs)]
    run_ids = [
        thread_run_id(thread, 2) if thread else f"sim-{seed}-{index}"
        for index, thread in enumerate(threads)
    ]
    for thread, world in zip(threads, worlds, strict=True):
        if thread is not None:
            _count(counts, "thread")
            world.provider.turn_offset = 1
    async with trio.open_nursery() as nursery:
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
            )
            nursery.start_soon(driver.drive)
    logs = [await store.read_log(run_id) for run_id in run_ids]
    violations: list[str] = []
    for index, log in enumerate(logs):
        budgets = scenario.agent(worlds[index]).budgets
        violations.extend(check_invariants(log, budgets=budgets))
        violations.extend(scenario.check(log, worlds[index]))
        violations.extend(_unanswered_calls(run_ids[index], worlds[index]))
        thread = threads[index]
        if thread is not None:
            violations.extend(await _inherited(store, thread, run_ids[index], worlds[index]))
        twin_world = scenario.world(random.Random(world_seeds[index]), plan, {})
        if thread is not None:
            twin_world.provider.turn_offset = 1
        twin = await _fault_free_twin(scenario, run_ids[index], twin_world, thread)
        violations.extend(_compare_with_twin(log, twin, scenario))
    violations.extend(await check_child_runs(store, logs))
    return SimulationResult(
        seed=seed,
        ok=not violations,
        violations=tuple(violations),
        faults_injected=dict(sorted(counts.items())),
        steps=sum(len(log.steps) for log in logs),
        log_digest=log_digest(logs),
    )


async def check_child_runs(store: RunStore, parents: Iterable[RunLog]) -> list[str]:
    """Check the child runs in ``store`` of the ``parents`` (docs/child-runs.md).

    - each child belongs to an action intent of its parent, under the run id derived from it,
      and no call has two children (a resumed parent re-attached, never started a second);
    - each child of a finished parent is finished, and its log keeps every invariant
      (`check_invariants`); a cancelled parent's child may be left unfinished only when its
      cancel is in its control stream, for whoever drives it next;
    - each of the parent's results for that intent names the child.

    Returns:
        One sentence per violation.
    """
    logs = {log.run_id: log for log in parents}
    problems: list[str] = []
    per_call: dict[str | None, list[str]] = {}
    for run_id in await store.list_runs():
        child = await store.read_log(run_id)
        started = child.started
        if started is None or started.parent_run_id not in logs:
            continue
        parent = logs[started.parent_run_id]
        per_call.setdefault(started.parent_intent_id, []).append(run_id)
        intents = {r.intent_id for r in parent.records if isinstance(r, ActionIntent)}
        if started.parent_intent_id not in intents:
            problems.append(f"{run_id}: a child run of no action intent of {parent.run_id}")
            continue
        if run_id != child_run_id(started.parent_intent_id or ""):
            problems.append(f"{run_id}: not the run id derived from its parent's intent")
        named = {
            r.outcome.child_run_id
            for r in parent.records
            if isinstance(r, ActionResult) and r.intent_id == started.parent_intent_id
        }
        if named - {run_id, None}:
            problems.append(f"{run_id}: its parent's result names another child: {named}")
        finished = parent.finished
        if child.finished is None:
            if finished is not None and finished.stop_reason is not StopReason.CANCELLED:
                problems.append(f"{run_id}: unfinished, its parent ended {finished.stop_reason}")
            continue
        problems.extend(check_invariants(child))
    for intent_id, runs in per_call.items():
        if len(runs) > 1:
            problems.append(f"{intent_id}: one call started {len(runs)} child runs: {runs}")
    return problems


def _threadable(world: Any) -> bool:
    """Whether a simulated run on ``world`` can continue a thread (see `FaultPlan.threads`)."""
    return isinstance(getattr(world, "provider", None), ScriptedModel)


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


async def _inherited(store: MemoryStore, thread: str, run_id: str, world: Any) -> list[str]:
    """Every request of the thread's second run starts with the first run's history."""
    earlier = list(await history(store, thread))
    problems = []
    for number, request in enumerate(world.provider.requests, start=1):
        seen = [m for m in request.messages if m.role != "system"][: len(earlier)]
        if seen != earlier:
            problems.append(
                f"run {run_id!r}: request {number} does not start with the history of "
                f"{thread!r} it continues"
            )
    return problems


def log_digest(logs: Iterable[RunLog]) -> str:
    """sha256 over every record of ``logs``, encoded as stored, in order."""
    digest = hashlib.sha256()
    for log in logs:
        for record in log.records:
            digest.update(encode(record).encode("utf-8"))
            digest.update(b"\n")
    return digest.hexdigest()


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
    """Drives one run through crashes (each one a "process restart") until it finishes."""

    scenario: Scenario
    run_id: str
    world: Any
    store: MemoryStore
    plan: FaultPlan
    rng: random.Random
    counts: dict[str, int]
    lease_clock: _LeaseClock
    thread: str | None = None

    async def drive(self) -> None:
        """Run incarnations until one ends the run (or `MAX_RESTARTS` is reached)."""
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
            cancel_after = (
                self.rng.uniform(0.0, 2.0) if self.plan.roll(self.rng, "cancel") else None
            )
            if cancel_after is not None:
                _count(self.counts, "cancel")
            # Each incarnation is a fresh process: a new agent (actors, tool objects) on the
            # same world (environment and provider).
            agent = _scenario_agent(self.scenario, self.world, faulty)
            try:
                async with open_run(
                    agent,
                    self.scenario.input(self.world),
                    store=faulty,
                    run_id=self.run_id,
                    clock=clock,
                    rng=random.Random(self.rng.randrange(2**32)),
                    control_poll_s=CONTROL_POLL_S,
                    actors=self._actors(),
                    thread_id=self.thread,
                ) as handle:
                    await _watch(handle, cancel_after, approver)
            except (RunInterrupted, StoreError, SimulatedCrash, ModelCallError, LeaseError):
                continue  # the process died: the next incarnation resumes from the log
            return

    def _faulty_store(self) -> Any:
        if self.plan.roll(self.rng, "crash"):
            _count(self.counts, "crash")
            crash_at = self.rng.randrange(1, 40)
            after = self.rng.random() < 0.5
            return CrashingStore(
                inner=self.store, crash_at=crash_at, when="after" if after else "before"
            )
        if self.plan.roll(self.rng, "store_error"):
            _count(self.counts, "store_error")
            return FailingStore(inner=self.store, fail_at=self.rng.randrange(1, 40))
        if self.plan.roll(self.rng, "takeover"):
            _count(self.counts, "takeover")
            at = self.rng.randrange(2, 40)
            return _TakenOver(inner=self.store, at=at, clock=self.lease_clock)
        return self.store

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


async def _watch(handle: RunHandle, cancel_after: float | None, approver: _Approver) -> None:
    """Wait for the run while the human decides and the cancel fault fires."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(approver.serve, handle)
            if cancel_after is not None:
                with trio.move_on_after(cancel_after):
                    await handle.wait()
                handle.cancel("simulated cancel")
            await handle.wait()
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def _unanswered_calls(run_id: str, world: Any) -> list[str]:
    """`check_tool_replies` on every request the world's model received (``world.provider``).

    A world without a ``provider`` that records ``requests`` (a `ScriptedModel`) is not
    checked.
    """
    requests = getattr(getattr(world, "provider", None), "requests", None)
    if requests is None:
        return []
    return [f"run {run_id!r}: {problem}" for problem in check_tool_replies(requests)]


async def _fault_free_twin(
    scenario: Scenario, run_id: str, world: Any, thread: str | None = None
) -> RunLog:
    """The same world (model and tool faults, approvals included), without crashes or cancels."""
    store = MemoryStore()
    if thread is not None:
        await _start_thread(store, scenario, world, thread)
    approver = _Approver(
        scenario=scenario, world=world, run_id=run_id, store=store, may_restart=False
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
    return await store.read_log(run_id)


_STEP_PARTS: tuple[str, ...] = (
    "decision",
    "history_message",
    "observations",
    "observation_images",
)
"""What is compared of each step with the fault-free twin (`_trajectory`)."""


def _trajectory(log: RunLog) -> list[tuple[Any, ...]]:
    return [tuple(getattr(s, part) for part in _STEP_PARTS) for s in log.steps]


def _first_difference(ours: Any, theirs: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place where two values differ: ``(path, ours, theirs)``, or ``None``.

    Descends into attrs records (by field), sequences (by index) and mappings (by key).
    """
    if ours == theirs:
        return None
    if type(ours) is type(theirs) and attrs.has(type(ours)):
        for field in attrs.fields(type(ours)):
            found = _first_difference(
                getattr(ours, field.name), getattr(theirs, field.name), f"{path}.{field.name}"
            )
            if found is not None:
                return found
    elif isinstance(ours, tuple | list) and isinstance(theirs, tuple | list):
        if len(ours) == len(theirs):
            for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                found = _first_difference(a, b, f"{path}[{index}]")
                if found is not None:
                    return found
    elif isinstance(ours, Mapping) and isinstance(theirs, Mapping) and ours.keys() == theirs.keys():
        for key in ours:
            found = _first_difference(ours[key], theirs[key], f"{path}[{key!r}]")
            if found is not None:
                return found
    return path, ours, theirs


def _clipped(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _step_difference(run_id: str, step: int, ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> str:
    """A sentence naming the first field where step ``step`` differs, with both values."""
    found = None
    for part, a, b in zip(_STEP_PARTS, ours, theirs, strict=True):
        found = _first_difference(a, b, part)
        if found is not None:
            break
    where, a, b = found if found is not None else ("the step", ours, theirs)
    return (
        f"{run_id}: step {step} differs from the fault-free twin's at {where}: "
        f"{_clipped(a)} here, {_clipped(b)} in the twin"
    )


_SPENT_BY_FAULTS = frozenset({StopReason.TIME_BUDGET, StopReason.MAX_MODEL_ATTEMPTS})
"""Budgets that faults legitimately consume (retries, backoff, latency, re-run attempts):
where a run stopped on one of them, only the steps both runs took are compared."""


def _compare_with_twin(log: RunLog, twin: RunLog, scenario: Scenario) -> list[str]:
    """Where the faults did not change what the model saw, the trajectory is the twin's.

    An action whose outcome was reconciled or recorded as unknown after a crash changes
    what the model saw from its step on, and a cancel ends the run early: the comparison
    covers the steps before either. A run (or twin) that stopped on a budget the faults
    consume is compared on the steps both took.
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
    stops = {f.stop_reason for f in (log.finished, twin.finished) if f is not None}
    cut_short = StopReason.CANCELLED in stops or bool(stops & _SPENT_BY_FAULTS)
    limit = len(ours) if changed_at is None else changed_at - 1
    if changed_at is None and not cut_short and len(ours) != len(theirs):
        return [f"{log.run_id}: {len(ours)} steps, its fault-free twin took {len(theirs)}"]
    for index in range(min(limit, len(theirs))):
        if ours[index] != theirs[index]:
            return [_step_difference(log.run_id, index + 1, ours[index], theirs[index])]
    return []


def check_ledger_approvals(
    log: RunLog, ledger: Ledger, *, approval_tools: Iterable[str]
) -> list[str]:
    """What the environment saw of approvals (the ledger survives crashes).

    - every effect of a tool in ``approval_tools`` follows an approve or edit decision in
      the log, and used the arguments the log's intent holds (the edited ones after edit);
    - no rejected or expired call left an effect.

    Returns:
        One sentence per violation.
    """
    tools = set(approval_tools)
    problems: list[str] = []
    decisions = {(d.step, d.call_id): d for d in log.records if isinstance(d, ApprovalDecided)}
    for record in log.records:
        if isinstance(record, ActionIntent) and record.tool in tools:
            decision = decisions.get((record.step, record.call_id))
            if decision is None or decision.decision not in (Decision.APPROVE, Decision.EDIT):
                problems.append(f"{log.run_id}: {record.tool} call {record.call_id} ran undecided")
            seen = ledger.arguments.get(record.intent_id)
            if seen is not None and _signed(record.tool, record.arguments) != seen:
                problems.append(
                    f"{log.run_id}: {record.intent_id} applied {seen}, its intent says "
                    f"{dict(record.arguments)}"
                )
        elif isinstance(record, ActionResult) and record.tool in tools:
            decision = decisions.get((record.step, record.call_id))
            if _refused(decision) and ledger.effects.get(record.intent_id):
                problems.append(f"{log.run_id}: refused call {record.call_id} changed the ledger")
    return problems


def _signed(tool_name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The ledger's record of a call: withdrawals are stored as negative amounts."""
    amount = arguments.get("amount")
    if tool_name == "withdraw" and isinstance(amount, int):
        return {"amount": -amount}
    return dict(arguments)


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
