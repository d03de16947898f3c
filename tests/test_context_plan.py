"""The context budget's pure parts: truncation and the plan of what stays (docs/context.md)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from treadle._budget import (
    Compact,
    Fitted,
    Group,
    Meter,
    Summary,
    cut_summary,
    fit_text,
    plan,
    summary_cap,
    summary_messages,
)
from treadle.types import Message, ToolCall

MARK = "[cut]"


@given(text=st.text(), room=st.integers(min_value=0, max_value=300))
def test_fit_text_never_exceeds_its_room_and_keeps_a_prefix(text, room):
    out = fit_text(text, room, MARK)
    assert len(out) <= max(room, 0)
    out.encode("utf-8")  # whole characters only: always encodable
    if len(text) <= room:
        assert out == text
    elif room > len(MARK) + 1:
        assert out.endswith(MARK)
        assert text.startswith(out[: -len(MARK) - 1])


def test_fit_text_never_splits_a_multibyte_character():
    text = "é" * 50 + "😀" * 50
    out = fit_text(text, 80, MARK)
    assert out.encode("utf-8").decode("utf-8") == out
    assert len(out) <= 80
    assert out.endswith("\n" + MARK)


def test_fit_text_never_splits_a_surrogate_pair():
    text = "a" * 9 + "\ud83d\ude00" + "b" * 20
    out = fit_text(text, 10 + len(MARK) + 1, MARK)
    head = out[: -len(MARK) - 1]
    assert not ("\ud800" <= head[-1] <= "\udbff")


@given(
    items=st.lists(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), max_size=30),
    room=st.integers(min_value=10, max_value=400),
)
def test_fit_text_keeps_json_arrays_valid(items, room):
    text = json.dumps(items)
    out = fit_text(text, room, MARK)
    assert len(out) <= room
    if out != text:
        head = out[: -len(MARK) - 1]
        kept = json.loads(head)
        assert _is_head(kept, items)
        if len(kept) > 1 or kept == items[:1]:
            assert kept == items[: len(kept)]  # whole leading elements, none cut inside


def _is_head(cut, whole) -> bool:
    """``cut`` is ``whole``'s head: its leading elements whole, the last one a head too."""
    if isinstance(whole, str):
        return isinstance(cut, str) and whole.startswith(cut)
    if isinstance(whole, list | dict):
        if type(cut) is not type(whole) or len(cut) > len(whole):
            return False
        pairs = (
            list(zip(cut, whole, strict=False))
            if isinstance(whole, list)
            else [(cut[k], whole[k]) for k in cut]
        )
        if isinstance(whole, dict) and list(cut) != list(whole)[: len(cut)]:
            return False
        return all(c == w for c, w in pairs[:-1]) and (not pairs or _is_head(*pairs[-1]))
    return cut == whole


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=60),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=40,
)


@given(
    value=st.lists(_JSON, min_size=1) | st.dictionaries(st.text(max_size=6), _JSON, min_size=1),
    room=st.integers(min_value=10, max_value=300),
)
def test_fit_text_keeps_the_head_of_a_json_value_valid(value, room):
    text = json.dumps(value, ensure_ascii=False)
    out = fit_text(text, room, MARK)
    assert len(out) <= room
    if out != text and len(out) > len(MARK):
        assert _is_head(json.loads(out[: -len(MARK) - 1]), value)


def test_a_json_value_whose_first_element_does_not_fit_keeps_its_head():
    # `{"rows": [2000 rows], "total": 2000}` over the limit was recorded as `{}` and
    # `["a" * 30000, "tail"]` as `[]`: the model saw nothing of either.
    rows = {"rows": [{"id": i, "name": "n" * 30} for i in range(2000)], "total": 2000}
    kept = json.loads(fit_text(json.dumps(rows), 5000, MARK)[: -len(MARK) - 1])
    assert kept["rows"] == rows["rows"][: len(kept["rows"])] and len(kept["rows"]) > 80
    text = json.loads(fit_text(json.dumps(["a" * 30000, "tail"]), 200, MARK)[: -len(MARK) - 1])
    assert text == ["a" * len(text[0])] and len(text[0]) > 100


