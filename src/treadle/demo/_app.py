"""What ``treadle demo`` does (the commands' options are declared in `treadle.demo.cli`).

The replay, the workspace, the console view and the report tables; loaded only when a demo
command runs, so that the rest of the CLI starts without them.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import click
import httpx
import trio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from treadle._cli_common import counted, shell_command
from treadle._exceptions import TreadleError
from treadle._terminal import mark, on_interrupt
from treadle.demo.airline.agent import RESPOND_TOOL
from treadle.demo.airline.data import (
    DATA_ENV_VAR,
    AirlineDataNotFound,
    AirlineDataUnreadable,
    Recording,
    load_data,
)
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.replay import (
    ChildExit,
    CrashPoint,
    LiveReport,
    ReplayReport,
    Workspace,
    demo_crash_point,
    find_recording,
    load_trajectories,
    locate_workload,
    open_workspace,
    pick_demo_recording,
    policy_text,
    recorded_steps,
    replay_recordings,
    run_id_of,
    run_live,
    tasks_by_id,
)
from treadle.demo.airline.replay_server import recording_key
from treadle.demo.airline.tools import WRITE_TOOLS
from treadle.models.openai import OpenAIChatClient
from treadle.stores.sqlite import open_sqlite_store
from treadle.types import ActionIntent, ActionResult, RunLog

T = TypeVar("T")

CLIP: Final = 110
"""Characters of a message shown per progress line."""

LOCAL_FOLDER: Final = Path(".treadle")
"""Where `treadle demo` keeps its stores by default (relative to the working directory)."""


def _run(fn: Callable[[], Awaitable[T]], *, interrupted: str | Callable[[], str]) -> T:
    """Run ``fn`` under trio; errors the user can act on become one line.

    A treadle or workload error becomes a `click.ClickException`. Ctrl-C (SIGINT: a
    `KeyboardInterrupt`, alone or inside the exception groups of the nurseries it crossed)
    prints ``interrupted: <interrupted>`` on standard error and exits with status 130
    (`treadle._terminal.on_interrupt`, as every command); a function is called then, to say
    what the interruption left.
    """
    with on_interrupt(interrupted), _said_in_one_line():
        return trio.run(fn)


ACTIONABLE: Final = (TreadleError, AirlineDataNotFound, AirlineDataUnreadable)
"""Errors the user can act on, said in one line (`_said_in_one_line`)."""


@contextlib.contextmanager
def _said_in_one_line() -> Iterator[None]:
    """A treadle or workload error raised inside becomes a `click.ClickException` (exit 1).

    Such errors are the user's to act on (a ``--store`` where nothing can be made, a
    workload that cannot be read, a full disk): docs/demo.md, "`treadle demo`" promises them
    as one line, never a traceback. Raised in concurrent tasks, they come inside the
    exception groups of the nurseries they crossed: a group holding only such errors is said
    as its first one; any other group passes as it is (Ctrl-C among them, for
    `treadle._terminal.on_interrupt`).
    """
    try:
        yield
    except ACTIONABLE as exc:
        raise click.ClickException(str(exc)) from exc
    except BaseExceptionGroup as group:
        actionable, rest = group.split(ACTIONABLE)
        if actionable is None or rest is not None:
            raise
        raise click.ClickException(str(_first_leaf(actionable))) from group


def _first_leaf(error: BaseException) -> BaseException:
    """The first exception of ``error`` that is not a group (``error`` itself if none)."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _clip(text: object, limit: int = CLIP) -> str:
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    ellipsis = mark("…")
    return flat[: limit - len(ellipsis)] + ellipsis


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")


def _default_store(kind: str) -> Path:
    """A new, empty store file under ``./.treadle/`` (a temporary folder when that is read-only).

    Named ``<kind>-<UTC time to the second>.db``; when another invocation took that name in
    the same second, ``<kind>-<time>-2.db``, ``-3`` … The file is created here, exclusively,
    so that no two invocations share a store (docs/demo.md, "`treadle demo`").
    """
    folder, stamp = _store_folder(), _stamp()
    path, taken = folder / f"{kind}-{stamp}.db", 1
    while True:
        try:
            path.touch(exist_ok=False)  # O_CREAT | O_EXCL: only one invocation gets a name
        except FileExistsError:
            taken += 1
            path = folder / f"{kind}-{stamp}-{taken}.db"
        else:
            return path


