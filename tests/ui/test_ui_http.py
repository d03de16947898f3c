"""The run console over plain HTTP: pages, the safety rules, and the live stream's resume."""

from __future__ import annotations

import contextlib
import html
import json
import os
import subprocess
import sys
import threading

import attrs
import httpx
import pytest
import trio
from click.testing import CliRunner
from sse_starlette import ServerSentEvent
from tests.fixtures.approval_waits import wait_for_state
from ui_support import MARKUP, approval_agent, fetch_page, markup_agent

import treadle
from treadle._exceptions import LogCorrupted, StoreError, UsageError
from treadle._ui import _view
from treadle._ui._app import CSP, Settings, create_app
from treadle.approvals import read_control
from treadle.cli import main
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.types import (
    ActionIntent,
    ApprovalDecided,
    CancelRequested,
    Liveness,
    ModelResult,
    RunLog,
    RunState,
    StopReason,
    ToolCall,
    Usage,
)

TOKEN = "t0ken-for-tests"
BASE = "http://127.0.0.1:8765"
SAME = {"origin": BASE}


def client(store, **settings) -> httpx.AsyncClient:
    app = create_app(store, Settings(token=TOKEN, **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)


async def finished_store() -> MemoryStore:
    store = MemoryStore()
    await treadle.run(markup_agent(), "read the page", store=store, run_id="markup")
    return store


async def wait_for(handle, state):
    with trio.fail_after(60):
        assert await handle.wait_state(state) is state


def sse(text: str) -> list[dict]:
    """The events of a server-sent event stream: id, event and data of each."""
    events = []
    for chunk in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict = {}
        for line in chunk.splitlines():
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                fields[name] = value
        if "event" in fields:
            events.append(fields)
    return events


@contextlib.asynccontextmanager
async def awaiting_approval(store, agent=None):
    """Run ``r`` of ``agent`` (`approval_agent`) driven on ``store``, once it waits on its
    approval."""
    async with open_run(
        agent or approval_agent(), "pay", store=store, run_id="r", control_poll_s=0.05
    ) as handle:
        await wait_for(handle, RunState.AWAITING_APPROVAL)
        yield handle


async def test_the_runs_list_shows_each_run_and_filters_them():
    store = await finished_store()
    await treadle.run(markup_agent(), "again", store=store, run_id="other")
    async with client(store) as http:
        page = await http.get("/")
        assert page.status_code == 200
        assert 'data-run="markup"' in page.text and 'data-run="other"' in page.text
        row = page.text[page.text.index('data-run="markup"') :]
        row = row[: row.index("</tr>")]
        assert "succeeded" in row and ">62<" in row  # tokens: 10 + 5 (scripted), then 40 + 7
        assert "final_answer" in row
        searched = await http.get("/", params={"q": "oth"})
        assert 'data-run="other"' in searched.text and 'data-run="markup"' not in searched.text
        none = await http.get("/", params={"state": "running"})
        assert 'data-run="' not in none.text


async def test_markup_a_tool_returned_is_text_and_every_page_has_a_strict_policy():
    store = await finished_store()
    async with client(store) as http:
        page = await http.get("/runs/markup")
    assert page.status_code == 200
    assert MARKUP not in page.text and "<script>window" not in page.text
    assert "&lt;script&gt;window.pwned = true&lt;/script&gt;" in page.text
    assert page.headers["content-security-policy"] == CSP
    assert "unsafe-inline" not in CSP and "script-src 'self'" in CSP
    assert page.headers["x-content-type-options"] == "nosniff"


async def test_state_changing_requests_need_the_token_and_the_same_origin():
    store = MemoryStore()
    agent = approval_agent()
    async with open_run(agent, "pay", store=store, run_id="r", control_poll_s=0.05) as handle:
        await wait_for(handle, RunState.AWAITING_APPROVAL)
        async with client(store) as http:
            form = {"token": TOKEN, "reason": "stop"}
            refused = [
                await http.post("/runs/r/cancel", data=form),  # no Origin, no Referer
                await http.post("/runs/r/cancel", data=form, headers={"origin": "http://evil"}),
                await http.post(
                    "/runs/r/cancel", data=form, headers={"referer": "http://evil/runs/r"}
                ),
                await http.post(
                    "/runs/r/cancel", data=form, headers={**SAME, "sec-fetch-site": "cross-site"}
                ),
                await http.post("/runs/r/cancel", data={"reason": "x"}, headers=SAME),
                await http.post("/runs/r/cancel", data={**form, "token": "wrong"}, headers=SAME),
                await http.post("/runs/r/approve", data={"decision": "approve"}, headers=SAME),
            ]
            assert [r.status_code for r in refused] == [403] * len(refused)
            assert "same-origin" in refused[1].text and "token" in refused[4].text
            assert await read_control(store, "r") == ()  # nothing was written
            done = await http.post(
                "/runs/r/cancel",
                data=form,
                headers={**SAME, "accept": "application/json", "sec-fetch-site": "same-origin"},
            )
            assert done.status_code == 200 and done.json()["ok"] is True
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    (requested,) = await read_control(store, "r")
    assert isinstance(requested, CancelRequested) and requested.canceller == "treadle ui"


async def test_a_foreign_host_name_is_refused():
    """A page of another site whose name resolves to 127.0.0.1 (DNS rebinding) reads nothing."""
    store = await finished_store()
    async with client(store) as http:
        page = await http.get("/runs/markup", headers={"host": "evil.example:8765"})
    assert page.status_code == 400 and "markup" not in page.text


async def test_a_given_token_guards_reads_and_is_kept_in_a_cookie():
    store = await finished_store()
    async with client(store, token_for_reads=True) as http:
        assert (await http.get("/")).status_code == 401
        assert (await http.get("/runs/markup/events")).status_code == 401
        assert (await http.get("/", params={"token": "wrong"})).status_code == 401
        entered = await http.get("/runs/markup", params={"token": TOKEN})
        assert entered.status_code == 303 and "token" not in entered.headers["location"]
        assert "httponly" in entered.headers["set-cookie"].lower()
        page = await http.get("/runs/markup")  # the cookie now
        assert page.status_code == 200 and "run finished" in page.text


async def test_the_approval_form_makes_the_checks_of_treadle_approve():
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        async with client(store) as http:
            page = await http.get("/runs/r")
            assert 'id="approval"' in page.text and "&#34;amount&#34;: 5" in page.text
            headers = {**SAME, "accept": "application/json"}

            async def decide(**fields):
                return await http.post(
                    "/runs/r/approve", data={"token": TOKEN, **fields}, headers=headers
                )

            other = await decide(decision="approve", call_id="t2")
            assert other.status_code == 409 and "waits on call 't1'" in other.json()["message"]
            bad = await decide(decision="edit", arguments='{"amount": "five"}')
            assert bad.status_code == 409
            not_json = await decide(decision="edit", arguments="{")
            assert not_json.status_code == 409 and "not JSON" in not_json.json()["message"]
            deep = await decide(decision="edit", arguments='{"a": ' + "[" * 5000 + "]" * 5000 + "}")
            assert deep.status_code == 409 and "nests too deeply" in deep.json()["message"]
            too_deep = await decide(
                decision="edit", arguments='{"amount": ' + "[" * 70 + "]" * 70 + "}"
            )
            assert too_deep.status_code == 409 and "deeper than 64" in too_deep.json()["message"]
            # No decision sent (a form without its button, a JSON body): nothing is decided.
            # Before, it approved, also with a rejection message in it.
            silent = await decide(message="NO - do not pay")
            assert silent.status_code == 409 and "no decision" in silent.json()["message"]
            # A JSON body carries no form field: with the token in its header, nothing but
            # the missing decision can refuse it (before, it approved).
            as_json = await http.post(
                "/runs/r/approve",
                json={"decision": "reject"},
                headers={**headers, "x-treadle-token": TOKEN},
            )
            assert as_json.status_code == 409 and "no decision" in as_json.json()["message"]
            assert await read_control(store, "r") == ()
            edited = await decide(decision="edit", arguments='{"amount": 3}', call_id="t1")
            assert edited.status_code == 200, edited.text
            again = await decide(decision="approve")
            assert again.status_code == 409 and "first decision counts" in again.json()["message"]
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    (decided,) = await read_control(store, "r")
    assert isinstance(decided, ApprovalDecided) and decided.edited_arguments == {"amount": 3}


async def test_a_decision_is_for_the_request_the_page_showed():
    """The form carried only the call id: a model that asked again under the same call id
    with other arguments (amount 5, then 5000) had the page's approve of the 5 (its panel not
    refreshed while the operator typed) approve the 5000. And after a restart of the
    console, the page's header token was stale while its form's was current: refused, with
    a plain-text 403 the page's script showed as an empty notice."""
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        async with client(store) as http:
            page = (await http.get("/runs/r")).text
            shown = {
                name: page.split(f'name="{name}" value="', 1)[1].split('"', 1)[0]
                for name in ("call_id", "step", "digest")
            }
            pending = handle.pending_approval
            assert pending is not None
            assert (shown["step"], shown["digest"]) == (
                str(pending.step),
                pending.arguments_digest,
            )
            headers = {**SAME, "accept": "application/json"}

            async def decide(token_header: str, **fields):
                return await http.post(
                    "/runs/r/approve",
                    data={"token": TOKEN, "decision": "approve", **shown, **fields},
                    headers={**headers, "x-treadle-token": token_header},
                )

            other = await decide(TOKEN, digest="0" * 64)
            assert other.status_code == 409
            assert "other arguments than those shown" in other.json()["message"]
            later = await decide(TOKEN, step=str(pending.step + 1))
            assert later.status_code == 409
            assert await read_control(store, "r") == ()
            refused = await http.post(
                "/runs/r/approve",
                data={"token": "stale", "decision": "approve", **shown},
                headers={**headers, "x-treadle-token": "stale"},
            )
            assert refused.status_code == 403 and refused.json()["ok"] is False
            assert "token is missing or wrong" in refused.json()["message"]
            approved = await decide("a-stale-one-from-before-a-restart")  # the form's is good
            assert approved.status_code == 200, approved.text
        await handle.wait()


async def test_the_stream_resumes_after_last_event_id_with_no_gap_and_no_duplicate():
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        seen = len((await store.read_log("r")).records)
        assert seen >= 4
        async with client(store, poll_s=0.01) as http, trio.open_nursery() as nursery:
            resumed: list[httpx.Response] = []

            async def reconnect():  # as a browser does after a dropped connection
                resumed.append(
                    await http.get("/runs/r/events", headers={"last-event-id": str(seen - 2)})
                )

            nursery.start_soon(reconnect)
            await trio.sleep(0.2)  # the stream is open and waits for records
            handle.approve("t1")
        await handle.wait()
        async with client(store) as http:
            whole = await http.get("/runs/r/events", params={"from": "1"})
            bad = await http.get("/runs/r/events", headers={"last-event-id": "x"})
            missing = await http.get("/runs/nope/events")
    count = len((await store.read_log("r")).records)
    events = [e for e in sse(resumed[0].text) if e["event"] != "token"]
    assert [e["event"] for e in events][-1] == "finished"
    ids = [int(e["id"]) for e in events if e["event"] == "record"]
    assert ids == list(range(seen - 1, count + 1))  # from after the id, to the end, once each
    full = [e for e in sse(whole.text) if e["event"] == "record"]
    assert [int(e["id"]) for e in full] == list(range(1, count + 1))
    by_id = {e["id"]: json.loads(e["data"]) for e in full}
    for event in events[:-1]:
        assert json.loads(event["data"])["kind"] == by_id[event["id"]]["kind"]
    assert bad.status_code == 400 and missing.status_code == 404


def test_another_host_is_refused_without_a_token():
    refused = CliRunner().invoke(main, ["ui", "--store", "x.db", "--host", "0.0.0.0"])
    assert refused.exit_code == 2 and "without --token" in refused.output


def test_help_loads_no_part_of_the_web_stack():
    script = (
        "import sys\nfrom treadle.cli import main\n"
        "for args in (['--help'], ['ui', '--help']):\n"
        "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    assert "--store" in out.stdout  # the ui command's own help was printed
    loaded = set(out.stdout.split("\n")[-2].split())
    assert not loaded & {"starlette", "hypercorn", "jinja2", "sse_starlette", "anyio"}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_names_are_loopback(host):
    from treadle._cli_ui import is_loopback

    assert is_loopback(host)
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


async def test_the_served_console_guards_a_jsonl_store_with_its_token(tmp_path):
    """The real command on a real port: a given token guards reads and writes alike."""
    from ui_support import start_console, stop

    async with treadle.open_jsonl_store(tmp_path / "store") as store:
        await treadle.run(markup_agent(), "read the page", store=store, run_id="markup")
    process, url = await trio.to_thread.run_sync(
        lambda: start_console(tmp_path / "store", "--token", TOKEN)
    )
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/")).status_code == 401
            entered = await http.get("/", params={"token": TOKEN})
            assert entered.status_code == 303
            listed = await http.get("/")  # the cookie the redirect set
            assert listed.status_code == 200 and 'data-run="markup"' in listed.text
            origin = {"origin": url, "accept": "application/json"}
            without = await http.post("/runs/markup/cancel", data={}, headers=origin)
            assert without.status_code == 403  # the cookie alone does not make a write
            late = await http.post("/runs/markup/cancel", data={"token": TOKEN}, headers=origin)
            assert late.status_code == 409 and "finished" in late.json()["message"]
            rebound = await http.get("/", headers={"host": f"evil.example:{url.rsplit(':', 1)[1]}"})
            assert rebound.status_code == 400
    finally:
        assert await trio.to_thread.run_sync(stop, process) == 0


RELEASE = threading.Event()


@treadle.tool(timeout_s=0.2)
def stuck(order_id: str) -> str:
    """Blocks in its thread past its timeout: the run abandons it (UNKNOWN, late)."""
    RELEASE.wait(60)
    return order_id


@treadle.tool(requires_approval=True, secret_arguments=["api_key"])
async def charge(amount: int, api_key: str) -> str:
    """Charge a card."""
    return f"charged {amount}"


def charging_agent() -> treadle.Agent:
    """One `charge` call with a secret ``api_key``, waiting for approval, then an answer."""
    return treadle.Agent(
        model=ScriptedModel(turns=[call("charge", amount=5, api_key="sk-live-123"), say("ok")]),
        executor=treadle.Toolbox([charge]),
        parser=treadle.NativeToolCallParser(),
    )


async def test_an_unknown_late_outcome_is_highlighted_and_marked():
    store = MemoryStore()
    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("stuck", order_id="7", call_id="s1"), say("gave up")]),
        executor=treadle.Toolbox([stuck]),
        parser=treadle.NativeToolCallParser(),
    )
    try:
        await treadle.run(agent, "go", store=store, run_id="r")
    finally:
        RELEASE.set()
    async with client(store) as http:
        page = (await http.get("/runs/r")).text
    step = page[page.index('id="step-1"') : page.index('id="step-2"')]
    assert 'class="block step highlighted"' in page[page.index('id="step-1"') - 60 :][:80]
    assert "stuck: outcome unknown" in step and "stuck: late" in step
    assert "status-unknown" in step
    # the model was given its observation, and went on: applied, though late
    assert "late: the run stopped waiting for it" in step and "not applied" not in step
    later = page[page.index('id="step-2"') - 60 :][:80]
    assert "highlighted" not in later


