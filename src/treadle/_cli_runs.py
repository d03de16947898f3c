"""``treadle approve``, ``cancel``, ``tail`` and ``repair``: acting on runs of a store.

``approve`` and ``cancel`` work from any process: they append to the run's control stream,
which the process driving the run reads every 0.5 s (docs/decisions/0007-external-control.md),
and say truthfully what happens next: who drives the run, or that nobody does (a cancel then
finishes the run here; a decision waits until a driver claims the run). ``tail`` prints a
run's events as they are stored, from any seq, until the run finishes, and says when nobody
drives it. ``repair`` cuts a damaged JSONL log knowingly.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping

import click
import trio

from treadle._cli_common import (
    approval_hint,
    call_text,
    counted,
    describe,
    from_seq_option,
    in_queue,
    open_store,
    printable,
    printable_json,
    redact,
    run_async,
    run_id_argument,
    store_option,
)
from treadle._cli_store import parked_on
from treadle._exceptions import RunLeased, StoreError, UsageError
from treadle._terminal import mark, on_interrupt
from treadle._text import valid_unicode
from treadle.actors import durable_event, with_step_started
from treadle.approvals import (
    AlreadyDecided,
    decide,
    edited_arguments,
    pending_approval,
    request_cancel,
)
from treadle.ports import RunIndex, RunStore
from treadle.redaction import Redaction
from treadle.stores import event_to_dict, finishes_cancel, lease_owner
from treadle.stores.jsonl import JsonlStore, Repair
from treadle.supervisors import finish_cancelled_here
from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    JSONValue,
    Lease,
    Liveness,
    ModelIntent,
    Record,
    RunLog,
    RunState,
    RunSummary,
)

TAIL_POLL_S = 0.2
"""Seconds between two reads of the store by ``treadle tail``."""


@click.command("approve")
@run_id_argument()
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
    if reject is not None and edit is not None:  # a usage error, as every other one: status 2
        raise click.UsageError("give --reject or --edit, not both")
    try:
        arguments = edited_arguments(edit) if edit is not None else None
    except UsageError as exc:
        raise click.BadParameter(str(exc), param_hint="--edit") from exc

    async def go() -> tuple[ApprovalDecided, ApprovalRequested | None, str]:
        async with open_store(store_path) as store:
            return await approve(store, run_id, call_id=call_id, reject=reject, edit=arguments)

    decided, request, next_text = run_async(go)
    call = f"call {decided.call_id}"
    if request is not None:
        call = f"{call_text(request)} ({call})"
    click.echo(printable(f"{decided.decision}: {call} of step {decided.step} of run {run_id}"))
    if decided.edited_arguments is not None:
        click.echo(
            "  runs with "
            + printable_json(dict(decided.edited_arguments))
            + " instead (an edit replaces the whole argument object)"
        )
    click.echo(next_text)


async def approve(
    store: RunStore,
    run_id: str,
    *,
    call_id: str | None = None,
    reject: str | None = None,
    edit: Mapping[str, JSONValue] | None = None,
    step: int | None = None,
    arguments_digest: str | None = None,
) -> tuple[ApprovalDecided, ApprovalRequested | None, str]:
    """Decide the call ``run_id`` waits on, as ``treadle approve`` and ``treadle ui`` do.

    The decision goes to the run's control stream (`treadle.approvals.decide`, which makes
    every check, of ``step`` and ``arguments_digest`` too: the request the decider saw);
    what is returned is redacted (docs/events.md, "Secret arguments").

    A decision `decide` refuses because the control stream holds the same one already, which
    counts (`treadle.approvals.AlreadyDecided`, a double submit; `SAME_DECISION`), is answered
    as that one: the decider's intent stands (docs/events.md, "Human approval").

    Returns:
        The decision as written (or the same one that counts), the request it answers
        (``None`` when it cannot be read), and one sentence saying who applies the decision
        and when.

    Raises:
        UsageError: `treadle.approvals.decide` refused the decision (nothing is written),
            unless the same decision counts already.
        StoreError: the write failed.
    """
    log = await store.read_log(run_id)
    request = pending_approval(log)
    try:
        decided = await decide(
            store,
            run_id,
            call_id=call_id,
            reject=reject,
            edit=edit,
            step=step,
            arguments_digest=arguments_digest,
        )
    except AlreadyDecided as exc:
        if not exc.same:
            raise
        # sent twice (a double click, a command run again): the same decision counts already
        decided, request, said = exc.counting, exc.request, SAME_DECISION
    else:
        said = _next_for_decision(store, await _summary(store, run_id))
    redaction = Redaction.of_log(log)  # an edit's secrets are not echoed either
    shown = redaction.request(request) if request is not None else None
    shown_decision = redaction.record(decided)
    assert isinstance(shown_decision, ApprovalDecided)
    return shown_decision, shown, said


SAME_DECISION = (
    "the same decision was written just before this one (it was sent twice): that one counts, "
    "and this one adds nothing"
)
"""What `approve` says of a decision its run's control stream holds already, the same."""


