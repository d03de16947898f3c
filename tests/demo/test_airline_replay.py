"""The recorded airline workload replayed through treadle end to end.

The replay server (the recorded model, over real HTTP streaming), the agent definition, the
driver processes and their real SIGKILL crashes, resume from the SQLite store, scoring, the
``treadle demo`` commands and live mode with a scripted customer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from click.testing import CliRunner

from treadle.cli import main as cli_main
from treadle.demo.airline import driver
from treadle.demo.airline.agent import (
    RESPOND_TOOL,
    AirlineExecutor,
    RecordedCustomer,
    respond_positions,
)
from treadle.demo.airline.data import AirlineDataNotFound, Recording, find_data_dir, load_data
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.replay import (
    CrashPoint,
    ReplayReport,
    Workspace,
    crash_point,
    demo_crash_point,
    expected_writes,
    find_recording,
    load_trajectories,
    locate_workload,
    replay_recordings,
)
from treadle.demo.airline.replay_server import (
    history_differences,
    open_replay_server,
    stream_events,
)
from treadle.demo.airline.scoring import recorded_tool_calls
from treadle.demo.airline.tools import WRITE_TOOLS
from treadle.models.openai import OpenAIChatClient
from treadle.stores.sqlite import open_sqlite_store
from treadle.types import (
    Action,
    ActionIntent,
    ActionResult,
    ActionStatus,
    Message,
    ModelRequest,
    ReplayPolicy,
    RunLog,
    ToolCall,
)

SAMPLE = ("30-1", "0-3", "26-0", "32-0", "18-0", "46-3")
"""Two cancellations (reward 1); bookings and a cancellation (reward 0); a cancellation and
flight changes (reward 1); bookings with a refusal (reward 0); a transfer to a human agent;
the 30-step limit reached with bookings and a certificate."""

SUMMARY_KEYS = (
    "task_id",
    "trial",
    "recorded_reward",
    "reward",
    "tool_calls",
    "observations_matching",
    "history_mismatches",
    "crashes",
    "resumes",
)

REPLAY_DEADLINE_S = 300


@pytest.fixture(scope="module")
def workload() -> Path:
    try:
        return find_data_dir()
    except AirlineDataNotFound:
        if os.environ.get("CI"):
            raise
        pytest.skip("airline workload data not found (set TREADLE_AIRLINE_DATA)")


@pytest.fixture(scope="module")
def trajectories(workload: Path) -> Path:
    return workload / "trajectories.json"


@pytest.fixture(scope="module")
def recordings(trajectories: Path) -> tuple[Recording, ...]:
    return load_trajectories(trajectories)


@pytest.fixture(scope="module")
def fresh(workload: Path, tmp_path_factory: pytest.TempPathFactory) -> AirlineDatabase:
    folder = tmp_path_factory.mktemp("airline-replay")
    return AirlineDatabase.create(folder / "fresh.sqlite3", load_data(workload))


def pick(recordings: tuple[Recording, ...], *keys: str) -> list[Recording]:
    return [find_recording(recordings, key) for key in keys]


def assert_reproduced(report: ReplayReport) -> None:
    name = report.run_id
    assert report.error is None, report.error
    assert report.reward == report.recorded_reward, name
    assert report.history_mismatches == 0, name
    assert report.tool_calls == report.recorded_tool_calls, name
    assert report.observations_matching == report.recorded_tool_calls, name
    assert report.applied_once, name
    assert report.db_matches_recording, name
    assert report.writes_applied == report.writes_in_log, name


# --------------------------------------------------------------------------- replay server


def test_stream_events_fragment_text_and_arguments(recordings):
    recording = find_recording(recordings, "30-1")
    message = next(m for m in recording.messages if m.get("content") and m.get("tool_calls"))
    raw = stream_events(
        message,
        response_id="r",
        model="m",
        rng=random.Random(1),
        usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    )
    assert raw[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[len(b"data: ") :]) for e in raw[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    texts = [d["content"] for d in deltas if d.get("content")]
    assert len(texts) > 1
    assert "".join(texts) == message["content"]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["id"] == message["tool_calls"][0]["id"]
    assert calls[0]["function"]["name"] == "cancel_reservation"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert len(calls) > 2  # the arguments come in several pieces
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert arguments == message["tool_calls"][0]["function"]["arguments"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5
    no_usage = stream_events(message, response_id="r", model="m", rng=random.Random(1), usage=None)
    assert all(b'"usage"' not in e for e in no_usage)


def test_history_differences():
    call = {"id": "c1", "type": "function", "function": {"name": "t", "arguments": '{"a": 1}'}}
    recorded = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "t", "content": "ok"},
    ]
    same = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {"name": "t", "arguments": '{"a":1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert history_differences(recorded, same) == []
    other = [dict(m) for m in same]
    other[1] = {**other[1], "content": ""}
    other[2] = {**other[2], "tool_call_id": "c2"}
    found = history_differences(recorded, other)
    assert len(found) == 2
    assert "content" in found[0] and "tool_call_id" in found[1]
    assert history_differences(recorded, same[:2]) == ["expected 3 messages, got 2"]


async def test_replay_server_answers_by_position_and_reports_mismatches(recordings):
    recording = find_recording(recordings, "30-1")
    history = [Message(role=m["role"], content=m["content"]) for m in recording.messages[:2]]
    with trio.fail_after(30):
        async with open_replay_server([recording]) as server:
            client = OpenAIChatClient(base_url=server.base_url("30-1"))
            try:
                deltas: list[str] = []
                request = ModelRequest(messages=tuple(history), model="gpt-4o")
                reply = await client.complete(
                    request, on_delta=lambda kind, text: deltas.append(text)
                )
                again = await client.complete(request)  # a repeat gets the same reply
                assert reply.text == again.text == recording.messages[2]["content"]
                assert len(deltas) > 1
                assert reply.usage.input_tokens is not None and reply.finish_reason == "stop"
                assert server.mismatches == []

                wrong = (*history[:1], Message(role="user", content="something else"))
                await client.complete(ModelRequest(messages=wrong, model="gpt-4o"))
                [mismatch] = server.mismatches
                assert mismatch.position == 0 and "content" in mismatch.differences[0]

                calls = recording.messages[4]["tool_calls"]
                prefix = (
                    *history,
                    Message(role="assistant", content=recording.messages[2]["content"]),
                    Message(role="user", content=recording.messages[3]["content"]),
                )
                reply = await client.complete(ModelRequest(messages=prefix, model="gpt-4o"))
                assert reply.tool_calls == (
                    ToolCall(
                        id=calls[0]["id"],
                        name="get_user_details",
                        arguments=json.loads(calls[0]["function"]["arguments"]),
                    ),
                )
            finally:
                await client.aclose()
            async with httpx.AsyncClient() as http:
                everything = [
                    {"role": m["role"], "content": m.get("content")} for m in recording.messages
                ]
                past = await http.post(
                    server.base_url("30-1") + "/chat/completions",
                    json={"model": "m", "messages": everything, "stream": True},
                )
                unknown = await http.post(
                    server.base_url("nope") + "/chat/completions", json={"messages": []}
                )
            assert past.status_code == 400 and unknown.status_code == 404
            assert "past the recording's end" in server.mismatches[-1].differences[0]


async def test_replay_server_survives_a_client_vanishing_mid_response(recordings):
    recording = find_recording(recordings, "30-1")
    messages = [{"role": m["role"], "content": m["content"]} for m in recording.messages[:2]]
    body = json.dumps({"model": "m", "messages": messages, "stream": True}).encode()
    with trio.fail_after(30):
        async with open_replay_server([recording], pause_s=0.05) as server:
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            head = (
                f"POST /r/30-1/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            )
            await stream.send_all(head.encode() + body)
            assert (await stream.receive_some(64)).startswith(b"HTTP/1.1 200")
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()  # a reset, as from a process killed with SIGKILL
            async with httpx.AsyncClient() as http:
                after = await http.post(server.base_url("30-1") + "/chat/completions", content=body)
            assert after.status_code == 200 and b"[DONE]" in after.content
            assert server.abandoned_responses == 1
    # leaving the block raised nothing: the server handled the vanished client


# --------------------------------------------------------------------------- agent


def action(step: int, tool: str, arguments: dict[str, Any], index: int = 1) -> Action:
    return Action(
        run_id="r",
        step=step,
        intent_id=f"r/s{step}/a{index}",
        call_id="" if tool == RESPOND_TOOL else f"c{step}",
        tool=tool,
        arguments=arguments,
    )


async def test_executor_replies_by_position_and_reconciles_writes(recordings, fresh, tmp_path):
    recording = find_recording(recordings, "30-1")
    db = fresh.copy_to(tmp_path / "conversation.sqlite3")
    customer = RecordedCustomer(recording)
    executor = AirlineExecutor(db, customer)
    assert executor.replay_policy(RESPOND_TOOL) is ReplayPolicy.SAFE
    assert executor.replay_policy("get_user_details") is ReplayPolicy.SAFE
    assert executor.replay_policy("cancel_reservation") is ReplayPolicy.NEVER
    assert executor.replay_policy("no_such_tool") is ReplayPolicy.NEVER
    assert len(executor.tool_specs()) == 14

    first = await executor.execute(action(1, RESPOND_TOOL, {"content": "hello"}))
    second = await executor.execute(action(4, RESPOND_TOOL, {"content": "next"}))
    repeated = await executor.execute(action(1, RESPOND_TOOL, {"content": "hello"}))
    assert first.observation == repeated.observation == customer.answers[0]
    assert second.observation == customer.answers[1]
    last = await executor.execute(action(9, RESPOND_TOOL, {"content": "bye"}))
    assert last.observation == customer.answers[2] and not last.task_completed

    # A resumed executor numbers the replies stored in the log the same way.
    intents = tuple(
        ActionIntent(run_id="r", step=s, intent_id=f"r/s{s}/a1", call_id="", tool=RESPOND_TOOL,
                     arguments={}, ts="")
        for s in (1, 4, 9)
    )  # fmt: skip
    assert respond_positions(RunLog(run_id="r", records=intents)) == {1: 0, 4: 1, 9: 2}

    cancel = action(12, "cancel_reservation", {"reservation_id": "FDZ0T5"})
    done = await executor.reconcile(cancel)  # never applied: performed now, once
    assert done is not None and done.status is ActionStatus.EXECUTED
    assert '"status": "cancelled"' in done.observation
    again = await executor.reconcile(cancel)  # applied: the stored output, nothing repeated
    assert again == done
    assert [row[0] for row in db.applied_actions()] == [cancel.intent_id]

    unknown = await executor.execute(action(13, "no_such_tool", {}))
    bad = await executor.execute(action(14, "get_user_details", {"user": 1}))
    assert unknown.status is bad.status is ActionStatus.NOT_EXECUTED
    assert (await executor.reconcile(action(13, "no_such_tool", {}))) == unknown
    transfer = await executor.execute(action(15, "transfer_to_human_agents", {"summary": "x"}))
    assert transfer.observation == "Transfer successful" and transfer.task_completed
    stop = RecordedCustomer(recording).answers[-1]
    assert "###STOP###" in stop


async def test_one_run_is_driven_by_one_process_at_a_time(tmp_path, monkeypatch, autojump_clock):
    monkeypatch.setattr(driver, "LOCK_WAIT_S", 5.0)
    path = tmp_path / "conversation.sqlite3.lock"
    held = await driver.hold_run_lock(path)
    with pytest.raises(driver.RunLocked):
        await driver.hold_run_lock(path)  # another open file: the flock is taken
    os.close(held)  # what the kernel does when the holder dies
    os.close(await driver.hold_run_lock(path))


def test_crash_points_come_from_the_seed(recordings):
    for recording in recordings:
        point = crash_point(5, recording)
        assert point == crash_point(5, recording)
        total = expected_writes(recording)
        if point.when == "after":
            assert 1 <= point.write <= total - 1
        else:
            assert 2 <= point.write <= total
    points = {crash_point(seed, recordings[0]) for seed in range(20)}
    assert len(points) > 5
    demo = demo_crash_point(find_recording(recordings, "30-1"))
    assert demo == CrashPoint(write=4 * 12 + 1, when="before")


def test_locate_workload_downloads_only_when_nothing_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("TREADLE_AIRLINE_DATA", raising=False)
    fetched: list[Path] = []

    def fake_download(dest: Path) -> Path:
        fetched.append(dest)
        (dest / "data").mkdir(parents=True)
        (dest / "data" / "users.json").write_text("{}")
        (dest / "trajectories.json").write_text("[]")
        return dest

    monkeypatch.setattr("treadle.demo.airline._discovery.download_data", fake_download)
    monkeypatch.setattr(
        "treadle.demo.airline._discovery.find_data_dir",
        lambda explicit=None: (_ for _ in ()).throw(AirlineDataNotFound([tmp_path])),
    )
    cache = tmp_path / "cache"
    assert locate_workload(cache_dir=cache) == cache
    assert locate_workload(cache_dir=cache) == cache  # the second time from the cache
    assert fetched == [cache]
    with pytest.raises(AirlineDataNotFound):
        locate_workload(tmp_path / "given")  # an explicit folder is never downloaded into


# --------------------------------------------------------------------------- replays


@pytest.mark.parametrize("crash", ["none", "random"])
async def test_sample_replays_reproduce_the_recordings(
    recordings, trajectories, workload, tmp_path, crash
):
    sample = pick(recordings, *SAMPLE)
    workspace = Workspace.beside(tmp_path / "runs.db")
    with trio.fail_after(REPLAY_DEADLINE_S):
        reports = await replay_recordings(
            sample,
            workspace=workspace,
            trajectories=trajectories,
            data_dir=workload,
            crash=crash,
            seed=11,
            concurrency=3,
        )
    assert [(r.task_id, r.trial) for r in reports] == [(s.task_id, s.trial) for s in sample]
    for report in reports:
        assert_reproduced(report)
        expected = 1 if crash == "random" else 0
        assert (report.crashes, report.resumes) == (expected, expected), report.run_id
    assert sum(r.writes_applied for r in reports) >= 15
    assert {r.reward for r in reports} == {0.0, 1.0}


def change_steps(recording: Recording) -> list[int]:
    """The steps (1-based) whose tool call changes the database."""
    assistant = [m for m in recording.messages if m["role"] == "assistant"]
    return [
        step
        for step, message in enumerate(assistant, start=1)
        if any(c["function"]["name"] in WRITE_TOOLS for c in message.get("tool_calls") or ())
    ]


class KillWatcher:
    """Keeps, for each killed driver, the intents it left without result (and their tools)."""

    def __init__(self) -> None:
        self.open_intents: list[list[ActionIntent]] = []

    def child_started(self, recording, pid, *, resume, crash) -> None:
        pass

    def event(self, recording, line) -> None:
        pass

    def child_exited(self, recording, exit, log) -> None:
        if exit.killed:
            done = {r.intent_id for r in log.records if isinstance(r, ActionResult)}
            self.open_intents.append(
                [r for r in log.records if isinstance(r, ActionIntent) and r.intent_id not in done]
            )


@pytest.mark.parametrize(
    ("key", "nth", "when"),
    [("26-0", 0, "before"), ("26-0", 1, "after"), ("0-3", 5, "before"), ("16-3", 0, "after")],
)
async def test_a_kill_around_a_database_change_applies_it_exactly_once(
    recordings, trajectories, workload, tmp_path, key, nth, when
):
    # "before" the step write: the change committed in the airline database, its result never
    # reached the log. "after" the action intent: the intent is durable, the change never ran.
    recording = find_recording(recordings, key)
    step = change_steps(recording)[nth]
    point = (
        CrashPoint(write=4 * step + 1, when="before")
        if when == "before"
        else (CrashPoint(write=4 * step, when="after"))
    )
    workspace = Workspace.beside(tmp_path / "runs.db")
    watcher = KillWatcher()
    with trio.fail_after(REPLAY_DEADLINE_S):
        [report] = await replay_recordings(
            [recording],
            workspace=workspace,
            trajectories=trajectories,
            data_dir=workload,
            crash_points={key: point},
            observer=watcher,
        )
    assert_reproduced(report)
    assert (report.crashes, report.resumes) == (1, 1)
    [[intent]] = watcher.open_intents
    assert intent.tool in WRITE_TOOLS and intent.step == step
    db = AirlineDatabase(workspace.conversation_path(report.run_id))
    applied = [row[0] for row in db.applied_actions()]
    assert applied.count(intent.intent_id) == 1  # reconciled or performed on resume, once


async def killed_driver(
    recording: Recording, workspace: Workspace, trajectories: Path, workload: Path, *crash: str
) -> int:
    """Drive ``recording``'s run in ``workspace`` with one driver process; its exit status.

    ``crash`` is its crash option (``--crash-after-writes N`` …); the airline databases are
    made as a replay makes them.
    """
    run_id = f"airline-{recording.task_id}-{recording.trial}"
    fresh_db = workspace.fresh_database(workload)
    db = workspace.conversation(run_id, fresh_db)
    key = f"{recording.task_id}-{recording.trial}"
    with trio.fail_after(REPLAY_DEADLINE_S):
        async with open_replay_server([recording]) as server:
            command = [sys.executable, "-m", "treadle.demo.airline.driver", "--recording-key",
                       key, "--store", str(workspace.store), "--db", str(db.path),
                       "--base-url", server.base_url(key), "--trajectories", str(trajectories),
                       *crash]  # fmt: skip
            done = await trio.run_process(command, check=False, capture_stderr=True)
    return done.returncode


async def test_a_driver_resuming_a_begun_run_never_dies_at_its_crash_point(
    recordings, trajectories, workload, tmp_path
):
    # A crash point counts a run's writes from its start, but a driver resuming a begun run
    # counted its own writes from where it resumed: it died elsewhere than asked, or never.
    recording = find_recording(recordings, "30-1")
    workspace = Workspace.beside(tmp_path / "runs.db")
    crash = ("--crash-after-writes", "6")
    status = await killed_driver(recording, workspace, trajectories, workload, *crash)
    assert status == -signal.SIGKILL
    status = await killed_driver(recording, workspace, trajectories, workload, *crash)
    assert status == 0  # resumed to the end: no kill at its own 6th write
    async with open_sqlite_store(workspace.store) as store:
        log = await store.read_log("airline-30-1")
    assert log.finished is not None


def test_the_demo_resuming_a_begun_run_promises_no_kill(
    recordings, trajectories, workload, tmp_path, monkeypatch
):
    # Run again after Ctrl-C, the demo said "this process will kill itself with SIGKILL
    # right before store write 49" for a driver resuming the run, which then never died
    # (or died after its own 49th write, past the first cancellation).
    recording = find_recording(recordings, "30-1")
    workspace = Workspace.beside(tmp_path / "demo.db")
    crash = ("--crash-after-writes", "6")
    status = trio.run(killed_driver, recording, workspace, trajectories, workload, *crash)
    assert status == -signal.SIGKILL
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli_main, ["demo", "--store", "demo.db", "--data", str(workload)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "resumes the run from its log" in out and "will kill itself" not in out
    assert "crashes 0 · resumes 1 · history mismatches 0" in out
    assert "each applied exactly once: yes" in out
    assert "score 1.0 recorded score 1.0" in out


def subset_file(trajectories: Path, keys: tuple[str, ...], target: Path) -> Path:
    raw = json.loads(trajectories.read_text(encoding="utf-8"))
    chosen = [r for r in raw if f"{r['task_id']}-{r.get('trial', 0)}" in keys]
    target.write_text(json.dumps(chosen), encoding="utf-8")
    return target


def file_order(path: Path) -> list[tuple[int, int]]:
    return [(r.task_id, r.trial) for r in load_trajectories(path)]


def store_rows(store: Path) -> dict[str, int]:
    with sqlite3.connect(store) as conn:
        rows = conn.execute("SELECT run_id, count(*) FROM records GROUP BY run_id").fetchall()
    return dict(rows)


def test_cli_json_lines_and_a_second_run_only_reports(trajectories, workload, tmp_path):
    subset = subset_file(trajectories, ("30-1", "18-0", "14-0"), tmp_path / "three.json")
    store = tmp_path / "runs.db"
    args = ["demo", "airline", "--trajectories", str(subset), "--data", str(workload),
            "--store", str(store), "--crash", "random", "--seed", "3", "--json"]  # fmt: skip
    first = CliRunner().invoke(cli_main, args)
    assert first.exit_code == 0, first.output
    lines = [json.loads(line) for line in first.stdout.splitlines()]
    assert [(d["task_id"], d["trial"]) for d in lines] == file_order(subset)
    for line in lines:
        assert tuple(line)[: len(SUMMARY_KEYS)] == SUMMARY_KEYS
        assert line["reward"] == line["recorded_reward"]
        assert line["history_mismatches"] == 0 and line["crashes"] == line["resumes"] == 1
        assert line["observations_matching"] == line["tool_calls"]
    rows = store_rows(store)
    second = CliRunner().invoke(cli_main, args)
    assert second.exit_code == 0, second.output
    assert [json.loads(line) for line in second.stdout.splitlines()] == lines
    assert store_rows(store) == rows  # nothing was run again


async def test_the_command_killed_from_outside_is_simply_run_again(
    trajectories, workload, tmp_path
):
    subset = subset_file(trajectories, ("0-3", "26-0", "16-3", "18-0"), tmp_path / "four.json")
    store = tmp_path / "runs.db"
    command = [sys.executable, "-m", "treadle.cli", "demo", "airline", "--trajectories",
               str(subset), "--data", str(workload), "--store", str(store), "--crash",
               "random", "--seed", "5", "--concurrency", "2", "--json"]  # fmt: skip
    with trio.fail_after(REPLAY_DEADLINE_S):
        process = await trio.lowlevel.open_process(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert process.stdout is not None
        async with process.stdout:
            first = await process.stdout.receive_some(65536)  # the first report is out
            assert first.startswith(b"{")
            process.send_signal(signal.SIGKILL)  # mid-replay: the others are unfinished
        assert await process.wait() == -signal.SIGKILL
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [(d["task_id"], d["trial"]) for d in lines] == file_order(subset)
    for line in lines:
        assert line["error"] is None
        assert line["reward"] == line["recorded_reward"], line
        assert line["history_mismatches"] == 0 and line["applied_once"], line
        assert line["observations_matching"] == line["recorded_tool_calls"], line


async def interrupted(command: list[str], marker: bytes) -> tuple[int, str]:
    """``command``'s exit status and output when SIGINT reached it once it printed ``marker``.

    It runs in a session of its own, and the signal goes to its process group, as Ctrl-C in
    a terminal sends it.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    output = b""
    with trio.fail_after(REPLAY_DEADLINE_S):
        process = await trio.lowlevel.open_process(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            assert process.stdout is not None
            async with process.stdout:
                while marker not in output:
                    chunk = await process.stdout.receive_some(65536)
                    assert chunk, output.decode()
                    output += chunk
                os.killpg(process.pid, signal.SIGINT)
                while chunk := await process.stdout.receive_some(65536):
                    output += chunk
            return await process.wait(), output.decode()
        finally:
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)


