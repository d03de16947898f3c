"""Approvers see the arguments they approve; secret ones are redacted on every path out.

docs/events.md, "Approvals" and "Secret arguments": the log keeps every argument (a resume
needs them), events, sinks, the handle and the command line show secret ones as
``[redacted]``, and an edit is checked against the tool's schema in the run's snapshot
before anything is written.
"""

from __future__ import annotations

import json
from typing import Literal

import attrs
import pytest
import trio
from click.testing import CliRunner
from tests.fixtures.approval_waits import wait_for_state

from treadle._exceptions import UsageError
from treadle.agent import Agent
from treadle.approvals import arguments_digest, decide, read_control
from treadle.cli import main
from treadle.parsers import NativeToolCallParser
from treadle.redaction import REDACTED, SNAPSHOT_KEY, Redaction
from treadle.stores._codec import record_to_dict
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import open_run, run
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.tools import Toolbox, tool
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalRequested,
    InvalidToolCall,
    ModelErrorInfo,
    ModelReply,
    ModelResult,
    RunFinished,
    RunState,
    StepRecord,
    StopReason,
    ToolCall,
    Usage,
)

CARD = "4111111111111111"
OTHER_CARD = "5500000000000004"


def make_agent(charged: list[dict[str, object]]) -> Agent:
    @tool(requires_approval=True, secret_arguments=("card",))
    async def charge(amount: int, card: str, memo: str = "") -> str:
        """Charge a card."""
        charged.append({"amount": amount, "card": card, "memo": memo})
        return f"charged {amount}"

    @tool
    async def lookup(order: str) -> str:
        """Look an order up."""
        return f"order {order}: 12 EUR"

    return Agent(
        model=ScriptedModel(
            turns=[
                call("lookup", order="A1", call_id="c0"),
                call("charge", amount=12, card=CARD, memo="order A1", call_id="c1"),
                say("done"),
            ]
        ),
        executor=Toolbox([charge, lookup]),
        parser=NativeToolCallParser(),
    )


class ListSink:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def send(self, event: object) -> None:
        self.events.append(event)


def as_text(events) -> str:
    return json.dumps([record_to_dict(e.record) for e in events if e.record is not None])


def test_a_tool_declares_its_secret_arguments_and_the_snapshot_records_them():
    charged: list[dict[str, object]] = []
    agent = make_agent(charged)
    assert agent.snapshot()[SNAPSHOT_KEY] == {"charge": ["card"]}
    plain = attrs.evolve(agent, executor=Toolbox([agent.executor.get("lookup")]))
    assert SNAPSHOT_KEY not in plain.snapshot()  # no key, so older snapshots still match

    async def f(card: str) -> str:
        return card

    with pytest.raises(UsageError, match="names no argument of the tool: pin"):
        tool(secret_arguments=("pin",))(f)
    with pytest.raises(UsageError, match="collection of names"):
        tool(secret_arguments="card")(f)


async def test_events_sinks_and_the_handle_show_arguments_with_secrets_redacted(autojump_clock):
    charged: list[dict[str, object]] = []
    store, sink = MemoryStore(), ListSink()
    seen = []
    async with open_run(
        make_agent(charged), "pay order A1", store=store, run_id="r", sinks=[sink]
    ) as handle:
        async for event in handle.events():
            seen.append(event)
            if isinstance(event.record, ApprovalRequested):
                pending = handle.pending_approval
                assert pending is not None and pending.tool == "charge"
                assert pending.arguments == {"amount": 12, "card": REDACTED, "memo": "order A1"}
                # Bound by a keyed digest: the plain digest of the real arguments would let
                # anyone test guesses of the card against it.
                digest = arguments_digest({"amount": 12, "card": CARD, "memo": "order A1"})
                assert pending.arguments_digest.startswith("hmac-sha256:")
                assert pending.arguments_digest != digest
                assert event.record.arguments == pending.arguments
                handle.approve("c1")
        result = await handle.wait()
        late = [e async for e in handle.events(from_seq=1)]  # read back from the store
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert charged == [{"amount": 12, "card": CARD, "memo": "order A1"}]
    for events in (seen, sink.events, late):
        text = as_text(events)
        assert CARD not in text
        assert text.count(REDACTED) >= 4  # model reply, request, intent, step history
        assert "order A1" in text  # what is not secret is shown
    log = await store.read_log("r")
    for kind in (ApprovalRequested, ActionIntent, ModelResult, StepRecord):
        assert any(
            isinstance(r, kind) and CARD in json.dumps(record_to_dict(r)) for r in log.records
        ), f"the log keeps the real value in {kind.__name__}"


