"""What the simulation checks after the runs: the fault-free twin, child runs, threads, digests.

Part of `treadle.testing.simulation`, which re-exports the public names (docs/simulation.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from treadle.ports import RunStore
from treadle.stores import record_to_json
from treadle.stores.memory import MemoryStore
from treadle.supervisors import child_run_id, history
from treadle.testing._sim_scenario import Scenario
from treadle.testing.invariants import (
    check_invariants,
    check_tool_replies,
)
from treadle.testing.scripted import ScriptedModel
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    RunLog,
    StopReason,
)


async def check_child_runs(store: RunStore, parents: Iterable[RunLog]) -> list[str]:
    """Check the child runs in ``store`` of the ``parents`` (docs/child-runs.md).

    - each child belongs to an action intent of its parent, under the run id derived from it,
      and no call has two children (a resumed parent re-attached, never started a second);
    - each child of a finished parent is finished, and its log keeps every invariant
      (`check_invariants`); a cancelled parent's child may be left unfinished only when its
      cancel is in its control stream, for whoever drives it next;
    - each of the parent's results for that intent names the child.

    Returns:
        One sentence per violation.
    """
    logs = {log.run_id: log for log in parents}
    problems: list[str] = []
    per_call: dict[str | None, list[str]] = {}
    for run_id in await store.list_runs():
        child = await store.read_log(run_id)
        started = child.started
        if started is None or started.parent_run_id not in logs:
            continue
        parent = logs[started.parent_run_id]
        per_call.setdefault(started.parent_intent_id, []).append(run_id)
        intents = {r.intent_id for r in parent.records if isinstance(r, ActionIntent)}
        if started.parent_intent_id not in intents:
            problems.append(f"{run_id}: a child run of no action intent of {parent.run_id}")
            continue
        if run_id != child_run_id(started.parent_intent_id or ""):
            problems.append(f"{run_id}: not the run id derived from its parent's intent")
        named = {
            r.outcome.child_run_id
            for r in parent.records
            if isinstance(r, ActionResult) and r.intent_id == started.parent_intent_id
        }
        if named - {run_id, None}:
            problems.append(f"{run_id}: its parent's result names another child: {named}")
        finished = parent.finished
        if child.finished is None:
            if finished is not None and finished.stop_reason is not StopReason.CANCELLED:
                problems.append(f"{run_id}: unfinished, its parent ended {finished.stop_reason}")
            continue
        problems.extend(check_invariants(child))
    for intent_id, runs in per_call.items():
        if len(runs) > 1:
            problems.append(f"{intent_id}: one call started {len(runs)} child runs: {runs}")
    return problems


async def _inherited(
    store: MemoryStore, thread: str, run_id: str, model: ScriptedModel
) -> list[str]:
    """Every request of the thread's second run starts with the first run's history."""
    earlier = list(await history(store, thread))
    problems = []
    for number, request in enumerate(model.requests, start=1):
        seen = [m for m in request.messages if m.role != "system"][: len(earlier)]
        if seen != earlier:
            problems.append(
                f"run {run_id!r}: request {number} does not start with the history of "
                f"{thread!r} it continues"
            )
    return problems


def log_digest(logs: Iterable[RunLog]) -> str:
    """sha256 over every record of ``logs``, in order, each in the codec's JSON-object form.

    The digest is the records' (two stores holding the same records give the same digest),
    not of any store's bytes.
    """
    digest = hashlib.sha256()
    for log in logs:
        for record in log.records:
            digest.update(record_to_json(record).encode("utf-8"))
            digest.update(b"\n")
    return digest.hexdigest()


def _unanswered_calls(run_id: str, model: ScriptedModel) -> list[str]:
    """`check_tool_replies` on every request the world's scripted model received."""
    return [f"run {run_id!r}: {problem}" for problem in check_tool_replies(model.requests)]


_STEP_PARTS: tuple[str, ...] = (
    "decision",
    "history_message",
    "observations",
    "observation_images",
)
"""What is compared of each step with the fault-free twin (`_trajectory`)."""


def _trajectory(log: RunLog) -> list[tuple[Any, ...]]:
    return [tuple(getattr(s, part) for part in _STEP_PARTS) for s in log.steps]


