"""examples/fastapi_app.py survives a restart of its server mid-run (docs/asyncio.md).

The application runs as a real ``uvicorn`` subprocess on 127.0.0.1 against a loopback model
server (src/treadle/testing/loopback.py, in a thread of this process). The test reads the
run's Server-Sent Events with httpx, SIGKILLs the server while the model streams its answer,
starts it again, reconnects with ``Last-Event-ID`` set to the last seq it saw, and checks that
the durable events of both connections are 1..N with no gap and no duplicate, that the run
finished with its tool's side effect made once, and that the model call cut by the kill was
made afresh.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path

import httpx
import pytest
import trio

import treadle
from treadle.asyncio import resume_after
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing.loopback import (
    ClientGone,
    RecordedRequest,
    ResponseWriter,
    open_loopback_server,
)
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import ModelResult

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as missing:
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must run the FastAPI example's test: {missing}") from missing
    pytest.skip(f"needs treadle[fastapi]: {missing}", allow_module_level=True)

ANSWER = [f"word{i} " for i in range(20)]


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "example-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n".encode()


class ModelServer:
    """An OpenAI-compatible loopback server in a thread: turn 1 calls ``save_note``; turn 2
    streams ``ANSWER``, except that its first attempt stalls after three words (the server
    is killed then). Answer attempt n streams once ``gates[n - 1]`` is set: the test sets it
    when its event stream is live, so the deltas are streamed to it."""

    def __init__(self) -> None:
        self.requests: list[RecordedRequest] = []
        self.answers_started = 0
        self.gates = [threading.Event(), threading.Event()]
        self._ready = threading.Event()
        self._port = 0
        self._stop: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        assert self._ready.wait(30), "the model server did not start"
        return f"http://127.0.0.1:{self._port}/v1"

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None and self._stop is not None
        self._token.run_sync_soon(self._stop.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        async with open_loopback_server(stream_handler=self._respond) as server:
            self._port = server.port
            self._ready.set()
            await self._stop.wait()

    async def _respond(self, request: RecordedRequest, writer: ResponseWriter) -> None:
        self.requests.append(request)
        turn = sum(m["role"] == "assistant" for m in request.json()["messages"])
        await writer.start(200, {"content-type": "text/event-stream"})
        if turn == 0:
            call = {"index": 0, "id": "call_1", "type": "function"}
            call["function"] = {"name": "save_note", "arguments": '{"text": "buy milk"}'}
            await writer.write(_chunk({"role": "assistant", "tool_calls": [call]}))
            await writer.write(_chunk({}, "tool_calls"))
        else:
            self.answers_started += 1
            stall = self.answers_started == 1
            gate = self.gates[min(self.answers_started, 2) - 1]
            assert await trio.to_thread.run_sync(gate.wait, 60), "the test never subscribed"
            for index, word in enumerate(ANSWER):
                if stall and index == 3:
                    try:
                        await writer.pause(3600)  # until the killed server's socket closes
                    except ClientGone:
                        return
                await writer.write(_chunk({"content": word}))
                await writer.pause(0.02)
            await writer.write(_chunk({}, "stop"))
        await writer.write(b"data: [DONE]\n\n")
        await writer.end()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def app_server(port: int, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """``uvicorn fastapi_app:app`` on 127.0.0.1:port, once its startup completed."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(EXAMPLES),
            "fastapi_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "Application startup complete" in line:
                started.set()
        started.set()  # the process ended: the check below reports it

    threading.Thread(target=read, daemon=True).start()
    try:
        assert started.wait(60) and proc.poll() is None, "".join(lines)
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


def sse(response: httpx.Response) -> Iterator[tuple[str | None, str, dict]]:
    """``(id, event, data)`` of each frame of a Server-Sent Events response."""
    frame: dict[str, str] = {}
    for line in response.iter_lines():
        if not line:
            if "data" in frame:
                yield frame.get("id"), frame.get("event", "message"), json.loads(frame["data"])
            frame = {}
            continue
        name, _, value = line.partition(":")
        frame[name] = value.removeprefix(" ")


