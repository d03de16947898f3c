"""Stream and error shapes as servers really send them, through a real HTTP server.

docs/models.md, "Replies, finish reasons, reasoning" and "Errors and retryability": an error
in a non-standard form is an error of its kind, never an empty success; a stream served under
the wrong content type is read as a stream; finish reasons are mapped onto the standard set
with the server's value kept; a refusal is kept apart from the text; Retry-After dates are
measured against the response's Date, and Google's RetryInfo counts.
"""

from __future__ import annotations

import json

import pytest
import trio
from test_anthropic_events import MESSAGE_STOP, block_start, event, message_delta, message_start
from test_anthropic_events import SSE as ANTHROPIC_SSE

from treadle._exceptions import ModelCallError
from treadle.agent import Agent
from treadle.models import AnthropicMessagesClient, OpenAIChatClient, SSEDecodeError
from treadle.models._sse import MAX_EVENT_BYTES
from treadle.models._transport import MAX_JSON_BODY_BYTES, as_sse
from treadle.parsers import REFUSAL, JsonToolCallParser, NativeToolCallParser
from treadle.supervisors import run
from treadle.testing.loopback import (
    CannedResponse,
    ClientGone,
    RecordedRequest,
    ResponseWriter,
    canned,
    open_loopback_server,
)
from treadle.tools import Toolbox, tool
from treadle.types import DecisionKind, Limits, Message, ModelRequest, StopReason

SSE = {"content-type": "text/event-stream"}
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="m")


def chunk(delta=None, finish=None) -> dict:
    return {"id": "c", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def data(*payloads) -> bytes:
    return b"".join(
        f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads
    )


async def complete(response: CannedResponse, client_type=OpenAIChatClient):
    """The reply (or the ModelCallError) of one call answered with ``response``."""
    async with open_loopback_server(canned(response)) as server:
        base = server.base_url + ("/v1" if client_type is OpenAIChatClient else "")
        async with client_type(base_url=base, api_key="sk-test") as client:
            try:
                with trio.fail_after(10):
                    return await client.complete(REQUEST)
            except ModelCallError as err:
                return err


# --------------------------------------------------------------------------- errors in streams


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        # a top-level error field in a chunk, then [DONE]
        (data({"error": {"message": "Rate limit reached", "type": "rate_limit"}}, "[DONE]"),
         "rate_limited"),
        (data({"error": "upstream model crashed"}, "[DONE]"), "upstream_error"),
        # an `error:` line (not an SSE field), then [DONE]
        (b'error: {"message": "overloaded", "type": "server_error"}\n\n' + data("[DONE]"),
         "server_error"),
        (b"error: internal failure\n\n" + data("[DONE]"), "upstream_error"),
        # nothing at all before [DONE]
        (data("[DONE]"), "incomplete_stream"),
        (data(chunk({"role": "assistant"}), "[DONE]"), "incomplete_stream"),
        # a finish reason that says the generation failed
        (data(chunk({"content": "par"}, "error"), "[DONE]"), "incomplete_stream"),
        (data(chunk({}, "abort"), "[DONE]"), "incomplete_stream"),
    ],
)  # fmt: skip
async def test_an_error_in_the_stream_is_an_error_of_its_kind_never_an_empty_success(body, kind):
    failed = await complete(CannedResponse(headers=SSE, chunks=[body]))
    assert isinstance(failed, ModelCallError), failed
    assert failed.info.kind == kind


async def test_an_anthropic_stream_with_nothing_in_it_is_no_reply():
    failed = await complete(
        CannedResponse(headers=ANTHROPIC_SSE, chunks=[message_start(), MESSAGE_STOP]),
        AnthropicMessagesClient,
    )
    assert isinstance(failed, ModelCallError) and failed.info.kind == "incomplete_stream"


# --------------------------------------------------------------------------- wrong content types


