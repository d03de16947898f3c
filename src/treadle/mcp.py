"""The tools of an MCP server as treadle tools (`open_mcp_tools`; extra ``treadle[mcp]``).

::

    async with open_mcp_tools("http://127.0.0.1:8000/mcp", trusted=True) as tools:
        agent = Agent(model=..., executor=tools, parser=NativeToolCallParser(), ...)
        result = await run(agent, "...", store=store)

With local tools (or other servers) beside them: ``executor=combine_tools(Toolbox([...]),
tools)`` (docs/mcp.md, "Local and MCP tools together").

The server is the official ``mcp`` SDK's `mcp.Client` target: an ``http(s)`` URL (streamable
HTTP), `mcp.StdioServerParameters` (a subprocess over stdin and stdout), an
`mcp.client.Transport`, or an in-process `mcp.server.Server` / ``MCPServer``.

Who owns what (docs/mcp.md, "The session"): the caller's ``async with`` block owns the MCP
session and its tasks; a run that uses the tools runs inside that block. The tool calls run in
the tool host and share the one session. Nothing of the session is in the run's log: a resume
in another process opens a session of its own.

Policies (docs/mcp.md, "Trust and policies"; docs/decisions/0070-mcp-trust-and-policies.md):
a server's annotations count only when the caller marks it ``trusted``: then ``readOnlyHint``
or ``idempotentHint`` makes a tool ``safe`` (re-sent on resume), any other is ``never``, and a
destructive one (``destructiveHint`` absent or true, and not read-only) requires approval. For
a server not trusted every tool is ``never`` and needs no approval. `McpToolOptions` overrides
either per tool.

Outcomes (docs/seams.md, "Action executor"):

* unknown tool or arguments that fail the server's input schema: NOT_EXECUTED, before any
  request; the server answering a JSON-RPC "method not found" or "invalid params": NOT_EXECUTED;
* an ``isError`` result: EXECUTED, observation ``Error: <the result's text>``;
* any other JSON-RPC error: EXECUTED, observation ``Error: <code>: <message>``;
* a broken transport (the connection closed, the process died, a stdio server wrote bytes
  that are no text, the HTTP request failed or got an answer that is no JSON-RPC answer, or
  its event stream ended without the answer: any error the server never sent,
  `treadle._mcp_http`): ENV_ERROR (the run ends); over stdio for every call in flight and
  every later call of the session; over HTTP, a call for which no connection could be had
  says that it was never sent;
* the call ran past its timeout: UNKNOWN (the server was asked to cancel it; whether its
  effect happened is unknown);
* anything else the SDK raises (a result that is no valid MCP result, say) propagates: the
  run is interrupted and stays resumable, the call's outcome unknown;
* a result: EXECUTED; text blocks, structured content (compact JSON, when no text block
  already holds it), audio, resource links and embedded resources map onto the
  observation; images become the outcome's ``images`` (references the session resolves,
  `McpTools.image_source`), each also named by a line of the observation, and an image whose
  media type is no ``image/<subtype>`` or whose data is no base64 only a line saying so
  (docs/mcp.md, "Results").

Every call carries the action's intent id in its ``_meta`` as ``treadle/idempotency-key``, and
``treadle/replay: true`` when resume re-sends a ``safe`` call.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeAlias

import anyio
import attrs
import httpx2
import jsonschema
import mcp_types
import trio
from mcp import Client, MCPError, StdioServerParameters
from mcp.client import Transport
from mcp.client._transport import ReadStream, TransportStreams
from mcp.client.stdio import stdio_client
from mcp.server import MCPServer, Server
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from treadle._exceptions import EnvironmentFailure, UsageError, raised
from treadle._mcp_http import (
    ReadStreamFilter,
    never_sent,
    no_server_answer,
    open_http,
    shown_url,
)
from treadle._schema import argument_validator
from treadle.tools import ReconcileHook
from treadle.types import (
    Action,
    ActionOutcome,
    ActionStatus,
    ImageRef,
    JSONValue,
    ReplayPolicy,
    ToolSpec,
)

__all__ = [
    "IDEMPOTENCY_KEY",
    "REPLAY_KEY",
    "McpServer",
    "McpTool",
    "McpToolOptions",
    "McpTools",
    "open_mcp_tools",
    "policy_of",
]

IDEMPOTENCY_KEY: Final = "treadle/idempotency-key"
"""The ``_meta`` key of every call's idempotency key: the action's intent id, the same on a
resume's re-send (docs/mcp.md, "Idempotency keys")."""

