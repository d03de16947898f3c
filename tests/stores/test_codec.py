"""Property tests of the record codec: every log record survives encode/decode unchanged."""

from __future__ import annotations

import datetime as dt
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
    text = _codec.record_to_json(record)
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
    assert _codec.record_to_json(record) == _codec.record_to_json(
        _codec.decode(_codec.record_to_json(record))
    )


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
        _codec.check_schema(_codec.decode(_codec.record_to_json(newer)))
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
        assert "images" not in _codec.record_to_json(record)
    ref = types.ImageRef(url="ref:shot", digest="sha256:" + "0" * 64, media_type="image/png")
    with_image = attrs.evolve(result, outcome=attrs.evolve(outcome, images=(ref,)))
    data = _codec.record_to_dict(with_image)
    assert data["outcome"]["images"] == [
        {"url": "ref:shot", "digest": "sha256:" + "0" * 64, "media_type": "image/png"}
    ]
    shown = attrs.evolve(step, observation_images=((ref,),))
    assert _codec.decode(_codec.record_to_json(shown)) == shown
    # an older log's line (no such keys) still decodes
    assert _codec.decode(_codec.record_to_json(step)).observation_images == ()


# --------------------------------------------------------------------------- the compact encoding

RUN = "Run:Q7"
"""A run id the strategies never draw (they draw lower-case ids), so it shows in a body only
where the codec wrote it."""

OWN_ID_FIELDS = {
    types.ModelIntent: ("intent_id",),
    types.ModelResult: ("intent_id",),
    types.ActionIntent: ("intent_id",),
    types.ActionResult: ("intent_id",),
    types.StepRecord: ("model_intent_id", "action_result_ids"),
}


def in_run(record: Record, data: st.DataObject) -> Record:
    """``record`` moved into run `RUN`, its intent ids (some of them) of the run's own form."""
    moved = attrs.evolve(record, run_id=RUN)
    changes: dict[str, object] = {}
    step = getattr(moved, "step", 0)
    for name in OWN_ID_FIELDS.get(type(moved), ()):
        if not data.draw(st.booleans()):
            continue
        number = data.draw(st.integers(min_value=0, max_value=10**6))
        letter = "a" if type(moved) in (types.ActionIntent, types.ActionResult) else "m"
        if name == "action_result_ids":
            changes[name] = tuple(f"{RUN}/s{step}/a{n}" for n in range(1, number % 4 + 1))
        elif isinstance(moved, types.ModelIntent):
            changes[name] = f"{RUN}/s{step}/m{moved.attempt}"
        else:
            changes[name] = f"{RUN}/s{step}/{letter}{number}"
    return attrs.evolve(moved, **changes)


@pytest.mark.parametrize("cls", list(RECORD_STRATEGIES), ids=lambda c: c.__name__)
@given(data=st.data())
def test_compact_round_trip_of_each_record_kind(cls, data):
    record = in_run(data.draw(RECORD_STRATEGIES[cls]), data)
    body = _codec.pack(record, RUN)
    assert b"\n" not in body  # one record, one line
    items = json.loads(body)
    assert isinstance(items, list) and items[0] == _codec.TAG_OF[cls]
    assert _codec.unpack(body, RUN, _codec.TAG_OF[cls]) == record
    assert _codec.unpack(body, RUN) == record  # the body's own tag
    assert _codec.decode_stored(_codec.TAG_OF[cls], body, RUN) == record
    assert _codec.pack(_codec.unpack(body, RUN), RUN) == body  # deterministic


@pytest.mark.parametrize("cls", list(OWN_ID_FIELDS), ids=lambda c: c.__name__)
@given(data=st.data())
def test_the_run_id_is_never_written(cls, data):
    """The row (or the file) names the run; intent ids of the run's own form are numbers."""
    record = data.draw(RECORD_STRATEGIES[cls])
    step = record.step
    own: dict[str, object] = {
        "run_id": RUN,
        "ts": "2026-12-01T21:21:08.255627+00:00",
    }
    if isinstance(record, types.ModelIntent):
        own["intent_id"] = f"{RUN}/s{step}/m{record.attempt}"
    elif isinstance(record, types.ModelResult):
        own["intent_id"] = f"{RUN}/s{step}/m3"
    elif isinstance(record, types.ActionIntent | types.ActionResult):
        own["intent_id"] = f"{RUN}/s{step}/a2"
    else:
        own["model_intent_id"] = f"{RUN}/s{step}/m1"
        own["action_result_ids"] = (f"{RUN}/s{step}/a1", f"{RUN}/s{step}/a2")
    record = attrs.evolve(record, **own)
    body = _codec.pack(record, RUN)
    assert RUN.encode() not in body
    assert b"2026-12-01" not in body  # the instant is a number of microseconds
    assert _codec.unpack(body, RUN) == record


