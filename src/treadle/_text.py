"""Text entering a run's log made valid Unicode (docs/crash-safety.md, "Text that is not Unicode").

A Python ``str`` may hold surrogate code points (U+D800 to U+DFFF) that no UTF-8 encoder
accepts: a file name decoded with ``surrogateescape`` in a tool's output, or an escaped lone
surrogate in a server's JSON. Such text in a model request makes the request impossible to
send, so a run holding it in its history could never take another step. Every boundary where
outside text enters the log (model replies and errors, tool outcomes, approval decisions,
cancel requests, run input) passes it through `valid_unicode` first: a surrogate pair becomes
the character it encodes, a lone surrogate becomes U+FFFD, and the record counts the
replacements in its ``surrogates_replaced`` field.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Mapping
from typing import Any, Final, TypeVar

import attrs

from treadle.types import (
    ActionResult,
    ApprovalDecided,
    CancelRequested,
    ModelResult,
    RunStarted,
)

REPLACEMENT = "\ufffd"
"""What a lone surrogate becomes."""

T = TypeVar("T")

_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> tuple[str, int]:
    """``text`` as valid Unicode, and how many surrogate code points it held.

    A surrogate pair (high then low) is joined into the character it encodes; a lone
    surrogate becomes U+FFFD. Text without surrogates is returned as is (the same object).
    """
    if text.isascii():
        return text, 0
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return text, 0
    fixed = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return fixed, len(_SURROGATE.findall(text))


def valid_unicode(value: T) -> tuple[T, int]:
    """``value`` with every string in it made valid Unicode (`valid_text`), and the count.

    Walks strings, mappings (keys and values), lists, tuples and attrs instances (the records
    and their parts); anything else (numbers, enums, ``None``) is returned as is. An object
    with nothing to replace is returned as is (the same object).
    """
    if not holds_surrogates(value):  # the common case, checked without building anything
        return value, 0
    fixed, count = _walk(value)
    return fixed, count


_NO_TEXT: Final = re.compile(r"\A(?:\s*(?:int|float|bool|None)\s*\|?)+\Z")
"""A field annotation that can hold no text (``int | None``, ``float``, ``bool`` ...)."""


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """The fields of an attrs class that may hold text (numbers and flags left out)."""
    return tuple(
        field.name
        for field in attrs.fields(cls)
        if not (isinstance(field.type, str) and _NO_TEXT.match(field.type))
        and field.type not in (int, float, bool)
    )


_NOTHING_TO_WALK: Final = frozenset({type(None), int, float, bool})
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {}
"""attrs class -> its fields that may hold text (`_field_names`), looked up without a call."""


def holds_surrogates(value: Any) -> bool:
    """Whether any string in ``value`` holds a surrogate code point (text no UTF-8 encodes).

    Walks what `valid_unicode` walks, building nothing.
    """
    kind = type(value)
    if kind is str:
        return not value.isascii() and _SURROGATE.search(value) is not None
    if kind in _NOTHING_TO_WALK:
        return False
    # Loops, not any(...): no generator frame per value (this runs on every result).
    if kind is dict:
        for key, item in value.items():  # noqa: SIM110
            if holds_surrogates(key) or holds_surrogates(item):
                return True
        return False
    if kind is tuple or kind is list:
        for item in value:  # noqa: SIM110
            if holds_surrogates(item):
                return True
        return False
    names = _TEXT_FIELDS.get(kind)
    if names is None and attrs.has(kind):
        names = _TEXT_FIELDS[kind] = _field_names(kind)
    if names is not None:
        for name in names:  # noqa: SIM110
            if holds_surrogates(getattr(value, name)):
                return True
        return False
    if isinstance(value, enum.Enum):
        return False
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, Mapping):
        return any(holds_surrogates(k) or holds_surrogates(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds_surrogates(item) for item in value)
    return False


def _walk(value: Any) -> tuple[Any, int]:
    if isinstance(value, enum.Enum):
        return value, 0
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, Mapping):
        total = 0
        items: list[tuple[Any, Any]] = []
        for key, item in value.items():
            new_key, kc = _walk(key)
            new_item, ic = _walk(item)
            total += kc + ic
            items.append((new_key, new_item))
        return (dict(items), total) if total else (value, 0)
    if isinstance(value, list | tuple):
        total = 0
        parts: list[Any] = []
        for item in value:
            new_item, count = _walk(item)
            total += count
            parts.append(new_item)
        if not total:
            return value, 0
        return (parts if isinstance(value, list) else tuple(parts)), total
    if attrs.has(type(value)):
        total = 0
        changes: dict[str, Any] = {}
        for field in attrs.fields(type(value)):
            if not field.init:
                continue
            new, count = _walk(getattr(value, field.name))
            if count:
                total += count
                changes[field.alias or field.name] = new
        return (attrs.evolve(value, **changes), total) if total else (value, 0)
    return value, 0


R = TypeVar("R", RunStarted, ModelResult, ActionResult, CancelRequested, ApprovalDecided)


def repaired(record: R) -> R:
    """``record`` made valid Unicode, its ``surrogates_replaced`` field raised by the count.

    One with nothing to replace is returned as is.
    """
    fixed, count = valid_unicode(record)
    if not count:
        return record
    return attrs.evolve(fixed, surrogates_replaced=record.surrogates_replaced + count)


def loads_json(data: str | bytes) -> Any:
    """Decode JSON from outside the process (a server's body, a person's edit) with the stdlib.

    ``NaN`` and big integers read exactly.

    Raises:
        ValueError: ``data`` is not JSON, or nests deeper than the decoder can follow (its
            `RecursionError`, about a thousand levels: outside data must not crash the run
            or the command that reads it).
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("the JSON nests too deeply to be decoded") from None


COUNT_DIGITS: Final = 19
"""The most digits of a count read from outside text (a 64-bit count has 19)."""

_COUNT: Final = re.compile(rf"[0-9]{{1,{COUNT_DIGITS}}}")


def read_count(text: str) -> int | None:
    """``text`` read as a count from outside (an event id's seq, the step a form names).

    Only 1 to `COUNT_DIGITS` ASCII digits are one: no sign, space, ``_`` or other digits
    (``int`` reads ``" 3"``, ``"1_0"`` and ``"\u0663"``, and takes seconds over, or refuses,
    thousands of digits). ``None`` for anything else.
    """
    return int(text) if _COUNT.fullmatch(text) else None


def require_text(what: str, value: object, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a ``str`` (or ``None`` when ``optional``).

    For text a caller hands to a run's log (a cancel's reason, a rejection's message): the
    record would be written with a value its decoder refuses, and the log would read as
    damaged from then on.

    Raises:
        treadle.UsageError: names ``what`` and the value's type.
    """
    if isinstance(value, str) or (optional and value is None):
        return
    from treadle._exceptions import UsageError  # (the exceptions module imports types)

    wanted = "a str or None" if optional else "a str"
    raise UsageError(f"{what} must be {wanted}, not {type(value).__name__} {value!r:.80}")