HELLO = data(chunk({"content": "Hel"}), chunk({"content": "lo"}, "stop"), "[DONE]")


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", HELLO),
        ("text/plain; charset=utf-8", HELLO),
        ("application/octet-stream", b": keep-alive\n\n" + HELLO),
        ("", HELLO),
        (
            "application/x-ndjson",
            b"".join(
                json.dumps(c).encode() + b"\n"
                for c in (chunk({"content": "Hel"}), chunk({"content": "lo"}, "stop"))
            ),
        ),
        ("application/jsonl", json.dumps(chunk({"content": "Hello"}, "stop")).encode()),
        # events under a newline-delimited JSON label are still events (each data line was
        # read as a line of JSON and refused)
        ("application/x-ndjson", HELLO),
        ("application/jsonl; charset=utf-8", b": keep-alive\n\n" + HELLO),
    ],
)
async def test_a_stream_under_another_content_type_is_read_as_a_stream(content_type, body):
    headers = {"content-type": content_type} if content_type else {}
    reply = await complete(CannedResponse(headers=headers, chunks=[body[:7], body[7:]]))
    assert not isinstance(reply, ModelCallError), reply
    assert (reply.text, reply.finish_reason) == ("Hello", "stop")


@pytest.mark.parametrize("content_type", ["application/json", "text/plain", ""])
@pytest.mark.parametrize("blank", [b"\n", b"\r\n", b"\xef\xbb\xbf\n\n"])
async def test_a_stream_under_another_content_type_read_after_a_blank_line_is_a_stream(
    content_type, blank
):
    # A keep-alive blank line that arrives in a read of its own (a chunk of its own here)
    # before the first event: the body was judged by that line alone and refused (or read as
    # JSON), while the same bytes in one read were a stream.
    headers = {"content-type": content_type} if content_type else {}
    reply = await complete(CannedResponse(headers=headers, chunks=[blank, HELLO]))
    assert not isinstance(reply, ModelCallError), reply
    assert (reply.text, reply.finish_reason) == ("Hello", "stop")


BOM = b"\xef\xbb\xbf"
NDJSON_HELLO = b"".join(
    json.dumps(c).encode() + b"\n"
    for c in (chunk({"content": "Hel"}), chunk({"content": "lo"}, "stop"))
)
COMPLETION_HELLO = json.dumps(
    {"choices": [{"index": 0, "message": {"content": "Hello"}, "finish_reason": "stop"}]}
).encode()


@pytest.mark.parametrize(
    ("content_type", "body", "text"),
    [
        pytest.param("application/x-ndjson", NDJSON_HELLO, "Hello", id="ndjson"),
        pytest.param("application/x-ndjson", b"\n" + NDJSON_HELLO, "Hello", id="ndjson_blank"),
        pytest.param("application/jsonl", NDJSON_HELLO.rstrip(b"\n"), "Hello", id="jsonl"),
        # its only line, not ended
        pytest.param("application/x-ndjson", NDJSON_HELLO.splitlines()[1], "lo", id="one_line"),
        pytest.param("text/plain", COMPLETION_HELLO, "Hello", id="json_as_text"),
        pytest.param("", b" " + COMPLETION_HELLO, "Hello", id="json_unlabelled"),
    ],
)
@pytest.mark.parametrize("split", [1, 2, 7], ids=lambda n: f"reads_of_{n}")
async def test_a_body_read_after_a_byte_order_mark_is_read_as_without_it(
    content_type, body, text, split
):
    # A byte order mark before newline-delimited JSON went into its first line's JSON, and
    # one before a JSON completion under a label that is not JSON made the body "neither a
    # JSON object nor server-sent events": both were a non-retryable invalid_response,
    # while an event stream or a body labelled JSON was read past it.
    headers = {"content-type": content_type} if content_type else {}
    whole = BOM + body
    reads = [whole[:split], whole[split:]]
    reply = await complete(CannedResponse(headers=headers, chunks=reads))
    assert not isinstance(reply, ModelCallError), reply
    assert (reply.text, reply.finish_reason) == (text, "stop")


