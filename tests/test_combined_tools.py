"""`treadle.combine_tools`: local tools and MCP servers behind one action executor.

The MCP parts are the real test server (tests/fixtures/mcp_server.py): in process for the
contract suite, over streamable HTTP on 127.0.0.1 for the runs, whose crashes are the crash
kit's (`CrashingStore`, `CrashingExecutor`) at every write and in the middle of each action.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
import trio
from tests.fixtures import mcp_server
from tests.fixtures.mcp_driver import (
    ROOT,
    drive,
    http_server,
    local_tools,
    read_ledger,
    stdio_server,
)

import treadle
from treadle import ActionStatus, ReplayPolicy, Toolbox, ToolContext, UsageError, tool
from treadle.agent import check_snapshot
from treadle.approvals import requires_approval
from treadle.mcp import McpToolOptions, open_mcp_tools
from treadle.policies import policies_of
from treadle.ports import ToolPolicies
from treadle.testing import CrashingExecutor, CrashingStore, SimulatedCrash, check_action_executor
from treadle.testing.crashdriver import open_store
from treadle.testing.scripted import ScriptedModel, calls, say
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    RunLog,
    ToolCall,
    ToolSpec,
)

SAFE, NEVER = ReplayPolicy.SAFE, ReplayPolicy.NEVER


def _action(tool_name: str, intent_id: str = "r/s1/a1", **arguments: Any) -> Action:
    return Action(
        run_id="r", step=1, intent_id=intent_id, call_id="c", tool=tool_name, arguments=arguments
    )


# --------------------------------------------------------------------------- local parts


async def _reconcile_send(action: Action) -> ActionOutcome | None:
    return ActionOutcome(status=ActionStatus.EXECUTED, observation=f"reconciled {action.tool}")


@tool(requires_approval=True, secret_arguments=("token",), timeout_s=3, reconcile=_reconcile_send)
async def send(to: str, token: str) -> str:
    """Send a message."""
    return f"sent to {to}"


@tool(replay=SAFE)
def lookup(key: str) -> str:
    """Look a key up."""
    return f"{key} is local"


@tool(writes="doc:{name}")
async def save(name: str, ctx: ToolContext) -> str:
    """Save a document."""
    return f"saved {name} over revision {ctx.seen_revision}"


class Bare:
    """An executor with only the four `ActionExecutor` methods (no `ToolPolicies`)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.seen: list[Action] = []

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        return tuple(ToolSpec(name=n) for n in self.names)

    def replay_policy(self, tool: str) -> ReplayPolicy:
        return NEVER

    async def execute(self, action: Action) -> ActionOutcome:
        await trio.lowlevel.checkpoint()
        self.seen.append(action)
        return ActionOutcome(status=ActionStatus.EXECUTED, observation=f"bare ran {action.tool}")

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        await trio.lowlevel.checkpoint()
        return None


def test_the_tools_of_every_part_in_order_with_prefixes():
    combined = treadle.combine_tools(Toolbox([send, lookup]), ("b_", Bare("lookup", "x")))
    assert [s.name for s in combined.tool_specs()] == ["send", "lookup", "b_lookup", "b_x"]
    assert combined.tool_specs()[0] == send.spec  # a part without prefix: its spec as is
    assert combined.part_of("b_lookup") == (combined.parts[1][1], "lookup")
    assert combined.part_of("lookup") == (combined.parts[0][1], "lookup")
    assert combined.part_of("x") is None


def test_a_clash_names_both_parts_and_the_ways_out():
    with pytest.raises(UsageError) as raised:
        treadle.combine_tools(Toolbox([send, lookup]), Bare("x", "lookup"))
    message = str(raised.value)
    assert "'lookup' is offered by part 1 (Toolbox) and by part 2 (Bare)" in message
    assert "give a part a prefix: combine_tools(..., ('some_prefix_', executor))" in message
    with pytest.raises(UsageError, match=r"offered by part 1 \(Bare, prefix 'p_'\) and by part 2"):
        treadle.combine_tools(("p_", Bare("a")), Bare("p_a"))
    with pytest.raises(UsageError, match=r"part 1 \(Bare\) offers two tools named 'a'"):
        treadle.combine_tools(Bare("a", "a"))


