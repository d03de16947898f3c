"""The treadle exception tree.

::

    TreadleError
      UsageError(TreadleError, ValueError)    our API was misused (bad argument, bad definition)
        SnapshotMismatch                      resume with a different agent definition (.keys)
        InvalidRunId                          a run id outside the allowed form (.run_id)
        RepairRefused                         a log repair would cut a call that may have run
                                              or the run's end (.where); nothing was changed
        AlreadyDecided                        the approval a decision was meant for has one
                                              that counts (.request, .counting, .same)
      StoreError                              persistence failed; the run's state is unknown
        ConflictError                         a write's seq is not the next one (two writers)
        LogCorrupted                          a log cannot be read back (.offset, .unit)
        SchemaTooNew                          a log written by a newer treadle (.version)
        StoreStopped                          the store commits nothing more (its committer
                                              stopped): open it again
        StoreRefused                          the database refuses the store's statements for
                                              a reason trying again does not change (a
                                              privilege the role lacks, a table it dropped)
        StoreBusy                             another transaction kept a lock the store
                                              needed past its wait: try again later
        StoreUnavailable                      the store could not open a connection for a
                                              call (no slot free, no server): try again later
      LeaseError                              a run's lease says someone else drives it
        RunLeased                             another live driver holds the lease (.holder)
        LeaseLost                             this driver's lease was taken over; write refused
      ModelCallError                          one model call attempt failed (.info, .usage)
      RunInterrupted                          an actor crashed; the run is left resumable
      ChildRunInterrupted                     a child run stopped unfinished: the parent's
                                              call fails its drive, which is left resumable
      SeamViolation(TreadleError, TypeError)  a seam returned what its contract excludes (.seam)
      EnvironmentFailure                      raised by a tool: its environment is gone (ENV_ERROR)
      StrayCancellation                       a call raised a trio.Cancelled nothing cancelled
      StaleWrite                              raised by a writing tool: its resource changed
                                              since the model read it (NOT_EXECUTED)
      ContractViolation(TreadleError, AssertionError)
                                              the test kit found an implementation breaking a
                                              contract (the message names the rule)
        SeamContractError                     a seam contract (treadle.testing.seams)
        StoreContractError                    the run store contract (treadle.testing.contracts)
        CrashContractError                    crash recovery (treadle.testing.crashes)
      SSEDecodeError(TreadleError, ValueError)
                                              bytes that are no event stream (.offset); the
                                              clients turn it into ModelCallError
      FrameError                              a JSONL line that is no intact frame; the store
                                              turns it into LogCorrupted or cuts a torn tail
      ClientGone                              the loopback test server's client hung up early

Defined next to what raises them: `SeamContractError`, `StoreContractError` and `CrashContractError`
in their contract suites, `SSEDecodeError` in `treadle.models` (module `_sse`), `FrameError` in the
JSONL store's framing (`treadle.stores._lines`, caught there), `ClientGone` in
`treadle.testing.loopback`, `StaleWrite` in `treadle.revisions`, `AlreadyDecided` in
`treadle.approvals`; the rest here. Not errors, and so
outside the tree: the coordinator's control-flow signals `Parked`, `AwaitingChildren` and `Drained`
(a run stops being driven here, caught by the run supervisor), a child-run tool's `ChildPending`
(its call parks instead of answering, caught by the tool executor), and the test kit's
`SimulatedCrash` (a simulated process death, which must get past every handler a real death would).

Every error carries the identifiers needed to act on it as attributes. `trio.Cancelled` is
never caught or subclassed here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Literal, TypeVar

from treadle.types import Lease, ModelErrorInfo, Usage


class TreadleError(Exception):
    """Root of every error treadle raises."""


E = TypeVar("E", bound=BaseException)


def raised(exc: BaseException, kind: type[E]) -> E | None:
    """The ``kind`` exception ``exc`` is, or the first one it holds in (nested) exception groups.

    A tool that raises inside its own nursery raises a group; what it means (an environment
    failure, a stale write) is the exception inside. ``None`` when there is none.
    """
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        group = exc.subgroup(kind)
        if group is not None:
            return raised(group.exceptions[0], kind)
    return None


def innermost(error: BaseException) -> BaseException:
    """``error``, or the one error inside nested exception groups of one error each."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def message_of(exc: BaseException) -> str:
    """``str(exc)``; when its ``__str__`` raises, a note saying the message could not be read.

    For an exception from code treadle does not own (a tool, a sink): reporting it must not
    raise in turn (docs/seams.md, "Event sink").
    """
    try:
        return str(exc)
    except Exception as broken:
        return f"(its message could not be read: {type(broken).__name__})"


