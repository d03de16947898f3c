"""Structured output on the wire: whole runs through the real clients and a loopback server.

OpenAI-compatible servers are asked natively (``response_format`` with the JSON schema);
Anthropic gets a declared ``final_answer`` tool whose input schema is the output schema.
"""

from __future__ import annotations

import json

import attrs
import pytest
import trio
from test_anthropic_events import (
    MESSAGE_STOP,
    SSE,
    block_start,
    block_stop,
    json_delta,
    message_delta,
    message_start,
)
from test_openai_client import chunk, sse

import treadle
from treadle._exceptions import UsageError
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.stores.memory import MemoryStore
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import DecisionKind, Message, ModelRequest, OutputFormat, StopReason


@attrs.frozen
class Answer:
    """The capital of a country.

    Attributes:
        country: the country asked about.
        capital: its capital city.
    """

    country: str
    capital: str


def openai_text(text: str) -> CannedResponse:
    chunks = [sse(chunk({"content": text}, "stop")), sse(chunk(usage={"prompt_tokens": 9}))]
    return CannedResponse(
        headers={"content-type": "text/event-stream"}, chunks=[*chunks, sse("[DONE]")]
    )


def anthropic_tool(name: str, arguments: dict, call_id: str) -> CannedResponse:
    return CannedResponse(
        headers=SSE,
        chunks=[
            message_start(40, 1),
            block_start(0, {"type": "tool_use", "id": call_id, "name": name, "input": {}}),
            json_delta(0, json.dumps(arguments)),
            block_stop(0),
            message_delta("tool_use", 20),
            MESSAGE_STOP,
        ],
    )


async def run_against(client_for, *responses, **agent_kwargs):
    store = MemoryStore()
    async with open_loopback_server(canned(*responses)) as server:
        client = client_for(server.base_url)
        try:
            agent = treadle.Agent(
                model=client,
                executor=treadle.Toolbox([]),
                parser=treadle.NativeToolCallParser(),
                model_name="m",
                output_type=Answer,
                **agent_kwargs,
            )
            with trio.fail_after(10):
                result = await treadle.run(agent, "Capital of France?", store=store, run_id="r")
        finally:
            await client.aclose()
    return result, await store.read_log("r"), server


def openai(base_url: str) -> OpenAIChatClient:
    return OpenAIChatClient(base_url=base_url + "/v1", api_key="sk-test")


async def test_openai_is_asked_with_response_format_and_an_invalid_answer_is_fed_back():
    result, log, server = await run_against(
        openai,
        openai_text('{"country": "France"}'),
        openai_text('{"country": "France", "capital": "Paris"}'),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.output == Answer(country="France", capital="Paris")
    first, second = (r.json() for r in server.requests)
    assert first["response_format"] == {
        "type": "json_schema",
        "json_schema": {
            "name": "Answer",
            "schema": {
                "type": "object",
                "properties": {
                    "country": {"description": "the country asked about.", "type": "string"},
                    "capital": {"description": "its capital city.", "type": "string"},
                },
                "required": ["country", "capital"],
                "additionalProperties": False,
            },
            "strict": True,
            "description": "The capital of a country.",
        },
    }
    assert "tools" not in first
    assert second["response_format"] == first["response_format"]
    assert [s.decision for s in log.steps] == [DecisionKind.INVALID, DecisionKind.FINAL_ANSWER]
    feedback = second["messages"][-1]
    assert feedback["role"] == "user"
    assert "required field missing @ $.capital" in feedback["content"]


async def test_openai_with_the_tool_mode_declares_a_final_answer_function():
    def tool_call(arguments: dict) -> CannedResponse:
        call = {"index": 0, "id": "call_1", "type": "function"}
        call["function"] = {"name": "final_answer", "arguments": json.dumps(arguments)}
        chunks = [sse(chunk({"tool_calls": [call]}, "tool_calls")), sse("[DONE]")]
        return CannedResponse(headers={"content-type": "text/event-stream"}, chunks=chunks)

    result, _, server = await run_against(
        openai, tool_call({"country": "France", "capital": "Paris"}), output_mode="tool"
    )
    assert result.output == Answer(country="France", capital="Paris")
    body = server.requests[0].json()
    assert "response_format" not in body
    [function] = body["tools"]
    assert function["function"]["name"] == "final_answer"
    assert function["function"]["parameters"]["required"] == ["country", "capital"]


async def test_anthropic_gets_a_final_answer_tool_and_its_call_is_the_answer():
    result, log, server = await run_against(
        lambda base_url: AnthropicMessagesClient(base_url=base_url, api_key="sk-ant-test"),
        anthropic_tool("final_answer", {"country": "France", "capital": 7}, "toolu_1"),
        anthropic_tool("final_answer", {"country": "France", "capital": "Paris"}, "toolu_2"),
    )
    assert result.output == Answer(country="France", capital="Paris")
    assert log.finished is not None
    assert log.finished.output == {"country": "France", "capital": "Paris"}
    first, second = (r.json() for r in server.requests)
    [tool] = first["tools"]
    assert tool["name"] == "final_answer"
    assert tool["input_schema"]["properties"]["capital"]["type"] == "string"
    assert "The capital of a country." in tool["description"]
    assert "response_format" not in first and "output_format" not in first
    # The invalid call is answered with the errors as its tool result.
    answer = second["messages"][-1]["content"][0]
    assert answer["type"] == "tool_result" and answer["tool_use_id"] == "toolu_1"
    assert "expected a string, got integer @ $.capital" in json.dumps(answer)


def test_the_clients_refuse_what_they_cannot_send():
    output = OutputFormat(name="o", schema={"type": "object"})
    request = ModelRequest(messages=(Message(role="user", content="hi"),), output=output)
    with pytest.raises(UsageError, match="no native structured output"):
        AnthropicMessagesClient(api_key="k").request_body(request)
    with pytest.raises(UsageError, match="response_format"):
        OpenAIChatClient(base_url="http://127.0.0.1:1/v1").request_body(
            attrs.evolve(request, params={"response_format": {"type": "json_object"}})
        )
    # Without an output type a response_format param passes as before.
    body = OpenAIChatClient(base_url="http://127.0.0.1:1/v1").request_body(
        attrs.evolve(request, output=None, params={"response_format": {"type": "json_object"}})
    )
    assert body["response_format"] == {"type": "json_object"}
