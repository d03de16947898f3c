"""Declaring tools (`tool`), validating their arguments, and running them (`Toolbox`).

A tool is a typed function, ``async def`` or plain ``def``::

    @tool(timeout_s=5)
    async def get_weather(city: str, days: int = 1) -> str:
        '''Get the weather forecast for a city.'''
        ...

    @tool
    def read_file(path: str) -> str:  # runs in a worker thread
        ...

    @tool(isolation="process")
    def render(job: str) -> str:  # runs in a child process, killed at its deadline
        ...

    toolbox = Toolbox([get_weather, read_file, render])

Tools from elsewhere (an MCP server's, another executor's) join a toolbox's in one executor
with `treadle.combine_tools` (docs/concepts.md, "Several tool sources").

What each kind guarantees when a call is cancelled or runs out of time is in
docs/concepts.md, "Tools and cancellation": an ``async def`` tool gets a trio cancellation
(where it awaits: one that blocks or computes without awaiting holds the whole trio run until it
does); a plain ``def`` tool runs in a worker thread the run abandons; a process tool is killed.

The JSON schema of the arguments is generated from the signature (msgspec) and the
description from the docstring's first paragraph; argument descriptions come from its
Google ``Args:`` section. Supported argument types: str, int, float, bool, None, unions of
them, ``list[X]``, ``dict[str, X]``, ``Literal``, enums (their values all str or all int; an
enum argument is given its member, an ``IntEnum``'s or a ``StrEnum``'s too, and a value of no
member is refused) and attrs classes; an argument with a default is optional, and its default
must be a value of its type (docs/models.md, "Tool arguments"). A parameter annotated
`ToolContext` receives the run, step and idempotency key of the call and is not shown to the
model. A generator function is no tool: a call returns one result. It is refused when declared;
a function that returns a generator (a generator function behind a decorator, which the
declaration cannot tell from a decorator that collects the items) makes each call an error that
says so.

`Toolbox` implements `treadle.ports.ActionExecutor`. Arguments are validated (strictly:
no coercion, no extra keys) before the tool runs (docs/concepts.md, "Data that stays in"). Outcomes
(docs/seams.md, "Action executor"):

* unknown tool or invalid arguments: NOT_EXECUTED (the detail says why);
* the tool raised: EXECUTED, observation ``Error: <ExceptionType>: <message>``;
* the tool raised `EnvironmentFailure`: ENV_ERROR (the run ends);
* the tool ran past its timeout: EXECUTED, ``Error: the call to X timed out after N s``
  (a process tool's process is killed), followed by ``, and raised <ExceptionType>: <message>
  as it was cancelled`` when an ``async def`` tool raised after its timeout fired (a task of
  its own nursery whose cleanup failed), whether or not a cancellation came with it; a
  thread tool that is still running is abandoned:
  UNKNOWN, ``Error: the call to X timed out after N s and was abandoned while it still
  ran; its outcome is unknown``; a thread tool that got no thread (`TOOL_THREADS`) within
  its timeout, or a process tool whose process was killed before its function began (the
  timeout counts the process's start-up): NOT_EXECUTED;
* a process tool's process ended without a reply (killed by a signal, the OOM killer):
  UNKNOWN, ``Error: the call to X failed: its process was killed by signal N before it
  reported its result; its outcome is unknown. ...``; NOT_EXECUTED when it ended before
  the function began, or could not load it (its module does not import in the child);
* a process tool's result cannot be read back from its process (it pickles there and fails
  to unpickle here): EXECUTED, ``Error: the result of X could not be read back from its
  process: ...``;
* the tool raised a `trio.Cancelled` that nothing cancelled (caught earlier, raised again):
  EXECUTED, ``Error: X raised a trio cancellation that was not its call's ...``;
* the tool returned: EXECUTED; a ``str`` is the observation as is, a `ToolResult` its
  ``text`` with its ``images``, anything else compact JSON (attrs instances, enums and
  datetimes unstructured by cattrs; NaN and infinities as ``null``; bytes are an error);
  a generator is an error, ``Error: X returned a generator, not a result: ...``;
  an `ActionOutcome` is the outcome as is (a child-run tool's, `treadle.agent_tool`);
* a tool that writes a resource (``writes=``) the run never read, or whose base revision
  argument names a revision the run never read: NOT_EXECUTED, before it runs;
* the tool raised `treadle.revisions.StaleWrite`: NOT_EXECUTED with ``stale_resource`` set;
* the tool raised `treadle.ChildRunInterrupted` (a child-run tool whose child stopped
  unfinished): no outcome; it propagates and fails the run's drive, which is left resumable
  (docs/child-runs.md, "Run ids"); likewise `treadle.supervisors.ChildPending` (a child-run
  tool whose call parks its run while its queued child works, docs/child-runs.md, "In a
  fleet"), which the tool executor takes as "no outcome yet".

A tool that reads a resource (``reads=``) returns `treadle.revisions.Observed` to report the
revision it saw; it is in the outcome's ``revisions`` (docs/concepts.md, "Stale writes").

For NOT_EXECUTED and ENV_ERROR the executor's own text is in both ``observation`` and
``detail``; the library's tool executor puts the synthetic observation into history.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import pickle
import re
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, cast, overload

import attrs
import outcome
import trio
from cattrs.preconf.json import make_converter

from treadle import _toolhost, _toolproc
from treadle._exceptions import (
    ChildPending,
    ChildRunInterrupted,
    EnvironmentFailure,
    UsageError,
    innermost,
    message_of,
    raised,
)
from treadle._schema import Invalid, ToolSignature, read_signature
from treadle._shapes import image_problem
from treadle._toolhost import cancelled_here
from treadle.revisions import Observed, ResourceTemplate, StaleWrite, check_write, is_revision
from treadle.types import (
    Action,
    ActionOutcome,
    ActionStatus,
    Event,
    ImageRef,
    ReplayPolicy,
    ToolSpec,
)

__all__ = [
    "EnvironmentFailure",
    "ReconcileHook",
    "Tool",
    "ToolContext",
    "ToolResult",
    "Toolbox",
    "call_tools_inline",
    "tool",
]

ToolFunction: TypeAlias = Callable[..., Any]
"""A tool function: ``async def`` or plain ``def`` with annotated keyword-compatible
parameters."""

Isolation: TypeAlias = Literal["task", "thread", "process"]
"""Where a tool's calls run: ``task`` (an ``async def`` tool, a trio task), ``thread`` (a plain
``def`` tool, a worker thread) or ``process`` (a child process); docs/concepts.md, "Tools and
cancellation"."""

ReconcileHook: TypeAlias = Callable[[Action], Awaitable[ActionOutcome | None]]
"""``async (action) -> outcome | None``: on resume, tell what an interrupted call did (looked
up by ``action.intent_id``), or ``None`` when that cannot be established. A driver paused past
its lease may still make the call afterwards: fence the system first with
``action.generation`` before answering that the call did not run (docs/crash-safety.md, "A
paused driver")."""

_NAME: Final = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
_RESULTS: Final = make_converter()


