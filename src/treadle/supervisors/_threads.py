"""Threads and forks: which run a new run continues, and the history a run ended with.

A **thread** is a conversation: runs that each continue the previous one with a new user
message. Its id is the id of its first run; its n-th run (n >= 2) has the id
``<thread id>.<n>`` (`thread_run_id`), so the thread's latest run is the one with the
highest n, and two callers continuing the same thread at once name the same new run (one of
them is refused; docs/decisions/0055-thread-ids.md). A **fork** is a new run that starts from
another run's history before one of its steps and tries that step again.

Neither copies history: the new run's run-started record names the run it continues
(``continues``, with ``thread`` or ``fork_step``) and the context hydrator reads that run's
history from the store (`treadle.actors.recorded_history`; docs/threads.md).
"""

from __future__ import annotations

import attrs

from treadle._exceptions import InvalidRunId, StoreError, UsageError
from treadle._ids import check_run_id
from treadle._text import valid_unicode
from treadle.actors import read_continued, recorded_history
from treadle.agent import RunInput, input_messages
from treadle.ports import RunIndex, RunStore
from treadle.types import Message, RunLog, RunStarted


@attrs.frozen(kw_only=True)
class Lineage:
    """What a new run's run-started record says it continues (docs/threads.md).

    Attributes:
        continues: the run whose recorded history the new run starts from.
        thread: the thread's id, for a thread's run; ``None`` for a fork.
        fork_step: for a fork, the step of ``continues`` tried again; ``None`` for a thread.
    """

    continues: str
    thread: str | None = None
    fork_step: int | None = None

    @classmethod
    def of(cls, started: RunStarted) -> Lineage | None:
        """The lineage a stored run-started record carries, ``None`` for none."""
        if started.continues is None:
            return None
        return cls(continues=started.continues, thread=started.thread, fork_step=started.fork_step)

    def describe(self) -> str:
        """In words, e.g. ``thread t1, continues t1.2`` or ``fork of r1 at step 3``."""
        if self.fork_step is not None:
            return f"fork of {self.continues} at step {self.fork_step}"
        return f"thread {self.thread}, continues {self.continues}"


def thread_run_id(thread_id: str, n: int) -> str:
    """The id of the ``n``-th run of thread ``thread_id`` (the first run's id for n = 1).

    Raises:
        InvalidRunId: the id would be too long (docs/concepts.md, "Run ids").
    """
    return thread_id if n == 1 else check_run_id(f"{thread_id}.{n}")


def thread_named(run_id: str) -> tuple[str, int] | None:
    """The thread and number ``run_id`` names a run of (``T`` and n for ``T.n``, n >= 2).

    ``None`` for an id of no such form: without a dot, or whose last part after one is not
    a number from 2 written as `thread_run_id` writes it (no sign, no leading zero).
    """
    thread_id, dot, number = run_id.rpartition(".")
    if not dot or not thread_id or not (number.isascii() and number.isdigit()):
        return None
    if number.startswith("0") or int(number) < 2:
        return None
    return thread_id, int(number)


async def check_thread_name_free(
    store: RunStore, run_id: str, read: tuple[RunLog, ...] = ()
) -> None:
    """Refuse to start a run of no thread under the name of a thread's run.

    ``run_id`` must not exist yet. A run named ``T.n`` (n >= 2, `thread_named`) while run
    ``T`` exists as a run that can start a thread (it continues no thread) would stop that
    thread for good when it reaches n: `next_in_thread` refuses a run of that name that is
    not the thread's (docs/threads.md, "Threads";
    docs/decisions/0141-a-thread-runs-name-is-the-threads.md). Any other id reads nothing.

    Args:
        store: the store.
        run_id: the new run's id.
        read: logs read already, taken instead of reading ``T`` again.

    Raises:
        UsageError: ``run_id`` is the name of a run of thread ``T`` (the message names it).
    """
    named = thread_named(run_id)
    if named is None:
        return
    thread_id, n = named
    root = next((log for log in read if log.run_id == thread_id), None)
    if root is None:
        root = await store.read_log(thread_id)
    if root.started is None or root.started.thread is not None:
        return
    raise UsageError(
        f"run id {run_id!r} is the name of run {n} of thread {thread_id!r} (a thread names "
        'its runs, docs/threads.md, "Threads"), and taking it would stop that thread: give '
        "this run another id"
    )


