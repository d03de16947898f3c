"""Where the simulation's crashes land: anywhere in a run, however long it is.

Crash points were drawn from the first 39 writes of each incarnation, so in a long run a
crash reached a late write only through crashes before it; a bug at the end of a long run
was never caught.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
import trio

import treadle
from treadle.testing import InterceptingStore, ScriptedModel, _sim_run, call, say
from treadle.testing.faults import CrashingStore
from treadle.testing.simulation import FaultPlan, run_seeds
from treadle.types import ActionResult, Record, RunLog, StoreOp

STEPS = 25  # about four writes a step: a run of about a hundred writes
SEEDS = 20


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def read(key: str) -> str:
    """Read a value.

    Args:
        key: which one.
    """
    return f"value of {key}"


@attrs.define(eq=False)
class _World:
    model: ScriptedModel


@attrs.frozen
class _LongScenario:
    """`STEPS` reads, then an answer."""

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> _World:
        turns = [call("read", key=f"k{index}") for index in range(STEPS)]
        return _World(model=ScriptedModel(turns=[*turns, say("done")]))

    def agent(self, world: _World) -> treadle.Agent:
        return treadle.Agent(
            model=world.model,
            executor=treadle.Toolbox([read]),
            parser=treadle.NativeToolCallParser(),
            budgets=treadle.Budgets(max_steps=STEPS + 1),
        )

    def input(self, world: _World) -> str:
        return "Read every key."

    def check(self, log: RunLog, world: _World) -> list[str]:
        return []

    def changed_observation(self, result: ActionResult) -> bool:
        return False


class _Counting(InterceptingStore):
    writes: int = 0

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        self.writes += 1
        return False


async def _writes_of_a_fault_free_run() -> int:
    scenario = _LongScenario()
    store = _Counting(treadle.MemoryStore())
    world = scenario.world(random.Random(0), FaultPlan.of([]), {})
    await treadle.run(scenario.agent(world), scenario.input(world), store=store, run_id="r")
    return store.writes


@pytest.fixture
def crashes_fired(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The write (of its incarnation) each crash the simulation injected hit."""
    fired: list[int] = []
    count_fired = _sim_run._Driver._count_fired

    def recording(driver: Any, faulty: Any) -> bool:
        if isinstance(faulty, CrashingStore) and faulty.crashed:
            fired.append(faulty.crash_at)
        return count_fired(driver, faulty)

    monkeypatch.setattr(_sim_run._Driver, "_count_fired", recording)
    return fired


def test_crashes_land_in_the_last_quarter_of_a_long_run_too(crashes_fired: list[int]) -> None:
    """From the first incarnation on: not only after crashes earlier in the run."""
    writes = trio.run(_writes_of_a_fault_free_run)
    assert writes > 80
    results = run_seeds(
        range(SEEDS), scenario=_LongScenario(), plan=FaultPlan.of(["crash"], rate=0.5)
    )
    assert [r.violations for r in results if not r.ok] == []
    assert len(crashes_fired) >= SEEDS // 2
    last_quarter = [at for at in crashes_fired if at > writes * 3 // 4]
    assert last_quarter, f"crashes at writes {sorted(crashes_fired)} of a run of {writes}"
