"""Images a tool returns reach the model, through both clients, and stay references in the log.

Every run talks to a real HTTP server on 127.0.0.1 (`treadle.testing.loopback`), which records
the bodies it received: the image must be inside the Anthropic ``tool_result`` block, and in the
``user`` message after the tool messages for Chat Completions (docs/models.md, "Images returned
by tools"). The MCP case uses the real test server (tests/fixtures/mcp_server.py) over stdio.
Resume is checked after a simulated crash (`CrashingStore`) and after a real process
(tests/fixtures/image_driver.py) is SIGKILLed with the image's model call in flight.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from tests.fixtures import image_driver, mcp_server
from tests.fixtures.mcp_driver import stdio_server

import treadle
from treadle import ImageRef, ToolResult
from treadle.mcp import open_mcp_tools
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.models._transport import digest
from treadle.stores import record_to_json
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import ActionOutcome, ActionResult, ActionStatus, RunLog, StepRecord

PNG = mcp_server.PNG
PNG_B64 = base64.b64encode(PNG).decode()
REF = ImageRef(url="ref:shot-1", digest=digest(PNG), media_type="image/png")
SSE = {"content-type": "text/event-stream"}
ROOT = Path(__file__).resolve().parents[2]


@treadle.tool
async def screenshot(page: str) -> ToolResult:
    """Take a screenshot of a page."""
    return ToolResult(text=f"{page} rendered", images=[REF])


# --------------------------------------------------------------------------- two providers


def _openai_sse(*payloads: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in payloads) + b"data: [DONE]\n\n"


def _openai_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _openai_call(tool: str, arguments: dict[str, Any]) -> CannedResponse:
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": tool, "arguments": json.dumps(arguments)},
    }
    return CannedResponse(
        headers=SSE, chunks=[_openai_sse(_openai_chunk({"tool_calls": [call]}, "tool_calls"))]
    )


def _openai_text(text: str) -> CannedResponse:
    chunks = _openai_sse(_openai_chunk({"content": text}), _openai_chunk({}, "stop"))
    return CannedResponse(headers=SSE, chunks=[chunks])


def _anthropic_stream(block: dict[str, Any], stop: str) -> CannedResponse:
    if block["type"] == "text":
        start: dict[str, Any] = {"type": "text", "text": ""}
        delta: dict[str, Any] = {"type": "text_delta", "text": block["text"]}
    else:
        start = {"type": "tool_use", "id": "call_1", "name": block["name"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    events = [
        {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 5}}},
        {"type": "content_block_start", "index": 0, "content_block": start},
        {"type": "content_block_delta", "index": 0, "delta": delta},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 3}},
        {"type": "message_stop"},
    ]
    chunks: list[bytes | float] = [
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events
    ]
    return CannedResponse(headers=SSE, chunks=chunks)


def _call(provider: str, tool: str, arguments: dict[str, Any]) -> CannedResponse:
    if provider == "openai":
        return _openai_call(tool, arguments)
    return _anthropic_stream({"type": "tool_use", "name": tool, "input": arguments}, "tool_use")


def _text(provider: str, text: str) -> CannedResponse:
    if provider == "openai":
        return _openai_text(text)
    return _anthropic_stream({"type": "text", "text": text}, "end_turn")


def _client(provider: str, base_url: str, source: Any = None) -> Any:
    if provider == "openai":
        return OpenAIChatClient(base_url=base_url + "/v1", image_source=source)
    return AnthropicMessagesClient(base_url=base_url, api_key="k", image_source=source)


def _agent(client: Any, executor: Any) -> treadle.Agent:
    return treadle.Agent(
        model=client,
        executor=executor,
        parser=treadle.NativeToolCallParser(),
        model_name="m",
        system_prompt="Look at pages.",
    )


def _sent_images(provider: str, body: dict[str, Any], tool: str) -> list[tuple[str, str]]:
    """``(where, base64 data)`` of every image in a request body, ``where`` naming its place.

    Anthropic: ``tool_result:<id>`` for an image inside a tool result. Chat Completions:
    ``after_tools:<caption>`` for an image in a user message right after tool messages.
    """
    found: list[tuple[str, str]] = []
    messages = body["messages"]
    for index, message in enumerate(messages):
        content = message["content"]
        if not isinstance(content, list):
            continue
        if provider == "anthropic":
            for block in content:
                assert block["type"] != "image", "an image outside a tool_result"
                if block["type"] == "tool_result" and isinstance(block["content"], list):
                    for part in block["content"]:
                        if part["type"] == "image":
                            assert part["source"]["media_type"] == "image/png"
                            found.append(
                                (f"tool_result:{block['tool_use_id']}", part["source"]["data"])
                            )
            continue
        assert message["role"] == "user" and messages[index - 1]["role"] == "tool"
        caption = next(p["text"] for p in content if p["type"] == "text")
        for part in content:
            if part["type"] == "image_url":
                url = part["image_url"]["url"]
                assert url.startswith("data:image/png;base64,")
                found.append((f"after_tools:{caption}", url.split(",", 1)[1]))
    return found


def _where(provider: str, tool: str) -> str:
    if provider == "anthropic":
        return "tool_result:call_1"
    return f"after_tools:[1 image returned by the call call_1 ({tool}):]"


def _check_log_holds_references(log: RunLog, ref: ImageRef, raw: list[bytes]) -> None:
    """The action result and the step hold the reference; no record holds the bytes."""
    [result] = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.images == (ref,)
    step = next(r for r in log.records if isinstance(r, StepRecord) and r.observations)
    assert step.observation_images == ((ref,),)
    encoded = "".join(record_to_json(record) for record in log.records)
    assert base64.b64encode(PNG).decode() not in encoded
    assert all(PNG not in blob for blob in raw)


# --------------------------------------------------------------------------- the tests


def _source(asked: list[ImageRef]) -> Any:
    def source(image: ImageRef) -> bytes:
        asked.append(image)
        return {"ref:shot-1": PNG}[image.url]

    return source


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_tool_image_reaches_the_model_in_the_providers_place(provider, tmp_path):
    asked: list[ImageRef] = []
    script = canned(_call(provider, "screenshot", {"page": "home"}), _text(provider, "A dot."))
    async with (
        open_loopback_server(script) as server,
        _client(provider, server.base_url, _source(asked)) as client,
        treadle.open_sqlite_store(tmp_path / "runs.db") as store,
    ):
        agent = _agent(client, treadle.Toolbox([screenshot]))
        with trio.fail_after(10):
            result = await treadle.run(agent, "Look at home.", store=store, run_id="r")
        log = await store.read_log("r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    first, second = (r.json() for r in server.requests)
    assert _sent_images(provider, first, "screenshot") == []
    where = _where(provider, "screenshot")
    assert _sent_images(provider, second, "screenshot") == [(where, PNG_B64)]
    assert asked == [REF]
    if provider == "openai":  # the tool message itself stays text, answering its call
        tool_message = second["messages"][-2]
        assert tool_message == {
            "role": "tool",
            "content": "home rendered",
            "tool_call_id": "call_1",
        }
    else:
        [block] = second["messages"][-1]["content"]
        assert block["content"][0] == {"type": "text", "text": "home rendered"}
    files = [path.read_bytes() for path in tmp_path.iterdir()]
    _check_log_holds_references(log, REF, files)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_key_the_source_cannot_resolve_is_an_error_of_the_attempt(provider):
    script = canned(_call(provider, "screenshot", {"page": "home"}), _text(provider, "unused"))
    store = treadle.MemoryStore()
    async with (
        open_loopback_server(script) as server,
        _client(provider, server.base_url, {}.__getitem__) as client,
    ):
        agent = _agent(client, treadle.Toolbox([screenshot]))
        with trio.fail_after(10), pytest.raises(treadle.UsageError, match="ref:shot-1"):
            await treadle.run(agent, "Look at home.", store=store, run_id="r")
    assert len(server.requests) == 1  # the request that needed the image was never sent
    log = await store.read_log("r")
    assert log.finished is None  # the run stays resumable, its step kept
    _check_log_holds_references(log, REF, [])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_resumed_run_sends_the_images_again_from_the_logs_references(provider, tmp_path):
    asked: list[ImageRef] = []
    db = tmp_path / "runs.db"
    # Writes: 1 run started, 2 model intent, 3 model result, 4 action intent, 5 the step with
    # its result; the crash comes before 6, the next model call's intent.
    crashed = False
    script = canned(_call(provider, "screenshot", {"page": "home"}))
    async with (
        open_loopback_server(script) as first,
        _client(provider, first.base_url, _source(asked)) as client,
        treadle.open_sqlite_store(db) as inner,
    ):
        crashing = CrashingStore(inner=inner, crash_at=6, when="before")
        agent = _agent(client, treadle.Toolbox([screenshot]))
        try:
            with trio.fail_after(10):
                await treadle.run(agent, "Look at home.", store=crashing, run_id="r")
        except* (treadle.RunInterrupted, SimulatedCrash):
            crashed = True
    assert crashed and crashing.crashed
    assert asked == []  # nothing was sent with the image before the crash
    async with (
        open_loopback_server(canned(_text(provider, "A dot."))) as second,
        _client(provider, second.base_url, _source(asked)) as client,
        treadle.open_sqlite_store(db) as store,
    ):
        agent = _agent(client, treadle.Toolbox([screenshot]))
        with trio.fail_after(10):
            result = await treadle.run(agent, store=store, run_id="r")
        log = await store.read_log("r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    [resumed] = (r.json() for r in second.requests)
    where = _where(provider, "screenshot")
    assert _sent_images(provider, resumed, "screenshot") == [(where, PNG_B64)]
    assert asked == [REF]  # resolved from the reference the log holds
    _check_log_holds_references(log, REF, [path.read_bytes() for path in tmp_path.iterdir()])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_an_mcp_tools_image_reaches_the_model_with_nothing_wired(provider, tmp_path):
    ledger = tmp_path / "ledger"
    script = canned(_call(provider, "chart", {}), _text(provider, "A chart."))
    store = treadle.MemoryStore()
    async with (
        open_mcp_tools(stdio_server(ledger)) as tools,
        open_loopback_server(script) as server,
        _client(provider, server.base_url) as client,  # no image_source: the session's
    ):
        executor = treadle.combine_tools(treadle.Toolbox([screenshot]), tools)
        with trio.fail_after(30):
            result = await treadle.run(_agent(client, executor), "Chart.", store=store, run_id="r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    second = server.requests[1].json()
    assert _sent_images(provider, second, "chart") == [(_where(provider, "chart"), PNG_B64)]
    sha = digest(PNG).removeprefix("sha256:")
    ref = ImageRef(url=f"ref:mcp-{sha}", digest=digest(PNG), media_type="image/png")
    _check_log_holds_references(await store.read_log("r"), ref, [])


def test_a_tool_result_takes_references_only():
    with pytest.raises(treadle.UsageError, match="never bytes"):
        ToolResult(text="x", images=[PNG])  # type: ignore[list-item]
    assert ToolResult(text="x", images=[REF]).images == (REF,)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("data:image/png;base64,iVBORw0KGgo=", "http\\(s\\) URL or a ref:<name> key"),
        ("file:///etc/passwd", "http\\(s\\) URL or a ref:<name> key"),
        ("/tmp/chart.png", "http\\(s\\) URL or a ref:<name> key"),
        (b"ref:chart", "url must be text, not bytes"),
    ],
)
def test_a_tool_result_refuses_an_image_whose_url_is_no_reference(url, why):
    """A ``data:`` URL put the image's bytes into the log, and a local path or bytes passed."""
    with pytest.raises(treadle.UsageError, match=why):
        ToolResult(text="x", images=[ImageRef(url=url)])
    for kept in ("https://example.com/a.png", "HTTP://example.com/a.png", "ref:chart"):
        assert ToolResult(text="x", images=[ImageRef(url=kept)]).images[0].url == kept


