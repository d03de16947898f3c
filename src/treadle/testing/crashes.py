"""Crash recovery as a contract: crash a scripted run at every write, resume it, check it.

`check_crash_recovery` holds any `treadle.ports.RunStore` to docs/crash-safety.md under crashes. It
runs the scripted scenario of this module once uninterrupted, then once per crash point: a
simulated process crash before and after every store write (`CrashingStore`) and in the
middle of every action (`CrashingExecutor`, before and after the action's effect). After each
crash it closes the store, opens it again, and checks:

* every acknowledged barrier, and every write before it, is readable after the reopen;
* the log is a prefix of whole writes: nothing after an unacknowledged write is half
  visible, and an action result never exists without its step record;
* the resumed run reaches a terminal state, and its log keeps every invariant of
  `treadle.testing.simulation.check_invariants`;
* no ``never``-policy action executed twice, and no action executed before its intent was
  durable (the tools count their own executions in a ledger file, outside the store);
* the trajectory equals the uninterrupted run's where the crash did not change what the
  model saw; where it did (an action recorded as ``unknown``), the steps before it are equal
  and the model was told the outcome is unknown.

The scenario (`make_agent`, `RUN_INPUT`) is shared with the real-crash driver
(`treadle.testing.crashdriver`), which SIGKILLs real processes instead of simulating.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import trio

from treadle._exceptions import ContractViolation, RunInterrupted, UsageError
from treadle.actors import recorded_history
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.ports import ActionExecutor, RunStore
from treadle.supervisors import run
from treadle.testing._intercept import InterceptingStore
from treadle.testing.contracts import StoreOpener
from treadle.testing.faults import CrashingExecutor, CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Limits,
    ModelErrorInfo,
    ModelReply,
    Record,
    ReplayPolicy,
    RunLog,
    StoreOp,
    SyntheticObservations,
    ToolCall,
)

__all__ = [
    "LATENCY_ENV",
    "LEDGER_ENV",
    "NEVER_TOOLS",
    "RUN_INPUT",
    "THREAD_INPUT",
    "CrashContractError",
    "CrashReport",
    "LedgerEntry",
    "agent_from_environment",
    "check_crash_recovery",
    "check_recovered_run",
    "check_thread_crash_recovery",
    "compare_trajectories",
    "make_agent",
    "read_ledger",
    "trajectory",
]

RUN_INPUT: Final = "Add 2 and 3, then 5 and 7, look up the rate, and submit the total."
"""The input of the scripted scenario."""

CHECK_TIMEOUT_S: Final = 600.0
"""Seconds (trio clock) after which `check_crash_recovery` fails instead of hanging."""

_SYNTHETIC: Final = SyntheticObservations()


class CrashContractError(ContractViolation):
    """A store (or the runtime on it) broke crash recovery; the message names the crash."""


# --------------------------------------------------------------------------- the ledger


@attrs.frozen(kw_only=True)
class LedgerEntry:
    """One execution of a scenario tool, as the tool itself recorded it.

    Attributes:
        tool: the tool.
        intent_id: the action's intent id (its idempotency key).
        replay: the execution was a ``safe`` re-execution on resume.
        result: the observation the tool returned.
        pid: the process that executed it.
    """

    tool: str
    intent_id: str
    replay: bool
    result: str
    pid: int


def _append_line(path: str, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_ledger(path: str | os.PathLike[str], *, run_id: str | None = None) -> list[LedgerEntry]:
    """The executions recorded in a ledger file, in order (a missing file is empty).

    Args:
        path: the ledger file.
        run_id: keep only this run's executions (its intent ids start with ``<run_id>/``).
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    entries = [LedgerEntry(**json.loads(line)) for line in data.splitlines() if line]
    if run_id is None:
        return entries
    return [e for e in entries if e.intent_id.startswith(f"{run_id}/")]


async def _record(ledger: str, ctx: ToolContext, result: str) -> str:
    entry = {
        "tool": ctx.tool,
        "intent_id": ctx.intent_id,
        "replay": ctx.replay,
        "result": result,
        "pid": os.getpid(),
    }
    line = json.dumps(entry).encode() + b"\n"
    await trio.to_thread.run_sync(_append_line, ledger, line)
    return result


