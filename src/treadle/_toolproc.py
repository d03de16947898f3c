"""Running one tool call in a child process (``@tool(isolation="process")``).

See docs/concepts.md, "Tools and cancellation".

The parent starts ``python -m treadle._toolproc LIFELINE REPLIES`` in a session of its own,
with its ``sys.path`` as ``PYTHONPATH``, and writes one pickled request to its stdin: the tool
function's module and qualified name (it is imported in the child, so it must be importable)
and the validated arguments. ``LIFELINE`` is the read end of a pipe whose write end only the
parent holds, for as long as it waits for the call: its end of file means the parent is gone.
``REPLIES`` is the write end of the call's **reply pipe**, whose read end only the parent holds.

The process started is the call's **keeper**, the leader of the call's session. It forks a
**worker** that loads the function, writes `BEGAN` to the reply pipe, runs the function (an
``async def`` one under its own `trio.run`) and writes one framed, pickled reply there
(`frame`). Nothing else writes to the reply pipe: the interpreter's start-up (a
``sitecustomize`` that prints) prints to the stdout the child inherited, and the function's own
prints go to stderr. A worker that cannot load the function (its module does not import, the
request does not unpickle) replies `REPLY_NOT_STARTED` without writing `BEGAN`: the parent
tells a call that never began from one that did by that mark. The worker ends as soon as its
reply is written (``os._exit``), or as soon as the function exits instead (``sys.exit``,
`KeyboardInterrupt`: no reply, the call's outcome is unknown): threads the tool left running,
its `atexit` handlers and multiprocessing's wait for its children do not run there and cannot
delay the call's end. It
writes to the reply pipe only while that descriptor is still the pipe: a tool that closed
descriptors it does not own (``os.closerange(3, ...)``) and opened a file that got the same
number does not get the reply written into that file; its call has no reply, as a process
that died. The keeper runs no code of the tool: it waits for the worker and exits as the
worker did (the same signal, or the same status), and when the lifeline breaks first (the
parent was killed, even with SIGKILL) it kills every process of the session (`kill_session`),
itself last: the worker and every process the tool started, whatever process group it moved
to, so nothing of the call runs on after the parent died (docs/crash-safety.md). The parent
kills the same session (SIGKILL) when the call is cancelled or times out. On Linux the worker
also dies with its keeper (``PR_SET_PDEATHSIG``).

Processes the tool starts do not hold the reply pipe (it is closed in forked children and not
inherited across ``exec``), so a background process left running does not keep the reply from
arriving; the parent stops reading once the reply is whole, in case one holds it anyway (a
child forked by C code, which Python's at-fork hooks do not see).

A driver started with its standard streams closed gives the child none either: the keeper
opens ``/dev/null`` in their place before anything of the call prints.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, NamedTuple, NoReturn

REPLY_OK = "ok"
"""The function returned: ``(REPLY_OK, value)``."""
REPLY_ERROR = "error"
"""The function raised: ``(REPLY_ERROR, text, failure)``, ``text`` as an observation
(``Error: Kind: message``), ``failure`` whether it raised `treadle.EnvironmentFailure`."""
REPLY_STALE = "stale"
"""The function raised `treadle.revisions.StaleWrite`: ``(REPLY_STALE, current, message)``."""
REPLY_NOT_STARTED = "not_started"
"""The function could not be loaded, so it never began: ``(REPLY_NOT_STARTED, what)``, ``what``
as ``Kind: message``."""

BEGAN: Final = b"B"
"""Written by the worker right before the function begins, ahead of its reply."""

_LENGTH: Final = struct.Struct(">Q")
"""A reply's frame: its length in bytes, ahead of it."""

_PR_SET_PDEATHSIG = 1
"""``prctl`` option (Linux): the signal this process gets when its parent thread ends."""

_PROC: Final = "/proc"

_ENDING: Final = threading.Lock()
"""Held by the keeper's watch while it kills the session: the keeper does not exit meanwhile
(its worker, killed first, would otherwise end it before the rest of the session is killed)."""


