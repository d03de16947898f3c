"""AnthropicMessagesClient: the request it sends and the reply it assembles."""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
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
    text_delta,
    text_reply,
    thinking_reply,
    tool_reply,
)

import treadle
from treadle._exceptions import ModelCallError, UsageError
from treadle.models import AnthropicMessagesClient
from treadle.ports import ModelClient
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import ImageRef, Message, ModelRequest, ToolCall, ToolSpec, Usage

KEY = "sk-ant-api03-secret-123456"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="claude-x")


async def call(response: CannedResponse, request=REQUEST, on_delta=None, **client_kwargs):
    """Serve one response and return (reply or ModelCallError, server)."""
    async with open_loopback_server(canned(response)) as server:
        client = AnthropicMessagesClient(base_url=server.base_url, api_key=KEY, **client_kwargs)
        try:
            with trio.fail_after(10):
                outcome = await client.complete(request, on_delta=on_delta)
        except ModelCallError as err:
            outcome = err
        finally:
            await client.aclose()
    return outcome, server


def body_of(request: ModelRequest, **kwargs) -> dict:
    return AnthropicMessagesClient(base_url="http://127.0.0.1:9", **kwargs).request_body(request)


# --------------------------------------------------------------------------- request building


def test_client_satisfies_the_model_client_port():
    assert isinstance(AnthropicMessagesClient(base_url="http://x"), ModelClient)


