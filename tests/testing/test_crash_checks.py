"""The crash kit's check of a recovered run counts executions per intent, whatever their order."""

from __future__ import annotations

import attrs

import treadle
from treadle.stores import MemoryStore
from treadle.testing.crashes import RUN_INPUT, check_recovered_run, make_agent, read_ledger


async def _scenario(tmp_path):
    ledger = tmp_path / "r.ledger"
    store = MemoryStore()
    await treadle.run(make_agent(ledger), RUN_INPUT, store=store, run_id="r")
    return await store.read_log("r"), read_ledger(ledger, run_id="r")


async def test_an_uninterrupted_run_passes(tmp_path):
    log, entries = await _scenario(tmp_path)
    assert {e.tool for e in entries} == {"add", "lookup", "submit"}
    assert check_recovered_run(log, entries, log) == []


async def test_a_replay_logged_before_the_abandoned_original_is_one_execution_and_a_replay(
    tmp_path,
):
    # A call the crashed incarnation abandoned ends after the resume replayed it: in one
    # process the two ledger lines can come in this order.
    log, entries = await _scenario(tmp_path)
    original = next(e for e in entries if e.tool == "lookup")
    replayed = attrs.evolve(original, replay=True)
    reordered = [replayed if e is original else e for e in entries] + [original]
    assert check_recovered_run(log, reordered, log) == []


async def test_a_safe_call_run_twice_as_an_original_is_found(tmp_path):
    log, entries = await _scenario(tmp_path)
    original = next(e for e in entries if e.tool == "lookup")
    problems = check_recovered_run(log, [*entries, original], log)
    assert problems == [f"r: {original.intent_id} ran again, not as a replay"]


async def test_a_never_call_run_twice_is_found_whatever_the_replay_flag(tmp_path):
    log, entries = await _scenario(tmp_path)
    add = next(e for e in entries if e.tool == "add")
    problems = check_recovered_run(log, [*entries, attrs.evolve(add, replay=True)], log)
    assert problems == [f"r: never-policy {add.intent_id} ran twice"]
