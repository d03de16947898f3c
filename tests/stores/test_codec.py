"""Property tests of the record codec: every log record survives encode/decode unchanged."""

from __future__ import annotations

import json
import typing

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.strategies import BUILT, RECORD_STRATEGIES, missing_fields, records, run_starteds

from treadle import types
from treadle._exceptions import SchemaTooNew
from treadle.stores import _codec
from treadle.types import SCHEMA_VERSION, Record, RunStarted


def test_every_record_class_has_a_strategy_and_a_tag():
    members = set(typing.get_args(Record))
    assert set(RECORD_STRATEGIES) == members
    assert set(_codec.KIND_OF) == members


@pytest.mark.parametrize("cls", list(BUILT), ids=lambda c: c.__name__)
def test_strategies_set_every_field(cls):
    assert missing_fields(cls) == [], f"tests/strategies.py: add these {cls.__name__} fields"


def test_every_attrs_class_of_types_has_a_strategy():
    classes = {c for c in vars(types).values() if isinstance(c, type) and attrs.has(c)}
    assert classes - set(BUILT) == set()


@pytest.mark.parametrize("cls", list(RECORD_STRATEGIES), ids=lambda c: c.__name__)
@given(data=st.data())
def test_round_trip_of_each_record_kind(cls, data):
    record = data.draw(RECORD_STRATEGIES[cls])
    text = _codec.encode(record)
    assert "\n" not in text  # one record, one line (JSONL stores rely on it)
    assert json.loads(text)["kind"] == _codec.KIND_OF[cls]
    assert _codec.decode(text) == record
    assert _codec.decode(text.encode()) == record


@given(record=records)
def test_dict_round_trip(record):
    data = _codec.record_to_dict(record)
    assert _codec.record_from_dict(data) == record
    assert _codec.record_to_dict(_codec.record_from_dict(data)) == data


@given(record=records)
def test_encoding_is_deterministic(record):
    assert _codec.encode(record) == _codec.encode(_codec.decode(_codec.encode(record)))


@given(record=run_starteds, extra=st.integers(min_value=1, max_value=1000))
def test_check_schema_refuses_newer_versions_only(record, extra):
    _codec.check_schema(record)  # the strategy stays within SCHEMA_VERSION
    newer = RunStarted(
        run_id=record.run_id,
        ts=record.ts,
        input=record.input,
        snapshot=record.snapshot,
        schema_version=SCHEMA_VERSION + extra,
    )
    with pytest.raises(SchemaTooNew) as info:
        _codec.check_schema(_codec.decode(_codec.encode(newer)))
    assert info.value.version == SCHEMA_VERSION + extra


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        '{"run_id": "r"}',
        '{"kind": "no_such_kind", "run_id": "r"}',
        '{"kind": "model_intent", "run_id": "r", "step": 1, "intent_id": "i", "attempt": 1}',
        '{"kind": "model_intent", "run_id": "r", "step": 1, "intent_id": "i", "attempt": 1, '
        '"ts": "t", "typo": 1}',
        '{"kind": "model_intent", "run_id": "r", "step": "one", "intent_id": "i", '
        '"attempt": 1, "ts": "t"}',
    ],
)
def test_bad_input_raises(text):
    with pytest.raises(Exception) as info:  # the codec raises several types
        _codec.decode(text)
    assert not isinstance(info.value, AssertionError)


def test_tool_images_are_left_out_when_empty_and_kept_as_references():
    """Records without tool images encode as before; with them, only references are stored."""
    outcome = types.ActionOutcome(status=types.ActionStatus.EXECUTED, observation="ok")
    result = types.ActionResult(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="t", outcome=outcome, ts="t0"
    )
    step = types.StepRecord(
        run_id="r", step=1, ts="t0", model_intent_id=None, decision=None, observations=("ok",)
    )
    for record in (result, step):
        assert "images" not in _codec.encode(record)
    ref = types.ImageRef(url="ref:shot", digest="sha256:" + "0" * 64, media_type="image/png")
    with_image = attrs.evolve(result, outcome=attrs.evolve(outcome, images=(ref,)))
    data = _codec.record_to_dict(with_image)
    assert data["outcome"]["images"] == [
        {"url": "ref:shot", "digest": "sha256:" + "0" * 64, "media_type": "image/png"}
    ]
    shown = attrs.evolve(step, observation_images=((ref,),))
    assert _codec.decode(_codec.encode(shown)) == shown
    # an older log's line (no such keys) still decodes
    assert _codec.decode(_codec.encode(step)).observation_images == ()
