"""Simulation under the compaction fault plan (docs/simulation.md, docs/context.md).

Crashes at any write (summary intents and results included), store failures, takeovers,
latency, retried provider errors and a provider whose real window is smaller than the one
declared: every log keeps the usual invariants and the context budget's
(`treadle.testing.invariants.check_context`), and each run's trajectory is its fault-free
twin's.
"""

from __future__ import annotations

import attrs

from treadle.testing.simulation import FaultPlan, simulate
from treadle.testing.windowed import ContextScenario
from treadle.types import ModelIntent, ModelResult, RunLog


@attrs.frozen(kw_only=True)
class _Counting(ContextScenario):
    """The scenario, counting what its logs show (the check runs once per log)."""

    seen: dict[str, int] = attrs.field(factory=dict, eq=False)

    def check(self, log: RunLog, world):
        results = [r for r in log.records if isinstance(r, ModelResult)]
        counts = {
            "summaries": sum(1 for r in results if r.summary_through is not None and r.reply),
            "forced": sum(1 for r in results if r.context is not None and r.context.forced),
            "compaction intents": sum(
                1 for r in log.records if isinstance(r, ModelIntent) and r.compaction
            ),
        }
        for key, value in counts.items():
            self.seen[key] = self.seen.get(key, 0) + value
        return super().check(log, world)


def test_sixty_seeds_of_the_compaction_plan_are_green():
    scenario = _Counting()
    injected: dict[str, int] = {}
    for seed in range(60):
        result = simulate(seed, plan=FaultPlan.compaction(), scenario=scenario)
        assert result.ok, f"seed {seed}: {result.violations}"
        for kind, count in result.faults_injected.items():
            injected[kind] = injected.get(kind, 0) + count
    assert set(injected) == set(FaultPlan.compaction().rates)  # every kind was exercised
    # compaction really happened, after refusals too (a crash at every summary write is
    # tests/runtime/test_context_crashes.py's sweep)
    assert scenario.seen["summaries"] > 60
    assert scenario.seen["compaction intents"] >= scenario.seen["summaries"]
    assert scenario.seen["forced"] > 0


def test_the_compaction_plan_is_deterministic():
    first = simulate(3, plan=FaultPlan.compaction(), scenario=ContextScenario())
    again = simulate(3, plan=FaultPlan.compaction(), scenario=ContextScenario())
    assert first.log_digest == again.log_digest


def test_a_crash_in_the_compaction_after_a_refusal_resumes_into_that_compaction():
    # Seeds where a real window (900) below the declared one gets a step refused for its
    # length, and a crash (or an abandoned summary attempt) falls inside the forced
    # compaction: the resumed step compacts again and finishes, as it does without the crash
    # (docs/context.md, "Context-length errors").
    for seed in (19, 54):
        result = simulate(
            seed, plan=FaultPlan.compaction(), scenario=ContextScenario(goal=30, window=900)
        )
        assert result.ok, f"seed {seed}: {result.violations}"