async def test_ctrl_c_stops_the_demo_which_the_same_command_resumes(workload, tmp_path):
    # Ctrl-C printed a raw exception group ending in KeyboardInterrupt and exited with 1.
    store = tmp_path / "demo.db"
    command = [sys.executable, "-m", "treadle.cli", "demo", "--store", str(store),
               "--data", str(workload)]  # fmt: skip
    status, output = await interrupted(command, b"driver process")
    assert status == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    again = f"treadle demo --store {store} --data {workload}"
    assert f"interrupted: airline-30-1 is left unfinished in {store}; " in output
    assert f"to resume it from its log, run: {again}\n" in output
    with trio.fail_after(REPLAY_DEADLINE_S):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    assert "score 1.0   recorded score 1.0" in done.stdout.decode()
    assert "each applied exactly once: yes" in done.stdout.decode()


async def test_ctrl_c_stops_demo_airline_which_running_again_resumes(
    trajectories, workload, tmp_path
):
    subset = subset_file(trajectories, ("30-1", "46-3"), tmp_path / "two.json")
    store = tmp_path / "runs.db"
    command = [sys.executable, "-m", "treadle.cli", "demo", "airline", "--trajectories",
               str(subset), "--data", str(workload), "--store", str(store), "--concurrency",
               "1", "--json"]  # fmt: skip
    status, output = await interrupted(command, b"}\n")  # 30-1 is out, 46-3 is under way
    assert status == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert f"interrupted: the unfinished runs are left in {store}; run the command again " in output
    assert f"with --store {store} to resume them" in output
    with trio.fail_after(REPLAY_DEADLINE_S):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [(d["task_id"], d["trial"]) for d in lines] == [(30, 1), (46, 3)]
    for line in lines:
        assert line["error"] is None and line["reward"] == line["recorded_reward"], line
        assert line["applied_once"] and line["db_matches_recording"], line
        assert line["observations_matching"] == line["recorded_tool_calls"], line


