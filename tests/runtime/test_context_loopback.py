"""A long run over HTTP: an OpenAI-compatible server on 127.0.0.1 with a real window.

Without a context window the run grows until the server refuses it (HTTP 400,
``context_length_exceeded``); with one it compacts and finishes, every request within the
window (docs/context.md).
"""

from __future__ import annotations

import json
import re
from typing import Any

import trio

from treadle import MemoryStore, OpenAIChatClient, run
from treadle._budget import DEFAULT_SUMMARY_PROMPT
from treadle.testing import CannedResponse, open_loopback_server
from treadle.testing.loopback import RecordedRequest
from treadle.testing.windowed import windowed_agent
from treadle.types import ModelResult, StopReason

WINDOW = 1500
GOAL = 40
_FACT = re.compile(r"n=(\d+)")


def _tokens(body: dict[str, Any]) -> int:
    chars = len(json.dumps(body.get("tools", [])))
    for message in body["messages"]:
        chars += len(message.get("content") or "")
        chars += len(json.dumps(message.get("tool_calls", [])))
    return chars // 4 + 4 * len(body["messages"])


def _sse(delta: dict[str, Any], finish: str, tokens: int) -> CannedResponse:
    chunk = {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    end = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": tokens, "completion_tokens": 9}}
    lines = [f"data: {json.dumps(c)}\n\n".encode() for c in (chunk, end, usage)]
    return CannedResponse(
        headers={"content-type": "text/event-stream"},
        chunks=[*lines, b"data: [DONE]\n\n"],
        pause_s=0.0,
    )


def provider(sizes: list[int]):
    def handler(request: RecordedRequest) -> CannedResponse:
        body = request.json()
        tokens = _tokens(body)
        sizes.append(tokens)
        cap = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if tokens + cap > WINDOW:
            error = {
                "error": {
                    "message": f"This model's maximum context length is {WINDOW} tokens. "
                    f"However, your messages resulted in {tokens} tokens.",
                    "type": "invalid_request_error",
                    "code": "context_length_exceeded",
                }
            }
            return CannedResponse(status=400, chunks=[json.dumps(error).encode()], chunked=False)
        texts = [m.get("content") or "" for m in body["messages"]]
        newest = max((int(k) for t in texts for k in _FACT.findall(t)), default=0)
        if texts and texts[0] == DEFAULT_SUMMARY_PROMPT:
            return _sse({"content": f"Facts: n={newest} (step {newest})."}, "stop", tokens)
        if newest >= GOAL:
            return _sse({"content": f"done at n={newest}"}, "stop", tokens)
        call = {
            "index": 0,
            "id": f"c{newest + 1}",
            "type": "function",
            "function": {"name": "fetch", "arguments": json.dumps({"n": newest + 1})},
        }
        return _sse({"tool_calls": [call]}, "tool_calls", tokens)

    return handler


async def _run(window: int | None) -> tuple[Any, list[int], MemoryStore]:
    sizes: list[int] = []
    store = MemoryStore()
    async with (
        open_loopback_server(provider(sizes)) as server,
        OpenAIChatClient(base_url=server.base_url) as client,
    ):
        agent = windowed_agent(client, window=window, payload_chars=300)
        with trio.fail_after(120):
            result = await run(agent, "count to forty", store=store, run_id="http")
    return result, sizes, store


async def test_without_a_window_the_server_refuses_the_grown_history():
    result, sizes, _ = await _run(None)
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.error == "context_length_exceeded"
    assert sizes[-1] + 64 > WINDOW


async def test_with_a_window_the_long_run_finishes_within_it():
    result, sizes, store = await _run(WINDOW)
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == f"done at n={GOAL}"
    assert max(sizes) + 64 <= WINDOW
    log = await store.read_log("http")
    results = [r for r in log.records if isinstance(r, ModelResult)]
    assert any(r.summary_through is not None for r in results)
    # the reported prompt size of each call is recorded next to the budget's estimate
    for record in results:
        if record.context is not None:
            assert record.usage.input_tokens is not None
            assert record.context.estimated_input_tokens <= record.context.budget
    # without compaction the same history would have grown past the window
    assert sum(sizes[:2]) < WINDOW < GOAL * 300 // 4
