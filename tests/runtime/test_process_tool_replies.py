"""A process tool's outcome is the reply its child wrote, whatever else the tool did to its
process: threads, exit handlers and processes it left running, file descriptors it closed,
a classmethod reached through a subclass, a `BaseException` it raised, a result that exits
when it is read, a driver without standard streams.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from process_tools import (
    SandboxTeller,
    Teller,
    close_then_log,
    exit_leaving_a_thread,
    fork_without_hooks,
    leave_a_multiprocessing_child,
    leave_a_slow_exit_handler,
    leave_a_thread,
    raise_base,
    return_exiting,
    stop_the_keeper,
)

import treadle
from treadle._exceptions import UsageError
from treadle.tools import Tool, Toolbox
from treadle.types import Action, ActionOutcome, ActionStatus

REAL_WAIT_S = 60.0
"""Real seconds a call may take at most here (each tool's own timeout is shorter)."""


async def execute(found: Tool, **arguments: object) -> ActionOutcome:
    action = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool=found.name, arguments=arguments
    )
    with trio.fail_after(REAL_WAIT_S):
        return await Toolbox([found]).execute(action)


@pytest.mark.parametrize(
    "found",
    [leave_a_thread, leave_a_multiprocessing_child, leave_a_slow_exit_handler, fork_without_hooks],
    ids=lambda found: found.name,
)
async def test_a_process_tool_that_returned_gives_its_result_whatever_it_left_running(
    tmp_path, found
):
    """The function returned at once, but its process did not end: the interpreter's exit
    waited for the thread, the multiprocessing child or the exit handler, or a child forked
    without Python's hooks held the reply pipe. The call waited for its whole timeout and was
    recorded as timed out and killed; the result was lost, and a model would call again."""
    try:
        outcome = await execute(found, directory=str(tmp_path))
    finally:
        (tmp_path / "release").write_text("")  # what still runs ends
        background = tmp_path / "background"
        if background.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(background.read_text()), signal.SIGKILL)
    assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, "returned")


@pytest.mark.parametrize(("how", "status"), [("exit", 3), ("interrupt", 130)])
async def test_a_process_tool_that_exits_is_unknown_without_waiting_for_its_threads(
    tmp_path, how, status
):
    """The function called ``sys.exit`` (or raised `KeyboardInterrupt`) with a non-daemon
    thread running: its process went through an interpreter's exit, which waited for the
    thread and ran the `atexit` handlers, so the call waited for its whole timeout and was
    recorded as executed and timed out. It is unknown, as docs/concepts.md says ("Tools and
    cancellation"), and ends with its function."""
    try:
        outcome = await execute(exit_leaving_a_thread, directory=str(tmp_path), how=how)
    finally:
        (tmp_path / "release").write_text("")  # the thread, if still running, ends
    assert outcome.status is ActionStatus.UNKNOWN
    assert f"its process exited with status {status} before it reported" in outcome.observation
    assert not (tmp_path / "atexit").exists()


async def test_a_process_tools_reply_read_whole_is_its_outcome_at_its_timeout():
    """The tool stopped the process that waits for it, so the call's process never ended
    before the timeout, though its whole reply had been read: the call was "timed out"."""
    outcome = await execute(stop_the_keeper)
    assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, "returned")


async def test_a_classmethod_reached_through_a_subclass_runs_bound_to_the_subclass():
    """The child found the classmethod by the name of the class that defines it, and ran it
    bound to that class: ``SandboxTeller.pay`` paid through ``Teller``'s bank."""
    direct = SandboxTeller.pay(5)
    for isolation in (None, "process"):
        outcome = await execute(treadle.tool(isolation=isolation)(SandboxTeller.pay), amount=5)
        assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, direct)
    assert direct == "paid 5 via sandbox bank"


def _not_a_method_of_teller(amount: int) -> str:
    """Not found on `Teller`."""
    return str(amount)