def test_parts_that_are_no_executors_are_clear_errors():
    with pytest.raises(
        UsageError, match=r"is not an action executor .*wrap local tools in Toolbox"
    ):
        treadle.combine_tools([send, lookup])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"part 2 .* is not an action executor"):
        treadle.combine_tools(Bare("a"), "b")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="the prefix of part 1 must be a str"):
        treadle.combine_tools((3, Bare("a")))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="a prefixed part is a pair"):
        treadle.combine_tools(("p_", Bare("a"), "q"))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="the tool name 'bad name_a' of part 1"):
        treadle.combine_tools(("bad name_", Bare("a")))
    with pytest.raises(UsageError, match="at least one executor"):
        treadle.combine_tools()


def test_every_policy_question_is_answered_by_the_owner():
    local = Toolbox([send, lookup, save], default_timeout_s=7)
    bare = Bare("send")
    combined = treadle.combine_tools(local, ("bare_", bare))
    asked = {
        name: (
            combined.replay_policy(name),
            combined.requires_approval(name),
            combined.secret_arguments(name),
            combined.timeout_s(name),
            combined.writes(name),
        )
        for name in ("send", "lookup", "save", "bare_send", "nope")
    }
    assert asked == {
        "send": (NEVER, True, {"token"}, 3, None),
        "lookup": (SAFE, False, frozenset(), 7, None),
        "save": (NEVER, False, frozenset(), 7, "doc:{name}"),
        # an owner without the policy methods: the library's defaults (no own timeout)
        "bare_send": (NEVER, False, frozenset(), None, None),
        "nope": (NEVER, False, frozenset(), None, None),
    }
    assert combined.invalid_arguments("send", {"to": 1}) is not None
    assert combined.invalid_arguments("send", {"to": "a", "token": "t"}) is None
    assert combined.invalid_arguments("bare_send", {"anything": 1}) is None
    assert combined.invalid_arguments("nope", {}) == "unknown tool 'nope'"
    # the approval rule asks the combined executor, which asks the owner
    assert requires_approval(policies_of(combined), None, "send", {"to": "a", "token": "t"})
    assert not requires_approval(policies_of(combined), None, "bare_send", {})
    assert not requires_approval(
        policies_of(combined), None, "send", {"to": 1}
    )  # refused, not asked


def test_the_combined_executor_has_every_policy_method():
    """A method added to `ToolPolicies` must be routed too, or the combination would hide it."""
    wanted = {
        name
        for name, _ in inspect.getmembers(ToolPolicies, inspect.isfunction)
        if not name.startswith("_")
    }
    assert wanted == {
        "requires_approval",
        "secret_arguments",
        "invalid_arguments",
        "timeout_s",
        "writes",
        "image_source",
    }
    assert all(callable(getattr(treadle.CombinedTools, name, None)) for name in wanted)


async def test_calls_and_reconciles_go_to_the_owner_under_its_own_name():
    bare = Bare("send")
    combined = treadle.combine_tools(Toolbox([send]), ("bare_", bare))
    local = await combined.execute(_action("send", to="ann", token="t"))
    remote = await combined.execute(_action("bare_send", to="bob"))
    assert (local.observation, remote.observation) == ("sent to ann", "bare ran send")
    assert [a.tool for a in bare.seen] == ["send"]
    assert (await combined.reconcile(_action("send"))).observation == "reconciled send"
    assert await combined.reconcile(_action("bare_send")) is None
    unknown = await combined.execute(_action("nope"))
    assert unknown.status is ActionStatus.NOT_EXECUTED
    assert unknown.detail == "unknown tool 'nope'; the known tools are: send, bare_send"


def _agent(executor: Any) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[say("hi")]),
        executor=executor,
        parser=treadle.NativeToolCallParser(),
        model_name="scripted",
    )


