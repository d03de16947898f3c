"""Every model-stream case of the shared failure catalogue, served over real HTTP on 127.0.0.1.

The cases live in ``tests/fixtures/cases`` (copied from ``../shared/cases``; a test below
checks the copies are current when that directory exists).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import trio

from treadle._exceptions import ModelCallError
from treadle.models import OpenAIChatClient
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import Message, ModelRequest, Usage

REPO = Path(__file__).resolve().parents[2]
CASES = REPO / "tests" / "fixtures" / "cases"
SHARED = REPO.parent / "shared" / "cases"


def _case_names() -> list[str]:
    names = []
    for path in sorted(CASES.glob("*.json")):
        number = int(path.name.split("-", 1)[0])
        has_body = path.with_suffix(".sse").exists() or path.with_suffix(".body").exists()
        if number <= 23 and has_body:
            names.append(path.stem)
    return names


CASE_NAMES = _case_names()


def load(name: str) -> tuple[dict, bytes]:
    case = json.loads((CASES / f"{name}.json").read_text())
    return case, (CASES / case["input_file"]).read_bytes()


def split(body: bytes, boundaries: list[int]) -> list[bytes | float]:
    points = [0, *boundaries, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(points)]


def response_for(case: dict, chunks: list[bytes | float], pause_s: float) -> CannedResponse:
    return CannedResponse(
        status=case["http_status"], headers=case["headers"], chunks=chunks, pause_s=pause_s
    )


def request_for(case: dict) -> ModelRequest:
    max_tokens = case.get("request", {}).get("max_tokens")
    return ModelRequest(
        messages=(Message(role="user", content="hello"),),
        model="example-model",
        max_output_tokens=max_tokens,
    )


def usage_of(expected: dict | None) -> Usage:
    if expected is None:
        return Usage()
    details = expected.get("completion_tokens_details") or {}
    return Usage(
        input_tokens=expected.get("prompt_tokens"),
        output_tokens=expected.get("completion_tokens"),
        reasoning_tokens=details.get("reasoning_tokens"),
        total_tokens=expected.get("total_tokens"),
    )


async def run_case(case: dict, chunks: list[bytes | float], *, pause_s: float = 0.01, times=1):
    """Serve ``chunks`` ``times`` times; return (outcomes, server) where an outcome is a reply
    or the raised ModelCallError, plus the deltas seen by on_delta."""
    outcomes, deltas = [], []
    async with open_loopback_server(canned(response_for(case, chunks, pause_s))) as server:
        client = OpenAIChatClient(base_url=server.base_url + "/v1", api_key="sk-case")
        try:
            for _ in range(times):
                seen: list[tuple[str, str]] = []
                try:
                    with trio.fail_after(10):
                        outcome = await client.complete(request_for(case), on_delta=_append(seen))
                except ModelCallError as err:
                    outcome = err
                outcomes.append(outcome)
                deltas.append(seen)
        finally:
            await client.aclose()
    return outcomes, deltas, server


def _append(seen):
    return lambda channel, text: seen.append((channel, text))


def check_error(case: dict, err: object) -> None:
    expected = case["expected"]
    assert isinstance(err, ModelCallError), f"expected an error, got {err!r}"
    assert err.info.kind == expected["error"]
    assert err.info.retryable is expected["retryable"]
    if "retry_after_s" in expected:
        assert err.info.retry_after_s == expected["retry_after_s"]
    if case["http_status"] != 200:
        assert err.info.status == case["http_status"]
    assert err.partial_text == (expected["text"] or "")
    assert err.usage == usage_of(expected["usage"])
    assert "sk-case" not in str(err)


def check_reply(case: dict, reply: object) -> None:
    expected = case["expected"]
    assert not isinstance(reply, Exception), f"unexpected error {reply!r}"
    # The shared cases record "" for a stream whose only content was "": the client reports
    # that as None, never "" standing for nothing (docs/seams.md, "Model client").
    assert reply.text == (expected["text"] or None)
    assert reply.finish_reason == expected["finish_reason"]
    assert reply.usage == usage_of(expected["usage"])
    assert reply.reasoning == expected.get("reasoning")
    got_calls = [(c.name, dict(c.arguments)) for c in reply.tool_calls]
    assert got_calls == [(c["name"], c["arguments"]) for c in expected["tool_calls"]]
    for call, want in zip(reply.tool_calls, expected["tool_calls"], strict=True):
        assert call.id == (want["id"] if want["id"] is not None else call.id)
        assert call.id  # a synthesised id is never empty
    assert len({c.id for c in reply.tool_calls}) == len(reply.tool_calls)
    invalid = [
        {"id": c.id, "name": c.name, "raw_arguments": c.raw_arguments, "reason": c.reason}
        for c in reply.invalid_tool_calls
    ]
    assert invalid == expected.get("invalid_tool_calls", [])


def check(case: dict, outcome: object) -> None:
    if case["expected"]["error"]:
        check_error(case, outcome)
    else:
        check_reply(case, outcome)


def test_every_stream_case_is_covered():
    numbers = {int(n.split("-", 1)[0]) for n in CASE_NAMES}
    assert numbers == {1, 3, 4, 5, 7, 8, 9, 10, 12, 13, 15, 17, 18, 19, 20, 22, 23}


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/cases is not present")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_fixture_copy_matches_shared_case(name):
    case, body = load(name)
    assert json.loads((SHARED / f"{name}.json").read_text()) == case
    assert (SHARED / case["input_file"]).read_bytes() == body


@pytest.mark.parametrize("name", CASE_NAMES)
async def test_case_as_recorded(name):
    """Served split at the case's read boundaries (one write otherwise)."""
    case, body = load(name)
    chunks = split(body, case.get("read_boundaries") or case["expected"].get("read_boundaries", []))
    (outcome,), (deltas,), server = await run_case(case, chunks)
    check(case, outcome)
    assert len(server.requests) == 1
    sent = server.requests[0].json()
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    if not isinstance(outcome, Exception):
        texts = "".join(t for channel, t in deltas if channel == "text")
        assert texts == (outcome.text or "")
        reasoning = "".join(t for channel, t in deltas if channel == "reasoning")
        assert reasoning == (outcome.reasoning or "")