async def test_a_newline_delimited_line_after_the_first_keeps_what_it_starts_with():
    lines = [b'{"a": 1}', BOM + b'{"b": 2}']
    events = [event async for event in as_sse(_reads_of(b"\n".join(lines) + b"\n"))]
    assert events == [b'data: {"a": 1}\n\n', b"data: " + BOM + b'{"b": 2}\n\n']


async def _reads_of(body: bytes):
    """``body`` one byte a read."""
    for at in range(len(body)):
        yield body[at : at + 1]


async def test_a_newline_delimited_stream_cut_inside_a_line_is_incomplete_and_retryable():
    # The body breaks off inside its last line: as for a cut event stream, the attempt is a
    # retryable incomplete_stream, not a non-retryable invalid_response for the cut JSON.
    first, second = (json.dumps(chunk({"content": c})).encode() for c in ("Hel", "lo"))
    body = first + b"\n" + second[:25]
    failed = await complete(
        CannedResponse(headers={"content-type": "application/x-ndjson"}, chunks=[body])
    )
    assert isinstance(failed, ModelCallError), failed
    assert (failed.info.kind, failed.info.retryable) == ("incomplete_stream", True)
    assert failed.partial_text == "Hel"


MIB = 1024 * 1024
ENDLESS_LINE_MIB = 32
"""How many MiB of one line the endless-line server sends at most (twice the bound)."""


