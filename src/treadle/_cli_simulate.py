"""``treadle simulate``: seeded deterministic simulations with invariant checks."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import click
from rich.table import Table

from treadle._cli_common import FiniteRange, import_spec, table_console
from treadle._exceptions import innermost
from treadle._terminal import on_interrupt
from treadle._text import valid_unicode
from treadle.testing.faults import FAULT_KINDS

if TYPE_CHECKING:  # the simulation (trio.testing, the test kit) loads when the command runs
    from treadle.testing.simulation import FaultPlan, Scenario, SimulationResult


MAX_RUNS_PER_SEED = 1000
"""The most runs ``--runs-per-seed`` takes. A seed makes all its runs before the first step
(their worlds, scripts and seeds, in memory) and drives them together on the virtual clock:
1000 runs took some 4 minutes and 220 MB; a count beyond any such (100000000000) printed
nothing while its memory grew without bound, where it is now refused (exit 2)."""

MAX_STEPS = 10_000
"""The most steps ``--steps`` takes. The built-in scenario writes a run's whole script (a
turn per step) before the run starts, however soon its budgets stop it: 10000 steps took some
5 s and 66 MB, 100000 took 19 s and 200 MB, and memory grew with the count from there."""


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
    type=FiniteRange(0, 1),
    help="One rate for every chosen kind (default: the built-in rates; ignored with 'none').",
)
@click.option(
    "--runs-per-seed",
    default=1,
    show_default=True,
    type=click.IntRange(min=1, max=MAX_RUNS_PER_SEED),
    help=f"Concurrent runs sharing one store in each seed (at most {MAX_RUNS_PER_SEED}: they "
    "are all made at once, in memory).",
)
@click.option(
    "--steps",
    default=10,
    show_default=True,
    type=click.IntRange(min=1, max=MAX_STEPS),
    help=f"Scripted tool steps per run of the built-in scenario (not with --agent; at most "
    f"{MAX_STEPS}: its script is written before the run starts).",
)
@click.option(
    "--agent",
    "agent",
    default=None,
    metavar="MODULE:FACTORY",
    help="A scenario factory (see docs/simulation.md); default: the ledger scenario.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON line per seed on standard output (the summary table and a failing seed's "
    "violations go to standard error, as always).",
)
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
    from treadle.testing.simulation import simulate

    plan = _plan(faults, rate)
    # A tool call abandoned in the tool host logs its late return; under `tool_stuck` that is
    # the injected fault itself, and the invariants check what it must not do.
    logging.getLogger("treadle.tools").setLevel(logging.ERROR)
    scenario = _load_scenario(agent) if agent else None
    if scenario is not None and steps != STEPS_DEFAULT:
        raise click.BadParameter(
            "--steps sets the built-in scenario's length; a scenario from --agent sets its own",
            param_hint="--steps",
        )
    replay = functools.partial(
        _replay_command, faults=faults, rate=rate, runs=runs_per_seed, steps=steps, agent=agent
    )
    done = _Simulated()
    with on_interrupt(lambda: _interrupted(done, first, seeds, replay, as_json=as_json)):
        for seed in range(first, first + seeds):
            try:
                result = simulate(
                    seed, plan=plan, runs=runs_per_seed, steps=steps, scenario=scenario
                )
            except Exception as exc:
                if scenario is None:
                    raise  # the built-in scenario failing is a bug of treadle's: its traceback
                raise click.ClickException(
                    f"seed {seed}: the scenario from --agent {agent} failed: {innermost(exc)!r} "
                    "(its world, agent, input or check raised; the seeds before it passed)"
                ) from exc
            done.add(result)
            if as_json:
                click.echo(json.dumps(result.to_json()))
    _report(done, replay, alone=seeds == 1, as_json=as_json)
    if done.failing:
        raise SystemExit(1)


@attrs.define
class _Simulated:
    """The seeds simulated so far: how many, their steps, the failing ones (in seed order)."""

    seeds: int = 0
    steps: int = 0
    failing: list[SimulationResult] = attrs.Factory(list)

    def add(self, result: SimulationResult) -> None:
        """Count one seed's result."""
        self.seeds += 1
        self.steps += result.steps
        if not result.ok:
            self.failing.append(result)


def _report(done: _Simulated, replay: Callable[..., str], *, alone: bool, as_json: bool) -> None:
    """The summary table, then what to do about the first failing seed (stderr)."""
    _summary(done.seeds, done.steps, done.failing)
    if not done.failing:
        return
    failed = done.failing[0]
    if alone and not as_json:
        _show_logs(failed)
    command = replay(failed.seed, as_json=as_json)
    click.echo(_next_step(failed, command, alone=alone, as_json=as_json), err=True)