def _next_for_decision(store: RunStore, summary: RunSummary | None) -> str:
    if summary is not None and summary.lease and finishes_cancel(summary.lease.owner):
        return (
            f"a cancel ({summary.lease.owner}) is finishing the run as cancelled now: the "
            "decision is not applied"
        )
    if summary is not None and summary.liveness is Liveness.DRIVEN and summary.lease:
        return (
            f"{summary.lease.owner} drives the run and applies the decision within about 1 s. "
            f"If that process is gone, {_expiry(store, summary.lease)}: the decision waits in the "
            "run's control stream for its next driver (`treadle resume --wait`, or a fleet "
            "worker)"
        )
    if summary is not None and summary.liveness is Liveness.PARKED:
        return (
            "the run is parked on this approval: the process that parked it (or a fleet "
            "worker serving its agent) takes it again and applies the decision within about "
            "1 s; only if no such process runs any more, resume it with `treadle resume`"
        )
    return (
        "nobody drives the run now: the decision waits in its control stream until a driver "
        "takes the run (a fleet worker claims it at once; or run `treadle resume`)"
    )


@click.command("cancel")
@run_id_argument()
@store_option
@click.option("--reason", default="", help="Why; kept in the cancel record.")
def cancel_command(run_id: str, store_path: str, reason: str) -> None:
    """Cancel a run (durable; works from any process).

    A run that a live driver holds is cancelled by that driver within about a second. A run
    that nobody drives (crashed, parked, queued, or of an agent no worker serves) is finished
    as cancelled here: this command takes its lease and writes the records a driver would.
    Exit status 1 when the cancel is refused (no such run, or one already finished), or
    when it is recorded but finishing the run here failed: the message says why, and the
    run's next driver applies the cancel.
    """

    async def go() -> str:
        async with open_store(store_path) as store:
            return await cancel(store, run_id, reason=reason, canceller="treadle cancel")

    outcome = run_async(go)
    click.echo(f"cancel requested for run {run_id}: {outcome}")


async def cancel(store: RunStore, run_id: str, *, reason: str, canceller: str) -> str:
    """Cancel ``run_id`` durably, as ``treadle cancel`` and ``treadle ui`` do.

    Appends a cancel request to the run's control stream; a run that nobody drives is
    finished as cancelled here (docs/decisions/0007-external-control.md).

    Returns:
        One sentence saying who stops the run, that it was finished here, or that its
        driver finished it cancelled meanwhile (`finish_cancelled_here` tells).

    Raises:
        UsageError: the run does not exist or already finished (also when its driver
            finished it between the request and this command's look at it).
        StoreError: the cancel request could not be stored; or it was, and finishing the run
            here failed (`_not_finished`: the message says the cancel is recorded and the
            run's next driver applies it, and why finishing failed).
    """
    await request_cancel(store, run_id, reason=reason, canceller=canceller)
    summary = await _summary(store, run_id)
    if summary is not None and summary.liveness is Liveness.DRIVEN and summary.lease:
        return _held(store, summary.lease, "drives the run")
    try:
        result, here = await finish_cancelled_here(
            store, run_id, owner=lease_owner(cancelling=True), reason=reason, canceller=canceller
        )
    except RunLeased as exc:
        return _held(store, exc.holder, "took the run meanwhile")
    except StoreError as exc:
        raise _not_finished(run_id, exc) from exc
    if here:
        return f"nobody drove the run: it is finished here, {result.state.value}"
    if result.state is not RunState.CANCELLED:  # its driver finished it meanwhile
        raise UsageError(
            f"run {run_id!r} finished {result.state.value} ({result.stop_reason.value}) before "
            "the cancel reached it: nothing was cancelled"
        )
    # its driver applied the cancel (or another canceller finished the run) before this
    # process took the run's lease
    return "its driver (or another cancel) finished it meanwhile, cancelled; not here"


