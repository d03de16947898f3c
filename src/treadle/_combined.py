"""One action executor over several: local tools and MCP servers together (`combine_tools`).

::

    async with open_mcp_tools(server, prefix="bank_") as bank:
        tools = combine_tools(Toolbox([add, note]), bank)
        agent = Agent(model=..., executor=tools, parser=NativeToolCallParser(), ...)

The combined executor offers the tools of every part, in part order and each part's own order
within it, under names that must be unique across the parts; it hands each call, and every
question the library asks about a tool (`treadle.ports.ToolPolicies`, the replay policy,
``reconcile`` on resume), to the part that owns the tool, under the tool's name in that part
(docs/concepts.md, "Several tool sources"; docs/decisions/0071-combined-tools.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

import attrs
import trio

from treadle._exceptions import UsageError
from treadle.policies import NO_POLICIES, ExecutorPolicies, policies_of
from treadle.ports import ActionExecutor
from treadle.types import Action, ActionOutcome, ActionStatus, ImageRef, ReplayPolicy, ToolSpec

__all__ = ["CombinedTools", "ToolPart", "combine_tools"]

ToolPart: TypeAlias = ActionExecutor | tuple[str, ActionExecutor]
"""One part of `combine_tools`: an action executor, or ``(prefix, executor)`` to put
``prefix`` before each of its tool names."""

_NAME: Final = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")


@attrs.frozen(kw_only=True)
class _Route:
    """Where a combined tool name goes: the part's index and the tool's name there."""

    index: int
    name: str


def _not_executed(detail: str) -> ActionOutcome:
    return ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=detail, detail=detail)


def _split(part: object, number: int) -> tuple[str, ActionExecutor]:
    """``(prefix, executor)`` of one argument of `combine_tools` (``number`` is 1-based)."""
    prefix: object = ""
    executor = part
    if isinstance(part, tuple):
        if len(part) != 2:
            raise UsageError(
                f"combine_tools: part {number} is a tuple of {len(part)}; a prefixed part "
                "is a pair (prefix, executor)"
            )
        prefix, executor = part
    if not isinstance(prefix, str):
        raise UsageError(f"combine_tools: the prefix of part {number} must be a str: {prefix!r}")
    if not isinstance(executor, ActionExecutor):
        hint = "; wrap local tools in Toolbox([...])" if _looks_like_tools(executor) else ""
        raise UsageError(
            f"combine_tools: part {number} ({executor!r}) is not an action executor "
            f"(tool_specs, replay_policy, execute, reconcile){hint}"
        )
    return prefix, executor


def _looks_like_tools(value: object) -> bool:
    from treadle.tools import Tool

    items = value if isinstance(value, list | tuple) else (value,)
    return any(isinstance(item, Tool) for item in items)


def _label(number: int, prefix: str, executor: ActionExecutor) -> str:
    """How an error names a part: its position, its type, its prefix."""
    shown = f"part {number} ({type(executor).__name__}"
    return shown + (f", prefix {prefix!r})" if prefix else ")")


class CombinedTools:
    """Several action executors offered to the model as one (`treadle.ports.ActionExecutor`).

    Built by `combine_tools`. It has every `treadle.ports.ToolPolicies` method: each answers
    for a tool what the part owning it answers (under the tool's name in that part), and what
    the library assumes for an executor without that method when the part has none. A name
    no part offers gets the answers of an unknown tool.

    The parts' tool lists are read once, when combined: a part whose list changes later is
    not followed (the list is part of the parameter snapshot, docs/crash-safety.md, "Resume").

    Raises:
        UsageError: when built, for a name clash or a bad name, as `combine_tools` says.
    """

    def __init__(self, parts: Sequence[tuple[str, ActionExecutor]]) -> None:
        self._parts = tuple(parts)
        self._policies = tuple(policies_of(executor) for _, executor in self._parts)
        self._specs: list[ToolSpec] = []
        self._routes: dict[str, _Route] = {}
        for index, (prefix, executor) in enumerate(self._parts):
            for spec in executor.tool_specs():
                self._add(index, prefix, executor, spec)

    def _add(self, index: int, prefix: str, executor: ActionExecutor, spec: ToolSpec) -> None:
        name = prefix + spec.name
        here = _label(index + 1, prefix, executor)
        if not _NAME.match(name):
            raise UsageError(
                f"combine_tools: the tool name {name!r} of {here} is not 1-64 characters of "
                "A-Z, a-z, 0-9, _ or -"
            )
        taken = self._routes.get(name)
        if taken is not None:
            if taken.index == index:
                raise UsageError(f"combine_tools: {here} offers two tools named {name!r}")
            there_prefix, there = self._parts[taken.index]
            raise UsageError(
                f"combine_tools: the tool name {name!r} is offered by "
                f"{_label(taken.index + 1, there_prefix, there)} and by {here}; rename one "
                "(@tool(name=...), open_mcp_tools(..., prefix=...)) or give a part a prefix: "
                "combine_tools(..., ('some_prefix_', executor))"
            )
        self._routes[name] = _Route(index=index, name=spec.name)
        self._specs.append(attrs.evolve(spec, name=name) if prefix else spec)

    @property
    def parts(self) -> tuple[tuple[str, ActionExecutor], ...]:
        """The parts as ``(prefix, executor)`` pairs, in order (``""``: no prefix)."""
        return self._parts

    def part_of(self, tool: str) -> tuple[ActionExecutor, str] | None:
        """The executor that owns ``tool`` and the tool's name there, or ``None``."""
        route = self._routes.get(tool)
        return None if route is None else (self._parts[route.index][1], route.name)

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """Every part's tools under their combined names: part order, then each part's order."""
        return tuple(self._specs)

    def _owner(self, tool: str) -> tuple[ExecutorPolicies, str]:
        """The owner's policies (looked up once, when combined) and the tool's name there.

        A tool no part offers gets the policies of an executor that declares none.
        """
        route = self._routes.get(tool)
        if route is None:
            return NO_POLICIES, tool
        return self._policies[route.index], route.name

    def replay_policy(self, tool: str) -> ReplayPolicy:
        """The owner's replay policy of ``tool`` (``NEVER`` for a tool no part offers)."""
        found = self.part_of(tool)
        return ReplayPolicy.NEVER if found is None else found[0].replay_policy(found[1])

    def requires_approval(self, tool: str) -> bool:
        """The owner's answer (``False``: unknown tool, or the owner has no such method)."""
        policies, name = self._owner(tool)
        return bool(policies.requires_approval(name))

    def secret_arguments(self, tool: str) -> frozenset[str]:
        """The owner's secret argument names of ``tool`` (none when it declares none)."""
        policies, name = self._owner(tool)
        return policies.secret_arguments(name)

    def invalid_arguments(self, tool: str, arguments: Mapping[str, Any]) -> str | None:
        """Why a call cannot run: an unknown tool, else the owner's reason (``None``: it can)."""
        if tool not in self._routes:
            return f"unknown tool {tool!r}"
        policies, name = self._owner(tool)
        return policies.invalid_arguments(name, arguments)

    def timeout_s(self, tool: str) -> float | None:
        """The owner's timeout of ``tool`` in seconds.

        ``None`` when the owner has no ``timeout_s`` method (or ``tool`` is unknown): the
        library then applies `treadle.Limits.tool_timeout_s` and times the call out itself,
        as for such an executor alone (docs/seams.md, "Action executor").
        """
        policies, name = self._owner(tool)
        return policies.timeout_s(name)

    def writes(self, tool: str) -> str | None:
        """The key template of the resource ``tool`` writes, as its owner says (else ``None``)."""
        policies, name = self._owner(tool)
        return policies.writes(name)

    def image_source(self, image: ImageRef) -> bytes:
        """The bytes of ``image`` from the first part that keeps it, in part order.

        Raises:
            KeyError: no part keeps it (or no part has an ``image_source``).
        """
        for policies in self._policies:
            source = policies.image_source
            if source is None:
                continue
            try:
                data: bytes = source(image)
            except LookupError:
                continue
            return data
        raise KeyError(image.url)

    async def execute(self, action: Action) -> ActionOutcome:
        """Hand ``action`` to the part that owns its tool, under the tool's name there.

        Returns:
            The owner's outcome as it is; NOT_EXECUTED when no part offers the tool.

        Cancellation:
            A checkpoint (the owner's, or this one's for an unknown tool); `trio.Cancelled`
            propagates, as the owner lets it.
        """
        route = self._routes.get(action.tool)
        if route is None:
            await trio.lowlevel.checkpoint()
            known = ", ".join(self._routes) or "none"
            return _not_executed(f"unknown tool {action.tool!r}; the known tools are: {known}")
        return await self._parts[route.index][1].execute(_renamed(action, route.name))

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        """Ask the owner what an interrupted call did (``None`` for a tool no part offers).

        Raises:
            Exception: whatever the owner's ``reconcile`` raises.
        """
        route = self._routes.get(action.tool)
        if route is None:
            await trio.lowlevel.checkpoint()
            return None
        return await self._parts[route.index][1].reconcile(_renamed(action, route.name))


def _renamed(action: Action, name: str) -> Action:
    """``action`` as its owner knows it: under the tool's name in that part."""
    return action if action.tool == name else attrs.evolve(action, tool=name)


def combine_tools(*parts: ToolPart) -> CombinedTools:
    """Offer the tools of several action executors to one agent.

    Each part is an action executor (a `treadle.Toolbox`, a `treadle.mcp.McpTools`, your
    own) or a ``(prefix, executor)`` pair, whose tool names the model sees with ``prefix``
    before them. Each call and each policy question goes to the part that owns the tool
    (docs/concepts.md, "Several tool sources").

    Args:
        parts: the parts, in the order their tools are offered (and snapshotted).

    Returns:
        The combined executor, to pass as an agent's ``executor``.

    Raises:
        UsageError: no part; a part that is no action executor (local tools go into a
            `treadle.Toolbox` first) or a prefix that is no ``str``; two parts offering one
            name (the error names both parts and how to tell them apart); a part offering
            one name twice; a prefixed name that is not 1-64 characters of ``[A-Za-z0-9_-]``.
    """
    if not parts:
        raise UsageError("combine_tools needs at least one executor")
    return CombinedTools([_split(part, number) for number, part in enumerate(parts, 1)])
