"""``treadle approve``, ``treadle cancel`` and ``treadle tail``: acting on runs of a store.

``approve`` and ``cancel`` work from any process: they append to the run's control log, which
the process driving the run reads every 0.5 s (docs/decisions/0007-external-control.md).
``tail`` prints a run's events as they are stored, from any seq, until the run finishes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
import trio

from treadle._exceptions import TreadleError
from treadle.approvals import decide, pending_approval, request_cancel
from treadle.ports import RunStore
from treadle.stores._codec import record_to_dict
from treadle.stores.jsonl import open_jsonl_store
from treadle.stores.sqlite import open_sqlite_store
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
)

T = TypeVar("T")

TAIL_POLL_S = 0.2
"""Seconds between two reads of the store by ``treadle tail``."""

_store_option = click.option(
    "--store",
    "store_path",
    required=True,
    type=click.Path(),
    help="SQLite store file, or JSONL store directory.",
)


def _run_async(fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return trio.run(fn)
    except TreadleError as exc:
        raise click.ClickException(str(exc)) from exc


def _require_file(path: str) -> None:
    if not Path(path).exists():
        raise click.ClickException(f"no store at {path}")


@asynccontextmanager
async def _open_store(path: str) -> AsyncIterator[RunStore]:
    """A JSONL store for a directory, a SQLite store for a file."""
    if await trio.Path(path).is_dir():
        async with open_jsonl_store(path) as jsonl:
            yield jsonl
    else:
        async with open_sqlite_store(path) as sqlite:
            yield sqlite


@click.command("approve")
@click.argument("run_id")
@_store_option
@click.option("--reject", "reject", default=None, help="Reject the call with this message.")
@click.option(
    "--edit",
    "edit",
    default=None,
    help="Approve with these arguments instead (a JSON object).",
)
@click.option(
    "--call",
    "call_id",
    default=None,
    help="The call id meant; refused when the run waits on another call.",
)
def approve_command(
    run_id: str, store_path: str, reject: str | None, edit: str | None, call_id: str | None
) -> None:
    """Approve (or reject, or edit) the tool call a run waits on."""
    arguments = _json_object(edit) if edit is not None else None
    _require_file(store_path)

    async def go() -> ApprovalDecided:
        async with _open_store(store_path) as store:
            return await decide(store, run_id, call_id=call_id, reject=reject, edit=arguments)

    decided = _run_async(go)
    click.echo(
        f"{decided.decision}: call {decided.call_id} of step {decided.step} of run {run_id} "
        "(the driving process picks it up within 0.5 s)"
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--edit") from exc
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--edit")
    return value


@click.command("cancel")
@click.argument("run_id")
@_store_option
@click.option("--reason", default="", help="Why; kept in the cancel record.")
def cancel_command(run_id: str, store_path: str, reason: str) -> None:
    """Ask the process driving a run to cancel it (durable; works from any process)."""
    _require_file(store_path)

    async def go() -> None:
        async with _open_store(store_path) as store:
            await request_cancel(store, run_id, reason=reason, canceller="treadle cancel")

    _run_async(go)
    click.echo(f"cancel requested for run {run_id} (picked up within 0.5 s)")


@click.command("tail")
@click.argument("run_id")
@_store_option
@click.option(
    "--from",
    "from_seq",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="The first seq to print.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event.")
@click.option(
    "--follow/--no-follow",
    default=True,
    show_default=True,
    help="Keep printing new events until the run finishes.",
)
def tail_command(run_id: str, store_path: str, from_seq: int, as_json: bool, follow: bool) -> None:
    """Print a run's events from a seq on, live, until the run finishes."""
    _require_file(store_path)

    def show(seq: int, record: Record) -> None:
        if as_json:
            click.echo(json.dumps({"seq": seq, **record_to_dict(record)}, ensure_ascii=False))
        else:
            click.echo(format_event(seq, record))

    async def go() -> None:
        async with _open_store(store_path) as store:
            await tail(store, run_id, from_seq, show, follow=follow)

    try:
        _run_async(go)
    except KeyboardInterrupt:  # pragma: no cover - interactive
        pass