async def test_secret_arguments_stay_out_of_the_page_and_its_stream():
    store = MemoryStore()
    async with awaiting_approval(store, charging_agent()) as handle, client(store) as http:
        waiting = (await http.get("/runs/r")).text
        assert "&#34;amount&#34;: 5" in waiting and "[redacted]" in waiting
        handle.approve()
        await handle.wait()
        page = (await http.get("/runs/r")).text
        stream = (await http.get("/runs/r/events")).text
    assert "sk-live-123" not in waiting + page + stream
    assert "[redacted]" in page


@treadle.tool(requires_approval=True)
async def file_note(text: str) -> str:
    """Write a note for the customer's file."""
    return "noted"


async def test_a_secret_value_in_another_call_stays_out_of_the_page_and_its_stream():
    """The key, secret as ``charge``'s argument, was shown in clear in the note the same
    reply wrote, and in the approval box of that note."""
    store = MemoryStore()
    reply = calls(
        ToolCall(id="c1", name="charge", arguments={"amount": 5, "api_key": "sk-live-123"}),
        ToolCall(id="c2", name="file_note", arguments={"text": "paid with sk-live-123"}),
    )
    agent = treadle.Agent(
        model=ScriptedModel(turns=[reply, say("ok")]),
        executor=treadle.Toolbox([charge, file_note]),
        parser=treadle.NativeToolCallParser(),
    )
    async with awaiting_approval(store, agent) as handle, client(store) as http:
        handle.approve("c1")
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)  # the note's, durable
        assert handle.pending_approval is not None
        assert handle.pending_approval.arguments == {"text": "paid with [redacted]"}
        waiting = (await http.get("/runs/r")).text
        assert "paid with [redacted]" in html.unescape(waiting)
        handle.approve("c2")
        await handle.wait()
        page = (await http.get("/runs/r")).text
        stream = (await http.get("/runs/r/events")).text
    assert "sk-live-123" not in waiting + page + stream
    assert "paid with [redacted]" in html.unescape(page)


