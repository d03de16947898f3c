"""The built-in `LedgerScenario`: a scripted provider, ledger tools with faults, child runs.

Part of `treadle.testing.simulation`, which re-exports the public names (docs/simulation.md).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import trio
import trio.testing

from treadle.agent import Agent, RunInput
from treadle.approvals import Decision
from treadle.parsers import NativeToolCallParser
from treadle.ports import RunStore
from treadle.supervisors import agent_tool
from treadle.testing._sim_faults import _MODEL_FAULTS, _PERSISTENT, ApprovalPlan, FaultPlan
from treadle.testing.invariants import (
    _refused,
    check_invariants,
)
from treadle.testing.scripted import ScriptedModel, call, say
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
    ReplayPolicy,
    RunLog,
    Usage,
)

APPROVAL_TIMEOUT_S = 20.0
"""The simulated agent's approval deadline (virtual seconds)."""


CONTROL_POLL_S = 1.0
"""Virtual seconds between two reads of a simulated run's control log (decisions written
there are picked up within this long; the approval delays are far from the deadline)."""


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
        """Whether ``result`` was established by ``reconcile`` after a crash.

        The reconcile text marks it (child runs the faults cut are counted by the
        simulation itself: docs/simulation.md, "Simulating your own agent").
        """
        return result.outcome.observation == RECONCILED


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