def test_fit_text_keeps_json_objects_valid():
    value = {f"key{i}": "v" * i for i in range(40)}
    out = fit_text(json.dumps(value), 200, MARK)
    kept = json.loads(out[: -len(MARK) - 1])
    assert kept == {k: value[k] for k in list(value)[: len(kept)]}
    assert len(out) <= 200


def test_fit_text_reserves_room_for_its_marker():
    out = fit_text("x" * 100, 20, MARK)
    assert out.endswith(MARK) and len(out) == 20
    assert fit_text("x" * 100, 3, MARK) == MARK[:3]


def _group(step: int, size: int) -> Group:
    call = ToolCall(id=f"c{step}", name="fetch", arguments={"n": step})
    return Group(
        step=step,
        messages=(
            Message(role="assistant", tool_calls=(call,)),
            Message(
                role="tool", content=f"n={step} " + "x" * size, tool_call_id=call.id, name="fetch"
            ),
        ),
    )


HEAD = (Message(role="system", content="rules"), Message(role="user", content="the task"))


def test_everything_fits_unchanged():
    groups = [_group(s, 30) for s in range(1, 4)]
    fitted = plan(
        head=HEAD, groups=groups, summary=None, budget=10_000, fixed_tokens=0, meter=Meter()
    )
    assert isinstance(fitted, Fitted)
    assert fitted.messages == (*HEAD, *(m for g in groups for m in g.messages))
    assert fitted.verbatim_from == 1 and fitted.marked == 0


def test_old_observations_become_markers_before_any_summary():
    groups = [_group(s, 600) for s in range(1, 6)]
    meter = Meter()
    whole = plan(head=HEAD, groups=groups, summary=None, budget=10_000, fixed_tokens=0, meter=meter)
    assert isinstance(whole, Fitted)
    budget = whole.tokens - 150  # one marker's worth less
    fitted = plan(
        head=HEAD, groups=groups, summary=None, budget=budget, fixed_tokens=0, meter=meter
    )
    assert isinstance(fitted, Fitted)
    assert fitted.marked == 1 and (fitted.marked_from, fitted.marked_to) == (1, 1)  # the oldest
    assert fitted.summary is None
    assert fitted.messages[-1] == groups[-1].messages[-1]  # the newest stays verbatim


def test_a_summary_is_asked_for_when_markers_are_not_enough():
    groups = [_group(s, 600) for s in range(1, 21)]
    fitted = plan(head=HEAD, groups=groups, summary=None, budget=900, fixed_tokens=0, meter=Meter())
    assert isinstance(fitted, Compact)
    assert fitted.after is None
    assert [g.step for g in fitted.groups] == list(range(1, fitted.through + 1))
    assert fitted.through < 20  # the newest steps are kept verbatim, never summarised


def test_with_the_summary_the_request_fits_in_order():
    groups = [_group(s, 600) for s in range(1, 21)]
    first = plan(head=HEAD, groups=groups, summary=None, budget=900, fixed_tokens=0, meter=Meter())
    assert isinstance(first, Compact)
    summary = Summary(intent_id="r/s21/m1", through=first.through, text="Facts: n=1 (step 1).")
    fitted = plan(
        head=HEAD, groups=groups, summary=summary, budget=900, fixed_tokens=0, meter=Meter()
    )
    assert isinstance(fitted, Fitted)
    assert fitted.tokens <= 900
    assert fitted.messages[:2] == HEAD  # instructions and input first
    assert fitted.messages[2].content.startswith(f"[Summary of steps 1-{first.through}")
    assert fitted.verbatim_from == first.through + 1
    # a call and its result are never split
    calls = [c.id for m in fitted.messages for c in m.tool_calls]
    answers = [m.tool_call_id for m in fitted.messages if m.role == "tool"]
    assert calls == answers