def scripted_customer(recording: Recording) -> bytes:
    """The customer's messages as typed: one line each, newlines continued with a backslash."""
    users = [m["content"] for m in recording.messages if m["role"] == "user"]
    return "".join(text.replace("\n", "\\\n") + "\n" for text in users).encode()


@pytest.mark.parametrize("key", ["30-1", "0-0"])
async def test_live_mode_with_a_scripted_customer(recordings, workload, tmp_path, key):
    recording = find_recording(recordings, key)
    with trio.fail_after(REPLAY_DEADLINE_S):
        async with open_replay_server([recording]) as server:
            command = [sys.executable, "-m", "treadle.cli", "demo", "airline", "--live",
                       "--data", str(workload), "--base-url", server.base_url(key),
                       "--model", "gpt-4o", "--task-id", str(recording.task_id),
                       "--store", str(tmp_path / "live.db"), "--json"]  # fmt: skip
            done = await trio.run_process(
                command,
                stdin=scripted_customer(recording),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout.decode().splitlines()[-1])
    assert server.mismatches == []
    assert report["reward"] == recording.reward
    assert report["tool_calls"] == len(recorded_tool_calls(recording))
    assert report["stop_reason"] == "task_completed"
    assert "agent>" in done.stderr.decode()  # the conversation was shown