def test_system_tools_tool_results_and_merged_turns():
    request = ModelRequest(
        model="claude-x",
        messages=(
            Message(role="system", content="Be brief."),
            Message(role="user", content="Weather in SF and NYC?"),
            Message(
                role="assistant",
                content="Checking.",
                tool_calls=(
                    ToolCall(id="toolu_1", name="get_weather", arguments={"city": "SF"}),
                    ToolCall(id="toolu_2", name="get_weather", arguments={"city": "NYC"}),
                ),
            ),
            Message(role="tool", tool_call_id="toolu_1", name="get_weather", content="18 C"),
            Message(role="tool", tool_call_id="toolu_2", name="get_weather", content="25 C"),
            Message(role="user", content="And tomorrow?"),
        ),
        tools=(ToolSpec(name="get_weather", description="Weather now.",
                        parameters={"type": "object", "properties": {"city": {"type": "string"}}}),),
    )  # fmt: skip
    body = body_of(request)
    assert body["system"] == "Be brief."
    assert body["stream"] is True
    assert body["tools"] == [
        {
            "name": "get_weather",
            "description": "Weather now.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][0]["content"] == "Weather in SF and NYC?"
    assert body["messages"][1]["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "SF"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "NYC"}},
    ]
    assert body["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "25 C"},
        {"type": "text", "text": "And tomorrow?"},
    ]


def test_max_tokens_always_sent_from_the_definition_and_never_raised_by_params():
    params = {"max_tokens": 9999, "max_completion_tokens": 9999, "max_output_tokens": 9999}
    capped = ModelRequest(messages=(), max_output_tokens=100, params=params)
    body = body_of(capped)
    assert body["max_tokens"] == 100
    assert "max_completion_tokens" not in body and "max_output_tokens" not in body
    uncapped = ModelRequest(messages=(), params={"max_tokens": 500})
    assert body_of(uncapped)["max_tokens"] == 500
    assert body_of(ModelRequest(messages=()))["max_tokens"] == 4096
    assert body_of(ModelRequest(messages=()), default_max_tokens=64)["max_tokens"] == 64


@pytest.mark.parametrize("value", [100.0, "100", 0, -5, True, None])
def test_a_max_tokens_param_that_is_not_a_positive_integer_is_refused_not_replaced(value):
    # It was replaced by default_max_tokens without a word: 100.0 asked for 4,096 tokens.
    refused = "the max_tokens param must be a positive integer"
    with pytest.raises(UsageError, match=refused):
        body_of(ModelRequest(messages=(), params={"max_tokens": value}))
    with pytest.raises(UsageError, match=refused):
        treadle.Agent(
            model=AnthropicMessagesClient(base_url="http://127.0.0.1:9"),
            executor=treadle.Toolbox([]),
            parser=treadle.NativeToolCallParser(),
            params={"max_tokens": value},
        )


def test_thinking_budget_and_sampling_params_pass_in_anthropic_form():
    thinking = {"type": "enabled", "budget_tokens": 2048}
    request = ModelRequest(
        messages=(), max_output_tokens=8000, params={"thinking": thinking, "temperature": 1}
    )
    body = body_of(request)
    assert body["thinking"] == thinking
    assert body["temperature"] == 1
    assert body["max_tokens"] == 8000


@pytest.mark.parametrize("key", ["model", "messages", "system", "tools", "stream"])
def test_params_cannot_replace_structural_keys(key):
    with pytest.raises(UsageError, match=key):
        body_of(ModelRequest(messages=(), params={key: 1}))


def test_images_by_url_and_by_reference():
    digest = "sha256:" + hashlib.sha256(PNG).hexdigest()
    request = ModelRequest(
        messages=(
            Message(
                role="user",
                content="What is this?",
                images=(
                    ImageRef(url="https://example.com/cat.png"),
                    ImageRef(url="ref:chart", digest=digest),
                ),
            ),
        )
    )
    body = body_of(request, image_source=lambda ref: PNG)
    content = body["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1] == {
        "type": "image",
        "source": {"type": "url", "url": "https://example.com/cat.png"},
    }
    assert content[2]["source"] == {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(PNG).decode(),
    }


@pytest.mark.parametrize(
    ("source", "image", "match"),
    [
        (None, ImageRef(url="ref:x"), "needs an image_source"),
        ({}.__getitem__, ImageRef(url="ref:x"), "could not be loaded"),
        (lambda ref: PNG, ImageRef(url="ref:x", digest="sha256:00"), "do not match"),
        (lambda ref: b"????", ImageRef(url="ref:x"), "unknown media type"),
    ],
)
def test_a_missing_or_wrong_image_is_a_clear_error(source, image, match):
    request = ModelRequest(messages=(Message(role="user", content="x", images=(image,)),))
    with pytest.raises(UsageError, match=match):
        body_of(request, image_source=source)


def test_images_on_non_user_messages_are_refused():
    message = Message(role="assistant", content="x", images=(ImageRef(url="https://e/x.png"),))
    with pytest.raises(UsageError, match="only allowed on user"):
        body_of(ModelRequest(messages=(message,)))


@pytest.mark.parametrize(
    "kwargs",
    [{"base_url": "ftp://x"}, {"idle_timeout_s": 0}, {"default_max_tokens": 0}],
)
def test_bad_configuration_raises_usage_error(kwargs):
    with pytest.raises(UsageError):
        AnthropicMessagesClient(**{"base_url": "http://x", **kwargs})


# --------------------------------------------------------------------------- on the wire


async def test_request_goes_out_with_path_headers_and_body():
    reply, server = await call(CannedResponse(headers=SSE, chunks=text_reply("Hi")))
    assert reply.text == "Hi"
    [sent] = server.requests
    assert (sent.method, sent.path) == ("POST", "/v1/messages")
    assert sent.header("x-api-key") == KEY
    assert sent.header("anthropic-version") == "2023-06-01"
    assert sent.header("authorization") is None
    assert sent.json()["messages"] == [{"role": "user", "content": "hi"}]


async def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-env")
    async with open_loopback_server(
        canned(CannedResponse(headers=SSE, chunks=text_reply("x")))
    ) as server:
        client = AnthropicMessagesClient(base_url=server.base_url)
        await client.complete(REQUEST)
        await client.aclose()
    assert server.requests[0].header("x-api-key") == "sk-ant-from-env"
    assert "sk-ant" not in repr(client)


async def test_no_key_anywhere_means_no_key_header(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    async with open_loopback_server(
        canned(CannedResponse(headers=SSE, chunks=text_reply("x")))
    ) as server:
        client = AnthropicMessagesClient(base_url=server.base_url)
        await client.complete(REQUEST)
        await client.aclose()
    assert server.requests[0].header("x-api-key") is None


# --------------------------------------------------------------------------- reply assembly


async def test_text_reply_streams_deltas_and_reports_usage():
    deltas = []
    reply, _ = await call(
        CannedResponse(headers=SSE, chunks=text_reply("Hel", "lo", "!")),
        on_delta=lambda channel, text: deltas.append((channel, text)),
    )
    assert reply.text == "Hello!"
    assert deltas == [("text", "Hel"), ("text", "lo"), ("text", "!")]
    assert reply.finish_reason == "stop"
    assert reply.response_id == "msg_01XFDUDYJgAACzvnptvVoYEL"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (25, 15)
    assert reply.reasoning is None and reply.tool_calls == ()


async def test_tool_use_with_streamed_input_json():
    reply, _ = await call(CannedResponse(headers=SSE, chunks=tool_reply()))
    assert reply.text == "Okay, let me check."
    assert reply.finish_reason == "tool_calls"
    assert reply.tool_calls == (
        ToolCall(id="toolu_01T1x", name="get_weather", arguments={"location": "San Francisco, CA"}),
    )
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (472, 89)


async def test_an_empty_text_block_beside_a_tool_use_is_no_text():
    """A text block that stays empty is ``None``, never "" standing for nothing
    (docs/seams.md, "Model client")."""
    chunks = [
        message_start(),
        block_start(0, {"type": "text", "text": ""}),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "toolu_a", "name": "now", "input": {}}),
        json_delta(1, ""),
        block_stop(1),
        message_delta("tool_use"),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.text is None
    assert [c.id for c in reply.tool_calls] == ["toolu_a"]


async def test_tool_use_without_arguments_and_parallel_calls():
    chunks = [
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_a", "name": "now", "input": {}}),
        json_delta(0, ""),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "toolu_b", "name": "add", "input": {}}),
        json_delta(1, '{"a": 1,'),
        json_delta(1, ' "b": 2}'),
        block_stop(1),
        message_delta("tool_use"),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.text is None
    assert [(c.id, c.name, dict(c.arguments)) for c in reply.tool_calls] == [
        ("toolu_a", "now", {}),
        ("toolu_b", "add", {"a": 1, "b": 2}),
    ]


async def test_thinking_is_reasoning_kept_apart_from_text():
    deltas = []
    reply, _ = await call(
        CannedResponse(headers=SSE, chunks=thinking_reply()),
        on_delta=lambda channel, text: deltas.append(channel),
    )
    assert reply.reasoning == "Let me solve this: 27 * 453 = 12231."
    assert reply.reasoning_signature == "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"
    assert reply.text == "27 * 453 = 12,231"
    assert deltas == ["reasoning", "reasoning", "text"]


def test_a_signed_thinking_turn_is_sent_back_unchanged_before_its_tool_use():
    """Anthropic refuses a tool-use turn with thinking enabled unless the signed thinking
    block of that turn comes back as it was."""
    from treadle.models.anthropic import AnthropicMessagesClient
    from treadle.parsers import NativeToolCallParser
    from treadle.types import Message, ModelReply, ModelRequest, ToolCall

    reply = ModelReply(
        reasoning="I should look it up.",
        reasoning_signature="sig-123",
        tool_calls=(ToolCall(id="toolu_1", name="lookup", arguments={"q": "x"}),),
        finish_reason="tool_calls",
    )
    history = NativeToolCallParser().parse(reply, ()).history_message
    assert history.reasoning_signature == "sig-123"
    request = ModelRequest(
        messages=(
            Message(role="user", content="find x"),
            history,
            Message(role="tool", content="found", tool_call_id="toolu_1", name="lookup"),
        ),
        model="claude",
        max_output_tokens=1000,
    )
    body = AnthropicMessagesClient(base_url="http://127.0.0.1:1", api_key="k").request_body(request)
    assistant = body["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["content"][0] == {
        "type": "thinking",
        "thinking": "I should look it up.",
        "signature": "sig-123",
    }
    assert assistant["content"][1]["type"] == "tool_use"


async def test_max_tokens_in_the_middle_of_a_tool_call_is_an_invalid_call():
    chunks = [
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_c", "name": "write", "input": {}}),
        json_delta(0, '{"path": "/tmp/x", "text": "half'),
        block_stop(0),
        message_delta("max_tokens", 100),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.finish_reason == "length"
    assert reply.tool_calls == ()
    [invalid] = reply.invalid_tool_calls
    assert (invalid.id, invalid.name, invalid.reason) == ("toolu_c", "write", "truncated")
    assert invalid.raw_arguments == '{"path": "/tmp/x", "text": "half'


async def test_max_tokens_after_input_that_parses_still_leaves_the_last_call_unexecuted():
    """What arrived of the cut call parsed (``{"path": "/tmp/a"}``), so it was executed: the
    limit may have cut more arguments, or more calls, after it (docs/models.md, "Output
    cap"). A call before it is whole and runs."""
    chunks = [
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {}}),
        json_delta(0, '{"path": "/tmp/b"}'),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "toolu_b", "name": "delete_file", "input": {}}),
        json_delta(1, '{"path": "/tmp/a"}'),
        block_stop(1),
        message_delta("max_tokens", 100),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert [(c.id, c.arguments) for c in reply.tool_calls] == [("toolu_a", {"path": "/tmp/b"})]
    [invalid] = reply.invalid_tool_calls
    assert (invalid.id, invalid.reason, invalid.raw_arguments) == (
        "toolu_b",
        "truncated",
        '{"path": "/tmp/a"}',
    )


