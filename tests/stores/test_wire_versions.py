"""The wire shape of log records is pinned to the versions an older treadle checks.

An older treadle decodes records refusing any field or tag it does not know, so a record of a
new shape reads to it as damage (`LogCorrupted`), and its ``treadle repair`` cuts it. It
refuses a store of a newer version (`SchemaTooNew`) instead, and only if the version was
raised with the shape: this test fails when the shape changes while the versions stay
(docs/crash-safety.md, "Versions"; docs/decisions/0110-the-wire-shape-is-pinned-to-the-versions.md).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import attrs

from treadle.stores import _codec, _sql
from treadle.stores._jsonl_files import FORMAT_VERSION
from treadle.types import SCHEMA_VERSION, ActionOutcome, Totals

Versions = tuple[int, int, int]
"""``(SCHEMA_VERSION, _sql.LAYOUT_VERSION, FORMAT_VERSION)``."""

PINNED: dict[Versions, str] = {
    (3, 4, 4): "0b884a55466c4cc122de507797e0698da2a9a80f279ccfe0144f01dd947f2190",
}
"""The fingerprint (`fingerprint`) of the wire shape each set of versions was released with.

Entries are never changed or removed: a new shape gets new versions and a new entry."""


def wire_shape(wire: dict[type[Any], tuple[str, ...]]) -> dict[str, Any]:
    """What an older reader's decoders depend on, as JSON data.

    ``compact``: each class of ``wire`` (nested shapes and records) with its tag and its
    fields in the order they are written; ``objects``: the field names of each class in the
    JSON-object encoding (format-2 files, control streams), where order does not matter.
    """
    compact = {cls.__name__: [_codec.TAG_OF.get(cls, ""), *fields] for cls, fields in wire.items()}
    objects = {
        cls.__name__: [_codec.KIND_OF.get(cls, ""), *sorted(f.name for f in attrs.fields(cls))]
        for cls in wire
    }
    return {"compact": compact, "objects": objects}


def fingerprint(wire: dict[type[Any], tuple[str, ...]]) -> str:
    """The SHA-256 of `wire_shape`, as hexadecimal text."""
    text = json.dumps(wire_shape(wire), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_wire_shape_is_pinned_to_the_versions() -> None:
    versions = (SCHEMA_VERSION, _sql.LAYOUT_VERSION, FORMAT_VERSION)
    found = fingerprint(_codec.WIRE)
    pinned = PINNED.get(versions)
    shape = json.dumps(wire_shape(_codec.WIRE), indent=1, sort_keys=True)
    assert pinned is not None, (
        f"no wire shape is pinned to the versions {versions} (SCHEMA_VERSION, LAYOUT_VERSION, "
        f"FORMAT_VERSION): add `{versions}: {found!r}` to PINNED once the shape they "
        'stand for is final (docs/crash-safety.md, "Versions")'
    )
    assert found == pinned, (
        f"the wire shape of log records changed, but the versions {versions} did not: an "
        "older treadle of these versions would read the new records as damage (LogCorrupted) "
        "instead of refusing the store (SchemaTooNew). Raise treadle.types.SCHEMA_VERSION, "
        "treadle.stores._sql.LAYOUT_VERSION and treadle.stores._jsonl_files.FORMAT_VERSION; "
        "mark a store of the older layout with the new one when it is opened (the migration "
        "in stores/sqlite.py `_ensure_layout` and stores/postgres.py `_ensure_schema`, with "
        "a test that an old-layout store opened is marked); then add the new versions and "
        f'{found!r} to PINNED (docs/crash-safety.md, "Versions"). The shape now:\n{shape}'
    )


def test_pinned_versions_only_grow() -> None:
    order = sorted(PINNED)
    for older, newer in itertools.pairwise(order):
        assert all(a < b for a, b in zip(older, newer, strict=True)), (older, newer)
    assert order[-1] == (SCHEMA_VERSION, _sql.LAYOUT_VERSION, FORMAT_VERSION)


def test_the_fingerprint_sees_a_field_added_and_fields_reordered() -> None:
    added = {**_codec.WIRE, Totals: (*_codec.WIRE[Totals], "new_field")}
    swapped = list(_codec.WIRE[ActionOutcome])
    swapped[-2:] = swapped[-1], swapped[-2]
    reordered = {**_codec.WIRE, ActionOutcome: tuple(swapped)}
    fingerprints = {fingerprint(w) for w in (_codec.WIRE, added, reordered)}
    assert len(fingerprints) == 3
