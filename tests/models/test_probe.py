"""probe(): one request with bounded retries, reported as a plain dict."""

from __future__ import annotations

import json

import pytest
import trio

from treadle._exceptions import UsageError
from treadle.models import probe
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import Message, ToolSpec

SSE = {"content-type": "text/event-stream"}


def sse(*payloads) -> list[bytes]:
    return [f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads]


def chunk(delta, finish=None, usage=None) -> dict:
    out = {"id": "chatcmpl-p", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


PONG = CannedResponse(
    headers=SSE,
    chunks=sse(
        chunk({"content": "pong"}, "stop"),
        {"id": "chatcmpl-p", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}},
        "[DONE]",
    ),
)


async def run_probe(*responses: CannedResponse, **kwargs):
    async with open_loopback_server(canned(*responses)) as server:
        with trio.fail_after(10):
            result = await probe(base_url=server.base_url, model="m", **kwargs)
    return result, server


async def test_success_is_reported_with_usage():
    result, server = await run_probe(PONG)
    assert result == {
        "protocol": "openai",
        "model": "m",
        "text": "pong",
        "reasoning": None,
        "reasoning_signature": None,
        "tool_calls": [],
        "invalid_tool_calls": [],
        "finish_reason": "stop",
        "usage": {
            "input_tokens": 9,
            "output_tokens": 1,
            "reasoning_tokens": None,
            "total_tokens": None,
            "cached_input_tokens": None,
            "cache_creation_input_tokens": None,
        },
        "response_id": "chatcmpl-p",
        "refusal": None,
        "provider_finish_reason": None,
        "surrogates_replaced": 0,
        "decision": {
            "kind": "final_answer",
            "actions": [],
            "text": "pong",
            "feedback": None,
            "reason": None,
            "repairs": [],
        },
        "error": None,
    }
    body = server.requests[0].json()
    assert body["model"] == "m"
    assert body["messages"] == [{"role": "user", "content": "Reply with the single word: pong"}]
    assert "tools" not in body


async def test_tools_and_messages_are_sent_and_calls_reported():
    call = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}
    response = CannedResponse(
        headers=SSE, chunks=sse(chunk({"tool_calls": [call]}, "tool_calls"), "[DONE]")
    )
    result, server = await run_probe(
        response,
        tools=[ToolSpec(name="f")],
        messages=[Message(role="user", content="call f")],
        api_key="sk-x",
    )
    assert result["tool_calls"] == [{"id": "c1", "name": "f", "arguments": {"a": 1}}]
    assert set(result["usage"].values()) == {None}
    assert result["error"] is None
    assert result["decision"]["kind"] == "actions"
    body = server.requests[0].json()
    assert body["tools"][0]["function"]["name"] == "f"
    assert body["messages"] == [{"role": "user", "content": "call f"}]
    assert server.requests[0].header("authorization") == "Bearer sk-x"


async def test_retryable_error_is_retried_honouring_retry_after():
    limited = CannedResponse(status=429, headers={"retry-after": "0"})
    result, server = await run_probe(limited, PONG, max_attempts=3)
    assert result["text"] == "pong"
    assert result["error"] is None
    assert len(server.requests) == 2


async def test_attempts_are_bounded_and_the_last_error_reported():
    failing = CannedResponse(status=503, headers={})
    result, server = await run_probe(failing, max_attempts=3, retry_initial_s=0)
    assert len(server.requests) == 3
    assert result["text"] is None and result["tool_calls"] == [] and result["decision"] is None
    assert result["error"] == {
        "kind": "server_error",
        "message": result["error"]["message"],
        "retryable": True,
        "retry_after_s": None,
        "status": 503,
    }


async def test_non_retryable_error_is_not_retried():
    result, server = await run_probe(CannedResponse(status=401), max_attempts=3)
    assert len(server.requests) == 1
    error = result["error"]
    assert (error["kind"], error["retryable"], error["status"]) == ("auth", False, 401)


async def test_a_wait_longer_than_allowed_ends_the_probe():
    limited = CannedResponse(status=429, headers={"retry-after": "120"})
    result, server = await run_probe(limited, PONG, max_retry_wait_s=5)
    assert len(server.requests) == 1
    error = result["error"]
    assert (error["kind"], error["retry_after_s"], error["status"]) == ("rate_limited", 120.0, 429)


async def test_max_attempts_must_be_positive():
    with pytest.raises(UsageError):
        await probe(base_url="http://127.0.0.1:9", model="m", max_attempts=0)


