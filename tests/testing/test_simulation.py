from __future__ import annotations

import datetime
import re
import subprocess
import sys

import attrs
import pytest

from treadle.approvals import arguments_digest
from treadle.testing import _sim_checks, _sim_ledger, _sim_run, invariants, simulation
from treadle.testing.simulation import FAULT_KINDS, FaultPlan, Ledger, check_invariants, simulate
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    Budgets,
    DecisionKind,
    ModelResult,
    ReplayPolicy,
    RunFinished,
    StepRecord,
    ToolCall,
    Usage,
)


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


def test_seeds_whose_deadlines_tie_give_one_log_digest_every_time():
    """A child run's time budget ended where its parent's step did: trio broke the tie by
    the scopes' memory addresses, and each of these seeds gave two logs within a dozen
    simulations of it in one process. (In a fresh interpreter: under pytest the addresses
    happened to keep one order.)"""
    script = (
        "from treadle.testing.simulation import simulate\n"
        "for seed in (56, 237, 277):\n"
        "    print(seed, len({simulate(seed).log_digest for _ in range(12)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split() == ["56", "1", "237", "1", "277", "1"], done.stdout


def test_the_checker_finds_a_runtime_that_replays_never_actions(monkeypatch):
    """Break the resume rule on purpose: the simulation must catch it."""
    original = _sim_ledger._ledger_tools

    def replaying_tools(ledger):
        toolbox = original(ledger)
        monkeypatch.setattr(toolbox, "replay_policy", lambda tool: ReplayPolicy.SAFE)
        return toolbox

    monkeypatch.setattr(_sim_ledger, "_ledger_tools", replaying_tools)
    plan = FaultPlan(rates={"crash": 1.0})
    failures = [r for r in (simulate(seed, plan=plan) for seed in range(60)) if not r.ok]
    assert failures, "a never-policy action applied twice went unnoticed"
    assert any("applied twice" in v for r in failures for v in r.violations)


async def _log_of_clean_run():
    import random

    import trio

    from treadle._clock import FixedStepClock
    from treadle.stores.memory import MemoryStore
    from treadle.supervisors import run

    ledger = Ledger()
    script = _sim_ledger._script(random.Random(1), FaultPlan(rates={}), {}, 4)
    agent = _sim_ledger._agent(_sim_ledger._model(script), ledger, Budgets(max_steps=6))
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


def _corrupt(records, how):
    """``records`` with one corruption ``how`` planted at the first step with an action."""
    at = next(i for i, r in enumerate(records) if isinstance(r, ActionResult))
    intent_at = next(i for i, r in enumerate(records) if isinstance(r, ActionIntent))
    step_at = next(i for i, r in enumerate(records) if i > at and isinstance(r, StepRecord))
    result, step = records[at], records[step_at]
    changed = list(records)
    if how == "result-before-another-step":
        later = next(r for r in records[step_at + 1 :] if isinstance(r, StepRecord))
        changed[step_at] = later
    elif how == "intent-twice":
        changed.insert(intent_at + 1, records[intent_at])
    elif how in ("call_id", "tool", "step"):
        value = result.step + 1 if how == "step" else "other"
        changed[at] = attrs.evolve(result, **{how: value})
    elif how == "second-run-started":
        changed.insert(1, records[0])
    elif how == "another-run":
        changed[at] = attrs.evolve(result, run_id="another-run")
    elif how == "observations":
        changed[step_at] = attrs.evolve(step, observations=("made up",) * len(step.observations))
    elif how == "result-ids":
        changed[step_at] = attrs.evolve(step, action_result_ids=("nope",))
    elif how == "model-intent":
        changed[step_at] = attrs.evolve(step, model_intent_id="ghost")
    elif how == "call-run-twice":
        return _call_run_twice(records, intent_at, at, step_at)
    elif how == "call-never-asked-for":
        intent = records[intent_at]
        changed[intent_at] = attrs.evolve(intent, call_id="ghost", tool="refund")
        changed[at] = attrs.evolve(result, call_id="ghost", tool="refund")
    elif how == "other-arguments":
        intent = records[intent_at]
        changed[intent_at] = attrs.evolve(intent, arguments={"amount": 10**9})
    elif how == "intent-before-reply":
        changed[intent_at - 1], changed[intent_at] = records[intent_at], records[intent_at - 1]
    elif how == "call-never-run":
        changed[step_at] = attrs.evolve(step, action_result_ids=(), observations=())
        del changed[at]
        del changed[intent_at]
    elif how == "model-result-step":
        model_at = next(i for i, r in enumerate(records) if isinstance(r, ModelResult))
        changed[model_at] = attrs.evolve(records[model_at], step=records[model_at].step + 1)
    elif how == "later-step-first":  # step 2's model call before step 1's step record
        moved = changed.pop(step_at)
        changed.insert(step_at + 2, moved)
    elif how == "step-after-answer":
        return _step_after_the_answer(records)
    elif how in ("ran-what-the-reply-did-not-ask", "answer-to-a-call", "reply-of-step-1"):
        return _step_unlike_its_reply(records, how, intent_at, step_at)
    return tuple(changed)


def _step_unlike_its_reply(records, how, intent_at, step_at):
    """A step that is not of the model reply it names, though consistent in itself.

    ``ran-what-the-reply-did-not-ask``: the first step's action and history message run its
    call with other arguments than the reply's; ``answer-to-a-call``: the last step, a
    final answer, acted on a reply that made a call (and had no text); ``reply-of-step-1``:
    step 2's record names step 1's model call.
    """
    changed = list(records)
    step = records[step_at]
    if how == "ran-what-the-reply-did-not-ask":
        intent = records[intent_at]
        other = {**intent.arguments, "amount": 10**9}
        (kept,) = step.history_message.tool_calls
        history = attrs.evolve(
            step.history_message, tool_calls=(attrs.evolve(kept, arguments=other),)
        )
        changed[intent_at] = attrs.evolve(intent, arguments=other)
        changed[step_at] = attrs.evolve(step, history_message=history)
    elif how == "answer-to-a-call":
        model_at = max(i for i, r in enumerate(records) if isinstance(r, ModelResult))
        result = records[model_at]
        asked = ToolCall(id="late", name=records[intent_at].tool, arguments={})
        reply = attrs.evolve(result.reply, text=None, tool_calls=(asked,))
        changed[model_at] = attrs.evolve(result, reply=reply)
    else:
        second = next(i for i, r in enumerate(records) if isinstance(r, StepRecord) and r.step == 2)
        changed[second] = attrs.evolve(records[second], model_intent_id=step.model_intent_id)
    return tuple(changed)


def _step_after_the_answer(records):
    """A model call and a step more after the step that gave the final answer."""
    *written, finished = records
    step = written[-1]
    assert isinstance(step, StepRecord) and step.decision is DecisionKind.FINAL_ANSWER
    intent, result = written[-3], written[-2]
    again = f"{intent.intent_id}-again"
    return (
        *written,
        attrs.evolve(intent, intent_id=again, step=step.step + 1),
        attrs.evolve(result, intent_id=again, step=step.step + 1),
        attrs.evolve(step, step=step.step + 1, model_intent_id=again),
        finished,
    )


def _call_run_twice(records, intent_at, at, step_at):
    """The first action's call run a second time, under a second intent, in its step."""
    intent, result, step = records[intent_at], records[at], records[step_at]
    again = attrs.evolve(intent, intent_id=f"{intent.intent_id}-again")
    result_again = attrs.evolve(result, intent_id=again.intent_id)
    step_again = attrs.evolve(
        step,
        action_result_ids=(*step.action_result_ids, again.intent_id),
        observations=(*step.observations, result.outcome.observation),
    )
    return (
        *records[: intent_at + 1],
        again,
        *records[intent_at + 1 : step_at],
        result_again,
        step_again,
        *records[step_at + 1 :],
    )


@pytest.mark.parametrize(
    ("how", "rule"),
    [
        # Each of these corruptions passed check_invariants.
        ("result-before-another-step", "without step record"),
        ("intent-twice", "was written twice"),
        ("call_id", "is of call, tool and step"),
        ("tool", "is of call, tool and step"),
        ("step", "is of call, tool and step"),
        ("second-run-started", "is a second run-started"),
        ("another-run", "is of run 'another-run'"),
        ("observations", "observations do not show the results"),
        ("result-ids", "lists action results \\['nope'\\]"),
        ("model-intent", "acted on model call ghost"),
        # These passed too: nothing tied a step's actions to the reply that asked for them.
        ("call-run-twice", "has a second action intent .* \\(a call run twice\\)"),
        ("call-never-asked-for", "runs call 'ghost' \\(refund\\), which the reply of step"),
        ("other-arguments", "with \\{'amount': 1000000000\\}, but call"),
        ("intent-before-reply", "were written before the reply of .* that asked for them"),
        # And these: a call never run, a step's records out of place, a step after the answer.
        ("call-never-run", "reply asked for calls \\['c0'\\], but got no action"),
        ("model-result-step", "model result r/s1/m1 is of step 2, its intent of step 1"),
        ("later-step-first", "is of step 2, written before the record of step 1"),
        ("step-after-answer", "follows step 5, whose decision was the final answer"),
        # And these: a step at odds with the model reply it names.
        (
            "ran-what-the-reply-did-not-ask",
            "the reply of r/s1/m1 that step 1 acted on made call 'c0' with .*, its history "
            "message holds .*'amount': 1000000000",
        ),
        (
            "answer-to-a-call",
            "the reply of r/s5/m1 that step 5 acted on made calls \\['late'\\], which its "
            "history message \\(final_answer\\) does not hold",
        ),
        ("reply-of-step-1", "step 2 acted on model call r/s1/m1, which is of step 1"),
    ],
)
async def test_check_invariants_flags_a_record_out_of_place(how, rule):
    log, _ = await _log_of_clean_run()
    corrupted = attrs.evolve(log, records=_corrupt(log.records, how))
    problems = check_invariants(corrupted)
    assert any(re.search(rule, p) for p in problems), problems


async def test_check_invariants_flags_a_call_decided_twice():
    import treadle
    from treadle.testing.scripted import ScriptedModel, call, say

    @treadle.tool(requires_approval=True)
    async def pay(amount: int) -> str:
        """Pay."""
        return f"paid {amount}"

    store = treadle.MemoryStore()
    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("pay", amount=10), say("done")]),
        executor=treadle.Toolbox([pay]),
        parser=treadle.NativeToolCallParser(),
    )
    async with treadle.open_run(agent, "pay", store=store, run_id="twice") as handle:
        async for event in handle.events():
            if event.kind == "approval_requested":
                handle.approve()
    log = await store.read_log("twice")
    assert check_invariants(log) == []
    records = list(log.records)
    at = next(i for i, r in enumerate(records) if isinstance(r, ApprovalDecided))
    second = attrs.evolve(records[at], decision="reject", message="no")
    problems = check_invariants(
        attrs.evolve(log, records=(*records[: at + 1], second, *records[at + 1 :]))
    )
    assert any("was decided twice (approve, then reject)" in p for p in problems), problems


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
    assert set(lines[0]) == {
        "seed",
        "ok",
        "violations",
        "faults_injected",
        "steps",
        "log_digest",
        "skipped",
    }

    def broken_check(log, **options):
        return ["forced violation"]

    monkeypatch.setattr(_sim_run, "check_invariants", broken_check)
    failing = runner.invoke(main, ["simulate", "--seeds", "3", "--from", "4"])
    assert failing.exit_code == 1
    assert "treadle simulate --from 4 --seeds 1" in failing.output
    # The replay itself does not suggest the same command again: it shows the run's log.
    alone = runner.invoke(main, ["simulate", "--seeds", "1", "--from", "4"])
    assert alone.exit_code == 1
    assert "--from 4 --seeds 1" not in alone.output
    assert "seed 4 fails the same way each time" in alone.stderr
    assert "logs are on standard output. Faults injected: " in alone.stderr
    assert "sim-4-0" in alone.stdout and "run finished" in alone.stdout  # its log, as show
    quiet = runner.invoke(main, ["simulate", "--seeds", "1", "--from", "4", "--json"])
    assert quiet.exit_code == 1 and "run finished" not in quiet.stdout
    assert "shown when it is simulated without --json" in quiet.stderr


