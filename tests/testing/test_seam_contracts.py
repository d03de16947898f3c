"""Every implementation of the parser, executor and model-client seams passes the public
contract checks of `treadle.testing.seams` (and a broken one fails them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import treadle
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.testing.seams import (
    SeamContractError,
    check_action_executor,
    check_decision_parser,
    check_model_client,
)
from treadle.types import Action, Attempt, DecisionKind, Message, ModelReply, ParsedReply

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"


@pytest.mark.parametrize(
    "parser",
    [
        treadle.NativeToolCallParser(),
        treadle.NativeToolCallParser(text_reply_tool="respond"),
        treadle.JsonToolCallParser(),
    ],
    ids=["native", "native-text-reply-tool", "json-in-text"],
)
def test_parsers_keep_the_contract(parser):
    check_decision_parser(parser)


class RaisingParser:
    def parse(self, reply, tools):
        return ParsedReply(kind=DecisionKind.ACTIONS, history_message=Message(role="assistant"))


def test_a_broken_parser_fails_the_contract():
    with pytest.raises(SeamContractError, match="ACTIONS without actions"):
        check_decision_parser(RaisingParser())


@treadle.tool
async def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


async def test_toolbox_keeps_the_contract():
    sample = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="lookup", arguments={"q": "x"}
    )
    await check_action_executor(treadle.Toolbox([lookup]), sample=sample)


async def test_airline_executor_keeps_the_contract(tmp_path):
    from treadle.demo.airline.agent import AirlineExecutor
    from treadle.demo.airline.data import AirlineDataNotFound, find_data_dir, load_data
    from treadle.demo.airline.db import AirlineDatabase

    try:
        data_dir = find_data_dir()
    except AirlineDataNotFound:
        if os.environ.get("CI"):
            raise
        pytest.skip("airline workload data not found (set TREADLE_AIRLINE_DATA)")

    class QuietCustomer:
        async def answer(self, index, agent_text):
            return "thanks ###STOP###"

    db = AirlineDatabase.create(tmp_path / "airline.sqlite3", load_data(data_dir))
    sample = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="list_all_airports", arguments={}
    )
    await check_action_executor(AirlineExecutor(db, QuietCustomer()), sample=sample)


@pytest.mark.parametrize(
    "reply", [say("hello"), call("lookup", q="x", call_id="c1")], ids=["text", "tool-call"]
)
async def test_scripted_model_keeps_the_contract(reply):
    model = ScriptedModel(turns=[reply], stream_chunk_chars=2)
    got = await check_model_client(model)
    assert got == reply


@pytest.mark.parametrize(
    "case",
    [
        "05-usage-chunk-empty-choices",
        "08-parallel-toolcalls-interleaved",
        "09-toolcall-name-every-delta-no-id",
    ],
)
async def test_openai_client_keeps_the_contract(case):
    body = (CASES / f"{case}.sse").read_bytes()
    response = CannedResponse(
        headers={"content-type": "text/event-stream"}, chunks=[body], pause_s=0
    )
    async with open_loopback_server(canned(response)) as server:
        client = treadle.OpenAIChatClient(base_url=server.base_url)
        try:
            reply = await check_model_client(client)
        finally:
            await client.aclose()
    assert isinstance(reply, ModelReply)


class LyingModel:
    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        if on_delta:
            on_delta("text", "abc")
        return ModelReply(text="xyz")


async def test_a_broken_model_client_fails_the_contract():
    with pytest.raises(SeamContractError, match="add up"):
        await check_model_client(LyingModel())