REPLAY_KEY: Final = "treadle/replay"
"""The ``_meta`` key set to ``true`` on a ``safe`` call resume sends again."""

McpServer: TypeAlias = str | StdioServerParameters | Transport | Server[Any] | MCPServer
"""What `open_mcp_tools` connects to: an ``http(s)`` URL (streamable HTTP), a subprocess
(`mcp.StdioServerParameters`), an `mcp.client.Transport`, or an in-process server."""

_NAME: Final = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
_IMAGE_TYPE: Final = re.compile(r"\Aimage/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*\Z", re.IGNORECASE)
"""An image media type (``image/<subtype>``, no parameters): what a model can be sent."""
_MAX_PAGES: Final = 1000
_MAX_IMAGES: Final = 256
"""How many images of its tool results the session keeps for each run (docs/mcp.md, "Results")."""
_MAX_ERRORS: Final = 5
_TRANSPORT_ERRORS: Final = (
    OSError,
    httpx2.TransportError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
)
_NOT_RUN: Final = frozenset({mcp_types.METHOD_NOT_FOUND, mcp_types.INVALID_PARAMS})
_SDK_TIMEOUT_MARGIN_S: Final = 60.0
"""How far past a call's ``timeout_s`` the SDK's own read timeout of that request is set."""
_UNDECODED: Final = "string_unicode"
"""pydantic's error type for a JSON text that holds lone surrogates (bytes no decoder took)."""


def _policy(value: ReplayPolicy | None) -> ReplayPolicy | None:
    if value is not None and not isinstance(value, ReplayPolicy):
        raise UsageError(f"replay must be a ReplayPolicy or None, got {value!r}")
    return value


