from __future__ import annotations

import attrs
import pytest

from treadle.testing import simulation
from treadle.testing.simulation import FAULT_KINDS, FaultPlan, Ledger, check_invariants, simulate
from treadle.types import ActionResult, Budgets, ReplayPolicy, RunFinished, StepRecord


def test_five_hundred_seeds_with_every_fault_kind_are_green():
    plan = FaultPlan.default()
    assert set(plan.rates) == set(FAULT_KINDS)
    seen: dict[str, int] = {}
    for seed in range(500):
        result = simulate(seed, plan=plan)
        assert result.ok, (
            f"seed {seed}: {result.violations} (replay: treadle simulate --from {seed} --seeds 1)"
        )
        for kind, count in result.faults_injected.items():
            seen[kind] = seen.get(kind, 0) + count
    assert set(seen) == set(FAULT_KINDS)  # every kind was really exercised


def test_same_seed_gives_the_same_log_digest():
    first = simulate(7, runs=3)
    second = simulate(7, runs=3)
    assert first.log_digest == second.log_digest
    assert first.faults_injected == second.faults_injected
    assert simulate(8, runs=3).log_digest != first.log_digest


def test_the_checker_finds_a_runtime_that_replays_never_actions(monkeypatch):
    """Break the resume rule on purpose: the simulation must catch it."""
    original = simulation._ledger_tools

    def replaying_tools(ledger):
        toolbox = original(ledger)
        monkeypatch.setattr(toolbox, "replay_policy", lambda tool: ReplayPolicy.SAFE)
        return toolbox

    monkeypatch.setattr(simulation, "_ledger_tools", replaying_tools)
    plan = FaultPlan(rates={"crash": 1.0})
    failures = [r for r in (simulate(seed, plan=plan) for seed in range(60)) if not r.ok]
    assert failures, "a never-policy action applied twice went unnoticed"
    assert any("applied twice" in v for r in failures for v in r.violations)


async def _log_of_clean_run():
    import random

    import trio

    from treadle._clock import FixedStepClock
    from treadle.stores.memory import MemoryStore
    from treadle.supervisors.run import run

    ledger = Ledger()
    script = simulation._script(random.Random(1), FaultPlan(rates={}), {}, 4)
    agent = simulation._agent(simulation._model(script), ledger, Budgets(max_steps=6))
    store = MemoryStore()
    await run(agent, "x", store=store, run_id="r", clock=FixedStepClock(), rng=random.Random(0))
    await trio.lowlevel.checkpoint()
    return await store.read_log("r"), ledger


async def test_check_invariants_accepts_a_clean_log_and_flags_each_corruption():
    log, ledger = await _log_of_clean_run()
    assert check_invariants(log, ledger=ledger) == []
    records = list(log.records)
    step_at = next(i for i, r in enumerate(records) if isinstance(r, StepRecord))
    result_at = next(i for i, r in enumerate(records) if isinstance(r, ActionResult))

    without_step = attrs.evolve(log, records=tuple(records[:step_at] + records[step_at + 1 :]))
    assert any("without step record" in p for p in check_invariants(without_step))

    no_intent = attrs.evolve(log, records=tuple(records[: result_at - 1] + records[result_at:]))
    assert any("has no intent" in p for p in check_invariants(no_intent))

    finished = records[-1]
    assert isinstance(finished, RunFinished)
    twice = attrs.evolve(log, records=(*records, finished))
    assert any("exactly one run-finished" in p for p in check_invariants(twice))

    ledger.effects["x"] = 2
    assert any("applied twice" in p for p in check_invariants(log, ledger=ledger))


def test_fault_plan_refuses_unknown_kinds_and_bad_rates():
    with pytest.raises(ValueError, match="unknown fault kinds"):
        FaultPlan.of(["meteor"])
    with pytest.raises(ValueError, match="rate"):
        FaultPlan.of(rate=2)


def test_cli_prints_one_line_per_seed_and_a_replay_command_on_failure(monkeypatch, tmp_path):
    import json

    from click.testing import CliRunner

    from treadle.cli import main

    runner = CliRunner()
    ok = runner.invoke(main, ["simulate", "--seeds", "5", "--from", "10", "--json"])
    assert ok.exit_code == 0, ok.output
    lines = [json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")]
    assert [line["seed"] for line in lines] == [10, 11, 12, 13, 14]
    assert set(lines[0]) == {"seed", "ok", "violations", "faults_injected", "steps", "log_digest"}

    def broken_check(log, **options):
        return ["forced violation"]

    monkeypatch.setattr(simulation, "check_invariants", broken_check)
    failing = runner.invoke(main, ["simulate", "--seeds", "3", "--from", "4"])
    assert failing.exit_code == 1
    assert "treadle simulate --from 4 --seeds 1" in failing.output


def test_user_scenario_from_the_docs_example_runs_green():
    from click.testing import CliRunner

    from treadle.cli import main

    result = CliRunner().invoke(
        main, ["simulate", "--agent", "examples.simulate_notes_agent:scenario", "--seeds", "30"]
    )
    assert result.exit_code == 0, result.output
