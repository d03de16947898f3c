"""A call the model writes as text has its secret values redacted in every form the parsers read.

docs/events.md, "Secret arguments": the text is read as it is written and as the parsers
decode its strings (JSON's and Python's escapes, JSON inside a JSON string); the value after a
secret argument's key, and every secret value wherever it stands, is replaced. The work is in
proportion to the text's length: a long reply full of braces (LaTeX, code) held the trio loop
for seconds, and every run in the process with it.
"""

from __future__ import annotations

import ast
import itertools
import json
from collections.abc import Iterator

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from treadle._secret_text import value_spans
from treadle.agent import Agent
from treadle.parsers import JsonToolCallParser, NativeToolCallParser
from treadle.redaction import REDACTED, SNAPSHOT_KEY, Redaction, without_secret_values
from treadle.stores._codec import record_to_dict
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel, calls, say
from treadle.tools import Toolbox, tool
from treadle.types import ModelReply, RunState, ToolCall, ToolSpec

CARD = "4111222233334444"
MIDDLE = "22223333"
"""Digits of `CARD` that no redacted text may hold, however the rest is escaped."""
KEY = "card\\u005fnumber"
"""``card_number`` written with a JSON escape."""

REDACTION = Redaction.of_snapshot({SNAPSHOT_KEY: {"charge": ["card_number"]}})
TOOLS = [
    ToolSpec(
        name="charge",
        parameters={
            "type": "object",
            "properties": {"amount": {"type": "integer"}, "card_number": {"type": "string"}},
        },
    )
]

TEMPLATES = {
    "JSON, escaped key, a digit escaped": (
        '<tool_call>{"name": "charge", "arguments": {"amount": 5, "@KEY@": "411122223333444\\u0034"}}'
        "</tool_call>"
    ),
    "JSON, escaped key, slashes escaped": (
        '<tool_call>{"name": "charge", "arguments": {"amount": 5, '
        '"@KEY@": "4111\\/2222\\/3333\\/4444"}}</tool_call>'
    ),
    "JSON string arguments, a digit escaped": (
        '<tool_call>{"name": "charge", "arguments": "{\\"amount\\": 5, '
        '\\"card_number\\": \\"411122223333444\\\\u0034\\"}"}</tool_call>'
    ),
    "JSON string arguments, an upper-case escape": (
        '<tool_call>{"name": "charge", "arguments": "{\\"card_number\\": '
        '\\"4111-2222-3333-caf\\\\u00E9\\"}"}</tool_call>'
    ),
    "Python, key with a \\x escape": (
        "<tool_call>{'name': 'charge', 'arguments': {'amount': 5, 'card\\x5fnumber': '@CARD@'}}"
        "</tool_call>"
    ),
    "Python, triple-quoted value": (
        "<tool_call>{'name': 'charge', 'arguments': {'amount': 5, 'card_number': '''@CARD@'''}}"
        "</tool_call>"
    ),
    "Python, comment after the colon": (
        "<tool_call>{'name': 'charge', 'arguments': {'amount': 5, 'card_number': # the card\n"
        " '@CARD@'}}</tool_call>"
    ),
    "Python, comment before the colon": (
        "<tool_call>{'name': 'charge', 'arguments': {'amount': 5, 'card_number' # the card\n"
        " : '@CARD@'}}</tool_call>"
    ),
    "Python, parenthesised value": (
        "<tool_call>{'name': 'charge', 'arguments': {'amount': 5, 'card_number': ( '@CARD@' )}}"
        "</tool_call>"
    ),
    "Python, octal and named escapes, a line continuation": (
        "<tool_call>{'name': 'charge', 'arguments': {'amount': 5, "
        "'card\\N{LOW LINE}number': '41112222\\\n333344\\064\\N{DIGIT FOUR}'}}</tool_call>"
    ),
    "Mistral markup": '[TOOL_CALLS]charge[ARGS]{"amount": 5, "@KEY@": "\\u0034@TAIL@"}',
    "Llama function block": (
        '<function=charge>{"amount": 5, "@KEY@": "411122223333444\\u0034"}</function>'
    ),
    "a number in exponent form": (
        '<tool_call>{"name": "charge", "arguments": {"amount": 5, "@KEY@": 4.111222233334444e15}}'
        "</tool_call>"
    ),
    "the value again in the prose, escaped": (
        '<tool_call>{"name": "charge", "arguments": {"amount": 5, '
        '"card_number": "4111/2222/3333/4444"}}</tool_call> I used 4111\\/2222\\/3333\\/4444.'
    ),
}
FORMS = {
    name: template.replace("@KEY@", KEY).replace("@CARD@", CARD).replace("@TAIL@", CARD[1:])
    for name, template in TEMPLATES.items()
}


