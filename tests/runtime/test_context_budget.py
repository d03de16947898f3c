"""The context budget end to end: real actors, real stores, a model with a real window.

docs/context.md: every request fits the window less the output cap and the margin; what
stays, in order; durable summaries made inside the step; the context each model result
records; a context-length refusal compacts once and retries the step.
"""

from __future__ import annotations

import json

import attrs
import pytest
import trio
from tests.fixtures.dense_provider import DenseProvider, dense_tokens

from treadle import MemoryStore, ModelCallError, UsageError, run
from treadle._budget import DEFAULT_SUMMARY_PROMPT, estimate_tools
from treadle.stores import record_to_json
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing.invariants import check_context, check_invariants, check_tool_replies
from treadle.testing.windowed import WindowedModel, provider_tokens, windowed_agent
from treadle.types import (
    Attempt,
    ContextUsed,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelRequest,
    ModelResult,
    RunLog,
    StepRecord,
    StopReason,
    ToolCall,
    Usage,
)

WINDOW = 1200
GOAL = 30


def _results(log: RunLog) -> list[ModelResult]:
    return [r for r in log.records if isinstance(r, ModelResult)]


def _step_results(log: RunLog) -> list[ModelResult]:
    return [r for r in _results(log) if r.summary_through is None and r.reply is not None]


def _summaries(log: RunLog) -> list[ModelResult]:
    return [r for r in _results(log) if r.summary_through is not None and r.reply is not None]


async def test_without_a_window_the_long_run_is_refused_by_the_provider():
    model = WindowedModel(window=WINDOW, goal=GOAL)
    result = await run(windowed_agent(model, window=None), "count", store=MemoryStore())
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.error == "context_length_exceeded"
    assert model.refused == 1


async def test_with_a_window_every_request_fits_and_the_run_finishes(tmp_path):
    model = WindowedModel(window=WINDOW, goal=GOAL)
    agent = windowed_agent(model, window=WINDOW)
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        result = await run(agent, "count", store=store, run_id="long")
        log = await store.read_log("long")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == f"done at n={GOAL}"
    assert model.refused == 0
    # every request (summaries included) fitted the provider's own count of the window
    assert max(model.sizes) + agent.max_output_tokens <= WINDOW  # type: ignore[operator]
    assert check_invariants(log) == []
    for record in _step_results(log):
        context = record.context
        assert context is not None
        assert context.budget == WINDOW - 64 - agent.margin_tokens
        assert context.estimated_input_tokens <= context.budget
    assert _summaries(log), "a run this long must have compacted"
    # the original records stay in the log: every step's record, in order
    assert [s.step for s in log.steps] == list(range(1, GOAL + 2))


async def test_the_summary_is_a_counted_model_attempt_not_a_step():
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    result = await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="r")
    log = await store.read_log("r")
    intents = [r for r in log.records if isinstance(r, ModelIntent)]
    compactions = [i for i in intents if i.compaction]
    assert len(compactions) == model.summaries == len(_summaries(log))
    assert result.totals.model_attempts == len(intents)
    assert result.totals.steps == GOAL + 1
    tokens = sum((r.usage.input_tokens or 0) for r in _results(log))
    assert result.totals.input_tokens == tokens
    summary_tokens = sum((r.usage.input_tokens or 0) for r in _summaries(log))
    assert summary_tokens > 0
    # intent before effect: each summary's intent is durable before its result, in its step
    seqs = {id(r): n for n, r in enumerate(log.records)}
    for summary in _summaries(log):
        intent = next(i for i in compactions if i.intent_id == summary.intent_id)
        assert seqs[id(intent)] < seqs[id(summary)]
        assert intent.step == summary.step
        # made inside the step that needs it: that step's request uses it
        user = next(r for r in _step_results(log) if r.step == summary.step)
        assert user.context is not None
        assert user.context.summary_intent_id == summary.intent_id
        assert user.context.summary_through == summary.summary_through