@pytest.mark.parametrize(
    ("base_url", "status", "said"),
    [
        ("notaurl", 2, "Invalid value for --base-url: base_url must start with http://"),
        (None, 0, "no message; nothing was run"),
    ],
)
async def test_live_mode_makes_nothing_before_the_first_message(
    recordings, workload, tmp_path, base_url, status, said
):
    # A refused --base-url (exit 2) left an empty .treadle/live-<time>.db behind; input
    # ending before a message left that and 3.5 MB of airline databases, each time.
    recording = find_recording(recordings, "30-1")
    with trio.fail_after(REPLAY_DEADLINE_S):
        async with open_replay_server([recording]) as server:
            command = [sys.executable, "-m", "treadle.cli", "demo", "airline", "--live",
                       "--data", str(workload), "--base-url", base_url or server.base_url("30-1"),
                       "--model", "gpt-4o"]  # fmt: skip
            done = await trio.run_process(
                command, stdin=b"", capture_stdout=True, capture_stderr=True, check=False,
                cwd=tmp_path,
            )  # fmt: skip
    assert done.returncode == status, done.stderr.decode()
    assert said in (done.stdout + done.stderr).decode()
    assert list(tmp_path.iterdir()) == []


async def test_live_modes_closing_command_is_quoted_for_the_shell(recordings, workload, tmp_path):
    """Live mode ended with `treadle show RUN --store PATH`, the path unquoted."""
    import shlex

    recording = find_recording(recordings, "30-1")
    store = tmp_path / "my runs[red]" / "live 1.db"
    store.parent.mkdir()
    with trio.fail_after(REPLAY_DEADLINE_S):
        async with open_replay_server([recording]) as server:
            command = [sys.executable, "-m", "treadle.cli", "demo", "airline", "--live",
                       "--data", str(workload), "--base-url", server.base_url("30-1"),
                       "--model", "gpt-4o", "--task-id", str(recording.task_id),
                       "--store", str(store)]  # fmt: skip
            done = await trio.run_process(
                command,
                stdin=scripted_customer(recording),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert done.returncode == 0, done.stderr.decode()
    (line,) = [x for x in done.stdout.decode().splitlines() if "look at the log:" in x]
    words = shlex.split(line.split("look at the log:", 1)[1])
    assert words[:2] == ["treadle", "show"] and words[3:] == ["--store", str(store)]
    shown = await trio.to_thread.run_sync(lambda: CliRunner().invoke(cli_main, words[1:]))
    assert shown.exit_code == 0 and "run finished" in shown.output


def test_demo_command(tmp_path, monkeypatch, workload):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    result = CliRunner().invoke(cli_main, ["demo"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "killed with SIGKILL" in out
    assert "HAS applied it" in out  # the cancellation ran before the kill
    assert "resumes the run from its log" in out
    assert "score 1.0   recorded score 1.0" in out
    assert "each applied exactly once: yes" in out
    stores = list((tmp_path / ".treadle").glob("demo-*.db"))
    assert len(stores) == 1
    assert f"treadle show airline-30-1 --store {Path('.treadle') / stores[0].name}" in out
    shown = CliRunner().invoke(cli_main, ["show", "airline-30-1", "--store", str(stores[0])])
    assert shown.exit_code == 0 and "cancel_reservation" in shown.output


def test_the_demos_closing_command_is_quoted_for_the_shell(tmp_path, workload):
    """The command the demo ends with held the store path unquoted: copied, a path with a
    space ran `treadle show` with extra arguments; one with ``[red]`` lost it (read as
    markup), as its first lines did."""
    import shlex

    store = tmp_path / "my runs[red]" / "demo 1.db"
    store.parent.mkdir()
    result = CliRunner().invoke(cli_main, ["demo", "--store", str(store), "--data", str(workload)])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if "treadle show" in x]
    words = shlex.split(line)
    assert words == ["treadle", "show", "airline-30-1", "--store", str(store)]
    flat = "".join(f"the run is logged in {store}".split())
    assert flat in "".join(result.output.split())  # however the line wraps
    shown = CliRunner().invoke(cli_main, words[1:])
    assert shown.exit_code == 0 and "cancel_reservation" in shown.output


def words_bash_reads(command: str) -> list[str]:
    """The words bash makes of ``command`` (a line copied from the terminal)."""
    done = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True
    )
    return [os.fsdecode(word) for word in done.stdout.split(b"\0")[:-1]]


def test_the_demos_closing_command_names_a_store_path_holding_control_characters(
    tmp_path, workload
):
    """The closing command was quoted for the shell and printed as it was: a tab in the store
    path came out raw (a terminal copies it as spaces), an escape sequence in it reached the
    terminal."""
    store = tmp_path / "tab\there \x1b[31m" / "demo.db"
    store.parent.mkdir()
    result = CliRunner().invoke(cli_main, ["demo", "--store", str(store), "--data", str(workload)])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if "treadle show" in x]
    assert line.isprintable()
    words = words_bash_reads(line.strip())
    assert words == ["treadle", "show", "airline-30-1", "--store", str(store)]
    shown = CliRunner().invoke(cli_main, words[1:])
    assert shown.exit_code == 0 and "cancel_reservation" in shown.output