def test_a_method_bound_to_a_class_it_cannot_be_found_on_is_refused_as_a_process_tool():
    """The child would have found the plain function, without its class."""
    import types

    bound = types.MethodType(_not_a_method_of_teller, Teller)
    with pytest.raises(UsageError, match="cannot be found on"):
        treadle.tool(isolation="process", name="bound")(bound)


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("custom", "Error: Uncaught: custom"),
        ("generator_exit", "Error: GeneratorExit: generator exit"),
        ("asyncio", "Error: CancelledError: asyncio cancel"),
    ],
)
async def test_a_process_tool_raising_a_base_exception_fails_as_a_thread_tool_does(kind, error):
    """The child wrote no reply and died of the exception: the call was UNKNOWN."""
    thread_tool = treadle.tool(name="raise_base")(raise_base.fn)
    for found in (thread_tool, raise_base):
        outcome = await execute(found, kind=kind)
        assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, error)


async def test_a_process_tool_that_closed_the_reply_pipe_gets_no_reply_in_its_own_files(tmp_path):
    """The tool closed every descriptor from 3 up and opened log files, one of them with the
    reply pipe's number: the reply was written into that log file."""
    outcome = await execute(close_then_log, directory=str(tmp_path))
    count = int((tmp_path / "count").read_text())
    logs = {path.name: path.read_bytes() for path in tmp_path.glob("log*.txt")}
    assert logs == {f"log{i}.txt": b"" for i in range(count)}
    assert outcome.status is ActionStatus.UNKNOWN
    assert "before it reported its result" in outcome.observation


@pytest.mark.parametrize(("kind", "error"), [("exit", "SystemExit: 7"), ("base", "Uncaught: read")])
async def test_a_result_that_exits_when_read_back_is_the_calls_error(kind, error):
    """Unpickling the result called ``sys.exit`` in the driver (or raised another
    `BaseException`): it ended the driver instead of failing the call."""
    outcome = await execute(return_exiting, kind=kind)
    assert (outcome.status, outcome.observation) == (
        ActionStatus.EXECUTED,
        f"Error: the result of return_exiting could not be read back from its process: {error}",
    )


def test_a_process_tool_runs_in_a_driver_without_standard_streams(tmp_path):
    """The driver's stdin, stdout and stderr were closed: the call's process failed to give
    its prints to stderr, before the function began, and every call was NOT_EXECUTED."""
    driver = Path(__file__).with_name("closed_streams_driver.py")
    result = tmp_path / "result"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    closed = 'exec "$0" "$@" <&- >&- 2>&-'
    subprocess.run(
        ["/bin/sh", "-c", closed, sys.executable, str(driver), str(result)],
        env=env,
        check=True,
        timeout=REAL_WAIT_S,
    )
    assert result.read_text() == "executed 42"


TOOL_IN_THE_CWD = """
import treadle


@treadle.tool(isolation="process")
def where_from() -> str:
    \"\"\"Say that the child found this module.\"\"\"
    return "found"
"""


async def test_a_process_tool_imported_from_the_current_directory_runs_after_a_chdir(
    tmp_path, monkeypatch
):
    """The tool's module was imported through ``""`` in ``sys.path`` (the current directory,
    as with ``python -c`` or a REPL), then the driver changed directory: the child searched
    the new current directory, and every call was NOT_EXECUTED ("No module named ...")."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    (home / "tools_in_the_cwd.py").write_text(TOOL_IN_THE_CWD)
    monkeypatch.chdir(home)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    monkeypatch.delitem(sys.modules, "tools_in_the_cwd", raising=False)  # removed afterwards
    importlib.invalidate_caches()
    module = importlib.import_module("tools_in_the_cwd")
    monkeypatch.chdir(elsewhere)
    outcome = await execute(module.where_from)
    assert (outcome.status, outcome.observation) == (ActionStatus.EXECUTED, "found")
