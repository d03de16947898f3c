"""Declaring resources on tools, `Observed`, `StaleWrite`, and what the log and snapshot hold.

docs/concepts.md, "Stale writes"; the whole-run behaviour is in tests/runtime/test_stale_writes.py.
"""

from __future__ import annotations

import decimal
import enum
import json
from typing import Any

import pytest
import trio

import treadle
from treadle._exceptions import UsageError
from treadle.revisions import Observed, StaleWrite, check_write, fold_revisions
from treadle.stores._codec import decode, record_to_json
from treadle.testing import ScriptedModel, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import Action, ActionOutcome, ActionResult, ActionStatus


class Cabin(enum.Enum):
    ECONOMY = "economy"
    BUSINESS = "business"


def action(tool_name: str, revisions: Any = None, **arguments: Any) -> Action:
    return Action(
        run_id="r",
        step=2,
        intent_id="r/s2/a1",
        call_id="c1",
        tool=tool_name,
        arguments=arguments,
        revisions=revisions or {},
    )


@tool(reads="flight:{number}/{day}/{cabin}")
async def get_flight(number: int, day: str, cabin: Cabin) -> Observed[str]:
    """Read a flight."""
    return Observed("seats left: 3", revision=0)


@tool(writes="flight:{number}/{day}/{cabin}")
async def book(number: int, day: str, cabin: Cabin, context: ToolContext) -> str:
    """Book a seat on a flight."""
    if context.seen_revision != 0:
        raise StaleWrite(current=0, message="seats were sold meanwhile")
    return f"booked from {context.resource} at revision {context.seen_revision}"


FLIGHT = {"number": 17, "day": "2026-03-01", "cabin": "business"}
FLIGHT_KEY = "flight:17/2026-03-01/business"


async def test_a_reading_tool_reports_the_revision_under_its_key() -> None:
    outcome = await Toolbox([get_flight]).execute(action("get_flight", **FLIGHT))
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation == "seats left: 3"
    assert outcome.revisions == {FLIGHT_KEY: 0}


async def test_a_writing_tool_gets_the_revision_the_run_read() -> None:
    box = Toolbox([book])
    outcome = await box.execute(action("book", {FLIGHT_KEY: (0,)}, **FLIGHT))
    assert outcome.observation == f"booked from {FLIGHT_KEY} at revision 0"
    assert box.writes("book") == "flight:{number}/{day}/{cabin}"
    assert box.writes("get_flight") is None


async def test_a_writing_tool_is_not_run_without_a_read() -> None:
    outcome = await Toolbox([book]).execute(action("book", {"flight:other": (4,)}, **FLIGHT))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.detail == (
        f"{FLIGHT_KEY} was not read in this run (a read from before it, earlier in the "
        "conversation, does not count); read it now, then change it from what you read"
    )


async def test_stale_write_is_not_executed_and_names_the_resource() -> None:
    outcome = await Toolbox([book]).execute(action("book", {FLIGHT_KEY: (0, 3)}, **FLIGHT))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.stale_resource == FLIGHT_KEY
    assert outcome.detail == (
        "you read revision 3; it is now at revision 0; seats were sold meanwhile"
    )
    assert outcome.revisions == {}


async def test_observed_needs_a_key_and_an_int_revision() -> None:
    @tool
    async def plain() -> Observed[str]:
        """No resource declared."""
        return Observed("x", revision=1)

    @tool(reads="doc:{name}")
    async def boolean(name: str) -> Observed[str]:
        """A bool is not a revision."""
        return Observed("x", revision=True)

    @tool
    async def explicit() -> Observed[str]:
        """The key given with the value."""
        return Observed("x", revision=0, resource="doc:readme")

    box = Toolbox([plain, boolean, explicit])
    for name, arguments, said in (
        ("plain", {}, "returned a revision without a resource key"),
        ("boolean", {"name": "a"}, "returned the revision True, which is not an int"),
    ):
        outcome = await box.execute(action(name, **arguments))
        assert outcome.status is ActionStatus.EXECUTED
        assert outcome.observation.startswith(f"Error: {name} {said}")
        assert outcome.revisions == {}
    assert (await box.execute(action("explicit"))).revisions == {"doc:readme": 0}


async def ok(reservation_id: str, seat: str, context: ToolContext) -> str:
    return "ok"