def test_demos_started_in_the_same_second_get_a_store_each(tmp_path, monkeypatch, workload):
    # The default store was named to the second: a demo started in the same second as
    # another replayed into its store and reported a run it had not driven.
    from treadle.demo import _app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    monkeypatch.setattr(_app, "_stamp", lambda: "20250101-120000")
    results = [CliRunner().invoke(cli_main, ["demo"]) for _ in range(2)]
    names = ["demo-20250101-120000-2.db", "demo-20250101-120000.db"]
    assert sorted(p.name for p in (tmp_path / ".treadle").glob("*.db")) == names
    for result, name in zip(results, reversed(names), strict=True):
        assert result.exit_code == 0, result.output
        assert "killed with SIGKILL" in result.output
        assert "crashes 1 · resumes 1" in result.output
        assert f"--store {Path('.treadle') / name}" in result.output


def test_the_demo_run_again_on_its_finished_store_reports_the_same_figures(
    tmp_path, monkeypatch, workload
):
    # Run again, the summary mixed the stored figures with what this invocation saw:
    # "steps 0 · tool calls 10 … customer turns 0" beside "crashes 1 · resumes 1".
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    first, second = (CliRunner().invoke(cli_main, ["demo", "--store", "s.db"]) for _ in range(2))
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    figures = [" ".join(r.output.split(" result ")[-1].split()) for r in (first, second)]
    assert "steps 16 · tool calls 10 " in figures[0] and "customer turns 6" in figures[0]
    assert "crashes 1 · resumes 1 · history mismatches 0" in figures[0]
    assert figures[1] == figures[0]
    again = " ".join(second.output.split())
    assert "airline-30-1 had already finished in s.db: nothing was run again" in again
    assert "driver process" not in again and "already finished" not in first.output