async def test_a_request_keeps_its_order_and_never_splits_a_call_from_its_result():
    seen: list[ModelRequest] = []
    model = WindowedModel(window=WINDOW, goal=GOAL)

    class Spy:
        async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
            seen.append(request)
            return await model.complete(request, on_delta=on_delta, attempt=attempt)

    await run(windowed_agent(Spy(), window=WINDOW), "count to thirty", store=MemoryStore())
    steps = [r for r in seen if r.messages[0].content != DEFAULT_SUMMARY_PROMPT]
    assert check_tool_replies(steps) == []
    for request in steps:
        roles = [m.role for m in request.messages]
        assert roles[:2] == ["system", "user"]  # the instructions, then the input
        assert request.messages[1].content == "count to thirty"
        summaries = [m for m in request.messages if (m.content or "").startswith("[Summary")]
        if summaries:  # the summary comes right after the input, before the verbatim steps
            assert request.messages[2] is summaries[0]
        calls = {c.id for m in request.messages for c in m.tool_calls}
        answered = {m.tool_call_id for m in request.messages if m.role == "tool"}
        assert calls == answered
    # the newest fact is always sent verbatim (the model counts on from it)
    last = steps[-1]
    assert f"n={GOAL} " in (last.messages[-1].content or "")


async def test_old_large_observations_become_markers_naming_their_call():
    model = WindowedModel(window=WINDOW, goal=12)
    store = MemoryStore()
    seen: list[ModelRequest] = []

    class Spy:
        async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
            seen.append(request)
            return await model.complete(request, on_delta=on_delta, attempt=attempt)

    await run(windowed_agent(Spy(), window=WINDOW), "count", store=store, run_id="m")
    log = await store.read_log("m")
    marked = [r for r in _step_results(log) if r.context and r.context.marked]
    assert marked, "markers come before any summary"
    first = marked[0]
    assert first.context is not None and first.context.summary_intent_id is None
    request = next(r for r in seen if "[elided:" in "".join(m.content or "" for m in r.messages))
    marker = next(m for m in request.messages if (m.content or "").startswith("[elided:"))
    assert marker.tool_call_id is not None
    assert f"call {marker.tool_call_id}" in (marker.content or "")
    assert "call the tool again" in (marker.content or "")


async def test_a_summariser_client_writes_the_summaries():
    model = WindowedModel(window=WINDOW, goal=GOAL)
    summariser = WindowedModel(window=WINDOW, goal=GOAL)
    agent = windowed_agent(model, window=WINDOW, summariser=summariser)
    await run(agent, "count", store=MemoryStore())
    assert summariser.summaries > 0
    assert model.summaries == 0


async def test_reported_usage_calibrates_the_estimate():
    model = WindowedModel(window=WINDOW, goal=8)
    store = MemoryStore()
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="c")
    log = await store.read_log("c")
    results = _step_results(log)
    # the first request is estimated by the uncalibrated counter (which errs on the large
    # side); once a report came back, the prefix's reported size is exact and only the new
    # part is estimated
    first = results[0]
    assert first.context is not None and first.usage.input_tokens is not None
    assert first.context.estimated_input_tokens >= first.usage.input_tokens
    for record in results[2:]:
        assert record.context is not None and record.usage.input_tokens is not None
        error = abs(record.context.estimated_input_tokens - record.usage.input_tokens)
        assert error <= 0.05 * record.usage.input_tokens, record


async def test_a_token_counter_is_used_when_given():
    counted: list[int] = []

    def counter(messages):
        counted.append(provider_tokens(ModelRequest(messages=tuple(messages))))
        return counted[-1]

    seen: list[ModelRequest] = []
    model = WindowedModel(window=WINDOW, goal=6)

    class Spy:
        async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
            seen.append(request)
            return await model.complete(request, on_delta=on_delta, attempt=attempt)

    store = MemoryStore()
    agent = windowed_agent(Spy(), window=WINDOW, token_counter=counter)
    await run(agent, "count", store=store, run_id="t")
    log = await store.read_log("t")
    assert counted
    first = _step_results(log)[0]
    assert first.context is not None
    mine = provider_tokens(ModelRequest(messages=seen[0].messages))
    assert first.context.counted_tokens == mine + estimate_tools(seen[0].tools)