@attrs.frozen(kw_only=True)
class ToolContext:
    """What a tool learns about the call it serves (inject it by annotating a parameter).

    Attributes:
        run_id: the run.
        step: the step index (1-based).
        intent_id: the id of the durable action intent, stable across a resume: use it as
            the idempotency key so that the effect happens at most once.
        call_id: the model's tool-call id (``""`` for a text reply treated as an action).
        tool: the tool name.
        replay: true when the call is re-executed on resume under the same ``intent_id``
            (replay policy ``SAFE``).
        resource: the key of the resource the tool writes (``writes=``), else of the one
            it reads (``reads=``); ``None`` when it declares neither.
        seen_revision: for a tool that writes a resource: the revision of it the model saw
            (its base revision argument when it passed one, else the latest this run
            observed). Compare it with the current revision inside the write's transaction
            and raise `treadle.revisions.StaleWrite` when they differ. ``None`` for other
            tools; 0 is a revision (docs/concepts.md, "Stale writes").
        tokens_left: this call's share of the run's token budget: what the run has left
            before this step, divided evenly among the step's calls that run (``None``: no
            token budget); a child run draws from it (docs/child-runs.md, "Budgets").
        deadline: the trio time (`trio.current_time`) at which the run's time budget ends
            (``inf``: no time budget). A process tool gets it on its own process's clock: an
            ``async def`` one on its trio run's, a plain ``def`` one (no trio clock runs there)
            as a `time.monotonic` time (docs/concepts.md, "Tools and cancellation").
        forward_event: hands another run's event (a child run's) to this run's live
            subscribers, never to its log (docs/child-runs.md, "Events"); ``None`` when
            the call was not made by a driven run.
        run_cancelled: ``run_cancelled()`` tells whether the run itself was cancelled (a
            cancel request), as opposed to its drive stopping in this process (a drain, a
            lost lease), which leaves the run resumable; ``None`` when nobody can tell.
        report_active_s: ``report_active_s(seconds)`` reports active seconds the call spent
            on the run's behalf as another log records them (a child run's
            `treadle.types.Totals.active_s`, time a process that died may have spent
            included): the step then counts at least its model attempts' time plus the most
            any of its calls reported (docs/child-runs.md, "Budgets"). Raises `UsageError`
            for seconds that are not a finite number of 0 or more. ``None`` when the call
            was not made by a driven run.
        can_park: the call may park its run instead of answering, by raising
            `treadle._exceptions.ChildPending` (every call of the step is ``safe`` to
            replay; docs/child-runs.md, "In a fleet").
        generation: the fencing generation of the run's lease under which this call runs:
            the one its action intent was written under (a ``safe`` call run again on
            resume: the resuming drive's, which is newer). A driver paused past its lease
            may still make its call after another driver took the run over; hand this to
            the system the tool acts on as a fencing token, which refuses a token older
            than one it has seen, so that such a stale call is refused there. 0 when the
            run has no lease (docs/crash-safety.md, "A paused driver").
    """

    run_id: str
    step: int
    intent_id: str
    call_id: str
    tool: str
    replay: bool = False
    resource: str | None = None
    seen_revision: int | None = None
    tokens_left: int | None = None
    deadline: float = math.inf
    forward_event: Callable[[Event], None] | None = attrs.field(default=None, eq=False, repr=False)
    run_cancelled: Callable[[], bool] | None = attrs.field(default=None, eq=False, repr=False)
    report_active_s: Callable[[float], None] | None = attrs.field(
        default=None, eq=False, repr=False
    )
    can_park: bool = False
    generation: int = 0


def _image_refs(value: Sequence[ImageRef]) -> tuple[ImageRef, ...]:
    images = tuple(value)
    for image in images:
        problem = image_problem(image)
        if problem is not None:
            raise UsageError(f"ToolResult.images: {problem}")
    return images


@attrs.frozen(kw_only=True)
class ToolResult:
    """What a tool returns to show the model images beside its text.

    ::

        @tool
        async def screenshot(page: str) -> ToolResult:
            key = save_png(page)  # your storage; your image_source reads it back
            return ToolResult(text=f"{page} rendered", images=[ImageRef(url=f"ref:{key}")])

    The images enter the log as references only (docs/concepts.md, "Data that stays in"): an
    ``http(s)`` URL the provider fetches, or a ``ref:<name>`` key that the model client's
    ``image_source`` resolves to bytes for every request, this run's and a resumed one's
    (docs/models.md, "Images returned by tools"). Wrap it in `treadle.revisions.Observed` to
    report a revision too.

    Attributes:
        text: the observation text.
        images: the images, in order (a sequence is stored as a tuple).

    Raises:
        UsageError: an image is not an `treadle.types.ImageRef` (bytes, a path, a str), or
            its url is neither an ``http(s)`` URL nor a ``ref:`` key (a ``data:`` URL would
            put the bytes into the log, a ``file:`` URL a local path).
    """

    text: str = ""
    images: tuple[ImageRef, ...] = attrs.field(default=(), converter=_image_refs)


@attrs.frozen(kw_only=True, eq=False)
class Tool:
    """A declared tool: the function, what the model sees, and how the library treats it.

    Build it with `tool`. Calling a `Tool` calls the function directly (no validation).

    Attributes:
        name: the name the model calls it by (``[A-Za-z0-9_-]``, at most 64 characters).
        description: shown to the model.
        fn: the function (``async def`` or plain ``def``).
        signature: its arguments, JSON schema and validator.
        replay: what resume does with a call whose outcome is unknown (default ``NEVER``).
        completes_task: a call that returns normally signals task completion.
        timeout_s: seconds a call may run; ``None`` uses the toolbox default.
        reconcile: the hook that establishes an interrupted call's outcome, if any.
        requires_approval: a human must approve each call before it runs.
        secret_arguments: the names of arguments whose values are redacted on every path
            out of the log (docs/events.md, "Secret arguments").
        isolation: where its calls run: ``task``, ``thread`` or ``process``
            (docs/concepts.md, "Tools and cancellation").
        reads: the key template of the resource a call reads, if any.
        writes: the key template of the resource a call writes, if any.
        base_revision: the argument in which the model passes the revision it changes
            from, if any (docs/concepts.md, "Stale writes").
    """

    name: str
    description: str
    fn: ToolFunction
    signature: ToolSignature
    replay: ReplayPolicy = ReplayPolicy.NEVER
    completes_task: bool = False
    timeout_s: float | None = None
    reconcile: ReconcileHook | None = None
    requires_approval: bool = False
    secret_arguments: frozenset[str] = frozenset()
    isolation: Isolation = "task"
    reads: ResourceTemplate | None = None
    writes: ResourceTemplate | None = None
    base_revision: str | None = None

    @property
    def spec(self) -> ToolSpec:
        """The tool as the model sees it."""
        return ToolSpec(
            name=self.name, description=self.description, parameters=self.signature.schema
        )

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function itself, here, bypassing validation, timeouts and isolation."""
        result = self.fn(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result


_ONE_RESULT: Final = "a call returns one result (collect the items and return them as a list)"
"""Why a generator is no tool's function, nor what its call returns."""


def _check_options(
    fn: Callable[..., Any],
    name: str,
    timeout_s: float | None,
    reconcile: Any,
    replay: Any,
    isolation: Any,
) -> None:
    if not _NAME.match(name):
        raise UsageError(f"tool name {name!r} must be 1-64 characters of A-Z, a-z, 0-9, _ or -")
    if not callable(fn):
        raise UsageError(f"tool {name!r}: {fn!r} is not a function")
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise UsageError(f"tool {name!r}: a generator function cannot be a tool: {_ONE_RESULT}")
    if isolation not in (None, "process"):
        raise UsageError(f"tool {name!r}: isolation must be None or 'process', got {isolation!r}")
    if isolation == "process":
        _check_importable(fn, name)
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise UsageError(f"tool {name!r}: timeout_s must be a positive number of seconds")
    if reconcile is not None and not _is_async(reconcile):
        raise UsageError(f"tool {name!r}: reconcile must be an 'async def' function")
    if not isinstance(replay, ReplayPolicy):
        raise UsageError(f"tool {name!r}: replay must be a ReplayPolicy, got {replay!r}")