# --------------------------------------------------------------------------- the scenario


def _toolbox(ledger: str) -> Toolbox:
    async def reconcile_add(action: Action) -> ActionOutcome | None:
        found = await trio.to_thread.run_sync(read_ledger, ledger)
        for entry in found:
            if entry.intent_id == action.intent_id:
                return ActionOutcome(status=ActionStatus.EXECUTED, observation=entry.result)
        return None  # it cannot tell whether the effect happened: the outcome is unknown

    @tool(reconcile=reconcile_add)
    async def add(a: int, b: int, ctx: ToolContext) -> str:
        """Add two integers (an effect that must happen at most once).

        Args:
            a: the first addend.
            b: the second addend.
            ctx: the call (its intent id is the ledger key).
        """
        return await _record(ledger, ctx, str(a + b))

    @tool(replay=ReplayPolicy.SAFE)
    async def lookup(key: str, ctx: ToolContext) -> str:
        """Look a value up (read-only: safe to run again).

        Args:
            key: what to look up.
            ctx: the call.
        """
        return await _record(ledger, ctx, f"{key} is 1")

    @tool(completes_task=True)
    async def submit(answer: str, ctx: ToolContext) -> str:
        """Submit the final answer (an effect that must happen at most once).

        Args:
            answer: the answer.
            ctx: the call.
        """
        return await _record(ledger, ctx, f"submitted {answer}")

    return Toolbox([add, lookup, submit], default_timeout_s=30.0)


def _model(latency_s: float = 0.0, more_turns: Sequence[ModelReply] = ()) -> ScriptedModel:
    tools = [
        call("add", a=2, b=3, call_id="c1"),
        calls(
            ToolCall(id="c2", name="lookup", arguments={"key": "rate"}),
            ToolCall(id="c3", name="add", arguments={"a": 5, "b": 7}),
        ),
        call("lookup", key="total", call_id="c4"),
        call("submit", answer="17", call_id="c5"),
    ]
    # The run completes its task at step 4; a fifth turn answers a model told that the
    # submission's outcome is unknown. A thread's next run takes the turns from the fifth on.
    last = [say("The total is 17, but its submission may not have gone through.")]
    return ScriptedModel(
        latency_s=latency_s,
        turns=[*tools, *(more_turns or last)],
        # one retryable failure: a failed attempt is a record of its own
        failures={2: [ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=0.0)]},
    )


def make_agent(
    ledger: str | os.PathLike[str],
    *,
    wrap: Any = None,
    synthetic: SyntheticObservations = _SYNTHETIC,
    latency_s: float = 0.0,
    more_turns: Sequence[ModelReply] = (),
) -> Agent:
    """The scripted scenario's agent: four steps, five actions, one failed model attempt.

    Tools: ``add`` (``never``, with a reconcile check that reads the ledger), ``lookup``
    (``safe``) and ``submit`` (``never``, completes the task). Each execution is appended to
    the ``ledger`` file and synced before the tool returns.

    Args:
        ledger: the file the tools record their executions in.
        wrap: ``callable(executor) -> executor`` applied to the toolbox (fault injection).
        synthetic: the synthetic observation texts.
        latency_s: seconds (trio clock) each model call takes; not part of the snapshot.
        more_turns: the model's replies after the scenario's four tool calls (instead of its
            fifth, a text reply), for a run that continues the scenario's finished run in a
            thread (the model counts turns over the whole history it is sent).
    """
    executor: ActionExecutor = _toolbox(os.fspath(ledger))
    if wrap is not None:
        executor = wrap(executor)
    return Agent(
        model=_model(latency_s, more_turns),
        executor=executor,
        parser=NativeToolCallParser(),
        model_name="scripted",
        system_prompt="You add numbers with tools.",
        # Every new process's model fails its first attempt of turn 2 again, and failed
        # attempts count from the log: a run killed many times in that step must not run
        # out of retries, or its trajectory would differ for a reason other than the crash.
        limits=Limits(retry_initial_s=0.001, retry_max_s=0.001, max_model_retries=1_000),
        synthetic=synthetic,
    )