async def next_in_thread(
    store: RunStore, thread_id: str, input: RunInput | None
) -> tuple[str, Lineage, tuple[RunLog, ...]]:
    """The run a call continuing thread ``thread_id`` with ``input`` drives, and its lineage.

    That is the thread's next run, continuing its latest run (which must be finished). When the
    latest run is unfinished and was started with this same input, it is that run: the call
    resumes it (a retry after a crash starts nothing twice).

    Returns:
        The run's id, its lineage, and the logs read to find them (the thread's first run
        and its latest), for the check of the chain to take instead of reading them again.
        Besides those two logs, finding the latest run asks about a few run ids only
        (`_latest_number`), and looks past a gap in the thread's numbers.

    Raises:
        UsageError: no input; the thread does not exist; ``thread_id`` names a run of
            another thread (the message names that thread); a run named like the thread's
            next run belongs to no thread or another one; the latest run is not finished
            and was started with another message (the message names it and its state).
        InvalidRunId: the thread's next run's id would be longer than a run id may be
            (docs/decisions/0055-thread-ids.md, "Consequences").
        StoreError: a run of the thread cannot be read or is missing, its first run
            included (the message names the run that continues it, or would:
            docs/threads.md, "When a thread cannot go on").
    """
    check_run_id(thread_id)
    if input is None:
        raise UsageError(f"continuing thread {thread_id!r} needs an input (the new message)")
    root = await read_continued(store, thread_id, f"{thread_id}.2")
    if root.started is None:
        await _check_no_second_run(store, thread_id)
        raise UsageError(f"thread {thread_id!r} does not exist: no run {thread_id!r} in the store")
    if root.started.thread is not None:
        raise UsageError(
            f"run {thread_id!r} is a run of thread {root.started.thread!r}; continue the "
            f"thread with thread_id={root.started.thread!r}"
        )
    n = await _latest_number(store, thread_id)
    latest_id, latest = thread_id, root
    if n > 1:
        latest_id = thread_run_id(thread_id, n)
        latest = await read_continued(store, latest_id, f"{thread_id}.{n + 1}")
        if latest.started is None or latest.started.thread != thread_id:
            raise UsageError(
                f"run {latest_id!r} exists but is not a run of thread {thread_id!r}; "
                "the thread cannot go on under that name"
            )
    candidate = thread_run_id(thread_id, n + 1)
    read = (root,) if n == 1 else (root, latest)
    if latest.finished is None:
        started = latest.started
        assert started is not None
        if n > 1 and valid_unicode(input_messages(input))[0] == started.input:
            lineage = Lineage.of(started)
            assert lineage is not None
            return latest_id, lineage, read
        raise UsageError(
            f"thread {thread_id!r}: its latest run {latest_id!r} is not finished "
            f"({_state(latest)}); wait for it or resume it before continuing the thread"
        )
    return candidate, Lineage(continues=latest_id, thread=thread_id), read


async def _check_no_second_run(store: RunStore, thread_id: str) -> None:
    """Refuse a thread whose first run is missing but whose second run is stored.

    Its first run's log was removed: the thread exists, and cannot go on (docs/threads.md,
    "When a thread cannot go on"), where "does not exist" would send its user looking for a
    typo.

    Raises:
        StoreError: ``run 'T.2' continues run 'T', whose log is missing``.
    """
    try:
        second = thread_run_id(thread_id, 2)
    except InvalidRunId:  # a thread id this long has no second run
        return
    log = await store.read_log(second)
    if log.started is not None and log.started.continues == thread_id:
        raise StoreError(f"run {second!r} continues run {thread_id!r}, whose log is missing")


