"""The model gateway holds its limits during a call: token and time budgets, deadlines, waits.

Streams come from a real loopback HTTP server; deadlines are short (tenths of a second) and no
test sleeps for real seconds to prove a timeout.
"""

from __future__ import annotations

import email.utils
import json
import time

import attrs
import trio
from runtime_fakes import LedgerTools, SimpleParser

from treadle.agent import Agent
from treadle.models import OpenAIChatClient
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run, run
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.testing.scripted import ScriptedModel, call
from treadle.types import (
    ActionResult,
    Budgets,
    Limits,
    ModelResult,
    RunState,
    StopReason,
    Usage,
)

SSE = {"content-type": "text/event-stream"}
FAST_RETRY = Limits(retry_initial_s=0.01, retry_max_s=0.02)


def chunk(delta=None, finish=None, **extra) -> dict:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"id": "chatcmpl-t", "object": "chat.completion.chunk", "choices": [choice], **extra}


def sse(*payloads) -> bytes:
    out = b""
    for payload in payloads:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        out += f"data: {text}\n\n".encode()
    return out


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


HELLO = [sse(chunk({"content": "Hel"})), sse(chunk({"content": "lo"}, "stop")), sse("[DONE]")]


def agent_for(client, **kwargs) -> Agent:
    return Agent(
        model=client, executor=LedgerTools(), parser=SimpleParser(), model_name="m", **kwargs
    )


def announcing(*responses: CannedResponse):
    """A canned handler that also sets the returned event when the first request arrives."""
    arrived = trio.Event()
    answer = canned(*responses)

    def handler(request):
        arrived.set()
        return answer(request)

    return handler, arrived


def results(log) -> list[ModelResult]:
    return [r for r in log.records if isinstance(r, ModelResult)]


async def run_against(responses, *, client_kwargs=None, **agent_kwargs):
    """Run an agent whose OpenAI client talks to a loopback server serving ``responses``."""
    store = MemoryStore()
    async with open_loopback_server(canned(*responses)) as server:
        client = OpenAIChatClient(base_url=server.base_url, **(client_kwargs or {}))
        try:
            with trio.fail_after(10):
                result = await run(agent_for(client, **agent_kwargs), "x", store=store, run_id="r")
        finally:
            await client.aclose()
    return result, await store.read_log("r"), server


# --------------------------------------------------------------------------- token budget


async def test_reply_crossing_the_token_budget_ends_the_run_without_acting():
    """A client that reports no usage before it returns: the reply is checked at the end."""
    tools = LedgerTools()
    reply = attrs.evolve(call("add", a=1, b=2), usage=Usage(input_tokens=60, output_tokens=50))
    agent = Agent(
        model=ScriptedModel(turns=[reply] * 3, reports_usage=False),
        executor=tools,
        parser=SimpleParser(),
        budgets=Budgets(token_budget=100),
    )
    store = MemoryStore()
    result = await run(agent, "x", store=store, run_id="r")
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert result.totals.steps == 0
    assert (result.totals.input_tokens, result.totals.output_tokens) == (60, 50)
    assert tools.executed == []
    [recorded] = results(await store.read_log("r"))
    assert recorded.reply is not None and recorded.usage.output_tokens == 50


async def test_a_reported_usage_crossing_the_token_budget_ends_the_attempt_there():
    """The same reply, reported to the attempt before it is returned: the attempt is cut."""
    tools = LedgerTools()
    reply = attrs.evolve(call("add", a=1, b=2), usage=Usage(input_tokens=60, output_tokens=50))
    agent = Agent(
        model=ScriptedModel(turns=[reply] * 3),
        executor=tools,
        parser=SimpleParser(),
        budgets=Budgets(token_budget=100),
    )
    store = MemoryStore()
    result = await run(agent, "x", store=store, run_id="r")
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert (result.totals.input_tokens, result.totals.output_tokens) == (60, 50)
    assert tools.executed == []
    [recorded] = results(await store.read_log("r"))
    assert recorded.reply is None and recorded.error is not None
    assert recorded.error.kind == "token_budget" and recorded.usage.output_tokens == 50


