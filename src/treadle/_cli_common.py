"""Helpers shared by the ``treadle`` commands.

Running trio, opening a store of either kind, and describing a record in one readable line.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shlex
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import click
import trio
from rich.console import Console

from treadle._clock import SystemClock, seconds_out_of_range
from treadle._exceptions import InvalidRunId, TreadleError, innermost, raised
from treadle._ids import check_run_id
from treadle._paths import is_directory
from treadle._state import holds_summary, seconds_between
from treadle._terminal import escape, escaped_for_output, mark
from treadle.agent import Agent
from treadle.approvals import read_control
from treadle.ports import RunIndex, RunQueue, RunStore
from treadle.stores import is_dsn, redact_dsn
from treadle.stores.jsonl import JsonlStore, open_jsonl_store
from treadle.stores.sqlite import open_sqlite_store
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ChildrenAwaited,
    DefinitionAccepted,
    Liveness,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelResult,
    Record,
    RunFinished,
    RunStarted,
    RunState,
    RunSummary,
    StepRecord,
    StopReason,
)

T = TypeVar("T")

STORE_ENV = "TREADLE_STORE"
"""The environment variable ``--store`` is read from when not given (keeps a DSN's password
out of the process list)."""


PIPED_WIDTH = 200
"""Columns of a table printed to a pipe or file when ``$COLUMNS`` does not say (rich's
default there is 80, which cut the runs table's last columns short)."""


def in_queue(summary: RunSummary, *, cancelled: bool = False) -> str | None:
    """What a run the queue holds is waiting for, to follow "run RUN is"; else ``None``.

    ``quarantined: no worker takes it until `treadle unquarantine RUN` (REASON)`` for a
    quarantined run (docs/fleet.md, "Poison runs"), started or not; ``queued (agent NAME): a
    worker serving it starts it`` for a run submitted and not started, or, when ``cancelled``
    (a cancel waits in its control stream), that such a worker finishes it cancelled without
    starting it. The one wording of `treadle show`, `tail`, `wait` and `resume` for such
    runs, so that none of them says a quarantined run will be started. What the store
    holds (the agent's name, the reason) is `printable`.
    """
    if summary.liveness is Liveness.QUARANTINED:
        return (
            f"quarantined: no worker takes it until `treadle unquarantine {summary.run_id}` "
            f"({printable(summary.quarantined or '')})"
        )
    if summary.state is RunState.QUEUED:
        agent = f" (agent {printable(summary.agent)})" if summary.agent else ""
        if cancelled:
            return (
                f"queued{agent} with a cancel waiting: a worker serving it finishes it "
                f"cancelled without starting it (`treadle cancel {summary.run_id}` does now)"
            )
        return f"queued{agent}: a worker serving it starts it"
    return None


async def not_started(store: RunStore, run_id: str) -> str | None:
    """`in_queue` of a run without records, read from the store's run index; else ``None``.

    ``None``: the store has no such run (nor a run index).

    Raises:
        StoreError: the run index cannot be read.
    """
    summary = await store.read_summary(run_id) if isinstance(store, RunIndex) else None
    if summary is None:
        return None
    control = await read_control(store, run_id) if summary.state is RunState.QUEUED else ()
    return in_queue(summary, cancelled=any(isinstance(r, CancelRequested) for r in control))


def table_console(*, stderr: bool = False) -> Console:
    """A rich console for the commands' tables: the terminal's width, `PIPED_WIDTH` piped."""
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPED_WIDTH
    return console


def _checked_store(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A store path or DSN, refused when empty (an empty ``$TREADLE_STORE`` included)."""
    if not value.strip():
        raise click.BadParameter("is empty: name a SQLite file, a JSONL folder or a DSN")
    return value


store_option = click.option(
    "--store",
    "store_path",
    required=True,
    envvar=STORE_ENV,
    show_envvar=True,
    callback=_checked_store,
    help="SQLite store file, JSONL store directory, or PostgreSQL DSN (postgresql://...).",
)
"""The ``--store PATH|DSN`` option every command that reads runs takes."""


from_seq_option = click.option(
    "--from",
    "from_seq",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="The first seq to print (a record's seq, as tail and show number them).",
)
"""The ``--from SEQ`` option of the commands that print a run's records (``tail``, ``show``)."""


def _checked_run_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A run id as docs/concepts.md, "Run ids" allows it, refused before the store is opened.

    A JSONL file's hashed name (``~<sha256>``), under which ``treadle runs`` lists a run
    whose header is damaged, passes too: the JSONL store takes it for that file.
    """
    if value is None:
        return None
    if JsonlStore.is_hashed_name(value):
        return value
    try:
        return check_run_id(value)
    except InvalidRunId as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def _repairable_run_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`_checked_run_id`, or the name of a version-1 control pseudo-run (``<run_id>#control``).

    ``treadle runs`` lists a damaged one under that name, which ``treadle repair`` takes
    (`treadle.stores.jsonl.JsonlStore.is_v1_control_name`).
    """
    if value is not None and JsonlStore.is_v1_control_name(value):
        return value
    return _checked_run_id(ctx, param, value)


def run_id_argument(
    *, required: bool = True, repairable: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``RUN_ID`` argument of the commands about one run, checked as a run id.

    ``repairable``: a version-1 control pseudo-run's name passes too (``treadle repair``).
    """
    callback = _repairable_run_id if repairable else _checked_run_id
    return click.argument("run_id", required=required, callback=callback)


def import_spec(spec: str, *, param_hint: str) -> Any:
    """Import the object named ``MODULE:NAME`` (the current directory importable).

    Raises:
        click.BadParameter: the spec is malformed, or the module or name cannot be found.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise click.BadParameter(f"{spec!r} is not MODULE:FACTORY", param_hint=param_hint)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot load {spec}: {exc}", param_hint=param_hint) from exc


def an_agent(spec: str, made: object) -> Agent:
    """``made``, checked to be the `treadle.Agent` that ``--agent``'s FACTORY gives.

    Raises:
        click.BadParameter: it is something else.
    """
    if not isinstance(made, Agent):
        raise click.BadParameter(
            f"{spec} gave {type(made).__name__}, not a treadle.Agent (nor an async context "
            "manager yielding one)",
            param_hint="--agent",
        )
    return made


def made_agent(
    spec: str,
) -> tuple[Callable[[], object], Agent | AbstractAsyncContextManager[object]]:
    """Import ``--agent``'s ``MODULE:FACTORY`` and call FACTORY once; ``(factory, made)``.

    FACTORY is a `treadle.Agent` (then ``factory`` returns it), or a function of no
    arguments returning one, or returning an async context manager that yields one
    (`agent_block` enters it). ``made`` is what the one call gave: the Agent, or the block,
    not yet entered.

    Raises:
        click.BadParameter: the spec is malformed, the name cannot be found, FACTORY is not
            callable or fails, or it gives something other than an Agent or a block.
    """
    found = import_spec(spec, param_hint="--agent")
    if isinstance(found, Agent):
        agent: Agent = found
        return (lambda: agent), agent
    if not callable(found):
        raise click.BadParameter(f"{spec} is neither an Agent nor a factory", param_hint="--agent")
    try:
        made = found()
    except Exception as exc:
        raise click.BadParameter(f"{spec}() failed: {exc}", param_hint="--agent") from exc
    if isinstance(made, AbstractAsyncContextManager):
        return found, made
    return found, an_agent(spec, made)


@asynccontextmanager
async def agent_block(
    spec: str, block: AbstractAsyncContextManager[object]
) -> AsyncIterator[Agent]:
    """Enter the block ``--agent``'s FACTORY returned (`made_agent`) and yield its Agent.

    An error of the command's body reaches the block as it leaves, and is the one reported;
    a block failing to leave after the body succeeded is a warning on standard error (the
    work was done, and is reported).

    Raises:
        click.ClickException: entering it failed (its server or client could not start);
            the message is that error's, taken out of the exception groups of one error
            a nursery in the block wraps it in.
        click.BadParameter: it yielded something other than an Agent.
    """
    stack = AsyncExitStack()
    try:
        entered = await stack.enter_async_context(block)
    except Exception as exc:
        raise click.ClickException(
            f"--agent {spec}: entering what {spec}() returned failed: {innermost(exc)}"
        ) from exc
    try:
        yield an_agent(spec, entered)
    except BaseException as exc:
        if not await stack.__aexit__(type(exc), exc, exc.__traceback__):
            raise
        return
    try:
        await stack.aclose()
    except Exception as exc:
        click.echo(
            f"warning: --agent {spec}: leaving what {spec}() returned failed: {innermost(exc)}",
            err=True,
        )


class Seconds(click.types.FloatParamType):
    """A command-line duration in seconds: a finite number >= 0 (> 0 with ``above_zero``).

    The rule of the worker's settings (`treadle._clock.seconds_out_of_range`):
    a NaN, an infinity or a negative number is refused as a usage error (exit 2) before it
    reaches a sleep or a deadline, where trio raised a traceback (and a zero poll busy-looped).
    """

    name = "seconds"

    def __init__(self, *, above_zero: bool = False) -> None:
        self.above_zero = above_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number of seconds ``value`` says; fails (exit 2) when out of range."""
        try:
            seconds = super().convert(value, param, ctx)
        except click.BadParameter:
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        why = seconds_out_of_range(seconds, above_zero=self.above_zero)
        if why is not None:
            self.fail(why, param, ctx)
        return seconds

    def __repr__(self) -> str:
        return "SECONDS"


class FiniteRange(click.FloatRange):
    """A command-line number within bounds (`click.FloatRange`), a NaN refused (exit 2).

    A NaN compares false with both bounds, so `click.FloatRange` lets it through, to be
    refused later under another option's name (``simulate --rate nan`` was blamed on
    ``--faults``) or after a store was made (``worker --lease-ttl nan``). Refused here as
    `Seconds` refuses it.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The number ``value`` says; fails (exit 2) when it is a NaN or out of range."""
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number (a NaN is refused)", param, ctx)
        return number


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn`` under trio; a treadle error becomes a clear command-line error.

    An error that reached here through nurseries (an agent factory's block that runs a
    server, say) arrives wrapped in exception groups of one error each: it is unwrapped
    first, so that it too prints as one line. Ctrl-C (a `KeyboardInterrupt`, or a
    `SystemExit`) in such a group leaves it as itself, as it leaves a trio run
    (docs/crash-safety.md, "What is guaranteed", item 8), for the command to report.
    Several treadle errors at once (a worker's runs refused by the database together)
    print as one error, each distinct message once with its count (`several_errors`).
    Anything else (a bug) keeps its traceback.
    """
    try:
        return trio.run(fn)
    except (TreadleError, BaseExceptionGroup) as exc:
        error = innermost(exc)
        if isinstance(error, TreadleError):
            raise click.ClickException(str(error)) from error
        if isinstance(error, click.ClickException):  # out of the groups a nursery made
            raise error from exc
        stopping = raised(exc, KeyboardInterrupt) or raised(exc, SystemExit)
        if stopping is not None:
            raise stopping from None
        if isinstance(error, BaseExceptionGroup):
            message = several_errors(error)
            if message is not None:
                raise click.ClickException(message) from exc
        raise


def several_errors(group: BaseExceptionGroup[BaseException]) -> str | None:
    """One message for a group of treadle errors, or ``None`` if any other error is in it.

    Each distinct message appears once, in the order first raised, with ``(N times)`` when
    it was raised more than once: the 4 runs a worker had refused by the database for the
    same reason print that reason once, not four tracebacks (docs/fleet.md, "What each
    crash does": ``treadle worker`` prints the refusal and exits 1).
    """
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending[:0] = error.exceptions
        else:
            leaves.append(error)
    if not leaves or not all(isinstance(error, TreadleError) for error in leaves):
        return None
    counts = Counter(str(error) for error in leaves)
    lines = [text if n == 1 else f"{text} ({n} times)" for text, n in counts.items()]
    if len(lines) == 1:
        return lines[0]
    return f"{len(leaves)} errors at once:\n" + "\n".join(f"  {line}" for line in lines)


@asynccontextmanager
async def open_store(path: str, *, create: bool = False) -> AsyncIterator[RunStore]:
    """A PostgreSQL store for a DSN, a JSONL store for a directory, a SQLite store for a file.

    Args:
        path: the DSN or path.
        create: make a store when nothing exists at ``path`` (``treadle worker`` and
            ``treadle submit`` may start a store, a PostgreSQL one's or a SQLite one's
            tables included; the reading commands never do, and change nothing at a
            ``path`` that holds no store: docs/fleet.md, "Stores").

    Raises:
        click.ClickException: nothing exists at ``path``, or a folder there holds no JSONL
            store (and ``create`` is false).
        StoreError: ``path`` cannot be looked at (a folder without permission); a file or
            a database there holds no treadle tables (and ``create`` is false).
    """
    if is_dsn(path):
        from treadle.stores.postgres import open_postgres_store

        async with open_postgres_store(path, create=create) as postgres:
            yield postgres
    elif await trio.to_thread.run_sync(is_directory, path):
        if not create and not await trio.to_thread.run_sync(JsonlStore.is_store, path):
            raise click.ClickException(
                f"no store at {path}: the folder holds no JSONL store (a JSONL store's folder "
                "holds .leases/ and .control/ and a file per run)"
            )
        async with open_jsonl_store(path) as jsonl:
            yield jsonl
    elif create or await trio.Path(path).is_file():
        async with open_sqlite_store(path, create=create) as sqlite:
            yield sqlite
    else:
        raise click.ClickException(f"no store at {path}")


@asynccontextmanager
async def open_queue(path: str) -> AsyncIterator[RunStore]:
    """The store with a queue at ``path`` for ``treadle submit`` and ``treadle worker``.

    A SQLite or PostgreSQL store, made when nothing is there yet (`open_store` with
    ``create``). The kind is decided from ``path`` before anything is made: a folder (a JSONL
    store's, which has no queue, or any other) is refused as it is, never made a JSONL store
    first (docs/fleet.md, "Stores"). The store yielded is a `treadle.ports.RunQueue`.

    Raises:
        click.ClickException: ``path`` is a folder, or the store there has no queue.
        StoreError: as `open_store`.
    """
    if not is_dsn(path) and await trio.to_thread.run_sync(is_directory, path):
        raise click.ClickException(_no_queue(path))
    async with open_store(path, create=True) as store:
        if not isinstance(store, RunQueue):
            raise click.ClickException(_no_queue(path))
        yield store


def _no_queue(path: str) -> str:
    return f"{redact(path)} has no queue (use SQLite or PostgreSQL)"


def bare_host(host: str) -> str:
    """``host`` as a socket binds it: an IPv6 literal without the brackets a URL gives it.

    ``[::1]`` and ``::1`` both give ``::1``; a name or an IPv4 address is returned as is.
    """
    return host.strip("[]")


def url_host(host: str) -> str:
    """``host`` as a URL or a ``Host`` header names it: an IPv6 literal in brackets.

    ``::1`` and ``[::1]`` both give ``[::1]`` (RFC 3986, "Host"); a name or an IPv4 address
    is returned as is.
    """
    bare = bare_host(host)
    return f"[{bare}]" if ":" in bare else bare


def redact(store: str) -> str:
    """A store path or DSN as it may be shown: a password in a DSN is replaced by ``***``."""
    return redact_dsn(store)


def clip(text: str | None, limit: int = 100) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis (`mark`)."""
    if not text:
        return ""
    text = text.replace("\n", " ")
    if len(text) <= limit:
        return text
    ellipsis = mark("…")
    return text[: limit - len(ellipsis)] + ellipsis


def lineage_text(started: RunStarted) -> str:
    """Which thread a run belongs to or which run it forks, in words (docs/threads.md).

    ``""`` for a run that continues nothing, e.g. ``thread t, continues t.2`` or
    ``fork of r at step 3``.
    """
    from treadle.supervisors import Lineage  # loaded with the commands that show runs

    lineage = Lineage.of(started)
    return lineage.describe() if lineage is not None else ""


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Control characters (an escape sequence's ESC included) and the bidirectional controls."""


def printable(text: str) -> str:
    r"""``text`` safe to print on a terminal: each control character written as an escape.

    What a model or a tool wrote reaches ``show`` and ``tail``: an escape sequence in it
    would set the terminal's title or colours, a carriage return overwrite a line, a
    bidirectional control reorder what follows. Each is shown as ``\xNN`` (``\uNNNN``).
    A character the output's encoding lacks (a Chinese one on a Latin-1 terminal) is
    escaped too, as ``\uNNNN`` (`treadle._terminal.escaped_for_output`).
    """
    return escaped_for_output(_UNPRINTABLE.sub(_escaped, text))


def printable_json(value: object) -> str:
    r"""``value`` as JSON text safe to print on a terminal, decoding to the same value.

    `json.dumps` escapes C0 controls but leaves DEL, the C1 controls (U+009B starts an escape
    sequence on some terminals) and the bidirectional controls raw; each is written here as
    a JSON escape (``\u202e``), as a character the output's encoding lacks is
    (`treadle._terminal.escape`).
    """
    return _UNPRINTABLE.sub(lambda match: escape(match[0]), json.dumps(value, ensure_ascii=False))


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shell_command(words: Sequence[str]) -> str:
    r"""``words`` as one printable command line for a POSIX shell, to be copied and run.

    Each word is quoted as `shlex.join` quotes it (``'my runs.db'``), unless it holds a
    character `printable` would escape (a control character, one the output's encoding
    lacks, a lone surrogate standing for an undecodable byte of a file name): such a word is
    written in dollar-single-quotes (POSIX.1-2024; bash, zsh, ksh), each of those characters as
    the three-digit octal escapes of its bytes in the file system's encoding (``$'tab\011x'``),
    so that the copied command names the same file (docs/events.md, "Reading events").
    """
    return " ".join(map(_shell_word, words))


def _shell_word(word: str) -> str:
    """One word of `shell_command`: `shlex.quote`'s, or dollar-single-quoted."""
    if all(map(_prints_as_is, word)):
        return shlex.quote(word)
    return "$'" + "".join(map(_dollar_quoted, word)) + "'"


def _prints_as_is(char: str) -> bool:
    """Whether `printable` leaves ``char`` as it is, and it stands for a character of its own."""
    return not "\ud800" <= char <= "\udfff" and printable(char) == char


def _dollar_quoted(char: str) -> str:
    r"""``char`` inside ``$'...'``: as is, backslash-escaped (``\\``, ``\'``), or in octal."""
    if char in "\\'":
        return "\\" + char
    if _prints_as_is(char):
        return char
    return "".join(f"\\{byte:03o}" for byte in os.fsencode(char))


def describe(record: Record) -> tuple[str, str]:
    """What a record is and its detail, for tables and ``tail`` lines (printable text)."""
    what, detail = _describe(record)
    return what, printable(detail)


def _describe(record: Record) -> tuple[str, str]:
    if isinstance(record, RunStarted):
        first = record.input[0].content if record.input else ""
        origin = lineage_text(record)
        if record.parent_run_id is not None:  # a child run: its parent's call first
            parent = f"child of {record.parent_run_id} (call {record.parent_intent_id})"
            origin = f"{parent} {mark('·')} {origin}" if origin else parent
        return "run started", clip(f"{origin} {mark('·')} {first}" if origin else first)
    if isinstance(record, ModelIntent):
        if record.compaction:
            return "summary call started", f"attempt {record.attempt}"
        return "model call started", f"attempt {record.attempt}"
    if isinstance(record, ModelResult):
        if record.summary_through is not None:
            return _summary_result(record)
        return "model call finished", _with_context(record, model_detail(record))
    if isinstance(record, ActionIntent):
        args = json.dumps(dict(record.arguments), ensure_ascii=False)
        return "action requested", clip(f"{record.tool}({args})")
    if isinstance(record, ActionResult):
        # late: the run stopped waiting for the call; a cut step's are not applied, a call
        # abandoned at its timeout is (docs/decisions/0137-late-is-the-runs-wait-not-a-verdict.md)
        late = " (late: the run stopped waiting for it)" if record.late else ""
        late += " (reconciled after a crash, not run here)" if record.reconciled else ""
        outcome = record.outcome
        if outcome.stale_resource:
            late += f" (stale: {outcome.stale_resource} changed since it was read)"
        if outcome.revisions:
            seen = ", ".join(f"{key}@{rev}" for key, rev in outcome.revisions.items())
            late += f" (read {seen})"
        if outcome.child_run_id is not None:
            late += f" (child run {outcome.child_run_id})"
        return "action finished", clip(
            f"{record.tool} {outcome.status.value}{late}: {outcome.observation}"
        )
    if isinstance(record, StepRecord):
        decision = record.decision.value if record.decision else "model failed"
        if record.repairs:
            decision += f" {mark('·')} repaired: " + ", ".join(record.repairs)
        decision += f" {mark('·')} task completed" if record.task_completed else ""
        if record.output is not None:
            output = json.dumps(record.output)
            return "step completed", clip(f"{decision} {mark('·')} output {output}")
        return "step completed", decision
    if isinstance(record, ApprovalRequested):
        return (
            "approval requested",
            clip(f"{call_text(record)} (call {record.call_id}) until {record.deadline_ts}"),
        )
    if isinstance(record, ApprovalDecided):
        message = f": {record.message}" if record.message else ""
        if record.edited_arguments is not None:
            message += " with " + json.dumps(dict(record.edited_arguments), ensure_ascii=False)
        return "approval decided", clip(f"{record.decision} call {record.call_id}{message}")
    if isinstance(record, CancelRequested):
        who = f" by {record.canceller}" if record.canceller else ""
        return "cancel requested", clip(f"{record.reason}{who}".strip())
    if isinstance(record, ChildrenAwaited):
        return "children awaited", clip(
            f"parked on {', '.join(record.children)} (call {', '.join(record.intent_ids)}); "
            f"claimable again when one ends, or at {record.recheck_ts}"
        )
    if isinstance(record, DefinitionAccepted):
        return "definition accepted", clip(
            f"{record.agent_version or 'unversioned'}, changed: {', '.join(record.changed)}"
            + (f" (by {record.accepted_by})" if record.accepted_by else "")
        )
    assert isinstance(record, RunFinished)
    undelivered = [
        counted(count, *what)
        for count, what in (
            (record.sink_failures, ("sink failure", "sink failures")),
            (record.sink_drops, ("event dropped for slow sinks", "events dropped for slow sinks")),
            (record.subscriber_drops, ("subscriber cut off", "subscribers cut off")),
        )
        if count
    ]
    ending = f"{record.state.value} ({record.stop_reason.value})"
    failure = record.model_error
    if failure is not None:
        ending += clip(f": {failure.kind} {_with_status(failure)}".rstrip())
    shown = [ending, counted(record.totals.steps, "step"), *undelivered]
    unknown = record.totals.unknown_usage_attempts
    if unknown and record.stop_reason is StopReason.TOKEN_BUDGET:  # docs/decisions/0114
        shown.insert(1, counted(unknown, "model attempt") + " reported no usage")
    if record.output is not None:
        shown.append("output " + json.dumps(record.output, ensure_ascii=False))
    return "run finished", ", ".join(shown)


def _with_status(failure: ModelErrorInfo) -> str:
    """A model failure's message with its HTTP status: ``HTTP 500: boom``, said once.

    The clients' messages for a status start with it already (``HTTP 500: ...``); a
    message that does not gets it in front.
    """
    if failure.status is None:
        return failure.message
    status = f"HTTP {failure.status}"
    if failure.message == status or failure.message.startswith(status + ":"):
        return failure.message
    return f"{status} {failure.message}".rstrip()


def call_text(request: ApprovalRequested) -> str:
    """``tool({"arg": ...})``: the call an approval request is about, as shown to approvers.

    Pass a redacted request (`treadle.redaction.Redaction.request`): this prints what it is
    given. A request from a log written before requests carried their arguments shows
    ``tool(…)`` (`mark`). The text is `printable`, its arguments `printable_json`.
    """
    if request.arguments is None:
        return printable(f"{request.tool}({mark('…')})")
    return printable(f"{request.tool}({printable_json(dict(request.arguments))})")


def approval_hint(
    request: ApprovalRequested, run_id: str, store_path: str, *, now: str | None = None
) -> str:
    """The line telling how to answer ``request`` of ``run_id`` from the command line.

    Pass a redacted request, as for `call_text`. The line is printable; its command is
    `shell_command`'s, so a store path holding a space, or a control character, stays the
    one word naming that path when the command is copied (docs/events.md, "Reading events").
    Once the request's deadline passed (``now``, ISO-8601; default: the system clock's),
    no decision can be given any more: the line says the wait ended instead, and names no
    command (docs/events.md, "Human approval", item 4).
    """
    call = f"{call_text(request)} (call {request.call_id})"
    if deadline_passed(request, now):
        return printable(
            f"the wait for approval of {call} ended at {request.deadline_ts}: a decision "
            "written now is never applied; the run's next drive expires the call (or applies "
            "a decision written before then)"
        )
    command = shell_command(["treadle", "approve", run_id, "--store", redact(store_path)])
    waiting = printable(f"waiting for approval of {call} until {request.deadline_ts}")
    return f"{waiting}: {command} [--reject MSG | --edit JSON]"


def deadline_passed(request: ApprovalRequested, now: str | None = None) -> bool:
    """Whether ``request``'s approval deadline is past at ``now`` (default: the system clock's).

    The same test a drive that begins makes before it expires the call
    (`treadle.approvals.expire_overdue`).
    """
    return seconds_between(request.deadline_ts, now or SystemClock().now_iso()) >= 0


def counted(count: object, one: str, many: str | None = None) -> str:
    """``"1 step"``, ``"2 steps"``: ``count`` with ``one`` or ``many`` (default ``one + "s"``)."""
    return f"{count} {one if count == 1 else (many or one + 's')}"


def _summary_result(record: ModelResult) -> tuple[str, str]:
    """A summary call's result: ``summary written``, or ``summary failed`` with its error.

    Only a reply holding text is a summary (docs/context.md, "Summaries"): a failed attempt
    (an error, a budget's cut, or a reply with no text) is not; the row says which, with the
    context of the summariser's request as other model rows show theirs (an ``unfit`` one
    included).
    """
    assert record.summary_through is not None  # a summary call's result
    covered, detail = covered_turns(record.summary_through), model_detail(record)
    if holds_summary(record.reply):
        return "summary written", _with_context(record, f"{covered}: {detail}")
    if record.error is None:  # an older log's reply without a summary in it
        detail = f"no summary text {detail}".strip()
    return "summary failed", _with_context(record, f"{covered}: {detail}")


def _with_context(record: ModelResult, detail: str) -> str:
    """``detail``, then the context the call was given when the record holds one."""
    if record.context is None:
        return detail
    return f"{detail} {mark('·')} {context_detail(record)}"


def covered_turns(step: int) -> str:
    """``steps 1-4``, or ``turns up to -2`` for a thread's inherited turns.

    Those are numbered up to 0 (docs/context.md, "What stays").
    """
    return f"steps 1-{step}" if step > 0 else f"turns up to {step}"


def marked_range(first: int | None, last: int | None) -> str:
    """Where markers replaced observations: `` of steps 8-20``, or `` of turns -12 to -1``.

    A thread's inherited turns are numbered up to 0 (docs/context.md, "What stays"); a range
    from them into the run's own steps reads `` of turns -12 to 0 and steps 1-3``. ``""`` when
    the record holds no range.
    """
    if first is None or last is None:
        return ""
    if first > 0:
        return f" of steps {first}-{last}"
    if last <= 0:
        return f" of turns {first} to {last}"
    return f" of turns {first} to 0 and steps 1-{last}"


def verbatim_text(first: int) -> str:
    """Where a request's verbatim history starts: ``steps 8- verbatim``, ``turns -3 on verbatim``.

    A thread's inherited turns are numbered up to 0 (docs/context.md, "What stays").
    """
    return f"steps {first}- verbatim" if first > 0 else f"turns {first} on verbatim"


def context_detail(record: ModelResult) -> str:
    """The context a model call was given, in one line (docs/context.md, "The record")."""
    context = record.context
    if context is None:
        return ""
    parts = [f"context {context.estimated_input_tokens} est"]
    if record.usage.input_tokens is not None:
        parts[0] += f" / {record.usage.input_tokens} reported"
    parts[0] += f" of {context.budget} tokens"
    if context.verbatim_from is not None:
        parts.append(verbatim_text(context.verbatim_from))
    if context.summary_intent_id is not None and context.summary_through is not None:
        through = covered_turns(context.summary_through).removeprefix("steps ")
        parts.append(f"summary of {through} ({context.summary_intent_id})")
    if context.marked:
        marked = marked_range(context.marked_from, context.marked_to)
        parts.append(f"{context.marked} observations{marked} elided")
    if context.truncated:
        parts.append(f"{context.truncated} cut to fit")
    if context.forced:
        parts.append("compacted after a context-length refusal")
    if context.unfit:
        parts.append("over budget: what cannot be cut does not fit")
    return ", ".join(parts)


def model_detail(record: ModelResult) -> str:
    """A model-call result in one line: text, refusal, tools, finish reason, usage, or error.

    The finish reason is shown when it is not the ordinary ``stop`` or ``tool_calls``, with
    the server's own value: ``finish content_filter (refusal)`` (docs/models.md, "Replies,
    finish reasons, reasoning").
    """
    usage = record.usage
    tokens = ""
    if usage.input_tokens is not None or usage.output_tokens is not None:
        cache = [
            f"{count} {what}"
            for count, what in (
                (usage.cached_input_tokens, "cached"),
                (usage.cache_creation_input_tokens, "written to cache"),
            )
            if count
        ]
        cached = f" ({', '.join(cache)})" if cache else ""
        tokens = f" [{usage.input_tokens} in{cached} / {usage.output_tokens} out tokens]"
    elif usage.total_tokens is not None:  # a server that reports only a total
        tokens = f" [{usage.total_tokens} tokens in total]"
    if record.abandoned:
        return "abandoned (outcome unknown after a crash)"
    if record.error is not None:
        return clip(f"error {record.error.kind} {_with_status(record.error)}".strip()) + tokens
    reply = record.reply
    text = (reply.text or "") if reply else ""
    if reply is not None and reply.refusal:
        text = f"{text} refused: {reply.refusal}".strip()
    calls = ", ".join(c.name for c in reply.tool_calls) if reply else ""
    called = f"{mark('→')} {calls}" if calls else ""
    shown = f"{text} {called}".strip()
    finish = _unusual_finish(reply)
    if finish:
        shown = f"{shown} {mark('·')} {finish}" if shown else finish
    return clip(shown) + tokens


def _unusual_finish(reply: ModelReply | None) -> str:
    """``finish length (max_tokens)``: a reply's unusual finish reason, or ``""``.

    ``""`` for ``stop``, ``tool_calls`` and none; the server's own value is in parentheses
    when it differs from the standard one.
    """
    if reply is None or reply.finish_reason in (None, "stop", "tool_calls"):
        return ""
    own = f" ({reply.provider_finish_reason})" if reply.provider_finish_reason else ""
    return f"finish {reply.finish_reason}{own}"