async def _latest_number(store: RunStore, thread_id: str) -> int:
    """The highest n whose run ``<thread_id>.<n>`` exists, as far as a few lookups tell.

    A thread's runs are numbered without a gap (each is started as the one after the latest),
    so run n exists exactly when n is at most the latest. The number is found by doubling a
    stride while runs exist, then halving the range between the last run found and the
    first one missing (`_end_from`), then looking past that end for a gap (`_run_past`):
    about ``3 * log2(n)`` lookups (`_exists`), not ``n``
    (docs/decisions/0112-a-thread-looks-past-a-gap.md). A run found past a gap is taken as
    the latest and the search goes on from it: the chain check then refuses the missing run
    (docs/threads.md, "When a thread cannot go on"), rather than the thread going on under
    its id and rewriting the history of every later run. A run is checked to belong to the
    thread when it is the latest (`next_in_thread`).
    """
    found = 1
    while True:
        found = await _end_from(store, thread_id, found)
        past = await _run_past(store, thread_id, found)
        if past is None:
            return found
        found = past


async def _end_from(store: RunStore, thread_id: str, start: int) -> int:
    """From run ``start`` (it exists, or is the first run): an n whose run n+1 is missing.

    Doubling a stride while runs exist, then halving the range between the last run found
    and the first one missing: about ``2 * log2(n)`` lookups.
    """
    found, stride = start, 1
    while await _exists(store, thread_id, found + stride):
        found, stride = found + stride, stride * 2
    missing = found + stride
    while missing - found > 1:
        middle = (found + missing) // 2
        if await _exists(store, thread_id, middle):
            found = middle
        else:
            missing = middle
    return found


async def _run_past(store: RunStore, thread_id: str, end: int) -> int | None:
    """A run numbered past ``end + 1`` (which is missing), or ``None`` when none is found.

    Looks at ``end + 1 + 2**j`` for ``2**j`` up to ``end``: ``end + 2``, ``end + 3``,
    ``end + 5``, ... (about ``log2(end)`` lookups). A gap of g runs after run ``end`` is
    found when its length rounded up to a power of two, P, is at most ``end`` and run
    ``end + 1 + P`` exists (the thread went on for at least P runs after the gap): a gap of
    one run always is, when a run follows it (docs/decisions/0112-a-thread-looks-past-a-gap.md).
    """
    step = 1
    while step <= end:
        if await _exists(store, thread_id, end + 1 + step):
            return end + 1 + step
        step *= 2
    return None


async def _exists(store: RunStore, thread_id: str, n: int) -> bool:
    """Whether the store holds run ``<thread_id>.<n>``.

    A number whose id would not be a valid run id (longer than the limit) names no run: the
    lookup may ask beyond the thread's end, and only the thread's next run must have a valid
    id (docs/decisions/0055-thread-ids.md, "Consequences"). Asked of the run index when the
    store has one (a row or a file's ends per run), so that no run's whole log is read; of
    its log otherwise.
    """
    try:
        run_id = thread_run_id(thread_id, n)
    except InvalidRunId:
        return False
    if isinstance(store, RunIndex):
        return await store.read_summary(run_id) is not None
    return (await store.read_log(run_id)).started is not None


async def run_in_thread(
    store: RunStore, thread_id: str, run_id: str, input: RunInput | None
) -> Lineage | None:
    """The lineage of run ``run_id`` when it exists as a run of thread ``thread_id``.

    ``None`` when there is no such run yet.

    Raises:
        UsageError: ``run_id`` exists but is not a run of that thread (the thread's first
            run included: it continues no thread), or was started with another input than
            ``input`` (finished or not).
    """
    log = await store.read_log(run_id)
    if log.started is None:
        return None
    if log.started.thread != thread_id:
        raise UsageError(f"run {run_id!r} exists and is not a later run of thread {thread_id!r}")
    if input is not None and valid_unicode(input_messages(input))[0] != log.started.input:
        raise UsageError(
            f"run {run_id!r} of thread {thread_id!r}: the input differs from the stored input"
        )
    return Lineage.of(log.started)