def only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is trio's cancellation alone: a `trio.Cancelled`, or a group of them.

    A group holding another error beside a cancellation (a task failing as it was
    cancelled) is that error's: raised on, the cancel scope takes the cancellations and the
    error goes on up.
    """
    import trio  # here: importing treadle does not import trio

    if isinstance(exc, BaseExceptionGroup):
        return all(only_cancelled(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


@contextlib.asynccontextmanager
async def one_error() -> AsyncIterator[None]:
    """Raise the only error of an exception group itself, as it was raised.

    Entered around ``trio.open_nursery()`` by a context manager that yields inside its
    nursery: an exception of the caller's block (an assertion, a misuse) or of a task of the
    nursery comes out as raised, not inside the group trio's nurseries raise; several errors
    stay a group.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class ChildRunInterrupted(TreadleError):
    """Raised by a child-run tool when its child stopped without finishing (docs/child-runs.md).

    The child's drive failed (its store, its lease) and the child is resumable; the call's
    outcome is not known yet. The tool executor does not turn it into an observation: it
    fails the parent run's drive, which is left interrupted and resumable, and a resume
    replays the call, which re-attaches to the child.

    Attributes:
        run_id: the child run.
    """

    def __init__(self, run_id: str, detail: str) -> None:
        super().__init__(f"child run {run_id!r} stopped without finishing: {detail}")
        self.run_id = run_id


class ChildPending(Exception):
    """A child-run tool's call parks its run instead of answering (a signal, not an error).

    Raised by `treadle.agent_tool` in a run a fleet worker drives, when the child it queued
    has not finished after the worker's ``park_after_s`` and the tool executor allows the
    call to park (every call of the step is ``safe`` to replay). The tool executor takes it
    as "no outcome yet"; once every call of the step has ended or parked, the run records
    `treadle.types.ChildrenAwaited` and its drive ends parked. Its resume replays the call,
    which finds the child (docs/child-runs.md, "In a fleet").

    Attributes:
        run_id: the child run the call waits on.
        recheck_s: seconds after which the parked run is claimable again even if the child
            never woke it.
    """

    def __init__(self, run_id: str, recheck_s: float) -> None:
        super().__init__(f"the call waits on child run {run_id!r}")
        self.run_id = run_id
        self.recheck_s = recheck_s


class EnvironmentFailure(TreadleError):
    """Raised by a tool when the environment itself can no longer serve.

    See docs/seams.md, "Action executor".

    The connection is gone, the protocol is broken, the sandbox died: the action becomes
    ENV_ERROR and the run ends with stop reason ``env_error``. An ordinary failure of the
    call (bad input, a command's non-zero exit) is any other exception: the model sees it.
    """


class StrayCancellation(TreadleError):
    """A call in the tool host raised `trio.Cancelled` though nothing cancelled it.

    A cancellation it caught earlier, in a scope it has left, and raised again: that is the
    call's error (its ``__cause__``), not its cancellation (docs/decisions/0025-tool-host.md).
    """


class ContractViolation(TreadleError, AssertionError):
    """The test kit found an implementation that breaks a contract; the message names it.

    An `AssertionError` too, so that pytest reports it as a failed check.
    """


class UsageError(TreadleError, ValueError):
    """The library was called with arguments or a definition it cannot accept."""


class SnapshotMismatch(UsageError):
    """A run was resumed with an agent definition whose snapshot differs from the stored one.

    Attributes:
        run_id: the run.
        keys: the differing snapshot keys, sorted.
        note: what a difference means, when it needs saying (``""``: nothing to add); the
            message ends with it.
    """

    def __init__(self, run_id: str, keys: list[str], *, note: str = "") -> None:
        super().__init__(
            f"run {run_id!r}: the agent definition differs from the stored parameter "
            f"snapshot in: {', '.join(keys)}" + (f" ({note})" if note else "")
        )
        self.run_id = run_id
        self.keys = keys
        self.note = note


class InvalidRunId(UsageError):
    """A run id that treadle does not accept (docs/concepts.md, "Run ids").

    Attributes:
        run_id: the refused id (``repr`` is safe to print, whatever it holds).
    """

    def __init__(self, run_id: object, why: str) -> None:
        shown = repr(run_id)
        super().__init__(f"invalid run id {shown[:80] + '…' if len(shown) > 80 else shown}: {why}")
        self.run_id = run_id


class StoreError(TreadleError):
    """A store operation failed; what was not acknowledged may not be durable."""


class StoreStopped(StoreError):
    """The store commits nothing more: its committer thread has stopped.

    It stops when its database stayed out of reach past the reconnect window, or a bug ended
    it. Writes and claims through this store object fail from then on (a claim with this
    error); what was acknowledged before is durable. A fleet worker ends with it, so that
    whatever supervises the worker starts it again with a fresh store (docs/fleet.md, "What
    each crash does").
    """