def test_user_scenario_from_the_docs_example_runs_green():
    from click.testing import CliRunner

    from treadle.cli import main

    result = CliRunner().invoke(
        main, ["simulate", "--agent", "examples.simulate_notes_agent:scenario", "--seeds", "30"]
    )
    assert result.exit_code == 0, result.output


def _capture_logs(monkeypatch):
    """Collect every simulated run's log (the twin comparison sees each one)."""
    logs = []
    original = _sim_run._compare_with_twin

    def capturing(log, twin, scenario):
        logs.append(log)
        return original(log, twin, scenario)

    monkeypatch.setattr(_sim_run, "_compare_with_twin", capturing)
    return logs


def test_approvals_of_every_kind_path_and_timing_are_exercised_and_green(monkeypatch):
    from treadle.types import ApprovalDecided

    logs = _capture_logs(monkeypatch)
    answered = []
    original = _sim_run._Approver._answer

    async def recording(self, handle, request, plan):
        answered.append((plan.via, plan.restart and self.may_restart, plan.delay_s))
        await original(self, handle, request, plan)

    monkeypatch.setattr(_sim_run._Approver, "_answer", recording)
    plan = FaultPlan(rates={"approval": 0.5, "crash": 0.3, "latency": 0.2})
    for seed in range(40):
        result = simulate(seed, plan=plan)
        assert result.ok, (seed, result.violations)
    decisions = {r.decision for log in logs for r in log.records if isinstance(r, ApprovalDecided)}
    assert decisions == {"approve", "reject", "edit", "expired"}
    assert {(via, restart) for via, restart, _ in answered} == {
        ("handle", False),
        ("handle", True),
        ("control", False),
        ("control", True),
    }
    assert any(delay > simulation.APPROVAL_TIMEOUT_S for *_, delay in answered)


