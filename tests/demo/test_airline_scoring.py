"""Airline scoring: recorded rewards and ground-truth hashes reproduced, and the rules."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from treadle.demo.airline.data import (
    AirlineData,
    AirlineDataNotFound,
    AirlineTask,
    GroundTruthAction,
    Recording,
    find_data_dir,
    load_data,
    load_recordings,
)
from treadle.demo.airline.db import AirlineDatabase, content_hash
from treadle.demo.airline.scoring import (
    apply_actions,
    assistant_replies,
    conversation_completed,
    expected_data_hash,
    outputs_found,
    replay_tool_calls,
    score,
    score_recording,
)
from treadle.demo.airline.tools import run_tool


@pytest.fixture(scope="module")
def workload() -> Path:
    try:
        return find_data_dir()
    except AirlineDataNotFound:
        if os.environ.get("CI"):
            raise
        pytest.skip("airline workload data not found (set TREADLE_AIRLINE_DATA)")


@pytest.fixture(scope="module")
def recordings(workload: Path) -> tuple[Recording, ...]:
    return load_recordings(workload)


@pytest.fixture(scope="module")
def fresh(workload: Path, tmp_path_factory: pytest.TempPathFactory) -> AirlineDatabase:
    folder = tmp_path_factory.mktemp("airline-scoring")
    return AirlineDatabase.create(folder / "fresh.sqlite3", load_data(workload))


@pytest.fixture(scope="module")
def expected_hashes(recordings: tuple[Recording, ...], fresh: AirlineDatabase) -> dict[int, str]:
    """Ground-truth content hash per task id (each task's actions applied to a fresh copy)."""
    hashes: dict[int, str] = {}
    for rec in recordings:
        if rec.task_id not in hashes:
            hashes[rec.task_id] = expected_data_hash(rec.task, fresh)
    return hashes


# --------------------------------------------------------------------------- recordings


KNOWN_REWARD_MISMATCHES: frozenset[str] = frozenset()
"""Recordings whose recorded reward is not reproduced; none at present."""


def test_fresh_database_hash_is_the_benchmarks(
    fresh: AirlineDatabase, recordings: tuple[Recording, ...]
):
    no_action = {r.expected_data_hash for r in recordings if not r.task.actions}
    assert no_action == {fresh.data_hash()}
    assert fresh.data_hash() == content_hash(fresh.snapshot())


def test_ground_truth_hashes_match_the_recorded_ones(
    recordings: tuple[Recording, ...], expected_hashes: dict[int, str]
):
    checked = 0
    for rec in recordings:
        if rec.expected_data_hash is not None:
            assert expected_hashes[rec.task_id] == rec.expected_data_hash, rec.name
            checked += 1
    assert checked >= 80  # recordings scored on outputs carry no data hash


def test_recorded_rewards_are_reproduced(
    recordings: tuple[Recording, ...],
    fresh: AirlineDatabase,
    expected_hashes: dict[int, str],
):
    mismatches = {}
    for rec in recordings:
        db = fresh.copy_to(fresh.path.parent / f"{rec.name}.sqlite3")
        replay_tool_calls(rec, db)
        result = score_recording(rec, db, fresh=fresh, expected_hash=expected_hashes[rec.task_id])
        if result.reward != rec.reward:
            mismatches[rec.name] = f"{rec.name}: recorded {rec.reward}, scored {result}"
    report = "\n".join(mismatches.values())
    assert len(recordings) - len(mismatches) >= 0.95 * len(recordings), report
    assert set(mismatches) <= KNOWN_REWARD_MISMATCHES, report


def test_recordings_have_both_rewards(recordings: tuple[Recording, ...]):
    assert {r.reward for r in recordings} == {0.0, 1.0}


# --------------------------------------------------------------------------- rules


USERS: dict[str, Any] = {
    "u1": {
        "payment_methods": {"credit_card_1": {"source": "credit_card", "id": "credit_card_1"}},
        "reservations": ["R1"],
    }
}
RESERVATIONS: dict[str, Any] = {
    "R1": {
        "reservation_id": "R1",
        "user_id": "u1",
        "payment_history": [{"payment_id": "credit_card_1", "amount": 10}],
    }
}


@pytest.fixture
def small(tmp_path: Path) -> AirlineDatabase:
    data = AirlineData(
        users=copy.deepcopy(USERS), reservations=copy.deepcopy(RESERVATIONS), flights={}
    )
    return AirlineDatabase.create(tmp_path / "fresh.sqlite3", data)


CANCEL = AirlineTask(
    user_id="u1",
    instruction="",
    actions=(GroundTruthAction(name="cancel_reservation", kwargs={"reservation_id": "R1"}),),
    outputs=("1,000",),
)


def test_score_needs_matching_data_outputs_and_completion(small: AirlineDatabase):
    db = small.copy_to(small.path.parent / "conversation.sqlite3")
    task = AirlineTask(user_id="u1", instruction="", actions=CANCEL.actions, outputs=("1000",))
    replies = ["Your refund of $1,000 is on its way."]

    before = score(db, task, replies, completed=True, fresh=small)
    assert (before.reward, before.data_matches) == (0.0, False)

    run_tool(db, "cancel_reservation", {"reservation_id": "R1"}, "agent-1")
    done = score(db, task, replies, completed=True, fresh=small)
    assert (done.reward, done.data_matches, done.outputs_found) == (1.0, True, {"1000": True})
    assert done.data_hash == done.expected_data_hash

    assert score(db, task, ["Refund of $999."], completed=True, fresh=small).reward == 0.0
    cut_off = score(db, task, replies, completed=False, fresh=small)
    assert (cut_off.reward, cut_off.completed, cut_off.data_matches) == (0.0, False, True)


def test_bookkeeping_and_read_calls_do_not_count_as_data(small: AirlineDatabase):
    db = small.copy_to(small.path.parent / "conversation.sqlite3")
    run_tool(db, "get_user_details", {"user_id": "u1"}, "a")
    run_tool(db, "cancel_reservation", {"reservation_id": "nope"}, "b")  # refused, recorded
    assert db.applied_actions()
    task = AirlineTask(user_id="u1", instruction="")
    assert score(db, task, [], completed=True, fresh=small).reward == 1.0


def test_expected_data_hash_leaves_fresh_untouched(small: AirlineDatabase):
    before = small.data_hash()
    assert expected_data_hash(CANCEL, small) != before
    assert small.data_hash() == before
    assert small.applied_actions() == []
    copy_ = small.copy_to(small.path.parent / "gt.sqlite3")
    apply_actions(copy_, CANCEL)
    assert copy_.data_hash() == expected_data_hash(CANCEL, small)


def test_outputs_match_ignores_case_and_commas():
    task = AirlineTask(user_id="u", instruction="", outputs=("23553", "Gold"))
    assert outputs_found(task, ["Total: $23,553.", "you are GOLD"]) == {
        "23553": True,
        "Gold": True,
    }
    assert outputs_found(task, ["Total: $23 553"]) == {"23553": False, "Gold": False}


def test_content_hash_counts_list_order_and_number_type_not_key_order():
    assert content_hash({"a": 1, "b": [1, 2]}) == content_hash({"b": [1, 2], "a": 1})
    assert content_hash({"a": [1, 2]}) != content_hash({"a": [2, 1]})
    assert content_hash({"a": 1}) != content_hash({"a": 1.0})


def test_replies_and_completion_from_messages():
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "policy"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "assistant", "content": "calling", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "name": "think", "content": ""},
        {"role": "assistant", "content": None},
    ]
    assert assistant_replies(messages) == ("Hello!",)
    assert not conversation_completed(messages)
    assert conversation_completed([*messages, {"role": "user", "content": "bye ###STOP###"}])
    transfer = {"role": "tool", "name": "transfer_to_human_agents", "content": "ok"}
    assert conversation_completed([*messages, transfer])
