"""``treadle approve``, ``treadle cancel`` and ``treadle tail``: acting on runs of a store.

``approve`` and ``cancel`` work from any process: they append to the run's control log, which
the process driving the run reads every 0.5 s (docs/decisions/0007-external-control.md).
``tail`` prints a run's events as they are stored, from any seq, until the run finishes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
import trio

from treadle._cli_common import describe, open_store, run_async, store_option
from treadle.approvals import decide, pending_approval, request_cancel
from treadle.ports import RunStore
from treadle.stores._codec import record_to_dict
from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    ModelIntent,
    Record,
    RunLog,
)

TAIL_POLL_S = 0.2
"""Seconds between two reads of the store by ``treadle tail``."""


@click.command("approve")
@click.argument("run_id")
@store_option
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

    async def go() -> ApprovalDecided:
        async with open_store(store_path) as store:
            return await decide(store, run_id, call_id=call_id, reject=reject, edit=arguments)

    decided = run_async(go)
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
@store_option
@click.option("--reason", default="", help="Why; kept in the cancel record.")
def cancel_command(run_id: str, store_path: str, reason: str) -> None:
    """Ask the process driving a run to cancel it (durable; works from any process)."""

    async def go() -> None:
        async with open_store(store_path) as store:
            await request_cancel(store, run_id, reason=reason, canceller="treadle cancel")

    run_async(go)
    click.echo(f"cancel requested for run {run_id} (picked up within 0.5 s)")


@click.command("tail")
@click.argument("run_id")
@store_option
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

    def show(seq: int, record: Record) -> None:
        if as_json:
            click.echo(json.dumps({"seq": seq, **record_to_dict(record)}, ensure_ascii=False))
            return
        if isinstance(record, ModelIntent) and record.attempt == 1:
            click.echo(f"{'':>5}  {record.step:>4}  step started")
        click.echo(format_event(seq, record))

    async def go() -> None:
        async with open_store(store_path) as store:
            await tail(store, run_id, from_seq, show, follow=follow, store_path=store_path)

    try:
        run_async(go)
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
    store_path: str = "STORE",
) -> None:
    """Call ``show(seq, record)`` for each record from ``from_seq`` on, as they are stored.

    Returns after the run-finished record (or at once without ``follow``). While the run
    waits for an approval, prints the command that decides it (naming ``store_path``).

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
        hinted = _hint_approval(log, hinted, store_path)
        await trio.sleep(poll_s)


def _hint_approval(
    log: RunLog, hinted: ApprovalRequested | None, store_path: str
) -> ApprovalRequested | None:
    request = pending_approval(log)
    if request is not None and request != hinted:
        click.echo(
            f"      … waiting for approval of {request.tool} (call {request.call_id}) until "
            f"{request.deadline_ts}: treadle approve {log.run_id} --store {store_path} "
            "[--reject MSG]"
        )
    return request


def format_event(seq: int, record: Record) -> str:
    """One readable line for one durable event: ``seq  step  what  detail``."""
    step = getattr(record, "step", None)
    what, detail = describe(record)
    return f"{seq:>5}  {'' if step is None else step:>4}  {what:<20} {detail}".rstrip()


def register(main: click.Group) -> None:
    """Add ``approve``, ``cancel`` and ``tail`` to the ``treadle`` command group."""
    for command in (approve_command, cancel_command, tail_command):
        main.add_command(command)


def _register() -> None:
    from treadle.cli import main

    register(main)


_register()