async def test_an_edit_that_does_not_fit_the_schema_is_refused_and_nothing_is_handed_over(
    autojump_clock,
):
    charged: list[dict[str, object]] = []
    store = MemoryStore()
    async with open_run(make_agent(charged), "pay", store=store, run_id="r") as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        for wrong, said in (
            ({"amount": "twelve", "card": CARD}, "amount: 'twelve' is not of type 'integer'"),
            ({"amount": 12}, "'card' is a required property"),
            ({"amount": 12, "card": CARD, "tip": 1}, "'tip' was unexpected"),
        ):
            with pytest.raises(UsageError, match="do not fit the schema of charge") as caught:
                handle.approve(edit=wrong)
            assert said in str(caught.value)
            assert handle.state is RunState.AWAITING_APPROVAL
        with pytest.raises(UsageError, match="card: the value does not fit") as caught:
            handle.approve(edit={"amount": 12, "card": 4111111111111111})
        assert "4111111111111111" not in str(caught.value)  # a secret is never repeated
        # An edit replaces the whole object: what it says is what runs.
        handle.approve(edit={"amount": 10, "card": OTHER_CARD})
        await handle.wait()
    assert charged == [{"amount": 10, "card": OTHER_CARD, "memo": ""}]


async def test_an_edit_made_from_the_shown_arguments_keeps_the_secret_it_never_saw(
    autojump_clock,
):
    """The approver sees ``card: [redacted]``; editing the amount must not charge that text.

    Before, the placeholder replaced the card number: the call ran with ``"[redacted]"``.
    """
    charged: list[dict[str, object]] = []
    store = MemoryStore()
    async with open_run(make_agent(charged), "pay", store=store, run_id="r") as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        pending = handle.pending_approval
        assert pending is not None and pending.arguments is not None
        assert pending.arguments["card"] == REDACTED
        handle.approve(edit={**pending.arguments, "amount": 10})
        await handle.wait()
    assert charged == [{"amount": 10, "card": CARD, "memo": "order A1"}]
    log = await store.read_log("r")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent) and r.tool == "charge"]
    assert intent.arguments == {"amount": 10, "card": CARD, "memo": "order A1"}


def left_waiting_for_approval(db: str, charged: list[dict[str, object]]) -> None:
    """Drive run ``r`` in ``db`` to its approval wait, then stop driving it (drained): nobody
    drives it, and the command line writes to its control stream."""

    async def until_the_approval_wait() -> None:
        async with (
            open_sqlite_store(db) as store,
            open_run(make_agent(charged), "pay", store=store, run_id="r") as handle,
        ):
            await wait_for_state(handle, RunState.AWAITING_APPROVAL)
            handle.drain()

    trio.run(until_the_approval_wait)