def _not_finished(run_id: str, failure: StoreError) -> StoreError:
    """The error of a cancel stored in the run's control stream that could not finish it here.

    The request is durable: whoever drives the run next applies it (docs/fleet.md,
    "Cancelling and approving").
    """
    return StoreError(
        f"the cancel of run {run_id!r} is recorded, and the run's next driver applies it (a "
        "fleet worker serving its agent claims the run, or `treadle resume`); finishing the "
        f"run here failed: {failure}"
    )


def _held(store: RunStore, lease: Lease, what: str) -> str:
    """Who stops a run whose lease is held, and what happens if that process is gone.

    The holder may have crashed without releasing the lease: until it expires, nobody else
    may write the run, so the cancel waits in the control stream for the next driver. A
    lease held to finish the run as cancelled (`treadle.stores.finishes_cancel`: another
    `cancel`, of this process or another) is said as such: it names no driver.
    """
    if finishes_cancel(lease.owner):
        return f"another cancel ({lease.owner}) is finishing the run as cancelled now"
    return (
        f"{lease.owner} {what} and stops it within about 1 s. If that process is gone, "
        f"{_expiry(store, lease)}: the run's next driver applies the cancel, or run this command "
        "again then to finish the run here"
    )


def _expiry(store: RunStore, lease: Lease) -> str:
    """When a lease whose holder may be dead runs out, as a clause.

    A JSONL store's lease is an OS lock: it drops with its holder's process, no TTL to wait
    (docs/fleet.md, "Leases").
    """
    if isinstance(store, JsonlStore):
        return "its lease went with it"
    left = max(0.0, lease.expires_at - time.time())
    return f"its lease expires in about {left:.0f} s"


async def _summary(store: RunStore, run_id: str) -> RunSummary | None:
    return await store.read_summary(run_id) if isinstance(store, RunIndex) else None


@click.command("tail")
@run_id_argument()
@store_option
@from_seq_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per event (the event kinds of the Python API, step_started included).",
)
@click.option(
    "--follow/--no-follow",
    default=True,
    show_default=True,
    help="Keep printing new events until the run finishes.",
)
def tail_command(run_id: str, store_path: str, from_seq: int, as_json: bool, follow: bool) -> None:
    """Print a run's events from a seq on, live, until the run finishes."""

    def show(seq: int, record: Record) -> None:
        record, _ = valid_unicode(record)  # printable, whatever an old log holds
        if as_json:
            for event in with_step_started([durable_event(run_id, seq, record)]):
                if event.seq >= from_seq:
                    click.echo(printable_json(event_to_dict(event)))
            return
        if isinstance(record, ModelIntent) and record.attempt == 1:
            click.echo(f"{'':>5}  {record.step:>4}  step started")
        click.echo(format_event(seq, record))

    async def go() -> None:
        async with open_store(store_path) as store:
            # With --json, stdout holds only events (one JSON object a line); notes go to stderr.
            await tail(
                store,
                run_id,
                from_seq,
                show,
                follow=follow,
                store_path=store_path,
                say=functools.partial(click.echo, err=as_json),
            )

    with on_interrupt(f"stopped following run {run_id}, which is left as it was"):
        run_async(go)


async def tail(
    store: RunStore,
    run_id: str,
    from_seq: int,
    show: Callable[[int, Record], None],
    *,
    follow: bool = True,
    poll_s: float = TAIL_POLL_S,
    store_path: str = "STORE",
    say: Callable[[str], object] = click.echo,
) -> None:
    """Call ``show(seq, record)`` for each record from ``from_seq`` on, as they are stored.

    Returns after the run-finished record (or at once without ``follow``). While the run
    waits for an approval, ``say``s the command that decides it (naming ``store_path``), and
    whenever nobody drives the run, why.

    Raises:
        UsageError: the run does not exist (no records, and the queue holds it neither
            queued nor quarantined: `in_queue`), or it finished before ``from_seq``: no record
            from there on will ever come (``treadle show --from`` says the same,
            docs/events.md, "Reading events").
    """
    from treadle._exceptions import UsageError

    next_seq = from_seq
    hinted: ApprovalRequested | None = None
    said: Liveness | None = None
    while True:
        log = await store.read_log(run_id)
        summary = await _summary(store, run_id)
        if log.started is None and (summary is None or in_queue(summary) is None):
            raise UsageError(f"there is no run {run_id!r} in this store")
        if log.finished is not None and from_seq > len(log.records):
            raise UsageError(
                f"run {run_id} has {len(log.records)} records: none from seq {from_seq}"
            )
        redaction = Redaction.of_log(log)
        for seq in range(next_seq, len(log.records) + 1):
            show(seq, redaction.record(log.records[seq - 1]))
        next_seq = max(next_seq, len(log.records) + 1)
        if log.finished is not None or not follow:
            _say_liveness(summary, None, say)
            return
        hinted = _hint_approval(log, hinted, store_path, say)
        said = _say_liveness(summary, said, say)
        await trio.sleep(poll_s)


