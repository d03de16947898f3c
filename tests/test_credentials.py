"""API keys never appear in anything a run writes (docs/models.md, "Credentials").

Each real client runs a whole run against a loopback server that echoes the key back in its
error bodies. Then everything the run produced is scanned for the key: the SQLite database
files, every record as read back and as encoded, every event (deltas included), the message
and traceback of a failing call, and all log output.
"""

from __future__ import annotations

import base64
import json
import logging
import traceback

import pytest
import trio

import treadle
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.stores import record_to_json
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import Message, ModelRequest

KEY = "sk-test-SECRET-5f3c9a1d7e"
JSON = {"content-type": "application/json"}
SSE = {"content-type": "text/event-stream"}


@treadle.tool
async def lookup(term: str) -> str:
    """Look a term up."""
    return f"{term}: found"


# --------------------------------------------------------------------------- two providers


def openai_sse(*payloads) -> bytes:
    return b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in payloads)


def openai_chunk(delta, finish=None) -> dict:
    return {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


OPENAI_SCRIPT = [
    CannedResponse(
        status=500,
        headers=JSON,
        chunks=[json.dumps({"error": {"message": f"internal error for key {KEY}"}}).encode()],
    ),
    CannedResponse(
        headers=SSE,
        chunks=[
            openai_sse(
                openai_chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "lookup", "arguments": '{"term": "x"}'},
                            }
                        ]
                    },
                    "tool_calls",
                )
            ),
            b"data: [DONE]\n\n",
        ],
    ),
    CannedResponse(
        headers=SSE,
        chunks=[
            openai_sse(openai_chunk({"content": "It was "}), openai_chunk({"content": "found."})),
            openai_sse(openai_chunk({}, "stop")),
            b"data: [DONE]\n\n",
        ],
    ),
]
OPENAI_AUTH_FAILURE = CannedResponse(
    status=401,
    headers=JSON,
    chunks=[json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}).encode()],
)


def anthropic_event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