def parsed_arguments(text: str) -> list[dict[str, object]]:
    parsed = JsonToolCallParser().parse(ModelReply(text=text), TOOLS)
    return [dict(action.arguments) for action in parsed.actions]


@pytest.mark.parametrize("text", list(FORMS.values()), ids=list(FORMS))
def test_a_secret_in_any_form_the_parsers_read_is_redacted(text):
    # The value was replaced only in the spellings json.dumps and repr produce, after a key
    # written plainly: one escaped digit, an upper-case escape, a Python literal's own
    # syntax (a \x escape, triple quotes, a comment, parentheses) kept it readable.
    (arguments,) = parsed_arguments(text)
    assert MIDDLE in str(arguments["card_number"]).replace("-", "").replace("/", "")
    shown = REDACTION.text(text)
    assert shown is not None and MIDDLE not in shown and "2222-3333" not in shown, shown
    assert "2222\\/3333" not in shown and "2222/3333" not in shown, shown
    assert parsed_arguments(shown) == [{**arguments, "card_number": REDACTED}]


def test_a_value_elsewhere_in_a_string_is_redacted_and_prose_stays():
    call = '{"name": "charge", "arguments": {"card_number": "' + CARD + '"}}'
    said = ' {"note": "the card \\u0034111222233334444 is charged", "n": 12345}'
    shown = REDACTION.text(call + said)
    assert shown is not None and MIDDLE not in shown
    assert json.loads(shown[len(call.replace(CARD, REDACTED)) :]) == {
        "note": f"the card {REDACTED} is charged",
        "n": 12345,
    }
    assert REDACTION.text("card 1234 of 12345, 'card_number' alone") == (
        "card 1234 of 12345, 'card_number' alone"
    )


def decoder_work(monkeypatch) -> list[int]:
    """The lengths of the texts handed to the JSON decoder and to `ast.literal_eval`."""
    handed: list[int] = []
    raw_decode = json.JSONDecoder.raw_decode
    literal_eval = ast.literal_eval

    def counted_raw_decode(self, text, idx=0):
        handed.append(len(text))
        return raw_decode(self, text, idx)

    def counted_literal_eval(text):
        handed.append(len(text))
        return literal_eval(text)

    monkeypatch.setattr(json.JSONDecoder, "raw_decode", counted_raw_decode)
    monkeypatch.setattr(ast, "literal_eval", counted_literal_eval)
    return handed