LEDGER_ENV: Final = "TREADLE_CRASH_LEDGER"
"""The environment variable naming the ledger file of `agent_from_environment`."""

LATENCY_ENV: Final = "TREADLE_CRASH_LATENCY_S"
"""The environment variable giving `agent_from_environment` its model latency (seconds)."""


def agent_from_environment() -> Agent:
    """The scenario's agent with the ledger file named by ``$TREADLE_CRASH_LEDGER``.

    For ``treadle resume --agent treadle.testing.crashes:agent_from_environment``.

    Raises:
        UsageError: the variable is not set.
    """
    ledger = os.environ.get(LEDGER_ENV)
    if not ledger:
        raise UsageError(f"set {LEDGER_ENV} to the ledger file of the crash scenario")
    return make_agent(ledger, latency_s=float(os.environ.get(LATENCY_ENV, "0") or 0))


# --------------------------------------------------------------------------- trajectories


def trajectory(log: RunLog) -> tuple[tuple[Any, ...], ...]:
    """What the model saw and decided, step by step, then how the run ended.

    Timestamps, durations, intent ids and attempt counts are left out: a resumed run differs
    from an uninterrupted one in those, never in what entered history.
    """
    steps = tuple(
        (
            s.step,
            s.decision,
            s.history_message,
            s.feedback,
            s.observations,
            s.observation_images,
            s.task_completed,
            s.env_error,
        )
        for s in log.steps
    )
    finished = log.finished
    end = (
        (finished.state, finished.stop_reason, finished.final_answer)
        if finished is not None
        else ("unfinished",)
    )
    return (*steps, end)


def compare_trajectories(log: RunLog, baseline: RunLog) -> list[str]:
    """Compare a resumed run with an uninterrupted one.

    Where no action's outcome was recorded as ``unknown``, the trajectories must be equal.
    Otherwise the steps before the first unknown outcome must be equal, and that step must
    carry the synthetic "unknown" observation for each unknown action.

    Returns:
        One sentence per difference; empty when they agree.
    """
    unknown = [
        r
        for r in log.records
        if isinstance(r, ActionResult) and r.outcome.status is ActionStatus.UNKNOWN
    ]
    ours, theirs = trajectory(log), trajectory(baseline)
    if not unknown:
        if ours != theirs:
            return [f"{log.run_id}: trajectory differs from the uninterrupted run's: {ours!r}"]
        return []
    first = min(r.step for r in unknown)
    if ours[: first - 1] != theirs[: first - 1]:
        return [f"{log.run_id}: the steps before the unknown outcome differ"]
    problems = []
    for result in unknown:
        text = _SYNTHETIC.unknown.format(tool=result.tool, detail="")
        if result.outcome.observation != text or not result.outcome.observation_is_synthetic:
            problems.append(f"{log.run_id}: unknown outcome of {result.intent_id} not synthetic")
    return problems


# --------------------------------------------------------------------------- the check


@attrs.define(eq=False)
class _Attempt:
    records: tuple[Record, ...]
    barrier: bool
    acknowledged: bool = False


@attrs.define(eq=False)
class _Recorder(InterceptingStore):
    """Records every write attempted through it and whether it returned."""

    inner: RunStore
    attempts: list[_Attempt] = attrs.Factory(list)

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        self.attempts.append(_Attempt(records=records, barrier=op.barrier))
        return True

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        self.attempts[-1].acknowledged = True


@attrs.frozen(kw_only=True)
class CrashReport:
    """What `check_crash_recovery` did.

    Attributes:
        writes: store writes of the uninterrupted run.
        actions: actions of the uninterrupted run.
        crashes: crashes injected (each followed by a reopen and a resume).
        unknown_outcomes: actions recorded as ``unknown`` on resume.
        reconciled: interrupted actions whose outcome the tool's reconcile check established.
        safe_reexecutions: ``safe`` actions executed again on resume.
    """

    writes: int
    actions: int
    crashes: int
    unknown_outcomes: int
    reconciled: int
    safe_reexecutions: int