async def test_a_newline_delimited_line_that_never_ends_is_refused_past_the_bound():
    # A line of newline-delimited JSON that never ended was kept whole (copied again on
    # every read) and only measured when the body ended: a server that kept sending it
    # filled the memory until the first-byte deadline, a retryable timeout. It is refused,
    # not retryable, as soon as it passes the bound of an event stream's line.
    written: list[int] = []

    async def endless_line(request: RecordedRequest, writer: ResponseWriter) -> None:
        await writer.start(200, {"content-type": "application/x-ndjson"})
        await writer.write(json.dumps(chunk({"content": "Hel"})).encode() + b"\n")
        try:
            await writer.write(b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "')
            for _ in range(ENDLESS_LINE_MIB):
                await writer.write(b"a" * MIB)
                written.append(MIB)
        except ClientGone:
            return
        await writer.end()

    async with (
        open_loopback_server(stream_handler=endless_line) as server,
        OpenAIChatClient(base_url=server.base_url, api_key="sk-test") as client,
    ):
        with pytest.raises(ModelCallError) as failed, trio.fail_after(60):
            await client.complete(REQUEST)
    info = failed.value.info
    assert (info.kind, info.retryable) == ("invalid_response", False), info
    assert f"a line longer than {MAX_EVENT_BYTES} bytes" in info.message
    assert failed.value.partial_text == "Hel"
    assert server.early_disconnects == 1  # refused while the line was still coming
    assert len(written) < ENDLESS_LINE_MIB


async def test_newline_delimited_json_reads_a_line_no_further_than_the_bound():
    # Counted in reads: the reading stops at the first one that takes the line past the
    # bound, and what was read of it is not kept beyond it.
    reads: list[int] = []

    start = b'{"b": "'

    async def pieces():
        yield b'{"a": 1}\n' + start
        for _ in range(2 * MAX_EVENT_BYTES // MIB):
            reads.append(MIB)
            yield b"b" * MIB

    events = as_sse(pieces())
    assert await anext(events) == b'data: {"a": 1}\n\n'
    with pytest.raises(SSEDecodeError, match=f"a line longer than {MAX_EVENT_BYTES} bytes") as err:
        await anext(events)
    assert len(reads) == (MAX_EVENT_BYTES - len(start)) // MIB + 1  # the read past the bound
    assert err.value.offset == len(b'{"a": 1}\n')


@pytest.mark.parametrize("client_type", [OpenAIChatClient, AnthropicMessagesClient])
async def test_a_json_body_past_the_bound_is_refused_as_too_long_not_as_bad_json(client_type):
    # The body was cut at the bound and parsed: "body is not JSON: Unterminated string".
    content = "a" * (MAX_JSON_BODY_BYTES + MIB)
    body = json.dumps({"choices": [{"index": 0, "message": {"content": content}}]}).encode()
    response = CannedResponse(headers={"content-type": "application/json"}, chunks=[body])
    failed = await complete(response, client_type)
    assert isinstance(failed, ModelCallError), failed
    assert (failed.info.kind, failed.info.retryable) == ("invalid_response", False)
    assert failed.info.message.startswith(f"a JSON body longer than {MAX_JSON_BODY_BYTES} bytes")


async def test_a_body_that_is_neither_json_nor_a_stream_is_an_invalid_response():
    failed = await complete(CannedResponse(headers={"content-type": "text/html"}, chunks=[b"<h1>"]))
    assert isinstance(failed, ModelCallError) and failed.info.kind == "invalid_response"


# --------------------------------------------------------------------------- finish reasons


@pytest.mark.parametrize(
    ("sent", "standard"),
    [("stop", "stop"), ("eos", "stop"), ("end_turn", "stop"), ("STOP", "stop"),
     ("MAX_TOKENS", "length"), ("model_length", "length"), ("tool_use", "tool_calls"),
     ("SAFETY", "content_filter"), ("something_new", "stop")],
)  # fmt: skip
async def test_finish_reasons_are_mapped_and_the_servers_value_is_kept(sent, standard):
    body = data(chunk({"content": "x"}, sent), "[DONE]")
    reply = await complete(CannedResponse(headers=SSE, chunks=[body]))
    assert reply.finish_reason == standard
    assert reply.provider_finish_reason == (None if sent == standard else sent)


async def test_a_call_cut_under_a_nonstandard_length_reason_is_truncated():
    cut = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a": '}}
    body = data(chunk({"tool_calls": [cut]}, "MAX_TOKENS"), "[DONE]")
    reply = await complete(CannedResponse(headers=SSE, chunks=[body]))
    assert reply.finish_reason == "length"
    assert [c.reason for c in reply.invalid_tool_calls] == ["truncated"]


async def test_a_cut_call_whose_arguments_parse_is_still_truncated():
    """``finish_reason: length`` after ``{"path": "/tmp/a"}``: the call was executed, where the
    limit may have cut it (docs/models.md, "Output cap"). The call before it is whole."""
    whole = {"index": 0, "id": "c0", "function": {"name": "read", "arguments": '{"p": 1}'}}
    cut = {"index": 1, "id": "c1", "function": {"name": "rm", "arguments": '{"path": "/tmp/a"}'}}
    body = data(chunk({"tool_calls": [whole]}), chunk({"tool_calls": [cut]}, "length"), "[DONE]")
    reply = await complete(CannedResponse(headers=SSE, chunks=[body]))
    assert [c.id for c in reply.tool_calls] == ["c0"]
    assert [(c.id, c.reason) for c in reply.invalid_tool_calls] == [("c1", "truncated")]


# --------------------------------------------------------------------------- refusals


REFUSED = data(
    chunk({"role": "assistant", "content": None, "refusal": ""}),
    chunk({"refusal": "I can't help "}),
    chunk({"refusal": "with that."}, "stop"),
    "[DONE]",
)


async def test_a_refusal_is_kept_apart_from_the_text_and_the_decision_says_so():
    reply = await complete(CannedResponse(headers=SSE, chunks=[REFUSED]))
    assert reply.text is None
    assert reply.refusal == "I can't help with that."
    for parser in (NativeToolCallParser(), JsonToolCallParser()):
        parsed = parser.parse(reply, ())
        assert parsed.kind is DecisionKind.FINAL_ANSWER and parsed.reason == REFUSAL
        assert parsed.text == "I can't help with that."
        assert parsed.history_message.content == "I can't help with that."


async def test_a_refusal_through_a_run_is_recorded_and_shown(tmp_path):
    from click.testing import CliRunner

    from treadle.cli import main
    from treadle.stores.sqlite import open_sqlite_store

    @tool
    async def noop() -> str:
        """Do nothing."""
        return ""

    db = str(tmp_path / "runs.db")
    async with (
        open_loopback_server(canned(CannedResponse(headers=SSE, chunks=[REFUSED]))) as server,
        OpenAIChatClient(base_url=server.base_url + "/v1") as model,
    ):
        agent = Agent(model=model, executor=Toolbox([noop]), parser=NativeToolCallParser())
        async with open_sqlite_store(db) as store:
            result = await run(agent, "do something bad", store=store, run_id="r")
            log = await store.read_log("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "I can't help with that."
    (model_result,) = [r for r in log.records if type(r).__name__ == "ModelResult"]
    assert model_result.reply.refusal == "I can't help with that."
    shown = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["show", "r", "--store", db], env={"COLUMNS": "200"})
    )
    assert "refused: I can't help with that." in shown.output


def anthropic_refusal(text: str | None = None, explanation: str | None = None) -> list[bytes]:
    """A message Anthropic's classifiers stopped: ``stop_reason: "refusal"``, after ``text``."""
    body = [message_start()]
    if text is not None:
        body.append(block_start(0, {"type": "text", "text": text}))
    if explanation is None:
        body.append(message_delta("refusal", output_tokens=5))
    else:
        details = {"type": "refusal", "category": "cyber", "explanation": explanation}
        stop = {"stop_reason": "refusal", "stop_sequence": None, "stop_details": details}
        body.append(event({"type": "message_delta", "delta": stop, "usage": {"output_tokens": 5}}))
    return [*body, MESSAGE_STOP]


STOPPED = [
    (CannedResponse(headers=ANTHROPIC_SSE, chunks=anthropic_refusal()), "refusal"),
    (CannedResponse(headers=ANTHROPIC_SSE, chunks=anthropic_refusal("Sure, step one is")), "refusal"),
    (CannedResponse(headers=SSE, chunks=[data(chunk({"content": ""}), chunk({}, "content_filter"),
                                              "[DONE]")]), "content_filter"),
    (CannedResponse(headers=SSE, chunks=[data(chunk({"content": "Here is how to"}),
                                              chunk({}, "content_filter"), "[DONE]")]),
     "content_filter"),
    (CannedResponse(headers=SSE, chunks=[data(chunk({"content": "Das ist"}, "SAFETY"), "[DONE]")]),
     "SAFETY"),
]  # fmt: skip


@pytest.mark.parametrize(("response", "said"), STOPPED)
async def test_a_reply_the_provider_stopped_is_a_refusal_not_an_answer_or_an_empty_reply(
    response, said
):
    # Anthropic's stop_reason "refusal" and a content_filter finish: the text before the stop
    # is no answer, and an empty one is no empty reply to ask again for (and pay again).
    client_type = OpenAIChatClient if response.headers is SSE else AnthropicMessagesClient
    reply = await complete(response, client_type)
    assert reply.finish_reason == "content_filter"
    for parser in (NativeToolCallParser(), JsonToolCallParser()):
        parsed = parser.parse(reply, ())
        assert (parsed.kind, parsed.reason) == (DecisionKind.FINAL_ANSWER, REFUSAL)
        assert parsed.text == f"No answer: the provider stopped the reply ({said})."
        assert parsed.history_message.content == parsed.text


async def test_an_anthropic_refusal_explanation_is_the_refusal():
    explanation = "This request was declined because it could enable cyber harm."
    response = CannedResponse(
        headers=ANTHROPIC_SSE, chunks=anthropic_refusal("Hello..", explanation=explanation)
    )
    reply = await complete(response, AnthropicMessagesClient)
    assert (reply.text, reply.refusal) == ("Hello..", explanation)
    assert (reply.finish_reason, reply.provider_finish_reason) == ("content_filter", "refusal")
    parsed = NativeToolCallParser().parse(reply, ())
    assert (parsed.kind, parsed.reason, parsed.text) == (
        DecisionKind.FINAL_ANSWER,
        REFUSAL,
        explanation,
    )


async def test_an_anthropic_refusal_through_a_run_is_one_call_and_shown(tmp_path):
    from click.testing import CliRunner

    from treadle.cli import main
    from treadle.stores.sqlite import open_sqlite_store

    db = str(tmp_path / "runs.db")
    refused = CannedResponse(headers=ANTHROPIC_SSE, chunks=anthropic_refusal("Sure, step one is"))
    async with (
        open_loopback_server(canned(refused)) as server,
        AnthropicMessagesClient(base_url=server.base_url, api_key="sk-test") as model,
    ):
        agent = Agent(model=model, executor=Toolbox([]), parser=NativeToolCallParser())
        async with open_sqlite_store(db) as store:
            with trio.fail_after(20):
                result = await run(agent, "do something bad", store=store, run_id="r")
    assert len(server.requests) == 1  # not asked for again as an empty reply
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "No answer: the provider stopped the reply (refusal)."
    shown = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["show", "r", "--store", db], env={"COLUMNS": "200"})
    )
    assert "Sure, step one is · finish content_filter (refusal) [25 in / 5 out tokens]" in (
        shown.output
    )