def test_the_command_line_shows_arguments_redacts_secrets_and_checks_edits(tmp_path):
    db = str(tmp_path / "runs.db")
    charged: list[dict[str, object]] = []
    left_waiting_for_approval(db, charged)
    runner = CliRunner()
    outputs = {
        "show": runner.invoke(main, ["show", "r", "--store", db], env={"COLUMNS": "300"}),
        "show --json": runner.invoke(main, ["show", "r", "--store", db, "--json"]),
        "tail": runner.invoke(main, ["tail", "r", "--store", db, "--no-follow"]),
        "tail --json": runner.invoke(main, ["tail", "r", "--store", db, "--no-follow", "--json"]),
    }
    for name, done in outputs.items():
        assert done.exit_code == 0, (name, done.output)
        assert CARD not in done.output, name
        assert REDACTED in done.output, name
    assert '"memo": "order A1"' in outputs["show"].output  # the table shows the arguments
    requested = [
        json.loads(line)
        for line in outputs["show --json"].output.splitlines()
        if '"approval_requested"' in line
    ]
    assert requested[0]["arguments"] == {"amount": 12, "card": REDACTED, "memo": "order A1"}

    refused = runner.invoke(main, ["approve", "r", "--store", db, "--edit", '{"amount": 12}'])
    assert refused.exit_code != 0
    assert "'card' is a required property" in refused.output

    async def control_records():
        async with open_sqlite_store(db) as store:
            return await read_control(store, "r")

    assert trio.run(control_records) == ()  # nothing was written
    edit = json.dumps({"amount": 12, "card": OTHER_CARD, "memo": "edited"})
    approved = runner.invoke(main, ["approve", "r", "--store", db, "--edit", edit])
    assert approved.exit_code == 0, approved.output
    assert "charge(" in approved.output and CARD not in approved.output
    assert OTHER_CARD not in approved.output and "edited" in approved.output

    async def resume() -> None:
        async with (
            open_sqlite_store(db) as store,
            open_run(make_agent(charged), store=store, run_id="r") as handle,
        ):
            await handle.wait()

    trio.run(resume)
    assert charged == [{"amount": 12, "card": OTHER_CARD, "memo": "edited"}]
    shown = runner.invoke(main, ["show", "r", "--store", db, "--json"])
    assert OTHER_CARD not in shown.output and CARD not in shown.output


def test_an_edit_given_as_treadle_show_printed_it_keeps_the_secret(tmp_path):
    db = str(tmp_path / "runs.db")
    charged: list[dict[str, object]] = []
    left_waiting_for_approval(db, charged)
    runner = CliRunner()
    shown = runner.invoke(main, ["show", "r", "--store", db, "--json"])
    (requested,) = [
        json.loads(line) for line in shown.output.splitlines() if '"approval_requested"' in line
    ]
    edit = json.dumps({**requested["arguments"], "memo": "edited"})
    assert REDACTED in edit and CARD not in edit
    approved = runner.invoke(main, ["approve", "r", "--store", db, "--edit", edit])
    assert approved.exit_code == 0, approved.output
    assert CARD not in approved.output

    async def resume() -> object:
        async with open_sqlite_store(db) as store:
            async with open_run(make_agent(charged), store=store, run_id="r") as handle:
                await handle.wait()
            return (await read_control(store, "r"))[0]

    decided = trio.run(resume)
    assert decided.edited_arguments == {"amount": 12, "card": CARD, "memo": "edited"}
    assert charged == [{"amount": 12, "card": CARD, "memo": "edited"}]


async def test_decide_checks_the_edit_against_the_snapshot_of_the_run(autojump_clock):
    charged: list[dict[str, object]] = []
    store = MemoryStore()
    async with open_run(make_agent(charged), "pay", store=store, run_id="r") as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        with pytest.raises(UsageError, match="'card' is a required property"):
            await decide(store, "r", edit={"amount": 3})
        assert await read_control(store, "r") == ()
        handle.approve()
        await handle.wait()


