"""``treadle simulate``: seeded deterministic simulations with invariant checks."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from treadle._cli_common import import_spec
from treadle.testing.simulation import (
    FAULT_KINDS,
    FaultPlan,
    Scenario,
    SimulationResult,
    simulate,
)


@click.command("simulate")
@click.option(
    "--seeds",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many seeds to simulate.",
)
@click.option(
    "--from",
    "first",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="The first seed.",
)
@click.option(
    "--faults",
    default="all",
    show_default=True,
    help=f"Comma-separated fault kinds ({', '.join(FAULT_KINDS)}), 'all' or 'none'.",
)
@click.option(
    "--rate",
    default=None,
    type=click.FloatRange(0, 1),
    help="One rate for every chosen kind (default: the built-in rates).",
)
@click.option(
    "--runs-per-seed",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Concurrent runs sharing one store in each seed.",
)
@click.option(
    "--steps",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="Scripted tool steps per run.",
)
@click.option(
    "--agent",
    "agent",
    default=None,
    metavar="MODULE:FACTORY",
    help="A scenario factory (see docs/simulation.md); default: the ledger scenario.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per seed, then the summary.")
def simulate_command(
    seeds: int,
    first: int,
    faults: str,
    rate: float | None,
    runs_per_seed: int,
    steps: int,
    agent: str | None,
    as_json: bool,
) -> None:
    """Simulate runs under seeded faults and check the durability invariants."""
    plan = _plan(faults, rate)
    scenario = _load_scenario(agent) if agent else None
    failing: SimulationResult | None = None
    total_steps = 0
    for seed in range(first, first + seeds):
        result = simulate(seed, plan=plan, runs=runs_per_seed, steps=steps, scenario=scenario)
        total_steps += result.steps
        if as_json:
            click.echo(json.dumps(result.to_json()))
        if not result.ok and failing is None:
            failing = result
    _summary(seeds, total_steps, failing, faults, runs_per_seed, steps)
    if failing is not None:
        raise SystemExit(1)


def _load_scenario(spec: str) -> Scenario:
    """Call the scenario factory named ``MODULE:FACTORY``."""
    scenario: Scenario = import_spec(spec, param_hint="--agent")()
    return scenario


def _plan(faults: str, rate: float | None) -> FaultPlan:
    if faults == "none":
        return FaultPlan(rates={})
    default = FaultPlan.default()
    kinds = FAULT_KINDS if faults == "all" else tuple(k.strip() for k in faults.split(","))
    try:
        plan = FaultPlan.of(kinds, rate=rate if rate is not None else 0.1)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--faults") from exc
    if rate is None:
        plan = FaultPlan(rates={k: default.rates[k] for k in kinds})
    return plan


def _summary(
    seeds: int, steps: int, failing: SimulationResult | None, faults: str, runs: int, per: int
) -> None:
    console = Console(stderr=True)
    table = Table(title="simulation")
    for column in ("seeds", "steps", "failing"):
        table.add_column(column, justify="right")
    table.add_row(str(seeds), str(steps), "0" if failing is None else "≥1")
    console.print(table)
    if failing is not None:
        console.print(f"[red]seed {failing.seed} failed:[/red] " + "; ".join(failing.violations))
        console.print(
            f"replay it: treadle simulate --from {failing.seed} --seeds 1 --faults {faults} "
            f"--runs-per-seed {runs} --steps {per} --json"
        )