async def based(reservation_id: str, revision: int) -> str:
    return "ok"


async def named(reservation_id: str, revision: str, context: ToolContext) -> str:
    return "ok"


async def no_context(reservation_id: str) -> str:
    return "ok"


@pytest.mark.parametrize(
    ("fn", "options", "message"),
    [
        (ok, {"reads": "r:{nope}"}, "names no argument 'nope'"),
        (ok, {"writes": "r:{reservation_id!r}"}, "a field is a bare argument name"),
        (ok, {"writes": "r:{reservation_id:>4}"}, "a field is a bare argument name"),
        (ok, {"writes": "r:{reservation_id"}, "is malformed"),
        (ok, {"writes": ""}, "non-empty key template"),
        (ok, {"reads": "r:{reservation_id}{seat}"}, "have no text between them"),
        (ok, {"writes": "r:{seat}", "secret_arguments": ("seat",)}, "secret argument 'seat'"),
        (ok, {"base_revision": "seat"}, "base_revision needs writes="),
        (named, {"writes": "r:{reservation_id}", "base_revision": "revision"}, "an int argument"),
        (based, {"writes": "r:{reservation_id}", "base_revision": "nope"}, "an int argument"),
        (no_context, {"writes": "r:{reservation_id}"}, "needs a ToolContext parameter"),
    ],
)
def test_bad_resource_declarations_raise_usage_error(
    fn: Any, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        tool(**options)(fn)


def test_check_write_and_fold() -> None:
    table: dict[str, tuple[int, ...]] = {}
    fold_revisions(table, {"a": 0})
    fold_revisions(table, {"a": 2, "b": 7})
    fold_revisions(table, {"a": 0})  # read again: the latest observed is 0 again
    assert table == {"a": (2, 0), "b": (7,)}
    assert check_write("a", table, None) == 0
    assert check_write("a", table, 2) == 2
    assert isinstance(check_write("a", table, 1), str)
    assert isinstance(check_write("c", table, None), str)


def result(outcome: ActionOutcome) -> ActionResult:
    return ActionResult(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="t", outcome=outcome, ts="t0"
    )


def test_a_result_without_revisions_is_logged_as_before() -> None:
    plain = result(ActionOutcome(status=ActionStatus.EXECUTED, observation="x"))
    line = record_to_json(plain)
    assert json.loads(line) == {
        "run_id": "r",
        "step": 1,
        "intent_id": "r/s1/a1",
        "call_id": "c",
        "tool": "t",
        "outcome": {"status": "executed", "observation": "x"},
        "ts": "t0",
        "kind": "action_result",
    }
    observed = result(
        ActionOutcome(
            status=ActionStatus.NOT_EXECUTED,
            observation="x",
            revisions={"reservation:R1": 0},
            stale_resource="reservation:R1",
        )
    )
    assert decode(record_to_json(observed)) == observed
    assert json.loads(record_to_json(observed))["outcome"]["revisions"] == {"reservation:R1": 0}


def _agent(*tools: treadle.Tool, **kwargs: Any) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[say("x")]),
        executor=treadle.Toolbox(list(tools)),
        parser=treadle.NativeToolCallParser(),
        **kwargs,
    )


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_the_stale_text_is_in_the_snapshot_only_with_a_writing_tool() -> None:
    plain = _agent(add)
    # The snapshot (and so the version label) of an agent without a writing tool is the
    # one it had before stale writes existed: runs started then resume without a mismatch.
    assert plain.version_label == "snap-8514c8d23c59"
    assert sorted(plain.snapshot()["synthetic"]) == [
        "env_error",
        "not_executed",
        "rejected",
        "unknown",
    ]
    changed = treadle.SyntheticObservations(stale="changed: {resource}")
    assert _agent(add, synthetic=changed).snapshot() == plain.snapshot()
    writing = _agent(add, get_flight, book)
    assert writing.snapshot()["synthetic"]["stale"] == treadle.SyntheticObservations().stale
    assert _agent(add, get_flight, book, synthetic=changed).snapshot() != writing.snapshot()


