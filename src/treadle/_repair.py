"""Decoding and repairing JSON written by a model (private; used by `treadle.parsers`).

Everything here is pure and total: every function returns a result for any ``str`` input
and never raises (the parser contract of docs/seams.md, "Decision parser" rests on it). Repairs are
narrow and
named; anything they do not cover is reported as a failure with the parse error, never
replaced by a silent ``{}``.

Repair names (they end up in `treadle.types.ParsedReply.repairs`):

* ``empty_arguments_as_empty_object``: empty or whitespace-only arguments mean ``{}``;
* ``null_arguments_as_empty_object``: the arguments of a tool that needs none were JSON
  ``null`` (several hosted providers send it), read as ``{}``;
* ``dropped_text_after_arguments``: one complete JSON object followed by text that is not
  JSON (prose, a closing remark); the object is used and the text dropped;
* ``unwrapped_code_fence``: the whole text was one ````` or `````json fenced block;
* ``decoded_json_string``: the arguments were a JSON string holding a JSON object;
* ``python_literal``: a Python dict literal (single quotes, ``True``/``False``/``None``),
  read with `ast.literal_eval` (never ``eval``) and accepted only if made of JSON types.
"""

from __future__ import annotations

import ast
import io
import json
import math
import re
import tokenize
import warnings
from typing import Any, Final

import attrs

EMPTY_AS_OBJECT: Final = "empty_arguments_as_empty_object"
NULL_AS_OBJECT: Final = "null_arguments_as_empty_object"
DROPPED_TRAILING_TEXT: Final = "dropped_text_after_arguments"
UNWRAPPED_FENCE: Final = "unwrapped_code_fence"
DECODED_JSON_STRING: Final = "decoded_json_string"
PYTHON_LITERAL: Final = "python_literal"

MULTIPLE_VALUES: Final = "multiple_json_values"
NOT_AN_OBJECT: Final = "arguments_not_object"
UNPARSEABLE: Final = "unparseable"

MAX_LITERAL_CHARS: Final = 100_000
"""Longer text is not tried as a Python literal (parsing cost is bounded)."""

_FENCE: Final = re.compile(
    r"\A```[ \t]*(?:json|JSON)?[ \t]*\r?\n?(.*?)\r?\n?[ \t]*```\Z", re.DOTALL
)
_JSON_WS: Final = re.compile(r"[ \t\n\r]*")
_NUMBER_WORDS: Final = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)


@attrs.frozen(kw_only=True)
class JsonValues:
    """The JSON values found one after another in a text.

    Attributes:
        values: every complete value, in order (may be non-empty when ``error`` is set).
        error: the parse error of the first value that failed, ``None`` when the whole text
            was values and whitespace.
        failed_at: with ``error``, the offset in the text where that value starts (after
            the complete ones and the white space after them); else ``None``.
    """

    values: tuple[Any, ...] = ()
    error: str | None = None
    failed_at: int | None = None


@attrs.frozen(kw_only=True)
class DecodedArguments:
    """The outcome of decoding one tool call's argument text.

    Attributes:
        arguments: the decoded object, ``None`` on failure.
        repairs: the repairs applied, in order.
        reason: on failure, ``multiple_json_values``, ``arguments_not_object`` or
            ``unparseable``.
        error: on failure, a one-line description for the model (parse error included).
        count: on ``multiple_json_values``, how many values were found.
    """

    arguments: dict[str, Any] | None = None
    repairs: tuple[str, ...] = ()
    reason: str | None = None
    error: str | None = None
    count: int = 0


def number_word(n: int) -> str:
    """Spell small counts as words (``2`` -> ``"two"``), larger ones as digits."""
    return _NUMBER_WORDS[n] if 0 <= n < len(_NUMBER_WORDS) else str(n)


def strip_code_fence(text: str) -> str | None:
    """Return the inside of ``text`` when all of it is one fenced block, else ``None``.

    Only a bare ````` fence or a `````json one counts; ``text`` should be stripped already.
    """
    match = _FENCE.match(text)
    if match is None or "```" in match.group(1):
        return None
    return match.group(1)


def json_values(text: str) -> JsonValues:
    """Decode every JSON value written one after another in ``text`` (strict JSON).

    ``NaN`` and ``Infinity`` are refused; nesting too deep for the decoder is a parse error.
    """
    values: list[Any] = []
    pos = _JSON_WS.match(text, 0).end()  # type: ignore[union-attr]
    while pos < len(text):
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError as exc:
            return JsonValues(values=tuple(values), error=str(exc), failed_at=pos)
        except RecursionError:
            error = "the JSON is nested too deeply"
            return JsonValues(values=tuple(values), error=error, failed_at=pos)
        values.append(value)
        pos = _JSON_WS.match(text, pos).end()  # type: ignore[union-attr]
    if not values:
        return JsonValues(error="no JSON value found", failed_at=pos)
    return JsonValues(values=tuple(values))