def test_redaction_of_a_log_is_the_union_of_its_snapshots():
    first = Redaction.of_snapshot({SNAPSHOT_KEY: {"charge": ["card"]}})
    later = Redaction.of_snapshot({SNAPSHOT_KEY: {"charge": ["cvc"], "login": ["password"]}})
    both = first | later
    assert both.arguments("charge", {"card": 1, "cvc": 2, "amount": 3}) == {
        "card": REDACTED,
        "cvc": REDACTED,
        "amount": 3,
    }
    assert both.arguments("login", {"password": "x"}) == {"password": REDACTED}
    assert both.arguments("", {"password": "x", "n": 1}) == {"password": REDACTED, "n": 1}
    assert not Redaction.of_snapshot({"tools": []})


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"name": "charge", "arguments": {"amount": 12, "card": CARD}}),
        '<tool_call>{"name": "charge", "arguments": {"amount": 12, "card": "' + CARD + '"}}'
        "</tool_call>",
        # the arguments as a JSON string, which parsers decode
        json.dumps({"name": "charge", "arguments": json.dumps({"amount": 12, "card": CARD})}),
        # the key written with a JSON escape
        '{"name": "charge", "arguments": {"amount": 12, "c\\u0061rd": "' + CARD + '"}}',
    ],
    ids=["json", "markup", "string arguments", "escaped key"],
)
async def test_a_call_written_as_text_has_its_secret_redacted_too(text, autojump_clock):
    """A model that writes its call into its text (repaired into a call by the parser) puts
    the secret into the reply's text and the history: redacted there as well."""
    charged: list[dict[str, object]] = []
    agent = make_agent(charged)
    agent = attrs.evolve(agent, model=ScriptedModel(turns=[say(text), say("done")]))
    store, sink = MemoryStore(), ListSink()
    seen = []
    async with open_run(agent, "pay", store=store, run_id="r", sinks=[sink]) as handle:
        async for event in handle.events():
            seen.append(event)
            if isinstance(event.record, ApprovalRequested):
                handle.approve()
        await handle.wait()
    assert charged == [{"amount": 12, "card": CARD, "memo": ""}]
    for events in (seen, sink.events):
        assert CARD not in as_text(events)
        assert CARD not in "".join(e.text or "" for e in events)  # no delta carried it
    log = await store.read_log("r")
    assert CARD in json.dumps([record_to_dict(r) for r in log.records])  # kept in the log


async def test_no_human_is_asked_about_a_call_that_could_not_run(autojump_clock):
    """Arguments that do not validate make the call NOT_EXECUTED without an approval wait
    (the approver could only have wasted a decision on it)."""
    charged: list[dict[str, object]] = []
    agent = make_agent(charged)
    bad = call("charge", amount="twelve", card=CARD, call_id="c1")
    agent = attrs.evolve(agent, model=ScriptedModel(turns=[bad, say("done")]))
    store = MemoryStore()
    result = await run(agent, "pay", store=store, run_id="r")
    assert result.stop_reason is StopReason.FINAL_ANSWER and charged == []
    log = await store.read_log("r")
    assert not any(isinstance(r, ApprovalRequested) for r in log.records)
    (step,) = [r for r in log.records if isinstance(r, StepRecord)][:1]
    assert "invalid arguments" in step.observations[0]


def test_a_secret_written_as_text_is_redacted_in_every_form_and_the_json_stays_valid():
    # Only a literal "name" key followed by one scalar was matched: arguments given as a JSON
    # string, a key with a JSON escape, or a list of secrets kept their values (the list was
    # cut after its first element, leaving broken JSON).
    redaction = Redaction.of_snapshot({SNAPSHOT_KEY: {"charge": ["card"], "recover": ["codes"]}})
    texts = [
        json.dumps({"name": "charge", "arguments": json.dumps({"amount": 12, "card": CARD})}),
        '{"name": "charge", "arguments": {"amount": 12, "c\\u0061rd": "' + CARD + '"}}',
        json.dumps({"name": "recover", "arguments": {"user": "bob", "codes": [CARD, OTHER_CARD]}}),
        json.dumps({"name": "recover", "arguments": {"codes": {"a": [CARD], "b": OTHER_CARD}}}),
        json.dumps([{"name": "charge", "arguments": json.dumps({"card": int(CARD)})}]),
    ]
    for text in texts:
        shown = redaction.text(text)
        assert shown is not None and CARD not in shown and OTHER_CARD not in shown, shown
        assert REDACTED in shown
        json.loads(shown)  # still JSON
    assert redaction.text("card 1234 of 12345") == "card 1234 of 12345"  # prose stays


