"""`ScriptedModel` numbers its turns from 1 in every message, as it names its calls."""

from __future__ import annotations

import treadle
from treadle.testing import ScriptedModel, call
from treadle.types import StopReason


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
