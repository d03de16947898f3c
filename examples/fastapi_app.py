"""A FastAPI application that drives treadle runs and streams them to a browser (docs/asyncio.md).

treadle runs in a trio thread behind the bridge `treadle.asyncio.open_runs`; FastAPI (on
uvicorn's asyncio loop) starts runs, streams their events over Server-Sent Events, approves
and cancels. Kill the server mid-run and start it again: the run resumes from its log (the
model call in flight is made afresh, no tool call runs twice), and the page's
``EventSource`` reconnects with ``Last-Event-ID``, the id of the last event it saw (a seq, or
``seq.ordinal`` for a step-started event), and carries on after it: no gap, no duplicate.
Stop it (SIGTERM, Ctrl-C) and its event streams end at once, so that it exits without waiting
for the runs to finish: they are drained (docs/asyncio.md, "The bridge") and resume in the
next server.

Run it against any OpenAI-compatible server::

    pip install 'treadle[fastapi]'
    export TREADLE_EXAMPLE_STORE=runs.db TREADLE_EXAMPLE_MODEL_URL=http://127.0.0.1:8000/v1
    uvicorn --app-dir examples fastapi_app:app --host 127.0.0.1 --port 8080

then open http://127.0.0.1:8080/. Settings (environment variables):

* ``TREADLE_EXAMPLE_STORE``: the SQLite file of the runs (default ``runs.db``);
* ``TREADLE_EXAMPLE_MODEL_URL``: the model server's API root;
* ``TREADLE_EXAMPLE_MODEL``: the model name sent (default ``example-model``);
* ``TREADLE_EXAMPLE_LEDGER``: the file the ``save_note`` tool appends to (default
  ``notes.txt``), its side effect;
* ``TREADLE_EXAMPLE_OWNER``: the lease owner id. It is fixed (``fastapi-example``) so that
  the restarted server continues its dead predecessor's leases at once; run one instance
  per owner id (docs/fleet.md, "Leases").
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel

import treadle
from treadle.asyncio import Runs, open_runs, resume_after, sse_frame

T = TypeVar("T")

LEDGER = Path(os.environ.get("TREADLE_EXAMPLE_LEDGER", "notes.txt"))


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
def save_note(text: str, ctx: treadle.ToolContext) -> str:
    """Save a note (once per call: a replayed call finds its line by the intent id)."""
    line = f"{ctx.intent_id}\t{text}\n"
    if LEDGER.exists() and line in LEDGER.read_text(encoding="utf-8"):
        return "saved"
    with LEDGER.open("a", encoding="utf-8") as ledger:
        ledger.write(line)
        ledger.flush()
        os.fsync(ledger.fileno())
    return "saved"


def make_agent() -> treadle.Agent:
    """The agent the application runs: one tool, an OpenAI-compatible model."""
    return treadle.Agent(
        model=treadle.OpenAIChatClient(
            base_url=os.environ.get("TREADLE_EXAMPLE_MODEL_URL", "http://127.0.0.1:8000/v1")
        ),
        model_name=os.environ.get("TREADLE_EXAMPLE_MODEL", "example-model"),
        system_prompt="Save what the user asks you to note, then say what you saved.",
        executor=treadle.Toolbox([save_note]),
        parser=treadle.NativeToolCallParser(),
    )


class Stopping(Exception):
    """The server was told to stop before the awaited call answered."""


@contextmanager
def set_when_told_to_stop(stopping: asyncio.Event) -> Iterator[None]:
    """Set ``stopping`` on SIGTERM or SIGINT, then handle the signal as the server does.

    uvicorn leaves the lifespan (and so `open_runs`, which ends the event streams) only once
    every connection has closed, and the event stream of an unfinished run never closes by
    itself: a run waiting on a human would hold the stop until its approval deadline. The
    requests that wait on a run end on ``stopping`` instead (docs/asyncio.md, "A FastAPI
    application that survives a restart"). The server's own handlers, installed before the
    lifespan starts, are called after and put back on exit. A signal without a Python
    handler is left as it is; off the main thread (a test client's) no signal handler can be
    installed, and nothing is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    servers: dict[int, Callable[[int, FrameType | None], Any]] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            servers[sig] = handler

    def handle(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(stopping.set)
        servers[sig](sig, frame)

    for sig in servers:
        signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in servers.items():
            signal.signal(sig, handler)


async def unless_stopping(stopping: asyncio.Event, awaitable: Awaitable[T]) -> T:
    """What ``awaitable`` returns, unless ``stopping`` is set first.

    Raises:
        Stopping: ``stopping`` was set first: ``awaitable`` was cancelled and has ended (a
            call of `Runs` is cancelled in treadle's trio thread too).
    """
    task = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise Stopping
    return task.result()


async def until_stopping(stopping: asyncio.Event, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of ``items`` until they end or ``stopping`` is set (the caller closes it)."""
    while not stopping.is_set():
        try:
            item = await unless_stopping(stopping, anext(items))
        except (StopAsyncIteration, Stopping):
            return
        yield item


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start treadle's trio thread (resuming unfinished runs) for the server's lifetime."""
    store = os.environ.get("TREADLE_EXAMPLE_STORE", "runs.db")
    app.state.stopping = stopping = asyncio.Event()
    with set_when_told_to_stop(stopping):
        async with open_runs(
            make_agent(),
            store=lambda: treadle.open_sqlite_store(store),
            owner=os.environ.get("TREADLE_EXAMPLE_OWNER", "fastapi-example"),
        ) as runs:
            app.state.runs = runs
            yield


app = FastAPI(lifespan=lifespan)


def _runs(request: Request) -> Runs:
    runs: Runs = request.app.state.runs
    return runs


def _stopping(request: Request) -> asyncio.Event:
    stopping: asyncio.Event = request.app.state.stopping
    return stopping


class NewRun(BaseModel):
    """The body of ``POST /runs``."""

    text: str
    run_id: str | None = None


class Decision(BaseModel):
    """The body of ``POST /runs/{run_id}/approve``."""

    reject: str | None = None


# Run ids may hold ``/`` (``user-42/conv-7``: docs/concepts.md, "Run ids"). A browser sends it
# as ``%2F``, which the router sees decoded, so each route takes the id as a path; the routes
# with a suffix come before ``GET /runs/{run_id}``, which would take ``.../events`` too.


@app.post("/runs")
async def start_run(body: NewRun, request: Request) -> dict[str, str]:
    """Start a run; its events are at ``/runs/{run_id}/events``.

    409 for a run id another instance drives (a client retrying a request it sent there),
    400 for a request no run can take.
    """
    try:
        run_id = await _runs(request).start(body.text, run_id=body.run_id)
    except treadle.RunLeased as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    except treadle.UsageError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    return {"run_id": run_id}


def _unknown(exc: treadle.UsageError) -> HTTPException:
    """400 for a malformed run id, 404 for a run the store does not have."""
    status = 400 if isinstance(exc, treadle.InvalidRunId) else 404
    return HTTPException(status_code=status, detail=str(exc))


async def _require_run(runs: Runs, run_id: str) -> None:
    """Answer 404 (or 400) now, before the stream's 200: a run has its seq 1 at once.

    A stream that broke after its 200 would have the browser's ``EventSource`` reconnect
    forever; an error status makes it stop.
    """
    try:
        async with aclosing(runs.events(run_id)) as events:
            async for _ in events:
                return
    except treadle.UsageError as exc:
        raise _unknown(exc) from exc


@app.get("/runs/{run_id:path}/events")
async def run_events(
    run_id: str,
    request: Request,
    last_event_id: str | None = Header(default=None),
    from_seq: int = Query(default=1, ge=1),
) -> StreamingResponse:
    """The run's events as Server-Sent Events, after ``Last-Event-ID`` (or from ``from_seq``)."""
    after = None
    if last_event_id is not None:
        try:
            after = resume_after(last_event_id)
        except treadle.UsageError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
    await _require_run(_runs(request), run_id)
    if after is None:
        events = _runs(request).events(run_id, from_seq=from_seq)
    else:
        events = _runs(request).events(run_id, after=after)

    async def frames() -> AsyncIterator[bytes]:
        yield b"retry: 500\n\n"  # the browser reconnects after half a second
        # The stream ends when the server is told to stop; the browser reconnects with
        # Last-Event-ID, to the server that takes over.
        async with aclosing(events):
            async for event in until_stopping(_stopping(request), events):
                yield sse_frame(event, run_id=run_id)  # ids of this run's events only

    return StreamingResponse(frames(), media_type="text/event-stream")


@app.post("/runs/{run_id:path}/approve")
async def approve(run_id: str, body: Decision, request: Request) -> dict[str, Any]:
    """Approve (or reject) the tool call the run waits on."""
    try:
        decided = await _runs(request).approve(run_id, reject=body.reject)
    except treadle.UsageError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    return {"decision": decided.decision, "call_id": decided.call_id}


@app.post("/runs/{run_id:path}/cancel")
async def cancel(run_id: str, request: Request) -> dict[str, str]:
    """Cancel the run."""
    try:
        await _runs(request).cancel(run_id, "cancelled from the page", canceller="browser")
    except treadle.UsageError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    return {"run_id": run_id}


@app.get("/runs/{run_id:path}")  # after the routes above: ``/runs/a/b/events`` is a stream
async def result(run_id: str, request: Request) -> dict[str, Any]:
    """Wait for the run's result.

    503 when its drive here stopped unfinished (it resumes from its log: ask again later),
    or when the server is told to stop first.
    """
    try:
        done = await unless_stopping(_stopping(request), _runs(request).result(run_id))
    except Stopping:
        raise HTTPException(status_code=503, detail="the server is stopping") from None
    except treadle.RunInterrupted as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from exc
    except treadle.UsageError as exc:
        raise _unknown(exc) from exc
    return {"state": done.state.value, "final_answer": done.final_answer}


PAGE = """<!doctype html>
<meta charset="utf-8"><title>treadle</title>
<form id="f"><input id="t" value="Note: buy milk" size="40"> <button>Run</button></form>
<pre id="out"></pre>
<script>
const out = document.getElementById("out");
document.getElementById("f").onsubmit = async (e) => {
  e.preventDefault();
  const r = await fetch("/runs", {method: "POST", headers: {"content-type": "application/json"},
    body: JSON.stringify({text: document.getElementById("t").value})});
  const {run_id} = await r.json();
  // EventSource reconnects by itself, sending Last-Event-ID: the id of the last event it saw
  const source = new EventSource(`/runs/${encodeURIComponent(run_id)}/events`);
  // a child run's events come too, named by their run id: this page shows the run's own
  const own = (m) => { const d = JSON.parse(m.data); return d.run_id === run_id ? d : null; };
  source.addEventListener("text_delta", (m) => { out.textContent += own(m)?.text ?? ""; });
  source.addEventListener("model_call_started", (m) => { if (own(m)) out.textContent += "\\n"; });
  source.addEventListener("run_finished", (m) => { if (own(m)) source.close(); });
};
</script>
"""


@app.get("/", response_class=HTMLResponse)
async def page() -> str:
    """A page that starts a run and shows its text as it streams."""
    return PAGE