def test_seed_881_regression_a_late_decision_does_not_delay_the_next_request():
    """The simulated human once queued requests behind an expired one, so the twin's next
    request expired while the crashed run's was decided (a false trajectory difference)."""
    assert simulate(881).ok


def test_token_and_time_budgets_bind_in_some_seeds(monkeypatch):
    logs = _capture_logs(monkeypatch)
    for seed in range(60):
        assert simulate(seed).ok
    reasons = {log.finished.stop_reason.value for log in logs if log.finished is not None}
    assert {"token_budget", "time_budget"} <= reasons


async def _approval_log(edit=None, reject=None):
    import random

    import trio

    from treadle import (
        Agent,
        FixedStepClock,
        MemoryStore,
        NativeToolCallParser,
        Toolbox,
        tool,
    )
    from treadle.supervisors import open_run
    from treadle.testing import ScriptedModel, call, say

    @tool(requires_approval=True)
    async def pay(amount: int) -> str:
        """Pay."""
        return f"paid {amount}"

    agent = Agent(
        model=ScriptedModel(turns=[call("pay", call_id="p1", amount=5), say("ok")]),
        executor=Toolbox([pay]),
        parser=NativeToolCallParser(),
    )
    store = MemoryStore()
    async with open_run(
        agent, "pay", store=store, run_id="a", clock=FixedStepClock(), rng=random.Random(0)
    ) as handle:
        for _ in range(100):  # virtual time: the request comes within a tick
            if handle.pending_approval is not None:
                break
            await trio.sleep(0.01)
        handle.approve("p1", edit=edit, reject=reject)
    return await store.read_log("a")