async def test_an_edit_made_in_the_approval_box_keeps_the_secret_it_shows_redacted():
    """The box shows ``"api_key": "[redacted]"``; changing the amount there must not run the
    call with that text as the key (it did: the placeholder replaced the secret)."""
    store = MemoryStore()
    async with awaiting_approval(store, charging_agent()) as handle:
        async with client(store) as http:
            page = (await http.get("/runs/r")).text
            box = page[page.index('<textarea name="arguments"') :]
            shown = html.unescape(box[box.index(">") + 1 : box.index("</textarea>")])
            assert json.loads(shown) == {"amount": 5, "api_key": "[redacted]"}
            edited = await http.post(
                "/runs/r/approve",
                data={"token": TOKEN, "decision": "edit", "arguments": shown.replace("5", "3")},
                headers={**SAME, "accept": "application/json"},
            )
            assert edited.status_code == 200, edited.text
        await handle.wait()
    log = await store.read_log("r")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent)]
    assert intent.arguments == {"amount": 3, "api_key": "sk-live-123"}


def test_a_record_kind_the_page_does_not_know_is_shown_by_its_fields():
    """A newer version's record (a summary mark, say) renders as a folded field list."""
    import attrs

    from treadle._ui._app import templates
    from treadle._ui._view import timeline
    from treadle.types import RunLog

    @attrs.frozen(kw_only=True)
    class ContextSummarized:
        run_id: str
        step: int
        ts: str
        summary: str

    async def go():
        store = await finished_store()
        return await store.read_log("markup")

    log = trio.run(go)
    extra = ContextSummarized(run_id="markup", step=1, ts="t", summary="<b>older turns</b>")
    blocks = timeline(RunLog(run_id="markup", records=(*log.records, extra)))
    (step,) = [b for b in blocks if b.id == "step-1"]
    assert "context summarized" in step.marks
    rendered = templates().get_template("_block.html").render(block=step)
    assert "&lt;b&gt;older turns&lt;/b&gt;" in rendered and "<b>older" not in rendered


async def test_the_list_and_a_run_page_show_threads_and_forks():
    store = MemoryStore()
    await treadle.run(markup_agent(), "read the page", store=store, run_id="chat")
    await treadle.run(markup_agent(), "and again", store=store, thread_id="chat")
    await treadle.run(markup_agent(), store=store, run_id="try", fork_of="chat", at_step=1)
    async with client(store) as http:
        listing = (await http.get("/")).text
        continued = (await http.get("/runs/chat.2")).text
        fork = (await http.get("/runs/try")).text
        alone = (await http.get("/runs/chat")).text
    assert "<th>thread</th>" in listing
    assert "<td>chat</td>" in listing  # the thread's second run
    assert "<td>fork of chat at step 1</td>" in listing
    assert '<dd id="run-thread">chat</dd>' in continued
    assert ">continues</dt>" in continued and 'href="/runs/chat"' in continued
    assert ">forks</dt>" in fork and "at step 1" in fork
    assert "run-continues" not in alone


async def test_a_run_page_shows_summaries_and_the_context_each_request_was_given():
    from treadle.testing.windowed import WindowedModel, windowed_agent

    store = MemoryStore()
    model = WindowedModel(window=1200, goal=30)
    await treadle.run(windowed_agent(model, window=1200), "count", store=store, run_id="long")
    log = await store.read_log("long")
    summaries = [r for r in log.records if isinstance(r, ModelResult) and r.summary_through]
    assert summaries  # a run this long compacts
    async with client(store) as http:
        page = (await http.get("/runs/long")).text
    assert page.count('<span class="mark summary">summary</span>') == len(summaries)
    assert f"(steps 1-{summaries[0].summary_through})" in page
    assert "earlier steps summarized" in page
    assert page.count('class="context dim"') == sum(
        1 for r in log.records if isinstance(r, ModelResult) and r.context is not None
    )
    assert f"summary of steps 1-{summaries[-1].summary_through} (" in page


async def test_a_parent_and_its_child_run_link_each_other():
    @treadle.tool
    async def note(text: str) -> str:
        """Write a note."""
        return f"noted {text}"

    store = MemoryStore()
    child = treadle.Agent(
        model=ScriptedModel(turns=[call("note", call_id="n1", text="hi"), say("child done")]),
        executor=treadle.Toolbox([note]),
        parser=treadle.NativeToolCallParser(),
    )
    helper = treadle.agent_tool(child, store=store, name="helper", description="Ask a helper.")
    parent = treadle.Agent(
        model=ScriptedModel(turns=[call("helper", call_id="h1", task="go"), say("parent done")]),
        executor=treadle.Toolbox([helper]),
        parser=treadle.NativeToolCallParser(),
    )
    await treadle.run(parent, "start", store=store, run_id="p")
    kid = treadle.child_run_id("p/s1/a1")
    assert "/" in kid  # a run id with slashes must still have its pages
    async with client(store) as http:
        parent_page = (await http.get("/runs/p")).text
        child_page = await http.get(f"/runs/{kid}")
        child_events = await http.get(f"/runs/{kid}/events")
    linked = kid.replace("/", "%2F")  # one path segment (docs/ui.md, "A run's page")
    assert f'child run <a href="/runs/{linked}">{kid}</a>' in parent_page
    assert child_page.status_code == 200
    assert '<dd id="run-parent"><a href="/runs/p">p</a></dd>' in child_page.text
    assert "child done" in child_page.text
    assert child_events.status_code == 200 and "event: finished" in child_events.text


def test_a_port_in_use_is_a_clear_error(tmp_path):
    import socket

    async def make():
        async with treadle.open_sqlite_store(tmp_path / "runs.db") as store:
            await treadle.run(markup_agent(), "x", store=store, run_id="markup")

    trio.run(make)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            main, ["ui", "--store", str(tmp_path / "runs.db"), "--port", str(port)]
        )
    assert result.exit_code == 1
    assert f"cannot serve 127.0.0.1:{port}" in result.output and "in use" in result.output


async def test_a_damaged_run_is_listed_with_its_error_and_its_page_says_why(tmp_path):
    async with treadle.open_jsonl_store(tmp_path) as store:
        for run_id in ("good", "bad"):
            await treadle.run(markup_agent(), "x", store=store, run_id=run_id)
        bad_file = trio.Path(store.run_file("bad"))
    lines = (await bad_file.read_bytes()).split(b"\n")
    lines[3] = lines[3][:10] + b"#" + lines[3][11:]  # one byte of a record frame changed
    await bad_file.write_bytes(b"\n".join(lines))
    async with treadle.open_jsonl_store(tmp_path) as store, client(store) as http:
        listed = await http.get("/")
        page = await http.get("/runs/bad")
        good = await http.get("/runs/good")
    row = listed.text[listed.text.index('data-run="bad"') :]
    row = row[: row.index("</tr>")]
    assert "unreadable" in row and 'class="error"' in row
    assert page.status_code == 500 and "bad" in page.text and 'class="notice refused"' in page.text
    assert good.status_code == 200


async def test_a_rejection_from_the_form_reaches_the_model_and_the_call_never_runs():
    store = MemoryStore()
    agent = approval_agent()
    async with open_run(agent, "pay", store=store, run_id="r", control_poll_s=0.05) as handle:
        await wait_for(handle, RunState.AWAITING_APPROVAL)
        async with client(store) as http:
            said = await http.post(
                "/runs/r/approve",
                data={"token": TOKEN, "decision": "reject", "message": "not this month"},
                headers=SAME,  # a plain form post: answered with a page
            )
        assert said.status_code == 200 and "reject" in said.text
        result = await handle.wait()
    assert result.state is RunState.SUCCEEDED and result.final_answer == "paid"
    (decided,) = await read_control(store, "r")
    assert decided.decision == "reject" and decided.message == "not this month"
    log = await store.read_log("r")
    (outcome,) = [r.outcome for r in log.records if type(r).__name__ == "ActionResult"]
    assert outcome.status.value == "not_executed" and "not this month" in outcome.observation