async def test_a_run_with_secret_arguments_streams_no_text_deltas(autojump_clock):
    # A call written into the text went out, secret and all, in the text deltas before any
    # parser had read it, to subscribers and sinks alike.
    charged: list[dict[str, object]] = []
    text = json.dumps({"name": "charge", "arguments": {"amount": 12, "card": CARD}})
    model = ScriptedModel(turns=[say(text), say("It is done.")], stream_chunk_chars=5)
    agent = attrs.evolve(make_agent(charged), model=model)
    store, sink = MemoryStore(), ListSink()
    seen = []
    async with open_run(agent, "pay", store=store, run_id="r", sinks=[sink]) as handle:
        async for event in handle.events():
            seen.append(event)
            if isinstance(event.record, ApprovalRequested):
                handle.approve()
        await handle.wait()
    assert charged == [{"amount": 12, "card": CARD, "memo": ""}]
    for events in (seen, sink.events):
        assert not [e for e in events if e.kind == "text_delta"]
        finished = [e.record.reply.text for e in events if isinstance(e.record, ModelResult)]
        assert finished[-1] == "It is done."  # the text still comes, whole, when it is done
        assert CARD not in json.dumps(finished)


async def test_an_approval_of_a_secret_call_is_bound_to_a_digest_no_guess_can_reproduce(
    autojump_clock,
):
    # The digest shown next to "[redacted]" was the plain sha256 of the arguments: a short
    # secret (a PIN) was found by hashing every candidate.
    charged: list[dict[str, object]] = []
    store = MemoryStore()
    async with open_run(make_agent(charged), "pay", store=store, run_id="r") as handle:
        async for event in handle.events():
            if isinstance(event.record, ApprovalRequested):
                shown = handle.pending_approval
                assert shown is not None
                real = {"amount": 12, "card": CARD, "memo": "order A1"}
                guesses = [real, dict(shown.arguments or {})]
                assert shown.arguments_digest not in [arguments_digest(g) for g in guesses]
                # The decision names the digest that was shown, as the console and
                # `treadle approve` do, and is applied.
                await decide(store, "r", call_id="c1", arguments_digest=shown.arguments_digest)
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert charged == [{"amount": 12, "card": CARD, "memo": "order A1"}]


async def test_a_seeded_run_binds_its_secret_call_to_the_same_keyed_digest_each_time(
    autojump_clock,
):
    """A run given a random source draws the digest's key from it: its log is the same for
    a seed (docs/simulation.md), the key still never in it; an unseeded run's differs."""
    import random

    async def requested(rng):
        store = MemoryStore()
        async with open_run(make_agent([]), "pay", store=store, run_id="r", rng=rng) as handle:
            async for event in handle.events():
                if isinstance(event.record, ApprovalRequested):
                    handle.cancel("enough")
            await handle.wait()
        (request,) = [
            r for r in (await store.read_log("r")).records if isinstance(r, ApprovalRequested)
        ]
        return request.arguments_digest

    seeded = [await requested(random.Random(7)) for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0].startswith("hmac-sha256:")
    assert await requested(None) != await requested(None)


async def test_an_argument_check_never_quotes_a_secret_value(autojump_clock):
    """A wrong ``Literal`` value was quoted (``got '31415926'``) in the not-executed observation,
    and so in events, sinks and ``treadle show --json``."""
    pin = "31415926"

    @tool(secret_arguments=("pin",))
    async def unlock(door: str, pin: Literal["1234", "9876"]) -> str:
        """Unlock a door with one of the issued PINs."""
        return "unlocked"

    agent = Agent(
        model=ScriptedModel(turns=[call("unlock", door="front", pin=pin), say("done")]),
        executor=Toolbox([unlock]),
        parser=NativeToolCallParser(),
    )
    store, sink = MemoryStore(), ListSink()
    await run(agent, "open up", store=store, run_id="r", sinks=[sink])
    log = await store.read_log("r")
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.detail == (
        f"invalid arguments: expected one of '1234', '9876', got '{REDACTED}' @ $.pin"
    )
    assert pin not in result.outcome.observation  # what the model reads next, too
    steps = [r for r in log.records if isinstance(r, StepRecord)]
    assert pin not in json.dumps([s.observations for s in steps])
    assert pin not in as_text(sink.events)