def _check_importable(fn: Callable[..., Any], name: str) -> None:
    """A process tool's function is found again in its child by module and qualified name.

    Raises:
        UsageError: it is not: a lambda, a closure, a function of the script being run (the
            child is a ``__main__`` of its own), a method bound to an instance (the child
            would find the plain function, without the instance), or a method bound to a
            class that does not have it under its name; docs/concepts.md, "Tools and
            cancellation".
    """
    module, qualname = _name_in_child(fn)
    if not qualname or "<" in qualname or module is None or module == "__main__":
        raise UsageError(
            f"tool {name!r}: a process tool must be a function defined at the top level "
            "of an importable module, not in the script being run (it is imported again "
            "in the child process)"
        )
    if inspect.ismethod(fn) and not inspect.isclass(fn.__self__):
        raise UsageError(
            f"tool {name!r}: a process tool cannot be a method bound to an instance (the "
            "child process imports the function again and has no instance to bind it to); "
            "declare a top-level function that calls the method"
        )
    if inspect.ismethod(fn) and getattr(fn.__self__, fn.__name__, None) != fn:
        raise UsageError(
            f"tool {name!r}: {fn.__name__!r} cannot be found on {qualname.rpartition('.')[0]}, "
            "the class it is bound to (the child process finds it there by name)"
        )


def _name_in_child(fn: Callable[..., Any]) -> tuple[str | None, str]:
    """The module and qualified name a process tool's function is found by in its child.

    A method bound to a class (a classmethod) is named through that class, not the one that
    defines it: reached through a subclass, it runs bound to the subclass there too.
    """
    if inspect.ismethod(fn) and inspect.isclass(fn.__self__):
        owner = fn.__self__
        return getattr(owner, "__module__", None), f"{owner.__qualname__}.{fn.__name__}"
    return getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")


def _import_root(module: str | None) -> str | None:
    """The directory (absolute) of this process's search path that module ``module`` came from.

    Its file's directory, one level up per dot in its name (and one more for a package's
    ``__init__``). ``None`` for a module not imported, or without a file (built in, a
    namespace package).
    """
    found = sys.modules.get(module) if module else None
    spec = getattr(found, "__spec__", None)
    origin = getattr(spec, "origin", None)
    if module is None or spec is None or not isinstance(origin, str):
        return None
    if not os.path.isabs(origin):
        return None
    directory = os.path.dirname(origin)
    levels = module.count(".") + (spec.submodule_search_locations is not None)
    for _ in range(levels):
        directory = os.path.dirname(directory)
    return directory


def _is_async(fn: Any) -> bool:
    """True for an ``async def`` function (a `functools.partial` of one included)."""
    return inspect.iscoroutinefunction(fn)


def _make_tool(fn: ToolFunction, options: Mapping[str, Any]) -> Tool:
    name = getattr(fn, "__name__", "") if options["name"] is None else options["name"]
    isolation = options["isolation"]
    _check_options(
        fn, name, options["timeout_s"], options["reconcile"], options["replay"], isolation
    )
    if isolation is None:
        isolation = "task" if _is_async(fn) else "thread"
    signature = read_signature(fn, tool_name=name, context_type=ToolContext)
    secrets = _secret_arguments(name, options["secret_arguments"], signature)
    description = options["description"]
    reads, writes, base = _resources(name, options, signature, secrets)
    return Tool(
        name=name,
        description=signature.summary if description is None else description,
        fn=fn,
        signature=signature,
        replay=options["replay"],
        completes_task=options["completes_task"],
        timeout_s=options["timeout_s"],
        reconcile=options["reconcile"],
        requires_approval=options["requires_approval"],
        secret_arguments=secrets,
        isolation=isolation,
        reads=reads,
        writes=writes,
        base_revision=base,
    )


def _resources(
    name: str, options: Mapping[str, Any], signature: ToolSignature, secrets: frozenset[str]
) -> tuple[ResourceTemplate | None, ResourceTemplate | None, str | None]:
    """The ``reads``, ``writes`` and ``base_revision`` options, checked."""
    arguments = {p.name: p for p in signature.parameters}
    templates = [
        None
        if options[option] is None
        else ResourceTemplate.parse(
            options[option], tool=name, option=option, arguments=arguments, secret=secrets
        )
        for option in ("reads", "writes")
    ]
    base = options["base_revision"]
    if base is not None:
        if templates[1] is None:
            raise UsageError(f"tool {name!r}: base_revision needs writes=")
        if base not in arguments or arguments[base].annotation not in (int, int | None):
            raise UsageError(f"tool {name!r}: base_revision must name an int argument")
    elif templates[1] is not None and signature.context_parameter is None:
        raise UsageError(
            f"tool {name!r}: a tool that writes a resource needs a ToolContext parameter "
            "(its seen_revision) or a base_revision argument"
        )
    return templates[0], templates[1], base


def _secret_arguments(
    name: str, declared: Collection[str], signature: ToolSignature
) -> frozenset[str]:
    if isinstance(declared, str):
        raise UsageError(
            f"tool {name!r}: secret_arguments takes a collection of names, e.g. ({declared!r},)"
        )
    properties = signature.schema.get("properties")
    known = set(properties) if isinstance(properties, Mapping) else set()
    unknown = sorted(set(declared) - known)
    if unknown:
        raise UsageError(
            f"tool {name!r}: secret_arguments names no argument of the tool: {', '.join(unknown)}"
        )
    return frozenset(declared)


@overload
def tool(fn: ToolFunction, /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    replay: ReplayPolicy = ReplayPolicy.NEVER,
    completes_task: bool = False,
    timeout_s: float | None = None,
    reconcile: ReconcileHook | None = None,
    requires_approval: bool = False,
    secret_arguments: Collection[str] = (),
    isolation: Literal["process"] | None = None,
    reads: str | None = None,
    writes: str | None = None,
    base_revision: str | None = None,
) -> Callable[[ToolFunction], Tool]: ...


