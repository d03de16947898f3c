"""Whole runs through AnthropicMessagesClient and a loopback server: tool use, budgets, cap."""

from __future__ import annotations

import trio
from test_anthropic_events import (
    MESSAGE_STOP,
    SSE,
    block_start,
    message_delta,
    message_start,
    text_delta,
    text_reply,
    tool_reply,
)

import treadle
from treadle.models import AnthropicMessagesClient
from treadle.stores.memory import MemoryStore
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import ActionResult, Budgets, ModelResult, StopReason

KEY = "sk-ant-api03-secret-123456"
CALLS: list[str] = []


@treadle.tool
async def get_weather(location: str) -> str:
    """The weather at a place."""
    CALLS.append(location)
    return "18 C, fog"


def agent_for(client, **kwargs) -> treadle.Agent:
    return treadle.Agent(
        model=client,
        executor=treadle.Toolbox([get_weather]),
        parser=treadle.NativeToolCallParser(),
        model_name="claude-x",
        system_prompt="Be brief.",
        **kwargs,
    )


async def run_against(*responses, **agent_kwargs):
    store = MemoryStore()
    async with open_loopback_server(canned(*responses)) as server:
        client = AnthropicMessagesClient(base_url=server.base_url, api_key=KEY)
        try:
            with trio.fail_after(10):
                result = await treadle.run(
                    agent_for(client, **agent_kwargs), "Weather in SF?", store=store, run_id="r"
                )
        finally:
            await client.aclose()
    return result, await store.read_log("r"), server


async def test_tool_use_turn_then_answer():
    CALLS.clear()
    result, log, server = await run_against(
        CannedResponse(headers=SSE, chunks=tool_reply()),
        CannedResponse(headers=SSE, chunks=text_reply("Foggy, 18 C.")),
        max_output_tokens=512,
        params={"max_tokens": 100_000, "thinking": {"type": "enabled", "budget_tokens": 256}},
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "Foggy, 18 C."
    assert CALLS == ["San Francisco, CA"]
    assert (result.totals.input_tokens, result.totals.output_tokens) == (472 + 25, 89 + 15)
    first, second = (r.json() for r in server.requests)
    assert first["system"] == "Be brief."
    assert first["max_tokens"] == second["max_tokens"] == 512
    assert first["thinking"] == {"type": "enabled", "budget_tokens": 256}
    assistant, results = second["messages"][1], second["messages"][2]
    assert assistant["role"] == "assistant"
    assert assistant["content"][-1]["type"] == "tool_use"
    assert results["role"] == "user"
    assert results["content"][0]["type"] == "tool_result"
    assert results["content"][0]["tool_use_id"] == "toolu_01T1x"
    assert any(isinstance(r, ActionResult) for r in log.records)


async def test_prompt_usage_in_message_start_crossing_the_budget_cuts_the_stream():
    chunks = [
        message_start(5000, 1),
        block_start(0, {"type": "text", "text": ""}),
        text_delta(0, "never read"),
        30.0,  # would hold the stream open; the cut must come first
        message_delta("end_turn"),
        MESSAGE_STOP,
    ]
    result, log, server = await run_against(
        CannedResponse(headers=SSE, chunks=chunks), budgets=Budgets(token_budget=1000)
    )
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert server.early_disconnects == 1
    [cut] = [r for r in log.records if isinstance(r, ModelResult)]
    assert cut.error is not None and cut.error.kind == "token_budget"
    assert (cut.usage.input_tokens, cut.usage.output_tokens) == (5000, 1)


async def test_overloaded_529_is_retried():
    overloaded = CannedResponse(
        status=529,
        headers={"content-type": "application/json", "retry-after": "0"},
        chunks=[
            b'{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}'
        ],
    )
    result, log, _ = await run_against(
        overloaded, CannedResponse(headers=SSE, chunks=text_reply("fine"))
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.totals.model_attempts == 2
    first = next(r for r in log.records if isinstance(r, ModelResult))
    assert first.error is not None
    assert (first.error.kind, first.error.status) == ("server_error", 529)


async def test_invalid_request_is_not_retried():
    bad = CannedResponse(
        status=400,
        headers={"content-type": "application/json"},
        chunks=[b'{"type": "error", "error": {"type": "invalid_request_error", '
                b'"message": "prompt is too long: 300000 tokens > 200000 maximum"}}'],
    )  # fmt: skip
    result, _, server = await run_against(bad)
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.error == "context_length_exceeded"
    assert len(server.requests) == 1
