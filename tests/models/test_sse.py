"""The incremental SSE decoder: line endings, comments, fields, UTF-8, end of stream."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treadle.models import SSEDecodeError, SSEDecoder, SSEEvent
from treadle.models._sse import MAX_EVENT_BYTES


def decode(*reads: bytes) -> tuple[list[SSEEvent], bool]:
    decoder = SSEDecoder()
    events = [event for chunk in reads for event in decoder.feed(chunk)]
    return events, decoder.close()


def datas(*reads: bytes) -> list[str]:
    events, _ = decode(*reads)
    return [event.data for event in events]


def test_one_event_per_blank_line():
    assert datas(b"data: a\n\ndata: b\n\n") == ["a", "b"]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending(eol):
    body = b"data: a" + eol + eol + b"data: b" + eol + eol
    assert datas(body) == ["a", "b"]


def test_crlf_split_between_cr_and_lf_is_one_terminator():
    events, truncated = decode(b"data: a\r", b"\n\r", b"\ndata: b\r\n", b"\r", b"\n")
    assert [e.data for e in events] == ["a", "b"]
    assert truncated is False


def test_crlf_split_inside_a_multiline_event_does_not_end_it():
    assert datas(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == ["a\nb"]


def test_a_read_holding_only_the_lf_of_a_crlf_pair_ends_the_skip():
    # CRLF ends the field line, a lone LF the event: the LF read alone, then the blank line
    assert datas(b"data: a\r", b"\n", b"\ndata: b\r\n\n") == ["a", "b"]
    assert datas(*[bytes([b]) for b in b"data: a\r\n\ndata: b\r\n\n"]) == ["a", "b"]


def test_a_cr_before_a_partial_line_does_not_skip_the_next_reads_lf():
    # the CR ended "data: a"; the LF after "data: b" is that line's end, not the CR's pair
    assert datas(b"data: a\rdata: b", b"\n\n") == ["a\nb"]


def test_cr_then_cr_across_reads_is_two_line_ends():
    assert datas(b"data: a\r", b"\r") == ["a"]


@pytest.mark.parametrize(
    "body",
    [
        b": PROCESSING\n\ndata: x\n\n",
        b"data: x\n\n: ping - 2026-11-30 12:00:01\n\n",
        b":\n\ndata: x\n\n",
        b":ping\ndata: x\n\n",
        b"data: x\n:inside\n\n",
    ],
)
def test_comments_are_ignored_anywhere(body):
    events, truncated = decode(body)
    assert [e.data for e in events] == ["x"]
    assert truncated is False


def test_comments_are_counted_but_never_dispatch():
    decoder = SSEDecoder()
    assert decoder.feed(b": a\n\n:\n\n: b\n") == []
    assert decoder.comments == 3
    assert decoder.close() is False


def test_multiline_data_is_joined_with_lf():
    assert datas(b'data: {"a":\ndata:1}\n\n') == ['{"a":\n1}']


def test_only_one_space_after_the_colon_is_removed():
    assert datas(b"data:x\n\ndata:  y\n\n") == ["x", " y"]


def test_field_without_colon_has_empty_value():
    assert datas(b"data\n\n") == [""]


def test_event_id_and_retry_fields():
    events, _ = decode(b"event: error\nid: 7\nretry: 1500\ndata: boom\n\ndata: next\n\n")
    assert events[0] == SSEEvent(data="boom", event="error", id="7", retry_ms=1500)
    assert events[1] == SSEEvent(data="next", event="message", id="7", retry_ms=None)


def test_block_without_data_dispatches_nothing():
    assert datas(b"event: ping\n\nid: 3\n\n") == []


def test_unknown_fields_are_ignored():
    assert datas(b"foo: bar\ndata: x\n\n") == ["x"]


def test_leading_bom_is_skipped_even_when_split():
    assert datas(b"\xef", b"\xbb", b"\xbfdata: x\n\n") == ["x"]
    assert datas(b"data: \xef\xbb\xbfx\n\n") == ["\ufeffx"]


def test_utf8_split_inside_characters_across_reads():
    body = "data: Grüße aus 東京 🌏!\n\n".encode()
    reads = [body[i : i + 1] for i in range(len(body))]
    assert datas(*reads) == ["Grüße aus 東京 🌏!"]


def test_unicode_line_separators_are_not_line_ends():
    value = "a\u0085b\u2028c\x0bd\x0ce\x1cf"
    assert datas(f"data: {value}\n\n".encode()) == [value]


def test_invalid_utf8_raises_with_offset():
    decoder = SSEDecoder()
    decoder.feed(b"data: ok\n\n")
    with pytest.raises(SSEDecodeError) as info:
        decoder.feed(b"data: \xff\xfe\n")
    assert info.value.offset == len(b"data: ok\n\n")


def test_unterminated_final_event_is_discarded_and_reported():
    events, truncated = decode(b'data: a\n\ndata: {"cut')
    assert [e.data for e in events] == ["a"]
    assert truncated is True


def test_complete_line_without_blank_line_is_discarded_and_reported():
    events, truncated = decode(b"data: a\n\ndata: b\n")
    assert [e.data for e in events] == ["a"]
    assert truncated is True


def test_clean_end_reports_no_truncation():
    assert decode(b"data: a\n\n: bye\n")[1] is False
    assert decode(b"")[1] is False


# --------------------------------------------------------------------------- properties

values = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)))
names = st.text(st.characters(whitelist_categories=("Ll",)), min_size=1, max_size=8)
events_strategy = st.lists(
    st.tuples(
        st.lists(values, min_size=1, max_size=3),
        st.one_of(st.none(), names),
        st.lists(values, max_size=2),
    ),
    max_size=6,
)


def serialise(events, eol: bytes) -> bytes:
    out = bytearray()
    for data_lines, name, comments in events:
        for comment in comments:
            out += b":" + comment.encode() + eol
        if name is not None:
            out += b"event: " + name.encode() + eol
        for line in data_lines:
            out += b"data: " + line.encode() + eol
        out += eol
    return bytes(out)


def expected_events(events) -> list[SSEEvent]:
    return [SSEEvent(data="\n".join(lines), event=name or "message") for lines, name, _ in events]


@given(
    events=events_strategy,
    eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_any_split_into_reads_decodes_to_the_same_events(events, eol, cuts):
    body = serialise(events, eol)
    points = sorted({c % (len(body) + 1) for c in cuts})
    reads = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    decoded, truncated = decode(*reads)
    assert decoded == expected_events(events)
    assert truncated is False


@given(events=events_strategy)
def test_line_ending_style_does_not_change_events(events):
    by_style = [decode(serialise(events, eol))[0] for eol in (b"\n", b"\r\n", b"\r")]
    assert by_style[0] == by_style[1] == by_style[2] == expected_events(events)


@given(events=events_strategy.filter(bool))
def test_cutting_the_last_terminator_reports_truncation(events):
    body = serialise(events, b"\n")
    decoded, truncated = decode(body[:-1])
    assert truncated is True
    assert decoded == expected_events(events)[:-1]


def test_a_line_that_never_ends_is_refused_past_the_bound_not_kept():
    # A server that never sends a line end made the decoder keep (and re-scan) it all.
    decoder = SSEDecoder()
    piece = b"x" * 65536
    decoder.feed(b"data: ")
    with pytest.raises(SSEDecodeError, match="a line longer than"):
        for _ in range(MAX_EVENT_BYTES // len(piece) + 1):
            decoder.feed(piece)


def test_an_event_that_never_ends_is_refused_past_the_bound():
    decoder = SSEDecoder(max_event_bytes=1000)
    decoder.feed(b"data: " + b"y" * 400 + b"\n" + b"data: " + b"y" * 400 + b"\n")
    with pytest.raises(SSEDecodeError, match="an event longer than 1000 bytes"):
        decoder.feed(b"data: " + b"y" * 400 + b"\n")


def test_a_long_line_in_many_reads_is_one_event_as_sent():
    decoder = SSEDecoder(max_event_bytes=10_000_000)
    body = b"data: " + b"z" * 3_000_000 + b"\r\n\r\n"
    events = []
    for start in range(0, len(body), 4096):
        events += decoder.feed(body[start : start + 4096])
    assert [len(e.data) for e in events] == [3_000_000]
    assert decoder.close() is False


def test_error_lines_count_toward_the_event_bound_in_bytes():
    # `error:` lines were kept without a bound, and data was counted in characters
    decoder = SSEDecoder(max_event_bytes=1000)
    with pytest.raises(SSEDecodeError, match="an event longer than 1000 bytes"):
        for _ in range(100):
            decoder.feed(b"error: " + b"e" * 20 + b"\n")
    wide = SSEDecoder(max_event_bytes=1000)
    with pytest.raises(SSEDecodeError, match="an event longer than 1000 bytes"):
        wide.feed(("data: " + "\u20ac" * 300 + "\n").encode())  # 900 bytes of 3-byte characters
        wide.feed(("data: " + "\u20ac" * 100 + "\n").encode())


@given(
    events=events_strategy,
    eols=st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_mixed_line_endings_split_anywhere_decode_to_the_same_events(events, eols, cuts):
    # WHATWG lets every line end its own way: a CRLF field line then an LF blank line
    lines = serialise(events, b"\n").split(b"\n")[:-1]  # no value holds CR or LF
    ends = iter(eols * (len(lines) + 1))
    body = b""
    for line in lines:
        end = next(ends)
        if not line and end == b"\n" and body.endswith(b"\r"):
            end = b"\r\n"  # an LF right after a CR would be its pair, not a line end
        body += line + end
    points = sorted({c % (len(body) + 1) for c in cuts})
    reads = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    decoded, truncated = decode(*reads)
    assert decoded == expected_events(events)
    assert truncated is False
