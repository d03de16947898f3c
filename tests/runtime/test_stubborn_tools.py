"""Tools that ignore cancellation cannot hold a run past its budget, its timeout or a cancel.

A plain ``def`` tool runs in a worker thread the run abandons; an ``async def`` tool that
blocks in a thread or shields a long cleanup runs in the tool host and is abandoned there; a
process tool is killed. Every action intent of a finished log has exactly one result, an
abandoned call's is UNKNOWN and late, and what a call returns after that is a diagnostic.

"The run ended before the tool did" is measured by the tool's own markers (a
`threading.Event`, a `trio.Event` never set, a file written after a sleep), never by the
wall clock; the trio clock is virtual except where a child process is involved.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import outcome
import pytest
import trio
import trio.testing
from held_process_tool import held
from process_tools import (
    Scaler,
    deadline_left,
    deadline_left_async,
    double,
    effect_then_killed,
    fail,
    fail_unprintably,
    fork_and_return,
    fork_chain,
    link_of_a_group,
    return_unreadable,
    running,
    scaler,
    slow_write,
    spawn_and_wait,
    spawn_in_own_group,
    stale_write,
    whoami,
)
from runtime_fakes import LedgerTools, SimpleParser

import treadle
import treadle.tools
from treadle import _toolproc
from treadle._exceptions import UsageError, raised
from treadle._toolhost import host_statistics
from treadle.actors import CANCEL_GRACE_S
from treadle.agent import Agent
from treadle.approvals import request_cancel
from treadle.stores.memory import MemoryStore
from treadle.supervisors import finish_cancelled, open_run
from treadle.testing.invariants import check_action_results, check_invariants
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.tools import Tool, Toolbox, tool
from treadle.types import (
    Action,
    ActionIntent,
    ActionResult,
    ActionStatus,
    Budgets,
    Limits,
    RunLog,
    RunState,
    StopReason,
    ToolCall,
)

REAL_WAIT_S = 20.0
"""Real seconds a blocked thread waits at most (it is released at the end of each test)."""


def make_agent(turns, tools: list[Tool], **kwargs) -> Agent:
    model = ScriptedModel(turns=turns)
    return Agent(model=model, executor=Toolbox(tools), parser=SimpleParser(), **kwargs)


def _action(tool: str, arguments: dict[str, Any]) -> Action:
    """The one call of step 1 of run ``r`` (call id ``c``): ``tool`` with ``arguments``."""
    return Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool=tool, arguments=arguments
    )


def results_of(log: RunLog) -> list[ActionResult]:
    return [r for r in log.records if isinstance(r, ActionResult)]


class Blocker:
    """Tools that block in a thread until released: ``sync`` a plain ``def`` (abandonable),
    ``async`` an ``async def`` awaiting a thread that ignores cancellation."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finished = threading.Event()

        def block_sync(note: str) -> str:
            """Block until released."""
            self.release.wait(REAL_WAIT_S)
            self.finished.set()
            return "released"

        async def block_async(note: str) -> str:
            """Block in a thread that ignores cancellation until released."""
            await trio.to_thread.run_sync(self.release.wait, REAL_WAIT_S)
            self.finished.set()
            return "released"

        self.tools = {
            "sync": tool(name="block")(block_sync),
            "async": tool(name="block")(block_async),
        }


@pytest.fixture
async def blocker():
    """Released before the test's trio run ends (it waits for a thread nobody can cancel)."""
    found = Blocker()
    yield found
    found.release.set()


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_blocked_call_cannot_hold_the_run_past_its_time_budget(
    kind, blocker, autojump_clock
):
    agent = make_agent(
        [call("block", note="x", call_id="c1"), say("never")],
        [blocker.tools[kind]],
        budgets=Budgets(time_budget_s=3),
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    assert not blocker.finished.is_set()  # the run returned while the tool still blocks
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert result.totals.active_s == pytest.approx(3.0)
    log = await store.read_log("r")
    (cut,) = results_of(log)
    assert cut.late and cut.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log, budgets=agent.budgets) == []


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_blocked_call_is_abandoned_at_its_timeout_and_the_run_goes_on(
    kind, blocker, autojump_clock
):
    slow = attrs.evolve(blocker.tools[kind], timeout_s=2)
    agent = make_agent([call("block", note="x", call_id="c1"), say("went on")], [slow])
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    assert not blocker.finished.is_set()
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.final_answer == "went on"
    log = await store.read_log("r")
    (abandoned,) = results_of(log)
    assert abandoned.late and abandoned.outcome.status is ActionStatus.UNKNOWN
    observation = log.steps[0].observations[0]
    assert "timed out after 2 s and was abandoned" in observation
    assert check_invariants(log) == []


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_cancel_during_a_blocked_call_ends_the_run_within_the_grace_period(
    kind, blocker, autojump_clock
):
    agent = make_agent([call("block", note="x", call_id="c1"), say("never")], [blocker.tools[kind]])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(1)
        handle.cancel("stop")
        asked = trio.current_time()
        result = await handle.wait()
        took = trio.current_time() - asked  # virtual seconds
    assert not blocker.finished.is_set()
    assert result.state is RunState.CANCELLED
    assert took <= CANCEL_GRACE_S + 0.01
    log = await store.read_log("r")
    (cut,) = results_of(log)
    assert cut.late and cut.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_cancel_during_a_blocked_call_does_not_carry_the_run_past_its_time_budget(
    kind, blocker, autojump_clock
):
    # The cancel comes 1 s before the budget runs out: its 2 s grace ends at the budget.
    agent = make_agent(
        [call("block", note="x", call_id="c1"), say("never")],
        [blocker.tools[kind]],
        budgets=Budgets(time_budget_s=3),
    )
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(2)
        handle.cancel("stop")
        result = await handle.wait()
    assert not blocker.finished.is_set()
    assert result.state is RunState.CANCELLED
    assert result.totals.active_s <= 3.0 + 0.01  # virtual seconds
    log = await store.read_log("r")
    (cut,) = results_of(log)
    assert cut.late and cut.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log, budgets=agent.budgets) == []