async def test_a_context_length_refusal_compacts_once_and_retries_the_step():
    # The agent believes its window is twice the provider's: the provider refuses, and the
    # step compacts and retries instead of failing the run.
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    agent = windowed_agent(model, window=2 * WINDOW)
    result = await run(agent, "count", store=store, run_id="x")
    log = await store.read_log("x")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert model.refused > 0
    forced = [r for r in _step_results(log) if r.context and r.context.forced]
    assert forced
    for record in forced:
        refused = [
            r
            for r in _results(log)
            if r.step == record.step and r.error and r.error.kind == "context_length_exceeded"
        ]
        assert len(refused) == 1  # once per step, then the retry
    assert result.totals.model_attempts == sum(1 for r in log.records if isinstance(r, ModelIntent))
    assert check_invariants(log) == []


async def test_a_second_refusal_in_the_same_step_fails_the_run():
    # A provider whose window is smaller than even the forced compaction can reach.
    model = WindowedModel(window=300, goal=GOAL)
    agent = windowed_agent(model, window=5000, payload_chars=2000, max_output_tokens=64)
    store = MemoryStore()
    result = await run(agent, "count", store=store, run_id="y")
    log = await store.read_log("y")
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.error == "context_length_exceeded"
    last_step = log.steps[-1].step
    refused = [
        r
        for r in _results(log)
        if r.step == last_step and r.error and r.error.kind == "context_length_exceeded"
    ]
    assert len(refused) == 2
    assert check_invariants(log) == []


def test_a_window_with_no_room_for_input_is_refused():
    model = WindowedModel(window=WINDOW, goal=1)
    with pytest.raises(UsageError, match="no room for input"):
        windowed_agent(model, window=100, max_output_tokens=64)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"context_window": -10}, "context_window"),
        ({"context_window": 1000.5}, "context_window"),
        ({"context_window": True}, "context_window"),
        ({"context_window": 1000, "context_margin": -5000}, "context_margin"),
        ({"context_window": 1000, "max_output_tokens": -4000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_token_settings_that_are_not_whole_numbers_in_range_are_refused(settings, named):
    # A negative margin or output cap made the input budget larger than the window, and a
    # negative output cap was sent to the provider.
    from treadle import Agent, NativeToolCallParser, Toolbox

    model = WindowedModel(window=WINDOW, goal=1)
    with pytest.raises(UsageError, match=rf"^Agent\.{named} must be None or a whole number"):
        Agent(model=model, executor=Toolbox([]), parser=NativeToolCallParser(), **settings)


def test_the_window_is_in_the_snapshot_only_when_set():
    model = WindowedModel(window=WINDOW, goal=1)
    assert "context" not in windowed_agent(model, window=None).snapshot()
    snapshot = windowed_agent(model, window=WINDOW).snapshot()
    assert snapshot["context"]["window"] == WINDOW  # type: ignore[index]


async def test_log_bytes_per_step_stay_flat_in_run_length():
    model = WindowedModel(window=WINDOW, goal=60)
    store = MemoryStore()
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="flat")
    log = await store.read_log("flat")
    per_step: dict[int, int] = {}
    for record in log.records:
        step = getattr(record, "step", None)
        summary = isinstance(record, ModelResult | ModelIntent) and (
            getattr(record, "summary_through", None) is not None
            or getattr(record, "compaction", False)
        )
        if step is None or summary:
            continue
        per_step[step] = per_step.get(step, 0) + len(record_to_json(record).encode())
    early = [per_step[s] for s in range(3, 13)]
    late = [per_step[s] for s in range(50, 60)]
    assert max(late) <= max(early) * 1.05, (early, late)
    # a summary's record is bounded by its output cap, not by the steps it covers
    sizes = [len(record_to_json(r).encode()) for r in _summaries(log)]
    assert max(sizes) <= 2 * min(sizes)
    context = _step_results(log)[-1].context
    assert context is not None and len(json.dumps(record_to_json(_step_results(log)[-1]))) < 2000


async def test_check_context_catches_a_recomputed_summary():
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="d")
    log = await store.read_log("d")
    assert check_context(log) == []
    summary = _summaries(log)[0]
    index = log.records.index(summary)
    doubled = RunLog(
        run_id=log.run_id,
        records=(*log.records[: index + 1], summary, *log.records[index + 1 :]),
    )
    assert any("recomputed" in p for p in check_context(doubled))


async def test_steps_hold_the_original_observations_after_compaction():
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="o")
    log = await store.read_log("o")
    first: StepRecord = log.steps[0]
    assert first.observations and first.observations[0].startswith("n=1 data")
    assert len(first.observations[0]) > 300