def frame(data: bytes) -> bytes:
    """``data`` with its length ahead of it: its reader tells a whole reply from a cut one."""
    return _LENGTH.pack(len(data)) + data


def frame_size(data: bytes | bytearray, start: int = 0) -> int | None:
    """The size in bytes of the frame at ``data[start:]``, its length included.

    ``None`` until that length is there: a reader knows when the reply is whole.
    """
    if len(data) - start < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(data, start)
    return int(_LENGTH.size + length)


def unframe(data: bytes) -> bytes | None:
    """The reply that `frame` put in ``data``, or ``None`` when it is cut off or absent."""
    if len(data) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(data)
    body = data[_LENGTH.size :]
    return body if len(body) == length else None


_LOOKS: Final = 10
"""How many times `kill_session` looks for the session's processes at most."""


class _Member(NamedTuple):
    """A process of a session, as ``/proc/<pid>/stat`` shows it (Linux)."""

    pid: int
    start: bytes
    """Its start time (clock ticks after boot): tells a reused pid from the process seen before."""
    parent: int
    """Its parent's pid."""
    group: int
    """Its process group's id."""


def kill_session(session: int) -> None:
    """SIGKILL every process of the session ``session`` except the calling one.

    On Linux they are found by their session id (``/proc/<pid>/stat``), whatever process group
    they moved to. Each is stopped (SIGSTOP) first, and looked for again until a look finds
    none not yet stopped (one may have forked meanwhile), at most `_LOOKS` times (`_stop_all`);
    only then are they killed, so that none can react to another's death (a shell running its
    next command). Each process group the last look saw is killed whole (``killpg``: the
    kernel gives every process of the group its SIGKILL at once, those the looks missed too),
    each before any group holding a parent of one of its processes (`_groups_first`). A death
    orphans a stopped process group, and the kernel continues it (SIGHUP, then SIGCONT), only
    when the group is the dying process's own or holds one of its children: both have their
    SIGKILL by then, so no process of the session runs again, one ignoring SIGHUP (a program
    started under ``nohup``) included. The processes of a group not killed whole are killed
    one by one afterwards, children before their parents (`_children_first`): those of the
    caller's own group when it is inside the session (it is spared), and all of them where
    groups hold each other's parents (a process moved into a group above its own), which no
    order of the groups fits. A group's id is given to no other process while the group has
    one, and a stopped process leaves its group only by dying: the ids the look saw are the
    groups' when they are killed, unless something else killed a whole group meanwhile.

    A caller outside the session first stops the process group of the session's leader at
    once, a fork in progress included (``killpg``), and kills it last: a fork chain there is
    stopped by the first look. A stopped process cannot fork, so only a process outside that
    group that forks faster than the looks find it (a fork chain that moved to a group of
    its own) can escape the kill. Elsewhere the process group of the session's leader is
    killed: a process that moved to a group of its own is missed there, and the caller dies
    too when it is in that group. A process that left the session (``setsid``) is its own
    (docs/concepts.md, "Tools and cancellation").

    It blocks for as long as its looks take (a scan of ``/proc`` each): call it off a trio
    loop.
    """
    if not sys.platform.startswith("linux") or not os.path.isdir(_PROC):
        _signal_group(session, signal.SIGKILL)
        return
    outside = os.getsid(0) != session
    if outside:
        _signal_group(session, signal.SIGSTOP)
    found = _stop_all(session)
    groups = _groups_first(found, None if outside else os.getpgrp())
    for group in groups:
        _signal_group(group, signal.SIGKILL)
    rest = [member for member in found if member.group not in groups]
    _signal_all(_children_first(rest), signal.SIGKILL)
    if outside:
        _signal_group(session, signal.SIGKILL)