def test_a_failed_replays_figures_are_the_runs_so_far(tmp_path, monkeypatch, workload):
    # A run whose drivers could not finish it was reported with made-up figures: "tool
    # calls 0" beside the log's 12 steps, and "each applied exactly once: NO" for a change
    # the database and the log both held once.
    from treadle.demo import _app
    from treadle.demo.airline import _drivers

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    monkeypatch.setattr(_drivers, "MAX_CHILDREN", 1)  # no driver resumes the killed one
    # After step 13's model intent, a barrier: step 12, with the cancellation's result, is
    # durable.
    point = CrashPoint(write=4 * 12 + 2, when="after")
    monkeypatch.setattr(_app, "demo_crash_point", lambda recording: point)
    result = CliRunner().invoke(cli_main, ["demo", "--store", "s.db"])
    assert result.exit_code == 1, result.output
    log = trio.run(read_demo_log, tmp_path / "s.db")
    calls = [r for r in log.records if isinstance(r, ActionResult) and r.tool != RESPOND_TOOL]
    turns = sum(1 for r in log.records if isinstance(r, ActionResult) and r.tool == RESPOND_TOOL)
    assert log.finished is None and len(log.steps) == 12 and len(calls) > 0
    out = " ".join(result.output.split(" result ")[-1].split())
    assert "the replay failed: the run was not finished after 1 driver processes" in out
    assert f"steps 12 · tool calls {len(calls)} ({len(calls)} outputs identical" in out
    assert f"customer turns {turns}" in out
    assert "crashes 1 · resumes 0 · history mismatches 0" in out
    assert "database changes 1, each applied exactly once: yes" in out