def test_an_overlong_summary_is_measured_as_it_is_sent():
    # The fit check measured a summary longer than its room whole, though the request sends
    # it cut to the room: it never fit, so every old observation became a marker (and every
    # step with more steps than fit beside it planned a new summary).
    groups = [_group(s, 300) for s in range(1, 6)]
    summary = Summary(intent_id="r/s4/m1", through=2, text="Facts: n=2 (step 2). " * 800)
    fitted = plan(
        head=HEAD, groups=groups, summary=summary, budget=1072, fixed_tokens=0, meter=Meter()
    )
    assert isinstance(fitted, Fitted)
    assert fitted.tokens <= 1072 and fitted.verbatim_from == 3 and fitted.marked == 0
    assert (fitted.messages[2].content or "").endswith("[summary cut to fit]")


def test_a_summary_as_long_as_its_room_leaves_the_next_step_room():
    # A compaction kept every step that fitted beside a summary as long as its room: one that
    # long left no room, and the next step planned a summary again (one a step).
    meter = Meter()
    groups = [_group(s, 600) for s in range(1, 41)]
    first = plan(head=HEAD, groups=groups, summary=None, budget=1072, fixed_tokens=0, meter=meter)
    assert isinstance(first, Compact)
    text = fit_text("Facts: n=1 (step 1). " * 400, 10_000, "[end]")
    long = cut_summary(
        Summary(intent_id="r/s41/m1", through=first.through, text=text), summary_cap(1072), meter
    )
    after = plan(head=HEAD, groups=groups, summary=long, budget=1072, fixed_tokens=0, meter=meter)
    assert isinstance(after, Fitted)
    following = [*groups, _group(41, 600)]
    again = plan(
        head=HEAD, groups=following, summary=long, budget=1072, fixed_tokens=0, meter=meter
    )
    assert isinstance(again, Fitted), again  # no new summary at the next step
    assert again.tokens <= 1072


def test_forced_compaction_keeps_only_the_newest_step():
    groups = [_group(s, 30) for s in range(1, 6)]
    fitted = plan(
        head=HEAD,
        groups=groups,
        summary=None,
        budget=10_000,
        fixed_tokens=0,
        meter=Meter(),
        force=True,
    )
    assert isinstance(fitted, Compact)
    assert fitted.through == 4


def test_a_newest_step_too_large_is_truncated_not_dropped():
    groups = [_group(1, 20_000)]
    fitted = plan(head=HEAD, groups=groups, summary=None, budget=500, fixed_tokens=0, meter=Meter())
    assert isinstance(fitted, Fitted)
    assert fitted.truncated == 1
    tool = fitted.messages[-1]
    assert tool.role == "tool" and tool.content.startswith("n=1 ")  # the fact at its head stays
    assert "call fetch again" in tool.content
    assert fitted.tokens <= 500


def _one_token_a_char(messages) -> int:
    """A tokenizer's count of dense text (CJK, compact JSON): a token a character, 4 a message."""
    return sum(len(m.content or "") + 4 for m in messages)


def test_truncation_fits_the_budget_by_the_counter_in_use():
    # With a counter that puts a character in a token, the newest step was cut to the
    # characters the default estimate (3 a token) gives its room, 3 times too many; the
    # request was left at about 3,000 of 1,072 tokens and marked `unfit`.
    rows = json.dumps(
        [{"id": i, "name": "日本語のテキスト"} for i in range(500)], ensure_ascii=False
    )
    call = ToolCall(id="c1", name="fetch", arguments={})
    group = Group(
        step=1,
        messages=(
            Message(role="assistant", tool_calls=(call,)),
            Message(role="tool", content=rows, tool_call_id="c1", name="fetch"),
        ),
    )
    meter = Meter(counter=_one_token_a_char)
    fitted = plan(head=HEAD, groups=[group], summary=None, budget=1072, fixed_tokens=0, meter=meter)
    assert isinstance(fitted, Fitted)
    assert fitted.tokens <= 1072 and not fitted.unfit
    assert fitted.truncated == 1
    assert _one_token_a_char(fitted.messages) > 1000  # cut to the room, not far below it
    body = (fitted.messages[-1].content or "").rpartition("\n")[0]
    assert _is_head(json.loads(body), json.loads(rows))