async def test_reply_reaching_the_budget_exactly_is_acted_on():
    tools = LedgerTools()
    reply = attrs.evolve(call("add", a=1, b=2), usage=Usage(input_tokens=50, output_tokens=50))
    agent = Agent(
        model=ScriptedModel(turns=[reply] * 3),
        executor=tools,
        parser=SimpleParser(),
        budgets=Budgets(token_budget=100),
    )
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert result.totals.steps == 1
    assert len(tools.executed) == 1


async def test_stream_with_running_usage_is_cut_when_it_crosses_the_budget():
    # vLLM-style continuous usage: every chunk carries the running counts.
    chunks = [sse(chunk({"content": f"w{i} "}, usage=usage(50, i + 1))) for i in range(20)]
    response = CannedResponse(headers=SSE, chunks=[*chunks, 30.0, *HELLO], pause_s=0.005)
    result, log, server = await run_against([response], budgets=Budgets(token_budget=60))
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert server.early_disconnects == 1
    [cut] = results(log)
    assert cut.reply is None and cut.error is not None
    assert cut.error.kind == "token_budget"
    assert (cut.usage.input_tokens, cut.usage.output_tokens) == (50, 11)
    assert (result.totals.input_tokens, result.totals.output_tokens) == (50, 11)


async def test_usage_reported_only_in_the_last_chunk_still_ends_the_run():
    chunks = [
        sse(chunk({"content": "done"}, "stop")),
        sse({"id": "c", "choices": [], "usage": usage(90, 20)}),
        sse("[DONE]"),
    ]
    response = CannedResponse(headers=SSE, chunks=chunks)
    result, log, _ = await run_against([response], budgets=Budgets(token_budget=100))
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert result.final_answer is None
    [recorded] = results(log)
    assert (recorded.usage.input_tokens, recorded.usage.output_tokens) == (90, 20)


async def test_usage_of_a_failed_attempt_is_recorded_and_counted():
    failing = CannedResponse(
        headers=SSE,
        chunks=[
            sse(chunk({"content": "par"}, usage=usage(40, 3))),
            sse({"error": {"message": "overloaded", "type": "overloaded_error"}}),
        ],
    )
    ok = CannedResponse(
        headers=SSE, chunks=[*HELLO[:2], sse({"id": "c", "choices": [], "usage": usage(40, 2)})]
    )
    result, log, _ = await run_against([failing, ok], limits=FAST_RETRY)
    assert result.stop_reason is StopReason.FINAL_ANSWER
    first, _ = results(log)
    assert first.error is not None and first.error.kind == "server_error"
    assert (first.usage.input_tokens, first.usage.output_tokens) == (40, 3)
    assert (result.totals.input_tokens, result.totals.output_tokens) == (80, 5)


# --------------------------------------------------------------------------- time budget


async def test_time_budget_cancels_a_slow_stream_and_closes_its_connection():
    slow = [sse(chunk({"content": "a"}, usage=usage(7, 1))), 30.0, *HELLO]
    start = trio.current_time()
    result, log, server = await run_against(
        [CannedResponse(headers=SSE, chunks=slow)], budgets=Budgets(time_budget_s=0.3)
    )
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert trio.current_time() - start < 3
    assert server.early_disconnects == 1
    [cut] = results(log)
    assert cut.error is not None and cut.error.kind == "time_budget"
    assert (cut.usage.input_tokens, cut.usage.output_tokens) == (7, 1)  # reported before the cut
    assert not any(isinstance(r, ActionResult) for r in log.records)


async def test_cancel_during_a_stream_closes_its_connection():
    slow = [sse(chunk({"content": "a"})), 30.0, *HELLO]
    store = MemoryStore()
    handler, arrived = announcing(CannedResponse(headers=SSE, chunks=slow))
    async with open_loopback_server(handler) as server:
        client = OpenAIChatClient(base_url=server.base_url)
        with trio.fail_after(10):
            async with open_run(agent_for(client), "x", store=store, run_id="r") as handle:
                await arrived.wait()
                await trio.sleep(0.05)
                handle.cancel("stop")
                result = await handle.wait()
            await server.wait_early_disconnect()
        await client.aclose()
    assert result.state is RunState.CANCELLED
    [cut] = results(await store.read_log("r"))
    assert cut.error is not None and cut.error.kind == "cancelled"


