"""OpenAIChatClient: the request it sends and the reply it assembles."""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
import pytest
import trio

from treadle._exceptions import ModelCallError, UsageError
from treadle.models import OpenAIChatClient
from treadle.ports import ModelClient
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import ImageRef, Message, ModelRequest, ToolCall, ToolSpec, Usage

KEY = "sk-secret-123456"
SSE = {"content-type": "text/event-stream"}
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8


def chunk(delta=None, finish=None, **extra) -> dict:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"id": "chatcmpl-t", "object": "chat.completion.chunk", "choices": [choice], **extra}


def sse(*payloads) -> bytes:
    out = b""
    for payload in payloads:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        out += f"data: {text}\n\n".encode()
    return out


HELLO = [sse(chunk({"content": "Hel"})), sse(chunk({"content": "lo"}, "stop")), sse("[DONE]")]
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="m")


async def call(response: CannedResponse, request=REQUEST, on_delta=None, **client_kwargs):
    """Serve one response and return (reply or ModelCallError, server)."""
    async with open_loopback_server(canned(response)) as server:
        client = OpenAIChatClient(base_url=server.base_url + "/v1", api_key=KEY, **client_kwargs)
        try:
            with trio.fail_after(10):
                outcome = await client.complete(request, on_delta=on_delta)
        except ModelCallError as err:
            outcome = err
        finally:
            await client.aclose()
    return outcome, server


async def fail(response: CannedResponse, **client_kwargs) -> ModelCallError:
    outcome, _ = await call(response, **client_kwargs)
    assert isinstance(outcome, ModelCallError), outcome
    assert KEY not in str(outcome) and KEY not in outcome.info.message
    return outcome


# --------------------------------------------------------------------------- request building


def body_of(request: ModelRequest, **kwargs) -> dict:
    return OpenAIChatClient(base_url="http://127.0.0.1:9/v1", **kwargs).request_body(request)


def test_client_satisfies_the_model_client_port():
    assert isinstance(OpenAIChatClient(base_url="http://x"), ModelClient)


def test_messages_tools_and_stream_settings():
    call_ = ToolCall(id="c1", name="get_weather", arguments={"city": "Oslo"})
    request = ModelRequest(
        messages=(
            Message(role="system", content="be brief"),
            Message(role="user", content="weather?"),
            Message(role="assistant", content=None, tool_calls=(call_,), reasoning="think"),
            Message(role="tool", content="sunny", tool_call_id="c1", name="get_weather"),
        ),
        tools=(
            ToolSpec(name="get_weather", description="Weather.", parameters={"type": "object"}),
        ),
        model="example-model",
    )
    body = body_of(request)
    assert body["model"] == "example-model"
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object"},
                "description": "Weather.",
            },
        }
    ]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "max_tokens" not in body


def test_reasoning_is_sent_back_only_when_asked():
    request = ModelRequest(messages=(Message(role="assistant", content="x", reasoning="r"),))
    assert "reasoning_content" not in body_of(request)["messages"][0]
    assert body_of(request, send_reasoning=True)["messages"][0]["reasoning_content"] == "r"


def test_max_tokens_comes_from_the_request_and_params_cannot_raise_it():
    request = ModelRequest(
        messages=(),
        max_output_tokens=100,
        params={"max_tokens": 9999, "max_completion_tokens": 9999, "temperature": 0.2},
    )
    body = body_of(request)
    assert body["max_tokens"] == 100
    assert "max_completion_tokens" not in body
    assert body["temperature"] == 0.2


def test_params_merge_when_no_cap_is_set_and_field_name_is_configurable():
    request = ModelRequest(messages=(), params={"reasoning_effort": "low", "max_tokens": 5})
    assert body_of(request)["reasoning_effort"] == "low"
    assert body_of(request)["max_tokens"] == 5
    capped = ModelRequest(messages=(), max_output_tokens=7)
    assert body_of(capped, max_tokens_field="max_completion_tokens")["max_completion_tokens"] == 7


@pytest.mark.parametrize("key", ["model", "messages", "tools", "stream", "stream_options"])
def test_params_cannot_replace_structural_keys(key):
    with pytest.raises(UsageError, match=key):
        body_of(ModelRequest(messages=(), params={key: False}))