async def test_a_call_of_a_misnamed_tool_has_every_secret_name_redacted(autojump_clock):
    """``Charge`` or ``functions.charge`` named no tool with secrets: the card was shown in
    clear, though the model meant ``charge``."""
    charged: list[dict[str, object]] = []
    agent = make_agent(charged)
    misnamed = [
        calls(ToolCall(id=f"c{i}", name=name, arguments={"amount": 12, "card": CARD}))
        for i, name in enumerate(("Charge", "functions.charge"))
    ]
    agent = attrs.evolve(agent, model=ScriptedModel(turns=[*misnamed, say("done")]))
    store, sink = MemoryStore(), ListSink()
    result = await run(agent, "pay", store=store, run_id="r", sinks=[sink])
    assert result.stop_reason is StopReason.FINAL_ANSWER and charged == []
    text = as_text(sink.events)
    assert CARD not in text and text.count(REDACTED) >= 4  # reply and intent of each call
    redaction = Redaction.of_snapshot(agent.snapshot())
    # a declared tool without secrets still shows its arguments, whatever their names
    assert redaction.arguments("lookup", {"card": "A1"}) == {"card": "A1"}


_QUOTED = json.dumps({"amount": 12, "card": CARD})


@pytest.mark.parametrize(
    "model",
    [
        ScriptedModel(
            turns=[say("unused")],
            failures={
                0: [
                    ModelErrorInfo(
                        kind="bad_request", message=f"Invalid arguments: {_QUOTED}", status=400
                    )
                ]
            },
        ),
        ScriptedModel(turns=[say('I would run {"name": "charge", "arguments": ' + _QUOTED + "}")]),
    ],
    ids=["model error", "final answer"],
)
async def test_a_model_error_and_a_final_answer_are_redacted_as_the_reply_text_is(
    model, autojump_clock
):
    """A server's error quoting the arguments it was sent, and a final answer that holds a
    call, kept the card in ``model_call_finished`` and ``run_finished``."""
    store, sink = MemoryStore(), ListSink()
    agent = attrs.evolve(make_agent([]), model=model)
    result = await run(agent, "pay", store=store, run_id="r", sinks=[sink])
    assert result.stop_reason in (StopReason.MODEL_ERROR, StopReason.FINAL_ANSWER)
    (finished,) = [e.record for e in sink.events if isinstance(e.record, RunFinished)]
    assert CARD not in as_text(sink.events)
    assert REDACTED in json.dumps(record_to_dict(finished))


def noting_agent(
    reply: ModelReply, charged: list[str], noted: list[str], *, ask_first: bool = False
) -> Agent:
    """``charge`` (its card secret) and ``note`` (no secret; put to a human with
    ``ask_first``), the model sending ``reply`` and then answering."""

    @tool(secret_arguments=("card",))
    async def charge(amount: int, card: str) -> str:
        """Charge a card."""
        charged.append(card)
        return f"charged {amount}"

    @tool(requires_approval=ask_first)
    async def note(text: str) -> str:
        """Write a note for the customer's file."""
        noted.append(text)
        return "noted"

    return Agent(
        model=ScriptedModel(turns=[reply, say("done")]),
        executor=Toolbox([charge, note]),
        parser=NativeToolCallParser(),
    )


CHARGED_AND_NOTED = calls(
    ToolCall(id="c1", name="charge", arguments={"amount": 12, "card": CARD}),
    ToolCall(id="c2", name="note", arguments={"text": f"charged card {CARD}"}),
)