def tool(
    fn: ToolFunction | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    replay: ReplayPolicy = ReplayPolicy.NEVER,
    completes_task: bool = False,
    timeout_s: float | None = None,
    reconcile: ReconcileHook | None = None,
    requires_approval: bool = False,
    secret_arguments: Collection[str] = (),
    isolation: Literal["process"] | None = None,
    reads: str | None = None,
    writes: str | None = None,
    base_revision: str | None = None,
) -> Tool | Callable[[ToolFunction], Tool]:
    """Declare a tool; use bare (``@tool``) or with options (``@tool(timeout_s=30)``).

    Args:
        fn: the function (when used bare): ``async def`` runs as a trio task, for work that
            awaits (blocking or CPU-bound work there holds the whole trio run); a plain
            ``def`` runs in a worker thread that the run abandons when it stops waiting.
        name: the name the model sees; defaults to the function's name.
        description: shown to the model; defaults to the docstring's first paragraph, up
            to its first section (``Args:``, ``Returns:``); a first line that is a notice
            with its text (``Warning: irreversible. ...``) is part of it.
        replay: ``SAFE`` for read-only or idempotent tools, re-executed on resume under the
            same intent id; ``NEVER`` (the default) records an unknown outcome instead,
            unless ``reconcile`` can tell what happened.
        completes_task: a call that returns normally ends the run as ``task_completed``.
        timeout_s: seconds one call may run; ``None`` uses the toolbox default (10 s).
        reconcile: ``async (action) -> ActionOutcome | None``, called on resume for a call
            whose outcome was never stored; ``action.generation`` is the resuming drive's
            fencing generation (docs/crash-safety.md, "A paused driver").
        requires_approval: a human must approve each call before it runs.
        secret_arguments: names of arguments that are secret: their values stay in the log
            (a resume needs them) and are redacted in events, sinks, the handle's pending
            approval and the command line (docs/events.md, "Secret arguments").
        isolation: ``"process"`` runs each call in a child process that is killed
            (SIGKILL) when the call is cancelled or times out; the function must be defined
            at the top level of an importable module (a plain function or a classmethod,
            not a method bound to an instance), and its arguments and return value must
            pickle. ``None`` (the default): a task or a thread, as above. See
            docs/concepts.md, "Tools and cancellation".
        reads: the key template of the resource a call reads, over its arguments
            (``"reservation:{reservation_id}"``); the tool returns
            `treadle.revisions.Observed` to report the revision it read.
        writes: the key template of the resource a call writes. A call runs only when the
            run read that resource before; the tool gets the revision the model saw
            (``ToolContext.seen_revision``) and raises `treadle.revisions.StaleWrite` when
            the resource changed since (docs/concepts.md, "Stale writes").
        base_revision: with ``writes``: the name of an ``int`` argument in which the model
            passes the revision it changes from; a call whose value the run never read is
            refused before it runs.

    Returns:
        The `Tool`, or a decorator making one.

    Raises:
        UsageError: the function is not callable, or is a generator function; an argument
            lacks an annotation, is ``*args``/``**kwargs``/positional-only, or has an
            unsupported type; a default holds NaN, an infinity or an integer too long to
            write, or is no value of its argument's type (docs/models.md, "Tool
            arguments"); the name is
            not a valid tool name; an option is out of range; ``secret_arguments``
            names an argument the tool does not have; a process tool is not defined at the
            top level of a module, or is a method bound to an instance; a
            ``reads``/``writes`` template is malformed or uses an argument that is unknown or
            secret; ``base_revision`` does not name an ``int`` argument of a writing tool; or
            a writing tool has neither a `ToolContext` parameter nor ``base_revision``.
    """
    options = {
        "name": name,
        "description": description,
        "replay": replay,
        "completes_task": completes_task,
        "timeout_s": timeout_s,
        "reconcile": reconcile,
        "requires_approval": requires_approval,
        "secret_arguments": secret_arguments,
        "isolation": isolation,
        "reads": reads,
        "writes": writes,
        "base_revision": base_revision,
    }
    if fn is not None:
        return _make_tool(fn, options)
    return lambda function: _make_tool(function, options)


# --------------------------------------------------------------------------- execution


def _not_executed(detail: str) -> ActionOutcome:
    return ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=detail, detail=detail)


def _error_text(exc: BaseException) -> str:
    """A call's error as its observation: ``Error: Kind: message`` (``Error: Kind`` without one)."""
    return f"Error: {_described(exc)}"


def _described(exc: BaseException) -> str:
    """``Kind: message``, or ``Kind`` when the message is empty; also when its ``__str__`` fails."""
    message = message_of(exc)  # its __str__ may raise: the call still failed with it
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def observation_of(result: Any) -> str:
    """The observation text of a tool's return value.

    A ``str`` is returned as is; anything else is unstructured by cattrs (attrs instances,
    enums, datetimes) and written as compact JSON, non-ASCII kept. NaN and the infinities,
    which JSON has no form for, are written as ``null`` (as JavaScript's ``JSON.stringify``
    does); bytes are refused, and so is a mapping key that JSON cannot write as text (a
    tuple, say; docs/concepts.md, "Actions and observations").

    Raises:
        TypeError, ValueError: the value cannot be written as JSON (it holds bytes, or a
            key of another type than str, int, float, bool or None once unstructured; a
            value that holds itself, or nests deeper than Python's recursion limit, is a
            `ValueError`).
    """
    if isinstance(result, str):  # a subclass as a plain str: its own __str__ is not called
        return result if type(result) is str else str.__str__(result)
    try:
        data = _RESULTS.unstructure(result)
        try:
            return _json(data)
        except ValueError:  # NaN or an infinity somewhere (the rare case: walked only then)
            return _json(_finite(data))
    except RecursionError:
        raise ValueError("it holds itself or nests too deeply") from None


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _finite(data: Any) -> Any:
    """``data`` (unstructured) with every NaN and infinity replaced by ``None``."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, Mapping):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(value) for value in data]
    return data


def _no_bytes(value: bytes | bytearray | memoryview) -> Any:
    raise TypeError(
        f"it holds {type(value).__name__}, which JSON has no form for (decode it to text, or "
        "encode it yourself, e.g. base64)"
    )


_KEYS: Final = (str, int, float, bool, type(None))
"""The types a JSON object's key may be unstructured to (`json.dumps` writes them as text)."""


def _is_mapping(cls: Any) -> bool:
    """Whether ``cls`` is a mapping class (a dict, a `Counter`, any `Mapping`)."""
    return isinstance(cls, type) and issubclass(cls, Mapping)


def _json_object(value: Mapping[Any, Any]) -> dict[Any, Any]:
    """A mapping unstructured for `json.dumps`: its keys and values unstructured by cattrs.

    Raises:
        TypeError: a key is unstructured to none of `_KEYS` (a tuple, a frozenset, an attrs
            instance, an object cattrs leaves as it is); the message names the key's type.
    """
    data: dict[Any, Any] = {}
    for key, item in value.items():
        name = key if type(key) is str else _RESULTS.unstructure(key)
        if not isinstance(name, _KEYS):
            raise TypeError(
                f"it has a key of type {type(key).__name__}, and a JSON object's keys are "
                "str, int, float, bool or None"
            )
        data[name] = _RESULTS.unstructure(item)
    return data


for _binary in (bytes, bytearray, memoryview):
    _RESULTS.register_unstructure_hook(_binary, _no_bytes)
_RESULTS.register_unstructure_hook_func(_is_mapping, _json_object)


_CALLS_INLINE: Final = trio.lowlevel.RunVar[bool]("treadle.tools.calls_inline", default=False)


def call_tools_inline() -> None:
    """From now on in this trio run, call every ``def`` and process tool directly, in trio's thread.

    For runs on a virtual clock (`treadle.testing.simulation`, docs/simulation.md): there the
    clock jumps whenever every task waits, also while a worker thread or a child process
    runs a call, so a call of a few real milliseconds could time out at a random virtual
    moment. Called directly, the function returns before virtual time moves on, the same way
    every time. Those tools then have neither their isolation nor their timeout: a call that
    blocks, blocks the run.
    """
    _CALLS_INLINE.set(True)


