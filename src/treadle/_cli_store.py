"""``treadle runs``, ``show`` and ``resume``: a store's runs, one run's trajectory, resuming.

``runs`` lists the runs of a store with who drives each (docs/fleet.md, "Liveness"); ``show``
prints a run's log as a table or its events as JSON lines (secret arguments redacted,
docs/events.md); ``resume`` drives unfinished runs of a store to their end with a given agent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs
import click
import trio
from rich.cells import cell_len
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from treadle._cli_common import (
    agent_block,
    approval_hint,
    counted,
    describe,
    from_seq_option,
    import_spec,
    lineage_text,
    made_agent,
    not_started,
    open_store,
    printable,
    printable_json,
    redact,
    run_async,
    run_id_argument,
    store_option,
    table_console,
)
from treadle._clock import SystemClock
from treadle._exceptions import (
    LogCorrupted,
    RunLeased,
    SnapshotMismatch,
    StoreError,
    TreadleError,
)
from treadle._state import seconds_between
from treadle._terminal import on_interrupt
from treadle._text import valid_unicode
from treadle.actors import stored_events
from treadle.agent import Agent
from treadle.approvals import pending_approval, undecided_approval
from treadle.ports import RunIndex, RunStore
from treadle.redaction import Redaction
from treadle.stores import event_to_dict, finishes_cancel, is_live
from treadle.supervisors import leases_of
from treadle.types import (
    ApprovalRequested,
    Event,
    Liveness,
    RunLog,
    RunStarted,
    RunState,
    RunSummary,
)


@click.command("runs")
@store_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
@click.option(
    "--threads",
    is_flag=True,
    help="Also show each run's thread and the run it continues or forks (reads every log).",
)
@click.option(
    "--last",
    type=click.IntRange(min=1),
    default=None,
    help="Only the N runs that entered the store last (default: every run).",
)
def runs(store_path: str, as_json: bool, threads: bool, last: int | None) -> None:
    """List the runs of a store: state, who drives each, steps.

    Runs are listed in the order they entered the store. With --threads, each run's thread
    and the run it continues (or forks, and at which step) are shown too; they are read
    from each run's run-started record, so every log is read (docs/threads.md, "On the
    command line"). A table of many runs is slow to draw (about 3 ms a row): --last N
    lists the newest, --json draws no table.

    A run that cannot be read (a damaged or too-new log) is listed with its error, and the
    exit status is 1.
    """
    summaries = run_async(lambda: read_summaries(store_path, last=last))
    if len(summaries) > LONG_TABLE and not as_json:
        click.echo(
            f"{len(summaries):,} runs: drawing the table takes a while (--last N lists the "
            "newest, --json draws none)",
            err=True,
        )
    starts: dict[str, RunStarted] | None = None
    if threads:
        summaries, starts = run_async(lambda: read_starts(store_path, summaries))
    if as_json:
        for summary in summaries:
            row = summary_json(summary)
            if starts is not None:
                row.update(lineage_json(starts.get(summary.run_id)))
            click.echo(printable_json(row))
    else:
        console = table_console()
        table = runs_table(store_path, summaries, starts, width=console.width)
        console.print(table, crop=False)  # a table wider than the terminal wraps, uncut
    bad = [s for s in summaries if s.error is not None]
    if bad:
        for summary in bad:
            click.echo(
                f"unreadable run {summary.run_id} ({summary.where}): {summary.error}", err=True
            )
        raise SystemExit(1)


LONG_TABLE = 2_000
"""Runs beyond which `treadle runs` says on standard error that its table is slow to draw."""


def runs_table(
    store_path: str,
    summaries: Sequence[RunSummary],
    starts: dict[str, RunStarted] | None = None,
    *,
    width: int | None = None,
) -> Table:
    """The runs of a store as a table; run ids, states and start times are never cut.

    ``driven by`` and ``agent`` are left out when no run has one (finished runs have no
    driver, and only runs a fleet serves name their agent), so a table of finished runs fits
    80 columns.

    Args:
        store_path: the store, named in the title (a DSN's password hidden).
        summaries: the runs, one row each, in this order.
        starts: run id -> run-started record; given, a ``from`` column says which thread a
            run continues or which run and step it forks.
        width: the columns the table should fit in (the console's), or ``None`` for as many
            as it takes. Columns that do not fit are left out, the least needed first
            (`_DROPPED_FIRST`), and the caption names them. A table of the run ids, states
            and start times alone wider than ``width`` is made as wide as they need: print
            it with ``crop=False``, and the terminal wraps its lines where rich would cut
            those cells.
    """
    rows = [_printable(_row(summary, starts)) for summary in summaries]
    columns = [
        column
        for column in _RUN_COLUMNS
        if (column != "from" or starts is not None)
        and (column not in _OPTIONAL_COLUMNS or any(row[column] for row in rows))
    ]
    needs = {column: _least_width(column, rows) for column in columns}
    left_out = _left_out(needs, width)
    kept = [column for column in columns if column not in left_out]
    table = Table(title=escape(f"runs in {redact(store_path)}"))  # a path is no markup
    if left_out:
        table.caption = (
            f"not shown in {width} columns: {', '.join(left_out)} (--json lists every field)"
        )
    least = _table_width([needs[column] for column in kept])
    if width is not None and least > width:
        table.width = least  # wider than asked: rich cuts no whole column to fit
    for column in kept:
        if column in _WHOLE_COLUMNS:  # short words, never cut: the others wrap instead
            table.add_column(column, no_wrap=True, min_width=needs[column])
        else:
            table.add_column(column, overflow="fold")
    for row in rows:  # Text: a "[...]" in a cell is no markup
        table.add_row(*(Text(row[column]) for column in kept))
    return table


_RUN_COLUMNS = ("run", "state", "driven by", "agent", "steps", "stop reason", "started", "from")
_OPTIONAL_COLUMNS = frozenset({"driven by", "agent"})
_WHOLE_COLUMNS = frozenset({"run", "state", "steps", "stop reason", "started"})
_DROPPED_FIRST = ("from", "agent", "stop reason", "steps", "driven by")
"""The columns `runs_table` leaves out when the table does not fit, in that order; a column
that fits beside those kept is kept (run ids, states and start times always are)."""

FOLDED_MIN = 10
"""Characters a folded column of `runs_table` (``driven by``, ``agent``, ``from``) keeps at
least (fewer when its longest cell is shorter): narrower, it would show a few letters a line."""


def _least_width(column: str, rows: Sequence[dict[str, str]]) -> int:
    """The characters ``column`` needs: its longest cell whole, or `FOLDED_MIN` folded."""
    longest = max((cell_len(row[column]) for row in rows), default=0)
    longest = max(longest, cell_len(column))
    return longest if column in _WHOLE_COLUMNS else min(longest, FOLDED_MIN)


def _table_width(columns: Sequence[int]) -> int:
    """The width of a table of columns this wide: one space each side, a border between."""
    return sum(columns) + 2 * len(columns) + len(columns) + 1


def _left_out(needs: dict[str, int], width: int | None) -> list[str]:
    """The columns to leave out for the others to fit ``width``, in `_DROPPED_FIRST` order.

    Run ids, states and start times are kept whatever their width; then each other column,
    the most needed first, if it fits beside those kept so far.
    """
    if width is None or _table_width(list(needs.values())) <= width:
        return []
    kept = {name: need for name, need in needs.items() if name not in _DROPPED_FIRST}
    for column in reversed(_DROPPED_FIRST):
        if column in needs and _table_width([*kept.values(), needs[column]]) <= width:
            kept[column] = needs[column]
    return [column for column in _DROPPED_FIRST if column in needs and column not in kept]


def _printable(row: dict[str, str]) -> dict[str, str]:
    """``row`` with each cell `printable` (an agent name or an error is the store's text)."""
    return {column: printable(text) for column, text in row.items()}


def _row(summary: RunSummary, starts: dict[str, RunStarted] | None) -> dict[str, str]:
    """One run's cells of `runs_table`, by column."""
    started = starts.get(summary.run_id) if starts is not None else None
    return {
        "run": summary.run_id,
        "state": summary.state.value if summary.state else "unreadable",
        "driven by": driver_text(summary),
        "agent": summary.agent or "",
        "steps": str(summary.steps),
        "stop reason": summary.stop_reason.value if summary.stop_reason else "",
        "started": (summary.started_at or "")[:19].replace("T", " "),
        "from": lineage_text(started) if started else "",
    }


def driver_text(summary: RunSummary) -> str:
    """Who drives a run, in words: the lease holder, or why nobody does."""
    lease = summary.lease
    if summary.liveness is Liveness.DRIVEN and lease is not None:
        age = summary.heartbeat_age_s or 0.0
        doing = "finishing it as cancelled, " if finishes_cancel(lease.owner) else ""
        return f"{lease.owner} ({doing}gen. {lease.generation}, renewed {age:.1f} s ago)"
    if summary.liveness is Liveness.FINISHED or summary.error is not None:
        return ""  # an unreadable run is no orphan to resume: its error says why
    if summary.liveness is Liveness.QUARANTINED:
        return f"nobody: quarantined ({summary.quarantined})"
    words = {
        Liveness.QUEUED: "nobody: queued",
        Liveness.PARKED: f"nobody: parked ({parked_on(summary)[0]})",
        Liveness.ORPHANED: "nobody: orphaned",
    }
    text = words.get(summary.liveness, "nobody")
    if summary.liveness is Liveness.ORPHANED and lease is not None and lease.owner:
        text += f" (lease of {lease.owner} expired)"
    return text


def parked_on(summary: RunSummary, now: str | None = None) -> tuple[str, str]:
    """What a parked run waits on, and what makes a driver take it again, in words.

    A run parked on child runs (state ``awaiting_child``) is taken again when one of its
    children finishes, its control stream grows or its recheck instant passes; one parked on
    an approval when it is decided or its deadline passes (docs/fleet.md, "Claiming"). Once
    that deadline is past (``summary.awaiting_until`` by ``now``, ISO-8601; default: the
    system clock's) it waits for no decision: no decision written then is applied, and its
    next driver expires the call (docs/events.md, "Human approval", item 4).
    """
    if summary.state is RunState.AWAITING_CHILD:
        return (
            "waits on child runs",
            "a child's end, a cancel or its recheck instant makes a driver take it again",
        )
    until = summary.awaiting_until
    if until is not None and seconds_between(until, now or SystemClock().now_iso()) >= 0:
        return (
            "its approval deadline passed",
            "no decision is applied any more: its next driver (the process that parked it, "
            "a worker serving its agent, or treadle resume) expires the call",
        )
    return (
        "waits for a decision",
        "a decision (treadle approve) or its deadline makes a driver take it again",
    )


def summary_json(summary: RunSummary) -> dict[str, Any]:
    """A run summary as the JSON object ``treadle runs --json`` prints."""
    lease = summary.lease
    driven = summary.liveness is Liveness.DRIVEN and lease is not None
    return {
        "run_id": summary.run_id,
        "state": summary.state.value if summary.state else None,
        "liveness": summary.liveness.value,
        "driver": lease.owner if driven and lease else None,
        "generation": lease.generation if lease else None,
        "heartbeat_age_s": summary.heartbeat_age_s if driven else None,
        "agent": summary.agent,
        "agent_version": summary.agent_version,
        "steps": summary.steps,
        "stop_reason": summary.stop_reason.value if summary.stop_reason else None,
        "started": summary.started_at,
        "submitted_at": summary.submitted_at,
        "claims": summary.claims,
        "takeovers": summary.takeovers,
        "quarantined": summary.quarantined,
        "awaiting_until": summary.awaiting_until,
        "error": summary.error,
        "where": summary.where,
    }


def lineage_json(started: RunStarted | None) -> dict[str, Any]:
    """The thread keys ``treadle runs --threads --json`` adds (``None`` where not known).

    ``thread``: the run's thread (its own id for a thread's first run, a fork included);
    ``continues``: the run it starts from; ``fork_step``: the step of that run a fork tries
    again.
    """
    if started is None:
        return {"thread": None, "continues": None, "fork_step": None}
    return {
        "thread": started.thread or started.run_id,
        "continues": started.continues,
        "fork_step": started.fork_step,
    }


async def read_starts(
    store_path: str, summaries: Sequence[RunSummary]
) -> tuple[tuple[RunSummary, ...], dict[str, RunStarted]]:
    """The run-started record of each readable listed run (read from its log).

    A run whose log turns out not to be readable (damage the run index does not show, such
    as a record failing its checksum) is marked unreadable in the summaries returned, as a
    store's own listing marks one (`unreadable`): it is listed with its error, and never
    hides the other runs (docs/crash-safety.md, "Torn tails and damage").

    Returns:
        The summaries (in the same order), and run id -> run-started record.
    """
    listed: list[RunSummary] = []
    starts: dict[str, RunStarted] = {}
    async with open_store(store_path) as store:
        for summary in summaries:
            if summary.error is None and summary.started_at is not None:
                try:
                    started = (await store.read_log(summary.run_id)).started
                except StoreError as exc:
                    summary = unreadable(summary, exc)
                else:
                    if started is not None:
                        starts[summary.run_id] = started
            listed.append(summary)
    return tuple(listed), starts


def unreadable(summary: RunSummary, exc: StoreError) -> RunSummary:
    """``summary`` of a run whose log could not be read, as a store lists such a run.

    Its state is unknown (``None``, shown as ``unreadable``), ``error`` says why, and
    ``where`` names the file or table (`treadle.types.RunSummary`).
    """
    where = exc.where if isinstance(exc, LogCorrupted) else summary.where
    return attrs.evolve(summary, state=None, error=str(exc), where=where)


SHOW_TABLE_ROWS: Final = 1_000
"""Records per table `treadle show` prints. A longer log is printed as one table of that many
records after another, each as soon as it is rendered: rich measures and renders a table
whole, so one table of a 10,000-step run (50,000 records) held some 270 MB and printed
nothing for minutes. Rendering costs about 1 ms of CPU per record either way."""


@click.command("show")
@run_id_argument()
@store_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print every event as JSON, one a line (the event kinds of the Python API).",
)
@from_seq_option
@click.option(
    "--last",
    type=click.IntRange(min=1),
    help="Show only the run's last N records (not with --from).",
)
def show(run_id: str, store_path: str, as_json: bool, from_seq: int, last: int | None) -> None:
    """Show a run's trajectory as a table (or its events as JSON lines).

    A table takes about 1 ms a record to print (a 2,000-step run has some 10,000): use --last
    or --from to see part of a long run.
    """
    if last is not None and from_seq != 1:
        raise click.UsageError("--last and --from each pick the first record: give one")

    async def read() -> tuple[RunLog, str | None]:
        async with open_store(store_path) as store:
            log = await store.read_log(run_id)
            waiting = await not_started(store, run_id) if not log.records else None
            return log, waiting

    log, waiting = run_async(read)
    if waiting is not None:  # in the queue, no record written yet: no event to print
        click.echo(
            f"run {run_id} is {waiting}; it has no records yet",
            err=as_json,  # --json: stdout holds events only
        )
        return
    if not log.records:
        raise click.ClickException(f"no run {run_id!r} in {redact(store_path)}")
    count = len(log.records)
    first = max(1, count - last + 1) if last is not None else from_seq
    if first > count:
        raise click.ClickException(f"run {run_id} has {count} records: none from seq {first}")
    # A log written before text entering it was made valid Unicode may hold lone surrogates,
    # which no terminal encoding prints (docs/crash-safety.md, "Text that is not Unicode").
    log, _ = valid_unicode(log)
    if as_json:
        for event in stored_events(log, first, count):
            click.echo(printable_json(event_to_dict(event)))
        return
    console = table_console()
    for table in trajectory_tables(log, first):
        console.print(table)
    started = log.started
    if started is not None and started.continues is not None:
        click.echo(
            f"{lineage_text(started)}: the history it started from is that run's "
            f"(treadle show {started.continues})"
        )


def trajectory_table(log: RunLog) -> Table:
    """A run's whole log as one readable table: one row per record, in seq order.

    Secret tool arguments are redacted (docs/events.md, "Secret arguments"). A long log
    renders slowly as one table: `trajectory_tables` prints it in parts.
    """
    table = _trajectory_head(log, _trajectory_title(log, 1))
    _add_records(table, log, Redaction.of_log(log), range(1, len(log.records) + 1))
    return table


def trajectory_tables(log: RunLog, first: int = 1) -> Iterator[Table]:
    """Records ``first`` (a seq) to the end of ``log`` as readable tables, in seq order.

    Each table holds up to `SHOW_TABLE_ROWS` records, one row each, under the same columns;
    only the first has a title (the run, and which records when they are not all of them).
    A log of at most `SHOW_TABLE_ROWS` records from seq 1 is `trajectory_table`'s one table.
    Secret tool arguments are redacted (docs/events.md, "Secret arguments").
    """
    redaction = Redaction.of_log(log)
    end = len(log.records) + 1
    for start in range(first, end, SHOW_TABLE_ROWS):
        title = _trajectory_title(log, first) if start == first else None
        table = _trajectory_head(log, title)
        _add_records(table, log, redaction, range(start, min(end, start + SHOW_TABLE_ROWS)))
        yield table


def _trajectory_title(log: RunLog, first: int) -> str:
    """``run ID``, with the run's lineage and, from a seq past 1, the records shown."""
    notes = [lineage_text(log.started)] if log.started is not None else []
    notes = [printable(note) for note in notes if note]
    if first > 1:
        notes.append(f"records {first}-{len(log.records)} of {len(log.records)}")
    return f"run {log.run_id}" + (f" ({'; '.join(notes)})" if notes else "")


def _trajectory_head(log: RunLog, title: str | None) -> Table:
    table = Table(title=title, show_lines=False)
    table.add_column("seq", justify="right")
    table.add_column("step", justify="right")
    table.add_column("record")
    table.add_column("detail", overflow="fold")
    return table


def _add_records(table: Table, log: RunLog, redaction: Redaction, seqs: range) -> None:
    """One row per record of ``log`` at ``seqs``: seq, step, what it is, its detail."""
    for seq in seqs:
        record = log.records[seq - 1]
        step = getattr(record, "step", None)
        shown = redaction.record(record)
        cells = (str(seq), "" if step is None else str(step), *describe(shown))
        table.add_row(*map(Text, cells))  # what a tool or model wrote is never markup


@click.command("resume")
@run_id_argument(required=False)
@store_option
@click.option(
    "--agent",
    "agent_spec",
    required=True,
    help="MODULE:FACTORY: the run's treadle.Agent, a function of no arguments returning "
    "one, or returning an async context manager that yields one.",
)
@click.option("--all", "resume_all", is_flag=True, help="Resume every unfinished run instead.")
@click.option(
    "--max-concurrent",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs driven at the same time (with --all).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
@click.option(
    "--accept-changed-definition",
    "accept_change",
    is_flag=True,
    help="Go on even though the agent definition differs from the run's: the difference is "
    "written to the log first (without this flag the resume is refused).",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Wait for leases held by other drivers to expire (a driver that died lets go "
    "within its lease TTL; a live one renews and keeps its runs).",
)
def resume(
    run_id: str | None,
    store_path: str,
    agent_spec: str,
    resume_all: bool,
    max_concurrent: int,
    as_json: bool,
    accept_change: bool,
    wait: bool,
) -> None:
    """Resume an unfinished run (or every one, with --all) and print how it ended.

    Finished model calls and actions are reused, never repeated; an action whose outcome was
    lost follows its tool's replay policy. A finished run is only reported. A run another live
    driver holds the lease of is left to it (and named on standard error).
    """
    if (run_id is None) == (not resume_all):
        raise click.UsageError("give a RUN_ID or --all (not both)")
    which = run_id if run_id is not None else "what was being resumed"
    with on_interrupt(
        f"{which} is left unfinished and resumable; nothing it finished is repeated when it "
        "is resumed again"
    ):
        import_spec(agent_spec, param_hint="--agent")  # a wrong name is refused before anything
        if resume_all and accept_change:
            raise click.UsageError("--accept-changed-definition takes one RUN_ID, not --all")
        queued = 0
        if resume_all:
            logs, errors, queued = run_async(
                lambda: _resume_all(store_path, agent_spec, max_concurrent, wait)
            )
        else:
            assert run_id is not None
            logs = [
                run_async(lambda: _resume_one(store_path, agent_spec, run_id, wait, accept_change))
            ]
            errors = []
    for log in logs:
        ended = _ending(log)
        if as_json:
            click.echo(printable_json(ended))
        else:
            click.echo(
                f"{log.run_id}: {ended['state']} ({ended['stop_reason']}), "
                f"{counted(ended['steps'], 'step')}"
            )
    if resume_all and not logs and not errors and not as_json:
        waiting = f" ({counted(queued, 'run')} queued for a worker)" if queued else ""
        click.echo(
            f"nothing to resume: every run in {redact(store_path)} is finished or driven{waiting}"
        )
    if errors:
        for error in errors:
            click.echo(" ".join([*getattr(error, "__notes__", []), str(error)]), err=True)
        raise click.ClickException(f"{len(errors)} run(s) could not be resumed (see above)")


@asynccontextmanager
async def opened_agent(spec: str) -> AsyncIterator[Agent]:
    """The agent definition named ``MODULE:FACTORY`` (``--agent``), for the block's duration.

    ``FACTORY`` is a `treadle.Agent`, a function of no arguments returning one, or a function
    of no arguments returning an async context manager that yields one (the model client
    and whatever else the agent needs open, such as ``async with
    treadle.OpenAIChatClient(...)``): it is entered before the first run and left after the
    last (docs/tutorial.md, "A crash, and a resume that does not pay twice").

    Raises:
        click.BadParameter: as `made_agent` and `agent_block`.
        click.ClickException: entering the block failed (`agent_block`).
    """
    _, made = made_agent(spec)
    if isinstance(made, Agent):
        yield made
        return
    async with agent_block(spec, made) as agent:
        yield agent


async def _resume_one(
    store_path: str, agent_spec: str, run_id: str, wait: bool, accept_change: bool
) -> RunLog:
    from treadle.supervisors import run

    async with open_store(store_path) as store:
        log = await store.read_log(run_id)
        if not log.records:
            waiting = await not_started(store, run_id)
            if waiting is not None:
                raise click.ClickException(
                    f"run {run_id!r} has no records to resume: it is {waiting} (treadle worker)"
                )
            raise click.ClickException(f"no run {run_id!r} in {redact(store_path)}")
        if log.finished is not None:
            return log  # only reported: its agent is not even opened
        if wait:
            await wait_for_leases(store, [run_id])
        await hint_pending(store, log, store_path)
        async with opened_agent(agent_spec) as agent:
            try:
                await run(
                    agent,
                    store=store,
                    run_id=run_id,
                    accept_definition_change=accept_change,
                    sinks=[ApprovalHints(store_path)],
                )
            except RunLeased as exc:
                if wait:
                    raise
                raise click.ClickException(
                    f"{exc}. If that process is gone, give --wait to wait for its lease to "
                    "expire (within its TTL)"
                ) from exc
            except SnapshotMismatch as exc:
                raise click.ClickException(
                    f"{exc}. To go on with this definition, give --accept-changed-definition "
                    "(the difference is written to the run's log first)"
                ) from exc
        log = await store.read_log(run_id)
    return log


@attrs.frozen
class ApprovalHints:
    """An event sink that says on standard error when a resumed run waits for approval.

    The command that resumes the run drives it until the decision arrives (written by
    ``treadle approve`` from another terminal, or the console); without the line it would wait
    in silence. Events reach sinks redacted (docs/events.md, "Secret arguments").
    """

    store_path: str

    async def send(self, event: Event) -> None:
        """Print the hint for an ``approval_requested`` event; ignore the rest."""
        if isinstance(event.record, ApprovalRequested):
            hint = approval_hint(event.record, event.run_id, self.store_path)
            click.echo(f"{event.run_id}: {hint} (this command drives the run until then)", err=True)


async def hint_pending(store: RunStore, log: RunLog, store_path: str) -> None:
    """Say on standard error that the run of ``log``, about to be resumed, waits for approval.

    Its request is in the log already, so no event of the resume announces it. Nothing is
    said when the run's control stream holds its decision already (`undecided_approval`):
    the resume applies it without waiting.

    Raises:
        StoreError: the control stream cannot be read.
    """
    request = await undecided_approval(store, log)
    if request is not None:
        shown = Redaction.of_log(log).request(request)
        click.echo(f"{log.run_id}: {approval_hint(shown, log.run_id, store_path)}", err=True)


LEASE_POLL_S = 0.25
"""Seconds between two looks at a lease while ``--wait`` waits for it to expire."""


async def wait_for_leases(store: RunStore, run_ids: Sequence[str]) -> None:
    """Wait until the leases of ``run_ids`` are free, or until they expire as seen now.

    A driver that died lets its leases expire within their TTL; one that is alive renews
    them, and once the expiry seen at the start has passed, the wait ends (the run is then
    left to that driver).
    """
    leases = leases_of(store)
    if leases is None:
        return
    now_leases = [await leases.read_lease(run_id) for run_id in run_ids]
    clock = time.time()
    horizon = max((lease.expires_at for lease in now_leases if lease and lease.owner), default=0)
    with trio.move_on_after(max(0.0, horizon - clock) + 1.0):
        while True:
            held = [await leases.read_lease(run_id) for run_id in run_ids]
            if not any(lease is not None and is_live(lease, time.time()) for lease in held):
                return
            await trio.sleep(LEASE_POLL_S)


async def _resume_all(
    store_path: str, agent_spec: str, max_concurrent: int, wait: bool
) -> tuple[list[RunLog], list[Exception], int]:
    """Resume every unfinished run: the logs of those resumed, the errors, the queued runs.

    Queued runs (submitted, not started) are counted, not resumed: a worker starts them.
    """
    from treadle.supervisors import resume_failed, resume_unfinished

    errors: list[Exception] = []
    async with open_store(store_path) as store, opened_agent(agent_spec) as agent:
        summaries = await _summaries_of(store)
        driven = [s.run_id for s in summaries if s.liveness is Liveness.DRIVEN]
        if driven and wait:
            await wait_for_leases(store, driven)
            summaries = await _summaries_of(store)
        for summary in summaries:
            if summary.liveness is Liveness.DRIVEN:
                click.echo(
                    printable(f"{summary.run_id}: left to its driver, {driver_text(summary)}"),
                    err=True,
                )
        # What resume_unfinished takes up: every run its log says is unfinished, a run whose
        # index row is damaged (its summary an error) included, unless another driver holds it.
        unfinished = [
            s.run_id
            for s in summaries
            if s.liveness in (Liveness.ORPHANED, Liveness.PARKED)
            or (s.error is not None and await _unfinished_log(store, s.run_id))
        ]
        for summary in summaries:
            if summary.run_id in unfinished and summary.awaiting_until is not None:
                await hint_pending(store, await store.read_log(summary.run_id), store_path)
        try:
            await resume_unfinished(
                agent,
                store=store,
                max_concurrent=max_concurrent,
                sinks=[ApprovalHints(store_path)],
            )
        except ExceptionGroup as group:
            errors = list(group.exceptions)
        logs = []
        for run_id in unfinished:
            if any(resume_failed(error, run_id) for error in errors):
                continue  # reported with its error, not as a result
            try:
                log = await store.read_log(run_id)
            except TreadleError:  # its resume failed too, and that error is reported
                continue
            if log.started is not None:
                logs.append(log)
    queued = sum(s.liveness is Liveness.QUEUED for s in summaries)
    return logs, errors, queued


async def _unfinished_log(store: RunStore, run_id: str) -> bool:
    """Whether ``run_id``'s log is readable and unfinished (its index row said nothing)."""
    try:
        log = await store.read_log(run_id)
    except TreadleError:
        return False  # resume_unfinished fails it, and that error is reported
    return log.started is not None and log.finished is None


def _ending(log: RunLog) -> dict[str, Any]:
    finished = log.finished
    state = finished.state.value if finished else "unfinished"
    if finished is None and pending_approval(log) is not None:
        state = "awaiting_approval"
    return {
        "run_id": log.run_id,
        "state": state,
        "stop_reason": finished.stop_reason.value if finished else None,
        "steps": len(log.steps),
        "records": len(log.records),
        "started": log.started.ts if log.started else None,
    }


async def read_summaries(store_path: str, *, last: int | None = None) -> tuple[RunSummary, ...]:
    """Every run of the store at ``store_path`` with its state and liveness.

    ``last``: only the runs that entered the store last, the others not read
    (`treadle.ports.RunIndex.list_summaries`).
    """
    async with open_store(store_path) as store:
        return await _summaries_of(store, last=last)


async def _summaries_of(store: RunStore, *, last: int | None = None) -> tuple[RunSummary, ...]:
    if isinstance(store, RunIndex):
        return await store.list_summaries(last=last)
    raise click.ClickException(f"{type(store).__name__} keeps no run index")