async def read_demo_log(store: Path) -> RunLog:
    """The log of the demo's run (``airline-30-1``) in ``store``."""
    async with open_sqlite_store(store) as opened:
        return await opened.read_log("airline-30-1")


def damaged_workload(workload: Path, target: Path, name: str, text: str | None) -> Path:
    """A workload folder whose ``data/<name>`` is ``text`` (absent for ``None``).

    The other files are links to the real ones.
    """
    (target / "data").mkdir(parents=True)
    for file in ("trajectories.json", "policy.md", "data/users.json", "data/reservations.json",
                 "data/flights.json"):  # fmt: skip
        if file != f"data/{name}":
            (target / file).symlink_to(workload / file)
        elif text is not None:
            (target / file).write_text(text, encoding="utf-8")
    return target


@pytest.mark.parametrize(
    ("command", "name", "text", "why"),
    [
        (["demo"], "flights.json", '{"x": ', "not JSON (Expecting value: line 1 column 7"),
        (["demo"], "flights.json", "[1, 2, 3]", "expected a JSON object keyed by id, got list"),
        (["demo"], "reservations.json", '{"ABC": 3}', "expected an object for 'ABC', got int"),
        (["demo"], "reservations.json", None, "No such file or directory"),
        (["demo", "airline"], "flights.json", '{"x": ', "not JSON"),
    ],
)
def test_a_damaged_data_file_is_named_in_a_one_line_error(
    workload, tmp_path, monkeypatch, command, name, text, why
):
    # A damaged flights.json gave a JSONDecodeError traceback not naming the file, a
    # wrong-shaped one a bare TypeError.
    damaged = damaged_workload(workload, tmp_path / "workload", name, text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(damaged))
    result = CliRunner().invoke(cli_main, command)
    assert result.exit_code == 1, result.output
    path = damaged / "data" / name
    assert f"Error: cannot read the airline data file {path}: {why}" in result.output
    assert result.output.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / ".treadle").exists()  # no store was made for nothing


@pytest.mark.parametrize("command", [["demo"], ["demo", "airline"]])
def test_a_store_that_is_not_a_sqlite_database_is_refused_before_anything_is_made(
    tmp_path, monkeypatch, workload, command
):
    # The store was opened only after the airline databases (3.5 MB) were made beside it.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    notes = "these are notes, not a database\n" * 100
    (tmp_path / "notadb.txt").write_text(notes, encoding="utf-8")
    result = CliRunner().invoke(cli_main, [*command, "--store", "notadb.txt"])
    assert result.exit_code == 1, result.output
    assert "notadb.txt: the database is damaged, or the file is not a SQLite database" in (
        result.output
    )
    assert [p.name for p in tmp_path.iterdir()] == ["notadb.txt"]
    assert (tmp_path / "notadb.txt").read_text(encoding="utf-8") == notes