@pytest.mark.parametrize(
    "last", ["-3", "-1", "+3", "1_0", "1" * 5000], ids=["-3", "-1", "+3", "1_0", "5000-digits"]
)
async def test_a_last_event_id_that_is_no_seq_is_refused_not_read_from_the_end(last):
    """A bogus reconnect id sends no record twice or out of order: it is a 400. The console
    reads the id as `treadle.asyncio.resume_after` does (``1_0`` was read as seq 10)."""
    store = await finished_store()
    async with client(store) as http:
        bogus = await http.get("/runs/markup/events", headers={"last-event-id": last})
        below = await http.get("/runs/markup/events", params={"from": "-7"})
    assert bogus.status_code == 400 and "seq" in bogus.text
    assert "event: record" not in bogus.text
    ids = [int(e["id"]) for e in sse(below.text) if e["event"] == "record"]
    assert ids == list(range(1, len((await store.read_log("markup")).records) + 1))


@pytest.mark.parametrize("wanted", ["\u0663", "1" * 5000, "+3", "1_0", " 3"])
async def test_a_from_that_is_no_seq_is_refused(wanted):
    """``?from=`` was read with ``int``: ``٣`` streamed from seq 3, 5,000 digits took the
    parse's limit. It is read as a Last-Event-ID is (a ``-`` before it: from the first)."""
    store = await finished_store()
    async with client(store) as http:
        bogus = await http.get("/runs/markup/events", params={"from": wanted})
    assert bogus.status_code == 400 and "seq" in bogus.text
    assert "event: record" not in bogus.text


async def test_a_run_id_with_a_slash_has_its_page_stream_and_actions():
    """Run ids may hold ``/`` (docs/concepts.md, "Run ids"): the console's paths name them
    with ``%2F``, so ``team/a/events`` is a run's page and never the stream of ``team/a``."""
    store = MemoryStore()
    await treadle.run(markup_agent(), "read the page", store=store, run_id="team/a/events")
    async with open_run(
        approval_agent(), "pay", store=store, run_id="team/b", control_poll_s=0.05
    ) as handle:
        await wait_for(handle, RunState.AWAITING_APPROVAL)
        async with client(store) as http:
            listed = await http.get("/")
            page = await http.get("/runs/team%2Fa%2Fevents")
            stream = await http.get("/runs/team%2Fa%2Fevents/events")
            other = await http.get("/runs/team%2Fa/events")
            waiting = await http.get("/runs/team%2Fb")
            done = await http.post(
                "/runs/team%2Fb/approve",
                data={"token": TOKEN, "decision": "approve", "call_id": "t1"},
                headers={**SAME, "accept": "application/json"},
            )
        assert done.status_code == 200 and done.json()["ok"] is True
        result = await handle.wait()
    assert 'href="/runs/team%2Fa%2Fevents"' in listed.text
    assert page.status_code == 200 and 'data-run="team/a/events"' in page.text
    assert [e["event"] for e in sse(stream.text)][-1] == "finished"
    assert other.status_code == 404 and "team/a" in other.text
    assert waiting.status_code == 200 and 'action="/runs/team%2Fb/approve"' in waiting.text
    assert result.state is RunState.SUCCEEDED


async def test_a_run_whose_log_fails_its_read_does_not_take_the_list_down(tmp_path):
    """A store whose index still summarizes a damaged run (SQLite: a record fails its
    checksum): the list shows every other run and marks that one with the error."""
    import sqlite3

    db = tmp_path / "runs.db"
    async with treadle.open_sqlite_store(db) as store:
        for run_id in ("good", "bad"):
            await treadle.run(markup_agent(), "x", store=store, run_id=run_id)
    with contextlib.closing(sqlite3.connect(db)) as raw:
        raw.execute(
            "UPDATE records SET body = substr(body, 1, 20) WHERE run_id = 'bad' AND seq = 3"
        )
        raw.commit()
    async with treadle.open_sqlite_store(db) as store, client(store, poll_s=0.01) as http:
        listed = await http.get("/")  # the live list's stream renders the same rows
        page = await http.get("/runs/bad")
        # The page's script asks for JSON: it got the HTML error page, which it cannot read.
        headers = {**SAME, "accept": "application/json"}
        cancel = await http.post("/runs/bad/cancel", data={"token": TOKEN}, headers=headers)
    assert cancel.status_code == 500 and cancel.json()["ok"] is False
    assert "checksum" in cancel.json()["message"]
    assert listed.status_code == 200 and 'data-run="good"' in listed.text
    row = listed.text[listed.text.index('data-run="bad"') :]
    row = row[: row.index("</tr>")]
    assert 'class="error"' in row and "checksum" in row
    assert page.status_code == 500 and "checksum" in page.text


class _DamagedAfter(MemoryStore):
    """A store whose log of ``r`` fails its read from the ``fail_from``-th read on (a log
    damaged while a page streams it)."""

    def __init__(self, fail_from: int) -> None:
        super().__init__()
        self.reads: int | None = None  # counted (and failed) only while a page streams
        self.fail_from = fail_from
        self.read_once = trio.Event()

    async def read_log(self, run_id):
        if run_id == "r" and self.reads is not None:
            self.reads += 1
            if self.reads >= self.fail_from:
                self.read_once.set()
                raise LogCorrupted("run 'r': a record fails its checksum", where="r", offset=3)
            log = await super().read_log(run_id)
            self.read_once.set()
            return log
        return await super().read_log(run_id)


async def _streamed_while_failing(store: _DamagedAfter) -> list[dict]:
    """The events of run ``r``'s stream while ``store`` fails its reads from some read on.

    The run waits on its approval until the stream read its log once (the check that it
    exists, which brings the first records); then it is cancelled, and the stream reads the
    log again because it moved."""
    async with awaiting_approval(store) as handle:
        store.reads = 0
        streams: list[httpx.Response] = []
        async with client(store, poll_s=0.01) as http, trio.open_nursery() as nursery:

            async def stream() -> None:
                streams.append(await http.get("/runs/r/events"))

            nursery.start_soon(stream)
            with trio.fail_after(30):
                await store.read_once.wait()
            handle.cancel("done")
        store.reads = None
        await handle.wait()
    assert streams[0].status_code == 200
    return sse(streams[0].text)


async def test_a_log_damaged_while_it_streams_ends_the_stream_with_the_error():
    """The stream says why it stops (an ``unreadable`` event), rather than breaking off
    mid-response, which the browser would take for a dropped connection and retry."""
    events = await _streamed_while_failing(_DamagedAfter(fail_from=2))
    assert [e["event"] for e in events][-1] == "unreadable"
    assert "checksum" in json.loads(events[-1]["data"])["message"]
    assert events[0]["event"] == "token"
    assert all(e["event"] == "record" for e in events[1:-1]) and events[1:-1]


async def test_damage_in_an_idle_runs_log_ends_its_stream_within_the_recheck():
    """The stream reads only the summary while the run does not move: damage in the middle
    of an idle run's log went unseen by an open page for as long as the run stayed idle."""
    store = _DamagedAfter(fail_from=2)
    async with awaiting_approval(store) as handle:
        store.reads = 0
        async with client(store, poll_s=0.01, recheck_s=0.2) as http:
            with trio.fail_after(30):
                stream = await http.get("/runs/r/events")  # ends without the run moving
        store.reads = None
        handle.cancel("done")
        await handle.wait()
    events = sse(stream.text)
    assert [e["event"] for e in events][-1] == "unreadable"
    assert "checksum" in json.loads(events[-1]["data"])["message"]


async def test_a_reconnect_to_a_damaged_log_gets_the_unreadable_event():
    """The browser reconnects its stream (Last-Event-ID): the first read failed before the
    stream began, and it got the HTML error page, dropped the stream and said nothing."""
    events = await _streamed_while_failing(_DamagedAfter(fail_from=1))
    assert [e["event"] for e in events] == ["unreadable"]
    assert "checksum" in json.loads(events[0]["data"])["message"]


async def test_behind_a_tls_proxy_the_https_origin_of_the_same_host_may_act():
    """docs/ui.md has a shared network served behind TLS: the proxy speaks plain HTTP to the
    console and the browser's Origin says ``https://`` with the same host."""
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        async with client(store) as http:
            other_host = await http.post(
                "/runs/r/cancel",
                data={"token": TOKEN},
                headers={"origin": "https://evil.example:8765"},
            )
            assert other_host.status_code == 403
            done = await http.post(
                "/runs/r/cancel",
                data={"token": TOKEN, "reason": "behind TLS"},
                headers={"origin": "https://127.0.0.1:8765", "accept": "application/json"},
            )
            assert done.status_code == 200 and done.json()["ok"] is True
        result = await handle.wait()
    assert result.state is RunState.CANCELLED