def _interrupted(
    done: _Simulated, first: int, seeds: int, replay: Callable[..., str], *, as_json: bool
) -> str:
    """Report the seeds simulated before Ctrl-C, as a whole command does; what was left.

    The seed under way when it came is not counted (its result was not known).
    """
    _report(done, replay, alone=False, as_json=as_json)
    if not done.seeds:
        return f"no seed was simulated (of {seeds} from {first})"
    last = first + done.seeds - 1
    return (
        f"seeds {first} to {last} simulated, {done.seeds} of {seeds}; to go on from the next: "
        f"--from {last + 1} --seeds {seeds - done.seeds}"
    )


STEPS_DEFAULT = 10
"""``--steps`` when not given."""


def _load_scenario(spec: str) -> Scenario:
    """Call the scenario factory named ``MODULE:FACTORY`` and check it made a scenario.

    Raises:
        click.BadParameter: the factory fails or makes something that is not a `Scenario`
            (for instance an agent factory, which `treadle resume` takes instead).
    """
    factory = import_spec(spec, param_hint="--agent")
    try:
        scenario = factory() if callable(factory) else factory
    except Exception as exc:
        raise click.BadParameter(f"{spec}() failed: {exc}", param_hint="--agent") from exc
    missing = [name for name in _SCENARIO_METHODS if not callable(getattr(scenario, name, None))]
    if missing:
        raise click.BadParameter(
            f"{spec} gave {type(scenario).__name__}, not a simulation scenario (it has no "
            f"{', '.join(missing)}); simulate takes a Scenario factory, see docs/simulation.md",
            param_hint="--agent",
        )
    checked: Scenario = scenario
    return checked


_SCENARIO_METHODS = ("world", "agent", "input", "check", "changed_observation")


def _plan(faults: str, rate: float | None) -> FaultPlan:
    from treadle.testing.simulation import FaultPlan

    if faults == "none":
        return FaultPlan(rates={})
    default = FaultPlan.default()
    kinds = FAULT_KINDS if faults == "all" else tuple(k.strip() for k in faults.split(","))
    if not all(kinds):
        raise click.BadParameter(
            f"an empty fault kind in {faults!r}; choose from {', '.join(FAULT_KINDS)}, "
            "or give 'all' or 'none' alone",
            param_hint="--faults",
        )
    try:
        plan = FaultPlan.of(kinds, rate=rate if rate is not None else 0.1)
    except ValueError as exc:
        raise click.BadParameter(
            f"{exc}; choose from {', '.join(FAULT_KINDS)}, or give 'all' or 'none' alone",
            param_hint="--faults",
        ) from exc
    if rate is None:
        plan = FaultPlan(rates={k: default.rates[k] for k in kinds})
    return plan


def _next_step(failed: SimulationResult, replay: str, *, alone: bool, as_json: bool) -> str:
    """What to do about the first failing seed: replay it alone, unless this was that replay.

    A seed simulated alone fails the same way each time (the same logs, docs/simulation.md):
    instead of the same command again, its runs' logs are shown (`_show_logs`), or the line
    says how to see them.
    """
    if not alone:
        return f"replay the first failing seed: {replay}"
    where = "on standard output" if not as_json else "shown when it is simulated without --json"
    injected = ", ".join(f"{kind} x{n}" for kind, n in sorted(failed.faults_injected.items()))
    return (
        f"seed {failed.seed} fails the same way each time it is simulated (log digest "
        f"{failed.log_digest[:16]}...); its runs' logs are {where}. Faults injected: "
        f"{injected or 'none'} (a crash writes no record: look at the steps after each "
        "resume, where a call may have run again)"
    )


def _show_logs(failed: SimulationResult) -> None:
    """Print each run's log of a failing seed, as ``treadle show`` prints a run."""
    from treadle._cli_store import trajectory_table

    console = table_console()
    for log in failed.logs:
        console.print(trajectory_table(valid_unicode(log)[0]))


def _replay_command(
    seed: int,
    *,
    faults: str,
    rate: float | None,
    runs: int,
    steps: int,
    agent: str | None,
    as_json: bool,
) -> str:
    """The command that simulates ``seed`` alone with everything else as given."""
    parts = ["treadle simulate", f"--from {seed} --seeds 1 --faults {faults}"]
    if rate is not None:
        parts.append(f"--rate {rate}")
    parts.append(f"--runs-per-seed {runs}")
    if agent:
        parts.append(f"--agent {agent}")
    else:
        parts.append(f"--steps {steps}")
    if as_json:  # without it, a seed failing alone shows its runs' logs
        parts.append("--json")
    return " ".join(parts)


def _summary(seeds: int, steps: int, failing: list[SimulationResult]) -> None:
    console = table_console(stderr=True)
    table = Table(title="simulation")
    for column in ("seeds", "steps", "failing"):
        table.add_column(column, justify="right")
    table.add_row(str(seeds), str(steps), str(len(failing)))
    console.print(table)
    if failing:
        first = failing[0]
        # Plain echo, not rich: a long line must not be wrapped (it is pasted back).
        click.echo(f"seed {first.seed} failed: " + "; ".join(first.violations), err=True)