async def test_resume_of_a_finished_compacting_run_calls_no_model():
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="f")
    again = WindowedModel(window=WINDOW, goal=GOAL)
    with trio.fail_after(30):
        result = await run(windowed_agent(again, window=WINDOW), store=store, run_id="f")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert again.sizes == []


async def test_the_summariser_reads_every_step_it_covers_whole():
    # The model's summary cites the newest fact it was shown: a summary of steps 1-T that
    # saw markers or a cut transcript would cite an older one.
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="w")
    log = await store.read_log("w")
    summaries = _summaries(log)
    assert len(summaries) >= 2
    for summary in summaries:
        assert summary.reply is not None
        through = summary.summary_through
        assert f"Facts: n={through} (step {through})." in (summary.reply.text or "")


async def test_show_displays_the_context_of_each_model_call(tmp_path):
    from click.testing import CliRunner

    from treadle.cli import main

    model = WindowedModel(window=WINDOW, goal=GOAL)
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="shown")
        log = await store.read_log("shown")
    summary = _summaries(log)[0]
    user = next(r for r in _step_results(log) if r.step == summary.step)
    assert user.context is not None
    shown = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(
            main, ["show", "shown", "--store", str(tmp_path / "runs.db")], env={"COLUMNS": "400"}
        )
    )
    assert shown.exit_code == 0, shown.output
    assert "summary call started" in shown.output
    assert "summary written" in shown.output
    assert f"steps 1-{summary.summary_through}: Goal: count to {GOAL}." in shown.output
    expected = (
        f"context {user.context.estimated_input_tokens} est / {user.usage.input_tokens} "
        f"reported of {user.context.budget} tokens, steps {user.context.verbatim_from}- "
        f"verbatim, summary of 1-{summary.summary_through} ({summary.intent_id})"
    )
    assert expected in shown.output


async def test_a_threads_inherited_history_is_compacted_like_the_runs_own_steps():
    # The first run of the thread is long (no window: it fits the provider's larger window);
    # the second declares a small window: the inherited history does not fit, is summarised
    # (a summary of step 0, the thread's earlier runs) and the second run finishes.
    big = WindowedModel(window=10 * WINDOW, goal=20)
    store = MemoryStore()
    first = await run(windowed_agent(big, window=None), "count", store=store, run_id="chat")
    assert first.stop_reason is StopReason.FINAL_ANSWER
    seen: list[ModelRequest] = []
    model = WindowedModel(window=WINDOW, goal=24)

    class Spy:
        async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
            seen.append(request)
            return await model.complete(request, on_delta=on_delta, attempt=attempt)

    second = await run(
        windowed_agent(Spy(), window=WINDOW), "count on", store=store, thread_id="chat"
    )
    assert second.stop_reason is StopReason.FINAL_ANSWER
    assert second.final_answer == "done at n=24"
    log = await store.read_log(second.run_id)
    assert check_invariants(log) == []
    assert max(model.sizes) + 64 <= WINDOW
    summaries = _summaries(log)
    # the inherited history is summarised oldest first, as far as needed (steps up to 0)
    assert summaries and summaries[0].summary_through is not None
    assert summaries[0].summary_through <= 0
    # `treadle show` said "steps 1--4" and "summary of 1--4" for inherited turns up to -4
    from treadle._cli_common import context_detail, describe

    through = summaries[0].summary_through
    assert describe(summaries[0])[1].startswith(f"turns up to {through}: ")
    user = next(r for r in _step_results(log) if r.context and r.context.summary_intent_id)
    assert user.context is not None and user.context.summary_through is not None
    assert user.context.summary_through <= 0 and user.context.verbatim_from is not None
    shown = context_detail(user)
    assert f"summary of turns up to {user.context.summary_through} (" in shown
    assert f"turns {user.context.verbatim_from} on verbatim" in shown
    first_request = next(r for r in seen if r.messages[0].content != DEFAULT_SUMMARY_PROMPT)
    texts = [m.content or "" for m in first_request.messages]
    # in history order: the instructions, the summary of the earlier runs' first part, what
    # is left of them (their newest turn verbatim), then this run's input
    assert texts[1].startswith("[Summary of the first part of the history this run continues")
    assert texts[-1] == "count on"
    assert texts[-2] == "done at n=20"
    assert check_tool_replies([first_request]) == []