@pytest.mark.parametrize(
    "path", ["/runs/a%20b", "/runs/%C3%A9", "/runs/" + "x" * 300, "/runs/a%20b/events"]
)
async def test_a_path_naming_no_possible_run_is_a_404_that_says_why(path):
    # An invalid run id went to the handler of unreadable logs: a 500.
    async with client(await finished_store()) as http:
        answer = await http.get(path, headers=SAME)
    assert answer.status_code == 404, answer.text
    assert "invalid run id" in answer.text or "there is no run" in answer.text


class _GoneAfter(_DamagedAfter):
    """A store whose run ``r`` is gone from the ``fail_from``-th read on (deleted by hand)."""

    async def read_log(self, run_id):
        if run_id == "r" and self.reads is not None:
            self.reads += 1
            if self.reads >= self.fail_from:
                self.read_once.set()
                return RunLog(run_id="r", records=())
            log = await MemoryStore.read_log(self, run_id)
            self.read_once.set()
            return log
        return await MemoryStore.read_log(self, run_id)


async def test_a_run_gone_while_it_streams_ends_the_stream_with_the_reason():
    """The stream's 404 for a run that no longer exists broke the response mid-stream (an
    ASGI error, the connection cut) instead of ending it with an ``unreadable`` event."""
    events = await _streamed_while_failing(_GoneAfter(fail_from=2))
    assert [e["event"] for e in events][-1] == "unreadable"
    assert "there is no run 'r'" in json.loads(events[-1]["data"])["message"]


class _CountedReads(MemoryStore):
    """Counts the reads of each run's log, and of its summary."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[str, int] = {}
        self.summaries = 0
        self.polled = trio.Event()

    async def read_log(self, run_id):
        self.reads[run_id] = self.reads.get(run_id, 0) + 1
        return await super().read_log(run_id)

    async def read_summary(self, run_id):
        self.summaries += 1
        if self.summaries >= 50:
            self.polled.set()
        return await super().read_summary(run_id)


async def test_a_stream_reads_the_log_again_only_when_its_run_moved():
    """Each poll of a run's stream read the whole log: ten pages open on an idle run of
    20,000 records kept two cores busy. A run that does not move costs a summary read."""
    store = _CountedReads()
    async with awaiting_approval(store) as handle:
        store.reads.clear()
        streams: list[httpx.Response] = []
        async with client(store, poll_s=0.001) as http, trio.open_nursery() as nursery:

            async def stream() -> None:
                streams.append(await http.get("/runs/r/events"))

            nursery.start_soon(stream)
            with trio.fail_after(30):
                await store.polled.wait()  # fifty polls of the idle run
            idle_reads = store.reads["r"]
            handle.approve("t1")  # it moves, and streams on to its end
        await handle.wait()
    assert idle_reads == 1  # the check that it exists, which is the stream's first read
    events = sse(streams[0].text)
    assert events[-1]["event"] == "finished"
    count = len((await store.read_log("r")).records)
    assert [int(e["id"]) for e in events if e["event"] == "record"] == list(range(1, count + 1))


async def test_the_runs_list_reads_a_log_again_only_when_its_run_moved():
    """Every poll of every open list re-read every unfinished run's log whole: twenty tabs on
    sixty idle runs of 500 steps kept the console busy and no tab got its table."""
    store = _CountedReads()
    async with awaiting_approval(store) as handle, client(store) as http:
        store.reads.clear()
        for _ in range(3):
            listed = await http.get("/")
            assert listed.status_code == 200 and 'data-run="r"' in listed.text
        assert store.reads.get("r") == 1  # the run did not move: read once
        handle.cancel("done")
        await handle.wait()
        listed = await http.get("/")
        assert "cancelled" in listed.text
        assert store.reads.get("r") == 2  # it moved (finished): read again, once
        await http.get("/")
        assert store.reads.get("r") == 2


# The console stops reading a body with a file part: httpx's test transport then drops the
# rest of its own stream, which Python reports as an unfinished async generator.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_action_form_holding_a_file_is_refused_unstored():
    """Another site's page could post a huge file; the console wrote it to a temporary file
    before it checked the origin. Now it checks first, and a form may hold no file."""
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        async with client(store) as http:
            form = {"token": TOKEN, "reason": "stop"}
            built = httpx.Request(
                "POST", "http://x/", data=form, files={"upload": ("big.bin", b"x" * 4096)}
            )
            built.read()
            with_file = await http.post(
                "/runs/r/cancel",
                content=built.content,
                headers={**SAME, "content-type": built.headers["content-type"]},
            )
            assert with_file.status_code == 400, with_file.text
            assert await read_control(store, "r") == ()  # nothing was written
        handle.cancel("done")
        await handle.wait()


@pytest.mark.parametrize("action", ["approve", "cancel"])
@pytest.mark.parametrize("path", ["/runs/no-such-run", "/runs/a%20b"])
async def test_an_action_on_a_run_id_naming_no_run_is_a_404(action, path):
    """Approve and cancel of a run that does not exist (or of an id no run can have) were
    refused with a 409, as if the run had refused them; the run's page says 404."""
    store = await finished_store()
    async with client(store) as http:
        page = await http.get(path)
        acted = await http.post(
            f"{path}/{action}",
            data={"token": TOKEN, "decision": "approve", "reason": "x"},
            headers={**SAME, "accept": "application/json"},
        )
    assert page.status_code == 404
    assert acted.status_code == 404, acted.text
    said = acted.json()
    assert said["ok"] is False
    assert "there is no run" in said["message"] or "invalid run id" in said["message"]
    assert await store.list_runs() == ("markup",)


@pytest.mark.parametrize("action", ["approve", "cancel"])
async def test_a_get_of_an_actions_address_is_a_405_naming_the_action(action):
    """A GET of ``/runs/markup/approve`` (a link to it, a form's address opened in a tab) was
    read as the page of a run ``markup/approve``: a 404 naming a run nobody asked for."""
    store = await finished_store()
    async with client(store) as http:
        got = await http.get(f"/runs/markup/{action}")
        head = await http.head(f"/runs/markup/{action}")
        asked = await http.get(f"/runs/markup/{action}", headers={"accept": "application/json"})
        put = await http.put(f"/runs/markup/{action}", headers=SAME)
        named = await http.get(f"/runs/markup%2F{action}")  # a run whose id ends so
    for answer in (got, head, asked, put):
        assert answer.status_code == 405, answer.text
        assert answer.headers["allow"] == "POST"
    assert f"{action} is an action" in got.text and "/runs/markup " in got.text
    assert "there is no run" not in got.text
    assert asked.json() == {"ok": False, "message": got.text}
    assert named.status_code == 404 and f"'markup/{action}'" in named.text
    assert await store.list_runs() == ("markup",)


async def test_a_stream_opens_with_the_consoles_token():
    """A page reconnecting to a restarted console (a new token) with nothing new to read got
    nothing: its approval form kept the old token and every decision from it was refused.
    Every stream now opens with the token, which the page puts in its forms."""
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        seen = len((await store.read_log("r")).records)
        async with client(store, poll_s=0.01) as http, trio.open_nursery() as nursery:
            streams: list[httpx.Response] = []

            async def reconnect() -> None:
                headers = {"last-event-id": str(seen)}
                streams.append(await http.get("/runs/r/events", headers=headers))

            nursery.start_soon(reconnect)
            handle.approve("t1")  # the run moves on and finishes: the stream ends
        await handle.wait()
    events = sse(streams[0].text)
    assert events[0]["event"] == "token" and "id" not in events[0], events[:2]
    assert json.loads(events[0]["data"]) == {"token": TOKEN}
    records = [int(e["id"]) for e in events if e["event"] == "record"]
    assert records[0] == seen + 1 and events[-1]["event"] == "finished"


async def test_the_charts_of_a_long_run_stay_bounded(monkeypatch):
    """The charts drew two bars per step and one per call: a run of 5,000 steps had a
    1.4 MB timing chart of 10,700 bars, rendered and sent again with each new record."""
    monkeypatch.setattr(_view, "MAX_TOKEN_SLOTS", 4)
    monkeypatch.setattr(_view, "MAX_WATERFALL_ROWS", 5)
    used = Usage(input_tokens=10, output_tokens=1)
    turns = [
        calls(ToolCall(id=f"f{i}", name="fetch_page", arguments={"url": "u"}), usage=used)
        for i in range(11)
    ]
    agent = treadle.Agent(
        model=ScriptedModel(turns=[*turns, say("done", usage=used)]),
        executor=treadle.Toolbox([fetch_page]),
        parser=treadle.NativeToolCallParser(),
    )
    store = MemoryStore()
    await treadle.run(agent, "read", store=store, run_id="long")
    async with client(store) as http:
        page = await http.get("/runs/long")
    text = html.unescape(page.text)
    charts = text[text.index('id="charts"') : text.index('id="timeline"')]
    # 12 steps, 3 to a slot: 4 slots of two bars, each summing its steps
    assert charts.count('class="bar input"') == 4 and charts.count('class="bar output"') == 4
    assert "steps 1–3: 30 input tokens" in charts and "steps 10–12: 3 output tokens" in charts
    assert "(steps 1–12, 3 steps a bar)" in charts
    # 12 model attempts and 11 tool calls, 5 to a bar (the last holds 3)
    rows = [charts.count(f'class="bar {kind}"') for kind in ("model", "tool", "mixed")]
    assert sum(rows) == 5 and rows[2] >= 4, rows
    assert "(23 calls, 5 a bar)" in charts
    assert "3 model attempts" in charts and "2 tool calls" in charts