@attrs.frozen(kw_only=True)
class _Crash:
    label: str
    at: int
    when: Literal["before", "after"]


async def check_crash_recovery(
    open_store: StoreOpener, *, workdir: str | os.PathLike[str]
) -> CrashReport:
    """Crash the scenario at every store write and in every action, then resume and check.

    Args:
        open_store: opens the store under test (see `treadle.testing.contracts.StoreOpener`);
            every call must open the same storage. A store that keeps nothing across a
            reopen fails the check.
        workdir: an existing directory for the tools' ledger files.

    Returns:
        What was injected and what resume did.

    Raises:
        CrashContractError: a check failed; the message names the crash point.
        trio.TooSlowError: the check hung for `CHECK_TIMEOUT_S`.
    """
    with trio.fail_after(CHECK_TIMEOUT_S), _abandoned_calls_at_debug():
        baseline, writes = await _baseline(open_store, Path(workdir))
        actions = sum(1 for r in baseline.records if isinstance(r, ActionResult))
        crashes = _crash_points(writes, actions)
        totals = {"unknown": 0, "reconciled": 0, "replayed": 0}
        for crash in crashes:
            found = await _crash_and_resume(open_store, Path(workdir), crash, baseline)
            for key, value in found.items():
                totals[key] += value
    return CrashReport(
        writes=writes,
        actions=actions,
        crashes=len(crashes),
        unknown_outcomes=totals["unknown"],
        reconciled=totals["reconciled"],
        safe_reexecutions=totals["replayed"],
    )


_WHENS: Final[tuple[Literal["before", "after"], ...]] = ("before", "after")

_TOOLS_LOG: Final = logging.getLogger("treadle.tools")
_IN_CHECK: ContextVar[bool] = ContextVar("treadle_crash_check", default=False)
"""True in the check's own task, and so in its runs and in their calls in the tool host."""