@pytest.mark.parametrize(
    ("error", "reply", "said"),
    [
        (ModelErrorInfo(kind="time_budget"), None, "steps 1-4: error time_budget"),
        (
            ModelErrorInfo(kind="context_length_exceeded", message="too long"),
            None,
            "steps 1-4: error context_length_exceeded too long",
        ),
        (None, ModelReply(text="  "), "steps 1-4: no summary text"),  # an older log's
    ],
)
def test_show_says_a_summary_attempt_failed_and_what_it_was_given(error, reply, said):
    # Every summary call's result was shown as "summary written", an error included.
    from treadle._cli_common import describe

    unfit = ContextUsed(window=1000, budget=900, estimated_input_tokens=1200, unfit=True)
    record = ModelResult(
        run_id="r",
        step=21,
        intent_id="r/s21/m1",
        ts="2026-12-01T00:00:00+00:00",
        error=error,
        reply=reply,
        context=unfit,
        summary_through=4,
    )
    what, detail = describe(record)
    assert what == "summary failed"
    assert detail.startswith(said)
    assert detail.endswith("over budget: what cannot be cut does not fit")
    written = attrs.evolve(record, error=None, reply=ModelReply(text="Facts: n=4."))
    assert describe(written) == (
        "summary written",
        "steps 1-4: Facts: n=4. · context 1200 est of 900 tokens, over budget: what cannot be "
        "cut does not fit",
    )


@pytest.mark.parametrize(
    ("first", "last", "said"),
    [
        (8, 20, "13 observations of steps 8-20 elided"),
        (-12, -1, "13 observations of turns -12 to -1 elided"),
        (-12, 3, "13 observations of turns -12 to 0 and steps 1-3 elided"),
    ],
    ids=["steps", "inherited turns", "turns and steps"],
)
def test_show_names_the_turns_whose_observations_were_elided(first, last, said):
    # A thread's inherited turns were shown as "observations of steps -12--1": steps, and a
    # range of negative numbers joined by a dash.
    from treadle._cli_common import context_detail

    context = ContextUsed(
        window=1200,
        budget=1072,
        estimated_input_tokens=1030,
        verbatim_from=first,
        marked=13,
        marked_from=first,
        marked_to=last,
    )
    record = ModelResult(
        run_id="t.2",
        step=1,
        intent_id="t.2/s1/m2",
        ts="2026-12-01T00:00:00+00:00",
        reply=ModelReply(text="ok"),
        context=context,
    )
    assert context_detail(record).endswith(f", {said}")


async def test_a_thread_starts_from_the_summary_its_earlier_run_wrote():
    """Each run of a thread summarised the whole inherited history again, in chunks, from
    its first turn: one new message of a 54-run thread took 29 summary calls, and the thread
    then failed every message on max_model_attempts. A run that needs the inherited history
    compacted starts from the newest summary of the thread's earlier runs."""
    model = WindowedModel(window=WINDOW, goal=0)
    store = MemoryStore()
    agent = windowed_agent(model, window=WINDOW)
    per_run: list[int] = []
    carried_from: list[set[str | None]] = []
    for number in range(1, 13):
        model.goal = 3 * number  # each message of the thread counts three steps further
        before = model.summaries
        thread = {"thread_id": "chat"} if number > 1 else {"run_id": "chat"}
        result = await run(agent, "count on", store=store, **thread)
        assert result.final_answer == f"done at n={3 * number}", result
        log = await store.read_log(result.run_id)
        assert check_invariants(log) == []
        per_run.append(model.summaries - before)
        carried_from.append({r.context.summary_run_id for r in _results(log) if r.context})
    assert model.refused == 0
    # once the thread outgrew the window (run 6), each later run summarised what was new
    # (its own three steps), not all of it again: 2 each, where it was 5, 7, 9, ... 15
    assert per_run[:5] == [0] * 5 and per_run[5] > 0, per_run
    assert max(per_run[6:]) <= 2, per_run
    # each of them started from the summary the run before it wrote (run 6 is "chat.6")
    for number in range(7, 13):
        assert f"chat.{number - 1}" in carried_from[number - 1], carried_from