def long_reply(pieces: int) -> str:
    """LaTeX with a brace every few characters, calls written into it, and a cut-off call."""
    call = json.dumps({"name": "charge", "arguments": json.dumps({"card_number": [CARD, 5]})})
    piece = "\\frac{a_{N}}{b^{N}} + "
    text = "".join(
        piece.replace("N", str(i)) + (call if i % 500 == 0 else "") for i in range(pieces)
    )
    return text + '{"card_number": {"card_number": [' * (pieces // 10)


@pytest.mark.parametrize("pieces", [2000, 8000])
def test_redacting_a_long_reply_hands_its_decoders_work_in_proportion_to_its_length(
    pieces, monkeypatch
):
    # Every "{" was decoded as JSON from where it stood, and each failure counted the lines
    # of the whole text before it: 22 s for a 221 KB reply, with the trio loop held.
    handed = decoder_work(monkeypatch)
    text = long_reply(pieces)
    shown = REDACTION.text(text)
    assert shown is not None and MIDDLE not in shown
    assert sum(handed) <= 8 * len(text), (sum(handed), len(text))


def test_a_reply_text_redacted_for_several_records_is_read_once(monkeypatch):
    # The model result, the step's history message and its output text hold the same text:
    # it was read three times.
    text = json.dumps({"name": "charge", "arguments": {"card_number": [CARD], "amount": 5}})
    handed = decoder_work(monkeypatch)
    first = REDACTION.text(text)
    read = len(handed)
    assert read and first is not None and CARD not in first
    assert REDACTION.text(text, known=["a known value"]) == first
    assert REDACTION.text(text) == first and len(handed) == read


@tool(secret_arguments=("card_number",))
async def charge(amount: int, card_number: str) -> str:
    """Charge a card."""
    return f"charged {amount}"


class ListSink:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def send(self, event: object) -> None:
        self.events.append(event)


@pytest.mark.parametrize(
    "form",
    [
        "JSON string arguments, a digit escaped",
        "Python, triple-quoted value",
        "Python, parenthesised value",
    ],
)
async def test_events_of_a_run_hold_no_secret_the_model_wrote_in_any_form(form, autojump_clock):
    agent = Agent(
        model=ScriptedModel(turns=[say(FORMS[form]), say("ok")]),
        executor=Toolbox([charge]),
        parser=JsonToolCallParser(),
        system_prompt="sys",
    )
    store, sink = MemoryStore(), ListSink()
    seen = []
    async with open_run(agent, "pay", store=store, run_id="r", sinks=[sink]) as handle:
        async for event in handle.events():
            seen.append(event)
        await handle.wait()
    log = await store.read_log("r")
    assert MIDDLE in json.dumps([record_to_dict(r) for r in log.records])  # kept in the log
    for events in (seen, sink.events):
        shown = json.dumps([record_to_dict(e.record) for e in events if e.record is not None])
        assert "charged 5" in shown and MIDDLE not in shown


HUGE_HEX = "{'card_number': [0x" + "f" * 4000 + "]}"
"""A Python literal whose number has more digits than Python writes in decimal."""
NAMELESS = "a path: \\\\N{\\ud800} ok"
"""``\\N{`` and a JSON escape that reads as a lone surrogate: no character's name."""
TOKENS = [
    "\\",
    "\\\\",
    "\\u",
    "\\ud800",
    "\\udc00",
    "\\U0001f600",
    "\\x5f",
    "\\N{",
    "\\N{DIGIT FOUR}",
    "\\0",
    "\\\n",
    "0x",
    "f" * 50,
    "9" * 50,
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    '"',
    "'",
    "'''",
    ":",
    ",",
    "#",
    "\n",
    ".",
    "e5",
    '"card_number"',
    "'card_number'",
    '"card\\u005fnumber"',
    "<parameter=card_number>",
    "</parameter>",
    CARD,
]


@given(
    pieces=st.lists(st.sampled_from(TOKENS) | st.text(max_size=4), max_size=40),
    known=st.lists(st.integers() | st.text(max_size=8), max_size=3),
)
@example(pieces=[HUGE_HEX], known=[])
@example(pieces=[NAMELESS], known=[])
@example(pieces=["the card"], known=[[16**4000, CARD]])
def test_redacting_any_text_returns_a_text(pieces, known):
    # A reply's text is the model's to write: a \\N{} escape of a lone surrogate and a Python
    # literal's hex number with 4800 digits raised, crashing the run's writer and `treadle show`.
    text = "".join(pieces)
    shown = REDACTION.text(text, known=[*known, CARD])
    assert isinstance(shown, str) and CARD not in shown
    shown = without_secret_values(text, {"card_number": [*known, CARD]}, {"card_number"})
    assert isinstance(shown, str) and CARD not in shown


def test_what_no_decoder_reads_is_left_as_written_and_the_value_after_its_key_goes():
    assert REDACTION.text(HUGE_HEX) == "{'card_number': '[redacted]'}"
    assert REDACTION.text(NAMELESS) == NAMELESS
    deep: object = CARD
    for _ in range(5000):
        deep = [deep]
    assert REDACTION.text(f"the card {CARD}", known=[deep]) == f"the card {REDACTED}"


async def test_a_reply_no_decoder_reads_lets_its_run_go_on(autojump_clock):
    # The writer crashed on the reply's text: the run was interrupted, and its call, intended
    # but not finished, was unknown on resume.
    card = ToolCall(id="c1", name="charge", arguments={"amount": 5, "card_number": CARD})
    agent = Agent(
        model=ScriptedModel(turns=[calls(card, text=f"Charging ({NAMELESS})."), say("ok")]),
        executor=Toolbox([charge]),
        parser=NativeToolCallParser(),
        system_prompt="sys",
    )
    store, sink = MemoryStore(), ListSink()
    async with open_run(agent, "pay", store=store, run_id="r", sinks=[sink]) as handle:
        result = await handle.wait()
    assert result.state is RunState.SUCCEEDED
    shown = json.dumps([record_to_dict(e.record) for e in sink.events if e.record is not None])
    assert "charged 5" in shown and CARD not in shown


class ScannedText(str):
    """A text that counts the characters `str.find` passes over in it."""

    scanned = 0

    def find(self, sub, start=0, end=None):  # type: ignore[override]
        found = super().find(sub, start)
        ScannedText.scanned += (len(self) if found < 0 else found + len(sub)) - start
        return found


def values_nested_in_one_another(size: int) -> tuple[str, list[str]]:
    """Secret keys whose values are runs of one letter of growing length, and the values."""
    parts: list[str] = []
    values: list[str] = []
    while sum(map(len, parts)) < size:
        values.append("a" * (8 + len(values)))
        parts.append(f'"card_number": "{values[-1]}",')
    return "{" + "".join(parts) + "}", values


@pytest.mark.parametrize("size", [10_000, 40_000])
def test_values_found_in_one_another_take_work_in_proportion_to_the_text(size):
    # Every value was found at every place inside every longer one, and each of the text's
    # distinct values looked for through the whole text: 33 s for 40 KB, with the loop held.
    text, values = values_nested_in_one_another(size)
    ScannedText.scanned = 0
    spans = value_spans([(ScannedText(text), ())], values)
    assert ScannedText.scanned <= 64 * len(text), (ScannedText.scanned, len(text))
    assert len(spans) <= len(text) // 4, (len(spans), len(text))
    assert "aaaaaaaa" not in REDACTION.text(text, known=values[-1:])


@pytest.mark.parametrize("shown", ["PIN 7391.", "PIN 7391. Done", "(7391.)", "7391.\n"])
def test_a_short_secret_before_a_full_stop_is_redacted(shown):
    # "." counted as part of a number whatever followed it: "PIN 7391." was shown.
    expected = shown.replace("7391", REDACTED)
    assert REDACTION.text(shown, known=["7391"]) == expected
    assert without_secret_values(shown, {"pin": "7391"}, {"pin"}) == expected


def test_a_short_secret_within_a_longer_number_is_left():
    for number in ("3.7391", "7391.5", "17391", "7391_2", "x7391"):
        assert REDACTION.text(f"PIN {number}.", known=["7391"]) == f"PIN {number}."


SECRETS = Redaction.of_snapshot({SNAPSHOT_KEY: {"charge": ["card_number", "pin"]}})
PROSE_AFTER = " After that I will email the report to bob as asked."


@pytest.mark.parametrize("quoted_times", [0, 1, 2])
@pytest.mark.parametrize(
    "secret",
    ["C:\\keys\\", "ends-with-a-backslash\\\\", {"password": "C:\\keys\\", "otp": "12345678"}],
    ids=["a backslash at the end", "two backslashes at the end", "an object holding one"],
)
def test_a_secret_ending_in_a_backslash_is_replaced_up_to_its_own_end(secret, quoted_times):
    # A reading that decodes the JSON's own escapes read "\\" before the closing quote as an
    # escaped quote: the value ran on to the next quote, or to the text's end for an object,
    # and `{"card_number": "[redacted]"amount": 5}` was shown, the prose after it gone.
    call = {"name": "charge", "arguments": {"card_number": secret, "amount": 5, "to": "bob"}}
    written = json.dumps(call)
    for _ in range(quoted_times):
        written = json.dumps(written)
    shown = SECRETS.text("Paying now. " + written + PROSE_AFTER)
    assert shown is not None and shown.startswith("Paying now. ") and shown.endswith(PROSE_AFTER)
    read = json.loads(shown[len("Paying now. ") : -len(PROSE_AFTER)])
    for _ in range(quoted_times):
        read = json.loads(read)
    assert read == {
        "name": "charge",
        "arguments": {"card_number": REDACTED, "amount": 5, "to": "bob"},
    }


PLAIN_CHARS = st.sampled_from(list("aZé \"'\\/\n\t\u2028\U0001f600{}[]:,#\x00\x7f.-euxN<>="))
"""Characters of what is not secret: JSON's and Python's syntax and escapes, no digit."""
PLAIN_TEXT = st.lists(PLAIN_CHARS, max_size=8).map("".join)
SECRET_KEY = st.sampled_from(["card_number", "pin"])
SECRET_LEAF = PLAIN_TEXT.map("S3CR3T".__add__) | st.integers(10**9, 10**17)
"""A secret string or number: nothing else in the text holds it (`told_apart`)."""
SECRET_VALUE = st.recursive(
    SECRET_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(PLAIN_TEXT, inner, max_size=3),
    max_leaves=4,
)
PLAIN_VALUE = st.recursive(
    PLAIN_TEXT | st.integers(-999, 999) | st.booleans() | st.none(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.builds(
            lambda plain, secret: {**plain, **secret},
            st.dictionaries(PLAIN_TEXT, inner, max_size=3),
            st.dictionaries(SECRET_KEY, SECRET_VALUE, max_size=1),
        )
    ),
    max_leaves=6,
)
"""A value that is no secret, though it may hold secret arguments (an object nested)."""


def told_apart(value: object, marks: Iterator[str]) -> object:
    """``value`` with a mark of its own after the ``S3CR3T`` of each secret string in it.

    No secret string is then the start of another: a value is replaced wherever it stands,
    and one that starts as another and goes on as its closing quote does (``S3CR3T\\`` and
    ``\\"S3CR3T\\"``, in JSON in a JSON string) is replaced across that quote too.
    """
    if isinstance(value, dict):
        return {key: told_apart(item, marks) for key, item in value.items()}
    if isinstance(value, list):
        return [told_apart(item, marks) for item in value]
    if isinstance(value, str) and value.startswith("S3CR3T"):
        return f"S3CR3T{next(marks)}{value.removeprefix('S3CR3T')}"
    return value


def without_secrets(value: object) -> object:
    """``value`` with every secret argument's value, at any depth, read as `REDACTED`."""
    if isinstance(value, dict):
        return {
            key: REDACTED if key in ("card_number", "pin") else without_secrets(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [without_secrets(item) for item in value]
    return value


@given(
    plain=st.dictionaries(PLAIN_TEXT, PLAIN_VALUE, max_size=4),
    secrets=st.dictionaries(SECRET_KEY, SECRET_VALUE, min_size=1),
    ascii_only=st.booleans(),
    quoted_times=st.integers(0, 2),
    prose=st.tuples(PLAIN_TEXT, PLAIN_TEXT),
)
@example(
    plain={"to": "bob"},
    secrets={"card_number": "S3CR3T C:\\keys\\"},
    ascii_only=True,
    quoted_times=0,
    prose=("Paying now.", "Then I tell bob."),
)
@example(
    plain={"to": "bob"},
    secrets={"pin": {"password": "S3CR3T C:\\keys\\", "otp": 12345678901}},
    ascii_only=True,
    quoted_times=1,
    prose=("Paying now.", "Then I tell bob."),
)
def test_redacted_json_still_parses_and_only_secret_values_change(
    plain, secrets, ascii_only, quoted_times, prose
):
    # docs/events.md, "Secret arguments": values are replaced so that the JSON stays valid,
    # and other prose is left as it is.
    marks = (chr(code) for code in itertools.count(0x4E00))
    call = {"name": "charge", "arguments": told_apart({**plain, **secrets}, marks)}
    written = json.dumps(call, ensure_ascii=ascii_only)
    for _ in range(quoted_times):
        written = json.dumps(written, ensure_ascii=ascii_only)
    before, after = prose[0] + " ", " " + prose[1]
    shown = SECRETS.text(before + written + after)
    assert shown is not None and shown.startswith(before) and shown.endswith(after), shown
    read = json.loads(shown[len(before) : len(shown) - len(after)])
    for _ in range(quoted_times):
        read = json.loads(read)
    assert read == without_secrets(call)
    assert "S3CR3T" not in shown