def test_the_snapshot_covers_every_part_in_order():
    first, second = Toolbox([send]), Toolbox([save])
    combined = _agent(treadle.combine_tools(first, ("b_", second))).snapshot()
    assert [t["name"] for t in combined["tools"]] == ["send", "b_save"]
    assert combined["secret_arguments"] == {"send": ["token"]}
    assert "stale" in combined["synthetic"]  # a part writes a resource
    alone = _agent(first).snapshot()
    assert "stale" not in alone["synthetic"]
    assert combined["tools"][0] == alone["tools"][0]
    swapped = _agent(treadle.combine_tools(("b_", second), first)).snapshot()
    with pytest.raises(treadle.SnapshotMismatch, match="tools"):
        check_snapshot("r", combined, swapped)  # the order is part of the definition


async def test_a_stale_write_check_holds_across_parts():
    """A write tool of one part is refused until a read of any part reported the revision."""
    combined = treadle.combine_tools(Toolbox([lookup]), ("docs_", Toolbox([save])))
    refused = await combined.execute(_action("docs_save", name="a"))
    assert refused.status is ActionStatus.NOT_EXECUTED
    seen = Action(
        run_id="r",
        step=2,
        intent_id="r/s2/a1",
        call_id="c",
        tool="docs_save",
        arguments={"name": "a"},
        revisions={"doc:a": (4,)},
    )
    assert (await combined.execute(seen)).observation == "saved a over revision 4"


# --------------------------------------------------------------------------- with MCP


async def test_an_mcp_parts_policies_reach_the_snapshot_under_the_combined_names(tmp_path):
    server = mcp_server.make_server(str(tmp_path / "ledger"))
    options = {
        "charge": McpToolOptions(secret_arguments=("account",), requires_approval=True),
        "lookup": McpToolOptions(replay=SAFE, timeout_s=2),
    }
    async with open_mcp_tools(server, tools=options, include=["charge", "lookup"]) as remote:
        combined = treadle.combine_tools(Toolbox([send]), ("bank_", remote))
        snapshot = _agent(combined).snapshot()
        assert combined.requires_approval("bank_charge") and combined.requires_approval("send")
        assert (combined.replay_policy("bank_lookup"), combined.timeout_s("bank_lookup")) == (
            SAFE,
            2,
        )
        refused = combined.invalid_arguments("bank_charge", {"account": "a", "cents": 0})
    assert refused == "invalid arguments: cents: 0 is less than the minimum of 1"
    assert snapshot["secret_arguments"] == {"send": ["token"], "bank_charge": ["account"]}
    assert [t["name"] for t in snapshot["tools"]] == ["send", "bank_lookup", "bank_charge"]


async def test_the_combination_keeps_the_executor_contract(tmp_path):
    server = mcp_server.make_server(str(tmp_path / "ledger"))
    async with open_mcp_tools(server, include=["lookup", "tag"]) as remote:
        combined = treadle.combine_tools(Toolbox([lookup, send]), ("srv_", remote))
        sample = _action("srv_tag", item="x")
        await check_action_executor(combined, sample=sample)
        await check_action_executor(combined, sample=_action("lookup", key="k"))
        nested = treadle.combine_tools(combined, ("more_", Toolbox([save])))
        await check_action_executor(nested, sample=sample)
    assert [e["tool"] for e in read_ledger(tmp_path / "ledger")].count("tag") >= 2


async def test_two_sessions_of_one_server_clash_until_prefixed(tmp_path):
    server = mcp_server.make_server(str(tmp_path / "ledger"))
    async with (
        open_mcp_tools(server, include=["tag"]) as one,
        open_mcp_tools(server, include=["tag", "lookup"]) as two,
    ):
        with pytest.raises(UsageError, match=r"'tag' is offered by part 1 \(McpTools\) and by"):
            treadle.combine_tools(one, two)
        combined = treadle.combine_tools(("a_", one), ("b_", two))
        assert [s.name for s in combined.tool_specs()] == ["a_tag", "b_lookup", "b_tag"]
        assert combined.timeout_s("b_tag") == two.timeout_s("tag") == 30
        assert (await combined.execute(_action("b_tag", "k-b", item="y"))).observation == (
            "tagged y"
        )
    assert [(e["tool"], e["key"]) for e in read_ledger(tmp_path / "ledger")] == [("tag", "k-b")]