def _replace(log, index, record):
    records = list(log.records)
    records[index] = record
    return attrs.evolve(log, records=tuple(records))


async def test_check_approvals_flags_each_broken_rule(autojump_clock):
    from treadle.types import ActionIntent, ActionOutcome, ActionStatus, ApprovalDecided

    edited = await _approval_log(edit={"amount": 2})
    assert check_invariants(edited) == []
    records = list(edited.records)
    decided_at = next(i for i, r in enumerate(records) if isinstance(r, ApprovalDecided))
    intent_at = next(i for i, r in enumerate(records) if isinstance(r, ActionIntent))
    assert records[intent_at].arguments == {"amount": 2}

    swapped = records[:]
    swapped[decided_at], swapped[intent_at] = swapped[intent_at], swapped[decided_at]
    early = attrs.evolve(edited, records=tuple(swapped))
    assert any("before its approval decision" in p for p in check_invariants(early))

    other_args = _replace(
        edited, intent_at, attrs.evolve(records[intent_at], arguments={"amount": 5})
    )
    assert any("not the edited arguments" in p for p in check_invariants(other_args))

    as_reject = _replace(edited, decided_at, attrs.evolve(records[decided_at], decision="reject"))
    assert any("although it was reject" in p for p in check_invariants(as_reject))

    rejected = await _approval_log(reject="no")
    assert check_invariants(rejected) == []
    assert not any(isinstance(r, ActionIntent) for r in rejected.records)
    result_at = next(i for i, r in enumerate(rejected.records) if isinstance(r, ActionResult))
    ran = attrs.evolve(
        rejected.records[result_at],
        outcome=ActionOutcome(status=ActionStatus.EXECUTED, observation="paid 5"),
    )
    assert any(
        "refused but its result" in p for p in check_invariants(_replace(rejected, result_at, ran))
    )


def _approval_damaged(log, how):
    """``log`` (a call approved by a human) with its approval records damaged ``how``."""
    from treadle.types import ApprovalRequested

    records = list(log.records)
    asked = next(i for i, r in enumerate(records) if isinstance(r, ApprovalRequested))
    decided = next(i for i, r in enumerate(records) if isinstance(r, ApprovalDecided))
    request, decision = records[asked], records[decided]
    if how == "request-dropped":
        del records[asked]
    elif how == "decision-first":
        records[asked], records[decided] = decision, request
    elif how == "other-digest":
        records[decided] = attrs.evolve(decision, arguments_digest="sha256:" + "0" * 64)
    elif how == "after-deadline":
        late = datetime.datetime.fromisoformat(request.deadline_ts) + datetime.timedelta(seconds=1)
        records[decided] = attrs.evolve(decision, ts=late.isoformat())
    elif how == "call-not-asked-for":
        records[asked] = attrs.evolve(request, call_id="ghost")
        records[decided] = attrs.evolve(decision, call_id="ghost")
    elif how == "approved-other-arguments":  # the human saw and approved amount 1; 5 ran
        other = arguments_digest({"amount": 1})
        records[asked] = attrs.evolve(request, arguments={"amount": 1}, arguments_digest=other)
        records[decided] = attrs.evolve(decision, arguments_digest=other)
    return attrs.evolve(log, records=tuple(records))


@pytest.mark.parametrize(
    ("how", "rule"),
    [
        # Each of these passed check_invariants: a decision was taken at its word.
        ("request-dropped", "decision \\(approve\\) on call p1 of step 1 answers no approval"),
        ("decision-first", "answers no approval request written before it"),
        ("other-digest", "is bound to arguments sha256:0+, the request to sha256:"),
        ("after-deadline", "after the request's deadline .*: it never counts"),
        ("call-not-asked-for", "requested for call 'ghost' \\(pay\\), which the reply of step 1"),
        # And these: an approval bound to other arguments than the call that ran.
        ("approved-other-arguments", "ran with \\{'amount': 5\\}, not the arguments approved"),
        (
            "approved-other-arguments",
            "request for call 'p1' of step 1 is bound to arguments sha256:.*, not to the "
            "call's \\{'amount': 5\\}",
        ),
    ],
)
async def test_check_invariants_flags_a_decision_the_run_could_not_have_applied(
    how, rule, autojump_clock
):
    approved = await _approval_log()
    assert check_invariants(approved) == []
    problems = check_invariants(_approval_damaged(approved, how))
    assert any(re.search(rule, p) for p in problems), problems


def _finish_damaged(log, how):
    """``log`` (a clean run ended with a final answer) with its end damaged ``how``."""
    from treadle.types import RunState, StopReason

    *records, finished = log.records
    step_at = max(i for i, r in enumerate(records) if isinstance(r, StepRecord))
    if how == "succeeded-max-steps":
        finished = attrs.evolve(finished, stop_reason=StopReason.MAX_STEPS)
    elif how == "failed-final-answer":
        finished = attrs.evolve(finished, state=RunState.FAILED)
    elif how == "other-answer":
        finished = attrs.evolve(finished, final_answer="something else")
    elif how == "last-step-invalid":
        records[step_at] = attrs.evolve(records[step_at], decision=DecisionKind.INVALID)
    elif how == "more-active-time":
        finished = attrs.evolve(finished, totals=attrs.evolve(finished.totals, active_s=999.0))
    elif how == "less-active-time":
        records[step_at] = attrs.evolve(records[step_at], active_s=records[step_at].active_s + 5)
    elif how == "output-without-answer":
        finished = attrs.evolve(
            finished,
            state=RunState.FAILED,
            stop_reason=StopReason.MAX_STEPS,
            final_answer=None,
            output={"city": "Paris"},
        )
    return attrs.evolve(log, records=(*records, finished))