class _WarningsAtDebug(logging.Filter):
    """Logs a warning of the tool host at debug level when one of the check's runs caused it.

    A call that a simulated crash abandoned goes on in this process and ends later, which
    the tool host reports as a warning (docs/concepts.md, "Tools and cancellation"); a real
    crash takes the call with it. In the check that is expected, not news: it would print a
    line on standard error for every such call of a check that passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not _IN_CHECK.get() or record.levelno != logging.WARNING:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return _TOOLS_LOG.isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def _abandoned_calls_at_debug() -> Iterator[None]:
    """Within the block, the warnings of the check's abandoned calls are debug records.

    Only records logged in the block's context (the check's runs and their calls) change;
    another run of the process logs as it would.
    """
    quiet = _WarningsAtDebug()
    token = _IN_CHECK.set(True)
    _TOOLS_LOG.addFilter(quiet)
    try:
        yield
    finally:
        _TOOLS_LOG.removeFilter(quiet)
        _IN_CHECK.reset(token)


_CHECK_OWNER: Final = "treadle-crash-check"
"""The lease owner of a crashed run and of its resume: the resume continues the lease the
crashed incarnation could not release, as a restarted process with the same identity would."""


async def _baseline(open_store: StoreOpener, workdir: Path) -> tuple[RunLog, int]:
    run_id = f"baseline-{secrets.token_hex(4)}"
    async with open_store() as store:
        recorder = _Recorder(store)
        await run(
            make_agent(workdir / f"{run_id}.ledger"), RUN_INPUT, store=recorder, run_id=run_id
        )
        log = await store.read_log(run_id)
    return log, len(recorder.attempts)


async def _crash_and_resume(
    open_store: StoreOpener, workdir: Path, crash: _Crash, baseline: RunLog
) -> dict[str, int]:
    name = f"{crash.label} {crash.when} {crash.at}"
    run_id = f"crash-{crash.label}-{crash.when}-{crash.at}-{secrets.token_hex(4)}"
    ledger = workdir / f"{run_id}.ledger"
    async with open_store() as store:
        recorder = await _crash(store, crash, ledger, run_id, name)
    async with open_store() as store:
        survived = await store.read_log(run_id)
        _check_prefix(name, survived, recorder)
        result = await run(
            make_agent(ledger), RUN_INPUT, store=store, run_id=run_id, owner=_CHECK_OWNER
        )
        log = await store.read_log(run_id)
    _expect(result.state.is_terminal, name, f"resumed run ended {result.state}")
    entries = read_ledger(ledger)
    problems = check_recovered_run(log, entries, baseline)
    _expect(not problems, name, "; ".join(problems))
    return _resume_counts(name, log, entries, len(survived.records))


def _crash_points(writes: int, actions: int) -> list[_Crash]:
    """Before and after each of ``writes`` store writes, then in each of ``actions`` actions."""
    crashes = [_Crash(label="store", at=k, when=w) for w in _WHENS for k in range(1, writes + 1)]
    crashes += [_Crash(label="action", at=k, when=w) for w in _WHENS for k in range(1, actions + 1)]
    return crashes


def _crashing(
    store: RunStore, crash: _Crash
) -> tuple[CrashingStore, Callable[[ActionExecutor], ActionExecutor] | None]:
    """The store that dies at ``crash`` and, for a crash in an action, the executor wrapper."""
    if crash.label == "store":
        return CrashingStore(inner=store, crash_at=crash.at, when=crash.when), None
    crashing = CrashingStore(inner=store, crash_at=10**9)

    def wrap(executor: ActionExecutor) -> ActionExecutor:
        return CrashingExecutor(inner=executor, crash_at=crash.at, when=crash.when, store=crashing)

    return crashing, wrap


async def _crash(store: RunStore, crash: _Crash, ledger: Path, run_id: str, name: str) -> _Recorder:
    crashing, wrap = _crashing(store, crash)
    recorder = _Recorder(crashing)
    try:
        await run(
            make_agent(ledger, wrap=wrap),
            RUN_INPUT,
            store=recorder,
            run_id=run_id,
            owner=_CHECK_OWNER,
        )
    except (RunInterrupted, SimulatedCrash):
        pass
    else:
        _expect(False, name, "the run finished without crashing")
    return recorder


def _check_prefix(name: str, log: RunLog, recorder: _Recorder) -> None:
    """The reopened log holds whole writes, in order, up to at least the last acked barrier."""
    records = log.records
    position = 0
    whole = 0
    for attempt in recorder.attempts:
        if position == len(records):
            break
        part = records[position : position + len(attempt.records)]
        _expect(
            part == attempt.records,
            name,
            f"after {whole} whole writes the log holds {[type(r).__name__ for r in part]}, "
            f"not the next write {[type(r).__name__ for r in attempt.records]}",
        )
        position += len(attempt.records)
        whole += 1
    _expect(position == len(records), name, "the log holds records that were never written")
    last_barrier = max(
        (i + 1 for i, a in enumerate(recorder.attempts) if a.barrier and a.acknowledged), default=0
    )
    _expect(
        whole >= last_barrier,
        name,
        f"acknowledged barrier {last_barrier} is lost: only {whole} writes survived the reopen",
    )


NEVER_TOOLS: Final = frozenset({"add", "submit"})
"""The scenario's tools with replay policy ``never``."""


def check_recovered_run(log: RunLog, ledger: Sequence[LedgerEntry], baseline: RunLog) -> list[str]:
    """Check a run of the scenario after crashes and resumes.

    Args:
        log: the run's final log.
        ledger: the executions its tools recorded (`read_ledger`), over every process.
        baseline: the log of an uninterrupted run of the scenario.

    Returns:
        One sentence per violation: the run is not finished in a terminal state; an invariant
        of `treadle.testing.simulation.check_invariants` fails; the trajectory differs from
        the baseline's where the crashes did not change what the model saw; an action ran
        without a durable intent; a ``never``-policy action ran twice; a ``safe`` action ran
        more than once without being told it is a replay. Executions are counted, not
        ordered: a call the crashed incarnation abandoned can still end (and write its
        ledger line) in this process after the resume replayed it, which a killed process
        cannot do. Empty when everything holds.
    """
    problems: list[str] = []
    if log.finished is None or not log.finished.state.is_terminal:
        problems.append(f"{log.run_id}: not finished in a terminal state")
    problems += check_invariants(log)
    problems += compare_trajectories(log, baseline)
    intents = {r.intent_id for r in log.records if isinstance(r, ActionIntent)}
    runs: dict[str, int] = {}
    first_runs: dict[str, int] = {}
    for entry in ledger:
        if entry.intent_id not in intents:
            problems.append(f"{log.run_id}: {entry.intent_id} ran without a durable intent")
        runs[entry.intent_id] = runs.get(entry.intent_id, 0) + 1
        if not entry.replay:
            first_runs[entry.intent_id] = first_runs.get(entry.intent_id, 0) + 1
        if runs[entry.intent_id] == 2 and entry.tool in NEVER_TOOLS:
            problems.append(f"{log.run_id}: never-policy {entry.intent_id} ran twice")
        elif first_runs.get(entry.intent_id) == 2 and not entry.replay:
            problems.append(f"{log.run_id}: {entry.intent_id} ran again, not as a replay")
    return problems