def test_images_become_content_parts_and_refs_become_data_urls():
    digest = "sha256:" + hashlib.sha256(PNG).hexdigest()
    images = (ImageRef(url="https://example.org/a.png"), ImageRef(url="ref:chart", digest=digest))
    request = ModelRequest(messages=(Message(role="user", content="look", images=images),))
    seen = []
    body = body_of(request, image_source=lambda ref: seen.append(ref.url) or PNG)
    assert seen == ["ref:chart"]
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "https://example.org/a.png"}},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()},
        },
    ]


def _image_request(**ref) -> ModelRequest:
    ref.setdefault("url", "ref:x")
    return ModelRequest(messages=(Message(role="user", images=(ImageRef(**ref),)),))


def _missing(ref):
    raise KeyError(ref.url)


@pytest.mark.parametrize(
    ("request_", "kwargs", "match"),
    [
        (_image_request(), {}, "needs an image_source"),
        (_image_request(), {"image_source": _missing}, "could not be loaded"),
        (_image_request(digest="sha256:00"), {"image_source": lambda r: PNG}, "digest"),
        (_image_request(), {"image_source": lambda r: b"????"}, "media type"),
        (
            ModelRequest(messages=(Message(role="assistant", images=(ImageRef(url="u"),)),)),
            {},
            "only allowed on user",
        ),
        (ModelRequest(messages=(), params={"x": object()}), {}, "cannot be encoded"),
    ],
)
async def test_bad_requests_raise_usage_error_before_sending(request_, kwargs, match):
    outcome = None
    async with open_loopback_server(canned(CannedResponse(headers=SSE, chunks=HELLO))) as server:
        client = OpenAIChatClient(base_url=server.base_url, **kwargs)
        with pytest.raises(UsageError, match=match):
            outcome = await client.complete(request_)
        await client.aclose()
    assert outcome is None
    assert server.requests == []


@pytest.mark.parametrize(
    "kwargs",
    [{"base_url": "ftp://x"}, {"base_url": "http://x", "idle_timeout_s": 0}],
)
def test_bad_configuration_raises_usage_error(kwargs):
    with pytest.raises(UsageError):
        OpenAIChatClient(**kwargs)


async def test_request_goes_out_with_headers_path_and_body():
    client_kwargs = {"extra_headers": {"x-trace": "t1"}}
    outcome, server = await call(CannedResponse(headers=SSE, chunks=HELLO), **client_kwargs)
    assert outcome.text == "Hello"
    (received,) = server.requests
    assert (received.method, received.path) == ("POST", "/v1/chat/completions")
    assert received.header("authorization") == f"Bearer {KEY}"
    assert received.header("accept") == "text/event-stream"
    assert received.header("content-type") == "application/json"
    assert received.header("x-trace") == "t1"
    assert received.json() == body_of(REQUEST)


async def test_no_api_key_means_no_authorization_header():
    async with open_loopback_server(canned(CannedResponse(headers=SSE, chunks=HELLO))) as server:
        client = OpenAIChatClient(base_url=server.base_url)
        await client.complete(REQUEST)
        await client.aclose()
    assert server.requests[0].header("authorization") is None


async def test_deltas_arrive_in_order_and_match_the_reply():
    seen = []
    chunks = [
        sse(chunk({"reasoning": "plan"})),
        sse(chunk({"content": "a"})),
        sse(chunk({"content": "b", "reasoning": None}, "stop")),
        sse("[DONE]"),
    ]
    reply, _ = await call(
        CannedResponse(headers=SSE, chunks=chunks), on_delta=lambda *d: seen.append(d)
    )
    assert seen == [("reasoning", "plan"), ("text", "a"), ("text", "b")]
    assert (reply.text, reply.reasoning, reply.response_id) == ("ab", "plan", "chatcmpl-t")


async def test_only_the_first_choice_is_assembled():
    def choice(index, text):
        return {"index": index, "delta": {"content": text}, "finish_reason": None}

    chunks = [
        sse({"id": "", "choices": [choice(1, "other"), choice(None, "a")]}),
        sse({"id": "", "choices": [choice(0, "b"), choice(1, "x")]}),
        sse(chunk({}, "stop")),
        sse("[DONE]"),
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert (reply.text, reply.response_id) == ("ab", "chatcmpl-t")


async def test_reply_without_done_but_with_finish_reason_is_complete():
    chunks = [sse(chunk({"content": "ok"}, "stop"))]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert (reply.text, reply.finish_reason) == ("ok", "stop")


async def test_non_streaming_json_body_is_accepted():
    body = {
        "id": "chatcmpl-j",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        },
                        {"type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    response = CannedResponse(
        headers={"content-type": "application/json"}, chunks=[json.dumps(body).encode()]
    )
    reply, _ = await call(response)
    assert reply.text is None
    assert [(c.name, dict(c.arguments)) for c in reply.tool_calls] == [("f", {}), ("g", {"x": 1})]
    assert reply.tool_calls[0].id == "a" and reply.tool_calls[1].id
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        3,
        2,
        None,
    )