@pytest.mark.parametrize("path", ["/runs/markup", "/runs/markup/events?from=1"])
async def test_a_run_rendering_does_not_hold_up_the_other_requests(monkeypatch, path):
    """A run's page and stream were rendered on the event loop: the page of a run of
    25,000 records held every other request of the console up for seconds."""
    store = await finished_store()
    rendering, served = threading.Event(), threading.Event()
    timeline = _view.timeline

    def held_timeline(log, upto=None):
        rendering.set()
        assert served.wait(60), "no other request was served while the run rendered"
        return timeline(log, upto)

    monkeypatch.setattr(_view, "timeline", held_timeline)
    async with client(store) as http, trio.open_nursery() as nursery:
        answers: list[httpx.Response] = []

        async def render() -> None:
            answers.append(await http.get(path))

        nursery.start_soon(render)
        with trio.fail_after(60):
            await trio.to_thread.run_sync(rendering.wait)
        other = await http.get("/static/ui.css")
        served.set()
    assert other.status_code == 200
    assert answers[0].status_code == 200 and "fetch_page" in answers[0].text


@pytest.mark.parametrize(
    "step",
    [
        pytest.param("1" * 5000, id="5000-digits"),
        pytest.param("1" * 20, id="20-digits"),
        pytest.param("\u0663", id="arabic-indic-3"),
        "+3",
        " 3",
        "3.0",
        "1_0",
    ],
)
async def test_a_form_step_that_is_no_step_number_is_refused(step):
    """A step of more than 4,300 digits was a raw 500 (``int`` refuses it), and one of other
    digits (``٣``) read as its number. A step is 1 to 19 digits 0-9, as an event id's seq."""
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        async with client(store) as http:
            headers = {**SAME, "accept": "application/json"}
            form = {"token": TOKEN, "decision": "approve", "call_id": "t1"}
            refused = await http.post(
                "/runs/r/approve", data={**form, "step": step}, headers=headers
            )
            assert refused.status_code == 409, refused.text
            assert refused.json() == {
                "ok": False,
                "message": "the form's step is no step number (1 to 19 digits 0-9); reload the page",
            }
            assert await read_control(store, "r") == ()  # nothing was written
            pending = handle.pending_approval
            assert pending is not None
            shown = {**form, "step": str(pending.step)}
            approved = await http.post("/runs/r/approve", data=shown, headers=headers)
            assert approved.status_code == 200, approved.text
        await handle.wait()


async def test_the_state_menu_offers_every_state_whatever_runs_there_are():
    """The menu listed only the states some run had: ``?state=cancelled`` on a store with no
    cancelled run showed a menu set to "every state", and the live list then showed every run.
    """
    async with client(await finished_store()) as http:
        page = (await http.get("/", params={"state": "cancelled"})).text
        odd = (await http.get("/", params={"state": "nosuch"})).text
    menu = page[page.index('<select name="state"') : page.index("</select>")]
    offered = [part.split('"', 1)[0] for part in menu.split('<option value="')[1:]]
    every = {s.value for s in RunState} | {v.value for v in Liveness} | {"unreadable"}
    assert offered[0] == "" and sorted(offered[1:]) == sorted(every)  # each once
    assert '<option value="cancelled" selected>' in menu
    assert 'data-run="' not in page  # no run is cancelled
    assert '<option value="nosuch" selected>' in odd and 'data-run="' not in odd


async def test_the_token_link_redirects_within_the_site_and_the_cookie_follows_tls():
    """Behind the documented TLS proxy, ``?token=`` answered with an absolute ``http://``
    Location (the browser left ``https://``) and a cookie without Secure."""
    store = await finished_store()
    proxied = {"host": "console.example"}
    async with client(store, token_for_reads=True, allowed_hosts=("*",)) as http:
        plain = await http.get("/runs/markup", params={"token": TOKEN, "q": "a b"}, headers=proxied)
        tls = await http.get(
            "/", params={"token": TOKEN}, headers={**proxied, "x-forwarded-proto": "https"}
        )
        slashed = await http.get("/runs/team%2Fa", params={"token": TOKEN}, headers=proxied)
    assert plain.status_code == 303 and plain.headers["location"] == "/runs/markup?q=a+b"
    assert "secure" not in plain.headers["set-cookie"].lower()
    assert tls.status_code == 303 and tls.headers["location"] == "/"
    assert "; secure" in tls.headers["set-cookie"].lower()
    assert slashed.headers["location"] == "/runs/team%2Fa"


