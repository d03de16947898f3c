"""What a simulation reports (why a run never finished, the faults that fired) and refuses."""

from __future__ import annotations

import math
import random
from typing import Any

import attrs
import pytest

from treadle import Agent, Toolbox, UsageError
from treadle.testing import _sim_run
from treadle.testing.faults import CrashingStore
from treadle.testing.simulation import (
    MAX_RESTARTS,
    ApprovalPlan,
    FaultPlan,
    LedgerScenario,
    simulate,
)
from treadle.types import Action, ActionOutcome, ApprovalRequested


async def _broken_reconcile(action: Action) -> ActionOutcome | None:
    raise RuntimeError("ledger lookup has a bug")


@attrs.frozen(kw_only=True)
class _BrokenReconcile(LedgerScenario):
    """The ledger scenario whose deposits' reconcile hook always raises (a bug)."""

    def agent(self, world: Any) -> Agent:
        agent = super().agent(world)
        tools = [
            attrs.evolve(t, reconcile=_broken_reconcile) if t.name == "deposit" else t
            for t in agent.executor._tools.values()
        ]
        return attrs.evolve(agent, executor=Toolbox(tools, default_timeout_s=5.0))


def test_a_run_that_keeps_being_interrupted_by_a_bug_names_it_and_the_restarts():
    result = simulate(8, plan=FaultPlan.of(["crash"], rate=0.8), scenario=_BrokenReconcile())
    assert not result.ok
    gave_up = [v for v in result.violations if "gave up" in v]
    assert len(gave_up) == 1, result.violations
    assert f"after {MAX_RESTARTS} restarts" in gave_up[0]
    assert "RuntimeError: ledger lookup has a bug" in gave_up[0]


def test_a_run_that_finishes_reports_no_restarts():
    result = simulate(1, plan=FaultPlan.of(["crash"], rate=0.5), steps=3)
    assert result.ok, result.violations
    assert not [v for v in result.violations if "gave up" in v]


def test_only_the_crashes_that_fired_are_counted(monkeypatch):
    """Crashes planned at a write the incarnation never made are not injected: short runs
    end before most crash points (steps=2, crash points drawn from writes 1..39)."""
    made: list[CrashingStore] = []

    @attrs.define(eq=False)
    class Recorded(CrashingStore):
        def __attrs_post_init__(self) -> None:
            made.append(self)

    monkeypatch.setattr(_sim_run, "CrashingStore", Recorded)
    reported = 0
    for seed in range(10):
        result = simulate(seed, plan=FaultPlan.of(["crash"], rate=0.5), steps=2)
        assert result.ok, result.violations
        reported += result.faults_injected.get("crash", 0)
    fired = sum(store.crashed for store in made)
    assert fired < len(made)  # the test means something: some crash points were never reached
    assert reported == fired


def test_a_cancel_after_the_run_ended_is_not_counted():
    results = [
        simulate(seed, plan=FaultPlan.of(["cancel"], rate=1.0), steps=2) for seed in range(8)
    ]
    cancelled = [
        r.logs[0].finished is not None and r.logs[0].finished.stop_reason.value == "cancelled"
        for r in results
    ]
    assert [r.faults_injected.get("cancel", 0) for r in results] == [int(c) for c in cancelled]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"delay_s": 1.0, "decision": "rejcet"}, "decision"),
        ({"delay_s": 1.0, "via": "contrl"}, "via"),
        ({"delay_s": -5.0}, "delay_s"),
        ({"delay_s": math.nan}, "delay_s"),
        ({"delay_s": 1.0, "decision": "edit"}, "edit"),
        ({"delay_s": 1.0, "decision": "expired"}, "decision"),
    ],
)
def test_an_approval_plan_with_a_wrong_field_is_refused_naming_it(fields, named):
    with pytest.raises(UsageError, match=f"ApprovalPlan: {named}"):
        ApprovalPlan(**fields)


@attrs.frozen(kw_only=True)
class _BadEdits(LedgerScenario):
    """Every withdrawal is edited with arguments its schema refuses."""

    def approval(self, world: Any, request: ApprovalRequested) -> ApprovalPlan | None:
        return ApprovalPlan(delay_s=1.0, decision="edit", edit={"amount": "a lot"})