def _first_difference(ours: Any, theirs: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place where two values differ: ``(path, ours, theirs)``, or ``None``.

    Descends into attrs records (by field), sequences (by index) and mappings (by key).
    """
    if ours == theirs:
        return None
    if type(ours) is type(theirs) and attrs.has(type(ours)):
        for field in attrs.fields(type(ours)):
            found = _first_difference(
                getattr(ours, field.name), getattr(theirs, field.name), f"{path}.{field.name}"
            )
            if found is not None:
                return found
    elif isinstance(ours, tuple | list) and isinstance(theirs, tuple | list):
        if len(ours) == len(theirs):
            for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                found = _first_difference(a, b, f"{path}[{index}]")
                if found is not None:
                    return found
    elif isinstance(ours, Mapping) and isinstance(theirs, Mapping) and ours.keys() == theirs.keys():
        for key in ours:
            found = _first_difference(ours[key], theirs[key], f"{path}[{key!r}]")
            if found is not None:
                return found
    return path, ours, theirs


def _clipped(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _step_difference(run_id: str, step: int, ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> str:
    """A sentence naming the first field where step ``step`` differs, with both values."""
    found = None
    for part, a, b in zip(_STEP_PARTS, ours, theirs, strict=True):
        found = _first_difference(a, b, part)
        if found is not None:
            break
    where, a, b = found if found is not None else ("the step", ours, theirs)
    return (
        f"{run_id}: step {step} differs from the fault-free twin's at {where}: "
        f"{_clipped(a)} here, {_clipped(b)} in the twin"
    )


_SPENT_BY_FAULTS = frozenset({StopReason.TIME_BUDGET, StopReason.MAX_MODEL_ATTEMPTS})
"""Budgets that faults legitimately consume (retries, backoff, latency, re-run attempts):
where a run stopped on one of them, only the steps both runs took are compared."""


def _compare_with_twin(log: RunLog, twin: RunLog, scenario: Scenario) -> list[str]:
    """Where the faults did not change what the model saw, the trajectory is the twin's.

    An action whose outcome the faults changed (`_changed_by_faults`) changes what the
    model saw from its step on, and a cancel ends the run early: the comparison covers the
    steps before either. A run (or twin) that stopped on a budget the faults consume is
    compared on the steps both took.
    """
    changed_at = min(
        (
            r.step
            for r in log.records
            if isinstance(r, ActionResult) and _changed_by_faults(r, scenario)
        ),
        default=None,
    )
    ours, theirs = _trajectory(log), _trajectory(twin)
    stops = {f.stop_reason for f in (log.finished, twin.finished) if f is not None}
    cut_short = StopReason.CANCELLED in stops or bool(stops & _SPENT_BY_FAULTS)
    limit = len(ours) if changed_at is None else changed_at - 1
    if changed_at is None and not cut_short and len(ours) != len(theirs):
        return [f"{log.run_id}: {len(ours)} steps, its fault-free twin took {len(theirs)}"]
    for index in range(min(limit, len(theirs))):
        if ours[index] != theirs[index]:
            return [_step_difference(log.run_id, index + 1, ours[index], theirs[index])]
    return []


def _changed_by_faults(result: ActionResult, scenario: Scenario) -> bool:
    """Whether the faults may have changed what ``result`` told the model.

    - an outcome recorded as unknown after a crash;
    - a result recorded late: the run cut its call (a cancel, possibly before the call
      started), and the result is what the cut left, not the call's own outcome;
    - a child-run call whose child ended without succeeding (``Error: the child run <id>
      ended …``) under a parent that went on: the faults cut it, e.g. a child cancelled by
      an incarnation that died before its own cancel was durable (docs/child-runs.md,
      "Cancellation"); every scenario's child runs are counted here, not by the scenario;
    - an outcome the scenario's ``reconcile`` hooks established after a crash
      (`Scenario.changed_observation`).
    """
    outcome = result.outcome
    if outcome.status is ActionStatus.UNKNOWN or result.late:
        return True
    if outcome.child_run_id is not None and outcome.observation.startswith(
        f"Error: the child run {outcome.child_run_id} ended "
    ):
        return True
    return scenario.changed_observation(result)