# --------------------------------------------------------------------------- runs and crashes

RUN = "Note that acme pays, and charge acme 250 cents."


def _mixed_agent(executor: Any) -> treadle.Agent:
    """One step calls the local ``note`` and the MCP ``bank_charge`` together, then answers."""
    return treadle.Agent(
        model=ScriptedModel(
            turns=[
                calls(
                    ToolCall(id="c1", name="note", arguments={"text": "acme pays"}),
                    ToolCall(
                        id="c2", name="bank_charge", arguments={"account": "acme", "cents": 250}
                    ),
                ),
                say("done"),
            ]
        ),
        executor=executor,
        parser=treadle.NativeToolCallParser(),
        model_name="scripted",
        system_prompt="You note and charge.",
    )


async def _run_mixed(
    url: str, store: Any, run_id: str, local: Path, *, wrap: Any = None
) -> treadle.RunResult:
    options = {"charge": McpToolOptions(timeout_s=20)}
    async with open_mcp_tools(url, prefix="bank_", tools=options) as bank:
        executor: Any = treadle.combine_tools(local_tools(local), bank)
        if wrap is not None:
            executor = wrap(executor)
        return await treadle.run(
            _mixed_agent(executor), RUN, store=store, run_id=run_id, owner="mixed"
        )


def _by_call(log: RunLog) -> dict[str, ActionResult]:
    return {r.call_id: r for r in log.records if isinstance(r, ActionResult)}