async def known_fork(
    store: RunStore, fork_of: str, at_step: int | None, run_id: str
) -> Lineage | None:
    """The lineage of run ``run_id`` when it exists as the fork of ``fork_of`` at ``at_step``.

    ``None`` when there is no such run yet. Only the fork's own log is read: a fork that
    exists is resumed, or its result returned, whatever became of the run it forks (its
    resume reads that history as every resume does; docs/threads.md, "Forks").

    Raises:
        UsageError: no ``at_step``; ``run_id`` is ``fork_of`` itself (a fork is a new run);
            ``run_id`` exists as another run (a plain run, a thread's run, a fork of another
            run or step).
    """
    _check_fork_call(fork_of, at_step)
    if run_id == fork_of:
        raise UsageError(
            f"run_id {run_id!r} names the run to fork; a fork is a new run: give it an id "
            "of its own, or none for a fresh one"
        )
    log = await store.read_log(run_id)
    if log.started is None:
        return None
    asked = Lineage(continues=fork_of, fork_step=at_step)
    stored = Lineage.of(log.started)
    if stored != asked:
        raise UsageError(
            f"run {run_id!r} exists as {stored.describe() if stored else 'a run of its own'}, "
            f"not as the {asked.describe()} asked for; a run id names one run"
        )
    return stored


def _check_fork_call(fork_of: str, at_step: int | None) -> None:
    """Refuse a fork call without a valid ``fork_of`` or without ``at_step``.

    Raises:
        InvalidRunId: ``fork_of`` is not a run id.
        UsageError: ``at_step`` is ``None``.
    """
    check_run_id(fork_of)
    if at_step is None:
        raise UsageError(f"a fork of run {fork_of!r} needs at_step (the step to try again)")


async def fork_lineage(
    store: RunStore, fork_of: str, at_step: int | None, fork_id: str
) -> tuple[Lineage, RunLog]:
    """The lineage of fork ``fork_id`` of run ``fork_of`` at step ``at_step``, checked.

    Checked against the log of ``fork_of``, read as the log a run inherits from is
    (`treadle.actors.read_continued`).

    Returns:
        The lineage and the log of ``fork_of`` (for the check of the chain to take instead
        of reading it again).

    Raises:
        UsageError: no ``at_step``; the run does not exist; ``at_step`` is not one of its
            steps (1 to its step count; a run with no step record yet has none, and the
            message says so).
        StoreError: its log cannot be read (the message names the fork as the run that
            continues it: docs/threads.md, "When a thread cannot go on").
    """
    _check_fork_call(fork_of, at_step)
    log = await read_continued(store, fork_of, fork_id)
    if log.started is None:
        raise UsageError(f"cannot fork run {fork_of!r}: no such run in the store")
    steps = len(log.steps)
    if isinstance(at_step, bool) or not isinstance(at_step, int) or not 1 <= at_step <= steps:
        has = f"steps 1 to {steps}" if steps else "no completed step yet"
        raise UsageError(f"cannot fork run {fork_of!r} at step {at_step!r}: it has {has}")
    return Lineage(continues=fork_of, fork_step=at_step), log


def _state(log: RunLog) -> str:
    return "started, not finished" if log.steps == () else f"{len(log.steps)} steps, not finished"


async def history(store: RunStore, run_id: str) -> tuple[Message, ...]:
    """The messages run ``run_id`` ended with (or holds so far, while unfinished).

    Read from the store, never recomputed: what the run inherited (a thread's earlier runs,
    a fork's prefix), its input, then what each step record says entered history: the
    assistant message, a ``tool`` message per observation (a ``user`` message for a text
    reply treated as an action), an invalid decision's feedback. Every tool call is answered.
    The agent's system prompt is not included (docs/threads.md, "History"). The values of
    secret arguments read ``[redacted]``, as each run's own snapshots declare them: this is
    a path out of the log (docs/events.md, "Secret arguments").

    Args:
        store: the store holding the run (and the runs it continues).
        run_id: the run.

    Returns:
        The messages, oldest first; continuing the run's thread adds the new message after
        them.

    Raises:
        UsageError: there is no run ``run_id``.
        StoreError: a log of the chain is missing or unreadable.
    """
    return tuple(await recorded_history(store, check_run_id(run_id), redact=True))
