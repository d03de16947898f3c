"""Tool-call arguments and calls as providers really send them, end to end through the stream.

Each case is served by a loopback HTTP server on 127.0.0.1, read by the real client
(`OpenAIChatClient`, or `AnthropicMessagesClient` where the case exists there), and the
assembled `ModelReply` is parsed by `NativeToolCallParser`. A reply that can be repaired
without guessing becomes actions with the repair named; one that cannot becomes an invalid
decision with feedback; never a final answer, never a dropped call. Whole runs check that
the repairs are recorded in the step record and shown by ``treadle show``, and that ids made
unique survive a crash and resume.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from click.testing import CliRunner
from test_anthropic_events import (
    MESSAGE_STOP,
    block_start,
    block_stop,
    json_delta,
    message_delta,
    message_start,
    text_delta,
)
from test_anthropic_events import SSE as ANTHROPIC_SSE

import treadle
from treadle.cli import main
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.parsers import JsonToolCallParser, NativeToolCallParser
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import (
    ActionResult,
    DecisionKind,
    Message,
    ModelReply,
    ModelRequest,
    ModelResult,
    ParsedReply,
    StepRecord,
    StoreOp,
)

SSE = {"content-type": "text/event-stream"}
CALLS: list[tuple[str, Any]] = []


@treadle.tool
async def list_airports() -> str:
    """Every airport served."""
    CALLS.append(("list_airports", None))
    return "SFO, JFK"


@treadle.tool
async def get_weather(city: str) -> str:
    """The weather in a city."""
    CALLS.append(("get_weather", city))
    return f"{city}: 18 C"


TOOLBOX = treadle.Toolbox([list_airports, get_weather])
SPECS = TOOLBOX.tool_specs()


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "choices": [choice]}


def sse(*chunks: dict[str, Any]) -> list[bytes]:
    """Each chunk a separate write, then ``[DONE]``."""
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


def call_stream(
    name: str, fragments: list[Any] | None, *, call_id: str = "call_1", index: int = 0
) -> list[dict[str, Any]]:
    """One native call: id and name first, then each arguments fragment as given.

    ``fragments=None`` sends no ``arguments`` key at all; a fragment may be ``None`` (JSON
    ``null``, as some providers send).
    """
    first: dict[str, Any] = {"index": index, "id": call_id, "type": "function"}
    first["function"] = {"name": name}
    chunks = [chunk({"role": "assistant", "content": None, "tool_calls": [first]})]
    for fragment in fragments or []:
        chunks.append(
            chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
        )
    return chunks


def text_stream(*fragments: str, finish: str = "stop") -> list[bytes]:
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": f}) for f in fragments]
    return sse(*chunks, chunk(finish=finish))


REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="m")


async def openai_reply(chunks: list[bytes]) -> ModelReply:
    response = CannedResponse(headers=SSE, chunks=chunks, pause_s=0.001)
    async with (
        open_loopback_server(canned(response)) as server,
        OpenAIChatClient(base_url=server.base_url) as client,
    ):
        with trio.fail_after(10):
            return await client.complete(REQUEST)


async def through_openai(chunks: list[bytes], parser: Any = None) -> ParsedReply:
    reply = await openai_reply(chunks)
    return (parser or NativeToolCallParser()).parse(reply, SPECS)


def assert_actions(parsed: ParsedReply, calls: list[tuple[str, dict[str, Any]]]) -> None:
    assert parsed.kind is DecisionKind.ACTIONS, parsed.feedback
    assert [(a.name, dict(a.arguments)) for a in parsed.actions] == calls
    # every call can be answered in history, and the history holds no raw argument text
    assert [c.id for c in parsed.history_message.tool_calls] == [a.id for a in parsed.actions]
    assert all(a.id for a in parsed.actions)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("fragments", "repair"),
    [
        ([""], "empty_arguments_as_empty_object"),
        (None, "empty_arguments_as_empty_object"),  # no arguments key at all
        ([None], "empty_arguments_as_empty_object"),  # "arguments": null in the delta
        (["null"], "null_arguments_as_empty_object"),  # the text "null"
        (["nu", "ll"], "null_arguments_as_empty_object"),
        ([" "], "empty_arguments_as_empty_object"),
    ],
)
async def test_empty_or_null_arguments_of_a_tool_without_parameters(fragments, repair):
    chunks = sse(*call_stream("list_airports", fragments), chunk(finish="tool_calls"))
    parsed = await through_openai(chunks)
    assert_actions(parsed, [("list_airports", {})])
    assert parsed.repairs == (repair,)
    assert parsed.actions[0].id == "call_1"


async def test_null_arguments_of_a_tool_with_parameters_are_not_guessed():
    chunks = sse(*call_stream("get_weather", ["null"]), chunk(finish="tool_calls"))
    parsed = await through_openai(chunks)
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "arguments_not_object"
    assert "call_1" in (parsed.feedback or "")


async def test_one_object_followed_by_prose_keeps_the_object():
    fragments = ['{"city": "Pa', 'ris"}', " I will check the weather there now."]
    chunks = sse(*call_stream("get_weather", fragments), chunk(finish="tool_calls"))
    parsed = await through_openai(chunks)
    assert_actions(parsed, [("get_weather", {"city": "Paris"})])
    assert parsed.repairs == ("dropped_text_after_arguments",)


@pytest.mark.parametrize(
    "raw",
    [
        '{"city": "Paris"} {"city": "Rome"}',  # two objects: never guessed apart
        '{"city": "Paris"} and then {"city": "Ro',
        '{"city": "Paris"}]',
    ],
)
async def test_object_followed_by_json_like_text_is_invalid(raw):
    chunks = sse(*call_stream("get_weather", [raw]), chunk(finish="tool_calls"))
    parsed = await through_openai(chunks)
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.actions == ()
    assert parsed.feedback and "call_1" in parsed.feedback
    assert [c.id for c in parsed.history_message.tool_calls] == ["call_1"]


async def test_object_encoded_twice_is_decoded_once_more():
    twice = json.dumps(json.dumps({"city": "Paris"}))
    chunks = sse(*call_stream("get_weather", [twice[:7], twice[7:]]), chunk(finish="tool_calls"))
    parsed = await through_openai(chunks)
    assert_actions(parsed, [("get_weather", {"city": "Paris"})])
    assert parsed.repairs == ("decoded_json_string",)


async def test_legacy_function_call_delta_and_finish_reason():
    chunks = sse(
        chunk({"role": "assistant", "content": None, "function_call": {"name": "get_weather"}}),
        chunk({"function_call": {"arguments": '{"city": '}}),
        chunk({"function_call": {"arguments": '"Oslo"}'}}),
        chunk(finish="function_call"),
    )
    reply = await openai_reply(chunks)
    assert reply.finish_reason == "tool_calls"
    parsed = NativeToolCallParser().parse(reply, SPECS)
    assert_actions(parsed, [("get_weather", {"city": "Oslo"})])
    first = parsed.actions[0].id
    assert first.startswith("call_")
    again = NativeToolCallParser().parse(await openai_reply(chunks), SPECS)
    assert again.actions[0].id == first  # synthesised deterministically


async def test_legacy_function_call_with_empty_arguments():
    chunks = sse(
        chunk({"role": "assistant", "function_call": {"name": "list_airports", "arguments": ""}}),
        chunk(finish="function_call"),
    )
    parsed = await through_openai(chunks)
    assert_actions(parsed, [("list_airports", {})])


async def test_two_calls_sharing_an_id_get_unique_ids():
    chunks = sse(
        *call_stream("get_weather", ['{"city": "Paris"}'], call_id="call_same", index=0),
        *call_stream("get_weather", ['{"city": "Rome"}'], call_id="call_same", index=1),
        chunk(finish="tool_calls"),
    )
    parsed = await through_openai(chunks)
    assert_actions(parsed, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])
    first, second = (a.id for a in parsed.actions)
    assert first == "call_same" and second != first
    assert "synthesised_call_id" in parsed.repairs


# --------------------------------------------------------------------------- markup in text

MARKUP_CASES = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me look.",
        [("get_weather", {"city": "Paris"})],
    ),
    "hermes-two-blocks": (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "list_airports", "arguments": {}}</tool_call>\nOne moment.',
        "One moment.",
        [("get_weather", {"city": "Paris"}), ("list_airports", {})],
    ),
    "hermes-string-arguments": (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "pipe-tool-call": (
        'Checking <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Lima"}}]'
        "<|/tool_call|>",
        "Checking",
        [("get_weather", {"city": "Lima"})],
    ),
    "function-tag": (
        'Sure. <function=get_weather>{"city": "Rome"}</function>',
        "Sure.",
        [("get_weather", {"city": "Rome"})],
    ),
    "mistral-list": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}]',
        None,
        [("get_weather", {"city": "Nice"})],
    ),
    "mistral-args": (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]list_airports[ARGS]{}',
        None,
        [("get_weather", {"city": "Nice"}), ("list_airports", {})],
    ),
    "python-tag": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Bern"}}<|eom_id|>',
        None,
        [("get_weather", {"city": "Bern"})],
    ),
}


@pytest.mark.parametrize("name", sorted(MARKUP_CASES))
async def test_tool_call_markup_in_text_becomes_calls(name):
    text, outside, calls = MARKUP_CASES[name]
    cut = len(text) // 2
    parsed = await through_openai(text_stream(text[:cut], text[cut:]))
    assert_actions(parsed, calls)
    assert parsed.text == outside
    assert parsed.history_message.content == outside  # the markup is not replayed as text
    assert parsed.repairs[0] == "tool_call_markup_in_text"
    assert len({a.id for a in parsed.actions}) == len(calls)


@pytest.mark.parametrize("name", sorted(MARKUP_CASES))
async def test_tool_call_markup_with_the_json_parser(name):
    text, outside, calls = MARKUP_CASES[name]
    parsed = await through_openai(text_stream(text), JsonToolCallParser())
    assert parsed.kind is DecisionKind.ACTIONS
    assert [(a.name, dict(a.arguments)) for a in parsed.actions] == calls
    assert parsed.text == outside


@pytest.mark.parametrize(
    ("text", "finish", "reason"),
    [
        ('Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa', "length",
         "truncated"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "stop",
         "invalid_tool_call_markup"),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>', "stop",
         "invalid_tool_call_markup"),
        ('<tool_call>{"name": "book_flight", "arguments": {}}</tool_call>', "stop",
         "invalid_tool_call_markup"),
        ('<function=get_weather>{"city": "Rome"}', "stop", "invalid_tool_call_markup"),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Ni', "length",
         "truncated"),
        ("Done. </tool_call>", "stop", "invalid_tool_call_markup"),
    ],
)  # fmt: skip
async def test_unclosed_or_invalid_markup_is_an_invalid_decision(text, finish, reason):
    for parser in (NativeToolCallParser(), JsonToolCallParser()):
        parsed = await through_openai(text_stream(text, finish=finish), parser)
        assert parsed.kind is DecisionKind.INVALID, parsed
        assert parsed.reason == reason
        assert parsed.actions == ()
        assert parsed.feedback and "No tool was called" in parsed.feedback


async def test_text_without_markup_stays_a_final_answer():
    parsed = await through_openai(text_stream("Use <b>bold</b> for tool names."))
    assert parsed.kind is DecisionKind.FINAL_ANSWER


# --------------------------------------------------------------------------- Anthropic


def anthropic_text(text: str, stop: str = "end_turn") -> list[bytes]:
    return [
        message_start(),
        block_start(0, {"type": "text", "text": ""}),
        text_delta(0, text),
        block_stop(0),
        message_delta(stop),
        MESSAGE_STOP,
    ]


def anthropic_tool(name: str, partials: list[str]) -> list[bytes]:
    return [
        message_start(),
        block_start(0, {"type": "tool_use", "id": "toolu_1", "name": name, "input": {}}),
        *(json_delta(0, p) for p in partials),
        block_stop(0),
        message_delta("tool_use"),
        MESSAGE_STOP,
    ]


async def through_anthropic(chunks: list[bytes]) -> ParsedReply:
    response = CannedResponse(headers=ANTHROPIC_SSE, chunks=chunks, pause_s=0.001)
    async with (
        open_loopback_server(canned(response)) as server,
        AnthropicMessagesClient(base_url=server.base_url, api_key="k") as client,
    ):
        with trio.fail_after(10):
            reply = await client.complete(REQUEST)
    return NativeToolCallParser().parse(reply, SPECS)


@pytest.mark.parametrize("partials", [[], [""]])
async def test_anthropic_tool_without_parameters(partials):
    parsed = await through_anthropic(anthropic_tool("list_airports", partials))
    assert_actions(parsed, [("list_airports", {})])
    assert parsed.actions[0].id == "toolu_1"


async def test_anthropic_object_followed_by_prose():
    parsed = await through_anthropic(anthropic_tool("get_weather", ['{"city": "Oslo"}', " ok"]))
    assert_actions(parsed, [("get_weather", {"city": "Oslo"})])
    assert parsed.repairs == ("dropped_text_after_arguments",)


@pytest.mark.parametrize("name", ["hermes", "function-tag", "mistral-args"])
async def test_anthropic_markup_in_text(name):
    text, outside, calls = MARKUP_CASES[name]
    parsed = await through_anthropic(anthropic_text(text))
    assert_actions(parsed, calls)
    assert parsed.text == outside


async def test_anthropic_unclosed_markup_cut_by_max_tokens():
    text = '<tool_call>{"name": "get_weather", "arguments": {"ci'
    parsed = await through_anthropic(anthropic_text(text, "max_tokens"))
    assert parsed.kind is DecisionKind.INVALID
    assert parsed.reason == "truncated"


# --------------------------------------------------------------------------- whole runs


def agent_for(client: OpenAIChatClient) -> treadle.Agent:
    return treadle.Agent(
        model=client,
        executor=TOOLBOX,
        parser=NativeToolCallParser(),
        model_name="m",
    )


def answer(text: str) -> CannedResponse:
    return CannedResponse(headers=SSE, chunks=text_stream(text))


async def test_repairs_are_recorded_and_shown(tmp_path):
    CALLS.clear()
    db = tmp_path / "runs.db"
    markup = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    responses = [
        CannedResponse(
            headers=SSE,
            chunks=sse(*call_stream("list_airports", ["null"]), chunk(finish="tool_calls")),
        ),
        CannedResponse(headers=SSE, chunks=text_stream(markup)),
        answer("SFO and JFK; Oslo is at 18 C."),
    ]
    async with (
        open_loopback_server(canned(*responses)) as server,
        OpenAIChatClient(base_url=server.base_url) as client,
        treadle.open_sqlite_store(db) as store,
    ):
        with trio.fail_after(20):
            result = await treadle.run(agent_for(client), "hi", store=store, run_id="r")
        log = await store.read_log("r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert CALLS == [("list_airports", None), ("get_weather", "Oslo")]
    steps = [r for r in log.records if isinstance(r, StepRecord)]
    assert [s.repairs for s in steps] == [
        ("null_arguments_as_empty_object",),
        ("tool_call_markup_in_text",),
        (),
    ]
    # the markup call went back to the model as a native call, answered by a tool message
    third = server.requests[2].json()["messages"]
    assert third[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert third[-2]["content"] is None
    assert third[-1]["role"] == "tool"
    shown = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["show", "r", "--store", str(db)], env={"COLUMNS": "250"})
    )
    assert shown.exit_code == 0, shown.output
    assert "repaired: null_arguments_as_empty_object" in shown.output
    assert "repaired: tool_call_markup_in_text" in shown.output


class CrashAfterModelReply(CrashingStore):
    """Dies right after the first write that stores a model reply."""

    async def before_write(self, op: StoreOp, records: tuple, seq: int) -> bool:
        if self.crashed:
            raise SimulatedCrash("the process is dead")
        self.writes += 1
        if any(isinstance(r, ModelResult) and r.reply is not None for r in records):
            self.crashed = True
            return True
        return False


async def test_shared_ids_stay_unique_and_equal_across_a_resume(tmp_path):
    CALLS.clear()
    db = tmp_path / "runs.db"
    shared = sse(
        *call_stream("get_weather", ['{"city": "Paris"}'], call_id="call_dup", index=0),
        *call_stream("get_weather", ['{"city": "Rome"}'], call_id="call_dup", index=1),
        chunk(finish="tool_calls"),
    )
    responses = [CannedResponse(headers=SSE, chunks=shared), answer("Both 18 C.")]
    async with (
        open_loopback_server(canned(*responses)) as server,
        OpenAIChatClient(base_url=server.base_url) as client,
    ):
        async with treadle.open_sqlite_store(db) as store:
            crashing = CrashAfterModelReply(inner=store, crash_at=1, when="after")  # its own rule
            with pytest.raises((treadle.RunInterrupted, SimulatedCrash)), trio.fail_after(20):
                await treadle.run(agent_for(client), "hi", store=crashing, run_id="r")
        assert CALLS == []  # died before any action
        async with treadle.open_sqlite_store(db) as store:
            with trio.fail_after(20):
                result = await treadle.run(agent_for(client), store=store, run_id="r")
            log = await store.read_log("r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert len(server.requests) == 2  # the stored reply was not asked for again
    assert sorted(CALLS) == [("get_weather", "Paris"), ("get_weather", "Rome")]
    executed = sorted(r.call_id for r in log.records if isinstance(r, ActionResult))
    [step] = [r for r in log.records if isinstance(r, StepRecord) and r.action_result_ids]
    history = [c.id for c in step.history_message.tool_calls]
    assert executed == sorted(history)
    assert len(set(history)) == 2 and history[0] == "call_dup"
    # what went back to the model: each call answered once, by its own id
    sent = server.requests[1].json()["messages"]
    assert [c["id"] for c in sent[-3]["tool_calls"]] == history
    assert [m["tool_call_id"] for m in sent[-2:]] == history
    # the parser gives the same ids for the stored reply (what a later resume re-derives)
    [stored] = [r for r in log.records if isinstance(r, ModelResult) and r.reply is not None][:1]
    again = NativeToolCallParser().parse(stored.reply, SPECS)
    assert [a.id for a in again.actions] == history


async def test_a_negative_tool_call_index_is_never_the_legacy_calls():
    # The legacy call is kept at index -1: a tool call sent at index -1 was merged into it,
    # one invalid call with two JSON values for arguments.
    legacy = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    indexed = {"index": -1, "id": "call_9", "type": "function"}
    indexed["function"] = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    for tool_calls in ([indexed], [{k: v for k, v in indexed.items() if k != "id"}]):
        chunks = sse(
            chunk({"role": "assistant", "function_call": legacy}),
            chunk({"tool_calls": tool_calls}),
            chunk(finish="tool_calls"),
        )
        parsed = NativeToolCallParser().parse(await openai_reply(chunks), SPECS)
        assert_actions(
            parsed, [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
        )


async def test_whole_calls_without_index_or_id_in_one_delta_stay_apart():
    # Some servers send every call whole in one delta's list, without index and id: each entry
    # is a call of its own (they were merged into one call named "get_weatherlist_airports"
    # with two argument objects). A later delta's fragment without index or id still
    # continues the last call.
    oslo = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}
    airports = {"type": "function", "function": {"name": "list_airports", "arguments": "{}"}}
    rome = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    chunks = sse(
        chunk({"role": "assistant", "tool_calls": [rome, airports, oslo]}),
        chunk({"tool_calls": [{"function": {"arguments": '"Oslo"}'}}]}),
        chunk(finish="tool_calls"),
    )
    parsed = await through_openai(chunks)
    assert_actions(
        parsed,
        [
            ("get_weather", {"city": "Rome"}),
            ("list_airports", {}),
            ("get_weather", {"city": "Oslo"}),
        ],
    )
    assert len({a.id for a in parsed.actions}) == 3


async def test_whole_calls_sharing_an_id_without_index_in_one_delta_stay_apart():
    # Two calls sent whole in one delta's list, without index and with the same id: each
    # entry is a call of its own, the second given an id of its own (they were merged into
    # one invalid call named "get_weatherlist_airports" with two argument objects).
    rome = {"id": "call_1", "type": "function"}
    rome["function"] = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    airports = {"id": "call_1", "type": "function"}
    airports["function"] = {"name": "list_airports", "arguments": "{}"}
    chunks = sse(
        chunk({"role": "assistant", "tool_calls": [rome, airports]}),
        chunk(finish="tool_calls"),
    )
    parsed = await through_openai(chunks)
    assert_actions(parsed, [("get_weather", {"city": "Rome"}), ("list_airports", {})])
    assert parsed.actions[0].id == "call_1" != parsed.actions[1].id
    assert "synthesised_call_id" in parsed.repairs
