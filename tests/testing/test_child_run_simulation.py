"""The simulation's ``child_run`` kind: parents hand tasks to child runs under every fault."""

from __future__ import annotations

import itertools

from treadle.supervisors import _children as children
from treadle.testing.simulation import FaultPlan, simulate

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