@pytest.mark.parametrize("command", [["demo"], ["demo", "airline"]])
def test_a_store_where_nothing_can_be_made_is_refused_in_one_line(
    tmp_path, monkeypatch, workload, command
):
    # `--store /proc/x.db` (or a read-only mount) ended in the raw OSError's traceback of
    # making the folder of airline databases beside the store.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    (tmp_path / "afile").write_text("a file, not a folder\n", encoding="utf-8")
    result = CliRunner().invoke(cli_main, [*command, "--store", "afile/x.db"])
    assert result.exit_code == 1, result.output
    root = tmp_path / "afile" / "x.db.airline"
    assert result.output == (
        f"Error: cannot make {root}, the folder of the airline databases beside the store "
        f"{tmp_path / 'afile' / 'x.db'}: Not a directory\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


FILE_SIZE_LIMIT = 300_000
"""Bytes a file may grow to in `test_a_write_failing_beside_the_store_is_said_in_one_line`:
less than an airline database, more than a new run store."""


def file_size_limited() -> None:
    """In a child process: writes past `FILE_SIZE_LIMIT` fail (``EFBIG``), as on a full disk."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("command", "made", "fresh_first"),
    [
        (["demo"], "fresh.sqlite3", False),
        (["demo"], "conversations/airline-30-1.sqlite3", True),
        (["demo", "airline", "--json"], "conversations/airline-30-1.sqlite3", True),
    ],
)
def test_a_write_failing_beside_the_store_is_said_in_one_line(
    trajectories, workload, tmp_path, command, made, fresh_first
):
    # A full disk while the airline databases were made ended in sqlite3's
    # "database or disk is full" traceback, inside exception groups for a conversation's.
    store = tmp_path / "s.db"
    workspace = Workspace.beside(store)
    if fresh_first:
        workspace.fresh_database(workload)
    one = subset_file(trajectories, ("30-1",), tmp_path / "one.json")
    subset = ["--trajectories", str(one)] if "airline" in command else []
    done = subprocess.run(
        [sys.executable, "-m", "treadle.cli", *command, *subset, "--store", str(store),
         "--data", str(workload)],
        capture_output=True, text=True, preexec_fn=file_size_limited, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    [said] = done.stderr.splitlines()
    path = workspace.root / made
    assert said.startswith(f"Error: cannot write {path}, the airline database "), said
    assert f"beside the store {store}: " in said
    assert not path.exists()
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no partial


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["demo", "--recording", ""], "Invalid value for '--recording': '' is not TASK-TRIAL"),
        (["demo", "--recording", "30"], "Invalid value for '--recording': '30' is not TASK-TRIAL"),
        (["demo", "--store", ""], "Invalid value for '--store': give a file path"),
        (["demo", "airline", "--store", ""], "Invalid value for '--store': give a file path"),
    ],
)
def test_an_empty_or_malformed_option_is_a_usage_error(
    tmp_path, monkeypatch, workload, arguments, said
):
    # An empty --recording or --store stood for no option: the default was used silently.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    result = CliRunner().invoke(cli_main, arguments)
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("before", "said"),
    [
        (["--store", "kept.db"], "--store before 'airline' is an option of `treadle demo` itself"),
        (["--data", "workload"], "--data before 'airline' is an option of `treadle demo` itself"),
        (["--recording", "30-1"], "`treadle demo airline` replays every recording of its"),
    ],
)
def test_the_demos_options_before_airline_are_a_usage_error(
    trajectories, workload, tmp_path, monkeypatch, before, said
):
    # `treadle demo --store kept.db airline` exited 0: the group's --store was dropped, the
    # runs went to a temporary store that was then removed, and kept.db was never made.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_AIRLINE_DATA", str(workload))
    one = subset_file(trajectories, ("18-0",), tmp_path / "one.json")
    result = CliRunner().invoke(cli_main, ["demo", *before, "airline", "--trajectories", str(one)])
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["one.json"]


# --------------------------------------------------------------------------- the whole workload


KNOWN_REWARD_MISMATCHES: frozenset[str] = frozenset()
"""Runs whose replay does not reproduce the recorded reward; none at present (the issue
accepts up to 5 of 100)."""


@pytest.mark.slow
@pytest.mark.parametrize("quarter", range(4))
async def test_all_recordings_with_random_crashes(
    recordings, trajectories, workload, tmp_path, quarter
):
    # The 100 recordings in four parts of 25, each well under the suite's 120 s watchdog.
    assert len(recordings) == 100
    part = recordings[25 * quarter : 25 * (quarter + 1)]
    with trio.fail_after(600):
        reports = await replay_recordings(
            part,
            workspace=Workspace.beside(tmp_path / "runs.db"),
            trajectories=trajectories,
            data_dir=workload,
            crash="random",
            seed=2024,
            concurrency=4,
        )
    assert len(reports) == len(part)
    unequal = {r.run_id for r in reports if r.reward != r.recorded_reward}
    assert unequal <= KNOWN_REWARD_MISMATCHES
    calls = sum(r.recorded_tool_calls for r in reports)
    assert sum(r.observations_matching for r in reports) >= 0.98 * calls
    assert sum(r.history_mismatches for r in reports) == 0
    assert all(r.applied_once and r.db_matches_recording for r in reports)
    assert all(r.crashes == 1 and r.resumes == 1 for r in reports)
    assert all(r.error is None for r in reports)


def test_demo_without_data_or_network_says_so_clearly(tmp_path, monkeypatch):
    """No workload folder and no way to download it: a clear error, not a traceback."""
    import httpx
    from click.testing import CliRunner

    from treadle.cli import main
    from treadle.demo.airline import _discovery
    from treadle.demo.airline import data as airline_data

    def no_folder(explicit=None):
        raise airline_data.AirlineDataNotFound("not here")

    def no_network(dest, **kwargs):
        raise httpx.ConnectError("Name or service not known")

    monkeypatch.delenv("TREADLE_AIRLINE_DATA", raising=False)
    monkeypatch.setattr(_discovery, "find_data_dir", no_folder)
    monkeypatch.setattr(_discovery, "download_data", no_network)
    monkeypatch.setattr(_discovery, "default_cache_dir", lambda: tmp_path / "cache")
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 1
    assert "downloading it failed" in result.output
    assert "Traceback" not in result.output