def _resume_counts(
    name: str, log: RunLog, ledger: list[LedgerEntry], survived: int
) -> dict[str, int]:
    """Count what resume did with the actions the crash interrupted.

    ``survived`` is how many records the crashed incarnation left: an action whose intent is
    among them and whose result is not was resumed.
    """
    executions: dict[str, int] = {}
    for entry in ledger:
        executions[entry.intent_id] = executions.get(entry.intent_id, 0) + 1
    before = {r.intent_id for r in log.records[:survived] if isinstance(r, ActionIntent)}
    resumed = [
        r for r in log.records[survived:] if isinstance(r, ActionResult) and r.intent_id in before
    ]
    unknown = [r for r in resumed if r.outcome.status is ActionStatus.UNKNOWN]
    for result in unknown:
        _expect(result.tool in NEVER_TOOLS, name, "a safe action was recorded as unknown")
    reconciled = [
        r for r in resumed if r.tool == "add" and r.outcome.status is ActionStatus.EXECUTED
    ]
    for result in reconciled:
        _expect(executions.get(result.intent_id) == 1, name, "reconciled without an execution")
    replayed = sum(1 for entry in ledger if entry.replay)
    return {"unknown": len(unknown), "reconciled": len(reconciled), "replayed": replayed}


def _expect(condition: bool, crash: str, message: str) -> None:
    if not condition:
        raise CrashContractError(f"[crash {crash}] {message}")


# --------------------------------------------------------------------------- threads

THREAD_INPUT: Final = "Now look up the rate again, add 4 and 4, and submit that."
"""The new message of the run that continues the scenario's run in a thread."""

THREAD_TURNS: Final[tuple[ModelReply, ...]] = (
    calls(
        ToolCall(id="c6", name="lookup", arguments={"key": "rate"}),
        ToolCall(id="c7", name="add", arguments={"a": 4, "b": 4}),
    ),
    call("submit", answer="8", call_id="c8"),
)
"""The model's replies in the thread's second run: two steps, three actions."""


@attrs.frozen(kw_only=True)
class ThreadCrashReport:
    """What `check_thread_crash_recovery` did.

    Attributes:
        writes: store writes of the thread's second run, uninterrupted (its run-started,
            which names the run it continues, is the first).
        actions: actions of that run.
        crashes: crashes injected into it (each followed by a reopen and a resume).
    """

    writes: int
    actions: int
    crashes: int