def test_the_example_resumes_after_a_kill_and_the_stream_reconnects_from_its_last_seq(
    tmp_path: Path,
):
    db, ledger = tmp_path / "runs.db", tmp_path / "notes.txt"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    first: list[tuple[int, str]] = []
    last_id = ""
    second: list[tuple[int, str]] = []
    deltas_after_restart: list[str] = []
    model = ModelServer()
    with model as model_url:
        env = {
            **os.environ,
            "TREADLE_EXAMPLE_STORE": str(db),
            "TREADLE_EXAMPLE_MODEL_URL": model_url,
            "TREADLE_EXAMPLE_LEDGER": str(ledger),
            "TREADLE_EXAMPLE_OWNER": "example-test",
        }
        with app_server(port, env) as (server, _):
            started = httpx.post(f"{url}/runs", json={"text": "note milk", "run_id": "r1"})
            assert started.status_code == 200, started.text
            assert started.json() == {"run_id": "r1"}
            tool_done = False
            with httpx.stream("GET", f"{url}/runs/r1/events", timeout=60) as response:
                for event_id, kind, data in sse(response):
                    model.gates[0].set()  # the stream is live
                    if event_id is not None:
                        assert resume_after(event_id) == (data["seq"], data.get("ordinal", 0))
                        first.append((data["seq"], kind))
                        last_id = event_id
                    tool_done = tool_done or kind == "action_finished"
                    if kind == "text_delta" and tool_done:
                        break  # the answer streams (and stalls after three words)
            server.send_signal(signal.SIGKILL)  # mid-answer: the model call is in flight
            server.wait(30)
        assert ledger.read_text(encoding="utf-8").count("\n") == 1
        with app_server(port, env) as (server, said):
            headers = {"Last-Event-ID": last_id}
            with httpx.stream("GET", f"{url}/runs/r1/events", headers=headers, timeout=60) as r:
                for event_id, kind, data in sse(r):
                    model.gates[1].set()
                    if event_id is not None:
                        second.append((data["seq"], kind))
                    elif kind == "text_delta":
                        deltas_after_restart.append(data["text"])
            result = httpx.get(f"{url}/runs/r1", timeout=60).json()
            server.send_signal(signal.SIGTERM)  # uvicorn shuts down, then re-raises it
            assert server.wait(60) in (0, -signal.SIGTERM)
            assert any("Application shutdown complete" in line for line in said), said
    assert model.answers_started == 2 and len(model.requests) == 3

    async def read():
        async with open_sqlite_store(db) as store:
            return await store.read_log("r1")

    log = trio.run(read)
    seqs = [seq for seq, kind in first + second if kind != "step_started"]
    assert seqs == list(range(1, len(log.records) + 1))  # no gap, no duplicate
    steps = [seq for seq, kind in first + second if kind == "step_started"]
    assert len(steps) == len(set(steps)) == log.finished.totals.steps  # each step's, once
    assert second[-1][1] == "run_finished"
    assert result == {"state": "succeeded", "final_answer": "".join(ANSWER)}
    # the tool ran once: its line is in the ledger once, under its intent id
    assert ledger.read_text(encoding="utf-8") == "r1/s1/a1\tbuy milk\n"
    # the answer cut by the kill was recorded abandoned and asked again, streamed in full
    model_results = [r for r in log.records if isinstance(r, ModelResult)]
    assert [r.abandoned for r in model_results] == [False, True, False]
    assert "".join(deltas_after_restart) == "".join(ANSWER)


