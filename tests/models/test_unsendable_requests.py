"""Requests no HTTP message can carry, user information beside a key, and the connection pool.

A key or header that no request can carry is refused when the client is made; one that got
past that fails its attempt as a ``bad_request`` that is not retried, never as an interrupt
or a retried ``connection`` error. User information in the base URL would replace the
``Authorization`` header. A client may serve more than 100 concurrent calls.
"""

from __future__ import annotations

import attrs
import httpx
import pytest
import trio
from tests.fixtures.canned_replies import ANTHROPIC_REPLY, OPENAI_DONE, OPENAI_REPLY

import treadle
from treadle import UsageError
from treadle._exceptions import ModelCallError
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.stores.memory import MemoryStore
from treadle.testing.loopback import (
    RecordedRequest,
    ResponseWriter,
    canned,
    open_loopback_server,
)
from treadle.types import Budgets, Message, ModelRequest, ModelResult, StopReason

SECRET = "pw-SECRET-12345"
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="m")
CLIENTS = [OpenAIChatClient, AnthropicMessagesClient]


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("make", CLIENTS)
@pytest.mark.parametrize("key", ["sk-ünicode-SECRET-1", "sk-\u2013dash-SECRET", "sk-\x7fSECRET"])
def test_an_api_key_outside_ascii_is_refused_when_the_client_is_made(make, key):
    # Every call raised a raw UnicodeEncodeError: the run was interrupted, and each resume
    # added another abandoned attempt though nothing was ever sent.
    with pytest.raises(UsageError, match="outside ASCII") as refused:
        make(base_url="http://127.0.0.1:9/v1", api_key=key)
    assert "SECRET" not in str(refused.value)


@pytest.mark.parametrize("make", CLIENTS)
def test_an_empty_api_key_is_refused_when_the_client_is_made(make):
    # OpenAI sent "Authorization: Bearer ", a header h11 refuses: every attempt a
    # retried "connection" error.
    with pytest.raises(UsageError, match="api_key=None"):
        make(base_url="http://127.0.0.1:9/v1", api_key="")


@pytest.mark.parametrize("make", CLIENTS)
@pytest.mark.parametrize(
    "headers",
    [
        {"x-title": "Café app"},
        {"x-title": "a\r\nx-injected: 1"},
        {"x-title": "a\nb"},
        {"x-title": "a\x00b"},
        {"x-title": " padded"},
        {"x-api-token": "SECRET-\u00e9"},
        {"x title": "ok"},
        {"x-tïtle": "ok"},
        {"": "ok"},
    ],
)
def test_an_extra_header_no_request_can_carry_is_refused_when_the_client_is_made(make, headers):
    # A non-ASCII value crashed every call (UnicodeEncodeError); one with a line break failed
    # every attempt as a retryable "connection" error (h11: "Illegal header value").
    with pytest.raises(UsageError, match="header") as refused:
        make(base_url="http://127.0.0.1:9/v1", extra_headers=headers)
    assert "SECRET" not in str(refused.value)


def test_an_anthropic_version_with_a_line_break_is_refused():
    with pytest.raises(UsageError, match="anthropic-version"):
        AnthropicMessagesClient(base_url="http://127.0.0.1:9", anthropic_version="2023-06-01\n")


@pytest.mark.parametrize("make", CLIENTS)
@pytest.mark.parametrize(
    ("base_url", "reason"),
    [
        (f"http://bob:{SECRET}@127.0.0.1:99999/v1", "Port out of range"),
        (f"http://bob:{SECRET}@127.0.0.1:80a/v1", "Port"),
        (f"http://bob:{SECRET}@exa mple.com/v1", "host holds whitespace"),
        ("http://exa\tmple.com/v1", "control character"),
        ("http:///v1", "no host"),
    ],
)
def test_a_base_url_no_request_can_go_to_is_refused_when_the_client_is_made(make, base_url, reason):
    # A port out of range and a space in the host went out as retryable "connection"
    # errors (connect failed, name not known), attempt after attempt.
    with pytest.raises(UsageError, match=reason) as refused:
        make(base_url=base_url)
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize("make", CLIENTS)
def test_headers_an_http_request_can_carry_are_accepted(make):
    client = make(
        base_url="http://127.0.0.1:9/v1",
        api_key="sk-abc_DEF.123~x",
        extra_headers={"X-Title": "My app (v1.2); tabs\tand spaces ok", "x-empty": ""},
    )
    assert client._headers["X-Title"].startswith("My app")


# --------------------------------------------------------------------------- a request that got past


def _unsendable(client, headers):
    # A header the constructor refuses, put there afterwards: what the defence must catch.
    client._headers = {**client._headers, **headers}
    return client


@pytest.mark.parametrize("make", CLIENTS)
@pytest.mark.parametrize("headers", [{"x-title": "Café app"}, {"x-title": "a\r\nx-injected: 1"}])
async def test_a_request_that_cannot_be_sent_is_a_bad_request_not_retried(make, headers):
    # Before: a raw UnicodeEncodeError (the run interrupted) or a retryable "connection" error.
    async with open_loopback_server(canned(OPENAI_REPLY)) as server:
        client = _unsendable(make(base_url=server.base_url, api_key="sk-SECRET-key"), headers)
        async with client:
            with trio.fail_after(10), pytest.raises(ModelCallError) as failed:
                await client.complete(REQUEST)
    assert (failed.value.info.kind, failed.value.info.retryable) == ("bad_request", False)
    assert "sk-SECRET-key" not in failed.value.info.message
    assert server.requests == []