async def test_a_stale_write_raised_in_a_nursery_is_still_stale() -> None:
    @tool(writes="doc:{name}")
    async def save(name: str, context: ToolContext) -> str:
        """Save a document."""

        async def check() -> None:
            await trio.lowlevel.checkpoint()
            raise StaleWrite(current=9)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(check)
        return "saved"

    outcome = await Toolbox([save]).execute(action("save", {"doc:a": (8,)}, name="a"))
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.stale_resource == "doc:a"
    assert outcome.detail == "you read revision 8; it is now at revision 9"


async def test_a_read_without_observed_says_so_in_the_diagnostics() -> None:
    @tool(reads="doc:{name}")
    async def read(name: str) -> str:
        """Forgets to report the revision."""
        return "text"

    outcome = await Toolbox([read]).execute(action("read", name="a"))
    assert outcome.status is ActionStatus.EXECUTED and outcome.observation == "text"
    assert outcome.revisions == {} and "returned no treadle.Observed value" in outcome.detail


def test_a_key_keeps_the_values_of_its_fields_apart() -> None:
    # Owner "a" and path "b/c" (read) and owner "a/b" and path "c" (written) both gave the
    # key file:a/b/c: a write of a file the model never read ran as if it had read it.
    from treadle.revisions import ResourceTemplate

    template = ResourceTemplate.parse(
        "file:{owner}/{path}", tool="t", option="writes", arguments=("owner", "path"), secret=()
    )
    read = template.key({"owner": "a", "path": "b/c"})
    written = template.key({"owner": "a/b", "path": "c"})
    assert read == "file:a/b%2Fc" and written == "file:a%2Fb/c"
    assert template.key({"owner": "50%", "path": "x"}) == "file:50%25/x"
    assert template.key({"owner": "order-17", "path": "notes.txt"}) == "file:order-17/notes.txt"
    one = ResourceTemplate.parse(
        "reservation:{id}", tool="t", option="reads", arguments=("id",), secret=()
    )
    assert one.key({"id": "R1/2"}) == "reservation:R1/2"  # one field: nothing to keep apart


def test_a_template_whose_fields_touch_is_refused() -> None:
    # Under doc:{a}{b}, a = "a", b = "bc" (read) and a = "ab", b = "c" (written) both gave the
    # key doc:abc, and 1, 23 and 12, 3 both doc:123: a write of a document the model never
    # read ran with the other one's revision.
    from treadle.revisions import ResourceTemplate

    def parse(text: str) -> ResourceTemplate:
        return ResourceTemplate.parse(
            text, tool="t", option="reads", arguments=("a", "b"), secret=()
        )

    for text in ("doc:{a}{b}", "{a}{b}:doc", "doc:{a}{a}"):
        with pytest.raises(UsageError, match="have no text between them"):
            parse(text)
    literal = parse("doc:{a}{{{b}")  # an escaped brace is text between them
    assert literal.key({"a": "a{", "b": "c"}) == "doc:a%7B{c"
    assert parse("doc:{a}-{b}").key({"a": "a", "b": "bc"}) == "doc:a-bc"


def test_a_key_keeps_values_of_different_types_apart() -> None:
    # None and "null", 7 and "7", true and "true" gave one key: a write of a resource the run
    # never read ran with the other one's revision.
    from treadle.revisions import ResourceTemplate

    template = ResourceTemplate.parse(
        "acct:{id}", tool="t", option="writes", arguments=("id",), secret=()
    )
    values = [None, "null", 7, "7", 7.0, "7.0", True, "true", False, "false", [7], "[7]"]
    values += ["", '""', '"7"', " 7", "1e3", 1e3, "NaN", {"a": 1}, '{"a": 1}', Cabin.BUSINESS]
    keys = [template.key({"id": value}) for value in values]
    assert len(set(keys)) == len(keys), keys
    assert template.key({"id": None}) == "acct:null" and template.key({"id": 7}) == "acct:7"
    assert template.key({"id": "7"}) == 'acct:"7"' and template.key({"id": "null"}) == 'acct:"null"'
    assert template.key({"id": 'say "hi"'}) == "acct:say %22hi%22"
    assert template.key({"id": "R1"}) == "acct:R1"  # a string no other type reads as: as it is
    assert template.key({"id": Cabin.BUSINESS}) == template.key({"id": "business"})
    assert template.key({"id": decimal.Decimal("7")}) == "acct:7"  # a number, as 7 is