def test_an_overlong_summary_is_cut_to_its_room_by_the_counter_in_use():
    summary = Summary(intent_id="r/s9/m1", through=8, text="Facts: 事実. " * 2000)
    meter = Meter(counter=_one_token_a_char)
    cut = cut_summary(summary, 500, meter)
    assert cut.text.endswith("[summary cut to fit]")
    assert 450 < meter.tokens([Message(role="user", content=cut.text)]) <= 500
    assert summary.text.startswith(cut.text[: -len("[summary cut to fit]") - 1])


def test_calibration_scales_the_count():
    meter = Meter()
    messages = [Message(role="user", content="x" * 300)]
    raw = meter.tokens(messages)
    meter.calibrate(raw, raw * 2)
    assert meter.tokens(messages) == raw * 2
    meter.calibrate(raw, raw * 1000)  # a wild report is clamped
    assert meter.tokens(messages) <= raw * 8


def test_the_summariser_request_cites_the_run_input_and_the_earlier_summary():
    previous = Summary(intent_id="r/s5/m1", through=4, text="Goal: count (step 1).")
    messages = summary_messages(
        prompt="PROMPT", head=HEAD, previous=previous, groups=[_group(5, 10)], max_chars=10_000
    )
    assert messages[0].content == "PROMPT"
    text = messages[1].content or ""
    assert "the task" in text and "Goal: count (step 1)." in text
    assert "## Step 5" in text and "fetch" in text and "[call c5]" in text


OPENAI_BODY = {
    "error": {
        "message": "This model's maximum context length is 8192 tokens. However, your "
        "messages resulted in 9013 tokens.",
        "type": "invalid_request_error",
        "code": "context_length_exceeded",
    }
}
ANTHROPIC_BODY = {
    "type": "error",
    "error": {
        "type": "invalid_request_error",
        "message": "prompt is too long: 210000 tokens > 200000 maximum",
    },
}


def test_context_length_errors_are_recognised_from_both_providers_bodies():
    from treadle.models._accumulate import classify_failure, error_fields
    from treadle.models._anthropic_stream import classify_anthropic

    message, code, type_ = error_fields(OPENAI_BODY)
    assert classify_failure(status=400, code=code, type_=type_, message=message) == (
        "context_length_exceeded",
        False,
    )
    message, _, type_ = error_fields(ANTHROPIC_BODY)
    assert classify_anthropic(status=400, type_=type_, message=message) == (
        "context_length_exceeded",
        False,
    )


def test_the_stated_window_is_read_from_both_providers_messages():
    from treadle._budget import window_from_error
    from treadle.models._accumulate import error_fields

    assert window_from_error(error_fields(OPENAI_BODY)[0]) == 8192
    assert window_from_error(error_fields(ANTHROPIC_BODY)[0]) == 200000
    assert window_from_error("HTTP 400: maximum context length is 131,072 tokens") == 131072
    assert window_from_error("HTTP 400: bad request") is None


def test_cutting_a_deeply_nested_json_value_reads_about_the_room_not_its_size(monkeypatch):
    # A 1 MB string nested 200 arrays deep was written out again at each level (size times
    # depth: seconds of a blocked event loop for one observation).
    from treadle import _budget

    written = []
    dumped = _budget._dumped

    def counting(value):
        text = dumped(value)
        written.append(len(text))
        return text

    monkeypatch.setattr(_budget, "_dumped", counting)
    value = "x" * 1_000_000
    for _ in range(200):
        value = [value]
    out = fit_text(json.dumps(value), 4000, MARK)
    kept = json.loads(out[: -len(MARK) - 1])
    assert _is_head(kept, value)
    assert sum(written) < 200 * 4000  # far from 200 levels x 1 MB
