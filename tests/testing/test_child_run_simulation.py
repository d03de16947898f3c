"""The simulation's ``child_run`` kind: parents hand tasks to child runs under every fault."""

from __future__ import annotations

import itertools

import treadle
from treadle.stores.memory import MemoryStore
from treadle.supervisors import _children as children
from treadle.supervisors import child_run_id
from treadle.testing import ScriptedModel, call, say, seed_log
from treadle.testing._sim_checks import _compare_with_twin
from treadle.testing.simulation import FaultPlan, simulate
from treadle.types import ActionIntent, ActionResult, CancelRequested, RunLog

PLAN = FaultPlan(rates={**FaultPlan.default().rates, "child_run": 0.5})


def test_sixty_seeds_with_child_runs_under_every_fault_kind_are_green():
    seen: dict[str, int] = {}
    for seed in range(60):
        result = simulate(seed, plan=PLAN)
        assert result.ok, f"seed {seed}: {result.violations}"
        for kind, count in result.faults_injected.items():
            seen[kind] = seen.get(kind, 0) + count
    assert seen["child_run"] >= 100
    assert seen["crash"] >= 20 and seen["cancel"] >= 1 and seen["takeover"] >= 1


def test_a_crash_during_a_child_run_call_leaves_the_parent_no_more_time():
    """Seed 126 of child runs and crashes ends its second child as its fault-free twin does.

    The parent died during its first call, after the child had finished; resumed, the call
    answered at once and the step counted none of the child's time, so the second call's
    child got that much more time and answered, where the twin's ran out of it
    (docs/child-runs.md, "Budgets").
    """
    result = simulate(126, plan=FaultPlan.of(["child_run", "crash"], rate=0.5))
    assert result.ok, result.violations
    assert result.faults_injected["crash"] >= 1 and result.faults_injected["child_run"] >= 2


def test_the_checker_finds_a_runtime_that_starts_a_second_child_on_resume(monkeypatch):
    """Break the rule on purpose: a child run id not derived from the intent (fresh per call),
    so a resumed parent starts another child. The simulation must say so."""
    fresh = itertools.count()
    monkeypatch.setattr(children, "child_run_id", lambda intent_id: f"child-{next(fresh)}")
    found = []
    for seed in range(30):
        result = simulate(seed, plan=PLAN)
        found.extend(v for v in result.violations if "child runs:" in v)
    assert found and "one call started 2 child runs" in found[0]


def test_a_seeds_child_runs_are_written_the_same_byte_for_byte():
    """A child run took the wall clock and an unseeded random source: the same seed wrote its
    child runs with other timestamps each time. It takes its parent's clock now, and a
    random source drawn from its parent's."""
    import trio

    from treadle.stores import record_to_json
    from treadle.testing.simulation import LedgerScenario

    stores = []

    class Capturing(LedgerScenario):
        def agent_on(self, world, store):
            stores.append(store)
            return super().agent_on(world, store)

    def every_log(seed: int) -> dict[str, list[str]]:
        stores.clear()
        simulate(seed, plan=FaultPlan(rates={"child_run": 1.0}), scenario=Capturing())
        store = stores[-1]
        while hasattr(store, "inner"):
            store = store.inner

        async def read() -> dict[str, list[str]]:
            logs = {}
            for run_id in await store.list_runs():
                logs[run_id] = [record_to_json(r) for r in (await store.read_log(run_id)).records]
            return logs

        return trio.run(read)

    first, second = every_log(0), every_log(0)
    assert any("child" in run_id for run_id in first)
    assert first == second


class _ReconcileOnly:
    """A scenario's own rule, as docs/simulation.md gives it: its reconcile hooks only."""

    def changed_observation(self, result: ActionResult) -> bool:
        return result.reconciled


async def _checked_by_a_child(store: MemoryStore, run_id: str) -> RunLog:
    """A parent run whose one call hands a check to a child run, then answers."""
    child = treadle.Agent(
        model=ScriptedModel(turns=[say("ann looks fine")]),
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
    )
    check = treadle.agent_tool(child, store=store, name="fraud_check", description="Check.")
    parent = treadle.Agent(
        model=ScriptedModel(turns=[call("fraud_check", task="Is ann ok?"), say("done")]),
        executor=treadle.Toolbox([check]),
        parser=treadle.NativeToolCallParser(),
    )
    await treadle.run(parent, "Check ann.", store=store, run_id=run_id)
    return await store.read_log(run_id)


async def test_a_child_run_the_faults_ended_is_no_difference_from_the_fault_free_twin() -> None:
    """A parent that died after its child's cancel was appended, before its own was durable,
    resumes uncancelled and the model is told the child ended cancelled (docs/child-runs.md,
    "Cancellation"). That is the faults' doing, for a scenario whose `changed_observation`
    counts only its reconcile hooks too."""
    twin_store = MemoryStore()
    twin = await _checked_by_a_child(twin_store, "p")
    (intent,) = [r for r in twin.records if isinstance(r, ActionIntent)]
    child_id = child_run_id(intent.intent_id)
    store = MemoryStore()  # what the incarnation that died left: the call's intent, the
    # child started, the child's cancel appended, the parent's own cancel not yet durable
    await seed_log(store, twin.records[: twin.records.index(intent) + 1])
    await seed_log(store, (await twin_store.read_log(child_id)).records[:1])
    await store.append_control(CancelRequested(run_id=child_id, ts="2026-01-01T00:00:00Z"))
    log = await _checked_by_a_child(store, "p")
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.observation.startswith(f"Error: the child run {child_id} ended")
    assert _compare_with_twin(log, twin, _ReconcileOnly()) == []