async def test_a_shielded_cleanup_does_not_hold_treadle_run_and_its_late_return_is_no_record(
    autojump_clock, caplog
):
    may_end = trio.Event()  # set only after the run returned
    cleanup = {"began": False, "ended": False}

    @tool
    async def careful(note: str) -> str:
        """Sleep; when cancelled, clean up (shielded) until allowed, then return anyway."""
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                cleanup["began"] = True
                await may_end.wait()
                cleanup["ended"] = True
            return "cleaned up"
        return "slept"

    agent = make_agent([call("careful", note="x", call_id="c1"), say("never")], [careful])
    store = MemoryStore()
    returned = trio.Event()
    outcome: list[treadle.RunResult] = []
    late_before = host_statistics().late_returns

    async def drive() -> None:
        outcome.append(await treadle.run(agent, "x", store=store, run_id="r"))
        returned.set()

    caplog.set_level(logging.WARNING, logger="treadle.tools")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive)
        try:
            await trio.sleep(1)
            await request_cancel(store, "r", reason="stop")
            with trio.fail_after(60):
                await returned.wait()
            # treadle.run returned while the cleanup still waits on an event nobody set.
            assert cleanup == {"began": True, "ended": False}
        finally:
            may_end.set()
    assert outcome[0].state is RunState.CANCELLED
    await trio.sleep(1)  # the straggler ends in the tool host
    assert cleanup["ended"]
    assert host_statistics().late_returns == late_before + 1
    assert any("returned 'cleaned up'" in r.getMessage() for r in caplog.records)
    log = await store.read_log("r")
    (cut,) = results_of(log)  # its late return is no second record
    assert cut.late and cut.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


async def test_hung_thread_tools_leave_trio_threads_free_and_are_counted(
    blocker, autojump_clock, caplog
):
    """Forty hung plain-def calls took every place of trio's default thread limiter: later
    thread tools of other runs never started, opening a SQLite store hung, and
    `host_statistics` showed nothing running."""
    hung = attrs.evolve(blocker.tools["sync"], timeout_s=1)
    many = [ToolCall(id=f"c{i}", name="block", arguments={"note": str(i)}) for i in range(40)]
    agent = make_agent([calls(*many), say("went on")], [hung])
    before = host_statistics()
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="a")
    assert all(
        r.outcome.status is ActionStatus.UNKNOWN for r in results_of(await store.read_log("a"))
    )
    assert host_statistics().stray_threads == before.stray_threads + 40
    assert trio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
    assert await trio.to_thread.run_sync(lambda: "a store's thread") == "a store's thread"

    caplog.set_level(logging.WARNING, logger="treadle.tools")
    blocker.release.set()
    for _ in range(6000):  # each end is reported from its thread: nothing to wait on here
        now = host_statistics()
        reported = sum("returned 'released'" in r.getMessage() for r in caplog.records)
        if now.stray_threads == before.stray_threads and reported == 40:
            break
        # real time for the threads to end (trio's virtual clock would jump past them)
        await trio.to_thread.run_sync(time.sleep, 0.02)
    assert host_statistics().late_returns == before.late_returns + 40
    assert sum("returned 'released'" in r.getMessage() for r in caplog.records) == 40


async def test_a_thread_tool_that_gets_no_place_in_time_never_runs(
    blocker, autojump_clock, monkeypatch
):
    monkeypatch.setattr(treadle.tools, "TOOL_THREADS", 1)
    ran: list[str] = []

    @tool(timeout_s=1)
    def quick(note: str) -> str:
        """Return at once."""
        ran.append(note)
        return "quick"

    hung = attrs.evolve(blocker.tools["sync"], timeout_s=1)
    agent = make_agent(
        [call("block", note="x", call_id="c1"), call("quick", note="y", call_id="c2"), say("ok")],
        [hung, quick],
    )
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="r")
    _, waited = results_of(await store.read_log("r"))
    assert waited.outcome.status is ActionStatus.NOT_EXECUTED
    assert "no thread tool place came free within the timeout: all 1 were taken" in (
        waited.outcome.detail or ""
    )
    blocker.release.set()
    await trio.to_thread.run_sync(blocker.finished.wait, REAL_WAIT_S)
    await trio.sleep(1)
    assert ran == []  # it was given up before it began: it never starts