@pytest.mark.parametrize(
    ("how", "rule"),
    [
        # Each of these passed check_invariants: the run-finished record was taken at its word.
        (
            "succeeded-max-steps",
            "finished succeeded with stop reason max_steps, which ends a run failed",
        ),
        (
            "failed-final-answer",
            "finished failed with stop reason final_answer, which ends a run succ",
        ),
        ("other-answer", "final answer 'something else' is not the text of step 5"),
        ("last-step-invalid", "finished final_answer, but its last step is step 5 \\(invalid\\)"),
        ("more-active-time", "active time 999.000000 s is not its step records'"),
        ("less-active-time", "active time .* s is less than its step records'"),
        ("output-without-answer", "finished max_steps with an output; only a run ended final_answ"),
    ],
)
async def test_check_invariants_flags_a_run_finished_record_the_log_contradicts(how, rule):
    log, _ = await _log_of_clean_run()
    assert check_invariants(log) == []
    problems = check_invariants(_finish_damaged(log, how))
    assert any(re.search(rule, p) for p in problems), problems


async def _cancelled_log():
    """A run cancelled while its one tool call sleeps: the call's late result, then the cancel."""
    import trio

    from treadle import Agent, MemoryStore, NativeToolCallParser, Toolbox, tool
    from treadle.supervisors import open_run
    from treadle.testing import ScriptedModel, call, say

    @tool
    async def slow() -> str:
        """Sleep."""
        await trio.sleep(60)
        return "slept"

    agent = Agent(
        model=ScriptedModel(turns=[call("slow"), say("never")]),
        executor=Toolbox([slow]),
        parser=NativeToolCallParser(),
    )
    store = MemoryStore()
    with trio.fail_after(30):
        async with open_run(agent, "go", store=store, run_id="c") as handle:
            async for event in handle.events():
                if event.kind == "action_requested":
                    handle.cancel("stop")
    return await store.read_log("c")


async def test_check_invariants_flags_a_cancel_out_of_place(autojump_clock):
    from treadle.types import CancelRequested, RunState, StopReason

    log = await _cancelled_log()
    assert log.finished is not None and log.finished.state is RunState.CANCELLED
    assert check_invariants(log) == []
    *records, finished = log.records
    at = next(i for i, r in enumerate(records) if isinstance(r, CancelRequested))
    cancel = records.pop(at)

    dropped = attrs.evolve(log, records=(*records, finished))
    assert any(
        "finished cancelled without a cancel in its log" in p for p in check_invariants(dropped)
    )
    first = attrs.evolve(log, records=(records[0], cancel, *records[1:], finished))
    assert any(
        re.search("record 3 \\(ModelIntent\\) follows the cancel \\(record 2\\)", p)
        for p in check_invariants(first)
    )
    succeeded = attrs.evolve(
        finished, state=RunState.SUCCEEDED, stop_reason=StopReason.TASK_COMPLETED
    )
    ignored = attrs.evolve(log, records=(*records, cancel, succeeded))
    assert any(
        "holds a cancel (record 7), but the run finished succeeded" in p
        for p in check_invariants(ignored)
    )


async def test_a_cancel_after_the_final_answer_ends_the_run_cancelled_and_is_no_violation():
    """Rule A comes before rule D: a cancel taken in after the answering step's record, before
    the run-finished, ends the run cancelled (docs/concepts.md, "Stop reasons")."""
    from treadle.types import CancelRequested, RunState, StopReason

    log, _ = await _log_of_clean_run()
    *records, finished = log.records
    cancel = CancelRequested(run_id=log.run_id, ts=finished.ts, reason="too late")
    cancelled = attrs.evolve(
        finished,
        state=RunState.CANCELLED,
        stop_reason=StopReason.CANCELLED,
        final_answer=None,
    )
    assert check_invariants(attrs.evolve(log, records=(*records, cancel, cancelled))) == []


async def _usage_log():
    log, _ = await _log_of_clean_run()
    return log


async def test_a_real_clocks_few_milliseconds_past_the_time_budget_are_no_overshoot():
    """A run stopped on ``time_budget`` by a real clock ends a few ms past it (1.0012 s to
    1.0049 s of a 1 s budget were seen): not an overshoot, except on the virtual clock."""
    from treadle.types import RunState, StopReason

    log = await _usage_log()
    finished = attrs.evolve(  # cut in its last step: that step's time has no step record
        log.records[-1],
        state=RunState.FAILED,
        stop_reason=StopReason.TIME_BUDGET,
        final_answer=None,
    )
    budget = Budgets(time_budget_s=finished.totals.active_s)
    late = attrs.evolve(finished.totals, active_s=finished.totals.active_s + 0.005)
    real = _replace(log, len(log.records) - 1, attrs.evolve(finished, totals=late))
    assert check_invariants(real, budgets=budget) == []
    virtual = check_invariants(real, budgets=budget, time_slack_s=simulation.VIRTUAL_TIME_SLACK_S)
    assert any("overshoot the time budget" in p for p in virtual), virtual
    waited = attrs.evolve(finished.totals, active_s=finished.totals.active_s + 2.0)  # a grace
    overshot = _replace(log, len(log.records) - 1, attrs.evolve(finished, totals=waited))
    assert any("overshoot the time budget" in p for p in check_invariants(overshot, budgets=budget))