def test_a_step_of_the_instant_workload_is_small():
    """The records of one step of benchmarks/_workload.py, as bench_runtime writes them."""
    ts = "2026-12-01T21:21:08.255627+00:00"
    run = "bench-run-0001"
    call = types.ToolCall(id="c2", name="noop")
    step = [
        types.ModelIntent(run_id=run, step=3, intent_id=f"{run}/s3/m1", attempt=1, ts=ts),
        types.ModelResult(
            run_id=run,
            step=3,
            intent_id=f"{run}/s3/m1",
            ts=ts,
            reply=types.ModelReply(tool_calls=(call,), finish_reason="tool_calls"),
            latency_s=0.001519,
        ),
        types.ActionIntent(
            run_id=run,
            step=3,
            intent_id=f"{run}/s3/a1",
            call_id="c2",
            tool="noop",
            arguments={},
            ts=ts,
        ),
        types.ActionResult(
            run_id=run,
            step=3,
            intent_id=f"{run}/s3/a1",
            call_id="c2",
            tool="noop",
            outcome=types.ActionOutcome(status=types.ActionStatus.EXECUTED, observation="ok"),
            ts=ts,
            duration_s=0.000151,
        ),
        types.StepRecord(
            run_id=run,
            step=3,
            ts=ts,
            model_intent_id=f"{run}/s3/m1",
            decision=types.DecisionKind.ACTIONS,
            history_message=types.Message(role="assistant", tool_calls=(call,)),
            observations=("ok",),
            action_result_ids=(f"{run}/s3/a1",),
            active_s=0.005598,
        ),
    ]
    bodies = [_codec.pack(r, run) for r in step]
    assert bodies == [
        b'["mi",3,1,1796160068255627]',
        b'["mr",3,1,1796160068255627,[[["c2","noop"]],"tool_calls"],0.001519]',
        b'["ai",3,1,"c2","noop",{},1796160068255627]',
        b'["ar",3,1,"c2","noop",["executed","ok"],1796160068255627,0.000151]',
        b'["st",3,1796160068255627,1,"actions",["assistant",null,[["c2","noop"]]],["ok"],[1],'
        b"0.005598]",
    ]
    assert sum(map(len, bodies)) < sum(len(_codec.encode_bytes(r)) for r in step) // 3
    assert [_codec.unpack(b, run) for b in bodies] == step