async def test_a_run_whose_request_cannot_be_sent_fails_once_and_is_not_interrupted():
    store = MemoryStore()
    async with open_loopback_server(canned(OPENAI_REPLY)) as server:
        client = OpenAIChatClient(base_url=server.base_url, api_key="sk-key-1234")
        async with _unsendable(client, {"x-title": "Café app"}):
            agent = treadle.Agent(
                model=client,
                executor=treadle.Toolbox([]),
                parser=treadle.NativeToolCallParser(),
                model_name="m",
                budgets=Budgets(max_steps=3),
            )
            with trio.fail_after(10):
                result = await treadle.run(agent, "hello", store=store, run_id="r")
    assert (result.stop_reason, result.error) == (StopReason.MODEL_ERROR, "bad_request")
    attempts = [r for r in (await store.read_log("r")).records if isinstance(r, ModelResult)]
    assert len(attempts) == 1
    assert server.requests == []


# --------------------------------------------------------------------------- user information


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [
        (OpenAIChatClient, {"api_key": "sk-THE-API-KEY"}),
        (OpenAIChatClient, {"extra_headers": {"Authorization": "Bearer gw-token-1"}}),
        (AnthropicMessagesClient, {"extra_headers": {"authorization": "Bearer gw-token-1"}}),
    ],
    ids=["openai key", "openai header", "anthropic header"],
)
@pytest.mark.parametrize("userinfo", [f"alice:{SECRET}@", "alice@"])
def test_user_information_beside_an_authorization_header_is_refused(make, kwargs, userinfo):
    # httpx sent the URL's user:password as "Authorization: Basic", in place of the
    # key's "Bearer": the key was silently never sent.
    with pytest.raises(UsageError, match="user information") as refused:
        make(base_url=f"http://{userinfo}127.0.0.1:9/v1", **kwargs)
    assert SECRET not in str(refused.value)
    assert "sk-THE-API-KEY" not in str(refused.value)


async def test_user_information_beside_a_given_clients_authorization_is_refused():
    async with httpx.AsyncClient(headers={"Authorization": "Bearer gw-token-1"}) as given:
        with pytest.raises(UsageError, match="user information"):
            OpenAIChatClient(base_url=f"http://alice:{SECRET}@127.0.0.1:9/v1", http_client=given)


async def test_anthropic_sends_its_key_beside_the_user_information():
    # x-api-key is no Authorization header: httpx's Basic auth does not replace it.
    async with open_loopback_server(canned(ANTHROPIC_REPLY)) as server:
        base_url = server.base_url.replace("http://", f"http://alice:{SECRET}@")
        async with AnthropicMessagesClient(base_url=base_url, api_key="sk-ant-key") as client:
            with trio.fail_after(10):
                reply = await client.complete(REQUEST)
    assert reply.text == "ok"
    sent = server.requests[0]
    assert sent.header("x-api-key") == "sk-ant-key"
    assert (sent.header("authorization") or "").startswith("Basic ")


# --------------------------------------------------------------------------- the connection pool


CONCURRENT_CALLS = 110


async def test_one_client_serves_more_than_a_hundred_concurrent_calls():
    # httpx's default pool of 100 connections made the 101st call wait, then fail as a
    # retryable "connect" timeout (PoolTimeout) though no connection was attempted. The
    # server holds every response until all the calls have arrived.
    arrived = failed = 0
    settled = trio.Event()  # every call arrived at the server or failed

    def count(*, arrival: int = 0, failure: int = 0) -> None:
        nonlocal arrived, failed
        arrived, failed = arrived + arrival, failed + failure
        if arrived + failed == CONCURRENT_CALLS:
            settled.set()

    async def hold_until_settled(request: RecordedRequest, writer: ResponseWriter) -> None:
        count(arrival=1)
        await writer.start(200, {"content-type": "text/event-stream"})
        await settled.wait()
        await writer.write(OPENAI_DONE)
        await writer.end()

    outcomes: list[str] = []

    async def call(client: OpenAIChatClient) -> None:
        try:
            outcomes.append((await client.complete(REQUEST)).text or "")
        except ModelCallError as exc:
            outcomes.append(f"{exc.info.kind}: {exc.info.message}")
            count(failure=1)

    async with open_loopback_server(stream_handler=hold_until_settled) as server:
        client = OpenAIChatClient(base_url=server.base_url, connect_timeout_s=2)
        with trio.fail_after(30):
            async with client, trio.open_nursery() as nursery:
                for _ in range(CONCURRENT_CALLS):
                    nursery.start_soon(call, client)
    assert outcomes == ["ok"] * CONCURRENT_CALLS


async def test_a_given_clients_pool_limit_is_kept_and_waiting_for_it_is_no_connect_timeout():
    # A given client keeps its own limits: the second call waits for the one connection.
    # That wait counted as the connect timeout (a retryable "connect: PoolTimeout") though
    # no connection was attempted; it now counts in the first-byte deadline.
    connect_s = 0.2
    reply = attrs.evolve(OPENAI_REPLY, delay_s=connect_s * 5)
    limits = httpx.Limits(max_connections=1)
    replies: list[str | None] = []
    async with (
        open_loopback_server(canned(reply)) as server,
        httpx.AsyncClient(limits=limits) as given,
    ):
        client = OpenAIChatClient(
            base_url=server.base_url, http_client=given, connect_timeout_s=connect_s
        )

        async def call() -> None:
            replies.append((await client.complete(REQUEST)).text)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                nursery.start_soon(call)
    assert replies == ["ok", "ok"]
    assert len(server.requests) == 2
