"""The run console's web app: Starlette routes over one open store.

Pages are Jinja2 templates with autoescaping on for every value; live parts stream over
server-sent events read from the store's log (the same reads ``treadle tail`` makes). Actions
go through the code paths of ``treadle approve`` and ``treadle cancel``. Every response carries
a Content-Security-Policy that allows this app's own script and style only, and every
state-changing request needs the console's token and a same-origin request
(docs/ui.md, "Safety").
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlencode

import attrs
import jinja2
import trio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle._cli_common import covered_turns, marked_range, verbatim_text
from treadle._cli_runs import approve, cancel
from treadle._cli_store import driver_text
from treadle._cli_ui import check_token
from treadle._exceptions import (
    InvalidRunId,
    LogCorrupted,
    SchemaTooNew,
    StoreError,
    StoreRefused,
    StoreStopped,
    TreadleError,
    UsageError,
)
from treadle._ids import check_run_id
from treadle._text import read_count, valid_unicode
from treadle._ui import _view
from treadle.approvals import edited_arguments, pending_approval
from treadle.asyncio import resume_after
from treadle.ports import RunIndex, RunStore
from treadle.redaction import Redaction
from treadle.types import ApprovalRequested, Liveness, RunLog, RunState, RunSummary

HERE = Path(__file__).resolve().parent
_T = TypeVar("_T")

POLL_S = 0.2
"""Seconds between two reads of the store by a live stream (as ``treadle tail``)."""
RECHECK_S = 30.0
"""Seconds after which a live stream reads a run's whole log again though its record count
did not move: damage in an idle run's log ends the stream within that time (docs/ui.md)."""
ROWS_POLL_S = 0.5
"""The least seconds between two reads of the runs list by a ``/rows`` stream."""
RENDER_GAP = 4.0
"""A live stream's rest after a whole read of a run's log and the render of its new records,
in multiples of the seconds (wall clock) that read and render took: an open page costs a long
run at most about a fifth of the time of its own updates, however fast the run writes
(docs/ui.md, "A run's page"; docs/decisions/0104-long-runs-render-off-the-loop.md)."""
RETRY_S = 0.5
"""Seconds a live stream waits before it reads the store again after a read that failed for
a passing reason (a dropped connection); the wait doubles with each failure in a row, up to
`RETRY_MAX_S` (docs/ui.md, "When the store fails a read")."""
RETRY_MAX_S = 10.0
"""The longest wait of a live stream between two reads that fail for a passing reason."""
RENDER_THREADS = 2
"""The renders of run pages and streams that run at once, each in a worker thread: the event
loop that serves every other request shares the interpreter with at most these."""

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
"""The Content-Security-Policy of every response: no inline script, nothing from elsewhere."""

TOKEN_HEADER = "x-treadle-token"
TOKEN_COOKIE = "treadle_token"
"""The start of the name of the cookie that keeps a console's token (`Settings.cookie`)."""
ACTIONS = ("approve", "cancel")
"""The actions on a run: ``POST /runs/RUN/ACTION`` (docs/ui.md, "Approving, rejecting,
cancelling")."""
MAX_FORM_FIELDS = 16
"""The most fields an action's form may hold (the approval form has six)."""