async def test_finish_cancelled_gives_a_pending_intent_its_unknown_result(blocker, autojump_clock):
    agent = make_agent(
        [call("block", note="x", call_id="c1"), say("never")], [blocker.tools["sync"]]
    )
    store = MemoryStore()
    with trio.move_on_after(1):  # the driver goes away mid-call: the run stays unfinished
        await treadle.run(agent, "x", store=store, run_id="r", owner="gone")
    before = await store.read_log("r")
    assert before.finished is None
    assert [r.intent_id for r in before.records if isinstance(r, ActionIntent)] == ["r/s1/a1"]
    assert results_of(before) == []
    result = await finish_cancelled(store, "r", owner="canceller", reason="nobody drives it")
    assert result.state is RunState.CANCELLED
    log = await store.read_log("r")
    (unknown,) = results_of(log)
    assert unknown.intent_id == "r/s1/a1" and unknown.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


# --------------------------------------------------------------- process tools


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    return tmp_path


async def check_killed(folder: Path) -> None:
    """The child never got past its 60 s sleep, and it is gone (reaped by the tool host)."""
    assert not (folder / "done").exists()
    started = folder / "started"
    if started.exists():  # it may have been killed before it began (a slow start)
        pid = int(started.read_text())
        for _ in range(int(REAL_WAIT_S / 0.05)):  # polled: nothing signals a reaped child
            if not _alive(pid):
                break
            await trio.sleep(0.05)
        assert not _alive(pid)
    assert not (folder / "done").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_process_tool_runs_in_a_child_process():
    agent = make_agent(
        [call("double", n=21, call_id="c1"), call("fail", message="no", call_id="c2"), say("ok")],
        [double, fail],
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    assert result.final_answer == "ok"
    log = await store.read_log("r")
    first, second = results_of(log)
    assert (first.outcome.status, first.outcome.observation) == (ActionStatus.EXECUTED, "42")
    assert second.outcome.observation == "Error: ValueError: no"


async def test_a_process_tool_gets_its_context_without_the_runs_callables():
    """The context of a call made by a run holds callables of the run's process (its child
    runs' event forwarding, its cancel): the child process gets the rest."""
    agent = make_agent([call("whoami", call_id="c1"), say("ok")], [whoami])
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="r")
    (called,) = results_of(await store.read_log("r"))
    assert called.outcome.observation == "r/s1/a1 None None"