async def test_unparseable_arguments_are_kept_raw_and_not_executable():
    chunks = [
        sse(
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}
                    ]
                }
            )
        ),
        sse(
            chunk(
                {
                    "tool_calls": [
                        {"index": 1, "id": "d", "function": {"name": "g", "arguments": "{'a': 1}"}}
                    ]
                }
            )
        ),
        sse(chunk({}, "tool_calls")),
        sse("[DONE]"),
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert reply.tool_calls == ()
    assert [(c.id, c.raw_arguments, c.reason) for c in reply.invalid_tool_calls] == [
        ("c", "", "unparseable"),
        ("d", "{'a': 1}", "unparseable"),
    ]


async def test_name_streamed_in_pieces_is_joined():
    chunks = [
        sse(chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "get_"}}]})),
        sse(
            chunk(
                {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": "{}"}}]}
            )
        ),
        sse(chunk({}, "tool_calls")),
        sse("[DONE]"),
    ]
    reply, _ = await call(CannedResponse(headers=SSE, chunks=chunks))
    assert [c.name for c in reply.tool_calls] == ["get_weather"]


async def test_client_is_reusable_across_calls():
    response = CannedResponse(headers=SSE, chunks=HELLO)
    async with open_loopback_server(canned(response)) as server:
        client = OpenAIChatClient(base_url=server.base_url)
        replies = [await client.complete(REQUEST) for _ in range(3)]
        await client.aclose()
    assert [r.text for r in replies] == ["Hello"] * 3
    assert len(server.requests) == 3


async def test_async_with_closes_the_client_it_made():
    """The closing form the README shows: no socket is left open (issue 13 item 6)."""
    async with open_loopback_server(canned(CannedResponse(headers=SSE, chunks=HELLO))) as server:
        async with OpenAIChatClient(base_url=server.base_url) as client:
            await client.complete(REQUEST)
            assert not client._client.is_closed
        assert client._client.is_closed
        given = httpx.AsyncClient()
        async with OpenAIChatClient(base_url=server.base_url, http_client=given):
            pass
        assert not given.is_closed  # a client handed in stays the caller's to close
        await given.aclose()


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (  # OpenAI: cached tokens are part of prompt_tokens
            {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
             "prompt_tokens_details": {"cached_tokens": 1920},
             "completion_tokens_details": {"reasoning_tokens": 64}},
            Usage(input_tokens=2006, output_tokens=300, reasoning_tokens=64, total_tokens=2306,
                  cached_input_tokens=1920),
        ),
        (  # DeepSeek: hit + miss = prompt_tokens
            {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
             "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36},
            Usage(input_tokens=100, output_tokens=5, total_tokens=105, cached_input_tokens=64),
        ),
        (  # hit and miss alone still give the whole prompt
            {"completion_tokens": 5, "prompt_cache_hit_tokens": 64, "prompt_cache_miss_tokens": 36},
            Usage(input_tokens=100, output_tokens=5, cached_input_tokens=64),
        ),
        (  # Moonshot: a top-level cached_tokens
            {"prompt_tokens": 50, "completion_tokens": 2, "cached_tokens": 32},
            Usage(input_tokens=50, output_tokens=2, cached_input_tokens=32),
        ),
        (  # unreported cache counts stay unknown
            {"prompt_tokens": 7, "completion_tokens": 1},
            Usage(input_tokens=7, output_tokens=1),
        ),
    ],
)  # fmt: skip
async def test_usage_with_cached_prompt_tokens_through_the_stream(usage, expected):
    final = {"id": "chatcmpl-t", "choices": [], "usage": usage}
    response = CannedResponse(
        headers=SSE, chunks=[sse(chunk({"content": "ok"}, "stop")), sse(final), sse("[DONE]")]
    )
    reply, _ = await call(response)
    assert reply.usage == expected
