"""Text that is not valid Unicode (lone surrogates) from a server, a tool, a human or the caller.

Each one enters the log as valid Unicode (U+FFFD in place of a lone surrogate, the count in the
record's ``surrogates_replaced``), so the run completes, resumes after a crash and prints with
``treadle show`` (docs/crash-safety.md, "Text that is not Unicode").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import attrs
import pytest
import trio

import treadle
from treadle.approvals import decision_for
from treadle.models import OpenAIChatClient
from treadle.stores._ops import write_records
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.types import (
    ActionResult,
    ApprovalRequested,
    Message,
    ModelIntent,
    ModelReply,
    ModelResult,
    RunStarted,
    StepRecord,
    ToolCall,
)

SSE = {"content-type": "text/event-stream"}
LISTED: list[str] = []


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def ls(path: str) -> str:
    """List a directory.

    Args:
        path: the directory.
    """
    LISTED.append(path)
    # A file name that is not UTF-8, decoded the way the OS module decodes it.
    return "notes.txt\n" + b"r\xe9sum\xe9.txt".decode("utf-8", "surrogateescape")


def sse(*payloads: Any) -> bytes:
    out = b""
    for payload in payloads:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        out += f"data: {text}\n\n".encode()
    return out


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


# json.dumps writes a lone surrogate as the escape "\ud800", as a server would.
TOOL_TURN = CannedResponse(
    headers=SSE,
    chunks=[
        sse(chunk({"reasoning_content": "think \ud800"})),
        sse(chunk({"content": "Looking \ud800"})),
        sse(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "ls",
                                "arguments": json.dumps({"path": "/home/\udcff"}),
                            },
                        }
                    ]
                },
                "tool_calls",
            )
        ),
        sse("[DONE]"),
    ],
)
ANSWER_TURN = CannedResponse(
    headers=SSE, chunks=[sse(chunk({"content": "Two files \ud800."}, "stop")), sse("[DONE]")]
)


def agent_for(client: OpenAIChatClient) -> treadle.Agent:
    return treadle.Agent(
        model=client,
        executor=treadle.Toolbox([ls]),
        parser=treadle.NativeToolCallParser(),
        model_name="m",
        system_prompt="You list files.",
    )


def strings(value: Any) -> list[str]:
    """Every string in a record (attrs instances, mappings and sequences walked)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    if isinstance(value, list | tuple):
        return [s for item in value for s in strings(item)]
    if attrs.has(type(value)):
        return [s for f in attrs.fields(type(value)) for s in strings(getattr(value, f.name))]
    return []


def assert_valid_unicode(log: treadle.types.RunLog) -> None:
    for record in log.records:
        for text in strings(record):
            text.encode("utf-8")  # raises on a lone surrogate


