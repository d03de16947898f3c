"""The simulation's thread plan: runs continuing a thread under every fault kind."""

from __future__ import annotations

import attrs

from treadle.actors import ContextHydrator
from treadle.supervisors import ActorContext, Actors, real_hydrator
from treadle.testing.simulation import FAULT_KINDS, FaultPlan, LedgerScenario, simulate


def test_the_thread_plan_continues_every_run_and_stays_green() -> None:
    plan = FaultPlan.threads()
    assert plan.rates["thread"] == 1.0 and set(plan.rates) == set(FAULT_KINDS)
    seen: dict[str, int] = {}
    for seed in range(60):
        result = simulate(seed, plan=plan, runs=2)
        assert result.ok, f"seed {seed}: {result.violations}"
        assert result.faults_injected["thread"] == 2
        for kind, count in result.faults_injected.items():
            seen[kind] = seen.get(kind, 0) + count
    assert seen["crash"] > 0 and seen["takeover"] > 0  # thread runs were resumed


def test_the_same_seed_gives_the_same_thread_logs() -> None:
    plan = FaultPlan.threads()
    assert simulate(3, plan=plan).log_digest == simulate(3, plan=plan).log_digest
    assert simulate(3, plan=plan).log_digest != simulate(3).log_digest


@attrs.define(eq=False)
class ForgetfulHydrator(ContextHydrator):
    """A hydrator that leaves the inherited history out (the bug the plan must catch)."""

    async def inherit(self) -> None:
        return None


@attrs.frozen(kw_only=True)
class ForgetfulScenario(LedgerScenario):
    def actors(self, world: object) -> Actors:
        def hydrator(context: ActorContext) -> ForgetfulHydrator:
            real = real_hydrator(context)
            return ForgetfulHydrator(
                started=real.started,
                system_prompt=real.system_prompt,
                tools=real.tools,
                model=real.model,
                max_output_tokens=real.max_output_tokens,
                params=real.params,
                synthetic=real.synthetic,
                output=real.output,
            )

        return Actors(hydrator=hydrator)


def test_a_run_that_forgets_its_thread_is_caught() -> None:
    plan = FaultPlan(rates={"thread": 1.0})
    result = simulate(1, plan=plan, scenario=ForgetfulScenario(steps=3))
    assert not result.ok
    assert any("does not start with the history of 'sim-1-0'" in v for v in result.violations)
    assert simulate(1, plan=plan, scenario=LedgerScenario(steps=3)).ok