def load_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *finished: str):
    """examples/fastapi_app.py as a module, over a store holding runs ``finished`` (each
    answered ``noted``); its model is never called."""
    import importlib.util

    import treadle
    from treadle.testing.scripted import ScriptedModel, say

    db = tmp_path / "runs.db"

    async def finish() -> None:
        async with open_sqlite_store(str(db)) as store:
            for run_id in finished:
                agent = treadle.Agent(
                    model=ScriptedModel(turns=[say("noted")]),
                    executor=treadle.Toolbox([]),
                    parser=treadle.NativeToolCallParser(),
                )
                await treadle.run(agent, "note", store=store, run_id=run_id)

    trio.run(finish)
    monkeypatch.setenv("TREADLE_EXAMPLE_STORE", str(db))
    monkeypatch.setenv("TREADLE_EXAMPLE_LEDGER", str(tmp_path / "notes.txt"))
    monkeypatch.setenv("TREADLE_EXAMPLE_MODEL_URL", "http://127.0.0.1:9/v1")  # never called
    spec = importlib.util.spec_from_file_location("fastapi_app", EXAMPLES / "fastapi_app.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_a_run_the_store_does_not_have_answers_404_not_500_or_a_broken_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``GET /runs/nope`` answered 500 (the UsageError of runs.result unhandled), and
    ``GET /runs/nope/events`` answered 200 and then broke the stream, which a browser's
    EventSource reconnects to for ever."""
    from fastapi.testclient import TestClient

    example = load_example(tmp_path, monkeypatch, "done")
    with TestClient(example.app, raise_server_exceptions=False) as client:
        assert client.get("/runs/nope").status_code == 404
        missing = client.get("/runs/nope/events")
        assert missing.status_code == 404 and "no run 'nope'" in missing.json()["detail"]
        assert client.get("/runs/%20bad/events").status_code == 400  # no run can have it
        assert client.get("/runs/done/events", params={"from_seq": 0}).status_code == 422
        huge = {"last-event-id": "1" * 5000}  # int() cannot read it: it answered 500
        assert client.get("/runs/done/events", headers=huge).status_code == 400
        stream = client.get("/runs/done/events", params={"from_seq": 2})
        assert client.get("/runs/done").json()["state"] == "succeeded"
    assert stream.status_code == 200
    frames = list(sse(stream))
    assert frames[0][0] == "2" and frames[-1][1] == "run_finished"


def test_a_run_whose_id_holds_a_slash_has_its_events_result_and_cancel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Run ids may hold ``/`` (docs/concepts.md, "Run ids"); the page asks for
    ``/runs/user-42%2Fconv-7/events``, which the router sees decoded: every per-run URL of
    such a run answered 404."""
    from fastapi.testclient import TestClient

    example = load_example(tmp_path, monkeypatch, "user-42/conv-7", "user-42")
    with TestClient(example.app, raise_server_exceptions=False) as client:
        stream = client.get("/runs/user-42%2Fconv-7/events")
        done = client.get("/runs/user-42%2Fconv-7")
        cancel = client.post("/runs/user-42%2Fconv-7/cancel")
        approve = client.post("/runs/user-42%2Fconv-7/approve", json={})
        other = client.get("/runs/user-42")
        missing = client.get("/runs/user-42%2Fnope/events")
    assert stream.status_code == 200
    frames = list(sse(stream))
    assert frames[0][:2] == ("1", "run_started") and frames[-1][1] == "run_finished"
    assert done.json() == {"state": "succeeded", "final_answer": "noted"}
    assert cancel.status_code == 200 and cancel.json() == {"run_id": "user-42/conv-7"}
    assert approve.status_code == 409 and "user-42/conv-7" in approve.json()["detail"]
    assert other.json()["state"] == "succeeded"
    assert missing.status_code == 404 and "user-42/nope" in missing.json()["detail"]


@contextmanager
def driven_elsewhere(db: Path, run_id: str) -> Iterator[None]:
    """Run ``run_id`` in a trio thread as another instance of the application would (owner
    ``instance-2``): it waits for an approval, holding the run's lease, until the block ends."""

    @treadle.tool(requires_approval=True)
    async def pay(amount: int) -> str:
        """Pay."""
        return "paid"

    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("pay", amount=5), say("paid")]),
        executor=treadle.Toolbox([pay]),
        parser=treadle.NativeToolCallParser(),
    )
    holding, leave = threading.Event(), threading.Event()

    async def hold() -> None:
        async with (
            open_sqlite_store(str(db)) as store,
            treadle.open_run(
                agent, "pay", store=store, run_id=run_id, owner="instance-2", park_after_s=None
            ) as handle,
        ):
            async with aclosing(handle.events()) as events:
                async for event in events:
                    if event.kind is treadle.EventKind.APPROVAL_REQUESTED:
                        break
            holding.set()
            await trio.to_thread.run_sync(leave.wait)
            handle.drain()  # unfinished, its lease let go

    thread = threading.Thread(target=trio.run, args=(hold,), daemon=True)
    thread.start()
    try:
        assert holding.wait(60), "the other instance never drove the run"
        yield
    finally:
        leave.set()
        thread.join(60)


class InterruptedRuns:
    """A stand-in for the application's `Runs` whose result wait ends as one does when the
    run's drive here stops unfinished (it was drained, or an actor failed)."""

    async def result(self, run_id: str) -> object:
        raise treadle.RunInterrupted(run_id, "this process stopped driving it (drained)")