class StoreRefused(StoreError):
    """The database refuses the store's statements for a reason trying again does not change.

    The store's role lacks a privilege (read-only, revoked), or a table or column it needs
    is gone. A fleet worker ends with it at its claim instead of trying again for good, so
    that its supervisor reports it (docs/fleet.md, "What each crash does").
    """


class StoreBusy(StoreError):
    """Another transaction kept a lock the store needed for longer than the store waits.

    A run's row kept locked by an operator's open transaction, a table locked by a
    migration (PostgreSQL: `treadle.stores.postgres.COMMIT_LOCK_WAIT_MS`, ``CALL_LOCK_WAIT_MS``).
    Nothing of the failed write was stored; trying again once the lock is gone works. A
    fleet drive that ends on it releases its run's lease: the run's next claim is no
    takeover (docs/fleet.md, "What each crash does").
    """


class StoreUnavailable(StoreError):
    """The store could not open a connection for a call; nothing of the call was done.

    The server refused the connection (no connection slot was free: ``max_connections``, a
    role's or a database's connection limit) or could not be reached: PostgreSQL's pooled
    connections, for its reads, claims, lease and control calls (its committer reconnects on
    its own). Trying again once the server has a slot free works. A fleet drive that ends
    on it releases its run's lease: the run's next claim is no takeover, so a server short
    of connections quarantines no run (docs/fleet.md, "Poison runs").
    """


class ConflictError(StoreError):
    """A write was refused because its seq is not the next one of the run's log.

    This is what a second writer of the same run sees (docs/fleet.md: one run has one driver).

    Attributes:
        run_id: the run.
        expected: the next seq the store holds.
        got: the seq the write carried.
    """

    def __init__(self, run_id: str, *, expected: int, got: int) -> None:
        super().__init__(f"run {run_id!r}: write with seq {got}, but the next seq is {expected}")
        self.run_id = run_id
        self.expected = expected
        self.got = got


class RepairRefused(UsageError):
    """A repair of a damaged log would cut acknowledged facts; nothing was changed.

    What the cut would remove still shows a call that may have run (a readable action
    intent or result, or an unreadable line where the next intent would be), which a resume
    would run again, or the run-finished record; or the file has no treadle header
    (docs/crash-safety.md, "Torn tails and damage"). ``treadle repair --force`` cuts anyway.

    Attributes:
        where: the log's file.
    """

    def __init__(self, message: str, *, where: str) -> None:
        super().__init__(message)
        self.where = where


class LogCorrupted(StoreError):
    """A stored log cannot be decoded.

    The message ends in where the damage is, in the unit ``offset`` counts: "(at offset
    374)" for a file's byte offset, "(at seq 11)" for a record of a table, "(at position 2)"
    for an entry of a table's control stream.

    Attributes:
        where: the file or table holding the log.
        offset: byte offset (files) or seq (tables) of the first bad record, or the position
            of a control entry (tables); ``None`` when the damage is the database's own
            (SQLite found its file malformed), not a record's.
        unit: what ``offset`` counts: ``"offset"`` (bytes of a file), ``"seq"`` or
            ``"position"``.
    """

    def __init__(
        self,
        message: str,
        *,
        where: str,
        offset: int | None,
        unit: Literal["offset", "seq", "position"] = "offset",
    ) -> None:
        at = "" if offset is None else f" (at {unit} {offset})"
        super().__init__(f"{where}: {message}{at}")
        self.where = where
        self.offset = offset
        self.unit = unit


class SchemaTooNew(StoreError):
    """A log was written by a newer schema version than this treadle understands.

    Args:
        version: the version found.
        supported: the newest this treadle reads.
        what: what carries the version, for a store's layout or a file's format (a
            database, a schema, a run file), said first; ``None`` for a log record's schema.
    """

    def __init__(self, version: int, supported: int, *, what: str | None = None) -> None:
        if what is None:
            said = (
                f"log written with schema version {version}; this treadle reads up to {supported}"
            )
        else:
            said = (
                f"{what} is at version {version}, written by a newer treadle; this treadle reads "
                f"up to version {supported}: upgrade treadle to use it"
            )
        super().__init__(said)
        self.version = version
        self.supported = supported


class ModelCallError(TreadleError):
    """One model call attempt failed.

    Attributes:
        info: the classification (kind, retryable, retry_after_s, HTTP status).
        usage: usage the server reported before failing (all ``None`` when none).
        partial_text: visible text received before the failure, for diagnostics only.
    """

    def __init__(
        self, info: ModelErrorInfo, *, usage: Usage | None = None, partial_text: str = ""
    ) -> None:
        super().__init__(f"{info.kind}: {info.message}" if info.message else info.kind)
        self.info = info
        self.usage = usage if usage is not None else Usage()
        self.partial_text = partial_text


class RunInterrupted(TreadleError):
    """A run's actor failed with a bug or an outage; the run was left resumable.

    Attributes:
        run_id: the run.
    """

    def __init__(self, run_id: str, message: str) -> None:
        super().__init__(f"run {run_id!r} interrupted: {message}")
        self.run_id = run_id