TOOL_THREADS: Final = 100
"""Calls of plain ``def`` tools that run at once in one trio run, each in a worker thread.

They have these places of their own, apart from trio's default thread limiter (which the
stores use), so hung tools never hold a store up. A call waits for a place within its timeout
(one that gets none in time never runs: NOT_EXECUTED); a thread abandoned at its timeout keeps
its place until the function returns (`treadle._toolhost.host_statistics`,
``stray_threads``; docs/concepts.md, "Tools and cancellation").
"""

_THREADS: Final = trio.lowlevel.RunVar[trio.CapacityLimiter]("treadle.tools.threads")


def _tool_threads() -> trio.CapacityLimiter:
    """The places of thread tool calls in this trio run (`TOOL_THREADS` of them)."""
    try:
        return _THREADS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(TOOL_THREADS)
        _THREADS.set(limiter)
        return limiter


class _ThreadCall:
    """One call of a plain ``def`` tool, shared by the task that waits and the worker thread.

    It is ``waiting`` for its place among the tool threads, then ``running`` (from when it
    got one: its thread starts at once), then ``ended``; or given up: ``skipped`` before it
    got a place (the function never runs), ``left`` while it ran (a stray thread, reported
    to the tool host when it ends). It is its own thread limiter for trio (trio's
    ``CapacityLimiter`` protocol), which is how it learns that it got its place.
    """

    def __init__(self, found: Tool, kwargs: dict[str, Any]) -> None:
        self._found = found
        self._kwargs = kwargs
        self._lock = threading.Lock()
        self._state = "waiting"
        self._stray: _toolhost.StrayThread | None = None

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        """Wait for a place among the tool threads; trio starts the thread right after."""
        await _tool_threads().acquire_on_behalf_of(borrower)
        with self._lock:
            self._state = "running"

    def release_on_behalf_of(self, borrower: object) -> None:
        """Give the place back (the thread ended)."""
        _tool_threads().release_on_behalf_of(borrower)

    def run(self) -> Any:
        """Call the function, in the worker thread."""
        found = outcome.capture(self._call)
        with self._lock:
            was, self._state = self._state, "ended"
        if was == "left" and self._stray is not None:
            self._stray.ended(found)
        return found.unwrap()

    def _call(self) -> Any:
        result = self._found.fn(**self._kwargs)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited: no "never awaited" warning either
            raise TypeError(
                f"{self._found.name} is a plain def that returned an awaitable; declare it "
                "async def to have it awaited"
            )
        return result

    def give_up(self) -> bool:
        """Stop waiting for the call (in trio's thread); whether the function ran or runs."""
        with self._lock:
            if self._state == "waiting":
                self._state = "skipped"
                return False
            if self._state == "running":
                self._state = "left"
                self._stray = _toolhost.leave_thread(f"a call of {self._found.name}")
            return True


_READ_AFTER_KILL_S: Final = 1.0
"""Seconds a killed process call's output is still read for, to learn whether its function
began (the output ends as soon as the kill lands); output not ended by then counts as begun."""


class _ProcessCall:
    """One call of a process tool: its child process, and what the child wrote back.

    The child writes `_toolproc.BEGAN` when the function begins, then its framed reply
    (`_toolproc.frame`), to a reply pipe of the call's own that nothing else writes to: what
    the child's interpreter prints while it starts (a ``sitecustomize`` that prints) goes to the
    stdout it inherited. The reply is read as it comes, so that a call killed at its timeout
    tells whether its function began (docs/concepts.md, "Tools and cancellation").
    """

    def __init__(
        self, found: Tool, kwargs: dict[str, Any], resource: str | None, seen: int | None
    ) -> None:
        self._found = found
        self._kwargs = kwargs
        self._resource = resource  # the call's resource key
        self._seen = seen  # the revision of it the model saw
        self._output = bytearray()
        # the output was read to its end, or to the end of a whole reply: no more is read
        self._ended = False

    @property
    def began(self) -> bool:
        """Whether the function began.

        False only when its process said it did not: its output ended, empty or holding a
        whole reply without `_toolproc.BEGAN` (the function could not be loaded). Whenever
        nobody can tell (the output did not end, or it is not what the child writes), True:
        the call counts as begun (docs/concepts.md, "Tools and cancellation").
        """
        output = bytes(self._output)
        if not self._ended or output.startswith(_toolproc.BEGAN):
            return True
        return output != b"" and _toolproc.unframe(output) is None

    @property
    def replied(self) -> bool:
        """Whether a whole reply was read.

        The call's outcome is then that reply, whatever became of the process after it
        (docs/concepts.md, "Tools and cancellation").
        """
        output = self._output
        start = len(_toolproc.BEGAN) if output.startswith(_toolproc.BEGAN) else 0
        size = _toolproc.frame_size(output, start)
        return size is not None and len(output) >= start + size

    async def run(self) -> ActionOutcome:
        """Run the call in a child process; killed at once when the call is cancelled.

        A `StaleWrite` raised in the child is a stale write here too. The output is read up to
        the end of a whole reply, then the call waits for its process to end.
        """
        lifeline, held = os.pipe()
        replies, reply_end = os.pipe()
        reply = trio.lowlevel.FdStream(replies)  # closes ``replies``
        started = False
        try:
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(self._process, lifeline, reply_end)
                os.close(reply_end)  # the child holds the only write end: its end ends the reply
                started = True
                await self._read(reply)
        except BaseException:
            if started:  # the kill has landed: what did the child write before?
                with trio.CancelScope(shield=True), trio.move_on_after(_READ_AFTER_KILL_S):
                    await self._read(reply)
            raise
        finally:
            os.close(lifeline)
            os.close(held)
            if not started:
                os.close(reply_end)
            with trio.CancelScope(shield=True):
                await reply.aclose()
        assert process.returncode is not None
        return self._outcome(process.returncode)

    async def _process(
        self, lifeline: int, reply_end: int, *, task_status: trio.TaskStatus[trio.Process]
    ) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(self._search_path())}
        # The child's lifeline: only this process holds the write end (not inherited), so its
        # end of file tells the child that nobody waits for the call any more.
        await trio.run_process(
            [sys.executable, "-m", _toolproc.__name__, str(lifeline), str(reply_end)],
            stdin=self._request(),
            check=False,
            env=env,
            pass_fds=(lifeline, reply_end),
            deliver_cancel=_kill,
            start_new_session=True,  # its own session: `_kill` kills what it started too
            task_status=task_status,
        )

    def _search_path(self) -> list[str]:
        """The child's module search path: this process's, and where the tool's module is.

        ``""`` (the current directory, for ``python -c`` or a REPL) is the current directory
        now. The module's own entry (`_import_root`) comes first when it is not among them: a
        module imported through ``""`` or a relative entry before the process changed its
        current directory is found where it was (docs/concepts.md, "Tools and cancellation").
        """
        paths = [os.getcwd() if entry == "" else entry for entry in sys.path]
        root = _import_root(_name_in_child(self._found.fn)[0])
        if root is not None and root not in {os.path.abspath(path) for path in paths}:
            paths.insert(0, root)
        return paths

    def _request(self) -> bytes:
        module, qualname = _name_in_child(self._found.fn)
        sent = {key: _for_the_child(value) for key, value in self._kwargs.items()}
        return pickle.dumps({"module": module, "qualname": qualname, "kwargs": sent})

    async def _read(self, reply: trio.abc.ReceiveStream) -> None:
        """Read the output to its end, or to the end of a whole reply.

        A process that holds the reply pipe (one forked by C code) cannot hold the reply back.
        """
        while not self.replied:
            chunk = await reply.receive_some()
            if not chunk:
                break
            self._output += chunk
        self._ended = True

    def _outcome(self, status: int) -> ActionOutcome:
        """The call's outcome from its output, read to its end (or its reply's).

        ``status`` is trio's `trio.Process.returncode` (negative: killed by that signal).
        """
        answer = self.answer()
        if answer is not None:
            return answer
        return _died(self._found, status) if self.began else _ended_first(self._found, status)

    def answer(self) -> ActionOutcome | None:
        """The outcome of the child's whole reply; ``None`` when none was read.

        A whole reply that cannot be unpickled here is the call's error, whatever unpickling
        raised (a ``__reduce__`` that calls `sys.exit` included); docs/concepts.md, "Tools and
        cancellation".
        """
        output = bytes(self._output)
        if output.startswith(_toolproc.BEGAN):
            data = _toolproc.unframe(output[len(_toolproc.BEGAN) :])
        else:  # a reply of a function never loaded, or nothing anyone can read
            data = _toolproc.unframe(output)
        if data is None:  # no reply, or a cut one
            return None
        try:
            reply = _unpickle(data)
        except BaseException as exc:  # a whole reply that cannot be read here
            if isinstance(exc, trio.Cancelled):  # not the data's: unpickling never checkpoints
                raise
            text = (
                f"Error: the result of {self._found.name} could not be read back from its "
                f"process: {_described(exc)}"
            )
            return ActionOutcome(status=ActionStatus.EXECUTED, observation=text)
        return self._replied(reply)

    def _replied(self, reply: tuple[Any, ...]) -> ActionOutcome:
        found = self._found
        if reply[0] == _toolproc.REPLY_OK:
            return Toolbox._returned(found, reply[1], self._resource)
        if reply[0] == _toolproc.REPLY_STALE:
            stale = StaleWrite(current=reply[1], message=reply[2])
            return _stale(found, self._resource, self._seen, stale)
        if reply[0] == _toolproc.REPLY_NOT_STARTED:
            return _not_executed(
                f"the call to {found.name} did not start: its process could not load the "
                f"tool: {reply[1]}"
            )
        _, text, failure = reply
        if failure:
            return ActionOutcome(status=ActionStatus.ENV_ERROR, observation=text, detail=text)
        return ActionOutcome(status=ActionStatus.EXECUTED, observation=text)