async def check_thread_crash_recovery(
    open_store: StoreOpener, *, workdir: str | os.PathLike[str]
) -> ThreadCrashReport:
    """Crash a run that continues a thread at every write and in every action; resume; check.

    For each crash point: the scenario's run (the thread's first) runs to its end, then the
    thread's second run (`THREAD_INPUT`, `THREAD_TURNS`) is started with ``thread_id`` and
    crashed; the store is reopened and the same call is made again with the run's id, as a
    restarted caller retrying exactly once would (it resumes the unfinished run, starts it
    when its run-started never became durable, or returns the result of a run that finished
    just before the crash). Checked on top of `check_recovered_run` for the second run:

    * the first run's log and its tools' executions are unchanged: nothing of it ran again;
    * every request of the second run starts with the first run's recorded history
      (`treadle.history`), read from the store after every resume;
    * the second run's run-started names the thread and the run it continues.

    Args:
        open_store: opens the store under test; every call must open the same storage.
        workdir: an existing directory for the tools' ledger files.

    Raises:
        CrashContractError: a check failed; the message names the crash point.
        trio.TooSlowError: the check hung for `CHECK_TIMEOUT_S`.
    """
    with trio.fail_after(CHECK_TIMEOUT_S), _abandoned_calls_at_debug():
        baseline, writes = await _thread_baseline(open_store, Path(workdir))
        actions = sum(1 for r in baseline.records if isinstance(r, ActionResult))
        crashes = _crash_points(writes, actions)
        for crash in crashes:
            await _crash_thread(open_store, Path(workdir), crash, baseline)
    return ThreadCrashReport(writes=writes, actions=actions, crashes=len(crashes))


async def _thread_root(store: RunStore, workdir: Path, name: str) -> tuple[str, Path]:
    root = f"{name}-{secrets.token_hex(4)}"
    ledger = workdir / f"{root}.ledger"
    result = await run(make_agent(ledger), RUN_INPUT, store=store, run_id=root)
    _expect(result.state.is_terminal, name, "the thread's first run did not finish")
    return root, ledger


async def _thread_baseline(open_store: StoreOpener, workdir: Path) -> tuple[RunLog, int]:
    async with open_store() as store:
        root, ledger = await _thread_root(store, workdir, "thread-baseline")
        recorder = _Recorder(store)
        result = await run(
            make_agent(ledger, more_turns=THREAD_TURNS),
            THREAD_INPUT,
            store=recorder,
            thread_id=root,
        )
        log = await store.read_log(result.run_id)
    return log, len(recorder.attempts)


async def _crash_thread(
    open_store: StoreOpener, workdir: Path, crash: _Crash, baseline: RunLog
) -> None:
    name = f"thread {crash.label} {crash.when} {crash.at}"
    async with open_store() as store:
        root, ledger = await _thread_root(store, workdir, f"thread-{crash.label}-{crash.at}")
        root_log = await store.read_log(root)
        root_runs = read_ledger(ledger, run_id=root)
        recorder = await _crash_continuation(store, crash, ledger, root, name)
    async with open_store() as store:
        second = f"{root}.2"
        survived = await store.read_log(second)
        _check_prefix(name, survived, recorder)
        agent = make_agent(ledger, more_turns=THREAD_TURNS)
        result = await run(
            agent, THREAD_INPUT, store=store, thread_id=root, run_id=second, owner=_CHECK_OWNER
        )
        log = await store.read_log(second)
        inherited = await recorded_history(store, root)
        _expect(await store.read_log(root) == root_log, name, "the first run's log changed")
    _expect(result.run_id == second, name, f"the thread went on as {result.run_id!r}")
    started = log.started
    _expect(
        started is not None and (started.thread, started.continues) == (root, root),
        name,
        "the second run's run-started does not name its thread",
    )
    _expect(read_ledger(ledger, run_id=root) == root_runs, name, "the first run's tools ran again")
    model = agent.model
    assert isinstance(model, ScriptedModel)
    for request in model.requests:
        seen = list(request.messages[1 : len(inherited) + 1])
        _expect(seen == inherited, name, "a request does not start with the thread's history")
    problems = check_recovered_run(log, read_ledger(ledger, run_id=second), baseline)
    _expect(not problems, name, "; ".join(problems))


async def _crash_continuation(
    store: RunStore, crash: _Crash, ledger: Path, root: str, name: str
) -> _Recorder:
    crashing, wrap = _crashing(store, crash)
    recorder = _Recorder(crashing)
    try:
        await run(
            make_agent(ledger, wrap=wrap, more_turns=THREAD_TURNS),
            THREAD_INPUT,
            store=recorder,
            thread_id=root,
            owner=_CHECK_OWNER,
        )
    except (RunInterrupted, SimulatedCrash):
        pass
    else:
        _expect(False, name, "the run finished without crashing")
    return recorder