async def test_a_failed_model_call_shows_its_http_status_once(tmp_path):
    from click.testing import CliRunner

    from treadle.cli import main
    from treadle.stores.sqlite import open_sqlite_store

    db = str(tmp_path / "runs.db")
    boom = json.dumps({"error": {"message": "boom"}}).encode()
    failing = CannedResponse(
        status=500, headers={"content-type": "application/json"}, chunks=[boom]
    )
    async with (
        open_loopback_server(canned(failing)) as server,
        OpenAIChatClient(base_url=server.base_url + "/v1") as model,
    ):
        agent = Agent(
            model=model,
            executor=Toolbox([]),
            parser=NativeToolCallParser(),
            limits=Limits(max_model_retries=0),
        )
        async with open_sqlite_store(db) as store:
            with trio.fail_after(20):
                result = await run(agent, "hi", store=store, run_id="r")
    assert result.stop_reason is StopReason.MODEL_ERROR
    shown = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["show", "r", "--store", db], env={"COLUMNS": "200"})
    )
    assert "failed (model_error): server_error HTTP 500: boom, 1 step" in shown.output


# --------------------------------------------------------------------------- waits


@pytest.mark.parametrize(
    ("headers", "body", "wait"),
    [
        # an HTTP-date, measured against the response's own Date (this machine's clock differs)
        ({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT", "date": "Wed, 21 Oct 2015 07:28:00 GMT"},
         b"{}", 10.0),
        # Google's RetryInfo inside a JSON list body
        ({}, json.dumps([{"error": {"code": 429, "message": "Resource has been exhausted",
                                    "status": "RESOURCE_EXHAUSTED",
                                    "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                                 "retryDelay": "37s"}]}}]).encode(), 37.0),
        # the header wins over the body
        ({"retry-after": "3"}, json.dumps({"error": {"details": [
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}]}}).encode(),
         3.0),
        # a wait that overflows to infinity is unreadable, in the body as in a header
        ({}, json.dumps({"error": {"details": [
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "9" * 400 + "s"}]}}
        ).encode(), None),
        ({"retry-after": "1e400"}, b"{}", None),
    ],
)  # fmt: skip
async def test_rate_limit_waits_are_honoured(headers, body, wait):
    response = CannedResponse(
        status=429, headers={"content-type": "application/json", **headers}, chunks=[body]
    )
    failed = await complete(response)
    assert isinstance(failed, ModelCallError)
    assert (failed.info.kind, failed.info.retry_after_s) == ("rate_limited", wait)
    if body.startswith(b"["):
        assert "Resource has been exhausted" in failed.info.message


# --------------------------------------------------------------------------- usage as written


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        # a whole number written as a float, and one too large for 64 bits (a float once decoded)
        ({"prompt_tokens": 5000.0, "completion_tokens": 3}, (5000, 3)),
        ({"prompt_tokens": 100000000000000000000, "completion_tokens": 3}, (10**20, 3)),
        ({"prompt_tokens": 1e23, "completion_tokens": 3}, (int(1e23), 3)),
        # not a count: unknown, never zero
        ({"prompt_tokens": 2.5, "completion_tokens": "3"}, (None, None)),
        ({"prompt_tokens": -1, "completion_tokens": True}, (None, None)),
    ],
)
async def test_openai_usage_counts_as_servers_write_them(usage, expected):
    body = data(chunk({"content": "hi"}, "stop"), {"id": "c", "choices": [], "usage": usage})
    reply = await complete(CannedResponse(headers=SSE, chunks=[body + data("[DONE]")]))
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == expected


async def test_a_later_openai_usage_report_keeps_the_counts_it_leaves_out():
    body = data(
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 2}},
        chunk({"content": "hi"}, "stop"),
        {"id": "c", "choices": [], "usage": {"completion_tokens": 4}},
        {"id": "c", "choices": [], "usage": {}},
        "[DONE]",
    )
    reply = await complete(CannedResponse(headers=SSE, chunks=[body]))
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (50, 4)