def test_an_edit_the_run_refuses_is_a_scenario_error_not_a_late_decision():
    plan = FaultPlan.of(["approval"], rate=1.0)
    with pytest.raises(UsageError, match=r"ApprovalPlan edits call .* refuses"):
        simulate(0, plan=plan, steps=2, scenario=_BadEdits(steps=2))


@pytest.mark.parametrize(
    ("rates", "rule"),
    [
        ({"crsh": 1.0}, "unknown fault kinds: 'crsh'"),
        ({"crash": 7.0}, "rate must be within 0..1"),
        ({"crash": "often"}, "rate must be within 0..1"),
    ],
)
def test_a_fault_plan_with_an_unknown_kind_or_a_wrong_rate_is_refused(rates, rule):
    with pytest.raises(ValueError, match=rule):
        FaultPlan(rates=rates)


def test_rolling_an_unknown_fault_kind_is_refused():
    with pytest.raises(ValueError, match="unknown fault kinds: 'tool_exeption'"):
        FaultPlan.default().roll(random.Random(0), "tool_exeption")


@attrs.define(eq=False)
class _NamedWorld:
    """A world that holds its scripted provider under another name than ``provider``."""

    inner: Any
    fresh_model: bool = False

    @property
    def model(self) -> Any:
        return self.inner.provider


@attrs.frozen(kw_only=True)
class _ModelWorldScenario:
    """The ledger scenario on a world naming its model ``model`` (as the tutorial's does)."""

    ledger: LedgerScenario = LedgerScenario(steps=2)
    fresh_model: bool = False

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Any:
        return _NamedWorld(inner=self.ledger.world(rng, plan, counts))

    def agent(self, world: Any) -> Agent:
        agent = self.ledger.agent(world.inner)
        if self.fresh_model:  # a provider the agent builds afresh: not the world's
            return attrs.evolve(agent, model=attrs.evolve(world.model, requests=[]))
        return agent

    def input(self, world: Any) -> str:
        return self.ledger.input(world.inner)

    def check(self, log: Any, world: Any) -> list[str]:
        return self.ledger.check(log, world.inner)

    def changed_observation(self, result: Any) -> bool:
        return self.ledger.changed_observation(result)


def test_the_thread_fault_and_the_reply_check_need_no_world_attribute_named_provider():
    result = simulate(0, plan=FaultPlan(rates={"thread": 1.0}), scenario=_ModelWorldScenario())
    assert result.ok, result.violations
    assert result.faults_injected == {"thread": 1}
    assert result.skipped == ()
    assert result.logs[0].run_id == "sim-0-0.2"  # the thread's second run


def test_a_run_whose_model_the_simulation_cannot_follow_reports_the_skip():
    scenario = _ModelWorldScenario(fresh_model=True)
    result = simulate(0, plan=FaultPlan(rates={"thread": 1.0}), scenario=scenario)
    assert result.ok, result.violations
    assert "thread" not in result.faults_injected
    assert len(result.skipped) == 1
    assert (
        "not checked for unanswered tool calls and it did not continue a thread"
        in (result.skipped[0])
    )


def _notes_answering_at_once() -> Any:
    """The docs' notes scenario with a provider that answers in no virtual time."""
    from examples.simulate_notes_agent import NotesScenario

    @attrs.frozen
    class AtOnce(NotesScenario):
        def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Any:
            world = super().world(rng, plan, counts)
            world.provider.latency_s = 0.0
            return world

    return AtOnce()


@pytest.mark.parametrize(
    "scenario",
    [_notes_answering_at_once(), LedgerScenario(steps=4)],
    ids=["no-virtual-time", "ledger"],
)
def test_a_cancel_fault_at_rate_1_reaches_runs_at_any_of_their_steps(scenario):
    """The cancel lands after a seeded write of the run (not within its first virtual
    seconds): a run that spends no virtual time is cancelled too, in late steps as well as
    early ones. One landing after the step that answered finds the run ending uncancelled."""
    plan = FaultPlan.of(["cancel"], rate=1.0)
    results = [simulate(seed, plan=plan, scenario=scenario) for seed in range(10)]
    assert [r.violations for r in results] == [()] * 10
    cancelled = [r for r in results if r.logs[0].finished.stop_reason.value == "cancelled"]
    assert len(cancelled) >= 8
    assert [r.faults_injected.get("cancel", 0) for r in results] == [
        int(r in cancelled) for r in results
    ]
    assert len({len(r.logs[0].steps) for r in cancelled}) >= 3  # cut at different steps