@pytest.mark.parametrize("counted", [float("nan"), None, "12", -5, True])
async def test_a_token_counter_returning_no_count_is_a_seam_violation(counted):
    """A counter returning NaN interrupted the run with "cannot convert float NaN to
    integer"; None or text, with another bare Python error."""
    from treadle._exceptions import RunInterrupted, SeamViolation

    model = WindowedModel(window=WINDOW, goal=3)
    agent = windowed_agent(model, window=WINDOW, token_counter=lambda messages: counted)
    store = MemoryStore()
    with pytest.raises(RunInterrupted) as info:
        await run(agent, "count", store=store, run_id="r")
    cause = info.value.__cause__
    while isinstance(cause, ExceptionGroup):
        cause = cause.exceptions[0]
    assert isinstance(cause, SeamViolation) and "token counter returned" in str(cause)
    assert (await store.read_log("r")).finished is None  # left resumable


class _LongSummaries(WindowedModel):
    """Writes summaries of some 1,000 tokens, as a summariser filling a large cap does."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        reply = await super().complete(request, on_delta=on_delta, attempt=attempt)
        first = request.messages[0] if request.messages else None
        if first is not None and first.content == DEFAULT_SUMMARY_PROMPT:
            return attrs.evolve(reply, text=reply.text + " detail" * 700)
        return reply


async def test_a_thread_goes_on_under_a_window_too_small_for_the_summary_it_inherits():
    """A summary written under a large window was carried into a run whose window had no
    room for it: every request was over the window, and the thread could not go on."""
    store = MemoryStore()
    big = _LongSummaries(window=3 * WINDOW, goal=120)
    first = await run(
        windowed_agent(big, window=3 * WINDOW, payload_chars=100), "count", store=store, run_id="t"
    )
    assert first.stop_reason is StopReason.FINAL_ANSWER and big.summaries > 0
    small = WindowedModel(window=WINDOW, goal=123)
    second = await run(windowed_agent(small, window=WINDOW), "on", store=store, thread_id="t")
    assert second.stop_reason is StopReason.FINAL_ANSWER, second.error
    assert small.refused == 0
    log = await store.read_log(second.run_id)
    assert check_invariants(log) == []
    assert all(r.context.summary_run_id is None for r in _results(log) if r.context)


async def test_a_forks_markers_of_the_forked_runs_steps_name_no_thread():
    """A fork's markers of the steps it inherits said "in an earlier run of the thread": a
    fork belongs to no thread, and those steps are the forked run's."""
    store = MemoryStore()
    await run(
        windowed_agent(WindowedModel(window=1400, goal=12), window=1400),
        "count to 12",
        store=store,
        run_id="r",
    )
    fork_model = WindowedModel(window=1400, goal=12)
    await run(
        windowed_agent(fork_model, window=1400), store=store, run_id="f", fork_of="r", at_step=10
    )
    sent = fork_model.requests[0].messages
    markers = [m.content or "" for m in sent if (m.content or "").startswith("[elided:")]
    assert markers, "the fork's first request marks the forked run's oldest results"
    for marker in markers:
        assert " in the history this run continues, about " in marker, marker
        assert "thread" not in marker
    assert all("thread" not in (m.content or "") for r in fork_model.requests for m in r.messages)


async def test_a_fork_starts_from_a_summary_written_before_the_fork_point():
    """A fork of an unfinished run could start from a summary the run wrote after the fork
    was made (in the step forked or later): a resumed fork then picked another one."""
    store = MemoryStore()
    model = WindowedModel(window=WINDOW, goal=GOAL)
    await run(windowed_agent(model, window=WINDOW), "count", store=store, run_id="r")
    written = {r.intent_id: r.step for r in _summaries(await store.read_log("r"))}
    at = sorted(written.values())[1]  # a step that wrote a summary
    fork = await run(
        windowed_agent(WindowedModel(window=WINDOW, goal=GOAL), window=WINDOW),
        None,
        store=store,
        run_id="f",
        fork_of="r",
        at_step=at,
    )
    assert fork.stop_reason is StopReason.FINAL_ANSWER
    carried = {
        r.context.summary_intent_id
        for r in _results(await store.read_log("f"))
        if r.context is not None and r.context.summary_run_id == "r"
    }
    assert carried, "the fork's history does not fit: it starts from r's summary"
    assert all(written[intent] < at for intent in carried), (carried, at)