async def test_a_secret_value_in_another_call_of_the_reply_is_redacted_on_every_path_out(
    autojump_clock,
):
    """The card, secret as ``charge``'s argument, stood in clear in the ``note`` call of the
    same reply: in the reply, the note's intent, its approval request and the step's
    history, live and read back, and the request was bound to a plain digest."""
    charged: list[str] = []
    noted: list[str] = []
    agent = noting_agent(CHARGED_AND_NOTED, charged, noted, ask_first=True)
    store, sink = MemoryStore(), ListSink()
    seen = []
    async with open_run(agent, "pay", store=store, run_id="r", sinks=[sink]) as handle:
        async for event in handle.events():
            seen.append(event)
            if isinstance(event.record, ApprovalRequested):
                pending = handle.pending_approval
                assert pending is not None and pending.tool == "note"
                assert pending.arguments == {"text": f"charged card {REDACTED}"}
                assert event.record.arguments == pending.arguments
                guesses = [{"text": f"charged card {CARD}"}, pending.arguments]
                assert pending.arguments_digest.startswith("hmac-sha256:")
                assert pending.arguments_digest not in [arguments_digest(g) for g in guesses]
                handle.approve("c2")
        result = await handle.wait()
        late = [e async for e in handle.events(from_seq=1)]  # read back from the store
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert charged == [CARD] and noted == [f"charged card {CARD}"]  # run as the model said
    for events in (seen, sink.events, late):
        text = as_text(events)
        assert CARD not in text
        assert text.count(f"charged card {REDACTED}") >= 4  # reply, request, intent, history
    log = await store.read_log("r")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent) and r.tool == "note"]
    assert intent.arguments == {"text": f"charged card {CARD}"}  # the log keeps it


def ran_on_sqlite(db: str, agent: Agent) -> list[object]:
    """Run ``r`` of ``agent`` to its end in ``db``; the events a sink got."""
    sink = ListSink()

    async def whole_run() -> None:
        async with open_sqlite_store(db) as store:
            await run(agent, "pay", store=store, run_id="r", sinks=[sink])

    trio.run(whole_run)
    return sink.events


def printed(db: str) -> dict[str, str]:
    """What ``treadle show`` and ``treadle tail``, with and without ``--json``, print of ``r``."""
    runner = CliRunner()
    commands = {
        "show": ["show", "r", "--store", db],
        "show --json": ["show", "r", "--store", db, "--json"],
        "tail": ["tail", "r", "--store", db, "--no-follow"],
        "tail --json": ["tail", "r", "--store", db, "--no-follow", "--json"],
    }
    outputs = {}
    for name, arguments in commands.items():
        done = runner.invoke(main, arguments, env={"COLUMNS": "400"})
        assert done.exit_code == 0, (name, done.output)
        outputs[name] = done.output
    return outputs


def _reply(*tool_calls: ToolCall, invalid: tuple[InvalidToolCall, ...] = ()) -> ModelReply:
    return ModelReply(
        tool_calls=tool_calls, invalid_tool_calls=invalid, finish_reason="tool_calls", usage=Usage()
    )


@pytest.mark.parametrize(
    "reply",
    [
        CHARGED_AND_NOTED,
        _reply(
            ToolCall(id="c1", name="charge", arguments={"arguments": {"amount": 12, "card": CARD}})
        ),
        _reply(
            ToolCall(id="c1", name="charge", arguments={"amount": 12, "card": CARD, "pan": CARD})
        ),
        _reply(ToolCall(id="c1", name="note", arguments={"text": json.dumps({"card": CARD})})),
        _reply(
            ToolCall(id="c1", name="charge", arguments={"amount": 12, "card": CARD}),
            invalid=(
                InvalidToolCall(
                    id="c2", name="note", raw_arguments='{"text": "card ' + CARD, reason="truncated"
                ),
            ),
        ),
    ],
    ids=["another call", "wrapped one level down", "another key", "a call in a string", "invalid"],
)
def test_a_secret_value_anywhere_in_a_reply_is_redacted_in_events_and_on_the_command_line(
    reply, tmp_path
):
    """Only the value under the secret's own top-level key was redacted: the same card in
    another call, another key, one level down, a string or another tool's invalid call was
    shown by events, sinks, ``treadle show`` and ``treadle tail``."""
    db = str(tmp_path / "runs.db")
    charged: list[str] = []
    events = ran_on_sqlite(db, noting_agent(reply, charged, []))
    assert CARD not in as_text(events) and REDACTED in as_text(events)
    outputs = printed(db)
    for name, output in outputs.items():
        assert CARD not in output, name
    assert REDACTED in outputs["show --json"] and REDACTED in outputs["tail --json"]

    async def kept() -> str:
        async with open_sqlite_store(db) as store:
            return json.dumps([record_to_dict(r) for r in (await store.read_log("r")).records])

    assert CARD in trio.run(kept)  # the log keeps what the model sent