def _store_folder() -> Path:
    try:
        LOCAL_FOLDER.mkdir(exist_ok=True)
        if not os.access(LOCAL_FOLDER, os.W_OK):
            raise PermissionError(LOCAL_FOLDER)
    except OSError:
        return Path(tempfile.mkdtemp(prefix="treadle-demo-"))
    return LOCAL_FOLDER


def _check_store(store_path: str | None) -> None:
    """Refuse a ``--store`` file that is not a SQLite run store, before anything is made.

    The workspace beside it would be made first otherwise. A file that does not exist yet is
    fine: it becomes the store.
    """
    if store_path is not None and Path(store_path).is_file():
        _run(functools.partial(_open_store, Path(store_path)), interrupted="nothing was run")


async def _open_store(path: Path) -> None:
    async with open_sqlite_store(path):
        pass


def _dim(console: Console, text: str) -> None:
    """Print ``text`` dimmed, as it is: a path in it holding ``[red]`` is no markup."""
    console.print(f"[dim]{escape(text)}[/]")


def _workload(data_dir: str | None, console: Console) -> Path:
    try:
        return locate_workload(data_dir, notify=lambda text: _dim(console, text))
    except AirlineDataNotFound as exc:
        raise click.ClickException(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise click.ClickException(
            "the airline workload is not on this machine (looked for shared/workloads/airline "
            f"above this folder and in ${DATA_ENV_VAR}) and downloading it failed: {exc}"
        ) from exc


def _check_data(data: Path) -> None:
    """Refuse a workload whose database files cannot be loaded, before a store is made."""
    try:
        load_data(data)
    except AirlineDataUnreadable as exc:
        raise click.ClickException(str(exc)) from exc


def _recordings(path: Path) -> tuple[Recording, ...]:
    try:
        return load_trajectories(path)
    except (OSError, TypeError, ValueError) as exc:
        raise click.ClickException(f"cannot read recordings from {path}: {exc}") from exc


# --------------------------------------------------------------------------- the demo view


class DemoView:
    """Prints a replay's progress as its driver processes report their run events.

    Implements `treadle.demo.airline.replay.ReplayObserver`.
    """

    def __init__(self, console: Console, workspace: Workspace) -> None:
        self.console = console
        self.workspace = workspace
        self.drivers = 0
        self.crash: CrashPoint | None = None

    def child_started(
        self, recording: Recording, pid: int, *, resume: bool, crash: CrashPoint | None
    ) -> None:
        """Announce a driver process (its crash point once it says it begins the run)."""
        self.drivers += 1
        self.crash = crash
        if resume:
            self.console.rule(f"driver process {pid}: resumes the run from its log")
        else:
            self.console.rule(f"driver process {pid}: runs {run_id_of(recording)}")

    def event(self, recording: Recording, line: Mapping[str, Any]) -> None:
        """Show one run event."""
        kind = line.get("kind")
        step = line.get("step")
        label = f"step {step:>2}" if isinstance(step, int) else "       "
        handler = {
            "driver": self._driver,
            "model_call_finished": self._model_finished,
            "action_requested": self._action_requested,
            "action_finished": self._action_finished,
            "run_finished": self._run_finished,
        }.get(str(kind))
        if handler is not None:
            handler(label, line)

    def _driver(self, label: str, line: Mapping[str, Any]) -> None:
        """What the driver read under the run's lock: an empty log arms its crash point.

        A driver resuming a begun run never dies at its crash point
        (`treadle.demo.airline.driver`), so the kill is announced only for one that begins it.
        """
        if line.get("stored_records") == 0 and self.crash is not None:
            self.console.print(
                f"[yellow]this process will kill itself with SIGKILL {self.crash.describe()}[/]"
            )
        if line.get("stored_records"):
            self.console.print(
                f"[cyan]read the log: {line['stored_records']} records, "
                f"{counted(line['steps'], 'step')} completed; continuing from there[/]"
            )

    def _model_finished(self, label: str, line: Mapping[str, Any]) -> None:
        if line.get("abandoned"):
            self.console.print(
                f"{label}  [cyan]model call without a result (its process died): "
                "recorded as abandoned, asked again[/]"
            )
        elif line.get("error"):
            self.console.print(f"{label}  [red]model call failed: {escape(line['error'])}[/]")
        elif line.get("text") and not line.get("tools"):
            self.console.print(f"{label}  [bold green]agent[/]     {escape(_clip(line['text']))}")
        elif line.get("text"):
            self.console.print(f"{label}  [green]agent[/]     {escape(_clip(line['text']))}")

    def _action_requested(self, label: str, line: Mapping[str, Any]) -> None:
        tool = str(line.get("tool"))
        if tool == "respond":
            return
        arguments = ", ".join(f"{k}={v}" for k, v in (line.get("arguments") or {}).items())
        style = "bold magenta" if tool in WRITE_TOOLS else "magenta"
        self.console.print(
            f"{label}  [{style}]tool[/]      {escape(_clip(f'{tool}({arguments})'))}"
        )

    def _action_finished(self, label: str, line: Mapping[str, Any]) -> None:
        observation = escape(_clip(line.get("observation") or "", CLIP - 4))
        if line.get("tool") == RESPOND_TOOL:
            self.console.print(f"{label}  [bold blue]customer[/]  {observation}")
            return
        self.console.print(f"{label}  [dim]  {mark('→')} {observation}[/]")

    def _run_finished(self, label: str, line: Mapping[str, Any]) -> None:
        self.console.print(
            f"[bold]run finished: {line.get('state')} ({line.get('stop_reason')}), "
            f"{counted(line.get('steps'), 'step')}[/]"
        )

    def child_exited(self, recording: Recording, exit: ChildExit, log: RunLog) -> None:
        """Explain what a killed driver left behind."""
        if not exit.killed:
            return
        self.console.print(
            f"[bold red]{mark('✗')} driver process {exit.pid} was killed with SIGKILL (kill -9)[/]"
        )
        self.console.print(
            f"  the log holds {len(log.records)} durable records, {len(log.steps)} steps "
            "completed; nothing after the last durable write survived the process"
        )
        for intent in _open_intents(log):
            self._explain_open(intent, run_id_of(recording))

    def _explain_open(self, intent: ActionIntent, run_id: str) -> None:
        if intent.tool not in WRITE_TOOLS:
            self.console.print(
                f"  {intent.tool} has an intent but no result: it only reads, so the "
                "resumed run will simply run it again"
            )
            return
        db = AirlineDatabase(self.workspace.conversation_path(run_id))
        applied = {row[0] for row in db.applied_actions()}
        where = "HAS applied it" if intent.intent_id in applied else "has NOT applied it"
        self.console.print(
            f"  [bold]{intent.tool}[/] has an intent ({intent.intent_id}) but no result in the "
            f"log; the airline database {where}.\n  The resumed run asks the database "
            "(reconcile by intent id) instead of guessing, so the change happens exactly once."
        )


def _open_intents(log: RunLog) -> list[ActionIntent]:
    finished = {r.intent_id for r in log.records if isinstance(r, ActionResult)}
    return [r for r in log.records if isinstance(r, ActionIntent) and r.intent_id not in finished]


def _print_demo_summary(
    console: Console, report: ReplayReport, log: RunLog, workspace: Workspace, store: Path
) -> None:
    """The run's figures, all from its log, its database and its stored counts.

    Each change is applied exactly once when `ReplayReport.applied_once` holds and, for a
    finished run, its database is the recorded calls' result; an unfinished run's database
    (a failed replay) is not, whatever it holds, so only its logged changes are compared.
    """
    console.rule("result")
    if report.error is not None:
        console.print(f"[bold red]the replay failed: {escape(report.error)}[/]")
    changes = AirlineDatabase(workspace.conversation_path(report.run_id)).applied_actions()
    turns = sum(1 for r in log.records if isinstance(r, ActionResult) and r.tool == RESPOND_TOOL)
    dot = mark("·")
    console.print(
        f"steps {len(log.steps)} {dot} tool calls {report.tool_calls} "
        f"({report.observations_matching} outputs identical to the recording) {dot} "
        f"customer turns {turns}"
    )
    console.print(
        f"crashes {report.crashes} {dot} resumes {report.resumes} {dot} "
        f"history mismatches {report.history_mismatches}"
    )
    whole = report.db_matches_recording or log.finished is None
    once = "yes" if report.applied_once and whole else "NO"
    console.print(f"database changes {len(changes)}, each applied exactly once: {once}")
    console.print(
        f"[bold]score {report.reward:.1f}[/]   recorded score {report.recorded_reward:.1f}"
    )
    console.print("look at the log:")
    console.print(f"  {escape(_show_command(report.run_id, store))}", soft_wrap=True)


# --------------------------------------------------------------------------- commands


def _demo_recording(recordings: Sequence[Recording], key: str | None) -> Recording:
    try:
        if key is not None:
            return find_recording(recordings, key)
        return pick_demo_recording(recordings)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from exc


def _announce(console: Console, recording: Recording, store: Path) -> None:
    console.print(
        f"[bold]treadle demo[/]: replaying recorded conversation task {recording.task_id}, "
        f"trial {recording.trial} ({recorded_steps(recording)} steps; GPT-4o as an airline "
        "agent, 14 tools, a simulated customer)"
    )
    console.print(f"[dim]the customer's brief: {escape(_clip(recording.task.instruction, 300))}[/]")
    console.print(
        f"[dim]model replies come from a replay server on 127.0.0.1; tools run for real on "
        f"a SQLite airline database; the run is logged in {escape(str(store))}[/]"
    )


def run_demo(store_path: str | None, data_dir: str | None, key: str | None) -> None:
    """``treadle demo``: replay a recorded conversation, SIGKILL it midway, resume it."""
    console = Console(highlight=False)
    data = _workload(data_dir, console)
    recording = _demo_recording(_recordings(data / "trajectories.json"), key)
    _check_data(data)
    _check_store(store_path)
    store = Path(store_path) if store_path is not None else _default_store("demo")
    with _said_in_one_line():
        workspace = Workspace.beside(store)
    _announce(console, recording, store)
    view = DemoView(console, workspace)
    report, log = _run(
        functools.partial(_replay_demo, recording, workspace, data, view),
        interrupted=f"{run_id_of(recording)} is left unfinished in {store}; to resume it from "
        f"its log, run: {_demo_command(store, key, data_dir)}",
    )
    if view.drivers == 0 and log.finished is not None:
        console.print(
            f"[cyan]{report.run_id} had already finished in {escape(str(store))}: nothing was "
            "run again; the figures below are the run's, from its log and its stored counts[/]"
        )
    _print_demo_summary(console, report, log, workspace, store)
    if report.error is not None:
        sys.exit(1)


async def _replay_demo(
    recording: Recording, workspace: Workspace, data: Path, view: DemoView
) -> tuple[ReplayReport, RunLog]:
    """Replay ``recording`` with the demo's crash point; its report and its log then."""
    reports = await replay_recordings(
        [recording],
        workspace=workspace,
        trajectories=(data / "trajectories.json").absolute(),
        data_dir=data,
        crash_points={recording_key(recording): demo_crash_point(recording)},
        concurrency=1,
        observer=view,
    )
    async with open_sqlite_store(workspace.store) as store:
        return reports[0], await store.read_log(run_id_of(recording))


def _demo_command(store: Path, key: str | None, data_dir: str | None) -> str:
    """The command that runs this demo again on ``store`` (and so resumes its run)."""
    words = ["treadle", "demo", "--store", str(store)]
    words += ["--recording", key] if key is not None else []
    words += ["--data", data_dir] if data_dir is not None else []
    return shell_command(words)


def _show_command(run_id: str, store: Path | str) -> str:
    """The command that shows the log of ``run_id`` in ``store``, quoted for a POSIX shell.

    docs/demo.md, "`treadle demo`": the demo ends with it, for the reader to copy; a store
    path holding a space, a quote or a control character stays the one word naming it
    (`treadle._cli_common.shell_command`).
    """
    return shell_command(["treadle", "show", run_id, "--store", str(store)])


def run_airline(
    trajectories: str | None,
    data_dir: str | None,
    store_path: str | None,
    crash: str,
    seed: int,
    concurrency: int,
    as_json: bool,
    live: bool,
    base_url: str | None,
    model: str | None,
    api_key_env: str | None,
    task_id: int | None,
) -> None:
    """``treadle demo airline``: replay recordings through treadle, or talk to a live model."""
    console = Console(highlight=False, stderr=as_json)
    data = _workload(data_dir, console)
    path = Path(trajectories) if trajectories else data / "trajectories.json"
    recordings = _recordings(path)
    _check_data(data)
    _check_store(store_path)
    if live:
        _live(console, data, recordings, store_path, base_url, model, api_key_env, task_id, as_json)
        return
    with _said_in_one_line(), open_workspace(store_path) as workspace:
        reports = _run(
            functools.partial(
                replay_recordings,
                recordings,
                workspace=workspace,
                trajectories=path.absolute(),
                data_dir=data,
                crash="random" if crash == "random" else "none",
                seed=seed,
                concurrency=concurrency,
                emit=_json_line if as_json else None,
            ),
            interrupted=_airline_interrupted(store_path),
        )
    if not as_json:
        console.print(_report_table(reports))
    console.print(_totals(reports), soft_wrap=True)
    if any(r.error is not None for r in reports):
        sys.exit(1)


def _airline_interrupted(store_path: str | None) -> str:
    if store_path is None:
        return (
            "the runs were in a temporary store, now removed; give --store PATH to keep "
            "interrupted runs and resume them by running the command again"
        )
    return (
        f"the unfinished runs are left in {store_path}; run the command again with --store "
        f"{shell_command([store_path])} to resume them (finished ones are only reported)"
    )


def _json_line(report: ReplayReport) -> None:
    click.echo(json.dumps(report.to_json(), ensure_ascii=False))
    sys.stdout.flush()


def _report_table(reports: Sequence[ReplayReport]) -> Table:
    table = Table(title="airline replays")
    for column in (
        "task",
        "trial",
        "recorded",
        "reward",
        "tool calls",
        "outputs equal",
        "mismatches",
        "crashes",
        "resumes",
        "applied once",
    ):
        table.add_column(column, justify="right")
    for r in reports:
        table.add_row(
            str(r.task_id), str(r.trial), f"{r.recorded_reward:.0f}", f"{r.reward:.0f}",
            str(r.tool_calls), str(r.observations_matching), str(r.history_mismatches),
            str(r.crashes), str(r.resumes), "yes" if r.applied_once else "NO",
        )  # fmt: skip
    return table


def _totals(reports: Sequence[ReplayReport]) -> str:
    equal = sum(1 for r in reports if r.reward == r.recorded_reward and r.error is None)
    recorded_calls = sum(r.recorded_tool_calls for r in reports)
    matching = sum(r.observations_matching for r in reports)
    share = f"{100 * matching / recorded_calls:.1f}%" if recorded_calls else "n/a"
    return (
        f"{len(reports)} recordings: reward equal to recorded {equal}/{len(reports)}; tool "
        f"outputs reproduced {matching}/{recorded_calls} ({share}); history mismatches "
        f"{sum(r.history_mismatches for r in reports)}; crashes "
        f"{sum(r.crashes for r in reports)}, resumes {sum(r.resumes for r in reports)}; "
        f"changes applied once in {sum(r.applied_once for r in reports)}/{len(reports)}; "
        f"errors {sum(r.error is not None for r in reports)}"
    )


# --------------------------------------------------------------------------- live mode


def _stdin_reader(console: Console) -> Callable[[], Awaitable[str | None]]:
    echo_off = sys.stdin.isatty()

    async def read_line() -> str | None:
        console.print("[bold blue]you>[/] ", end="")
        line: str = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line:
            console.print()
            return None
        text = line.rstrip("\r\n")
        if not echo_off:
            console.print(escape(text))  # scripted input: show it, as a terminal would
        return text

    return read_line


class _LiveStore:
    """The store of a live conversation, made once its first message came.

    Nothing is made before (docs/demo.md, "Live mode"): not for a refused option, not when
    input ends before a message.

    Attributes:
        path: the store file; ``None`` until it is made.
    """

    def __init__(self, store_path: str | None) -> None:
        self._given = store_path
        self.path: Path | None = None

    def workspace(self) -> Workspace:
        """Make the store's workspace: ``--store``, else a new file in ``./.treadle/``.

        Raises:
            StoreError: the folder beside the store cannot be made.
        """
        self.path = Path(self._given) if self._given is not None else _default_store("live")
        return Workspace.beside(self.path)

    def interrupted(self) -> str:
        """What Ctrl-C leaves: nothing before the first message, else the unfinished run."""
        if self.path is None:
            return "the conversation stops here; nothing was run"
        return (
            f"the conversation stops here; a run it began is left unfinished in {self.path} "
            f"(treadle runs --store {shell_command([str(self.path)])} lists it)"
        )


def _live(
    console: Console,
    data: Path,
    recordings: Sequence[Recording],
    store_path: str | None,
    base_url: str | None,
    model: str | None,
    api_key_env: str | None,
    task_id: int | None,
    as_json: bool,
) -> None:
    if not base_url or not model:
        raise click.UsageError("--live needs --base-url and --model")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise click.BadParameter(f"{api_key_env} is not set", param_hint="--api-key-env")
    tasks = tasks_by_id(recordings)
    if task_id is not None and task_id not in tasks:
        raise click.BadParameter(f"no task {task_id} in the recordings", param_hint="--task-id")
    task = tasks[task_id] if task_id is not None else None
    system = policy_text(data, recordings)
    try:
        client = OpenAIChatClient(base_url=base_url, api_key=api_key)
    except TreadleError as exc:
        raise click.BadParameter(str(exc), param_hint="--base-url") from exc
    store = _LiveStore(store_path)
    console.print(f"[bold]live airline agent[/] ({escape(model)} at {escape(base_url)})")
    if task is not None:
        console.print(f"[dim]you play the customer: {escape(task.instruction)}[/]")
    console.print(
        "[dim]type your messages; end a line with \\ to continue it; end the conversation "
        "with ###STOP### or end of input[/]"
    )

    def show(kind: str, text: str) -> None:
        if kind == "agent":
            console.print(f"[bold green]agent>[/] {escape(text)}")
        else:
            console.print(f"[magenta]tool[/] [dim]{escape(_clip(text, 300))}[/]")

    async def go() -> LiveReport | None:
        try:
            return await run_live(
                client=client,
                model=model,
                workspace=store.workspace,
                data_dir=data,
                system=system,
                read_line=_stdin_reader(console),
                show=show,
                task=task,
                task_id=task_id,
            )
        finally:
            await client.aclose()

    report = _run(go, interrupted=store.interrupted)
    if report is None:
        console.print("no message; nothing was run")
        return
    if as_json:
        click.echo(json.dumps(report.to_json(), ensure_ascii=False))
    reward = "" if report.reward is None else f" {mark('·')} score {report.reward:.1f}"
    console.print(
        f"run {report.run_id}: {report.state} ({report.stop_reason}), "
        f"{counted(report.steps, 'step')}, {counted(report.tool_calls, 'tool call')}{reward}"
    )
    console.print(
        f"look at the log:  {escape(_show_command(report.run_id, report.store))}", soft_wrap=True
    )