def _stop_all(session: int) -> list[_Member]:
    """Stop (SIGSTOP) every process of ``session`` but the calling one; what the last look saw.

    It looks again until a look finds none not yet stopped, at most `_LOOKS` times.
    """
    me = os.getpid()
    stopped: set[tuple[int, bytes]] = set()
    latest: list[_Member] = []
    for _ in range(_LOOKS):
        latest = [member for member in _members(session) if member.pid != me]
        found = [member for member in latest if (member.pid, member.start) not in stopped]
        if not found:
            break
        _signal_all(found, signal.SIGSTOP)
        stopped.update((member.pid, member.start) for member in found)
    return latest


def _signal_group(group: int, number: int) -> None:
    """Send signal ``number`` to the process group ``group``, if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, number)


def _groups_first(members: Iterable[_Member], spared: int | None) -> list[int]:
    """The process groups of ``members``, each before any holding a parent of one of its own.

    Killed whole in this order, a group dies only once every group below it has its SIGKILL:
    the kernel continues a stopped group that a death orphans (SIGHUP, then SIGCONT) only
    when the dying process is in that group or is a parent of one of its processes.
    ``spared`` (the caller's own group, or ``None``) is left out, and must come last: its
    processes are killed after every group (`kill_session`).

    Returns:
        Group ids, in the order to kill them; ``[]`` when no order exists (groups holding
        each other's parents, or ``spared`` holding a process whose parent is in another
        group): the processes are then killed one by one.
    """
    found = list(members)
    group_of = {member.pid: member.group for member in found}
    below: dict[int, set[int]] = {member.group: set() for member in found}
    for member in found:
        above = group_of.get(member.parent, member.group)
        if above != member.group:
            below[above].add(member.group)
    if spared in below:
        below[spared] |= below.keys() - {spared}
    order: list[int] = []
    while below:
        ready = sorted(group for group, first in below.items() if not first & below.keys())
        if not ready:
            return []
        order += ready
        for group in ready:
            del below[group]
    return [group for group in order if group != spared]


def _children_first(members: Iterable[_Member]) -> list[_Member]:
    """``members`` ordered so that each comes after its descendants among them.

    Killed in this order, a process dies only once every process below it has a SIGKILL
    pending, so none of those is continued by its death: the order for the processes not
    killed with their whole group (`kill_session`).
    """
    found = list(members)
    parents = {member.pid: member.parent for member in found}

    def depth(pid: int) -> int:
        count = 0
        while (pid := parents.get(pid, 0)) in parents and count < len(parents):
            count += 1
        return count

    return sorted(found, key=lambda member: depth(member.pid), reverse=True)


def _signal_all(members: Iterable[_Member], number: int) -> None:
    """Send signal ``number`` to each of ``members``, in order."""
    for member in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member.pid, number)


def _members(session: int) -> Iterator[_Member]:
    """The processes of ``session`` (Linux)."""
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        try:
            with open(f"{_PROC}/{name}/stat", "rb") as stat:
                line = stat.read()
        except OSError:  # it ended meanwhile
            continue
        # after the name in parentheses: field 3 of proc(5) (the state) onwards
        fields = line.rsplit(b")", 1)[-1].split()
        if len(fields) > 19 and int(fields[3]) == session:  # field 6: the session
            # fields 22 (the start time), 4 (the parent) and 5 (the group)
            yield _Member(int(name), fields[19], int(fields[1]), int(fields[2]))


def resolve(module: str, qualname: str) -> Any:
    """The function named ``module:qualname`` (the function of a `treadle.Tool` found there).

    Raises:
        ImportError, AttributeError: it cannot be found.
    """
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    inner = getattr(found, "fn", None)
    if inner is not None and callable(inner):
        return inner
    return found


def _call(fn: Any, kwargs: dict[str, Any]) -> Any:
    if not inspect.iscoroutinefunction(fn):
        return fn(**kwargs)
    import trio

    async def in_trio() -> Any:
        return await fn(**_on_trio_clock(kwargs))

    return trio.run(in_trio)


def _on_trio_clock(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a `treadle.ToolContext`'s deadline on this trio run's clock.

    The parent sent it as a `time.monotonic` time, the clock the processes of a machine share.
    """
    import attrs
    import trio

    from treadle.tools import ToolContext

    def moved(value: Any) -> Any:
        if not isinstance(value, ToolContext):
            return value
        left = value.deadline - time.monotonic()
        return attrs.evolve(value, deadline=trio.current_time() + left)

    return {key: moved(value) for key, value in kwargs.items()}


def _reply_of(request: bytes, begin: Callable[[], object]) -> bytes:
    """Load the function, ``begin()``, call it: its pickled reply (one of the ``REPLY_`` kinds).

    What the function raises is its error, a `BaseException` (``GeneratorExit``, asyncio's
    ``CancelledError``) as well, as in a thread tool (docs/concepts.md, "Actions and
    observations").

    Raises:
        KeyboardInterrupt, SystemExit: the function raised it (``sys.exit``), also inside an
            exception group: no reply, the worker ends (`_work`).
    """
    from treadle.tools import _described

    try:
        call = pickle.loads(request)
        fn = resolve(call["module"], call["qualname"])
    except Exception as exc:  # it never began
        return pickle.dumps((REPLY_NOT_STARTED, _described(exc)))
    begin()
    try:
        value = _call(fn, call["kwargs"])
    except BaseException as exc:
        if _ends_the_process(exc):
            raise
        return pickle.dumps(_error_reply(exc))
    try:
        return pickle.dumps((REPLY_OK, value))
    except BaseException as exc:
        if _ends_the_process(exc):
            raise
        described = _described(exc)
        text = f"Error: the result could not be sent back from the tool's process: {described}"
        return pickle.dumps((REPLY_ERROR, text, False))


def _ends_the_process(exc: BaseException) -> bool:
    """Whether ``exc`` (also inside exception groups) is an exit: no outcome of the call."""
    from treadle._exceptions import raised

    return raised(exc, KeyboardInterrupt) is not None or raised(exc, SystemExit) is not None


def _error_reply(exc: BaseException) -> tuple[Any, ...]:
    """The reply of a function that raised ``exc``: its text as a thread tool's would be."""
    from treadle._exceptions import EnvironmentFailure, raised
    from treadle.revisions import StaleWrite
    from treadle.tools import _error_text

    stale = raised(exc, StaleWrite)
    if stale is not None:
        return (REPLY_STALE, stale.current, stale.message)
    failure = raised(exc, EnvironmentFailure)
    return (REPLY_ERROR, _error_text(exc if failure is None else failure), failure is not None)


def main() -> None:
    """Keep the call: fork its worker, and kill the call's session if the parent dies.

    ``sys.argv[1]`` is the lifeline's file descriptor, ``sys.argv[2]`` the reply pipe's; stdin
    holds the request; the reply is written to the reply pipe by the worker.
    """
    lifeline = int(sys.argv[1])
    reply_fd = int(sys.argv[2])
    os.set_inheritable(reply_fd, False)  # not inherited across exec
    _open_standard_streams()
    os.dup2(2, 1)  # the function's prints go to stderr
    sys.stdout = sys.stderr
    request = sys.stdin.buffer.read()
    keeper = os.getpid()
    worker = os.fork()
    if worker == 0:
        os.close(lifeline)
        _work(keeper, request, reply_fd)
    os.close(reply_fd)
    threading.Thread(target=_watch, args=(lifeline,), daemon=True).start()
    _, status = os.waitpid(worker, 0)
    with _ENDING:
        _exit_as(status)


def _open_standard_streams() -> None:
    """Open ``/dev/null`` as stdin, stdout or stderr where the process has none.

    A driver started with them closed gives the child none; the keeper then gives stderr to
    the function as its stdout.
    """
    for fd in (0, 1, 2):
        if _identity(fd) is not None:
            continue
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:  # the lowest free number: ``fd`` unless a lower one is free too
            os.dup2(null, fd)
            os.close(null)


def _identity(fd: int) -> tuple[int, int] | None:
    """``(device, inode)`` of what ``fd`` is open on; ``None`` when it is not open."""
    try:
        found = os.fstat(fd)
    except OSError:
        return None
    return found.st_dev, found.st_ino


class _ReplyPipe:
    """The worker's end of the reply pipe, used only while ``fd`` is still that pipe.

    The tool may close descriptors it does not own and open files that get the same number:
    those are left alone (nothing written to them, nor closed in a forked child).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._identity = _identity(fd)

    def _ours(self) -> bool:
        return self._identity is not None and _identity(self.fd) == self._identity

    def write(self, data: bytes) -> None:
        """Write all of ``data``, if ``fd`` is still the pipe (a reader gone: nothing)."""
        if not self._ours():
            return
        view = memoryview(data)
        with contextlib.suppress(OSError):
            while view:
                view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        """Close ``fd``, if it is still the pipe."""
        if self._ours():
            with contextlib.suppress(OSError):
                os.close(self.fd)


def _work(keeper: int, request: bytes, reply_fd: int) -> NoReturn:
    """The worker: run the call, write its reply, and end at once (``os._exit``).

    Nothing of an interpreter's exit runs after the reply (joining non-daemon threads, `atexit`
    handlers, multiprocessing's wait for its children): the call ends when its function does.
    A function that exits instead (``sys.exit``, `KeyboardInterrupt`) ends the worker the same
    way, without a reply, with the status the interpreter would have exited with
    (`_exit_status`): the call's outcome is unknown (docs/concepts.md, "Tools and
    cancellation").
    """
    _die_with(keeper)
    pipe = _ReplyPipe(reply_fd)
    # in a process the tool forks: it must not hold the reply
    os.register_at_fork(after_in_child=pipe.close)
    try:
        data = _reply_of(request, lambda: pipe.write(BEGAN))
    except BaseException as exc:  # an exit of the function's, or a reply that cannot be made
        status = _exit_status(exc)
        _flush_prints()
        os._exit(status)
    _flush_prints()
    pipe.write(frame(data))
    os._exit(0)


def _flush_prints() -> None:
    """Write out what the function printed, ahead of the worker's end."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _exit_status(exc: BaseException) -> int:
    """The status an interpreter ends with when ``exc`` escapes (0 to 255), having said why.

    `SystemExit` (also inside an exception group): its code (``None``: 0; a code that is not
    a number is printed to stderr, and gives 1). `KeyboardInterrupt`: 130 (128 + SIGINT, as a
    shell shows a process that SIGINT ended). Anything else: 1. Their traceback goes to
    stderr, as the interpreter prints it.
    """
    from treadle._exceptions import raised

    ending = raised(exc, SystemExit)
    if ending is None:
        with contextlib.suppress(Exception):
            traceback.print_exception(exc)
        return 128 + signal.SIGINT if raised(exc, KeyboardInterrupt) is not None else 1
    if ending.code is None:
        return 0
    if isinstance(ending.code, int):
        return ending.code & 0xFF
    with contextlib.suppress(Exception):
        print(ending.code, file=sys.stderr)
    return 1


def _die_with(keeper: int) -> None:
    """On Linux, have the kernel kill this process when its keeper ends (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the keeper's session kill covers it
        return
    if os.getppid() != keeper:  # the keeper ended before the signal was armed
        os._exit(1)


def _watch(lifeline: int) -> None:
    """Wait for the lifeline's end of file (the parent is gone), then kill the call's session.

    The keeper is killed last, after every other process of the session.
    """
    try:
        while os.read(lifeline, 4096):
            pass
    except OSError:
        traceback.print_exc()
    _ENDING.acquire()  # released by no one: this process ends here
    kill_session(os.getsid(0))
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_as(status: int) -> NoReturn:
    """End the keeper as its worker ended (``status`` from `os.waitpid`)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal that does not end a process
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