async def test_check_budgets_flags_overshooting_logs(autojump_clock):
    from treadle.types import ModelIntent, ModelResult, Totals

    log = await _usage_log()
    results = [r for r in log.records if isinstance(r, ModelResult)]
    known = [r for r in results if r.usage.input_tokens is not None]
    assert len(log.steps) >= 3 and known, "the scripted run reports usage"
    assert simulation.check_budgets(log, Budgets(max_steps=None)) == []
    after_first = sum(invariants._tokens(r.usage) for r in results[: results.index(known[0]) + 1])

    # The next attempt began with the budget already spent.
    spent = simulation.check_budgets(log, Budgets(token_budget=after_first))
    assert any("at or past the token budget" in p for p in spent)
    # The reply that crossed the budget was acted on.
    crossed = simulation.check_budgets(log, Budgets(token_budget=after_first - 1))
    assert any("past the token budget" in p and "action" in p for p in crossed)

    first_step = log.steps[0].active_s
    late = simulation.check_budgets(log, Budgets(time_budget_s=first_step / 2))
    assert any("step 2 began after" in p for p in late)

    finished = log.records[-1]
    total = finished.totals.active_s
    over = _replace(
        log,
        len(log.records) - 1,
        attrs.evolve(finished, totals=attrs.evolve(finished.totals, active_s=total + 1.0)),
    )
    assert any(
        "overshoot the time budget" in p
        for p in simulation.check_budgets(over, Budgets(time_budget_s=total + 0.5))
    )
    assert simulation.check_budgets(log, Budgets(time_budget_s=total)) == []

    attempts = sum(isinstance(r, ModelIntent) for r in log.records)
    assert any(
        "attempt budget" in p
        for p in simulation.check_budgets(log, Budgets(max_model_attempts=attempts - 1))
    )

    # Unknown usage is not 0: totals claiming 0 where nothing was reported are refused.
    zero = attrs.evolve(finished.totals, unknown_usage_attempts=0)
    if finished.totals.unknown_usage_attempts:
        assert any(
            "run-finished totals" in p
            for p in check_invariants(
                _replace(log, len(log.records) - 1, attrs.evolve(finished, totals=zero))
            )
        )
    unreported = [
        attrs.evolve(r, usage=Usage()) if isinstance(r, ModelResult) else r
        for r in log.records[:-1]
    ]
    silent = attrs.evolve(
        log,
        records=(
            *unreported,
            attrs.evolve(
                finished,
                totals=Totals(
                    steps=finished.totals.steps,
                    model_attempts=attempts,
                    input_tokens=0,
                    output_tokens=0,
                    unknown_usage_attempts=len(results),
                    active_s=total,
                ),
            ),
        ),
    )
    assert any("run-finished totals" in p for p in check_invariants(silent))


def test_the_checker_finds_a_runtime_that_ignores_the_token_budget(monkeypatch):
    """Break the token budget on purpose: the simulation must catch the overshoot."""
    from treadle.actors import ModelGateway, RunCoordinator

    original = RunCoordinator._budget_reason

    def without_tokens(self):
        kept = self.budgets
        self.budgets = attrs.evolve(kept, token_budget=None)
        try:
            return original(self)
        finally:
            self.budgets = kept

    monkeypatch.setattr(RunCoordinator, "_budget_reason", without_tokens)
    monkeypatch.setattr(ModelGateway, "_budget_stop", lambda self, attempts, tokens: None)
    monkeypatch.setattr(ModelGateway, "_remaining_tokens", lambda self, tokens: None)
    failures = [
        r for r in (simulate(seed, plan=FaultPlan(rates={})) for seed in range(40)) if not r.ok
    ]
    assert any("token budget" in v for r in failures for v in r.violations)


@attrs.define(eq=False)
class _RefusedWorld:
    model: object


@attrs.frozen
class _RefusedOnce:
    """The model's call fails for good (context length), as would every attempt after it."""

    def world(self, rng, plan, counts):
        from treadle.testing import ScriptedModel, say
        from treadle.types import ModelErrorInfo

        refused = ModelErrorInfo(kind="context_length_exceeded", status=400)
        failures = {0: [refused] * 5}  # a provider's refusal for length is persistent
        return _RefusedWorld(model=ScriptedModel(turns=[say("never")], failures=failures))

    def agent(self, world):
        import treadle

        return treadle.Agent(
            model=world.model,
            executor=treadle.Toolbox([]),
            parser=treadle.NativeToolCallParser(),
        )

    def input(self, world):
        return "Summarise everything."

    def check(self, log, world):
        return []

    def changed_observation(self, result):
        return False


CRASHES = FaultPlan.of(["crash"], rate=0.5)
REFUSED_SEEDS = range(30)  # crashes at each write of the short run, before and after