# --------------------------------------------------------------------------- deadlines and waits


async def test_idle_stream_deadline_fails_the_attempt_and_the_retry_succeeds():
    stalled = CannedResponse(headers=SSE, chunks=[sse(chunk({"content": "a"})), 30.0, *HELLO])
    ok = CannedResponse(headers=SSE, chunks=HELLO)
    result, log, server = await run_against(
        [stalled, ok], client_kwargs={"idle_timeout_s": 0.2}, limits=FAST_RETRY
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "Hello"
    first, _ = results(log)
    assert first.error is not None and first.error.kind == "timeout"
    assert "idle" in first.error.message
    assert server.early_disconnects == 1


async def test_the_definitions_limits_tighten_the_clients_own_deadlines():
    stalled = CannedResponse(headers=SSE, chunks=[sse(chunk({"content": "a"})), 30.0, *HELLO])
    slow_headers = CannedResponse(headers=SSE, chunks=HELLO, delay_s=30)
    limits = attrs.evolve(FAST_RETRY, model_idle_s=0.2, model_first_byte_s=0.2, max_model_retries=1)
    start = trio.current_time()
    result, log, _ = await run_against([stalled, slow_headers], limits=limits)  # client: 60 s
    assert trio.current_time() - start < 3
    assert result.stop_reason is StopReason.MODEL_ERROR
    idle, first_byte = results(log)
    assert idle.error is not None and "idle" in idle.error.message
    assert first_byte.error is not None and first_byte.error.kind == "timeout"
    assert "idle" not in first_byte.error.message


async def test_attempt_total_deadline_cuts_a_stream_that_keeps_trickling():
    trickle = [sse(chunk({"content": "."})) for _ in range(200)]
    slow = CannedResponse(headers=SSE, chunks=[*trickle, *HELLO], pause_s=0.02)
    limits = attrs.evolve(FAST_RETRY, model_attempt_s=0.3, max_model_retries=0)
    result, log, server = await run_against([slow], limits=limits)
    assert result.stop_reason is StopReason.MODEL_ERROR
    [failed] = results(log)
    assert failed.error is not None and failed.error.kind == "timeout"
    assert server.early_disconnects == 1


async def test_retry_after_http_date_longer_than_the_time_left_ends_the_run_at_once():
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    limited = CannedResponse(status=429, headers={"retry-after": later})
    start = trio.current_time()
    result, log, server = await run_against(
        [limited, CannedResponse(headers=SSE, chunks=HELLO)],
        budgets=Budgets(time_budget_s=5),
        limits=FAST_RETRY,
    )
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert trio.current_time() - start < 3
    assert len(server.requests) == 1
    [failed] = results(log)
    assert failed.error is not None and 50 <= failed.error.retry_after_s <= 61


async def test_retry_after_http_date_is_waited_instead_of_backoff():
    later = email.utils.formatdate(time.time() + 60, usegmt=True)
    limited = CannedResponse(status=503, headers={"retry-after": later})
    store = MemoryStore()
    handler, arrived = announcing(limited, CannedResponse(headers=SSE, chunks=HELLO))
    async with open_loopback_server(handler) as server:
        client = OpenAIChatClient(base_url=server.base_url)
        agent = agent_for(client, limits=FAST_RETRY)  # backoff alone would retry in 20 ms
        with trio.fail_after(10):
            async with open_run(agent, "x", store=store, run_id="r") as handle:
                await arrived.wait()
                await trio.sleep(0.3)
                assert len(server.requests) == 1  # still waiting for the date
                handle.cancel("enough")
                result = await handle.wait()
        await client.aclose()
    assert result.stop_reason is StopReason.CANCELLED
    assert result.totals.model_attempts == 1


# --------------------------------------------------------------------------- output cap, reasoning


async def test_output_cap_and_reasoning_effort_reach_the_server_through_a_run():
    result, _, server = await run_against(
        [CannedResponse(headers=SSE, chunks=HELLO)],
        max_output_tokens=100,
        params={"max_tokens": 9999, "max_completion_tokens": 9999, "reasoning_effort": "low"},
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    body = server.requests[0].json()
    assert body["max_tokens"] == 100
    assert "max_completion_tokens" not in body
    assert body["reasoning_effort"] == "low"