async def test_one_step_calls_a_local_and_an_mcp_tool(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with http_server(remote) as (url, _):
        async with open_store("sqlite", tmp_path / "runs.db") as store:
            result = await _run_mixed(url, store, "run-mixed", local)
            log = await store.read_log("run-mixed")
    assert result.final_answer == "done"
    results = _by_call(log)
    assert (results["c1"].tool, results["c1"].outcome.observation) == ("note", "noted acme pays")
    assert (results["c2"].tool, results["c2"].outcome.observation) == (
        "bank_charge",
        "charged 250 cents to acme",
    )
    intents = {r.call_id: r.intent_id for r in log.records if isinstance(r, ActionIntent)}
    assert [e["key"] for e in read_ledger(local)] == [intents["c1"]]
    assert [(e["tool"], e["key"]) for e in read_ledger(remote)] == [("charge", intents["c2"])]
    assert [t["name"] for t in log.started.snapshot["tools"]] == [
        "note",
        "bank_lookup",
        "bank_charge",
        "bank_tag",
        "bank_refuse",
        "bank_chart",
        "bank_hang",
    ]


async def _crashes(running: Awaitable[object]) -> None:
    """Await a run that must die of its simulated crash (it leaves the MCP block in a group)."""
    crashed = False
    try:
        await running
    except* (treadle.RunInterrupted, SimulatedCrash):
        crashed = True
    assert crashed, "the run finished without crashing"


async def _count_writes(url: str, tmp_path: Path) -> int:
    """How many store writes the uninterrupted run makes."""
    async with open_store("sqlite", tmp_path / "count.db") as store:
        counting = CrashingStore(inner=store, crash_at=10**9)
        await _run_mixed(url, counting, "run-count", tmp_path / "count-local")
    return counting.writes


async def _crash_then_resume(url: str, tmp_path: Path, name: str, crash: Any) -> set[str]:
    """Crash the run as ``crash(store) -> (store, wrap)`` says, resume it, check the ledgers.

    Returns what resume did: ``"reconciled"`` (the local call), ``"unknown"`` (the MCP call).
    """
    local, db = tmp_path / f"{name}.local", tmp_path / f"{name}.db"
    remote_before = len(read_ledger(tmp_path / "remote"))
    async with open_store("sqlite", db) as store:
        crashing, wrap = crash(store)
        await _crashes(_run_mixed(url, crashing, name, local, wrap=wrap))
    async with open_store("sqlite", db) as store:
        survived = await store.read_log(name)
        result = await _run_mixed(url, store, name, local)  # a new MCP session
        log = await store.read_log(name)
    assert result.state.value == "succeeded", name
    intents = {r.call_id: r.intent_id for r in log.records if isinstance(r, ActionIntent)}
    remote = [
        e for e in read_ledger(tmp_path / "remote")[remote_before:] if e["key"] in intents.values()
    ]
    # nothing ran twice, and nothing ran without its durable intent
    for entries in (read_ledger(local), remote):
        keys = [e["key"] for e in entries]
        assert len(keys) == len(set(keys)), f"{name}: ran twice: {keys}"
        assert set(keys) <= set(intents.values()), f"{name}: ran without an intent"
    results = _by_call(log)
    assert set(results) == {"c1", "c2"}, name
    done = {r.call_id for r in survived.records if isinstance(r, ActionResult)}
    for call_id, ran in (("c1", read_ledger(local)), ("c2", remote)):
        outcome = results[call_id].outcome
        if call_id in done or outcome.status is ActionStatus.EXECUTED:
            assert len(ran) == 1, f"{name}: {call_id} executed, so it ran once"
        else:  # resume did not send it again: unknown
            assert outcome.status is ActionStatus.UNKNOWN, name
    # the local part's reconcile hook answered for its own interrupted call only
    if results["c1"].reconciled:
        assert results["c1"].outcome.observation == "noted acme pays"
    assert not results["c2"].reconciled  # the MCP part has no hook: never asked the local one
    did = {"reconciled"} if results["c1"].reconciled else set()
    return did | ({"unknown"} if results["c2"].outcome.status is ActionStatus.UNKNOWN else set())


async def test_crashes_at_every_write_and_in_each_call_resume_without_repeating(tmp_path):
    with http_server(tmp_path / "remote") as (url, _):
        writes = await _count_writes(url, tmp_path)
        assert writes >= 8
        did: set[str] = set()
        for at in range(1, writes + 1):
            for when in ("before", "after"):

                def at_write(store: Any, at: int = at, when: Any = when) -> tuple[Any, None]:
                    return CrashingStore(inner=store, crash_at=at, when=when), None

                did |= await _crash_then_resume(url, tmp_path, f"store-{when}-{at}", at_write)
        for at in (1, 2):
            for when in ("before", "after"):

                def in_call(store: Any, at: int = at, when: Any = when) -> tuple[Any, Any]:
                    crashing = CrashingStore(inner=store, crash_at=10**9)

                    def wrap(executor: Any) -> Any:
                        return CrashingExecutor(
                            inner=executor, crash_at=at, when=when, store=crashing
                        )

                    return crashing, wrap

                did |= await _crash_then_resume(url, tmp_path, f"call-{when}-{at}", in_call)
    assert did == {"reconciled", "unknown"}  # some crashes left both calls unresolved


async def test_a_crash_after_both_calls_ran_reconciles_the_local_one_only(tmp_path):
    """Both calls of the step ran, then the process died before either result was stored:
    resume asks the local part's hook (it finds its ledger entry) and sends nothing to the
    server again (its ``never`` call is unknown)."""
    local, db = tmp_path / "local", tmp_path / "runs.db"
    with http_server(tmp_path / "remote") as (url, _):
        async with open_store("sqlite", db) as store:
            crashing = CrashingStore(inner=store, crash_at=10**9)
            done: list[str] = []

            def wrap(executor: Any) -> Any:
                return _DieAfterBoth(executor, crashing, done)

            await _crashes(_run_mixed(url, crashing, "run-both", local, wrap=wrap))
        assert sorted(done) == ["bank_charge", "note"]
        async with open_store("sqlite", db) as store:
            await _run_mixed(url, store, "run-both", local)
            log = await store.read_log("run-both")
    results = _by_call(log)
    assert results["c1"].reconciled
    assert results["c1"].outcome.observation == "noted acme pays"
    assert results["c2"].outcome.status is ActionStatus.UNKNOWN
    assert len(read_ledger(local)) == 1
    assert [e["tool"] for e in read_ledger(tmp_path / "remote")] == ["charge"]


class _DieAfterBoth:
    """Runs both calls of the step to their end, then kills the store before any result."""

    def __init__(self, inner: Any, store: CrashingStore, done: list[str]) -> None:
        self.inner, self.store, self.done = inner, store, done
        self.both = trio.Event()

    def tool_specs(self) -> Any:
        return self.inner.tool_specs()

    def replay_policy(self, tool: str) -> ReplayPolicy:
        return self.inner.replay_policy(tool)  # type: ignore[no-any-return]

    async def execute(self, action: Action) -> ActionOutcome:
        await self.inner.execute(action)
        self.done.append(action.tool)
        if len(self.done) == 2:
            self.store.crash()
            self.both.set()
        await self.both.wait()  # bounded: the other call of the step ends too
        raise SimulatedCrash("the process died with both calls done")

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        return await self.inner.reconcile(action)  # type: ignore[no-any-return]


def _kill_mixed_driver(store: Path, run_id: str, ledger: Path, local: Path) -> None:
    """Start the mixed driver (stdio server), wait until its step's local call has run and its
    MCP call is in flight (both say so on the driver's stderr), SIGKILL it."""
    args = [sys.executable, "-m", "tests.fixtures.mcp_driver", str(store), run_id, "stdio"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    driver = subprocess.Popen(
        [*args, str(ledger), f"--mixed={local}"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stderr is not None
        waiting = {"NOTED", "IN FLIGHT"}
        for line in driver.stderr:  # bounded: the tools write the lines, or the stream ends
            waiting -= {w for w in waiting if line.startswith(w + " ")}
            if not waiting:
                break
        else:
            pytest.fail(f"the step never got both calls going: {waiting} missing")
        driver.send_signal(signal.SIGKILL)
        assert driver.wait() == -signal.SIGKILL
    finally:
        driver.kill()
        driver.wait()
        if driver.stderr is not None:
            driver.stderr.close()


async def test_a_killed_process_resumes_a_mixed_step_without_repeating_either_call(tmp_path):
    """A real SIGKILL while the step's MCP call is in flight and its local call is done:
    the resumed run (a new process's view, a new session) asks the local part's hook and
    sends nothing to the server again."""
    ledger, local, store = tmp_path / "ledger", tmp_path / "local", tmp_path / "runs.db"
    try:
        _kill_mixed_driver(store, "run-mixed-kill", ledger, local)
        assert [e["tool"] for e in read_ledger(ledger)] == ["hang"]
        assert len(read_ledger(local)) == 1
        await drive(str(store), "run-mixed-kill", stdio_server(ledger), local=local)
        async with open_store("sqlite", store) as reopened:
            log = await reopened.read_log("run-mixed-kill")
    finally:
        for entry in read_ledger(ledger):  # the killed driver's server may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.kill(entry["pid"], signal.SIGKILL)
    assert log.finished is not None and log.finished.state.value == "succeeded"
    results = _by_call(log)
    assert results["c1"].reconciled and results["c1"].outcome.observation == "noted j1 started"
    assert results["c2"].outcome.status is ActionStatus.UNKNOWN
    assert not results["c2"].reconciled
    intents = {r.call_id: r.intent_id for r in log.records if isinstance(r, ActionIntent)}
    assert [e["key"] for e in read_ledger(local)] == [intents["c1"]]
    assert [(e["tool"], e["key"]) for e in read_ledger(ledger)] == [("hang", intents["c2"])]