def test_regression_a_model_call_that_failed_for_good_is_not_rerun_on_resume():
    """Found by the simulation: a crash between a final model error and its step record
    made resume try the model again instead of reusing the recorded failure."""
    for seed in REFUSED_SEEDS:
        result = simulate(seed, plan=CRASHES, scenario=_RefusedOnce())
        assert result.ok, (seed, result.violations)


def test_the_checker_flags_a_reattempt_after_a_final_model_error(monkeypatch):
    from treadle.actors import RunCoordinator

    # Put the bug back: the coordinator forgets the recorded failure on resume.
    monkeypatch.setattr(RunCoordinator, "_failed_for_good", lambda self, pending: None)
    found = [simulate(seed, plan=CRASHES, scenario=_RefusedOnce()) for seed in REFUSED_SEEDS]
    violations = [v for result in found for v in result.violations]
    assert violations and all("failed for good" in v for v in violations)


def test_the_printed_replay_command_reproduces_the_failing_seed_of_a_user_scenario():
    import json
    import shlex

    from click.testing import CliRunner

    from treadle.cli import main

    runner = CliRunner()
    spec = "flaky_scenario:scenario"
    args = ["simulate", "--agent", spec, "--faults", "crash", "--rate", "0.9", "--seeds", "20"]
    first = runner.invoke(main, [*args, "--json"])
    assert first.exit_code == 1, first.output
    failed = [json.loads(line) for line in first.stdout.splitlines() if '"ok": false' in line]
    (command,) = [line for line in first.stderr.splitlines() if "treadle simulate" in line]
    replay = shlex.split(command.split(": ", 1)[1])[1:]  # drop "treadle"
    assert "--rate" in replay and spec in replay
    again = runner.invoke(main, replay)
    assert again.exit_code == 1
    (line,) = [json.loads(line) for line in again.stdout.splitlines() if line.startswith("{")]
    assert line == failed[0]  # same seed, same violations, same log digest
    assert "failing" in first.stderr and str(len(failed)) in first.stderr
    # The summary row: 20 seeds, then the steps, then exactly the number of failing seeds.
    assert re.search(rf"│\s*20\s*│\s*\d+\s*│\s*{len(failed)}\s*│", first.stderr)


def test_simulate_refuses_an_agent_factory_and_steps_with_a_scenario():
    from click.testing import CliRunner

    from treadle.cli import main

    runner = CliRunner()
    agent = runner.invoke(main, ["simulate", "--agent", "flaky_scenario:agent_factory"])
    assert agent.exit_code == 2
    assert "not a simulation scenario" in agent.output and "Traceback" not in agent.output
    steps = runner.invoke(main, ["simulate", "--agent", "flaky_scenario:scenario", "--steps", "3"])
    assert steps.exit_code == 2 and "--steps" in steps.output
    for faults in ("", "crash,", "all,crash"):
        bad = runner.invoke(main, ["simulate", "--faults", faults])
        assert bad.exit_code == 2 and "choose from crash" in bad.output, faults
    # A scenario's own hook raising is its author's bug: one line naming it, no traceback.
    broken = runner.invoke(main, ["simulate", "--agent", "flaky_scenario:check_raises"])
    assert broken.exit_code == 1 and "Traceback" not in broken.output
    assert "seed 0: the scenario from --agent flaky_scenario:check_raises failed" in broken.output
    assert "KeyError('check broke')" in broken.output


def test_simulate_refuses_a_nan_rate_too_many_runs_per_seed_and_steps_at_their_options():
    # `--rate nan` passed the option's range and was reported as an invalid `--faults`;
    # `--runs-per-seed 100000000000` printed nothing while its memory grew without bound.
    from click.testing import CliRunner

    from treadle.cli import main

    runner = CliRunner()
    for faults in ("all", "crash"):
        nan = runner.invoke(main, ["simulate", "--seeds", "1", "--faults", faults, "--rate", "nan"])
        assert nan.exit_code == 2, nan.output
        assert "Invalid value for '--rate': 'nan' is not a number" in nan.output
        assert "--faults" not in nan.output
    many = runner.invoke(main, ["simulate", "--seeds", "1", "--runs-per-seed", "100000000000"])
    assert many.exit_code == 2, many.output
    assert "Invalid value for '--runs-per-seed'" in many.output and "1<=x<=1000" in many.output
    # `--steps 10000000` wrote a script of ten million turns before the run started.
    long = runner.invoke(main, ["simulate", "--seeds", "1", "--steps", "10000000"])
    assert long.exit_code == 2, long.output
    assert "Invalid value for '--steps'" in long.output and "1<=x<=10000" in long.output


def test_a_scenario_swaps_actors_for_every_incarnation_and_the_twin():
    import attrs

    from treadle.supervisors import Actors, real_executor
    from treadle.testing.simulation import LedgerScenario

    built: list[str] = []

    @attrs.frozen(kw_only=True)
    class Swapping(LedgerScenario):
        def actors(self, world):
            def executor(context):
                built.append(context.run_id)
                return real_executor(context)

            return Actors(executor=executor)

    plan = FaultPlan.of(["crash", "latency"], rate=0.5)
    result = simulate(5, scenario=Swapping(steps=4), plan=plan)
    assert result.ok, result.violations
    # Built for the run (again for each incarnation after a crash) and for its twin.
    assert len(built) >= 2
    assert set(built) == {"sim-5-0"}