def show(db: Any, run_id: str, *extra: str) -> subprocess.CompletedProcess[bytes]:
    """``treadle show`` in a real process (its stdout is strict UTF-8)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "treadle", "show", run_id, "--store", str(db), *extra],
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )


async def run_on(store: Any, run_id: str, *responses: CannedResponse, **kwargs: Any) -> Any:
    """Run (or resume) ``run_id`` against a loopback server: ``(result or crash, server)``."""
    async with open_loopback_server(canned(*responses)) as server:
        client = OpenAIChatClient(base_url=server.base_url + "/v1", api_key="k")
        try:
            with trio.fail_after(20):
                result = await treadle.run(agent_for(client), store=store, run_id=run_id, **kwargs)
        except (treadle.RunInterrupted, SimulatedCrash) as crash:
            result = crash
        finally:
            await client.aclose()
    return result, server


async def test_surrogates_from_the_server_the_tool_and_the_input_complete_the_run(tmp_path):
    LISTED.clear()
    db = tmp_path / "runs.db"
    async with treadle.open_sqlite_store(db) as store:
        result, server = await run_on(
            store, "u", TOOL_TURN, ANSWER_TURN, input="list /home/\udcff please"
        )
        log = await store.read_log("u")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert result.final_answer == "Two files \ufffd."
    assert LISTED == ["/home/\ufffd"]  # the tool got the validated arguments
    assert_valid_unicode(log)
    started = log.started
    assert started is not None
    assert started.input[0].content == "list /home/\ufffd please"
    assert started.surrogates_replaced == 1
    replies = [r for r in log.records if isinstance(r, ModelResult)]
    # reasoning, text and the argument of the first reply; the text of the second
    assert [r.surrogates_replaced for r in replies] == [3, 1]
    [action] = [r for r in log.records if isinstance(r, ActionResult)]
    assert action.surrogates_replaced == 2
    assert action.outcome.observation == "notes.txt\nr\ufffdsum\ufffd.txt"
    # Both requests were valid UTF-8 JSON, and the second one carried the repaired history.
    second = server.requests[1].json()
    assert second["messages"][-1]["content"] == "notes.txt\nr\ufffdsum\ufffd.txt"
    arguments = second["messages"][-2]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"path": "/home/\ufffd"}
    shown = await trio.to_thread.run_sync(show, db, "u")
    assert shown.returncode == 0, shown.stderr.decode(errors="replace")
    assert "run finished" in shown.stdout.decode()
    as_json = await trio.to_thread.run_sync(show, db, "u", "--json")
    assert as_json.returncode == 0, as_json.stderr.decode(errors="replace")
    assert [json.loads(line)["kind"] for line in as_json.stdout.splitlines()][-1] == (
        "run_finished"
    )


@pytest.mark.parametrize("crash_at", [5, 6])
async def test_a_run_crashed_after_the_repaired_step_resumes_to_the_end(tmp_path, crash_at):
    # Writes: 1 run started, 2 model intent, 3 model result, 4 action intent, 5 step,
    # 6 the next model intent. Crash right after 5 (the step) or after 6 (its barrier).
    LISTED.clear()
    db = tmp_path / "runs.db"
    async with treadle.open_sqlite_store(db) as store:
        crashed, _ = await run_on(
            CrashingStore(inner=store, crash_at=crash_at, when="after"),
            "c",
            TOOL_TURN,
            ANSWER_TURN,
            input="list /home",
        )
    assert isinstance(crashed, treadle.RunInterrupted | SimulatedCrash)
    async with treadle.open_sqlite_store(db) as store:
        result, _ = await run_on(store, "c", TOOL_TURN, ANSWER_TURN)
        log = await store.read_log("c")
    assert result.state is treadle.RunState.SUCCEEDED
    assert_valid_unicode(log)
    shown = await trio.to_thread.run_sync(show, db, "c")
    assert shown.returncode == 0, shown.stderr.decode(errors="replace")


async def test_a_log_written_with_lone_surrogates_still_resumes_and_shows(tmp_path):
    """A log from before the repair (lone surrogates stored as escapes) stays usable."""
    db = tmp_path / "runs.db"
    agent = agent_for(OpenAIChatClient(base_url="http://127.0.0.1:9/v1"))
    records = [
        RunStarted(
            run_id="old", ts="2024-01-01T00:00:00+00:00", input=(), snapshot=agent.snapshot()
        ),
        ModelIntent(
            run_id="old", step=1, intent_id="old/s1/m1", attempt=1, ts="2024-01-01T00:00:00+00:00"
        ),
        ModelResult(
            run_id="old",
            step=1,
            intent_id="old/s1/m1",
            ts="2024-01-01T00:00:00+00:00",
            reply=ModelReply(
                text="Looking \ud800",
                tool_calls=(ToolCall(id="call_1", name="ls", arguments={"path": "x"}),),
            ),
        ),
    ]
    records[0] = attrs.evolve(records[0], input=(Message(role="user", content="ls \udcff"),))
    call = ToolCall(id="call_1", name="ls", arguments={"path": "x"})
    records.append(
        StepRecord(
            run_id="old",
            step=1,
            ts="2024-01-01T00:00:01+00:00",
            model_intent_id="old/s1/m1",
            decision=treadle.types.DecisionKind.ACTIONS,
            history_message=Message(role="assistant", content="Looking \ud800", tool_calls=(call,)),
            observations=("r\udce9sum\udce9.txt",),
        )
    )
    async with treadle.open_sqlite_store(db) as store:
        lease = await store.acquire_lease("old", owner="writer", ttl_s=60)
        await write_records(store, records, seq=1, generation=lease.generation)
        await store.release_lease(lease)
    async with treadle.open_sqlite_store(db) as store:
        result, server = await run_on(store, "old", ANSWER_TURN)
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    sent = server.requests[0].json()["messages"]
    assert sent[1]["content"] == "ls \ufffd"
    assert sent[-1]["content"] == "r\ufffdsum\ufffd.txt"
    shown = await trio.to_thread.run_sync(show, db, "old")
    assert shown.returncode == 0, shown.stderr.decode(errors="replace")


def test_an_approval_edit_and_a_rejection_enter_the_log_valid():
    request = ApprovalRequested(
        run_id="r",
        step=1,
        call_id="c",
        tool="ls",
        arguments_digest="sha256:0",
        ts="2024-01-01T00:00:00+00:00",
        deadline_ts="2024-01-01T01:00:00+00:00",
    )
    decided = decision_for("r", request, treadle.SystemClock(), edit={"path\ud800": ["\udcff"]})
    assert decided.edited_arguments == {"path\ufffd": ["\ufffd"]}
    assert decided.surrogates_replaced == 2
    rejected = decision_for("r", request, treadle.SystemClock(), reject="no \ud800")
    assert (rejected.message, rejected.surrogates_replaced) == ("no \ufffd", 1)