async def test_tool_call_cut_before_any_input_is_not_executable():
    chunks = [
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_d", "name": "delete_all", "input": {}}),
        message_delta("max_tokens", 100),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.tool_calls == ()
    assert reply.invalid_tool_calls[0].reason == "truncated"


async def test_unparseable_input_is_kept_raw_and_not_executable():
    chunks = [
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_e", "name": "f", "input": {}}),
        json_delta(0, "[1, 2]"),
        block_stop(0),
        message_delta("tool_use"),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.invalid_tool_calls[0].reason == "unparseable"


async def test_usage_absent_stays_unknown():
    chunks = [
        message_start(None, None),
        block_start(0, {"type": "text", "text": ""}),
        text_delta(0, "x"),
        block_stop(0),
        message_delta("end_turn", None),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.usage.input_tokens is None and reply.usage.output_tokens is None


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [("end_turn", "stop"), ("stop_sequence", "stop"), ("tool_use", "tool_calls"),
     ("max_tokens", "length"), ("refusal", "content_filter"), ("pause_turn", "stop"),
     ("model_context_window_exceeded", "length"), ("something_new", "stop")],
)  # fmt: skip
async def test_stop_reasons_are_mapped(stop_reason, finish):
    chunks = [*text_reply("x")[:-2], message_delta(stop_reason), MESSAGE_STOP]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.finish_reason == finish
    assert reply.provider_finish_reason == stop_reason  # the server's own value is kept


async def test_unknown_events_and_delta_types_are_ignored():
    chunks = text_reply("a")
    chunks.insert(3, b'event: future_event\ndata: {"type": "future_event", "x": 1}\n\n')
    chunks.insert(4, b'event: content_block_delta\ndata: {"type": "content_block_delta", '
                  b'"index": 0, "delta": {"type": "citations_delta", "citation": {}}}\n\n')  # fmt: skip
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.text == "a"


async def test_non_streaming_json_message_is_accepted():
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 5, "output_tokens": 7},
    }
    response = CannedResponse(
        headers={"content-type": "application/json"}, chunks=[json.dumps(message).encode()]
    )
    reply, _ = await call(response)
    assert (reply.text, reply.reasoning, reply.finish_reason) == ("Calling.", "hmm", "tool_calls")
    assert reply.tool_calls == (ToolCall(id="toolu_1", name="f", arguments={"a": 1}),)
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (5, 7)