@trio.lowlevel.enable_ki_protection
def _unpickle(data: bytes) -> Any:
    """``pickle.loads(data)``, with Ctrl-C held off by trio meanwhile.

    A `KeyboardInterrupt` raised here is then the data's own (its ``__reduce__``), not the
    user's.
    """
    return pickle.loads(data)


def _for_the_child(value: Any) -> Any:
    """An argument as the child process gets it.

    A `ToolContext` goes without the callables that live in this process (the run's writer
    and step), and with its deadline on `time.monotonic`, the clock the processes of a
    machine share: the child moves it to its own trio clock.
    """
    if not isinstance(value, ToolContext):
        return value
    left = value.deadline - trio.current_time()
    return attrs.evolve(
        value,
        forward_event=None,
        run_cancelled=None,
        report_active_s=None,
        deadline=time.monotonic() + left,
    )


def _how(status: int) -> str:
    """How a process ended: ``status`` as trio's `trio.Process.returncode`."""
    return f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"


def _died(found: Tool, status: int) -> ActionOutcome:
    """The process of a call ended without a reply (killed by a signal, the OOM killer, an exit).

    What the tool did before is unknown, as for an abandoned call (docs/concepts.md, "Tools and
    cancellation").
    """
    how = _how(status)
    detail = f"the process of {found.name} {how} without reporting its result"
    return ActionOutcome(
        status=ActionStatus.UNKNOWN,
        observation=(
            f"Error: the call to {found.name} failed: its process {how} before it reported "
            "its result; its outcome is unknown. Check its effect before trying again."
        ),
        detail=detail,
    )


def _ended_first(found: Tool, status: int) -> ActionOutcome:
    """The process of a call ended before the tool's function began: the call never started."""
    return _not_executed(
        f"the call to {found.name} did not start: its process {_how(status)} before the "
        "tool's function began"
    )


def _not_started_within(found: Tool, timeout: float) -> ActionOutcome:
    """The call timed out before the tool's function began (``timeout`` in seconds)."""
    if found.isolation == "process":
        detail = "its process was killed while it started, before the tool's function began"
    else:
        detail = f"no thread tool place came free within the timeout: all {TOOL_THREADS} were taken"
    return ActionOutcome(
        status=ActionStatus.NOT_EXECUTED,
        observation=f"the call to {found.name} did not start within {timeout:g} s: {detail}",
        detail=detail,
    )


_LEAVES_THE_CALL: Final = (trio.Cancelled, KeyboardInterrupt, SystemExit)
"""What a tool raises that is no outcome of its call, also inside exception groups: trio's
cancellation (its timeout, the run's cancel) and the process's exit."""


_STRAY: Final = (
    "raised a trio cancellation that was not its call's (one it caught earlier and raised "
    "again); nothing cancelled the call"
)


def _beside_cancellation(exc: BaseException) -> tuple[BaseException, BaseException | None]:
    """``exc`` split into the call's trio cancellation and what its tasks raised beside it.

    A tool's own nursery ends a cancelled call with a group holding both (a child task whose
    cleanup fails as it is cancelled): the cancellation is the scope's that cancelled the
    call, the rest is the call's error (docs/concepts.md, "Actions and observations").
    Returns ``(exc, None)`` when there is nothing beside a cancellation, or when the group
    holds a `KeyboardInterrupt` or `SystemExit` (they leave the call whole).
    """
    if not isinstance(exc, BaseExceptionGroup) or any(
        raised(exc, kind) for kind in (KeyboardInterrupt, SystemExit)
    ):
        return exc, None
    cancelled, rest = exc.split(trio.Cancelled)
    if cancelled is None or rest is None:
        return exc, None
    return cancelled, rest


def _timed_out(found: Tool, timer: trio.CancelScope) -> bool:
    """Whether a task tool's call that raised did so after its own timeout fired.

    The timeout decides, not what the call raised: a nursery whose parent task waits in its
    exit ends the cancelled call with a group of its tasks' errors and no `trio.Cancelled`
    in it (docs/concepts.md, "Actions and observations";
    docs/decisions/0150-a-calls-timeout-decides-that-it-timed-out.md). ``timer`` is the call's
    timeout scope; its deadline having passed counts as fired. A thread or process call's
    error is its function's own (no trio cancellation reaches it): never a timeout here.
    """
    return found.isolation == "task" and timer.cancel_called


def _generator_returned(found: Tool, result: Any) -> ActionOutcome:
    """A call whose function returned a generator: EXECUTED, and the error says so.

    A generator function is refused when it is declared (`tool`); one behind a decorator is
    not, since the function called is the decorator's, which may as well collect the items
    (docs/concepts.md, "Actions and observations"). The generator is not iterated here.
    """
    kind = "an async generator" if inspect.isasyncgen(result) else "a generator"
    text = f"Error: {found.name} returned {kind}, not a result: {_ONE_RESULT}"
    return ActionOutcome(status=ActionStatus.EXECUTED, observation=text, detail=text)