@attrs.define(eq=False)
class _FailsEachCallOnce:
    """A summariser whose every call fails once (503, retryable) and succeeds on its retry."""

    inner: WindowedModel
    calls: int = 0

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        self.calls += 1
        if self.calls % 2 == 1:
            info = ModelErrorInfo(kind="server_error", retryable=True, status=503)
            raise ModelCallError(info, usage=Usage())
        return await self.inner.complete(request, on_delta=on_delta, attempt=attempt)


async def test_each_summary_of_a_forced_compaction_has_its_own_retries():
    # Limits.max_model_retries counts the retries of one model call: a forced compaction's
    # summaries are each a call, so one failure each does not add up to end the step.
    provider = WindowedModel(window=900, goal=GOAL)
    agent = windowed_agent(provider, window=1200, summariser=_FailsEachCallOnce(provider))
    agent = attrs.evolve(agent, limits=attrs.evolve(agent.limits, max_model_retries=1))
    store = MemoryStore()
    result = await run(agent, "count", store=store, run_id="r")
    log = await store.read_log("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER, result.error
    summaries = [r for r in _results(log) if r.summary_through is not None]
    failed = [r for r in summaries if r.error is not None]
    assert failed and all(r.error.kind == "server_error" for r in failed)
    forced_steps = {r.step for r in _results(log) if r.context and r.context.forced}
    assert any(sum(r.step == s for r in failed) > 1 for s in forced_steps)
    assert check_invariants(log) == []


@attrs.define(eq=False)
class _AnswersNothingFirst:
    """A summariser whose every call first answers without text (``reply``), then really."""

    inner: WindowedModel
    reply: ModelReply
    calls: int = 0

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        self.calls += 1
        if self.calls % 2 == 1:
            return self.reply
        return await self.inner.complete(request, on_delta=on_delta, attempt=attempt)


@pytest.mark.parametrize(
    "empty",
    [
        ModelReply(text="", usage=Usage(input_tokens=50, output_tokens=1)),
        ModelReply(text=None, tool_calls=(ToolCall(id="c1", name="fetch", arguments={}),)),
    ],
    ids=["empty text", "tool calls only"],
)
async def test_a_summariser_reply_without_text_is_a_failed_attempt(empty):
    # The summary is the reply's text (docs/context.md, "Summaries"): a reply without any
    # never replaces the steps it was to cover; it is retried like a failed attempt.
    model = WindowedModel(window=WINDOW, goal=GOAL)
    summariser = _AnswersNothingFirst(WindowedModel(window=WINDOW, goal=GOAL), empty)
    store = MemoryStore()
    result = await run(
        windowed_agent(model, window=WINDOW, summariser=summariser),
        "count",
        store=store,
        run_id="e",
    )
    log = await store.read_log("e")
    assert result.stop_reason is StopReason.FINAL_ANSWER, result.error
    summaries = [r for r in _results(log) if r.summary_through is not None]
    failed = [r for r in summaries if r.reply is None]
    assert failed and all(r.error and r.error.kind == "empty_summary" for r in failed)
    written = [r for r in summaries if r.reply is not None]
    assert written and all((r.reply.text or "").strip() for r in written)
    assert check_invariants(log) == []


@attrs.define(eq=False)
class _OverlongOnce:
    """A summariser that ignores its output cap once: its first summary is ~1,500 tokens."""

    inner: WindowedModel
    calls: int = 0

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        self.calls += 1
        reply = await self.inner.complete(request, on_delta=on_delta, attempt=attempt)
        if self.calls == 1:
            reply = attrs.evolve(reply, text=(reply.text or "") + " detail." * 750)
        return reply


async def test_an_overlong_summary_is_cut_in_the_next_summariser_request():
    # The summariser's own request must fit the window (docs/context.md, "Limits"): an
    # earlier summary longer than its cap is cut there as in the step's request.
    summariser = WindowedModel(window=WINDOW, goal=GOAL)
    model = WindowedModel(window=WINDOW, goal=GOAL)
    store = MemoryStore()
    agent = windowed_agent(model, window=WINDOW, summariser=_OverlongOnce(summariser))
    result = await run(agent, "count", store=store, run_id="o")
    log = await store.read_log("o")
    assert result.stop_reason is StopReason.FINAL_ANSWER, result.error
    summaries = [r for r in _results(log) if r.summary_through is not None]
    assert len(summaries) >= 2 and len(summaries[0].reply.text) > 5000
    assert not any(r.context.unfit for r in summaries)
    assert all(size + agent.max_output_tokens <= WINDOW for size in summariser.sizes)


async def test_a_newest_step_is_cut_to_fit_by_the_token_counter_in_use():
    # A counter that puts a character in a token (the provider's count too): the newest
    # observation was cut to the characters the default estimate gives its room (3 a
    # token), the request went out 3 times over the budget marked `unfit`, was refused, and
    # the forced compaction built the same request: the run failed.
    provider = DenseProvider(window=4000, goal=3)
    agent = windowed_agent(provider, window=4000, payload_chars=12_000, token_counter=dense_tokens)
    store = MemoryStore()
    result = await run(agent, "count", store=store, run_id="dense")
    log = await store.read_log("dense")
    assert result.stop_reason is StopReason.FINAL_ANSWER, result.error
    assert result.final_answer == "done at n=3"
    assert all(size + 64 <= 4000 for size in provider.sizes)
    contexts = [r.context for r in _results(log) if r.context is not None]
    assert any(c.truncated for c in contexts)
    assert not any(c.unfit or c.forced for c in contexts)
    assert check_invariants(log) == []


async def test_a_summariser_request_fits_by_the_token_counter_in_use():
    # The steps a summariser request holds were chosen, and a step too large cut, by the
    # characters the default estimate gives the room: with a counter that puts a character
    # in a token, a thread's long inherited history made a summariser request 3 times too
    # large, refused twice, and the run failed.
    store = MemoryStore()
    first = WindowedModel(window=10**6, goal=20)
    await run(windowed_agent(first, window=None), "count", store=store, run_id="chat")
    provider = DenseProvider(window=4000, goal=24)
    agent = windowed_agent(provider, window=4000, token_counter=dense_tokens)
    second = await run(agent, "count on", store=store, thread_id="chat")
    log = await store.read_log(second.run_id)
    assert second.stop_reason is StopReason.FINAL_ANSWER, second.error
    assert second.final_answer == "done at n=24"
    assert provider.summaries >= 1
    assert all(size + 64 <= 4000 for size in provider.sizes)
    summaries = [r for r in _results(log) if r.summary_through is not None]
    assert summaries and not any(r.context.unfit or r.error for r in summaries)
    assert check_invariants(log) == []


@attrs.define(eq=False)
class _SummariesOfItsCap:
    """A summariser whose every summary is ``share`` times as long as its output cap allows.

    Summaries are text of some 4 characters a token (the provider's count), cited facts
    first; 1.0 fills the cap, more ignores it.
    """

    inner: WindowedModel
    share: float

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        reply = await self.inner.complete(request, on_delta=on_delta, attempt=attempt)
        chars = int((request.max_output_tokens or 0) * 4 * self.share)
        text = reply.text or ""
        return attrs.evolve(reply, text=(text + " detail" * chars)[:chars])


@pytest.mark.parametrize("share", [1.0, 3.0], ids=["fills its cap", "ignores its cap"])
async def test_a_summary_as_long_as_its_room_is_not_written_again_at_every_step(share):
    # A compaction kept every step that fitted beside a summary as long as its room, and the
    # budget measured an overlong one whole: the next step never fitted, and every step from
    # the first compaction on wrote a summary (one model call more a step).
    model = WindowedModel(window=4000, goal=110)
    summariser = _SummariesOfItsCap(WindowedModel(window=4000, goal=110), share)
    agent = windowed_agent(model, window=4000, payload_chars=2000, summariser=summariser)
    store = MemoryStore()
    result = await run(agent, "count", store=store, run_id="long")
    log = await store.read_log("long")
    assert result.stop_reason is StopReason.FINAL_ANSWER, result.error
    steps = sorted({r.step for r in _summaries(log)})
    assert len(steps) >= 5
    from_first = result.totals.steps - steps[0] + 1
    assert len(steps) * 2 <= from_first, steps  # at most every other step, not every one
    assert all(len(r.reply.text or "") >= 3000 for r in _summaries(log))
    assert check_invariants(log) == []
