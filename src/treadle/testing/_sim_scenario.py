"""What a simulation runs: the `Scenario` protocol and its optional capabilities.

Part of `treadle.testing.simulation`, which re-exports the public names (docs/simulation.md).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from treadle.agent import Agent, RunInput
from treadle.ports import RunStore
from treadle.supervisors import DEFAULT_ACTORS, Actors
from treadle.testing._sim_faults import ApprovalPlan, FaultPlan
from treadle.types import (
    ActionResult,
    ApprovalRequested,
    RunLog,
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

        The model then saw something its fault-free twin did not. Outcomes recorded as
        unknown and child-run calls whose child ended without succeeding are counted by the
        simulation itself (docs/simulation.md, "Simulating your own agent").
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