async def test_two_consoles_on_one_host_keep_a_cookie_each():
    """Browsers keep cookies per host, not per port: two consoles with tokens on one host
    each set ``treadle_token``, and entering one logged the browser out of the other."""
    store = await finished_store()
    apps = {
        port: httpx.ASGITransport(
            app=create_app(store, Settings(token=token, token_for_reads=True))
        )
        for port, token in ((8765, "token-a"), (8766, "token-b"))
    }

    class ByPort(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await apps[request.url.port or 80].handle_async_request(request)

    # one cookie jar, as a browser's: a cookie set by one port is sent to the other too
    async with httpx.AsyncClient(transport=ByPort()) as browser:
        a, b = "http://127.0.0.1:8765", "http://127.0.0.1:8766"
        assert (await browser.get(f"{a}/", params={"token": "token-a"})).status_code == 303
        assert (await browser.get(f"{b}/", params={"token": "token-b"})).status_code == 303
        assert (await browser.get(f"{a}/")).status_code == 200
        assert (await browser.get(f"{b}/")).status_code == 200
    assert len(browser.cookies) == 2


class _CountedLists(MemoryStore):
    """Counts the reads of the runs list; `listed` waits for a count of them."""

    def __init__(self) -> None:
        super().__init__()
        self.lists = 0
        self._listed = trio.Event()

    async def list_summaries(self, *args, **kwargs):
        self.lists += 1
        self._listed.set()
        self._listed = trio.Event()
        return await super().list_summaries(*args, **kwargs)

    async def listed(self, count: int) -> None:
        with trio.fail_after(60):
            while self.lists < count:
                await self._listed.wait()


async def test_the_runs_list_stream_renders_and_sends_its_table_only_when_it_changed(
    monkeypatch,
):
    """Each open runs list rendered its whole table every 0.5 s to compare it with the last,
    on the event loop, though no run had moved: 1.3 MB of HTML a poll for 3,000 runs."""
    from starlette.requests import Request

    store = _CountedLists()
    await treadle.run(markup_agent(), "read", store=store, run_id="a")
    app = create_app(store, Settings(token=TOKEN, poll_s=0.0))
    (stream,) = [r.endpoint for r in app.routes if getattr(r, "path", "") == "/rows"]
    env = stream.__self__.env
    renders = []
    get_template = env.get_template

    def counted(name, *args, **kwargs):
        renders.extend([name] if name == "_rows.html" else [])
        return get_template(name, *args, **kwargs)

    monkeypatch.setattr(env, "get_template", counted)
    scope = {"type": "http", "method": "GET", "path": "/rows", "query_string": b"", "headers": []}
    response = await stream(Request(scope))
    sent = []

    async def read() -> None:
        async for event in response.body_iterator:
            sent.append(event)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await store.listed(4)  # four polls of an unchanged list
        assert len(sent) == 1 and len(renders) == 1, (len(sent), renders)
        await treadle.run(markup_agent(), "again", store=store, run_id="b")
        await store.listed(store.lists + 2)  # the next poll sees run b
        assert len(sent) == 2 and len(renders) == 2, (len(sent), renders)
        assert 'data-run="b"' in sent[1].data
        nursery.cancel_scope.cancel()


def test_a_token_no_header_or_cookie_can_carry_is_refused_at_start():
    """``--token €uro-secret`` started a console whose ``?token=`` link was a bare 500 (the
    cookie could not be encoded) and whose header, sent as UTF-8, never matched: unusable."""
    for token in ("€uro-secret", "two words", "tab\there", ""):
        refused = CliRunner().invoke(main, ["ui", "--store", "x.db", "--token", token])
        assert refused.exit_code == 2, (token, refused.output)
        assert "printable ASCII characters other than space" in refused.output
        with pytest.raises(UsageError, match="printable ASCII"):
            Settings(token=token)
    assert "'€'" in CliRunner().invoke(main, ["ui", "--token", "€uro"]).output


async def test_a_token_of_every_allowed_character_opens_the_console():
    token = "".join(map(chr, range(0x21, 0x7F)))  # quotes, ; and \ too: the cookie quotes them
    store = await finished_store()
    app = create_app(store, Settings(token=token, token_for_reads=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
        assert (await http.get("/", params={"token": token})).status_code == 303
        assert (await http.get("/")).status_code == 200  # with the cookie it set
        http.cookies.clear()
        assert (await http.get("/", headers={"x-treadle-token": token})).status_code == 200


async def test_the_runs_list_page_renders_in_a_worker_thread(monkeypatch):
    """The first load of ``/`` rendered its table on the event loop: with 3,000 runs every
    other request of the console (a static file, an approval) waited over a second."""
    store = await finished_store()
    app = create_app(store, Settings(token=TOKEN))
    (page,) = [r.endpoint for r in app.routes if getattr(r, "path", "") == "/"]
    env = page.__self__.env
    rendered_in = []
    get_template = env.get_template

    def noted(name, *args, **kwargs):
        rendered_in.extend([threading.current_thread()] if name == "runs.html" else [])
        return get_template(name, *args, **kwargs)

    monkeypatch.setattr(env, "get_template", noted)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
        page = await http.get("/")
    assert page.status_code == 200 and 'data-run="markup"' in page.text
    assert len(rendered_in) == 1 and rendered_in[0] is not threading.main_thread()


async def test_a_decision_sent_twice_is_answered_as_applied_both_times():
    """A double click on approve: the call was approved, but the second answer said the call
    "already has a decision (approve) ... the first decision counts" (or that it was
    "written just before this one ... does not count"), a refusal of the operator's own
    click."""
    store = MemoryStore()
    async with awaiting_approval(store) as handle:
        async with client(store) as http:
            page = (await http.get("/runs/r")).text
            form = {
                name: html.unescape(page.split(f'name="{name}" value="')[1].split('"')[0])
                for name in ("call_id", "step", "digest")
            }
            headers = {**SAME, "accept": "application/json"}
            data = {**form, "token": TOKEN, "decision": "approve"}
            first = await http.post("/runs/r/approve", data=data, headers=headers)
            second = await http.post("/runs/r/approve", data=data, headers=headers)
            rejected = await http.post(
                "/runs/r/approve", data={**data, "decision": "reject"}, headers=headers
            )
        result = await handle.wait()
    assert first.status_code == 200 and first.json()["ok"] is True, first.text
    assert second.status_code == 200 and second.json()["ok"] is True, second.text
    assert "the same decision was written just before this one" in second.json()["message"]
    assert rejected.status_code == 409  # another decision than the one that counts
    assert result.state is RunState.SUCCEEDED


class _HeldFinish(MemoryStore):
    """Holds the first cancel that takes a run's lease to finish it, until `let_go` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.held, self.let_go = trio.Event(), trio.Event()

    async def acquire_lease(self, run_id, *, owner, ttl_s):
        lease = await super().acquire_lease(run_id, owner=owner, ttl_s=ttl_s)
        if self.holding and not self.held.is_set():
            self.held.set()
            await self.let_go.wait()
        return lease


async def test_concurrent_cancels_never_name_the_consoles_own_lease_as_a_driver():
    """Cancels sent at once to a parked run: the first took the run's lease to finish it, and
    the others answered that ``host:<the console's pid>:...`` "drives the run and stops it
    within about 1 s", a process that drives nothing."""
    store = _HeldFinish()
    with trio.CancelScope() as gone:
        async with open_run(approval_agent(), "pay", store=store, run_id="r", park_after_s=0.1):
            with trio.fail_after(60):
                while (await store.read_summary("r")).liveness is not Liveness.PARKED:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            gone.cancel()
    store.holding = True
    answers = []
    async with client(store) as http:

        async def cancel(reason: str) -> None:
            headers = {**SAME, "accept": "application/json"}
            data = {"token": TOKEN, "reason": reason}
            answers.append(await http.post("/runs/r/cancel", data=data, headers=headers))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel, "first")
            with trio.fail_after(60):
                await store.held.wait()  # the first one holds the lease, finishing the run
            await cancel("second")
            store.let_go.set()
    second, first = answers
    assert first.json()["ok"] is True and "finished here, cancelled" in first.json()["message"]
    said = second.json()["message"]
    assert "is finishing the run as cancelled now" in said and "another cancel (" in said, said
    assert f":{os.getpid()}:cancel-" in said  # named as a cancel, not as a driver
    assert "drives the run" not in said and "stops it within" not in said
    assert (await store.read_log("r")).finished.state is RunState.CANCELLED


DROPPED = "terminating connection due to administrator command"
"""What PostgreSQL says to a client whose connection an administrator ended."""


class _DroppedFor(MemoryStore):
    """A store whose reads of run ``r`` (its log and its summary) fail as over a dropped
    database connection, ``failures`` times once `drop` is called, then work again."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0
        self.read_once = trio.Event()  # run r's log was read
        self.passed = trio.Event()  # the failures are used up

    def drop(self, failures: int) -> None:
        self.failures = failures

    def _fail(self, run_id: str) -> None:
        if run_id == "r" and self.failures:
            self.failures -= 1
            if not self.failures:
                self.passed.set()
            raise StoreError(f"cannot read or update PostgreSQL store: {DROPPED}")

    async def read_log(self, run_id):
        self._fail(run_id)
        log = await super().read_log(run_id)
        if run_id == "r":
            self.read_once.set()
        return log

    async def read_summary(self, run_id):
        self._fail(run_id)
        return await super().read_summary(run_id)


@pytest.mark.parametrize("opened", ["before", "after"])
async def test_a_read_that_fails_for_a_passing_reason_is_retried_and_the_stream_goes_on(opened):
    """One dropped PostgreSQL connection ended every open run page for good: the stream sent
    ``unreadable`` for it as for a damaged log, and the page stopped while the run went on
    (and a page opened meanwhile got nothing but that event). A failure that may pass is told
    in ``retrying`` events, and the stream reads again and goes on to the run's end."""
    store = _DroppedFor()
    async with awaiting_approval(store) as handle:
        streams: list[httpx.Response] = []
        async with client(store, poll_s=0.01) as http, trio.open_nursery() as nursery:

            async def stream() -> None:
                streams.append(await http.get("/runs/r/events"))

            if opened == "before":  # the read that finds the run fails, then the stream's two
                store.drop(3)
            else:
                store.read_once = trio.Event()
            nursery.start_soon(stream)
            with trio.fail_after(30):
                await store.read_once.wait()  # the stream read the log
                if opened == "after":
                    store.drop(2)
                await store.passed.wait()
            handle.approve("t1")  # the run moves on and finishes: the stream ends
        await handle.wait()
    events = sse(streams[0].text)
    kinds = [e["event"] for e in events]
    assert "unreadable" not in kinds and kinds[-1] == "finished", kinds
    retrying = [json.loads(e["data"]) for e in events if e["event"] == "retrying"]
    assert len(retrying) == 2 and all(DROPPED in said["message"] for said in retrying)
    assert [said["retry_s"] for said in retrying] == [0.5, 1.0]  # it waits longer each time
    assert kinds.index("recovered") == kinds.index("retrying") + 2
    count = len((await store.read_log("r")).records)
    assert [int(e["id"]) for e in events if e["event"] == "record"] == list(range(1, count + 1))


class _Orphaned(MemoryStore):
    """A store whose summary of run ``r`` says its driver died (its lease expired) once
    `orphan` is called, though no record was written; `polled` waits for summary reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lapsed: object = None  # the lease as it was when the driver died
        self.summaries = 0
        self._read = trio.Event()

    def orphan(self, lease) -> None:
        self.lapsed = lease

    async def read_summary(self, run_id):
        summary = await super().read_summary(run_id)
        self.summaries += 1
        self._read.set()
        self._read = trio.Event()
        if self.lapsed is None or summary is None:
            return summary
        return attrs.evolve(summary, liveness=Liveness.ORPHANED, lease=self.lapsed)

    async def polled(self, count: int) -> None:
        with trio.fail_after(60):
            while self.summaries < count:
                await self._read.wait()


async def test_the_panel_follows_the_runs_driver_without_a_new_record():
    """A run's page kept saying the run was driven by a process that had died (its age
    frozen) while ``treadle runs`` said orphaned: the panel came only with new records, and a
    lease that lapses writes none. It comes once when the summary shows the change, and is not
    sent again while nothing it shows changes."""
    store = _Orphaned()
    async with awaiting_approval(store) as handle:
        summary = await store.read_summary("r")
        assert summary is not None and summary.liveness is Liveness.DRIVEN
        streams: list[httpx.Response] = []
        async with client(store, poll_s=0.001) as http, trio.open_nursery() as nursery:

            async def stream() -> None:
                streams.append(await http.get("/runs/r/events"))

            nursery.start_soon(stream)
            # the stream sent the records and polls: the driver dies with no record written
            await store.polled(store.summaries + 3)
            store.orphan(summary.lease)
            await store.polled(store.summaries + 50)  # fifty polls of the orphaned run
            store.lapsed = None
            handle.approve("t1")  # the run goes on to its end: the stream ends
        await handle.wait()
    events = sse(streams[0].text)
    kinds = [e["event"] for e in events]
    panels = [json.loads(e["data"])["panel"] for e in events if e["event"] == "panel"]
    # once the test stops faking the driver's death, its lease shows again: that may send a
    # panel of its own before the approval's records come
    orphaned = [shown for shown in panels if "nobody: orphaned" in shown]
    assert len(orphaned) == 1 and panels[0] == orphaned[0], kinds  # once in fifty polls
    assert "expired" in orphaned[0]
    assert all("id" not in e for e in events if e["event"] == "panel")  # a reconnect resumes
    # after the last record
    first_after = next(e for e in events[kinds.index("panel") :] if e["event"] == "record")
    assert int(first_after["id"]) > 1 and kinds[-1] == "finished"


class _ListFails(MemoryStore):
    """A store whose runs list fails with ``error`` ``failures`` times once `fail` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.error: StoreError | None = None
        self.failures = 0

    def fail(self, error: StoreError, failures: int) -> None:
        self.error, self.failures = error, failures

    async def list_summaries(self, *args, **kwargs):
        if self.error is not None and self.failures:
            self.failures -= 1
            raise self.error
        return await super().list_summaries(*args, **kwargs)


async def _rows_events(store: MemoryStore, until: str) -> list[ServerSentEvent]:
    """The events of the runs list's stream over ``store``, up to the first ``until`` event
    (taken from the app's response, which a test client would read to its end)."""
    from starlette.requests import Request

    app = create_app(store, Settings(token=TOKEN, poll_s=0.0))
    (stream,) = [r.endpoint for r in app.routes if getattr(r, "path", "") == "/rows"]
    scope = {"type": "http", "method": "GET", "path": "/rows", "query_string": b"", "headers": []}
    response = await stream(Request(scope))
    sent: list[ServerSentEvent] = []
    with trio.fail_after(60):
        async with contextlib.aclosing(response.body_iterator) as events:
            async for event in events:
                sent.append(event)
                if event.event == until:
                    break
    return sent


async def test_the_runs_lists_stream_says_a_failed_read_and_goes_on():
    """A store that failed the list's read (a dropped PostgreSQL connection, a JSONL folder
    gone for a moment) broke the list's stream with three chained tracebacks on the console's
    standard error, and the page said nothing; the browser reconnected into the next one."""
    store = _ListFails()
    await treadle.run(markup_agent(), "read", store=store, run_id="a")
    store.fail(StoreError(f"cannot list the store: {DROPPED}"), 2)
    sent = await _rows_events(store, until="recovered")
    assert [e.event for e in sent] == ["retrying", "retrying", "recovered"]
    said = [json.loads(str(e.data)) for e in sent[:2]]
    assert all(DROPPED in s["message"] for s in said)
    assert [s["retry_s"] for s in said] == [0.5, 1.0]  # it waits longer each time


async def test_the_runs_lists_stream_ends_with_the_reason_when_the_store_is_damaged():
    """Damage is no passing failure: the stream says why in ``unreadable`` and ends (the page
    shows it and stops reconnecting)."""
    store = _ListFails()
    await treadle.run(markup_agent(), "read", store=store, run_id="a")
    store.fail(LogCorrupted("the database is damaged", where="runs.db", offset=None), 1)
    sent = await _rows_events(store, until="never")  # it ends by itself
    assert [e.event for e in sent] == ["unreadable"]
    assert "the database is damaged" in json.loads(str(sent[0].data))["message"]


async def test_a_run_stream_outlasts_postgresql_dropping_the_consoles_connections(
    postgres_database,
):
    """The repro of the dropped connection over a real server: an administrator ends every
    connection of the console's store (``pg_terminate_backend``, as a failover does) while a
    page streams a run; the stream goes on to the run's end on new connections, nothing
    missed, nothing sent twice."""
    import psycopg

    from treadle.stores.postgres import open_postgres_store
    from treadle.testing.contracts import seed_log
    from treadle.types import Message, ModelIntent, RunFinished, RunStarted, Totals

    ts = "2026-01-01T00:00:00+00:00"
    begun = RunStarted(run_id="r", ts=ts, input=(Message(role="user", content="hi"),), snapshot={})
    asked = ModelIntent(run_id="r", step=1, intent_id="r/m1", attempt=1, ts=ts)
    ended = RunFinished(
        run_id="r",
        ts=ts,
        state=RunState.CANCELLED,
        stop_reason=StopReason.CANCELLED,
        totals=Totals(),
    )
    async with open_postgres_store(postgres_database) as store:
        await seed_log(store, [begun, asked])
        polls = 0
        polled = trio.Event()
        read_summary = store.read_summary

        async def counted(run_id):
            nonlocal polls, polled
            summary = await read_summary(run_id)
            polls += 1
            polled.set()
            polled = trio.Event()
            return summary

        async def polls_past(count: int) -> None:
            with trio.fail_after(60):
                while polls < count:
                    await polled.wait()

        store.read_summary = counted  # type: ignore[method-assign]
        streams: list[httpx.Response] = []
        async with client(store, poll_s=0.01) as http, trio.open_nursery() as nursery:

            async def stream() -> None:
                streams.append(await http.get("/runs/r/events"))

            nursery.start_soon(stream)
            await polls_past(3)  # the stream sent the records and polls the run
            with psycopg.connect(postgres_database, autocommit=True) as admin:
                ended_ = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
            assert ended_
            await polls_past(polls + 3)  # read on a new connection, three times
            await seed_log(store, [ended])  # the stream ends with the run
    events = sse(streams[0].text)
    kinds = [e["event"] for e in events]
    assert "unreadable" not in kinds and kinds[-1] == "finished", events
    # The store reads again on a new connection itself (docs/fleet.md, "What each crash
    # does"); a read that failed all the same is said and tried again by the stream.
    retrying = [json.loads(e["data"])["message"] for e in events if e["event"] == "retrying"]
    assert all("terminating connection" in said for said in retrying), retrying
    if retrying:
        assert kinds.index("recovered") > kinds.index("retrying")
    assert [int(e["id"]) for e in events if e["event"] == "record"] == [1, 2, 3]


async def test_the_context_of_a_thread_run_names_inherited_turns_as_turns():
    """A model call's context row said "steps -12+ verbatim", "summary of steps through -13"
    and "old observations replaced by markers (steps -12--1)" for a thread's inherited turns,
    which are numbered up to 0; it says them as `treadle show` does."""
    from treadle.stores import write_records
    from treadle.types import ContextUsed, ModelResult

    ran = await finished_store()
    records = list((await ran.read_log("markup")).records)
    first = next(i for i, r in enumerate(records) if isinstance(r, ModelResult))
    context = ContextUsed(
        window=1200,
        budget=1072,
        estimated_input_tokens=1030,
        verbatim_from=-12,
        summary_intent_id="chat/s3/m9",
        summary_through=-13,
        marked=13,
        marked_from=-12,
        marked_to=-1,
    )
    records[first] = attrs.evolve(records[first], context=context)
    store = MemoryStore()
    lease = await store.acquire_lease("markup", owner="writer", ttl_s=60.0)
    await write_records(store, records, seq=1, generation=lease.generation)
    await store.release_lease(lease)
    async with client(store) as http:
        page = (await http.get("/runs/markup")).text
    (row,) = [line for line in page.splitlines() if 'class="context dim"' in line]
    assert "turns -12 on verbatim" in row and "summary of turns up to -13" in row, row
    assert "13 old observations of turns -12 to -1 replaced by markers" in row, row
    assert "steps -" not in row, row