async def test_client_is_reusable_across_calls():
    responses = canned(
        CannedResponse(headers=SSE, chunks=text_reply("one")),
        CannedResponse(headers=SSE, chunks=text_reply("two")),
    )
    async with open_loopback_server(responses) as server:
        client = AnthropicMessagesClient(base_url=server.base_url, api_key=KEY)
        first = await client.complete(REQUEST)
        second = await client.complete(REQUEST)
        await client.aclose()
    assert (first.text, second.text) == ("one", "two")


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_complete_stream_leaves_its_connection_reusable(provider):
    from treadle.models import OpenAIChatClient

    openai_done = [
        b'data: {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    chunks = text_reply("x") if provider == "anthropic" else openai_done
    peers: list[object] = []

    async def remember_peer(response: httpx.Response) -> None:
        peers.append(response.extensions["network_stream"].get_extra_info("client_addr"))

    async with (
        open_loopback_server(canned(CannedResponse(headers=SSE, chunks=chunks))) as server,
        httpx.AsyncClient(event_hooks={"response": [remember_peer]}) as http,
    ):
        client: ModelClient = (
            AnthropicMessagesClient(base_url=server.base_url, http_client=http)
            if provider == "anthropic"
            else OpenAIChatClient(base_url=server.base_url, http_client=http)
        )
        for _ in range(3):
            assert (await client.complete(REQUEST)).text == "x"
    assert len(peers) == 3
    assert len(set(peers)) == 1  # one TCP connection served all three calls


def test_a_call_outside_a_run_gets_the_standalone_attempt():
    import inspect
    import math

    from treadle.types import Attempt

    standalone = Attempt.STANDALONE
    assert (standalone.connect_s, standalone.first_byte_s, standalone.idle_s) == (math.inf,) * 3
    assert standalone.image_source is None
    assert standalone.report_usage(Usage(input_tokens=1)) is None  # reported to no one
    default = inspect.signature(AnthropicMessagesClient.complete).parameters["attempt"].default
    assert default is standalone


async def test_every_usage_report_goes_to_the_attempt_and_one_that_raises_ends_it():
    from treadle.types import Attempt, ModelErrorInfo

    seen: list[Usage] = []
    response = CannedResponse(headers=SSE, chunks=text_reply("a", "b"))
    async with (
        open_loopback_server(canned(response)) as server,
        AnthropicMessagesClient(base_url=server.base_url, api_key=KEY) as client,
    ):
        reply = await client.complete(REQUEST, attempt=Attempt(report_usage=seen.append))
        assert seen[0].input_tokens is not None  # message_start, before any text
        assert seen[-1] == reply.usage

        cut = ModelCallError(ModelErrorInfo(kind="token_budget"))

        def budget(usage: Usage) -> None:
            raise cut

        with pytest.raises(ModelCallError) as caught:
            await client.complete(REQUEST, attempt=Attempt(report_usage=budget))
        assert caught.value is cut
        with trio.fail_after(10):
            await server.wait_early_disconnect()  # cut at message_start: the stream abandoned


async def test_cache_read_and_write_tokens_through_the_stream():
    chunks = [
        message_start(3, 1, cache_creation_input_tokens=1500, cache_read_input_tokens=20000),
        block_start(0, {"type": "text", "text": ""}),
        text_delta(0, "ok"),
        block_stop(0),
        message_delta("end_turn", 12),
        MESSAGE_STOP,
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.usage == Usage(
        input_tokens=21503,  # the whole prompt: uncached + cache writes + cache reads
        output_tokens=12,
        total_tokens=21515,
        cached_input_tokens=20000,
        cache_creation_input_tokens=1500,
    )
