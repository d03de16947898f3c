"""The request URL keeps base_url's query string; no credential reaches a log or another host."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
from tests.fixtures.canned_replies import ANTHROPIC_REPLY, OPENAI_REPLY

from treadle import ModelCallError
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import Message, ModelRequest

SECRET = "AIzaSyQUERYSECRET123"
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="m")


@pytest.mark.parametrize(
    ("make", "root", "path", "reply"),
    [
        (OpenAIChatClient, "/v1", "/v1/chat/completions", OPENAI_REPLY),
        (AnthropicMessagesClient, "", "/v1/messages", ANTHROPIC_REPLY),
    ],
    ids=["openai", "anthropic"],
)
async def test_the_path_goes_before_the_query_and_no_log_line_holds_its_key(
    caplog, make, root, path, reply
):
    caplog.set_level(logging.DEBUG)
    query = f"api-version=2024-06-01&key={SECRET}"
    async with open_loopback_server(canned(reply)) as server:
        client = make(base_url=f"{server.base_url}{root}?{query}", api_key="sk-header-key")
        try:
            with trio.fail_after(10):
                answer = await client.complete(REQUEST)
        finally:
            await client.aclose()
    assert answer.text == "ok"
    assert server.requests[0].path == f"{path}?{query}"
    http_lines = [r for r in caplog.records if r.name == "httpx"]
    assert any("HTTP Request: POST" in r.getMessage() for r in http_lines)
    assert any("api-version=2024-06-01&key=***" in r.getMessage() for r in http_lines)
    assert SECRET not in caplog.text
    assert all(SECRET not in r.getMessage() for r in caplog.records)
    assert SECRET not in repr(client)


def test_join_url_keeps_the_query_and_does_not_double_slashes():
    from treadle.models._transport import join_url

    assert join_url("https://h/v1?api-version=1", "/chat/completions") == (
        "https://h/v1/chat/completions?api-version=1"
    )
    assert join_url("https://h/v1/", "/chat/completions") == "https://h/v1/chat/completions"
    assert join_url("https://h", "/v1/messages") == "https://h/v1/messages"


async def test_no_log_line_holds_the_password_of_the_base_urls_user_information(caplog):
    # httpx logs the request URL: "POST http://user:PASSWORD@host/..." went out as it was.
    caplog.set_level(logging.DEBUG)
    async with open_loopback_server(canned(OPENAI_REPLY)) as server:
        userinfo = server.base_url.replace("http://", f"http://proxyuser:{SECRET}@")
        client = OpenAIChatClient(base_url=f"{userinfo}/v1")
        try:
            with trio.fail_after(10):
                await client.complete(REQUEST)
        finally:
            await client.aclose()
    assert any("proxyuser:***@" in r.getMessage() for r in caplog.records if r.name == "httpx")
    assert SECRET not in caplog.text


@pytest.mark.parametrize("make", [OpenAIChatClient, AnthropicMessagesClient])
@pytest.mark.parametrize("key", ["sk-key\n", " sk-key", "sk key", "sk-\tkey"])
def test_an_api_key_with_whitespace_is_refused_when_the_client_is_made(make, key):
    # A key read from a file kept its line break: every request failed on the header, and
    # the error quoting the header's bytes (with the line break escaped) carried the key
    # into the run's records, `treadle show` and the logs.
    from treadle import UsageError

    with pytest.raises(UsageError, match="whitespace or a control character") as refused:
        make(base_url="http://127.0.0.1:9/v1", api_key=key)
    assert "sk" not in str(refused.value)


def test_the_key_is_redacted_also_as_a_repr_writes_it():
    key = "sk-SE\\CRET"  # one backslash, which a repr doubles
    client = OpenAIChatClient(base_url="http://127.0.0.1:9/v1", api_key=key)
    text = f"Illegal header value {('Bearer ' + key).encode()!r}"
    assert "CRET" in text and "CRET" not in client._redact(text)


@pytest.mark.parametrize(
    "name",
    [
        "subscription-key",
        "x-goog-api-key",
        "X-Goog-Signature",
        "X-Goog-Credential",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
        "X-Amz-Credential",
    ],
)
def test_the_credentials_of_signed_urls_and_gateways_are_hidden(name):
    # Azure API Management's subscription key and the signature, credential and session
    # token of AWS and Google Cloud signed URLs stayed in log lines and error messages.
    from treadle._credentials import redact_url_secrets

    url = f"https://h/v1?api-version=1&{name}={SECRET}&x=1"
    assert redact_url_secrets(url) == f"https://h/v1?api-version=1&{name}=***&x=1"


@pytest.mark.parametrize("make", [OpenAIChatClient, AnthropicMessagesClient])
@pytest.mark.parametrize(
    "base_url",
    [
        f"htps://bob:{SECRET}@h/v1?key={SECRET}",  # a mistyped scheme
        f"bob:{SECRET}@h/v1",  # no scheme at all
        f"http://bob:{SECRET}@[::1:1/v1?key={SECRET}",  # an IPv6 address never closed
    ],
)
def test_a_base_url_that_is_refused_is_quoted_without_its_credentials(make, base_url):
    from treadle import UsageError

    with pytest.raises(UsageError, match="base_url") as refused:
        make(base_url=base_url)
    assert SECRET not in str(refused.value) and "bob:***@" in str(refused.value)


@pytest.mark.parametrize(
    ("make", "root", "reply"),
    [
        (OpenAIChatClient, "/v1", OPENAI_REPLY),
        (AnthropicMessagesClient, "", ANTHROPIC_REPLY),
    ],
    ids=["openai", "anthropic"],
)
async def test_a_given_http_client_that_follows_redirects_sends_nothing_to_the_other_host(
    make, root, reply
):
    # The caller's client followed a 307 to another origin, and httpx drops only
    # Authorization on the way: the x-api-key, an extra_headers key and the body went there.
    async with (
        open_loopback_server(canned(reply)) as elsewhere,
        open_loopback_server(
            canned(CannedResponse(status=307, headers={"location": elsewhere.base_url}))
        ) as origin,
        httpx.AsyncClient(follow_redirects=True) as http,
    ):
        client = make(
            base_url=origin.base_url + root,
            api_key="sk-header-key",
            extra_headers={"api-key": SECRET},
            http_client=http,
        )
        with trio.fail_after(10), pytest.raises(ModelCallError) as refused:
            await client.complete(REQUEST)
    assert (refused.value.info.kind, refused.value.info.status) == ("invalid_response", 307)
    assert len(origin.requests) == 1
    assert elsewhere.requests == []