def is_json_data(value: Any) -> bool:
    """True when ``value`` is JSON data: dict (str keys), list, str, int, float, bool, None.

    Non-finite floats are refused; the walk is iterative, so any depth is fine.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif item is not None and not isinstance(item, str | int):
            return False
    return True


def python_literal(text: str) -> Any | None:
    """Read ``text`` as a Python literal and return it if it is JSON data, else ``None``.

    Uses `ast.literal_eval` only (no code runs). Tuples, sets, bytes, complex numbers,
    non-finite floats and side-by-side strings (``"a" "b"``, a missing comma that Python
    would join) are refused, and so is text over `MAX_LITERAL_CHARS` characters.
    """
    if len(text) > MAX_LITERAL_CHARS:
        return None
    try:
        with warnings.catch_warnings():
            # An invalid escape such as '\d' warns; the result is the same either way.
            warnings.simplefilter("ignore")
            value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not is_json_data(value) or _has_implicit_concatenation(text):
        return None
    return value


def _has_implicit_concatenation(text: str) -> bool:
    """True when two string literals stand side by side (``"a" "b"`` reads as ``"ab"``).

    Python joins them silently; in a model's argument text they are a missing comma.
    """
    skipped = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT}
    previous = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type in skipped:
                continue
            if token.type == tokenize.STRING and previous == tokenize.STRING:
                return True
            previous = token.type
    except (tokenize.TokenError, SyntaxError):
        return True
    return False


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "null" if value is None else "object"


def _from_single_value(value: Any, repairs: list[str], *, null_ok: bool) -> DecodedArguments:
    if value is None and null_ok:
        repairs.append(NULL_AS_OBJECT)
        return DecodedArguments(arguments={}, repairs=tuple(repairs))
    if isinstance(value, dict):
        return DecodedArguments(arguments=value, repairs=tuple(repairs))
    if isinstance(value, str):
        inner = json_values(value.strip())
        if inner.error is None and len(inner.values) == 1 and isinstance(inner.values[0], dict):
            repairs.append(DECODED_JSON_STRING)
            return DecodedArguments(arguments=inner.values[0], repairs=tuple(repairs))
    return DecodedArguments(
        repairs=tuple(repairs),
        reason=NOT_AN_OBJECT,
        error=f"the arguments are a JSON {_json_type(value)}, not an object",
    )


def _prose_after(text: str) -> bool:
    """True when ``text`` is one JSON object and then text that is not JSON at all.

    Text after the object that starts like JSON (``{``, ``[``, ``"``, a digit ...) may be a
    second, broken value: that is not guessed apart, and neither is a second object inside.
    """
    end = _end_of_first_value(text)
    rest = text[end:].strip() if end is not None else ""
    if not rest:
        return False
    return rest[0].isalpha() and "{" not in rest


def _end_of_first_value(text: str) -> int | None:
    try:
        _, end = _DECODER.raw_decode(text, _JSON_WS.match(text, 0).end())  # type: ignore[union-attr]
    except (ValueError, RecursionError):
        return None
    return end


def decode_arguments(raw: str, *, null_ok: bool = False) -> DecodedArguments:
    """Decode the argument text of one tool call into a JSON object, repairing what is safe.

    Order: empty -> ``{}``; unwrap one whole code fence; strict JSON (``null`` -> ``{}`` when
    ``null_ok``, a
    JSON string holding an object -> that object); a Python dict literal; one JSON object
    followed by prose (the prose is dropped). Two or more JSON values back to back are never
    guessed apart (``multiple_json_values``).

    Args:
        raw: the argument text exactly as the model sent it.
        null_ok: read JSON ``null`` as ``{}`` (for a tool that needs no argument); otherwise
            ``null`` is ``arguments_not_object``.

    Returns:
        The decoded arguments and repairs, or the failure reason and error text.
    """
    text = raw.strip()
    repairs: list[str] = []
    inner = strip_code_fence(text)
    if inner is not None:
        text = inner.strip()
        repairs.append(UNWRAPPED_FENCE)
    if not text:
        repairs.append(EMPTY_AS_OBJECT)
        return DecodedArguments(arguments={}, repairs=tuple(repairs))
    found = json_values(text)
    if found.error is None:
        if len(found.values) > 1:
            return DecodedArguments(
                repairs=tuple(repairs),
                reason=MULTIPLE_VALUES,
                error=f"the arguments hold {len(found.values)} JSON values",
                count=len(found.values),
            )
        return _from_single_value(found.values[0], repairs, null_ok=null_ok)
    literal = python_literal(text)
    if isinstance(literal, dict):
        repairs.append(PYTHON_LITERAL)
        return DecodedArguments(arguments=literal, repairs=tuple(repairs))
    if len(found.values) == 1 and isinstance(found.values[0], dict) and _prose_after(text):
        repairs.append(DROPPED_TRAILING_TEXT)
        return DecodedArguments(arguments=found.values[0], repairs=tuple(repairs))
    return DecodedArguments(
        repairs=tuple(repairs),
        reason=UNPARSEABLE,
        error=f"the arguments are not valid JSON ({found.error})",
    )


def raw_decode(text: str, pos: int) -> tuple[Any, int]:
    """Decode one strict JSON value at ``text[pos:]``; return it and where it ends.

    Raises:
        ValueError: no valid JSON value starts there (too deep a nesting included).
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError as exc:
        raise ValueError("the JSON is nested too deeply") from exc


def json_prefix(text: str) -> bool:
    """True when ``text`` (stripped) could be the start of a JSON value cut off at its end.

    Checks that brackets and quotes are still open at the end: a cut-off value has more
    openers than closers, a broken one does not.
    """
    depth = 0
    in_string = escaped = False
    for char in text.strip():
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
    return in_string or depth > 0