def test_an_executor_outcome_with_a_data_url_image_breaks_the_seam():
    from treadle._shapes import outcome_problem

    inline = ImageRef(url="data:image/png;base64,iVBORw0KGgo=")
    found = ActionOutcome(status=ActionStatus.EXECUTED, observation="x", images=(inline,))
    assert "http(s) URL or a ref:<name> key" in (outcome_problem(found) or "")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_run_killed_while_sending_an_image_resends_it_after_a_resume(provider, tmp_path):
    """A real process is SIGKILLed with the image's model call in flight; the resume sends
    the same image again, read back through the reference the log holds."""
    db, images = tmp_path / "runs.db", tmp_path / "images"
    images.mkdir()
    in_flight = trio.Event()

    async def first_process(request: Any) -> CannedResponse:
        if not in_flight.is_set() and len(server.requests) == 1:
            return _call(provider, "screenshot", {"page": "home"})
        in_flight.set()
        await trio.sleep_forever()  # the call that carries the image never answers
        raise AssertionError("unreachable")

    root = ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    args = [sys.executable, "-m", "tests.fixtures.image_driver", str(db), provider]
    async with open_loopback_server(first_process) as server:
        driver = await trio.lowlevel.open_process(
            [*args, server.base_url, str(images)], cwd=root, env=env
        )
        try:
            with trio.fail_after(60):
                await in_flight.wait()
            driver.send_signal(signal.SIGKILL)
            assert await driver.wait() == -signal.SIGKILL
        finally:
            driver.kill()
            await driver.wait()
    killed = server.requests[1].json()
    assert _sent_images(provider, killed, "screenshot") == [
        (_where(provider, "screenshot"), PNG_B64)
    ]
    async with open_loopback_server(canned(_text(provider, "A dot."))) as second:
        await image_driver.drive(str(db), provider, second.base_url, images)
    [resumed] = (r.json() for r in second.requests)
    assert _sent_images(provider, resumed, "screenshot") == [
        (_where(provider, "screenshot"), PNG_B64)
    ]
    async with treadle.open_sqlite_store(db) as store:
        log = await store.read_log(image_driver.RUN_ID)
    assert log.finished is not None and log.finished.stop_reason is treadle.StopReason.FINAL_ANSWER
    ref = ImageRef(url="ref:home.png", media_type="image/png")
    blobs = [path.read_bytes() for path in tmp_path.iterdir() if path.is_file()]
    _check_log_holds_references(log, ref, blobs)