@given(instant=st.datetimes(timezones=st.just(dt.UTC)))
def test_utc_timestamps_of_the_clocks_form_are_numbers(instant):
    text = instant.isoformat()
    micros = _codec.compact_ts(text)
    assert isinstance(micros, int)
    assert _codec.micros_text(micros) == text
    assert micros == (instant - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(
        microseconds=1
    )


@given(
    instant=st.datetimes(timezones=st.just(dt.UTC)),
    at=st.integers(min_value=0, max_value=31),
    char=st.sampled_from("0123456789:.-+TZ ٨x"),
)
def test_any_text_is_kept_or_given_back_exactly(instant, at, char):
    """A timestamp with one character changed is a number only if it formats back to itself."""
    text = instant.isoformat()
    at = min(at, len(text) - 1)
    changed = text[:at] + char + text[at + 1 :]
    micros = _codec.compact_ts(changed)
    assert micros == changed or _codec.micros_text(int(micros)) == changed


@pytest.mark.parametrize(
    "text",
    [
        "t0",
        "",
        "2026-12-01T21:21:08.255627",  # no offset
        "2026-12-01T21:21:08.255627+01:00",  # another offset
        "2026-12-01T21:21:08.255627Z",
        "2026-12-01T21:21:08.000000+00:00",  # a zero fraction isoformat leaves out
        "2026-12-01T21:21:08.2556+00:00",  # another precision
        "2026-12-01 21:21:08.255627+00:00",
        "2026-12-01T21:21:60.255627+00:00",
        "2026-02-30T21:21:08.255627+00:00",
        "2026-12-01T21:21:0٨.255627+00:00",  # a digit that is not ASCII
        "2026-12-01T21:21:+8.255627+00:00",
    ],
)
def test_other_timestamps_stay_text(text):
    assert _codec.compact_ts(text) == text
    record = types.CancelRequested(run_id="r", ts=text)
    assert json.loads(_codec.pack(record, "r"))[1] == text
    assert _codec.unpack(_codec.pack(record, "r"), "r") == record


@pytest.mark.parametrize(
    "intent_id",
    [
        "r/s1/m01",  # not written plainly
        "r/s1/m",
        "r/s1/m-1",
        "r/s1/m1x",
        "r/s1/m١",  # a digit that is not ASCII
        "r/s2/m1",  # another step's
        "other/s1/m1",  # another run's
        "r/s1/a1",  # an action's id where a model call's goes
        "7",
        "",
    ],
)
def test_intent_ids_of_another_form_stay_text(intent_id):
    result = types.ModelResult(run_id="r", step=1, intent_id=intent_id, ts="t")
    step = types.StepRecord(
        run_id="r",
        step=1,
        ts="t",
        model_intent_id=intent_id,
        decision=None,
        action_result_ids=(intent_id, "r/s1/a1"),
    )
    intent = types.ModelIntent(run_id="r", step=1, intent_id=intent_id, attempt=1, ts="t")
    for record in (result, step, intent):
        body = _codec.pack(record, "r")
        assert json.dumps(intent_id, ensure_ascii=False).encode() in body
        assert _codec.unpack(body, "r") == record


def test_a_run_started_record_keeps_the_schema_version_it_was_written_with():
    """Written even when it is the writer's default: a reader of a later version must not take
    its own default for it."""
    for version in (1, SCHEMA_VERSION):
        record = RunStarted(run_id="r", ts="t", input=(), snapshot={}, schema_version=version)
        items = json.loads(_codec.pack(record, "r"))
        assert items == ["rs", "t", [], {}, version]
    with pytest.raises(ValueError, match="at least length"):
        _codec.unpack(b'["rs","t",[],{}]', "r")


@given(record=run_starteds, extra=st.integers(min_value=1, max_value=1000))
def test_check_schema_refuses_newer_compact_run_starts(record, extra):
    newer = attrs.evolve(record, schema_version=SCHEMA_VERSION + extra)
    with pytest.raises(SchemaTooNew):
        _codec.check_schema(_codec.unpack(_codec.pack(newer, newer.run_id), newer.run_id))


def test_pack_refuses_a_record_of_another_run():
    with pytest.raises(ValueError, match="a record of run 'r' in the log of run 'x'"):
        _codec.pack(types.CancelRequested(run_id="r", ts="t"), "x")


def test_lone_surrogates_are_escaped_and_read_back():
    record = types.CancelRequested(run_id="r", ts="t", reason="\ud800 and \udfff")
    body = _codec.pack(record, "r")
    assert body.isascii() and b"\\ud800" in body
    assert _codec.unpack(body, "r") == record
    assert _codec.unpack(body, "r", "cr") == record


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("mi", b"", "truncated"),
        ("mi", b"not json", "malformed"),
        ("mi", b"{}", "Expected `array`, got `object`"),
        ("mi", b'["mi"]', "at least length"),
        ("mi", b'["mi",1,1,2,null,false,0]', "at most length"),
        ("mi", b'["mi",true,1,2]', "Expected `int`, got `bool`"),
        ("mi", b'["mi",1,1,2.5]', r"Expected `int \| str`, got `float`"),
        ("mi", b'["mr",1,1,2]', "Invalid value 'mr'"),
        ("st", b'["st",1,2,-4,null]', "Expected `int` >= 0"),
        ("st", b'["st",1,2,null,"maybe"]', "Invalid enum value 'maybe'"),
        ("ar", b'["ar",1,1,"c","t",["done","ok"],2]', "Invalid enum value 'done'"),
        ("rf", b'["rf",1,"succeeded","final_answer",[1,2,null,null,0,0.1,7,8]]', "at most length"),
        ("zz", b'["zz"]', "'zz' is not a tag of either encoding"),
        ("cr", b'["cr",100000000000000000000000000]', "no instant of years 1 to 9999"),
        ("cr", b'["cr",-62135596800000001]', "ordinal must be >= 1"),
        (
            "mi",
            b'{"kind":"model_intent","run_id":"r","step":1,"intent_id":"i","attempt":1,"ts":"t"}',
            "Expected `array`, got `object`",
        ),
        ("model_intent", b'["mi",1,1,2]', "a JSON list, not an object"),  # as its tag says
    ],
)
def test_bad_compact_bodies_are_refused(kind, body, message):
    with pytest.raises(Exception, match=message) as info:  # ValueError or a cattrs error
        _codec.decode_stored(kind, body, "r")
    assert not isinstance(info.value, AssertionError)


def test_every_field_has_its_place():
    """`WIRE` names every field of every class once (a record's run id excepted): a field
    added to a record without a place fails here (and at import)."""
    for cls, order in _codec.WIRE.items():
        names = [f.name for f in attrs.fields(cls)]
        if cls in _codec.TAG_OF:
            names.remove("run_id")
        assert sorted(order) == sorted(names), cls.__name__
    nested = {c for c in vars(types).values() if isinstance(c, type) and attrs.has(c)}
    held = set(_codec.WIRE) - set(_codec.TAG_OF)
    assert held <= nested
    assert set(_codec.TAG_OF) == set(typing.get_args(Record))
    assert len(set(_codec.TAG_OF.values())) == len(_codec.TAG_OF)
    assert not set(_codec.TAG_OF.values()) & set(_codec.KIND_OF.values())