@attrs.frozen
class Settings:
    """How the console was started.

    Attributes:
        token: the secret every state-changing request must carry: printable ASCII other
            than space (`treadle._cli_ui.check_token`; a header and a cookie carry no other).
        token_for_reads: reads need the token too (it was given, not generated).
        allowed_hosts: the Host header values served (a rebinding guard); ``("*",)`` for any.
        poll_s: seconds between store reads of a live stream.
        recheck_s: seconds between whole reads of a log whose record count did not move.
        retry_s: seconds a live stream waits after a store read failed for a passing reason,
            doubled with each failure in a row up to `RETRY_MAX_S`.
        canceller: who the cancel records name.

    Raises:
        UsageError: ``token`` holds other characters, or none.
    """

    token: str = attrs.field(validator=lambda _, __, token: check_token(token))
    token_for_reads: bool = False
    allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
    poll_s: float = POLL_S
    recheck_s: float = RECHECK_S
    retry_s: float = RETRY_S
    canceller: str = "treadle ui"

    @property
    def cookie(self) -> str:
        """The name of the cookie that keeps the token.

        `TOKEN_COOKIE`, ``_`` and the first 16 hex digits of the token's SHA-256. A browser
        keeps one cookie per host and name, whatever the port: consoles on one host with one
        name would each overwrite the other's token (docs/ui.md, "Safety").
        """
        digest = hashlib.sha256(self.token.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{TOKEN_COOKIE}_{digest[:16]}"


@attrs.frozen
class Row:
    """One line of the runs list."""

    summary: RunSummary
    driver: str
    tokens: int | None
    thread: str | None

    @property
    def state(self) -> str:
        """The run's state, or ``unreadable``."""
        return self.summary.state.value if self.summary.state else "unreadable"

    @property
    def shown(self) -> tuple[object, ...]:
        """What the list's table (``_rows.html``) shows of the run, to tell a change.

        Not the summary's ``observed_at``, which moves with every read.
        """
        s = self.summary
        return (
            *(s.run_id, self.state, s.liveness, self.driver, s.agent, self.thread),
            *(s.steps, self.tokens, s.started_at, s.stop_reason, s.error),
        )

    @property
    def search_text(self) -> str:
        """What the search box matches, lower-cased."""
        parts = (self.summary.run_id, self.summary.agent, self.thread, self.driver, self.state)
        return " ".join(p for p in parts if p).lower()


@attrs.frozen
class _Look:
    """What one look of a live stream at the store found: its events, then a rest or the end.

    Attributes:
        events: the events to send, in order.
        rest_s: seconds (trio clock) before the stream looks again.
        done: the stream ends after ``events``.
    """

    events: list[ServerSentEvent]
    rest_s: float = 0.0
    done: bool = False


@attrs.define
class _Follow:
    """What a run's stream knows of its run between two looks (`_Console._look`).

    Attributes:
        run_id: the run.
        next_seq: the first seq not sent yet.
        read: a whole read not turned into events yet (the one that found the run), with
            when it began (trio clock); else ``None``.
        log: the last whole read's log (the panel is rendered from it again when only the
            run's summary changed), ``None`` before the first.
        panel: what the panel last sent showed of the run's summary (`_panel_facts`).
        read_at: when the last whole read and its render ended (trio clock).
        gap: seconds to rest after ``read_at`` before the next look (`RENDER_GAP`).
    """

    run_id: str
    next_seq: int
    read: tuple[float, tuple[RunLog, RunSummary | None]] | None = None
    log: RunLog | None = None
    panel: object = None
    read_at: float = -math.inf
    gap: float = 0.0


class _SecurityHeaders:
    """Adds the CSP and the other protective headers to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    # same-origin: a plain form post (no scripts) carries its Origin; with
                    # no-referrer, Chromium sends "Origin: null" and the post is refused
                    (b"referrer-policy", b"same-origin"),
                    (b"x-frame-options", b"DENY"),
                    (b"cache-control", b"no-store"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class _RunIdPaths:
    """Keeps a ``/`` inside a run id's path segment (sent as ``%2F``) out of the routing.

    Run ids may hold ``/`` (docs/concepts.md, "Run ids"), so the console's paths name a run
    as one segment, `run_path` of its id. The router matches the decoded path, in which an
    encoded ``/`` would split the segment; here each segment of the raw path is decoded by
    itself and a ``/`` (and ``%``) in it is encoded again, so ``/runs/a%2Fevents`` is the page
    of run ``a/events`` and ``/runs/a/events`` the stream of run ``a``. The routes take the
    id as a path (``/runs/a/b`` is run ``a/b`` too); the handlers decode it (`_run_id`).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path")
        if scope["type"] == "http" and isinstance(raw, bytes) and raw.startswith(b"/runs/"):
            segments = [unquote(part) for part in raw.decode("latin-1").split("/")]
            path = "/".join(
                quote(part, safe="") if "/" in part or "%" in part else part for part in segments
            )
            scope = {**scope, "path": path}
        await self.app(scope, receive, send)


def run_path(run_id: str) -> str:
    """``run_id`` as one path segment, for the console's links and forms.

    Every character outside letters, digits and ``_.-~`` is percent-encoded, ``/`` included
    (`_RunIdPaths` routes on it).
    """
    return quote(run_id, safe="")


def _run_id(request: Request) -> str:
    """The run id a path names (its segment decoded, ``%2F`` back to ``/``)."""
    return unquote(request.path_params["run_id"])


def templates() -> jinja2.Environment:
    """The console's templates, every value autoescaped."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.globals["json_text"] = _view.json_text
    env.globals["CHART_WIDTH"] = _view.CHART_WIDTH
    env.filters["run_path"] = run_path
    # what the context of a model call covers, in `treadle show`'s words
    env.globals["covered_turns"] = covered_turns
    env.globals["marked_range"] = marked_range
    env.globals["verbatim_text"] = verbatim_text
    return env


def create_app(store: RunStore, settings: Settings) -> Starlette:
    """The console app over ``store`` (which the caller opens and closes).

    Raises:
        UsageError: ``store`` keeps no run index (the runs list needs one).
    """
    if not isinstance(store, RunIndex):
        raise UsageError(f"{type(store).__name__} keeps no run index; the console needs one")
    console = _Console(store, settings, templates())
    routes = [
        Route("/", console.runs_page),
        Route("/rows", console.runs_stream),  # outside /runs/: "rows" is a valid run id
        # Run ids may hold "/" (a child run's does: docs/child-runs.md), so they match as
        # paths; the routes with a suffix come first.
        Route("/runs/{run_id:path}/events", console.run_stream),
        Route("/runs/{run_id:path}/approve", console.approve, methods=["POST"]),
        Route("/runs/{run_id:path}/cancel", console.cancel, methods=["POST"]),
        # a GET of an action's address is told its method, not taken for a run's page
        *(
            Route(f"/runs/{{run_id:path}}/{action}", _post_only, methods=["GET"])
            for action in ACTIONS
        ),
        Route("/runs/{run_id:path}", console.run_page),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [
        Middleware(_SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts)),
        Middleware(_RunIdPaths),
    ]
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            TreadleError: console.unreadable,
            InvalidRunId: console.no_such_run,
            HTTPException: console.refused,
        },
    )


class _Console:
    """The route handlers, over one store."""

    def __init__(self, store: RunStore, settings: Settings, env: jinja2.Environment) -> None:
        self.store = store
        self.settings = settings
        self.env = env
        # finished runs only (they never change): tokens, and the thread or fork text
        self._tokens: dict[str, tuple[int | None, str | None]] = {}
        # unfinished runs: the same, as of the steps and state their summary showed then
        self._moving: dict[str, tuple[tuple[int, RunState | None], int | None, str | None]] = {}
        self._renders = trio.CapacityLimiter(RENDER_THREADS)
        # the runs list's last read by a /rows stream, with when it began (trio clock)
        self._listed: tuple[float, list[Row]] | None = None
        self._listing = trio.Lock()

    async def no_such_run(self, request: Request, exc: Exception) -> Response:
        """A path naming no possible run (docs/concepts.md, "Run ids"): a 404 saying why."""
        return self._said(request, "", str(exc), ok=False, status=404)

    async def refused(self, request: Request, exc: Exception) -> Response:
        """A refused request (no token, another origin, no such run): JSON to a JSON caller.

        Else as Starlette answers it, the reason as plain text.
        """
        assert isinstance(exc, HTTPException)
        if _wants_json(request):
            body = {"ok": False, "message": exc.detail}
            return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)

    async def unreadable(self, request: Request, exc: Exception) -> Response:
        """A store error (a damaged or too-new log, a failed write): the error, said plainly.

        As JSON to a caller that asks for it (the page's script), else as a page.
        """
        return self._said(request, "", str(exc), ok=False, status=500)

    # ----------------------------------------------------------------- guards

    def _check_read(self, request: Request) -> Response | None:
        """Refuse a read without the token when the token guards reads.

        ``?token=`` sets the token cookie and redirects to the same page without it
        (`_entered`).
        """
        if not self.settings.token_for_reads:
            return None
        given = request.query_params.get("token")
        if given is not None and self._good(given):
            return _entered(request, self.settings.cookie, given)
        presented = request.cookies.get(self.settings.cookie) or request.headers.get(TOKEN_HEADER)
        if presented is None or not self._good(presented):
            raise HTTPException(401, "this console needs its token: open it as /?token=TOKEN")
        return None

    async def _form(self, request: Request) -> FormData:
        """The form of a state-changing request that is same-site and carries the token.

        The origin is checked before the body is read, and the form may hold no file: a
        page of another site cannot make the console store what it posts.
        """
        self._check_origin(request)
        form = await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
        self._check_write(request, form)
        return form

    def _check_origin(self, request: Request) -> None:
        """Refuse a state-changing request that is cross-site.

        The origin must name the console's own host; its scheme may be ``https`` as well as
        the request's own, since behind a TLS proxy (docs/ui.md, "Safety") the browser's
        origin is ``https://`` while the console is spoken to in plain HTTP.
        """
        host = request.headers.get("host", "")
        expected = {f"{request.url.scheme}://{host}", f"https://{host}"}
        origin = request.headers.get("origin")
        if origin is None:
            referer = request.headers.get("referer")
            origin = _origin_of(referer) if referer else None
        if origin is None or origin not in expected:
            raise HTTPException(403, "refused: not a same-origin request")
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise HTTPException(403, f"refused: a {site} request")

    def _check_write(self, request: Request, form: FormData) -> None:
        """Refuse a state-changing request without the console's token (header or form)."""
        # Either one: after a restart (a new token) an open page's header is stale while
        # its form, re-rendered by the live stream, carries the new one.
        given = (request.headers.get(TOKEN_HEADER), form.get("token"))
        if not any(isinstance(token, str) and self._good(token) for token in given):
            raise HTTPException(
                403, "refused: the console's token is missing or wrong (reload the page)"
            )

    def _good(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.settings.token.encode())

    # ----------------------------------------------------------------- runs list

    async def runs_page(self, request: Request) -> Response:
        """The runs list (``?q=`` searches, ``?state=`` filters by state or liveness).

        The page is rendered in a worker thread (`_rendered`), as a run's page is: the table
        of thousands of runs takes a second to render, and the console serves every other
        request meanwhile (docs/ui.md, "The runs list").
        """
        refused = self._check_read(request)
        if refused is not None:
            return refused
        rows = await self._rows()
        q, state = request.query_params.get("q", ""), request.query_params.get("state", "")
        render = functools.partial(
            self._html,
            "runs.html",
            rows=_filtered(rows, q, state),
            total=len(rows),
            q=q,
            state=state,
            states=_state_choices(state),
            threads=any(r.thread for r in rows),
        )
        return HTMLResponse(await self._rendered(render))

    async def runs_stream(self, request: Request) -> Response:
        """Server-sent ``rows`` events: the list's table body, each time it changes.

        Each poll compares the rows the stream shows (their summaries, drivers, tokens and
        threads) with those it sent last; only a table that changed is rendered again, in a
        worker thread (`_rendered`), and sent: a list of thousands of runs that do not move
        costs a comparison per poll, not a render and a send. Every open list shares the
        poll's read of the list (`_polled_rows`; docs/ui.md, "The runs list"). A read the
        store fails is told and tried again as in every live stream (`_live`).
        """
        self._check_read(request)
        q, state = request.query_params.get("q", ""), request.query_params.get("state", "")
        last: tuple[list[tuple[object, ...]], bool] | None = None

        async def look() -> _Look:
            nonlocal last
            rows = await self._polled_rows()
            listed, threads = _filtered(rows, q, state), any(r.thread for r in rows)
            shown = ([row.shown for row in listed], threads)
            events = []
            if shown != last:
                last = shown
                html = await self._rendered(self._rows_html, listed, threads)
                events.append(ServerSentEvent(data=html, event="rows"))
            return _Look(events, rest_s=max(self.settings.poll_s, ROWS_POLL_S))

        return EventSourceResponse(_live(look, self.settings.retry_s), ping=15)

    async def _polled_rows(self) -> list[Row]:
        """The list's rows for a ``/rows`` stream: every open list shares one read a poll.

        A read begun less than `ROWS_POLL_S` ago is reused; a stream that asks while one is
        under way waits for it.
        """
        async with self._listing:
            now = trio.current_time()
            if self._listed is None or now - self._listed[0] >= ROWS_POLL_S:
                self._listed = (now, await self._rows())
            return self._listed[1]

    def _rows_html(self, rows: list[Row], threads: bool) -> str:
        """The list's table body of ``rows`` (in a worker thread)."""
        return self.env.get_template("_rows.html").render(rows=rows, threads=threads)

    async def _rows(self) -> list[Row]:
        """The list's rows, with each run's tokens and thread read from its log.

        A log is read again only when the run's summary shows a new step or state (every
        tab and every poll share what was read): a list of runs that do not move costs one
        read of the index, however long their logs.
        """
        assert isinstance(self.store, RunIndex)
        summaries = await self.store.list_summaries()
        rows = []
        for summary in summaries:
            tokens, thread = self._tokens.get(summary.run_id, (None, None))
            if summary.run_id not in self._tokens and summary.error is None:
                seen = (summary.steps, summary.state)
                known = self._moving.get(summary.run_id)
                if known is not None and known[0] == seen:
                    _, tokens, thread = known
                else:
                    try:
                        log = await self.store.read_log(summary.run_id)
                    except StoreError as exc:
                        # the index summarizes a run whose log fails its read: that row says
                        # why, the others are listed (as for a log the index cannot read)
                        summary = attrs.evolve(summary, error=str(exc))
                    else:
                        tokens, thread = _view.run_tokens(log), _view.run_thread(log)
                        if log.finished is not None:
                            self._tokens[summary.run_id] = (tokens, thread)
                            self._moving.pop(summary.run_id, None)
                        else:
                            self._moving[summary.run_id] = (seen, tokens, thread)
            rows.append(Row(summary, driver_text(summary), tokens, thread))
        return rows

    # ----------------------------------------------------------------- one run

    async def run_page(self, request: Request) -> Response:
        """One run's timeline, charts and actions; it goes on live over `run_stream`.

        The page is rendered in a worker thread (`_rendered`): a run of thousands of steps
        takes seconds to render, and the console serves every other request meanwhile.
        """
        refused = self._check_read(request)
        if refused is not None:
            return refused
        log, summary = await self._read(_run_id(request))
        return HTMLResponse(await self._rendered(self._run_html, log, summary))

    def _run_html(self, log: RunLog, summary: RunSummary | None) -> str:
        """The whole page of a run (in a worker thread)."""
        log, _ = valid_unicode(log)  # what an old log holds, made printable
        blocks = _view.timeline(log)
        return self._html(
            "run.html",
            blocks=blocks,
            last_seq=len(log.records),
            finished=log.finished is not None,
            **self._panel_context(log, summary),
            **_view.charts(blocks),
        )

    async def _rendered(self, render: Callable[..., _T], *args: Any) -> _T:
        """``render(*args)`` in a worker thread, at most `RENDER_THREADS` at once.

        Cancellation: the render runs to its end; the caller is cancelled after it.
        """
        return await trio.to_thread.run_sync(
            functools.partial(render, *args), limiter=self._renders
        )

    async def run_stream(self, request: Request) -> Response:
        """Server-sent events of a run's log from a seq on, live, until the run finishes.

        Each record is one ``record`` event whose id is its seq; a reconnect's
        ``Last-Event-ID`` resumes after that seq (else ``?from=SEQ`` names the first one).
        Every stream opens with a ``token`` event (``{"token": ...}``, no id): a page that
        reconnects to a restarted console (a new token) puts it in its forms, which it can
        post then (docs/ui.md, "Approving, rejecting, cancelling"). A ``finished`` event
        closes the stream once the run-finished record was sent; an ``unreadable`` event
        (``{"message": ...}``) closes it when the log cannot be read any more, or the run is
        gone (the page says why instead of reconnecting). A read that fails for a passing
        reason is told in a ``retrying`` event and tried again (`_live`).

        Each poll reads the run's summary; the log is read again only when the summary's
        record count moved since the last read (or the index does not know it), or
        ``recheck_s`` after the last whole read (which finds damage in a log that does not
        move), so a run that does not move costs one index read per poll, however long its
        log. A summary that shows the run's state or lease changed without a new record (a
        driver died, another took over) sends a ``panel`` event (``{"panel": HTML}``, no id).
        After a whole read the stream rests `RENDER_GAP` times what that read and its render
        took before it polls again; the records written meanwhile come in one batch, each
        still its own event.
        """
        self._check_read(request)
        follow = _Follow(run_id=_run_id(request), next_seq=_first_seq(request))
        began = trio.current_time()
        try:
            # a run that does not exist is a 404, not a stream; the read is the stream's first
            follow.read = (began, await self._read(follow.run_id))
        except StoreError as exc:
            if _for_good(exc):  # damaged: a reconnect is told why, as the stream would
                return EventSourceResponse(_unreadable(str(exc)), ping=15)
            # a passing failure: the stream reads again, and says why it waits meanwhile

        async def events() -> AsyncIterator[ServerSentEvent]:
            yield ServerSentEvent(data=json.dumps({"token": self.settings.token}), event="token")
            async for event in _live(lambda: self._look(follow), self.settings.retry_s):
                yield event

        return EventSourceResponse(events(), ping=15)

    async def _look(self, follow: _Follow) -> _Look:
        """One look of a run's stream: the records new since the last, or the panel's change.

        A whole read of the log when the run's summary says its record count moved, when
        ``recheck_s`` passed since the last whole read, or when the summary does not know the
        count; none before the `RENDER_GAP` rest after the last whole read ends. When only the
        summary moved (a lease renewed, taken over or expired: docs/fleet.md, "Liveness"),
        the panel alone is sent again, rendered from the last whole read (`_panel_events`).

        Raises:
            StoreError: a read failed.
            HTTPException: 404, the run is gone.
        """
        resting = _Look([], rest_s=self.settings.poll_s)
        if follow.read is None:
            since = trio.current_time() - follow.read_at
            if since < follow.gap:
                return resting
            if since < self.settings.recheck_s and follow.log is not None:
                assert isinstance(self.store, RunIndex)
                summary = await self.store.read_summary(follow.run_id)
                if _records(summary) == len(follow.log.records):
                    return attrs.evolve(resting, events=await self._panel_events(follow, summary))
            began = trio.current_time()
            follow.read = (began, await self._read(follow.run_id))
        (began, (log, summary)), follow.read = follow.read, None
        said = await self._rendered(self._stream_events, log, summary, follow.next_seq)
        follow.read_at = trio.current_time()
        follow.gap = RENDER_GAP * (follow.read_at - began)
        follow.log = log
        if said:  # the panel rides on the last record
            follow.panel = _panel_facts(summary)
        else:
            said = await self._panel_events(follow, summary)
        follow.next_seq = max(follow.next_seq, len(log.records) + 1)
        if log.finished is not None:
            return _Look([*said, ServerSentEvent(data="{}", event="finished")], done=True)
        return attrs.evolve(resting, events=said)

    async def _panel_events(
        self, follow: _Follow, summary: RunSummary | None
    ) -> list[ServerSentEvent]:
        """A ``panel`` event when what the panel shows of ``summary`` changed, else none.

        The panel is rendered (in a worker thread) from the last whole read of the log.
        """
        facts = _panel_facts(summary)
        if follow.log is None or facts == follow.panel:
            return []
        follow.panel = facts
        html = await self._rendered(self._panel_html, follow.log, summary)
        return [ServerSentEvent(data=json.dumps({"panel": html}), event="panel")]

    def _panel_html(self, log: RunLog, summary: RunSummary | None) -> str:
        """The panel of a run (in a worker thread)."""
        log, _ = valid_unicode(log)  # what an old log holds, made printable
        return self._html("_panel.html", **self._panel_context(log, summary))

    def _stream_events(
        self, log: RunLog, summary: RunSummary | None, first: int
    ) -> list[ServerSentEvent]:
        """A stream's events of records ``first`` on, for one whole read (in a worker thread)."""
        log, _ = valid_unicode(log)  # what an old log holds, made printable
        last = len(log.records)
        return self._record_events(log, summary, first, last) if last >= first else []

    def _record_events(
        self, log: RunLog, summary: RunSummary | None, first: int, last: int
    ) -> list[ServerSentEvent]:
        """One event per record ``first..last``; a block's HTML rides on its last record.

        The last one carries the panel and the charts too.
        """
        blocks = _view.timeline(log)
        owner = {s: b for b in blocks for s, _ in b.records}
        last_of = {owner[s].id: s for s in range(first, last + 1) if s in owner}
        block_template = self.env.get_template("_block.html")
        events = []
        for seq in range(first, last + 1):
            block = owner.get(seq)
            record = log.records[seq - 1]
            data: dict[str, Any] = {
                "seq": seq,
                "kind": type(record).__name__,
                "block": block.id if block else None,
                "html": None,
            }
            if block is not None and last_of.get(block.id) == seq:
                data["html"] = block_template.render(block=block)
            if seq == last:
                data["panel"] = self._html("_panel.html", **self._panel_context(log, summary))
                data["charts"] = self._html("_charts.html", **_view.charts(blocks))
            events.append(ServerSentEvent(data=json.dumps(data), id=str(seq), event="record"))
        return events

    async def _read(self, run_id: str) -> tuple[RunLog, RunSummary | None]:
        """Run ``run_id``'s log as stored, and its summary.

        Raises:
            HTTPException: 404, the store holds no such run.
            StoreError: the log cannot be read.
        """
        log = await self.store.read_log(run_id)
        assert isinstance(self.store, RunIndex)
        summary = await self.store.read_summary(run_id)
        if log.started is None and (summary is None or summary.state is not RunState.QUEUED):
            raise HTTPException(404, f"there is no run {run_id!r} in this store")
        return log, summary

    def _panel_context(self, log: RunLog, summary: RunSummary | None) -> dict[str, Any]:
        """What the panel template shows of a run: its facts and the forms of its actions."""
        pending = pending_approval(log)
        shown: ApprovalRequested | None = None
        if pending is not None:
            shown = Redaction.of_log(log).request(pending)
        finished = log.finished
        state = summary.state.value if summary and summary.state else ""
        if finished is not None:
            state = finished.state.value
        return {
            "run_id": log.run_id,
            "state": state,
            "liveness": summary.liveness.value if summary else "",
            "driver": driver_text(summary) if summary else "",
            "driven": summary is not None and summary.liveness is Liveness.DRIVEN,
            "summary": summary,
            "started": log.started,
            "finished_record": finished,
            "steps": len(log.steps),
            "tokens": _view.run_tokens(log),
            "pending": shown,
            "token": self.settings.token,
        }

    # ----------------------------------------------------------------- actions

    async def approve(self, request: Request) -> Response:
        """Approve, reject or edit the call a run waits on (as ``treadle approve``)."""
        form = await self._form(request)
        run_id = await self._existing(request)
        # No default: a form sent without its button (Enter in the message box of a browser
        # that submits anyway, a script) must not approve what its author meant to reject.
        decision = str(form.get("decision", ""))
        call_id = str(form.get("call_id") or "") or None
        # The request the page showed: a model may ask again under the same call id
        shown_step = str(form.get("step") or "")
        step = read_count(shown_step) if shown_step else None
        if shown_step and step is None:
            said = "the form's step is no step number (1 to 19 digits 0-9); reload the page"
            return self._said(request, run_id, said, ok=False)
        digest = str(form.get("digest") or "") or None
        reject = edit = None
        if decision == "reject":
            reject = str(form.get("message", "")) or "rejected"
        elif decision == "edit":
            try:
                edit = edited_arguments(str(form.get("arguments", "")))
            except UsageError as exc:
                return self._said(request, run_id, str(exc), ok=False)
        elif decision != "approve":
            said = f"unknown decision {decision!r}" if decision else "no decision was sent"
            return self._said(request, run_id, f"{said}: send approve, edit or reject", ok=False)
        try:
            decided, _, next_text = await approve(
                self.store,
                run_id,
                call_id=call_id,
                reject=reject,
                edit=edit,
                step=step,
                arguments_digest=digest,
            )
        except UsageError as exc:
            return self._said(request, run_id, str(exc), ok=False)
        said = f"{decided.decision}: call {decided.call_id}; {next_text}"
        return self._said(request, run_id, said)

    async def cancel(self, request: Request) -> Response:
        """Cancel a run (as ``treadle cancel``)."""
        form = await self._form(request)
        run_id = await self._existing(request)
        reason = str(form.get("reason", ""))
        try:
            outcome = await cancel(
                self.store, run_id, reason=reason, canceller=self.settings.canceller
            )
        except UsageError as exc:
            return self._said(request, run_id, str(exc), ok=False)
        return self._said(request, run_id, f"cancel requested: {outcome}")

    async def _existing(self, request: Request) -> str:
        """The id of the run an action names, once the store knows that run.

        An action on a run id that names no run is a 404, as its page is, not a refusal
        (docs/ui.md, "Approving, rejecting, cancelling").

        Raises:
            InvalidRunId: the path names no possible run (a 404 too).
            HTTPException: 404, the store has no run of that id.
        """
        run_id = check_run_id(_run_id(request))
        assert isinstance(self.store, RunIndex)
        if await self.store.read_summary(run_id) is None:
            raise HTTPException(404, f"there is no run {run_id!r} in this store")
        return run_id

    def _said(
        self,
        request: Request,
        run_id: str,
        message: str,
        *,
        ok: bool = True,
        status: int | None = None,
    ) -> Response:
        """The answer to an action: JSON for the page's script, else a small page.

        ``status``: 200 when ``ok``, else 409 (a refused action), unless given.
        """
        if status is None:
            status = 200 if ok else 409
        if _wants_json(request):
            return JSONResponse({"ok": ok, "message": message}, status_code=status)
        return self._page("said.html", status=status, run_id=run_id, message=message, ok=ok)

    def _page(self, name: str, *, status: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(self._html(name, **context), status_code=status)

    def _html(self, name: str, **context: Any) -> str:
        """Template ``name`` rendered (the console's token given unless ``context`` has it)."""
        context.setdefault("token", self.settings.token)
        return self.env.get_template(name).render(**context)


STATES: tuple[str, ...] = tuple(
    dict.fromkeys([*(s.value for s in RunState), *(v.value for v in Liveness), "unreadable"])
)
"""What the runs list's state menu offers, in this order: every run state, every liveness
(``queued`` is both), and ``unreadable`` (a run whose log the index cannot read)."""


def _state_choices(chosen: str) -> tuple[str, ...]:
    """The state menu's choices: `STATES`, whatever runs the store holds now.

    A ``?state=`` naming none of them is one more choice (it matches no run), so the menu
    shows what the URL asked for and the list, live or not, filters by it (docs/ui.md,
    "The runs list").
    """
    return STATES if not chosen or chosen in STATES else (*STATES, chosen)


def _filtered(rows: Sequence[Row], q: str, state: str) -> list[Row]:
    words = q.lower().split()
    return [
        r
        for r in rows
        if (not state or state in (r.state, r.summary.liveness.value))
        and all(w in r.search_text for w in words)
    ]


async def _post_only(request: Request) -> Response:
    """A GET of an action's address (a link to it, its form's address opened in a tab).

    Raises:
        HTTPException: always, a 405 with ``Allow: POST`` naming the action and the run's
            page; without this route the path would be read as the page of a run whose id
            ends in the action's name, a 404 naming a run nobody asked for (docs/ui.md,
            "A run's page").
    """
    action = request.url.path.rpartition("/")[2]
    page = "/runs/" + run_path(_run_id(request))
    raise HTTPException(
        405,
        f"{action} is an action: it takes a POST, as the form on the run's page {page} sends",
        headers={"Allow": "POST"},
    )


def _first_seq(request: Request) -> int:
    """The first seq a stream sends: after ``Last-Event-ID``, else ``?from=`` (default 1).

    ``Last-Event-ID`` is read as every event id is (`treadle.asyncio.resume_after`: ASCII
    digits, at most 19). Seqs count from 1 (docs/events.md, "Numbering"), so one below 0
    names no record a stream sent: it is refused (a 400), never read as a position from the
    log's end; so is one ``int`` cannot read (5000 digits) or of other digits (``٣``).
    ``?from=`` is read so too (`treadle._text.read_count`), a ``-`` before it allowed: a
    ``from`` below 1 streams from the first record.
    """
    last = request.headers.get("last-event-id")
    refused = HTTPException(
        400, "Last-Event-ID and ?from= take a seq (an integer, Last-Event-ID 0 or more)"
    )
    try:
        seen = resume_after(last)[0] if last else None
    except UsageError:
        raise refused from None
    wanted = request.query_params.get("from", "1")
    first = read_count(wanted.removeprefix("-"))  # below 1: from the first record
    if first is None:
        raise refused
    return (1 if wanted.startswith("-") else max(1, first)) if seen is None else seen + 1


def _entered(request: Request, cookie: str, token: str) -> Response:
    """The answer to a page opened with the right ``?token=``: a 303 to that page without it.

    It sets cookie ``cookie`` to ``token`` (HttpOnly, SameSite=Strict). The redirect's
    Location is relative (the path and the rest of the query), so a browser that reached the
    console through a TLS proxy stays on its ``https://`` address. The cookie is Secure when
    the request came over HTTPS: to the console itself, or to a proxy that says so in
    ``X-Forwarded-Proto`` (docs/ui.md, "Safety"). That header is taken from anyone: it can
    only keep the cookie off plain HTTP, never widen where it goes.
    """
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
    path = "/" + request.url.path.lstrip("/")  # never "//host": a Location on another site
    response = RedirectResponse(f"{path}?{query}" if query else path, status_code=303)
    forwarded = request.headers.get("x-forwarded-proto", "").partition(",")[0].strip()
    secure = request.url.scheme == "https" or forwarded.lower() == "https"
    response.set_cookie(cookie, token, httponly=True, samesite="strict", path="/", secure=secure)
    return response


def _origin_of(url: str) -> str | None:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    return f"{scheme}://{rest.split('/', 1)[0]}"


async def _live(
    look: Callable[[], Awaitable[_Look]], retry_s: float
) -> AsyncIterator[ServerSentEvent]:
    """The events of a live stream: ``look`` again and again, until a look says it is done.

    The one way both streams meet a failed read (docs/ui.md, "When the store fails a read"):
    a read that fails for good (`_for_good`), or a run that is gone (a 404), ends the stream
    with an ``unreadable`` event (``{"message": ...}``), which the page shows instead of
    reconnecting. Any other `StoreError` (a dropped database connection, a file that cannot
    be opened for now) sends a ``retrying`` event (``{"message": ..., "retry_s": ...}``) and
    the stream looks again after ``retry_s`` seconds, doubled with each failure in a row up
    to `RETRY_MAX_S`; the first look that succeeds after failures sends a ``recovered``
    event (``{}``) before what it found.

    Cancellation: a checkpoint at each rest; cancelled, the stream just ends.
    """
    wait: float | None = None  # the rest after the last failure of a run of them
    while True:
        try:
            looked = await look()
        except HTTPException as exc:
            yield _unreadable_event(exc.detail)
            return
        except StoreError as exc:
            if _for_good(exc):
                yield _unreadable_event(str(exc))
                return
            wait = retry_s if wait is None else min(2 * wait, RETRY_MAX_S)
            said = {"message": f"{exc}; trying again in {wait:g} s", "retry_s": wait}
            yield ServerSentEvent(data=json.dumps(said), event="retrying")
            await trio.sleep(wait)
            continue
        if wait is not None:
            wait = None
            yield ServerSentEvent(data="{}", event="recovered")
        for event in looked.events:
            yield event
        if looked.done:
            return
        await trio.sleep(looked.rest_s)


def _for_good(exc: StoreError) -> bool:
    """Whether a failed read would fail again however often it is tried.

    A damaged log or database (`LogCorrupted`), one written by a newer treadle
    (`SchemaTooNew`), a store the database refuses (`StoreRefused`) or that stopped
    (`StoreStopped`): trying again changes nothing (as a fleet worker judges its claims,
    docs/fleet.md, "What each crash does"). Any other failure may pass.
    """
    return isinstance(exc, LogCorrupted | SchemaTooNew | StoreRefused | StoreStopped)


def _records(summary: RunSummary | None) -> int | None:
    """The records the index says a run holds, ``None`` when it does not say."""
    return None if summary is None or summary.error is not None else summary.records


def _panel_facts(summary: RunSummary | None) -> object:
    """What the panel shows of a run's summary: its state and who drives it (`driver_text`).

    The lease whole, so a renewal (which resets the age the panel shows), a takeover and an
    expiry each count as a change; not ``observed_at``, which moves with every read.
    """
    if summary is None:
        return None
    return (summary.state, summary.liveness, summary.lease, summary.quarantined, summary.error)


async def _unreadable(message: str) -> AsyncIterator[ServerSentEvent]:
    """The one event of a run stream that stops because the log cannot be read."""
    yield _unreadable_event(message)


def _unreadable_event(message: str) -> ServerSentEvent:
    """The event that ends a live stream whose store read failed for good."""
    return ServerSentEvent(data=json.dumps({"message": message}), event="unreadable")


def _wants_json(request: Request) -> bool:
    """Whether the caller asks for JSON (``Accept: application/json``: the page's script)."""
    return "application/json" in request.headers.get("accept", "")