def _names(value: Collection[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise UsageError(f"secret_arguments takes a collection of names, e.g. ({value!r},)")
    return frozenset(value)


def _approval(value: bool | None) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise UsageError(f"requires_approval must be True, False or None, got {value!r}")
    return value


@attrs.frozen(kw_only=True)
class McpToolOptions:
    """What the caller decides about one MCP tool, over what its server's annotations say.

    Attributes:
        replay: ``SAFE`` or ``NEVER``; ``None`` keeps the policy from the annotations (for a
            trusted server) or ``NEVER`` (docs/mcp.md, "Trust and policies").
        requires_approval: whether each call waits for a human; ``None`` keeps the default
            (a trusted server's destructive tools do, others do not).
        timeout_s: seconds one call may run; ``None`` uses the default of `open_mcp_tools`.
        secret_arguments: names of arguments redacted out of the log (docs/events.md,
            "Secret arguments"); each must be a property of the tool's input schema.
        reconcile: ``async (action) -> ActionOutcome | None``, asked on resume what an
            interrupted ``never`` call did (e.g. by asking the server about
            ``action.intent_id``, the idempotency key it was sent).

    Raises:
        UsageError: ``replay`` is no `ReplayPolicy`, ``requires_approval`` no bool or
            ``None``, ``secret_arguments`` is a string.
    """

    replay: ReplayPolicy | None = attrs.field(default=None, converter=_policy)
    requires_approval: bool | None = attrs.field(default=None, converter=_approval)
    timeout_s: float | None = None
    secret_arguments: frozenset[str] = attrs.field(default=frozenset(), converter=_names)
    reconcile: ReconcileHook | None = None


@attrs.frozen(kw_only=True)
class McpTool:
    """One tool of an MCP server as the run sees it.

    Attributes:
        name: the name the model calls it by (the prefix, then the server's name).
        server_name: its name on the server.
        spec: name, description and input schema, as the server listed them.
        annotations: the annotations as the server sent them (``{}`` when none), for display
            and audits; they decided nothing unless the server is trusted.
        replay: ``SAFE`` (re-sent on resume) or ``NEVER``.
        requires_approval: each call waits for a human.
        timeout_s: seconds one call may run.
        secret_arguments: arguments redacted out of the log.
        reconcile: the hook asked on resume, if any.
    """

    name: str
    server_name: str
    spec: ToolSpec
    annotations: Mapping[str, JSONValue]
    replay: ReplayPolicy
    requires_approval: bool
    timeout_s: float
    secret_arguments: frozenset[str] = frozenset()
    reconcile: ReconcileHook | None = None


def policy_of(
    annotations: mcp_types.ToolAnnotations | None, *, trusted: bool
) -> tuple[ReplayPolicy, bool]:
    """The replay policy and approval requirement an MCP tool gets before the caller's options.

    The rule of docs/mcp.md, "Trust and policies": for a server not ``trusted``,
    ``(NEVER, False)`` whatever it annotates. For a trusted one, ``SAFE`` when
    ``readOnlyHint`` or ``idempotentHint`` is true, else ``NEVER``; approval when the tool is
    destructive: not read-only and ``destructiveHint`` not false (the MCP specification's
    defaults: absent annotations mean a destructive tool that is not read-only).

    Returns:
        ``(replay policy, requires approval)``.
    """
    if not trusted:
        return ReplayPolicy.NEVER, False
    hints = annotations or mcp_types.ToolAnnotations()
    read_only = hints.read_only_hint is True
    safe = read_only or hints.idempotent_hint is True
    destructive = not read_only and hints.destructive_hint is not False
    return (ReplayPolicy.SAFE if safe else ReplayPolicy.NEVER), destructive


def _not_executed(detail: str) -> ActionOutcome:
    return ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=detail, detail=detail)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _validator(name: str, schema: Mapping[str, Any]) -> jsonschema.protocols.Validator:
    """A validator of the server's input schema for ``name``; a broken schema is a clear error.

    The check is `treadle._schema.argument_validator`'s: the draft the schema's ``$schema``
    names, regular expressions left to the server (their syntax too), references resolved
    inside the schema alone: nothing is fetched (docs/mcp.md).

    Raises:
        UsageError: the schema is no valid JSON schema.
    """
    try:
        return argument_validator(schema)
    except jsonschema.SchemaError as exc:
        raise UsageError(
            f"MCP tool {name!r}: the server's input schema is no valid JSON schema: {exc.message}"
        ) from exc


class McpTools:
    """The tools of one MCP session: a `treadle.ports.ActionExecutor` with `ToolPolicies`.

    Built by `open_mcp_tools`, valid inside its ``async with`` block (the session's
    lifetime); pass it as an agent's ``executor``, alone or with local tools and other
    sessions through `treadle.combine_tools` (docs/mcp.md, "Local and MCP tools together").
    """

    def __init__(
        self,
        client: Client,
        tools: Sequence[McpTool],
        *,
        default_timeout_s: float = 30.0,
        closed_because: Callable[[], str | None] = lambda: None,
        wire_checked: bool = False,
    ) -> None:
        """The tools of ``client``'s session; built by `open_mcp_tools`.

        ``closed_because`` tells why the session's stream was ended on treadle's side (a
        stdio server's output that is no text), or ``None``; it names the cause in the
        outcome of a call the closed session failed. ``wire_checked``: the session is over
        `open_http`, which marks every error the server never sent (`no_server_answer`).
        """
        self._client = client
        self._default_timeout_s = default_timeout_s
        self._closed_because = closed_because
        self._wire_checked = wire_checked
        self._tools = {entry.name: entry for entry in tools}
        self._validators = {
            entry.name: _validator(entry.name, entry.spec.parameters) for entry in tools
        }
        self._images = _RunImages()

    @property
    def tools(self) -> tuple[McpTool, ...]:
        """The tools, in the order the server listed them."""
        return tuple(self._tools.values())

    def get(self, name: str) -> McpTool | None:
        """The tool the model calls ``name``, or ``None``."""
        return self._tools.get(name)

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The tools offered to the model, in the order the server listed them."""
        return tuple(entry.spec for entry in self._tools.values())

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

    def timeout_s(self, tool: str) -> float:
        """Seconds one call of ``tool`` may run (the session's default for unknown tools)."""
        found = self._tools.get(tool)
        return self._default_timeout_s if found is None else found.timeout_s

    def invalid_arguments(self, tool: str, arguments: Mapping[str, Any]) -> str | None:
        """Why a call of ``tool`` cannot run (unknown tool, schema errors), or ``None``."""
        if tool not in self._tools:
            return f"unknown tool {tool!r}"
        try:
            errors = sorted(
                self._validators[tool].iter_errors(dict(arguments)), key=lambda e: list(e.path)
            )
        except Exception as exc:  # the server's schema itself is broken (a $ref to nowhere)
            return f"the server's input schema of {tool!r} cannot be checked: {exc}"
        if not errors:
            return None
        shown = [
            f"{'/'.join(str(p) for p in error.path) or '(arguments)'}: {error.message}"
            for error in errors[:_MAX_ERRORS]
        ]
        return "invalid arguments: " + "; ".join(shown)

    def image_source(self, image: ImageRef) -> bytes:
        """The bytes of an image a tool result of this session returned.

        A run whose executor holds this session asks it by itself (nothing to wire:
        `treadle.ports.ToolPolicies`; docs/mcp.md, "Results"). The session keeps the last 256
        images of each run's calls in memory, until the block ends (`_RunImages`); the log
        holds only their reference, so a run resumed in another session cannot send an
        earlier session's images (docs/models.md, "Images returned by tools").

        Raises:
            KeyError: the reference is not one of those images.
        """
        return self._images.get(image.url)

    async def execute(self, action: Action) -> ActionOutcome:
        """Check ``action``'s arguments against the server's schema, call the tool, report.

        Returns:
            The outcome, as the module docstring lists them.

        Cancellation:
            A checkpoint before the request. `trio.Cancelled` from outside propagates (the
            SDK sends the server a cancellation); the call's outcome is then unknown.
        """
        await trio.lowlevel.checkpoint()
        found = self._tools.get(action.tool)
        if found is None:
            known = ", ".join(self._tools) or "none"
            return _not_executed(f"unknown tool {action.tool!r}; the known tools are: {known}")
        problem = self.invalid_arguments(action.tool, action.arguments)
        if problem is not None:
            return _not_executed(problem)
        meta: dict[str, Any] = {IDEMPOTENCY_KEY: action.intent_id}
        if action.replay:
            meta[REPLAY_KEY] = True
        # The tool's own timeout, or the run's when that is shorter (`Action.timeout_s`): timed
        # out here, the call is UNKNOWN (the server may still run it); cut by the run, it
        # would read as a call that ended at its timeout.
        timeout_s = min(found.timeout_s, action.timeout_s)
        with trio.move_on_after(timeout_s):
            try:
                result = await self._client.call_tool(
                    found.server_name,
                    dict(action.arguments),
                    # the call's own timeout (above) ends it first: the session's
                    # connect_timeout_s bounds the handshake and listing only
                    read_timeout_seconds=timeout_s + _SDK_TIMEOUT_MARGIN_S,
                    meta=mcp_types.RequestParamsMeta(**meta),  # type: ignore[typeddict-item]
                )
            except Exception as exc:
                return self._failed(found, exc)
            return self._observed(result, action.run_id)
        return ActionOutcome(
            status=ActionStatus.UNKNOWN,
            observation=(
                f"Error: the call to {found.name} timed out after {timeout_s:g} s; the "
                "server was asked to cancel it and its outcome is unknown. Check its effect "
                "before trying again."
            ),
            detail="cancelled at its timeout while the server ran it",
        )

    def _failed(self, found: McpTool, exc: Exception) -> ActionOutcome:
        error = raised(exc, MCPError)
        if error is not None and not _closed(error, self._wire_checked):
            text = f"Error: {error.code}: {error.message}"
            if error.code in _NOT_RUN:
                return _not_executed(f"the server refused the call of {found.name}: {text}")
            return ActionOutcome(status=ActionStatus.EXECUTED, observation=text, detail=text)
        broken = error if error is not None else _transport_error(exc)
        if broken is None:
            raise exc
        cause = self._closed_because() if error is not None else None
        what = cause or f"{type(broken).__name__}: {broken}"
        detail = (
            f"Error: the call of {found.name} was never sent: no connection to the MCP server "
            f"could be had ({what}); it did not run"
            if error is not None and never_sent(error)
            else f"Error: the connection to the MCP server broke during the call of {found.name} "
            f"({what}); its outcome is unknown"
        )
        return ActionOutcome(status=ActionStatus.ENV_ERROR, observation=detail, detail=detail)

    def _observed(self, result: mcp_types.CallToolResult, run_id: str) -> ActionOutcome:
        """The outcome of ``result``; its images are kept for the run ``run_id``."""
        images: list[ImageRef] = []
        parts = [self._block_text(block, images, run_id) for block in result.content]
        structured = result.structured_content
        if structured is not None and not any(
            _holds(block, structured) for block in result.content
        ):
            parts.append(_compact(structured))
        text = "\n".join(parts)
        if result.is_error:
            text = f"Error: {text}" if text else "Error: the tool reported an error, no text"
        return ActionOutcome(status=ActionStatus.EXECUTED, observation=text, images=tuple(images))

    def _block_text(
        self, block: mcp_types.ContentBlock, images: list[ImageRef], run_id: str
    ) -> str:
        if isinstance(block, mcp_types.TextContent):
            return block.text
        if isinstance(block, mcp_types.ImageContent):
            return self._keep_image(block, images, run_id)
        if isinstance(block, mcp_types.AudioContent):
            return f"[audio {block.mime_type}, {_size(block.data)} bytes, not kept]"
        if isinstance(block, mcp_types.ResourceLink):
            return f"[resource link {block.uri} ({block.name})]"
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return resource.text
        kind = resource.mime_type or "unknown type"
        return f"[resource {resource.uri}: {kind}, {_size(resource.blob)} bytes, not kept]"

    def _keep_image(
        self, block: mcp_types.ImageContent, images: list[ImageRef], run_id: str
    ) -> str:
        """The observation's line of an image block.

        A valid image joins ``images``, and the session keeps its bytes for the run ``run_id``.
        """
        if not block.mime_type:
            return "[image: the server sent no media type]"
        if not _IMAGE_TYPE.match(block.mime_type):
            return f"[image {block.mime_type}: the server sent a media type that is no image type]"
        try:
            data = base64.b64decode(block.data, validate=True)
        except (binascii.Error, ValueError):
            return f"[image {block.mime_type}: the server sent data that is no base64]"
        digest = hashlib.sha256(data).hexdigest()
        ref = ImageRef(
            url=f"ref:mcp-{digest}", digest=f"sha256:{digest}", media_type=block.mime_type
        )
        self._images.keep(run_id, ref.url, data)
        images.append(ref)
        return f"[image {ref.url} {block.mime_type}, {len(data)} bytes]"

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        """Ask the tool's reconcile hook what an interrupted call did.

        Returns:
            The hook's outcome; ``None`` when the tool is unknown, has no hook, the hook
            cannot tell, or it runs past the tool's timeout. Nothing is sent to the server
            unless the hook sends it.

        Raises:
            Exception: whatever the hook raises.
        """
        found = self._tools.get(action.tool)
        if found is None or found.reconcile is None:
            await trio.lowlevel.checkpoint()
            return None
        with trio.move_on_after(found.timeout_s):
            return await found.reconcile(action)
        return None


class _RunImages:
    """The bytes of the images a session's tool results returned, kept per run.

    Each run keeps the last `_MAX_IMAGES` images of its own calls: another run's calls,
    however many, never evict them, so runs sharing the session do not break each other's
    next model calls (docs/mcp.md, "Results"). An image is kept once, by its reference (which
    names its digest), for as long as a run keeps it. Nothing tells the session that a run
    ended: a run's images are held until the session ends.
    """

    def __init__(self) -> None:
        self._bytes: dict[str, bytes] = {}
        self._holders: Counter[str] = Counter()
        self._runs: dict[str, dict[str, None]] = {}  # a run's references, oldest first

    def keep(self, run_id: str, url: str, data: bytes) -> None:
        """Keep ``data`` under ``url`` as the run ``run_id``'s newest image."""
        kept = self._runs.setdefault(run_id, {})
        if url in kept:
            del kept[url]  # it moves to the newest place
        else:
            self._bytes[url] = data
            self._holders[url] += 1
        kept[url] = None
        while len(kept) > _MAX_IMAGES:
            oldest = next(iter(kept))
            del kept[oldest]
            self._release(oldest)

    def get(self, url: str) -> bytes:
        """The bytes kept under ``url``.

        Raises:
            KeyError: no run keeps an image under ``url``.
        """
        return self._bytes[url]

    def _release(self, url: str) -> None:
        """One run kept ``url`` no more; its bytes go when none does."""
        self._holders[url] -= 1
        if not self._holders[url]:
            del self._holders[url]
            del self._bytes[url]


def _transport_error(exc: BaseException) -> BaseException | None:
    """The error of a broken transport that ``exc`` is or holds, else ``None``."""
    for kind in _TRANSPORT_ERRORS:
        found = raised(exc, kind)
        if found is not None:
            return found
    return None


def _size(data: str) -> int:
    """The decoded size of base64 ``data`` (an estimate for invalid data)."""
    return len(data) * 3 // 4 - data.count("=", -2)


def _holds(block: mcp_types.ContentBlock, structured: Any) -> bool:
    """Whether a text block is the serialized structured content (servers should send both)."""
    if not isinstance(block, mcp_types.TextContent):
        return False
    try:
        return bool(json.loads(block.text) == structured)
    except ValueError:
        return False


async def _list_tools(client: Client) -> list[mcp_types.Tool]:
    found: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(_MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        found.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return found
    raise UsageError(f"the MCP server's tool list did not end after {_MAX_PAGES} pages")


def _tool(
    listed: mcp_types.Tool,
    *,
    name: str,
    trusted: bool,
    options: McpToolOptions,
    default_timeout_s: float,
) -> McpTool:
    replay, approval = policy_of(listed.annotations, trusted=trusted)
    schema: dict[str, Any] = dict(listed.input_schema)
    properties = schema.get("properties")
    known = set(properties) if isinstance(properties, Mapping) else set()
    unknown = sorted(options.secret_arguments - known)
    if unknown:
        raise UsageError(
            f"MCP tool {listed.name!r}: secret_arguments names no argument of the tool: "
            + ", ".join(unknown)
        )
    timeout = options.timeout_s if options.timeout_s is not None else default_timeout_s
    _check_timeout(timeout, f"MCP tool {listed.name!r}: timeout_s")
    annotations = (
        {}
        if listed.annotations is None
        else listed.annotations.model_dump(by_alias=True, exclude_none=True)
    )
    return McpTool(
        name=name,
        server_name=listed.name,
        spec=ToolSpec(
            name=name, description=listed.description or listed.title or "", parameters=schema
        ),
        annotations=annotations,
        replay=options.replay if options.replay is not None else replay,
        requires_approval=(
            options.requires_approval if options.requires_approval is not None else approval
        ),
        timeout_s=timeout,
        secret_arguments=options.secret_arguments,
        reconcile=options.reconcile,
    )


def _check_timeout(value: float, what: str) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise UsageError(f"{what} must be a positive number of seconds, got {value!r}")


def _build_tools(
    listed: Sequence[mcp_types.Tool],
    *,
    trusted: bool,
    options: Mapping[str, McpToolOptions],
    include: Collection[str] | None,
    prefix: str,
    default_timeout_s: float,
) -> list[McpTool]:
    """The treadle tools of a server's listing (see `open_mcp_tools` for the arguments).

    Raises:
        UsageError: as `open_mcp_tools` says.
    """
    _check_timeout(default_timeout_s, "default_timeout_s")
    if isinstance(include, str):
        raise UsageError(f"include takes a collection of tool names, e.g. ({include!r},)")
    if not isinstance(prefix, str):
        raise UsageError(f"prefix must be a string, got {prefix!r}")
    names = [entry.name for entry in listed]
    wanted = set(names) if include is None else set(include)
    missing = sorted((wanted | set(options)) - set(names))
    if missing:
        raise UsageError(
            "the MCP server has no tool named "
            + ", ".join(repr(n) for n in missing)
            + "; it has: "
            + (", ".join(names) or "none")
        )
    chosen = [entry for entry in listed if entry.name in wanted]
    bad = [entry.name for entry in chosen if not _NAME.match(prefix + entry.name)]
    if bad:
        raise UsageError(
            "these MCP tool names are not 1-64 characters of A-Z, a-z, 0-9, _ or - "
            f"(with the prefix {prefix!r}): {', '.join(bad)}; leave them out with include="
        )
    counted = Counter(entry.name for entry in chosen)
    twice = [name for name, count in counted.items() if count > 1]
    if twice:
        raise UsageError(
            "the MCP server lists more than one tool under the name "
            f"{', '.join(repr(n) for n in twice)}; leave them out with include="
        )
    return [
        _tool(
            entry,
            name=prefix + entry.name,
            trusted=trusted,
            options=options.get(entry.name, McpToolOptions()),
            default_timeout_s=default_timeout_s,
        )
        for entry in chosen
    ]


def _shown_refused(server: str) -> str:
    """A server string that is no http(s) URL, as an error quotes it: no credential shown.

    Its query and fragment go (`shown_url`), and all before its last ``@`` (user
    information, however the scheme was mistyped: ``http:/bob:pw@host``).
    """
    shown = shown_url(server)
    return f"***@{shown.rpartition('@')[2]}" if "@" in shown else shown


def _target(server: McpServer) -> McpServer:
    """``server``, checked to be one `McpServer` names.

    A string must be an http(s) URL, its scheme in any case (``HTTPS://`` too: a URL's
    scheme is case-insensitive; docs/mcp.md, "MCP tools").

    Raises:
        UsageError: a string that is no http(s) URL (quoted without its credentials,
            `_shown_refused`), or an object that is none of the kinds `McpServer` names.
    """
    if isinstance(server, str) and not server.lower().startswith(("http://", "https://")):
        raise UsageError(
            f"an MCP server URL must start with http:// or https://, got {_shown_refused(server)!r}"
        )
    known = isinstance(server, str | StdioServerParameters | Server | MCPServer)
    if not known and not hasattr(server, "__aenter__"):  # a Transport is an async context
        raise UsageError(
            "server must be an http(s) URL, mcp.StdioServerParameters, an mcp Transport or "
            f"an mcp server object, got {server!r}"
        )
    return server


class _Closure:
    """Why `_TextLines` ended a session's stream, once it has (``None`` before)."""

    def __init__(self) -> None:
        self.reason: str | None = None


class _TextLines(ReadStreamFilter):
    """A stdio transport's read stream that ends at the first line that is no text.

    `_stdio` has the SDK decode the server's stdout with ``surrogateescape``, so a line with
    bytes that are no text in the transport's encoding arrives as the parse error of a string
    holding lone surrogates (pydantic's ``string_unicode``) instead of killing the SDK's
    reader (whose death would leave every request waiting out its timeout). That line ends the
    stream as a closed stdout would: the session fails every pending and later request with
    "connection closed" (docs/mcp.md, "Results").
    """

    def __init__(
        self, inner: ReadStream[SessionMessage | Exception], closure: _Closure, encoding: str
    ) -> None:
        super().__init__(inner)
        self._closure = closure
        self._encoding = encoding

    async def receive(self) -> SessionMessage | Exception:
        """The next message or parse error; `anyio.EndOfStream` after a line that is no text."""
        if self._closure.reason is not None:
            raise anyio.EndOfStream
        item = await self._inner.receive()
        if _undecoded(item):
            self._closure.reason = (
                f"the server wrote bytes that are no {self._encoding} text on its stdout"
            )
            raise anyio.EndOfStream
        return item


def _undecoded(item: SessionMessage | Exception) -> bool:
    """Whether ``item`` is the parse error of a line that held bytes no decoder took."""
    if not isinstance(item, ValidationError):
        return False
    return any(error["type"] == _UNDECODED for error in item.errors())


@asynccontextmanager
async def _stdio(
    params: StdioServerParameters, closure: _Closure
) -> AsyncIterator[TransportStreams]:
    """The SDK's stdio transport, whose read stream ends at a line that is no text.

    ``surrogateescape`` is one of Python's codec error handlers; the SDK hands the
    parameter's handler to the decoder as is (its type lists only the usual three, hence the
    copy without validation).
    """
    escaping = params.model_copy(update={"encoding_error_handler": "surrogateescape"})
    async with stdio_client(escaping) as (read, write):
        yield _TextLines(read, closure, params.encoding), write


def _closed(error: MCPError, wire_checked: bool) -> bool:
    """Whether ``error`` says the session's connection closed, not the server refused.

    Code -32000 is both the SDK's "connection closed" and the first of JSON-RPC's codes for
    a server's own errors, which many servers use. Over HTTP (``wire_checked``) only the wire
    decides: the server never sent it (`no_server_answer`: an error the SDK or treadle made
    up for a request that got no answer), whatever its words
    (docs/decisions/0103-mcp-http-failures-end-the-run.md, point 4). Otherwise only the
    SDK's message makes it a closed connection.
    """
    if no_server_answer(error):
        return True
    if wire_checked:
        return False
    return error.code == mcp_types.CONNECTION_CLOSED and error.message == _SDK_CLOSED


_SDK_CLOSED: Final = "Connection closed"


@asynccontextmanager
async def _connected(
    server: McpServer, connect_timeout_s: float, closure: _Closure
) -> AsyncIterator[Client]:
    """An open `mcp.Client` of ``server``, its handshake done within ``connect_timeout_s``.

    A URL gets the SDK's streamable HTTP transport with treadle's checks (`open_http`); a
    subprocess that decodes strictly gets `_stdio`, which notes in ``closure`` why it ended
    the stream. The handshake, whatever requests the SDK makes of it (a ``server/discover``
    probe with a wait of its own, then ``initialize``), has ``connect_timeout_s`` seconds in
    all (docs/mcp.md, "The session"); ``connect_timeout_s`` also bounds each later request of
    the session that sets no timeout of its own (the tool listing).

    Raises:
        trio.TooSlowError: the handshake did not end within ``connect_timeout_s``.
    """
    target: Any = server
    if isinstance(server, str):
        target = open_http(server)
    elif isinstance(server, StdioServerParameters) and server.encoding_error_handler == "strict":
        target = _stdio(server, closure)
    with trio.CancelScope(deadline=trio.current_time() + connect_timeout_s) as handshake:
        async with Client(target, read_timeout_seconds=connect_timeout_s) as client:
            handshake.deadline = math.inf
            yield client
    if handshake.cancelled_caught:
        raise trio.TooSlowError("the handshake did not end in time")


@asynccontextmanager
async def open_mcp_tools(
    server: McpServer,
    *,
    trusted: bool = False,
    tools: Mapping[str, McpToolOptions] | None = None,
    include: Collection[str] | None = None,
    prefix: str = "",
    default_timeout_s: float = 30.0,
    connect_timeout_s: float = 30.0,
) -> AsyncIterator[McpTools]:
    """Connect to an MCP server, list its tools, and yield them as an action executor.

    The block owns the session (docs/mcp.md, "The session"): run the agent inside it. On
    leaving it the session closes (a stdio server's process is stopped; an HTTP server gets
    a DELETE, whose answer is waited for at most 5 s); a call still running in the tool host
    then fails, and its end is a diagnostic only.

    Args:
        server: what to connect to (`McpServer`).
        trusted: let the server's annotations decide replay and approval (docs/mcp.md,
            "Trust and policies"); otherwise every tool is ``never``.
        tools: options per tool, by its name on the server (`McpToolOptions`).
        include: the server's tool names to offer (default: all of them).
        prefix: put before every name the model sees (e.g. ``"github_"``).
        default_timeout_s: seconds one call may run when its options set none.
        connect_timeout_s: seconds the server may take for the handshake, and to answer
            each request of the tool listing (a server that never answers fails then).

    Raises:
        UsageError: a URL that is not ``http(s)``, ``include`` that is a string (not a
            collection of names), a ``prefix`` that is no string, ``tools`` or ``include``
            naming a tool the server does not list, a name that is not 1-64 characters of
            ``[A-Za-z0-9_-]`` with the prefix or that the server lists for more than one
            tool (among those ``include`` keeps), a server schema that is no valid JSON
            schema, a bad timeout, or secret arguments the schema does not have.
        EnvironmentFailure: the server cannot be reached, its command cannot start, or it
            fails the handshake or the tool listing or does not answer them within
            ``connect_timeout_s`` (the SDK's error is the ``__cause__``).
    """
    target = _target(server)
    _check_timeout(connect_timeout_s, "connect_timeout_s")
    problem: UsageError | None = None
    entered = False
    closure = _Closure()
    try:
        async with _connected(target, connect_timeout_s, closure) as client:
            try:
                chosen = _build_tools(
                    await _list_tools(client),
                    trusted=trusted,
                    options={} if tools is None else tools,
                    include=include,
                    prefix=prefix,
                    default_timeout_s=default_timeout_s,
                )
                built = McpTools(
                    client,
                    chosen,
                    default_timeout_s=default_timeout_s,
                    closed_because=lambda: closure.reason,
                    wire_checked=isinstance(target, str),
                )
            except UsageError as exc:  # raised below, once the session is closed
                problem = exc
            if problem is None:
                entered = True
                yield built
    except Exception as exc:
        if entered:
            raise  # the block's own error, or the session's while the block ran
        leaf = _leaf(exc)
        silent = isinstance(leaf, trio.TooSlowError) or (
            isinstance(leaf, MCPError) and leaf.code == mcp_types.REQUEST_TIMEOUT
        )
        why = f"; it did not answer within {connect_timeout_s:g} s" if silent else ""
        why = f"; {closure.reason}" if closure.reason is not None else why
        raise EnvironmentFailure(
            f"the MCP session with {_describe(target)} could not be opened: "
            f"{type(leaf).__name__}: {leaf}{why}"
        ) from exc
    if problem is not None:
        raise problem


def _leaf(exc: BaseException) -> BaseException:
    """The first error in ``exc``'s (nested) exception groups, or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe(server: McpServer) -> str:
    """``server`` as errors name it: a URL without what can hold secrets (`shown_url`)."""
    if isinstance(server, str):
        return shown_url(server)
    if isinstance(server, StdioServerParameters):
        return f"the command {server.command!r}"
    return repr(server)