def _stray_cancellation(exc: BaseException) -> bool:
    """Whether a tool raised `trio.Cancelled` that no scope around the call took: a tool bug.

    Only a call (or the run) that was cancelled ends with its cancellation; a stale one
    raised again is the call's error (docs/concepts.md, "Actions and observations").
    """
    return (
        raised(exc, KeyboardInterrupt) is None
        and raised(exc, SystemExit) is None
        and not cancelled_here()
    )


async def _kill(process: trio.Process) -> None:
    """Cancel a process tool's call: SIGKILL to every process of its session, no grace.

    The session is the tool's process and every process it started, whatever process group
    they moved to (coreutils ``timeout``, a job-control shell), unless they left the session
    themselves (``setsid``): nothing of the call runs on after the kill (docs/concepts.md,
    "Tools and cancellation"). The processes are looked for in ``/proc`` in a worker thread,
    a bounded number of times (`_toolproc.kill_session`), so the trio loop and every other
    run on it go on meanwhile; the call waits for the kill to be done.
    """
    await trio.to_thread.run_sync(_toolproc.kill_session, process.pid)  # its leader's pid
    process.send_signal(signal.SIGKILL)  # the call's own process in any case


def _resource_key(found: Tool, kwargs: Mapping[str, Any]) -> str | None:
    """The key of the resource a call writes, else of the one it reads, else ``None``."""
    template = found.writes if found.writes is not None else found.reads
    return None if template is None else template.key(kwargs)


def _stale(found: Tool, resource: str | None, seen: int | None, exc: StaleWrite) -> ActionOutcome:
    """The tool found its resource changed since the model read it: nothing was written."""
    parts = [] if seen is None else [f"you read revision {seen}"]
    if exc.current is not None:
        parts.append(f"it is now at revision {exc.current}")
    if exc.message:
        parts.append(exc.message)
    detail = "; ".join(parts) or str(exc)
    return ActionOutcome(
        status=ActionStatus.NOT_EXECUTED,
        observation=detail,
        detail=detail,
        stale_resource=resource if resource is not None else found.name,
    )