def anthropic_stream(*blocks: dict, stop: str) -> list[bytes]:
    events = [
        {
            "type": "message_start",
            "message": {"id": "msg_1", "usage": {"input_tokens": 10, "output_tokens": 1}},
        }
    ]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            body = {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": "toolu_1", "name": block["name"], "input": {}}
            body = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            {"type": "content_block_start", "index": index, "content_block": start},
            {"type": "content_block_delta", "index": index, "delta": body},
            {"type": "content_block_stop", "index": index},
        ]
    events += [
        {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    ]
    return [anthropic_event(e) for e in events]


ANTHROPIC_SCRIPT = [
    CannedResponse(
        status=529,
        headers={**JSON, "retry-after": "0"},
        chunks=[
            json.dumps(
                {"type": "error", "error": {"type": "overloaded_error", "message": f"{KEY}"}}
            ).encode()
        ],
    ),
    CannedResponse(
        headers=SSE,
        chunks=anthropic_stream(
            {"type": "tool_use", "name": "lookup", "input": {"term": "x"}}, stop="tool_use"
        ),
    ),
    CannedResponse(
        headers=SSE,
        chunks=anthropic_stream({"type": "text", "text": "It was found."}, stop="end_turn"),
    ),
]
ANTHROPIC_AUTH_FAILURE = CannedResponse(
    status=401,
    headers=JSON,
    chunks=[
        json.dumps(
            {"type": "error", "error": {"type": "authentication_error", "message": f"bad {KEY}"}}
        ).encode()
    ],
)


def make_client(provider: str, base_url: str, monkeypatch):
    if provider == "openai":
        return OpenAIChatClient(base_url=base_url + "/v1", api_key=KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)  # the key comes from the environment here
    return AnthropicMessagesClient(base_url=base_url)


SCRIPTS = {
    "openai": (OPENAI_SCRIPT, OPENAI_AUTH_FAILURE),
    "anthropic": (ANTHROPIC_SCRIPT, ANTHROPIC_AUTH_FAILURE),
}


# --------------------------------------------------------------------------- the scan


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_the_key_appears_nowhere_a_run_writes(provider, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)  # every logger, httpx and treadle included
    script, auth_failure = SCRIPTS[provider]
    db = tmp_path / "runs.db"
    texts: list[str] = []
    async with open_loopback_server(canned(*script, auth_failure)) as server:
        client = make_client(provider, server.base_url, monkeypatch)
        agent = treadle.Agent(
            model=client,
            executor=treadle.Toolbox([lookup]),
            parser=treadle.NativeToolCallParser(),
            model_name="m",
            system_prompt="Be brief.",
            limits=treadle.Limits(retry_initial_s=0.01, retry_max_s=0.02),
        )
        async with treadle.open_sqlite_store(db) as store:
            with trio.fail_after(10):
                async with treadle.open_run(agent, "Find x.", store=store, run_id="ok") as handle:
                    async for event in handle.events():
                        texts.append(repr(event))
                    result = await handle.wait()
                failed = await treadle.run(agent, "Again.", store=store, run_id="denied")
            logs = [await store.read_log("ok"), await store.read_log("denied")]
        with pytest.raises(treadle.ModelCallError) as info:  # the failing call itself
            await client.complete(ModelRequest(messages=(Message(role="user", content="x"),)))
        await client.aclose()

    # The runs really happened, with the key sent and echoed back.
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert result.final_answer == "It was found."
    assert (failed.stop_reason, failed.error) == (treadle.StopReason.MODEL_ERROR, "auth")
    assert all(KEY in (r.header("authorization") or r.header("x-api-key") or "")
               for r in server.requests)  # fmt: skip
    assert any(r.status == 401 for r in _model_errors(logs))

    texts += [repr(record) for log in logs for record in log.records]
    texts += [record_to_json(record) for log in logs for record in log.records]
    texts += [repr(result), repr(failed), repr(client), repr(agent), json.dumps(agent.snapshot())]
    err = info.value
    texts += [str(err), repr(err), err.info.message, err.partial_text]
    texts += traceback.format_exception(err)
    texts += [record.getMessage() for record in caplog.records]
    texts.append(caplog.text)
    leaks = [text for text in texts if KEY in text]
    assert leaks == []
    assert "***" in err.info.message  # the echoed key was replaced, not the message dropped
    for path in tmp_path.iterdir():  # the database, its WAL and anything else written
        assert KEY.encode() not in await trio.Path(path).read_bytes(), path.name


def _model_errors(logs):
    for log in logs:
        for record in log.records:
            error = getattr(record, "error", None)
            if isinstance(error, treadle.types.ModelErrorInfo):
                yield error


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
@pytest.mark.parametrize("cut", [3, 7, 8, 20, len(KEY) - 1])
async def test_a_key_cut_short_by_the_message_limit_is_hidden_too(provider, cut, monkeypatch):
    # A server's message is kept to 500 characters: when that cuts inside the echoed key, the
    # start of the key that is left must go as well.
    message = "x" * (500 - cut) + f"{KEY} (rest of the message)"
    if provider == "openai":
        payload = {"error": {"message": message}}
    else:
        payload = {"type": "error", "error": {"type": "authentication_error", "message": message}}
    denied = CannedResponse(status=401, headers=JSON, chunks=[json.dumps(payload).encode()])
    async with open_loopback_server(canned(denied)) as server:
        client = make_client(provider, server.base_url, monkeypatch)
        with pytest.raises(treadle.ModelCallError) as info:
            await client.complete(ModelRequest(messages=(Message(role="user", content="x"),)))
        await client.aclose()
    text = info.value.info.message
    assert KEY[:3] not in text and text.endswith("***")
    assert "x" * 100 in text  # the rest of the message stays


# --------------------------------------------------------------------------- other credentials

SECRET = "cred-SECRET-7d2e9b41c0"


def echo_every_header(request) -> CannedResponse:
    # What some gateways do on a 401: quote the request back, credentials included.
    sent = "; ".join(f"{name}: {value}" for name, value in request.headers)
    payload = {"error": {"type": "authentication_error", "message": f"denied: {sent}"}}
    return CannedResponse(status=401, headers=JSON, chunks=[json.dumps(payload).encode()])


def with_userinfo(base_url: str) -> str:
    return base_url.replace("http://", f"http://gateway-user:{SECRET}@")


CREDENTIALS_SENT = {
    "azure api-key": (OpenAIChatClient, "/v1", {"api-key": SECRET}, None),
    "gateway bearer": (OpenAIChatClient, "/v1", {"Authorization": f"Bearer {SECRET}"}, None),
    "google api key": (AnthropicMessagesClient, "", {"x-goog-api-key": SECRET}, None),
    "openai url password": (OpenAIChatClient, "/v1", None, with_userinfo),
    "anthropic url password": (AnthropicMessagesClient, "", None, with_userinfo),
}


@pytest.mark.parametrize("case", CREDENTIALS_SENT, ids=list(CREDENTIALS_SENT))
async def test_a_credential_header_or_url_password_echoed_back_is_hidden(case):
    # Only the API key was hidden: a credential in extra_headers, or the Basic credentials
    # httpx makes of a base URL's password, reached the run's records when a 401 quoted them.
    make, root, headers, rewrite = CREDENTIALS_SENT[case]
    async with open_loopback_server(echo_every_header) as server:
        base_url = (rewrite or str)(server.base_url) + root
        # The URL's Basic credentials would replace an OpenAI key's Authorization header: that
        # pair is refused (docs/models.md, "What goes on the wire").
        replaced = rewrite is not None and make is OpenAIChatClient
        api_key = None if replaced else "sk-the-key"
        client = make(base_url=base_url, api_key=api_key, extra_headers=headers)
        with pytest.raises(treadle.ModelCallError) as info:
            await client.complete(ModelRequest(messages=(Message(role="user", content="x"),)))
        await client.aclose()
    sent = "; ".join(f"{name}: {value}" for name, value in server.requests[0].headers)
    basic = base64.b64encode(f"gateway-user:{SECRET}".encode()).decode()
    assert SECRET in sent or basic in sent  # the credential really went out
    message = info.value.info.message
    assert "denied: " in message and "***" in message
    assert SECRET not in message and basic not in message and "sk-the-key" not in message
    assert "content-type: application/json" in message  # the rest of the message stays


def test_only_headers_that_carry_credentials_are_hidden():
    from treadle._credentials import credentials_sent

    headers = {
        "anthropic-beta": "tools-2024-04-04",
        "OpenAI-Organization": "org-public",
        "Ocp-Apim-Subscription-Key": "apim-secret",
        "Proxy-Authorization": "Basic " + base64.b64encode(b"proxy:pw-proxy").decode(),
        "x-api-key-version": "2",  # too short to hide on its own
    }
    hidden = credentials_sent(None, headers, "https://h/v1?api-version=1&key=q-secret")
    assert "apim-secret" in hidden and "q-secret" in hidden
    assert {"proxy:pw-proxy", "pw-proxy"} <= set(hidden)
    assert "tools-2024-04-04" not in hidden and "org-public" not in hidden and "2" not in hidden