@pytest.mark.parametrize("name", CASE_NAMES)
async def test_case_in_tiny_reads(name):
    """The same bytes cut every 7 bytes: the result must not depend on read boundaries."""
    case, body = load(name)
    (outcome,), _, _ = await run_case(case, split(body, list(range(7, len(body), 7))), pause_s=0)
    check(case, outcome)


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if n.startswith(("09-", "07-"))])
async def test_synthesised_ids_are_stable_for_the_same_stream(name):
    case, body = load(name)
    outcomes, _, _ = await run_case(case, [body], times=2)
    first, second = ([c.id for c in reply.tool_calls] for reply in outcomes)
    assert first == second
    assert all(first)


async def test_case13_max_tokens_is_sent_and_truncated_call_is_not_executable():
    case, body = load("13-finish-length-mid-toolcall")
    (reply,), _, server = await run_case(case, [body])
    assert server.requests[0].json()["max_tokens"] == 40
    assert reply.tool_calls == ()
    assert [c.reason for c in reply.invalid_tool_calls] == ["truncated"]


@pytest.mark.parametrize("abort", ["close", "reset"])
async def test_case17_connection_cut_mid_body_is_incomplete_stream(abort):
    case, body = load("17-eof-mid-stream")
    response = CannedResponse(headers=case["headers"], chunks=[body], abort=abort)
    async with open_loopback_server(canned(response)) as server:
        client = OpenAIChatClient(base_url=server.base_url)
        with pytest.raises(ModelCallError) as info, trio.fail_after(10):
            await client.complete(request_for(case))
        await client.aclose()
    assert info.value.info.kind == "incomplete_stream"
    assert info.value.info.retryable is True
    assert info.value.partial_text == case["expected"]["text"]


async def test_case01_comments_alone_never_count_as_first_byte():
    """A stream of keep-alive comments longer than the first-byte deadline times out."""
    pings = [b": ping - 2026-11-30 12:00:01.000000\n\n"] * 60  # 60 x 0.05 s = 3 s of pings
    headers = {"content-type": "text/event-stream"}
    response = CannedResponse(headers=headers, chunks=pings, pause_s=0.05)
    async with open_loopback_server(canned(response)) as server:
        client = OpenAIChatClient(base_url=server.base_url, first_byte_timeout_s=0.2)
        start = trio.current_time()
        with pytest.raises(ModelCallError) as info, trio.fail_after(10):
            await client.complete(request_for({}))
        elapsed = trio.current_time() - start
        with trio.fail_after(5):
            await server.wait_early_disconnect()
        await client.aclose()
    assert info.value.info.kind == "timeout"
    assert info.value.info.retryable is True
    assert 0.2 <= elapsed < 2.0