class Toolbox:
    """The default action executor: a fixed set of tools (`treadle.ports.ActionExecutor`).

    To offer other executors' tools beside these (an MCP server's), combine them:
    ``combine_tools(toolbox, mcp_tools)`` (docs/concepts.md, "Several tool sources").

    Args:
        tools: the tools, in the order they are offered to the model.
        default_timeout_s: seconds a call may run when its tool sets no ``timeout_s``.

    Raises:
        UsageError: two tools share a name, an entry is not a `Tool` (decorate it with
            ``@tool``), or ``default_timeout_s`` is not a positive number.
    """

    def __init__(self, tools: Sequence[Tool], *, default_timeout_s: float = 10.0) -> None:
        if not (math.isfinite(default_timeout_s) and default_timeout_s > 0):
            raise UsageError("default_timeout_s must be a positive number of seconds")
        self._tools: dict[str, Tool] = {}
        for entry in tools:
            if not isinstance(entry, Tool):
                raise UsageError(f"{entry!r} is not a tool; decorate it with @tool")
            if entry.name in self._tools:
                raise UsageError(f"two tools are named {entry.name!r}")
            self._tools[entry.name] = entry
        self._default_timeout_s = default_timeout_s

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The tools offered to the model, in declaration order."""
        return tuple(t.spec for t in self._tools.values())

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or ``None``."""
        return self._tools.get(name)

    def replay_policy(self, tool: str) -> ReplayPolicy:
        """The replay policy of ``tool`` (``NEVER`` for unknown tools)."""
        found = self._tools.get(tool)
        return ReplayPolicy.NEVER if found is None else found.replay

    def requires_approval(self, tool: str) -> bool:
        """Whether calls of ``tool`` wait for a human (``False`` for unknown tools)."""
        found = self._tools.get(tool)
        return found is not None and found.requires_approval

    def secret_arguments(self, tool: str) -> frozenset[str]:
        """The names of ``tool``'s secret arguments (none for unknown tools)."""
        found = self._tools.get(tool)
        return frozenset() if found is None else found.secret_arguments

    def writes(self, tool: str) -> str | None:
        """The key template of the resource ``tool`` writes (``None``: none, or unknown)."""
        found = self._tools.get(tool)
        return None if found is None or found.writes is None else found.writes.text

    def invalid_arguments(self, tool: str, arguments: Mapping[str, Any]) -> str | None:
        """Why a call of ``tool`` with ``arguments`` cannot run, or ``None`` when it can.

        The reasons are those `execute` reports: an unknown tool, arguments that do not
        validate. `treadle.approvals.requires_approval` asks no human about such a call.
        """
        found = self._tools.get(tool)
        if found is None:
            return f"unknown tool {tool!r}"
        checked = found.signature.validate(arguments)
        return (
            "invalid arguments: " + "; ".join(checked.errors)
            if isinstance(checked, Invalid)
            else None
        )

    def timeout_s(self, tool: str) -> float:
        """Seconds one call of ``tool`` may run.

        ``inf`` for a child-run tool: its calls are bounded by the run's budgets instead
        (docs/child-runs.md, "Budgets").
        """
        found = self._tools.get(tool)
        if found is None or found.timeout_s is None:
            return self._default_timeout_s
        return found.timeout_s

    async def execute(self, action: Action, *, replay: bool = False) -> ActionOutcome:
        """Validate ``action``'s arguments, run its tool under its timeout, and report.

        The timeout is the tool's own, or ``action.timeout_s`` when that is shorter.

        Args:
            action: the action; ``arguments`` are the decoded JSON object from the model.
            replay: the call is re-executed on resume (passed to the tool's context).

        Returns:
            NOT_EXECUTED for an unknown tool or invalid arguments (``detail`` says which
            and why), for a write of a resource ``action.revisions`` holds no (such)
            revision of, and when the tool raised `treadle.revisions.StaleWrite`
            (``stale_resource`` set); ENV_ERROR when the tool raised `EnvironmentFailure`;
            else EXECUTED, with the return value, the raised error or the timeout as
            observation, and the revision an `treadle.revisions.Observed` value reported.

        Cancellation:
            Called in a cancelled scope, the tool never starts (`trio.Cancelled`); otherwise
            it yields to the scheduler where the tool does (a no-op tool not at all).
            `trio.Cancelled` from outside always propagates, alone (what the tool's own
            tasks raised beside it is dropped with the call); the tool's outcome is then
            unknown.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        found = self._tools.get(action.tool)
        if found is None:
            known = ", ".join(self._tools) or "none"
            return _not_executed(f"unknown tool {action.tool!r}; the known tools are: {known}")
        kwargs = found.signature.validate(action.arguments)
        if isinstance(kwargs, Invalid):
            return _not_executed("invalid arguments: " + "; ".join(kwargs.errors))
        resource = _resource_key(found, kwargs)
        seen: int | None = None
        if found.writes is not None and resource is not None:
            base = kwargs.get(found.base_revision) if found.base_revision else None
            checked = check_write(resource, action.revisions, base)
            if isinstance(checked, str):
                return _not_executed(checked)
            seen = checked
        if found.signature.context_parameter is not None:
            kwargs[found.signature.context_parameter] = ToolContext(
                run_id=action.run_id,
                step=action.step,
                intent_id=action.intent_id,
                call_id=action.call_id,
                tool=action.tool,
                replay=replay or action.replay,
                resource=resource,
                seen_revision=seen,
                tokens_left=action.tokens_left,
                deadline=action.deadline,
                forward_event=action.forward,
                run_cancelled=action.cancelled,
                report_active_s=action.report_active_s,
                can_park=action.can_park,
                generation=action.generation,
            )
        return await self._run(found, kwargs, resource, seen, action.timeout_s)

    async def _run(
        self,
        found: Tool,
        kwargs: dict[str, Any],
        resource: str | None,
        seen: int | None,
        run_timeout_s: float,
    ) -> ActionOutcome:
        # The run may stop waiting sooner than the tool's own timeout (`Limits.tool_timeout_s`):
        # then the call ends here at that time, and says what it did (a thread is abandoned).
        timeout = min(self.timeout_s(found.name), run_timeout_s)
        # only a call in a worker thread needs to learn it was abandoned
        in_thread = _ThreadCall(found, kwargs) if found.isolation == "thread" else None
        # a process call is killed: was it before its function began?
        in_process = (
            _ProcessCall(found, kwargs, resource, seen) if found.isolation == "process" else None
        )
        began = True
        failed: BaseException | None = None  # raised beside the call's cancellation
        with trio.move_on_after(timeout) as timer:
            try:
                if found.isolation != "task" and _CALLS_INLINE.get():
                    await trio.lowlevel.checkpoint()
                    result = found.fn(**kwargs)
                    if inspect.isawaitable(result):  # an ``async def`` process tool
                        result = await result
                elif in_thread is not None:  # isolation "thread"
                    result = await trio.to_thread.run_sync(
                        in_thread.run,
                        abandon_on_cancel=True,
                        limiter=cast(trio.CapacityLimiter, in_thread),
                    )
                elif in_process is not None:  # isolation "process"
                    return await in_process.run()
                else:
                    result = await found.fn(**kwargs)
            except (ChildRunInterrupted, ChildPending):
                raise  # not an outcome: the run's drive stops or parks; a resume re-attaches
            except Exception as exc:
                if raised(exc, ChildRunInterrupted) is not None:
                    raise
                pending = raised(exc, ChildPending)
                if pending is not None:
                    raise pending from None
                if _timed_out(found, timer):
                    failed = exc  # raised as its timeout cancelled it: reported below
                else:
                    stale = raised(exc, StaleWrite)
                    if stale is not None:
                        return _stale(found, resource, seen, stale)
                    return self._failed(exc)
            except BaseException as exc:
                if not any(raised(exc, kind) for kind in _LEAVES_THE_CALL):
                    return self._failed(exc)  # asyncio's CancelledError, GeneratorExit, ...
                if _stray_cancellation(exc):
                    return ActionOutcome(
                        status=ActionStatus.EXECUTED,
                        observation=f"Error: {found.name} {_STRAY}",
                        detail=_error_text(exc),
                    )
                # cancelled (or timed out): a thread is left behind
                if in_thread is not None:
                    began = in_thread.give_up()
                if in_process is not None:
                    began = in_process.began
                cancelled, failed = _beside_cancellation(exc)
                if failed is not None:
                    raise cancelled from failed  # the scope's to take; ``failed``: the call's error
                raise
            else:
                return self._returned(found, result, resource)
        answer = None if in_process is None else in_process.answer()
        if answer is not None:  # a whole reply came, but its process did not end in time
            return answer
        if not began:
            return _not_started_within(found, timeout)
        if found.isolation == "thread":
            return ActionOutcome(
                status=ActionStatus.UNKNOWN,
                observation=(
                    f"Error: the call to {found.name} timed out after {timeout:g} s and was "
                    "abandoned while it still ran; its outcome is unknown. Check its effect "
                    "before trying again."
                ),
                detail="abandoned in its worker thread at the timeout",
            )
        killed = " (its process was killed)" if found.isolation == "process" else ""
        text = f"Error: the call to {found.name} timed out after {timeout:g} s{killed}"
        if failed is not None:
            text += f", and raised {_described(innermost(failed))} as it was cancelled"
        return ActionOutcome(status=ActionStatus.EXECUTED, observation=text)

    @staticmethod
    def _failed(exc: BaseException) -> ActionOutcome:
        failure = raised(exc, EnvironmentFailure)
        if failure is not None:
            detail = _error_text(failure)
            return ActionOutcome(status=ActionStatus.ENV_ERROR, observation=detail, detail=detail)
        return ActionOutcome(status=ActionStatus.EXECUTED, observation=_error_text(exc))

    @staticmethod
    def _returned(found: Tool, result: Any, resource: str | None) -> ActionOutcome:
        if isinstance(result, ActionOutcome):  # a tool reporting its outcome itself
            return result
        if inspect.isgenerator(result) or inspect.isasyncgen(result):
            return _generator_returned(found, result)
        revisions: dict[str, int] = {}
        if isinstance(result, Observed):
            key = result.resource if result.resource is not None else resource
            problem = (
                f"returned the revision {result.revision!r}, which is not an int"
                if not is_revision(result.revision)
                else "returned a revision without a resource key (declare reads= or writes=, "
                "or pass resource=)"
                if key is None
                else None
            )
            if problem is not None or key is None:
                text = f"Error: {found.name} {problem}"
                return ActionOutcome(status=ActionStatus.EXECUTED, observation=text, detail=text)
            revisions[key] = result.revision
            result = result.value
        images: tuple[ImageRef, ...] = ()
        if isinstance(result, ToolResult):
            result, images = result.text, result.images
        try:
            observation = observation_of(result)
        except (TypeError, ValueError) as exc:
            text = f"Error: the result of {found.name} could not be written as JSON: {exc}"
            return ActionOutcome(status=ActionStatus.EXECUTED, observation=text, detail=text)
        if found.reads is not None and not revisions:
            # A read that reports no revision cannot let a later write through: say so in
            # the diagnostics, where the tool's author looks (docs/concepts.md, "Stale writes").
            detail = (
                f"{found.name} is declared reads= but returned no treadle.Observed value: "
                "no revision was recorded, so writes of the resource stay refused"
            )
            return ActionOutcome(
                status=ActionStatus.EXECUTED,
                observation=observation,
                task_completed=found.completes_task,
                detail=detail,
                images=images,
            )
        return ActionOutcome(
            status=ActionStatus.EXECUTED,
            observation=observation,
            task_completed=found.completes_task,
            revisions=revisions,
            images=images,
        )

    def image_source(self, image: ImageRef) -> bytes:
        """A toolbox keeps no image bytes: its tools' ``ref:`` images are the caller's.

        They resolve through the model client's ``image_source`` (docs/models.md, "Images
        returned by tools").

        Raises:
            KeyError: always.
        """
        raise KeyError(image.url)

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        """Ask the tool's reconcile hook what an interrupted call did.

        Returns:
            The hook's outcome; ``None`` when the tool is unknown, has no hook, the hook
            cannot tell, or it runs past the tool's timeout.

        Raises:
            Exception: whatever the hook raises (it is not hidden as "unknown").
        """
        found = self._tools.get(action.tool)
        if found is None or found.reconcile is None:
            await trio.lowlevel.checkpoint()
            return None
        with trio.move_on_after(self.timeout_s(found.name)):
            return await found.reconcile(action)
        return None