def test_a_run_waiting_on_a_call_that_holds_another_calls_secret_resumes_with_the_real_value(
    tmp_path,
):
    """The command line shows the waiting note without the card, and the run resumed in
    another drive still writes the note the model wrote."""
    db = str(tmp_path / "runs.db")
    noted: list[str] = []

    def agent() -> Agent:
        return noting_agent(CHARGED_AND_NOTED, [], noted, ask_first=True)

    async def until_the_approval_wait() -> None:
        async with (
            open_sqlite_store(db) as store,
            open_run(agent(), "pay", store=store, run_id="r") as handle,
        ):
            await wait_for_state(handle, RunState.AWAITING_APPROVAL)
            handle.drain()

    trio.run(until_the_approval_wait)
    for name, output in printed(db).items():
        assert CARD not in output and f"charged card {REDACTED}" in output, name
    approved = CliRunner().invoke(main, ["approve", "r", "--store", db])
    assert approved.exit_code == 0, approved.output
    assert "note(" in approved.output and CARD not in approved.output

    async def resume() -> None:
        async with (
            open_sqlite_store(db) as store,
            open_run(agent(), store=store, run_id="r") as handle,
        ):
            await handle.wait()

    trio.run(resume)
    assert noted == [f"charged card {CARD}"]
    assert all(CARD not in output for output in printed(db).values())


async def test_an_argument_check_of_another_call_never_quotes_the_secret(autojump_clock):
    """A wrong ``Literal`` value of a call without secrets was quoted in its not-executed
    observation although it was another call's secret value."""

    @tool(secret_arguments=("pin",))
    async def unlock(door: str, pin: str) -> str:
        """Unlock a door."""
        return "unlocked"

    @tool
    async def pick(door: Literal["front", "back"]) -> str:
        """Pick a door."""
        return "picked"

    pin = "31415926"
    agent = Agent(
        model=ScriptedModel(
            turns=[
                calls(
                    ToolCall(id="c1", name="unlock", arguments={"door": "front", "pin": pin}),
                    ToolCall(id="c2", name="pick", arguments={"door": pin}),
                ),
                say("done"),
            ]
        ),
        executor=Toolbox([unlock, pick]),
        parser=NativeToolCallParser(),
    )
    store, sink = MemoryStore(), ListSink()
    await run(agent, "open up", store=store, run_id="r", sinks=[sink])
    log = await store.read_log("r")
    results = {r.tool: r for r in log.records if isinstance(r, ActionResult)}
    assert results["pick"].outcome.detail == (
        f"invalid arguments: expected one of 'front', 'back', got '{REDACTED}' @ $.door"
    )
    assert pin not in results["pick"].outcome.observation  # what the model reads next, too
    assert pin not in as_text(sink.events)


def test_arguments_hide_a_secret_under_its_name_at_any_depth_and_its_value_anywhere():
    redaction = Redaction.of_snapshot(
        {SNAPSHOT_KEY: {"unlock": ["pin"]}, "tools": [{"name": "unlock"}, {"name": "log"}]}
    )
    wrapped = {"calls": [{"door": "front", "pin": 73911}], "said": "pin 73911, front", "n": 73911}
    assert redaction.arguments("unlock", wrapped) == {
        "calls": [{"door": "front", "pin": REDACTED}],
        "said": f"pin {REDACTED}, front",
        "n": REDACTED,
    }
    assert redaction.hides("unlock", wrapped)
    plain = {"door": "front", "n": 173911}
    assert redaction.arguments("log", plain, known=[73911]) is plain  # nothing hidden: as is
    assert not redaction.hides("log", plain)
    assert redaction.arguments("log", {"n": 73911}, known=[73911]) == {"n": REDACTED}