@attrs.frozen
class _UnnamedCalls:
    """The docs' notes scenario, its calls written without ``call_id=`` (a new user's way)."""

    notes: int = 3

    def __getattr__(self, name):
        from examples.simulate_notes_agent import NotesScenario

        return getattr(NotesScenario(notes=self.notes), name)

    def world(self, rng, plan, counts):
        from examples.simulate_notes_agent import Notes

        from treadle.testing import ScriptedModel, call, say

        call("warm_up")  # calls scripted elsewhere in the process must not shift the ids
        turns = [call("save_note", text=f"note {i}") for i in range(self.notes)]
        turns += [call("list_notes"), say("Saved them all.")]
        world = Notes()
        world.provider = ScriptedModel(turns=turns, latency_s=0.1)
        return world


@pytest.mark.parametrize("plan", [FaultPlan(rates={}), FaultPlan.default()], ids=["none", "all"])
def test_a_scenario_whose_calls_have_no_call_id_is_green(plan):
    """Issue: a scenario written with ``call(...)`` without ``call_id=`` failed every seed
    ("step 1 differs from the fault-free twin's"): the ids came from a process-wide counter."""
    for seed in range(20):
        result = simulate(seed, plan=plan, scenario=_UnnamedCalls())
        assert result.ok, (seed, result.violations)


def test_unnamed_scripted_calls_are_named_by_their_place_in_the_script():
    import trio

    from treadle.testing import ScriptedModel, call, calls, say
    from treadle.types import Message, ModelRequest, ToolCall

    model = ScriptedModel(
        turns=[call("a"), calls(ToolCall(id="", name="b"), ToolCall(id="mine", name="c")), say("x")]
    )
    first = trio.run(model.complete, ModelRequest(messages=(Message(role="user", content="go"),)))
    assistant = Message(role="assistant", content="")
    second = trio.run(
        model.complete, ModelRequest(messages=(Message(role="user", content="go"), assistant))
    )
    assert [c.id for c in first.tool_calls] == ["call_1_1"]
    assert [c.id for c in second.tool_calls] == ["call_2_1", "mine"]


def test_a_twin_mismatch_names_the_field_and_both_values():
    ours = ({"kind": "tool_calls", "calls": [{"id": "call_1", "name": "save"}]}, None, ())
    theirs = ({"kind": "tool_calls", "calls": [{"id": "call_7", "name": "save"}]}, None, ())
    message = _sim_checks._step_difference("r1", 1, ours, theirs)
    assert message == (
        "r1: step 1 differs from the fault-free twin's at decision['calls'][0]['id']: "
        "'call_1' here, 'call_7' in the twin"
    )


@pytest.mark.parametrize("kind", ["tool_stuck", "bad_text"])
def test_the_review_fault_kinds_are_injected_and_the_invariants_hold(kind):
    """A tool that ignores cancellation, and text that is not valid Unicode (the hostile
    review's classes), injected alone and with crashes: every seed's invariants hold."""
    plan = FaultPlan.of([kind, "crash"], rate=0.4)
    results = [simulate(seed, plan=plan) for seed in range(40)]
    assert sum(r.faults_injected.get(kind, 0) for r in results) >= 10
    assert [r.violations for r in results if not r.ok] == []


@attrs.define(eq=False)
class _SlowWorld:
    provider: object = None
    done: list[int] = attrs.Factory(list)


@attrs.frozen
class _SlowSyncTools:
    """A scenario whose tool is a plain ``def`` taking 20 ms of real time (timeout 1 s)."""

    calls: int = 3

    def world(self, rng, plan, counts):
        from treadle.testing import ScriptedModel, call, say

        world = _SlowWorld()
        turns = [call("compute", x=i) for i in range(self.calls)] + [say("done")]
        world.provider = ScriptedModel(turns=turns)
        return world

    def agent(self, world):
        import time

        import treadle

        @treadle.tool(replay=ReplayPolicy.SAFE, timeout_s=1.0)
        def compute(x: int) -> str:
            """Compute slowly."""
            time.sleep(0.02)
            world.done.append(x)
            return f"result {x}"

        return treadle.Agent(
            model=world.provider,
            executor=treadle.Toolbox([compute]),
            parser=treadle.NativeToolCallParser(),
            budgets=Budgets(max_steps=10),
        )

    def input(self, world):
        return "go"

    def check(self, log, world):
        outcomes = [r.outcome.observation for r in log.records if isinstance(r, ActionResult)]
        return [] if outcomes == [f"result {i}" for i in range(self.calls)] else [str(outcomes)]

    def changed_observation(self, result):
        return False


def test_a_def_tool_returns_in_a_simulation_the_same_way_every_time():
    """A ``def`` tool ran in a worker thread while the virtual clock jumped (every task
    waited), so its calls timed out after a virtual second or returned, by the thread's
    timing; the seed still passed. It is called directly in trio's thread now."""
    plan = FaultPlan(rates={})
    results = [simulate(seed, plan=plan, scenario=_SlowSyncTools()) for seed in (0, 0, 1)]
    assert all(result.ok for result in results), [r.violations for r in results]
    assert results[0].log_digest == results[1].log_digest