async def tail(
    store: RunStore,
    run_id: str,
    from_seq: int,
    show: Callable[[int, Record], None],
    *,
    follow: bool = True,
    poll_s: float = TAIL_POLL_S,
) -> None:
    """Call ``show(seq, record)`` for each record from ``from_seq`` on, as they are stored.

    Returns after the run-finished record (or at once without ``follow``).

    Raises:
        UsageError: the run does not exist.
    """
    from treadle._exceptions import UsageError

    next_seq = from_seq
    hinted: ApprovalRequested | None = None
    while True:
        log = await store.read_log(run_id)
        if log.started is None:
            raise UsageError(f"there is no run {run_id!r} in this store")
        for seq in range(next_seq, len(log.records) + 1):
            show(seq, log.records[seq - 1])
        next_seq = max(next_seq, len(log.records) + 1)
        if log.finished is not None or not follow:
            return
        hinted = _hint_approval(log, hinted)
        await trio.sleep(poll_s)


def _hint_approval(log: RunLog, hinted: ApprovalRequested | None) -> ApprovalRequested | None:
    request = pending_approval(log)
    if request is not None and request != hinted:
        click.echo(
            f"      … waiting for approval of {request.tool} (call {request.call_id}) until "
            f"{request.deadline_ts}: treadle approve {log.run_id} --store STORE [--reject MSG]"
        )
    return request


def format_event(seq: int, record: Record) -> str:
    """One readable line for one durable event: ``seq  step  what  detail``."""
    step = getattr(record, "step", None)
    what, detail = _describe(record)
    return f"{seq:>5}  {'' if step is None else step:>4}  {what:<20} {detail}".rstrip()


def _clip(text: str | None, limit: int = 100) -> str:
    if not text:
        return ""
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(record: Record) -> tuple[str, str]:
    if isinstance(record, RunStarted):
        first = record.input[0].content if record.input else ""
        return "run started", _clip(first)
    if isinstance(record, ModelIntent):
        return "model call started", f"attempt {record.attempt}"
    if isinstance(record, ModelResult):
        return "model call finished", _model_detail(record)
    if isinstance(record, ActionIntent):
        args = json.dumps(dict(record.arguments), ensure_ascii=False)
        return "action requested", _clip(f"{record.tool}({args})")
    if isinstance(record, ActionResult):
        late = " (late, not applied)" if record.late else ""
        outcome = record.outcome
        return "action finished", _clip(
            f"{record.tool} {outcome.status.value}{late}: {outcome.observation}"
        )
    if isinstance(record, StepRecord):
        decision = record.decision.value if record.decision else "model failed"
        return "step completed", decision + (" · task completed" if record.task_completed else "")
    if isinstance(record, ApprovalRequested):
        return (
            "approval requested",
            f"{record.tool} (call {record.call_id}) until {record.deadline_ts}",
        )
    if isinstance(record, ApprovalDecided):
        message = f": {record.message}" if record.message else ""
        return "approval decided", _clip(f"{record.decision} call {record.call_id}{message}")
    if isinstance(record, CancelRequested):
        who = f" by {record.canceller}" if record.canceller else ""
        return "cancel requested", _clip(f"{record.reason}{who}".strip())
    assert isinstance(record, RunFinished)
    return "run finished", (
        f"{record.state.value} ({record.stop_reason.value}), {record.totals.steps} steps"
    )


def _model_detail(record: ModelResult) -> str:
    usage = record.usage
    tokens = ""
    if usage.input_tokens is not None or usage.output_tokens is not None:
        tokens = f" [{usage.input_tokens} in / {usage.output_tokens} out tokens]"
    if record.abandoned:
        return "abandoned (outcome unknown after a crash)"
    if record.error is not None:
        return _clip(f"error {record.error.kind} {record.error.message}".strip()) + tokens
    reply = record.reply
    text = (reply.text or "") if reply else ""
    calls = ", ".join(c.name for c in reply.tool_calls) if reply else ""
    return _clip(f"{text} {'→ ' + calls if calls else ''}".strip()) + tokens


def register(main: click.Group) -> None:
    """Add ``approve``, ``cancel`` and ``tail`` to the ``treadle`` command group."""
    for command in (approve_command, cancel_command, tail_command):
        main.add_command(command)


def _register() -> None:
    from treadle.cli import main

    register(main)


_register()