class SeamViolation(TreadleError, TypeError):
    """A seam implementation returned what its contract excludes (docs/seams.md).

    A model client that returns no `treadle.types.ModelReply`, a decision parser that
    returns no `treadle.types.ParsedReply`, an executor whose ``execute`` or ``reconcile``
    returns no `treadle.types.ActionOutcome` (``None`` allowed for ``reconcile``). It is a bug
    in that implementation, not an outcome of the run: the actor that got it fails, the run
    is interrupted (`RunInterrupted`, this error as ``__cause__``) and its log is left
    resumable, with nothing recorded for the call (docs/concepts.md, "Stop reasons").

    Attributes:
        seam: which seam, e.g. ``"model client"``.
        returned: the ``repr`` of what it returned (cut to 200 characters).
    """

    def __init__(self, seam: str, returned: object, expected: str) -> None:
        shown = repr(returned)
        shown = shown[:200] + "…" if len(shown) > 200 else shown
        super().__init__(
            f"the {seam} returned {shown}, not {expected} (docs/seams.md); "
            "the run is left resumable"
        )
        self.seam = seam
        self.returned = shown


class LeaseError(TreadleError):
    """A run's lease shows that another driver drives it (docs/fleet.md, "Leases")."""


def _instant(epoch_s: float) -> str:
    try:
        return dt.datetime.fromtimestamp(epoch_s, dt.UTC).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError, TypeError):  # a damaged expiry: say it as is
        return f"at {epoch_s!r} (not a time this machine can show)"


class RunLeased(LeaseError):
    """Opening (or claiming) a run that another live driver holds the lease of.

    Attributes:
        run_id: the run.
        holder: the holder's lease (owner, generation, expiry on the store's clock).
    """

    def __init__(self, run_id: str, holder: Lease) -> None:
        super().__init__(
            f"run {run_id!r} is driven by {holder.owner} (lease generation "
            f"{holder.generation}, expires {_instant(holder.expires_at)} unless renewed)"
        )
        self.run_id = run_id
        self.holder = holder


class LeaseLost(LeaseError):
    """A write was refused: the writer's lease generation is no longer the run's current one.

    Another driver took the run over (its lease had expired), or the lease expired before its
    driver could renew it (its store too busy, its process paused), or it was released. The
    refused write stored nothing, and the driver stops without writing more.

    Attributes:
        run_id: the run.
        generation: the writer's (stale) generation.
        current: the store's current generation (``None`` when the store keeps no lease).
    """

    def __init__(self, run_id: str, *, generation: int, current: int | None) -> None:
        if current == generation:  # the same generation, no longer this driver's to hold
            why = (
                f"nobody took the run over (the store holds generation {current}), but the lease "
                "is no longer this driver's: it expired before this driver could renew it, or it "
                "was released or given another owner"
            )
        else:
            now = "no lease" if current is None else f"generation {current}"
            why = f"the store holds {now}; another driver took the run over"
        super().__init__(
            f"run {run_id!r}: this driver's lease (generation {generation}) was lost: {why}, "
            "so this one stopped without writing more"
        )
        self.run_id = run_id
        self.generation = generation
        self.current = current


def refusal_in(exc: BaseException) -> StoreRefused | None:
    """The `StoreRefused` that ``exc`` is or holds (in groups, or as a cause), if any.

    A run's write refused for a privilege its role lacks reaches the drive wrapped (in the
    run's interruption, in the engine's refusal of the run's later writes): the worker ends
    on it as on a refused claim, and the run is left to a worker that may write.
    """
    found = _held_in(exc, StoreRefused)
    return found if isinstance(found, StoreRefused) else None


def lease_lost_in(exc: BaseException) -> LeaseLost | None:
    """The `LeaseLost` that ``exc`` is or holds (in groups, or as a cause), if any."""
    found = _held_in(exc, LeaseLost)
    return found if isinstance(found, LeaseLost) else None


def busy_in(exc: BaseException) -> StoreBusy | None:
    """The `StoreBusy` that ``exc`` is or holds (in groups, or as a cause), if any."""
    found = _held_in(exc, StoreBusy)
    return found if isinstance(found, StoreBusy) else None


def unavailable_in(exc: BaseException) -> StoreUnavailable | None:
    """The `StoreUnavailable` that ``exc`` is or holds (in groups, or as a cause), if any."""
    found = _held_in(exc, StoreUnavailable)
    return found if isinstance(found, StoreUnavailable) else None


def _held_in(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        found = todo.pop()
        if id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, kind):
            return found
        if isinstance(found, BaseExceptionGroup):
            todo.extend(found.exceptions)
        todo.extend(e for e in (found.__cause__, found.__context__) if e is not None)
    return None