async def test_a_call_whose_arguments_the_parser_repairs_is_the_decision_a_run_makes():
    """The client leaves arguments it cannot decode as an invalid call; the run's parser
    repairs them (a Python literal here), and the probe reports that decision, not "empty"."""
    bad = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{'a': 1}"}}
    response = CannedResponse(
        headers=SSE, chunks=sse(chunk({"tool_calls": [bad]}, "tool_calls"), "[DONE]")
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    result, _ = await run_probe(response, tools=[ToolSpec(name="f", parameters=schema)])
    assert result["tool_calls"] == []
    assert result["invalid_tool_calls"] == [
        {"id": "c1", "name": "f", "raw_arguments": "{'a': 1}", "reason": "unparseable"}
    ]
    decision = result["decision"]
    assert decision["kind"] == "actions"
    assert decision["actions"] == [{"id": "c1", "name": "f", "arguments": {"a": 1}}]
    assert decision["repairs"] == ["python_literal"]


async def test_the_anthropic_protocol_reports_the_same_shape():
    from test_anthropic_events import SSE as ANTHROPIC_SSE
    from test_anthropic_events import text_reply

    reply = CannedResponse(headers=ANTHROPIC_SSE, chunks=text_reply("po", "ng"))
    result, server = await run_probe(reply, protocol="anthropic", api_key="sk-ant-x")
    openai, _ = await run_probe(PONG)
    assert set(result) == set(openai)
    assert result["protocol"] == "anthropic"
    assert (result["text"], result["finish_reason"]) == ("pong", "stop")
    assert result["decision"]["kind"] == "final_answer"
    assert server.requests[0].path.endswith("/v1/messages")
    assert server.requests[0].header("x-api-key") == "sk-ant-x"


async def test_reasoning_is_reported():
    response = CannedResponse(
        headers=SSE,
        chunks=sse(
            chunk({"reasoning_content": "think"}), chunk({"content": "pong"}, "stop"), "[DONE]"
        ),
    )
    result, _ = await run_probe(response)
    assert (result["reasoning"], result["text"]) == ("think", "pong")


async def test_an_unknown_protocol_is_refused():
    with pytest.raises(UsageError, match="protocol must be one of openai, anthropic"):
        await probe(base_url="http://127.0.0.1:9", model="m", protocol="grpc")


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_the_probe_prints_what_a_runs_records_hold_for_the_same_reply(protocol):
    """The reply fields equal the run's model-result record; the decision its step's."""
    from test_anthropic_events import SSE as ANTHROPIC_SSE
    from test_anthropic_events import text_reply, tool_reply

    from treadle.agent import Agent
    from treadle.models import AnthropicMessagesClient, OpenAIChatClient
    from treadle.models._probe import _plain
    from treadle.parsers import NativeToolCallParser
    from treadle.stores.memory import MemoryStore
    from treadle.supervisors import run
    from treadle.testing.loopback import CannedResponse
    from treadle.tools import Toolbox, tool
    from treadle.types import ModelResult, StepRecord

    @tool
    async def get_weather(location: str) -> str:
        """The weather."""
        return "sunny"

    if protocol == "openai":
        call = {"index": 0, "id": "c1", "function": {"name": "get_weather", "arguments": ""}}
        more = {"index": 0, "function": {"arguments": '{"location": "Paris"}'}}
        first = CannedResponse(
            headers=SSE,
            chunks=sse(chunk({"tool_calls": [call]}), chunk({"tool_calls": [more]}, "tool_calls"))
            + sse("[DONE]"),
        )
        client_type, base = OpenAIChatClient, "/v1"
    else:
        first = CannedResponse(headers=ANTHROPIC_SSE, chunks=tool_reply())
        client_type, base = AnthropicMessagesClient, ""
    done = (
        PONG
        if protocol == "openai"
        else CannedResponse(headers=ANTHROPIC_SSE, chunks=text_reply("pong"))
    )
    tools = Toolbox([get_weather])
    report, _ = await run_probe(first, protocol=protocol, tools=tools.tool_specs())
    store = MemoryStore()
    async with (
        open_loopback_server(canned(first, done)) as server,
        client_type(base_url=server.base_url + base) as model,
    ):
        agent = Agent(model=model, executor=tools, parser=NativeToolCallParser())
        await run(agent, "weather?", store=store, run_id="r")
    log = await store.read_log("r")
    recorded = next(r for r in log.records if isinstance(r, ModelResult))
    step = next(r for r in log.records if isinstance(r, StepRecord))
    assert {k: report[k] for k in _plain(recorded.reply)} == _plain(recorded.reply)
    assert report["decision"]["kind"] == step.decision.value
    history_calls = [
        {"id": c.id, "name": c.name, "arguments": dict(c.arguments)}
        for c in step.history_message.tool_calls
    ]
    assert report["decision"]["actions"] == history_calls


async def test_the_probe_reports_what_a_run_records_for_bad_text_and_non_finite_numbers():
    """A lone surrogate is replaced (and counted), a NaN argument makes the call invalid,
    as the gateway records them; the report is strict JSON."""
    nan = {"index": 0, "id": "c1", "function": {"name": "add", "arguments": '{"a": NaN}'}}
    response = CannedResponse(
        headers=SSE,
        chunks=[
            b'data: {"choices": [{"index": 0, "delta": {"content": "a\\ud800b"}}]}\n\n',
            *sse(chunk({"tool_calls": [nan]}, "tool_calls"), "[DONE]"),
        ],
    )
    result, _ = await run_probe(response, tools=[ToolSpec(name="add")])
    assert result["text"] == "a\ufffdb" and result["surrogates_replaced"] == 1
    assert result["tool_calls"] == []
    assert [c["reason"] for c in result["invalid_tool_calls"]] == ["non_finite_number"]
    assert result["decision"]["kind"] == "invalid"
    json.dumps(result, allow_nan=False).encode("utf-8")  # printable as strict JSON