async def test_a_process_tool_is_killed_at_its_timeout(markers):
    slow = attrs.evolve(slow_write, timeout_s=3)
    agent = make_agent(
        [call("slow_write", directory=str(markers), seconds=60, call_id="c1"), say("went on")],
        [slow],
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    await check_killed(markers)
    assert result.final_answer == "went on"
    log = await store.read_log("r")
    (killed,) = results_of(log)
    timed_out = "Error: the call to slow_write timed out after 3 s (its process was killed)"
    if (markers / "started").exists():  # its function ran: killed at its timeout
        assert killed.outcome.observation == timed_out
    else:  # a start slower than 3 s (a loaded machine): maybe killed before it began
        assert killed.outcome.observation == timed_out or (
            killed.outcome.status is ActionStatus.NOT_EXECUTED
            and "before the tool's function began" in killed.outcome.observation
        ), killed.outcome
    assert check_invariants(log) == []


async def test_a_process_tools_own_processes_are_killed_with_it(markers):
    # Only the tool's process got SIGKILL: a process it started ran on and made its effect.
    spawner = attrs.evolve(spawn_and_wait, timeout_s=3)
    agent = make_agent(
        [call("spawn_and_wait", directory=str(markers), call_id="c1"), say("went on")],
        [spawner],
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    assert result.final_answer == "went on"
    await check_killed(markers)  # ``started`` holds the grandchild's pid


async def test_a_process_tools_processes_in_a_group_of_their_own_are_killed_with_it(markers):
    """A command the tool started in a process group of its own (coreutils ``timeout``,
    ``Popen(process_group=0)``) stays in the call's session and dies with the call, and so
    does its own child, none of them seeing another die. Before, only the call's process
    group was killed: the command ran on and made its effect after the call had ended."""
    action = _action("spawn_in_own_group", {"directory": str(markers)})
    started = markers / "started"
    with trio.fail_after(REAL_WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Toolbox([spawn_in_own_group]).execute, action)
            while not started.exists():  # noqa: ASYNC110 (the tool signals nothing else)
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    for pid in [int(pid) for pid in started.read_text().split()]:
        for _ in range(int(REAL_WAIT_S / 0.05)):
            if not _alive(pid):
                break
            await trio.sleep(0.05)
        assert not _alive(pid), f"process {pid} of the call outlived its kill"
    assert sorted(p.name for p in markers.iterdir()) == ["started"]


@pytest.mark.parametrize("name", ["spawn_then_sleep", "spawn_in_own_group"])
def test_a_process_tool_dies_with_its_driver_killed_mid_call(markers, name):
    """The driver is SIGKILLed while its process tool sleeps: the tool's process and the
    processes it started die too, also those in a process group of their own. Before, they
    ran on (their parent gone, nothing tied them to it) and made their effect after the kill,
    so a resume that reconciled the call as never done performed a ``never`` action twice."""
    driver = Path(__file__).with_name("process_tool_driver.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, str(driver), str(markers), name], env=env)
    try:
        started = markers / "started"
        for _ in range(int(REAL_WAIT_S / 0.05)):  # polled: the driver signals nothing else
            if started.exists() and len(started.read_text().split()) == 2:
                break
            assert process.poll() is None, "the driver ended before its tool started"
            time.sleep(0.05)
        pids = [int(pid) for pid in started.read_text().split()]
    finally:
        process.kill()
        process.wait()
    for pid in pids:
        for _ in range(int(REAL_WAIT_S / 0.05)):
            if not _alive(pid):
                break
            time.sleep(0.05)
        assert not _alive(pid), f"process {pid} of the call outlived its driver"
    assert sorted(p.name for p in markers.iterdir()) == ["started"]


async def test_a_process_tool_killed_by_a_signal_has_an_unknown_outcome(markers):
    """Its effect may have happened before the kill: it was EXECUTED with an ordinary error
    (``ToolProcessFailed``), and the model could retry it."""
    agent = make_agent(
        [call("effect_then_killed", directory=str(markers), call_id="c1"), say("ok")],
        [effect_then_killed],
    )
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="r")
    assert (markers / "done").exists()
    log = await store.read_log("r")
    (killed,) = results_of(log)
    assert killed.outcome.status is ActionStatus.UNKNOWN
    assert not killed.late  # the run waited for it: the model was given this observation
    assert killed.outcome.observation == (
        "Error: the call to effect_then_killed failed: its process was killed by signal 9 "
        "before it reported its result; its outcome is unknown. Check its effect before "
        "trying again."
    )
    assert check_invariants(log) == []


async def test_a_process_tool_leaving_a_background_process_returns_its_result(markers):
    """The forked process held the reply pipe open: the result never arrived and the call
    was recorded as timed out."""
    agent = make_agent(
        [call("fork_and_return", directory=str(markers), call_id="c1"), say("ok")],
        [fork_and_return],
    )
    store = MemoryStore()
    try:
        await treadle.run(agent, "x", store=store, run_id="r")
    finally:
        background = markers / "background"
        if background.exists():
            os.kill(int(background.read_text()), signal.SIGKILL)
    (returned,) = results_of(await store.read_log("r"))
    assert (returned.outcome.status, returned.outcome.observation) == (
        ActionStatus.EXECUTED,
        "returned",
    )


def test_a_process_tool_of_the_script_being_run_is_refused_when_declared():
    # The child process is a `__main__` of its own: every call failed with AttributeError.
    def double(n: int) -> int:
        """Twice n."""
        return 2 * n

    double.__module__ = "__main__"
    double.__qualname__ = "double"
    with pytest.raises(UsageError, match="not in the script being run"):
        treadle.tool(isolation="process")(double)


def test_a_method_bound_to_an_instance_is_refused_as_a_process_tool():
    """The child finds ``Scaler.scale`` without the instance: every call failed with a
    missing ``self``. A classmethod is found bound to its class, and is fine."""
    with pytest.raises(UsageError, match="bound to an instance"):
        treadle.tool(isolation="process")(scaler.scale)
    assert treadle.tool(isolation="process")(Scaler.offset).isolation == "process"


async def test_a_process_tools_deadline_is_on_its_own_processs_clock():
    """A trio clock is per trio run: the run's deadline, read on the child's clock, was off
    by tens of thousands of seconds."""
    agent = make_agent(
        [
            calls(
                ToolCall(id="c1", name="deadline_left_async", arguments={}),
                ToolCall(id="c2", name="deadline_left", arguments={}),
            ),
            say("ok"),
        ],
        [deadline_left_async, deadline_left],
        budgets=Budgets(time_budget_s=60),
    )
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="r")
    for result in results_of(await store.read_log("r")):
        assert result.outcome.status is ActionStatus.EXECUTED
        assert 0 < float(result.outcome.observation) <= 60


async def test_a_process_tool_whose_module_the_child_cannot_import_never_started(tmp_path):
    """Loaded here from a file off ``sys.path``, the tool's module does not import in the
    child: the function never ran. It was EXECUTED with a ModuleNotFoundError."""
    source = tmp_path / "only_here_tools.py"
    source.write_text(
        "import treadle\n\n\n"
        "@treadle.tool(isolation='process')\n"
        "def only_here(n: int) -> int:\n"
        '    """n."""\n'
        "    return n\n"
    )
    spec = importlib.util.spec_from_file_location("only_here_tools", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    action = _action("only_here", {"n": 1})
    outcome = await Toolbox([module.only_here]).execute(action)
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.detail == (
        "the call to only_here did not start: its process could not load the tool: "
        "ModuleNotFoundError: No module named 'only_here_tools'"
    )


async def test_a_process_call_killed_before_its_function_began_never_started(tmp_path, monkeypatch):
    """The child cannot load the tool before the timeout (its module waits for a file that
    never comes), so the timeout kills it before the function began. It was recorded as
    EXECUTED, timed out, as though the function had run."""
    monkeypatch.setenv("TREADLE_TEST_HOLD_IMPORT", str(tmp_path / "never"))
    action = _action("held", {"n": 1})
    with trio.fail_after(REAL_WAIT_S):
        outcome = await Toolbox([held]).execute(action)
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.observation == (
        "the call to held did not start within 2 s: its process was killed while it started, "
        "before the tool's function began"
    )


async def test_a_process_tool_whose_interpreter_prints_as_it_starts_returns_its_result(
    tmp_path, monkeypatch, capfd
):
    """A ``sitecustomize`` on the child's path prints while its interpreter starts. The print
    went ahead of the began mark on the channel the reply came back on: a call that ran to
    its end was recorded NOT_EXECUTED, as though its function never began, and a retry would
    have run it twice."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('site customized')\n")
    monkeypatch.syspath_prepend(str(site))  # the child's PYTHONPATH is this process's path
    action = _action("double", {"n": 21})
    with trio.fail_after(REAL_WAIT_S):
        outcome = await Toolbox([double]).execute(action)
    assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, "42")
    assert "site customized" in capfd.readouterr().out  # it did print, as it starts


async def _cancel_once_started(tool: Tool, folder: Path) -> None:
    """Call ``tool`` with ``directory=folder`` and cancel the call once it wrote ``started``."""
    action = _action(tool.name, {"directory": str(folder)})
    with trio.fail_after(REAL_WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Toolbox([tool]).execute, action)
            while not (folder / "started").exists():  # noqa: ASYNC110 (it signals nothing else)
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


async def test_a_process_tools_fork_chain_is_killed_with_it(markers):
    """Each process of the chain forks the next and exits: the kill looked for the session's
    processes again for as long as each look found a new one, on the trio loop, for seconds;
    the process group of the session's leader is now stopped at once."""
    await _cancel_once_started(fork_chain, markers)
    session = int((markers / "started").read_text())
    try:
        for _ in range(int(REAL_WAIT_S / 0.05)):  # polled: nothing signals a reaped process
            if not list(_toolproc._members(session)):
                break
            await trio.sleep(0.05)
        assert list(_toolproc._members(session)) == []
    finally:  # a chain that escaped the kill stays in the group of the session's leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signal.SIGKILL)
    assert sorted(p.name for p in markers.iterdir()) == ["started"]


async def test_the_trio_loop_goes_on_while_a_process_tool_is_killed(markers, monkeypatch):
    """The kill looked for the session's processes in ``/proc`` on the trio loop: every run of
    the process stood still meanwhile (lease renewals included), for seconds with a process
    that forks fast. Here the kill waits for a trio task to run before it goes on."""
    in_kill = threading.Event()
    loop_ran = threading.Event()
    saw_the_loop: list[bool] = []
    kill_session = _toolproc.kill_session

    def waiting_kill(session: int) -> None:
        in_kill.set()
        saw_the_loop.append(loop_ran.wait(REAL_WAIT_S))
        kill_session(session)

    async def run_on_the_loop() -> None:
        await trio.to_thread.run_sync(in_kill.wait, REAL_WAIT_S)
        loop_ran.set()

    monkeypatch.setattr(_toolproc, "kill_session", waiting_kill)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_on_the_loop)
        await _cancel_once_started(spawn_and_wait, markers)
    assert saw_the_loop == [True]
    await check_killed(markers)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks in /proc (Linux)")
def test_a_kill_looks_for_the_sessions_processes_a_bounded_number_of_times(monkeypatch):
    """Each look finds a process not seen before (a fork chain outrunning the looks): the
    kill looked again for as long as that went on, here 1000 times."""
    looks = 0

    def members(session: int) -> list[_toolproc._Member]:
        nonlocal looks
        looks += 1
        # above any pid Linux hands out (at most 2**22): no process gets these signals
        pid = 2**23 + looks
        return [_toolproc._Member(pid, b"0", 1, pid)] if looks < 1000 else []

    monkeypatch.setattr(_toolproc, "_members", members)
    _toolproc.kill_session(2**23)
    assert looks < 1000
    assert looks == _toolproc._LOOKS


FAKE = 2**23
"""Above any pid Linux hands out (at most 2**22): no process gets the signals of a faked kill."""


def fake_session(monkeypatch, members: list[tuple[int, int, int]]) -> list[tuple[str, int]]:
    """Have `_toolproc.kill_session` find ``members`` (pid, parent, group), and record its
    SIGKILLs, in order: ``("group", id)`` sent with ``killpg``, ``("process", pid)``."""
    found = [_toolproc._Member(pid, b"0", parent, group) for pid, parent, group in members]
    monkeypatch.setattr(_toolproc, "_members", lambda session: found)
    sent: list[tuple[str, int]] = []

    def recorder(kind: str) -> Callable[[int, int], None]:
        def record(target: int, number: int) -> None:
            if number == signal.SIGKILL:
                sent.append((kind, target))

        return record

    monkeypatch.setattr(os, "kill", recorder("process"))
    monkeypatch.setattr(os, "killpg", recorder("group"))
    return sent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks in /proc (Linux)")
def test_a_kill_kills_each_group_whole_before_the_groups_of_its_parents(monkeypatch):
    """The session's leader (group L) starts a worker; the worker, a process leading group G
    and one in group J; the leader of G, one in group H; G also holds a process whose parent
    is outside the session (a ``nohup`` command started through a process that exited).
    Killed one by one, children first, G's leader, the only link of G to the session, died
    before that process and orphaned G: the kernel continued it (SIGHUP, SIGCONT), and it ran
    on until its own SIGKILL. Each group is now killed whole, below its parents'."""
    leader, worker, g, h, j, outsider = (FAKE + n for n in range(6))
    sent = fake_session(
        monkeypatch,
        [
            (leader, 1, leader),
            (worker, leader, leader),
            (g, worker, g),
            (outsider, 1, g),
            (h, g, h),
            (j, worker, j),
        ],
    )
    _toolproc.kill_session(leader)
    # the last: the session leader's group, killed again once all is done
    assert sent == [("group", group) for group in (h, j, g, leader, leader)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks in /proc (Linux)")
def test_a_kill_from_inside_the_session_kills_its_own_group_last_children_first(monkeypatch):
    """The call's keeper kills its session when its driver dies: it spares its own group
    (itself in it), and kills the group's other processes one by one after every other
    group, children before their parents: a parent killed first orphans its child's stopped
    process group, and the kernel continues it."""
    chain = [FAKE + n for n in (5, 2, 7, 1, 8, 3, 6, 4)]  # each the parent of the next
    parent_of = dict(zip(chain[1:], chain[:-1], strict=True)) | {chain[0]: 1}
    own = [(pid, parent_of[pid], chain[0]) for pid in chain]
    below = FAKE + 9  # a group of its own, started by the chain's middle
    sent = fake_session(monkeypatch, [*own, (below, chain[4], below)])
    monkeypatch.setattr(os, "getsid", lambda pid: chain[0])
    monkeypatch.setattr(os, "getpgrp", lambda: chain[0])
    monkeypatch.setattr(os, "getpid", lambda: chain[0])
    _toolproc.kill_session(chain[0])
    assert sent == [("group", below), *(("process", pid) for pid in chain[:0:-1])]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks in /proc (Linux)")
def test_a_kill_of_groups_holding_each_others_parents_kills_processes_children_first(
    monkeypatch,
):
    """Group A holds the parent of a process of group B, which holds the parent of a
    process moved into A: no order of the groups kills each below its parents' groups."""
    a, b, moved = FAKE + 1, FAKE + 2, FAKE + 3
    sent = fake_session(monkeypatch, [(a, 1, a), (b, a, b), (moved, b, a)])
    _toolproc.kill_session(FAKE)
    assert sent == [("process", moved), ("process", b), ("process", a), ("group", FAKE)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="looks in /proc (Linux)")
async def test_a_process_group_orphaned_by_the_kill_does_not_run_again(markers, monkeypatch):
    """A group's leader was its only link to the call (its watcher's parent is outside the
    session): the leader, killed before the watcher, orphaned the stopped group, the kernel
    continued it (SIGHUP, then SIGCONT), and the watcher, ignoring SIGHUP, ran on until its
    own SIGKILL came, saw the leader dead and acted. Here the kill waits, once it has killed
    the leader, until the watcher has acted or died: the watcher dies with its leader."""
    started = markers / "started"
    killed_the_leader = threading.Event()

    def settled(watcher: int) -> None:
        for _ in range(int(REAL_WAIT_S / 0.01)):  # polled: nothing signals either
            if (markers / "acted").exists() or not running(watcher):
                return
            time.sleep(0.01)

    def waiting(send: Callable[[int, int], None]) -> Callable[[int, int], None]:
        def sent(target: int, number: int) -> None:
            send(target, number)
            if number != signal.SIGKILL or not started.exists():
                return
            watcher, leader = (int(pid) for pid in started.read_text().split())
            if target == leader:  # the leader as a process, or its group
                killed_the_leader.set()
                settled(watcher)

        return sent

    monkeypatch.setattr(os, "kill", waiting(os.kill))
    monkeypatch.setattr(os, "killpg", waiting(os.killpg))
    action = _action("link_of_a_group", {"directory": str(markers)})
    with trio.fail_after(REAL_WAIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Toolbox([link_of_a_group]).execute, action)
            while not started.exists():  # noqa: ASYNC110 (the tool signals nothing else)
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert killed_the_leader.is_set()
    watcher = int(started.read_text().split()[0])
    for _ in range(int(REAL_WAIT_S / 0.05)):  # polled: nothing signals its end (init reaps it)
        if not running(watcher):
            break
        await trio.sleep(0.05)
    assert not running(watcher)
    assert sorted(p.name for p in markers.iterdir()) == ["started"]


async def test_a_process_tools_error_whose_message_cannot_be_read_is_its_error(markers):
    """As a thread tool's is. The child crashed writing its reply, and the call was UNKNOWN."""
    action = _action("fail_unprintably", {"directory": str(markers)})
    outcome = await Toolbox([fail_unprintably]).execute(action)
    assert (markers / "done").exists()
    assert (outcome.status, outcome.observation) == (
        ActionStatus.EXECUTED,
        "Error: Unprintable: (its message could not be read: RuntimeError)",
    )


async def test_a_process_tools_result_that_cannot_be_read_back_is_its_error(markers):
    """The whole reply arrived but does not unpickle here: the call ran to its end. It was
    taken for a reply cut off by the process's death, UNKNOWN."""
    action = _action("return_unreadable", {"directory": str(markers)})
    outcome = await Toolbox([return_unreadable]).execute(action)
    assert (markers / "done").exists()
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation == (
        "Error: the result of return_unreadable could not be read back from its process: "
        "TypeError: TwoPart.__init__() missing 1 required positional argument: 'second'"
    )


@tool(name="nested")
async def nested_sleep(note: str) -> str:
    """Sleep in a task of its own nursery (its cancellation comes out of the nursery)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
    return "never"


@pytest.mark.parametrize("kind", ["thread", "nursery"])
async def test_the_runs_tool_timeout_below_the_tools_own_is_the_calls_timeout(
    kind, blocker, autojump_clock
):
    """`Limits.tool_timeout_s` shorter than the tool's own: the Toolbox ends the call then.

    Before, the executor cut the call first: a thread running on was recorded EXECUTED
    "timed out" (not unknown, and the model might retry it), and a task whose cancellation
    came out of its own nursery interrupted the run."""
    found = blocker.tools["sync"] if kind == "thread" else nested_sleep
    slow = attrs.evolve(found, timeout_s=600)
    agent = make_agent(
        [call(slow.name, note="x", call_id="c1"), say("went on")],
        [slow],
        limits=Limits(tool_timeout_s=2),
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    assert result.final_answer == "went on"
    (timed_out,) = results_of(await store.read_log("r"))
    if kind == "thread":
        assert timed_out.outcome.status is ActionStatus.UNKNOWN and timed_out.late
    else:
        assert timed_out.outcome.status is ActionStatus.EXECUTED and not timed_out.late
        assert timed_out.outcome.observation == "Error: the call to nested timed out after 2 s"


@tool(name="pool", timeout_s=2)
async def pool_failing_as_cancelled(note: str) -> str:
    """Wait in a nursery whose other task's cleanup raises as it is cancelled."""

    async def worker() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise ValueError("connection pool closed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        await trio.sleep_forever()
    return "never"


async def test_a_tool_failing_as_it_is_cancelled_at_its_timeout_has_that_error_and_the_run_goes_on(
    autojump_clock,
):
    """The error beside the cancellation came out of the executor: the run was interrupted
    (RunInterrupted), its call left without a result."""
    agent = make_agent(
        [call("pool", note="x", call_id="c1"), say("went on")], [pool_failing_as_cancelled]
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    assert result.final_answer == "went on"
    log = await store.read_log("r")
    (failed,) = results_of(log)
    assert failed.outcome.status is ActionStatus.EXECUTED and not failed.late
    assert log.steps[0].observations[0] == (
        "Error: the call to pool timed out after 2 s, and raised ValueError: connection pool "
        "closed as it was cancelled"
    )
    assert check_invariants(log) == []


def test_a_hosted_call_cancelled_out_of_its_own_nursery_ends_with_no_result():
    """A cancellation raised as a group (from the call's nursery) is the call's scope's to
    take: stored as the call's error, it was raised again in the run, interrupting it."""
    from treadle._toolhost import current_host

    async def main() -> object:
        call = current_host().start(lambda: nested_sleep.fn(note="x"), description="nested")
        await trio.testing.wait_all_tasks_blocked()
        call.cancel()
        await call.wait()
        return call.result()

    assert trio.run(main) is None


def test_a_hosted_call_failing_as_it_is_cancelled_does_not_end_the_trio_run():
    """A call whose nursery raised an error beside the cancellation (a child run's event
    forwarding failing on a store closed under it) escaped the host's system task: the
    trio run ended with TrioInternalError after the run that made the call had finished."""
    from treadle._toolhost import current_host

    async def fails_when_cancelled() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise treadle.StoreError("the store is closed") from None

    async def call_body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails_when_cancelled)
            await trio.sleep_forever()

    async def main() -> object:
        call = current_host().start(call_body, description="forwarding")
        await trio.testing.wait_all_tasks_blocked()
        call.abandon()
        await call.wait()
        return call.result()

    found = trio.run(main)
    assert isinstance(found, outcome.Error)
    assert raised(found.error, treadle.StoreError) is not None


async def raise_a_stale_cancellation() -> str:
    """Raise a cancellation caught in an inner scope, after that scope ended."""
    with trio.CancelScope() as inner:
        inner.cancel()
        try:
            await trio.sleep(1)
        except trio.Cancelled as exc:
            stale = exc
    raise stale


async def test_a_tool_raising_a_stale_cancellation_fails_its_call_not_the_tool_host(
    autojump_clock,
):
    """The call was recorded "timed out", the host's nursery ended, and every later call in
    the process never started (recorded unknown at its timeout)."""
    stray = tool(name="stray")(raise_a_stale_cancellation)
    agent = make_agent([call("stray", call_id="c1"), say("ok")], [stray])
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="a")
    (failed,) = results_of(await store.read_log("a"))
    assert failed.outcome.status is ActionStatus.EXECUTED and not failed.late
    assert failed.outcome.observation.startswith(
        "Error: stray raised a trio cancellation that was not its call's"
    )

    @tool
    async def fine() -> str:
        """Answer at once."""
        return "fine"

    later = make_agent([call("fine", call_id="c1"), say("ok")], [fine])
    await treadle.run(later, "x", store=store, run_id="b")
    (answered,) = results_of(await store.read_log("b"))
    assert answered.outcome.observation == "fine"


def test_a_hosted_call_raising_a_stale_cancellation_is_its_error_and_the_host_lives_on():
    from treadle._toolhost import current_host

    async def six() -> int:
        return 6

    async def main() -> tuple[object, object]:
        stray = current_host().start(raise_a_stale_cancellation, description="stray")
        await stray.wait()
        after = current_host().start(six, description="after")
        with trio.fail_after(5):
            await after.wait()
        return stray.result(), after.result()

    stray, after = trio.run(main)
    assert isinstance(stray, outcome.Error) and isinstance(stray.error, treadle.TreadleError)
    assert "raised a trio.Cancelled that no cancel scope of its own took" in str(stray.error)
    assert after == outcome.Value(6)


async def test_a_process_tool_is_killed_at_the_time_budget(markers):
    agent = make_agent(
        [call("slow_write", directory=str(markers), seconds=60, call_id="c1"), say("never")],
        [slow_write],
        budgets=Budgets(time_budget_s=3),
        limits=Limits(tool_timeout_s=30),
    )
    store = MemoryStore()
    result = await treadle.run(agent, "x", store=store, run_id="r")
    await check_killed(markers)
    assert result.stop_reason is StopReason.TIME_BUDGET
    log = await store.read_log("r")
    (cut,) = results_of(log)
    assert cut.late and cut.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


# --------------------------------------------------------------- the invariant checker


async def test_the_checker_fails_a_finished_log_whose_intent_has_no_result_or_two():
    agent = Agent(
        model=ScriptedModel(turns=[call("add", a=1, b=2, call_id="c1"), say("3")]),
        executor=LedgerTools(),
        parser=SimpleParser(),
    )
    store = MemoryStore()
    await treadle.run(agent, "x", store=store, run_id="r")
    log = await store.read_log("r")
    assert check_invariants(log) == [] and check_action_results(log) == []
    (result,) = results_of(log)
    missing = RunLog(run_id="r", records=tuple(r for r in log.records if r is not result))
    assert check_action_results(missing) == ["r: action intent r/s1/a1 has no result"]
    assert "r: action intent r/s1/a1 has no result" in check_invariants(missing)
    index = log.records.index(result)
    twice = RunLog(run_id="r", records=(*log.records[:index], result, *log.records[index:]))
    assert check_action_results(twice) == ["r: action intent r/s1/a1 has 2 results"]
    unfinished = RunLog(run_id="r", records=missing.records[:-1])
    assert check_action_results(unfinished) == []  # resume resolves an open intent


async def test_a_stale_write_in_a_process_tool_is_a_stale_write():
    from treadle.types import Action

    action = Action(
        run_id="r",
        step=1,
        intent_id="r/s1/a1",
        call_id="c",
        tool="stale_write",
        arguments={"rid": "A", "base": 4},
        revisions={"res:A": (4,)},
    )
    outcome = await Toolbox([stale_write]).execute(action)
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert outcome.stale_resource == "res:A"
    assert "it is now at revision 5" in outcome.detail