def test_a_run_driven_elsewhere_answers_409_and_one_interrupted_here_503_not_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``POST /runs`` retrying a run id another instance drives answered 500 (``RunLeased``
    is no UsageError), and so did ``GET /runs/{id}`` for a run whose drive here stopped
    unfinished (``RunInterrupted``): both are documented answers of `Runs`."""
    from fastapi.testclient import TestClient

    example = load_example(tmp_path, monkeypatch)
    with (
        driven_elsewhere(tmp_path / "runs.db", "busy"),
        TestClient(example.app, raise_server_exceptions=False) as client,
    ):
        leased = client.post("/runs", json={"text": "pay", "run_id": "busy"})
        runs, example.app.state.runs = example.app.state.runs, InterruptedRuns()
        interrupted = client.get("/runs/b1")
        example.app.state.runs = runs
    assert leased.status_code == 409 and "driven by instance-2" in leased.json()["detail"]
    assert interrupted.status_code == 503
    assert "stopped driving it (drained)" in interrupted.json()["detail"]


class HeldAnswerServer(ModelServer):
    """A loopback model server in a thread whose answer streams ``ANSWER[0]`` once
    ``gates[0]`` is set (the test's event stream is live), and the rest of ``ANSWER`` once
    ``gates[1]`` is."""

    async def _respond(self, request: RecordedRequest, writer: ResponseWriter) -> None:
        self.requests.append(request)
        await writer.start(200, {"content-type": "text/event-stream"})
        assert await trio.to_thread.run_sync(self.gates[0].wait, 60), "never subscribed"
        await writer.write(_chunk({"role": "assistant", "content": ANSWER[0]}))
        assert await trio.to_thread.run_sync(self.gates[1].wait, 60), "never released"
        for word in ANSWER[1:]:
            await writer.write(_chunk({"content": word}))
        await writer.write(_chunk({}, "stop"))
        await writer.write(b"data: [DONE]\n\n")
        await writer.end()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_open_event_streams_and_the_server_exits_by_itself(
    tmp_path: Path, sig: signal.Signals
):
    """uvicorn leaves the lifespan (where `open_runs` ends the event streams) only once every
    connection has closed, and the stream of an unfinished run never closed: SIGTERM or
    Ctrl-C waited for the run to finish, for a run waiting on a human until its approval
    deadline. The stream ends when the server is told to stop, and the server exits."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    kinds: list[str] = []
    model = HeldAnswerServer()
    with model as model_url:
        env = {
            **os.environ,
            "TREADLE_EXAMPLE_STORE": str(tmp_path / "runs.db"),
            "TREADLE_EXAMPLE_MODEL_URL": model_url,
            "TREADLE_EXAMPLE_LEDGER": str(tmp_path / "notes.txt"),
            "TREADLE_EXAMPLE_OWNER": "example-test",
        }
        try:
            with app_server(port, env) as (server, said):
                started = httpx.post(f"{url}/runs", json={"text": "hello", "run_id": "r1"})
                assert started.status_code == 200, started.text
                with httpx.stream("GET", f"{url}/runs/r1/events", timeout=60) as response:
                    for _, kind, _ in sse(response):
                        kinds.append(kind)
                        model.gates[0].set()  # the stream is live
                        if kind == "text_delta":  # the answer streams, then holds
                            server.send_signal(sig)
                # the stream ended (it had not: the read timed out, and the server went on)
                model.gates[1].set()  # the model call the drain waits for ends
                code = server.wait(60)
                assert any("Application shutdown complete" in line for line in said), said
        finally:
            for gate in model.gates:
                gate.set()
    assert kinds.count("text_delta") == 1 and "run_finished" not in kinds
    # uvicorn shuts down, then raises the signal again: SIGTERM ends the process by its
    # default action, SIGINT raises KeyboardInterrupt, which uvicorn's command exits 0 on
    assert code in (0, -sig), said


def test_once_the_server_is_told_to_stop_a_wait_for_a_result_answers_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A ``GET /runs/{id}`` waiting for an unfinished run held the server's stop as an event
    stream did; once the server is told to stop (the event a SIGTERM or SIGINT sets), the
    wait answers 503 and the stream of the same run ends."""
    from fastapi.testclient import TestClient

    example = load_example(tmp_path, monkeypatch)
    with (
        driven_elsewhere(tmp_path / "runs.db", "busy"),
        TestClient(example.app, raise_server_exceptions=False) as client,
    ):
        assert client.portal is not None
        client.portal.call(example.app.state.stopping.set)
        waited = client.get("/runs/busy")
        stream = client.get("/runs/busy/events")
    assert waited.status_code == 503 and waited.json() == {"detail": "the server is stopping"}
    assert stream.status_code == 200 and stream.text == "retry: 500\n\n"