def _say_liveness(
    summary: RunSummary | None, said: Liveness | None, say: Callable[[str], object]
) -> Liveness | None:
    """Say once (and again when it changes) that nobody drives the run, and why."""
    if summary is None or summary.liveness is said:
        return said
    waits, wakes = parked_on(summary)
    queue = f"it is {in_queue(summary)}"
    words = {
        Liveness.QUEUED: queue,
        Liveness.ORPHANED: "it is orphaned: its driver died or stopped; `treadle resume` or "
        "a fleet worker takes it over",
        Liveness.PARKED: f"it is parked ({waits}): {wakes}",
        Liveness.QUARANTINED: queue,
    }
    text = words.get(summary.liveness)
    if text is not None:
        say(f"      {mark('…')} nobody drives run {summary.run_id}: {text}")
    elif said is not None and summary.liveness is Liveness.DRIVEN and summary.lease:
        say(f"      {mark('…')} {summary.lease.owner} drives run {summary.run_id} now")
    return summary.liveness


def _hint_approval(
    log: RunLog, hinted: ApprovalRequested | None, store_path: str, say: Callable[[str], object]
) -> ApprovalRequested | None:
    request = pending_approval(log)
    if request is not None and request != hinted:
        hint = approval_hint(Redaction.of_log(log).request(request), log.run_id, store_path)
        say(f"      {mark('…')} {hint}")
    return request


def format_event(seq: int, record: Record) -> str:
    """One readable line for one durable event: ``seq  step  what  detail``."""
    step = getattr(record, "step", None)
    what, detail = describe(record)
    return f"{seq:>5}  {'' if step is None else step:>4}  {what:<20} {detail}".rstrip()


@click.command("repair")
@run_id_argument(repairable=True)
@store_option
@click.option(
    "--force",
    is_flag=True,
    help="Cut even when what it removes shows a call that may have run (a resume would run "
    "it again), holds the run's end (a resume would reopen it), or the file has no header; "
    "or, in the run's control stream, a cancel or decision that still reads.",
)
def repair_command(run_id: str, store_path: str, force: bool) -> None:
    """Cut a damaged JSONL run log at its first damaged line, keeping what it removes.

    Run it knowingly: the damaged line and every line after it are removed from the log
    (saved, with a note of offset, length and SHA-256, in the store's .repairs/ directory).
    A cut that would remove a call that may have run, or the run's end, is refused
    without --force: check those calls' effects first. The run's control stream (its
    cancels and approval decisions) is cut the same way, after the log; a cut that would
    remove a cancel or decision that still reads is refused without --force. A control log
    of a version-1 store that could not be moved (listed as RUN_ID#control) is repaired by
    that name, then moved; one that waits for its run's damaged control stream is moved by
    the run's repair. A torn tail left by a crash needs no repair; the store cuts it by
    itself.
    """

    async def go() -> None:
        async with open_store(store_path) as store:
            if not isinstance(store, JsonlStore):
                raise click.ClickException("repair applies to JSONL stores")
            if await store.read_summary(run_id) is None:  # its one file, not every run's
                raise click.ClickException(f"no run {run_id!r} in {redact(store_path)}")
            log = await store.repair(run_id, owner=lease_owner(), force=force)
            if log is not None:  # said before the stream's repair, which may be refused
                click.echo(_cut_said(run_id, log, "readable record"))
            control = await store.repair_control(run_id, owner=lease_owner(), force=force)
            if control is not None:
                click.echo(
                    _cut_said(run_id, control, "readable control entry", "readable control entries")
                )
            if log is None and control is None:
                click.echo(
                    f"run {run_id}: its log and its control stream read without damage; "
                    "nothing removed"
                )

    run_async(go)


def _cut_said(run_id: str, done: Repair, one: str, many: str | None = None) -> str:
    """The line that tells what a repair removed (``one``, ``many``: its readable items)."""
    intact = (
        f", {counted(done.readable_removed, one, many)} among them" if done.readable_removed else ""
    )
    return (
        f"run {run_id}: removed {done.removed} bytes{intact} from offset {done.offset} of "
        f"{done.path} ({done.reason}); kept in {done.saved}, note {done.note}"
    )