async def test_anthropic_usage_too_large_for_64_bits_still_counts():
    stop = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    body = b"".join(
        [
            message_start(input_tokens=1e23, output_tokens=1.0),
            event(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
            ),
            event(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "hi"},
                }
            ),
            event({"type": "content_block_stop", "index": 0}),
            event({**stop, "usage": {"output_tokens": 7.0}}),
            MESSAGE_STOP,
        ]
    )
    reply = await complete(
        CannedResponse(headers=ANTHROPIC_SSE, chunks=[body]), AnthropicMessagesClient
    )
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (int(1e23), 7)


# --------------------------------------------------------------------------- a stream left open


async def _left_open(body: bytes, client_type):
    """The reply of a server that sends ``body`` and then neither ends the stream nor closes."""
    response = CannedResponse(headers=SSE, chunks=[body, 3600.0])
    async with open_loopback_server(canned(response)) as server:
        base = server.base_url + ("/v1" if client_type is OpenAIChatClient else "")
        async with client_type(base_url=base, api_key="sk-test", idle_timeout_s=0.3) as client:
            try:
                with trio.fail_after(30):
                    return await client.complete(REQUEST)
            except ModelCallError as err:
                return err


async def test_a_whole_openai_reply_whose_stream_stays_open_is_taken_at_the_idle_deadline():
    # The complete reply was thrown away as a timeout, retried, and its tokens paid twice.
    done = {"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    reply = await _left_open(data(chunk({"content": "hi"}, "stop"), done), OpenAIChatClient)
    assert not isinstance(reply, ModelCallError), reply
    assert reply.text == "hi" and reply.usage.output_tokens == 2
    # without the usage chunk, more could still come: a timeout, as before
    cut = await _left_open(data(chunk({"content": "hi"}, "stop")), OpenAIChatClient)
    assert isinstance(cut, ModelCallError) and cut.info.kind == "timeout"


async def test_a_whole_anthropic_reply_whose_stream_stays_open_is_taken_at_the_idle_deadline():
    stop = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
    start = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "hi"},
    }
    blocks = [
        message_start(),
        event(start),
        event(delta),
        event({"type": "content_block_stop", "index": 0}),
    ]
    reply = await _left_open(
        b"".join([*blocks, event({**stop, "usage": {"output_tokens": 3}})]), AnthropicMessagesClient
    )
    assert not isinstance(reply, ModelCallError), reply
    assert reply.text == "hi" and reply.usage.output_tokens == 3
    cut = await _left_open(b"".join(blocks), AnthropicMessagesClient)
    assert isinstance(cut, ModelCallError) and cut.info.kind == "timeout"
