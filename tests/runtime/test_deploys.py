"""Deploys: a run goes on under a changed definition only when that is accepted, on record.

A resumed run whose agent definition's snapshot differs from the one it was started under is
refused (SnapshotMismatch, naming the keys). ``accept_definition_change=True`` (``treadle
resume --accept-changed-definition``) writes the difference to the log first, as a barrier,
and later resumes compare with the accepted snapshot.
"""

from __future__ import annotations

import attrs
import pytest
import trio

import treadle
from treadle.stores.memory import MemoryStore
from treadle.testing import CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import DefinitionAccepted, EventKind, StepRecord


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def agent(prompt: str = "Add.", version: str | None = None) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("add", a=1, b=2, call_id="c1"), say("3")]),
        executor=treadle.Toolbox([add]),
        parser=treadle.NativeToolCallParser(),
        system_prompt=prompt,
        version=version,
    )


async def crashed_run(store: MemoryStore) -> None:
    """Start run r with the old definition and let it die after its first step."""
    with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
        await treadle.run(
            agent(version="v1"), "go", store=CrashingStore(inner=store, crash_at=6), run_id="r"
        )
    log = await store.read_log("r")
    assert log.finished is None and any(isinstance(r, StepRecord) for r in log.records)


async def test_a_changed_definition_is_refused_without_acceptance() -> None:
    store = MemoryStore()
    await crashed_run(store)
    before = await store.read_log("r")
    with pytest.raises(treadle.SnapshotMismatch) as info:
        await treadle.run(agent("Add carefully.", version="v2"), store=store, run_id="r")
    assert info.value.keys == ["system_prompt"]
    assert await store.read_log("r") == before  # nothing written


async def test_an_accepted_change_is_recorded_before_the_run_goes_on() -> None:
    store = MemoryStore()
    await crashed_run(store)
    seen = len((await store.read_log("r")).records)
    new = agent("Add carefully.", version="v2")
    result = await treadle.run(new, store=store, run_id="r", accept_definition_change=True)
    assert result.state is treadle.RunState.SUCCEEDED
    log = await store.read_log("r")
    accepted = log.records[seen]  # the first record the resumed driver wrote
    assert isinstance(accepted, DefinitionAccepted)
    assert accepted.changed == ("system_prompt",)
    assert accepted.snapshot == new.snapshot() and accepted.agent_version == "v2"
    assert accepted.accepted_by  # the driver that accepted it
    assert check_invariants(log) == []
    summary = await store.read_summary("r")
    assert summary is not None and summary.agent_version == "v2"  # the index follows


async def test_later_resumes_compare_with_the_accepted_definition() -> None:
    store = MemoryStore()
    await crashed_run(store)
    new = agent("Add carefully.", version="v2")
    async with treadle.open_run(
        new, store=store, run_id="r", accept_definition_change=True
    ) as handle:
        kinds = []
        with trio.fail_after(10):
            async for event in handle.events():
                kinds.append(event.kind)
    assert EventKind.DEFINITION_ACCEPTED in kinds
    # The finished run returns its stored result under the accepted definition...
    assert (await treadle.run(new, store=store, run_id="r")).state is treadle.RunState.SUCCEEDED


async def test_accepting_an_unchanged_definition_writes_nothing() -> None:
    store = MemoryStore()
    await crashed_run(store)
    await treadle.run(agent(version="v1"), store=store, run_id="r", accept_definition_change=True)
    log = await store.read_log("r")
    assert not any(isinstance(r, DefinitionAccepted) for r in log.records)


def test_the_version_label_defaults_to_the_snapshot() -> None:
    plain = agent()
    assert plain.version_label.startswith("snap-")
    assert agent("Other.").version_label != plain.version_label
    assert attrs.evolve(plain, version="v7").version_label == "v7"
