"""`ScriptedModel` numbers its turns from 1 in every message, as it names its calls.

Its replies report a known usage unless scripted otherwise, so a token budget counts them.
"""

from __future__ import annotations

from typing import Any

import treadle
from treadle.testing import ScriptedModel, call, calls, say
from treadle.testing.scripted import SCRIPTED_USAGE
from treadle.types import Budgets, RunResult, RunState, StopReason, ToolCall, Usage


@treadle.tool
async def ping() -> str:
    """Answer pong."""
    return "pong"


async def test_a_script_that_ran_out_names_the_turn_as_its_call_ids_do() -> None:
    """The first turn's call is ``call_1_1``; the turn after the last is turn 2, not turn 1."""
    model = ScriptedModel(turns=[call("ping")])  # no final answer scripted
    agent = treadle.Agent(
        model=model, executor=treadle.Toolbox([ping]), parser=treadle.NativeToolCallParser()
    )
    store = treadle.MemoryStore()
    result = await treadle.run(agent, "ping once", store=store, run_id="r")
    log = await store.read_log("r")
    history = log.steps[0].history_message
    assert history is not None
    assert [c.id for c in history.tool_calls] == ["call_1_1"]
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.model_error is not None
    assert result.model_error.message == "script has no turn 2 (it has 1 turn, numbered from 1)"


async def test_a_script_runs_to_its_end_under_a_token_budget() -> None:
    """Scripted replies reported no usage, so a token budget ended the run at the first one.

    Each reply of `say`, `call` and `calls` now reports 10 input and 5 output tokens; the run
    of three replies spends 45 of its 1,000 tokens and ends with its final answer.
    """
    assert (SCRIPTED_USAGE.input_tokens, SCRIPTED_USAGE.output_tokens) == (10, 5)
    assert SCRIPTED_USAGE.known_total == 15
    pings = [ToolCall(id=f"b{index}", name="ping", arguments={}) for index in (1, 2)]
    twice = calls(*pings)
    model = ScriptedModel(turns=[call("ping"), twice, say("pong twice")])
    result = await _ping_run(model, budgets=Budgets(token_budget=1000))
    assert (result.state, result.stop_reason) == (RunState.SUCCEEDED, StopReason.FINAL_ANSWER)
    assert result.final_answer == "pong twice" and result.totals.steps == 3
    assert (result.totals.input_tokens, result.totals.output_tokens) == (30, 15)
    assert result.totals.unknown_usage_attempts == 0


async def test_a_reply_scripted_with_unknown_usage_still_ends_a_token_budgeted_run() -> None:
    """``usage=Usage()`` scripts a reply whose usage was never reported (decision 0114)."""
    model = ScriptedModel(turns=[say("pong", usage=Usage())])
    result = await _ping_run(model, budgets=Budgets(token_budget=1000))
    assert (result.state, result.stop_reason) == (RunState.FAILED, StopReason.TOKEN_BUDGET)
    assert result.final_answer is None and result.totals.unknown_usage_attempts == 1


async def test_a_turn_offset_past_the_history_says_so_not_a_negative_turn() -> None:
    """A fresh run (no assistant message) of a script skipping 3 inherited ones."""
    result = await _ping_run(ScriptedModel(turns=[call("ping")], turn_offset=3))
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.model_error is not None
    assert result.model_error.message == (
        "the request's history holds 0 assistant messages, fewer than the turn_offset of 3 "
        "the script skips (the assistant messages of the runs a thread continues): it is of "
        "no turn of the script"
    )


async def _ping_run(model: ScriptedModel, **agent_options: Any) -> RunResult:
    """Run ``model`` on ``ping`` alone in a memory store: the run's result."""
    agent = treadle.Agent(
        model=model,
        executor=treadle.Toolbox([ping]),
        parser=treadle.NativeToolCallParser(),
        **agent_options,
    )
    return await treadle.run(agent, "ping", store=treadle.MemoryStore(), run_id="r")
