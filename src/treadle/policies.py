"""What an action executor declares about its tools, looked up once.

The library asks an executor more than the four `treadle.ports.ActionExecutor` methods when
the executor can answer: the optional methods of `treadle.ports.ToolPolicies`. `policies_of`
looks each of them up once and fills in the documented default of each method the executor
does not have; the run's actors, its supervisor and the parameter snapshot ask the result,
never the executor by name (docs/seams.md, "Action executor";
docs/decisions/0091-explicit-seams.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from treadle._exceptions import SeamViolation, UsageError
from treadle.types import ImageSource, ReplayPolicy

POLICY_METHODS: tuple[str, ...] = (
    "requires_approval",
    "secret_arguments",
    "invalid_arguments",
    "timeout_s",
    "writes",
    "image_source",
)
"""The names of the optional `treadle.ports.ToolPolicies` methods, in their documented order."""


def replay_policy_of(executor: Any, tool: str) -> ReplayPolicy:
    """What ``executor.replay_policy(tool)`` answers, as a `ReplayPolicy`.

    The member itself or its value (``"safe"``, ``"never"``) are taken, as they are by the
    contract check (`treadle.testing.seams.check_action_executor`); the run's actors ask
    through here, never compare the answer themselves (docs/seams.md, "Action executor").

    Raises:
        SeamViolation: the answer is neither a `ReplayPolicy` nor the value of one (the run is
            interrupted, its log left resumable).
    """
    answer = executor.replay_policy(tool)
    try:
        return ReplayPolicy(answer)
    except ValueError:
        raise SeamViolation(
            f"action executor's replay_policy({tool!r})", answer, "ReplayPolicy.SAFE or NEVER"
        ) from None


def _never(tool: str) -> bool:
    return False


def _no_secrets(tool: str) -> frozenset[str]:
    return frozenset()


def _runnable(tool: str, arguments: Mapping[str, Any]) -> str | None:
    return None


def _no_timeout(tool: str) -> float | None:
    return None


def _writes_nothing(tool: str) -> str | None:
    return None


@attrs.frozen(kw_only=True, eq=False)
class ExecutorPolicies:
    """The `treadle.ports.ToolPolicies` of one action executor, each its own or the default.

    Made by `policies_of`; every attribute but ``declared`` and ``image_source`` is a
    function, called like the executor's method of the same name.

    Attributes:
        declared: the names of the `POLICY_METHODS` the executor has.
        requires_approval: ``(tool) -> bool``, whether every call of ``tool`` waits for a
            human (default: never; docs/events.md, "Human approval").
        secret_arguments: ``(tool) -> frozenset[str]``, the argument names of ``tool``
            redacted out of the log (default: none; docs/events.md, "Secret arguments");
            an answer that is no collection of ``str`` (a bare ``str`` among them) raises
            `SeamViolation`.
        invalid_arguments: ``(tool, arguments) -> str | None``, why a call cannot run,
            before any human is asked about it (default: ``None``, every call can run).
        timeout_s: ``(tool) -> float | None``, seconds one call of ``tool`` may run when
            shorter than `treadle.types.Limits.tool_timeout_s`, ``math.inf`` for a call the
            run's budgets bound instead (a child run), ``None`` when the executor has no
            timeout of its own (default: ``None``; the tool executor then applies the limit
            and times the call out itself, docs/seams.md, "Action executor").
        writes: ``(tool) -> str | None``, the key template of the resource ``tool`` writes
            (default: ``None``; docs/concepts.md, "Stale writes").
        image_source: the executor's ``image_source`` (a ``ref:`` image's bytes; raises
            `LookupError` for an image it does not keep), or ``None`` when it has none
            (docs/models.md, "Images returned by tools").
    """

    declared: frozenset[str] = frozenset()
    requires_approval: Callable[[str], bool] = _never
    secret_arguments: Callable[[str], frozenset[str]] = _no_secrets
    invalid_arguments: Callable[[str, Mapping[str, Any]], str | None] = _runnable
    timeout_s: Callable[[str], float | None] = _no_timeout
    writes: Callable[[str], str | None] = _writes_nothing
    image_source: ImageSource | None = None


NO_POLICIES = ExecutorPolicies()
"""The policies of an executor that declares none: every default."""


def policies_of(executor: object) -> ExecutorPolicies:
    """Look up ``executor``'s `treadle.ports.ToolPolicies` methods, once.

    An attribute missing or ``None`` is not declared and gets its default (see
    `ExecutorPolicies`). The methods found are kept bound, so a wrapper that forwards them
    (`treadle.testing.CrashingExecutor`) keeps its inner executor's answers.

    Raises:
        UsageError: one of the `POLICY_METHODS` is present but not callable.
    """
    found: dict[str, Any] = {}
    for name in POLICY_METHODS:
        method = getattr(executor, name, None)
        if method is None:
            continue
        if not callable(method):
            where = 'docs/seams.md, "Action executor"'
            raise UsageError(
                f"the action executor's {name} is {method!r}, not a method: the optional "
                f"ToolPolicies methods are called with the tool's name ({where})"
            )
        found[name] = method
    if not found:
        return NO_POLICIES
    secrets = found.get("secret_arguments")
    if secrets is not None:
        found["secret_arguments"] = _frozen_names(secrets)
    return ExecutorPolicies(declared=frozenset(found), **found)


def _frozen_names(ask: Callable[[str], Any]) -> Callable[[str], frozenset[str]]:
    """``ask``, its answer made a frozenset (an executor may answer with any iterable).

    The answer is a collection of argument names (docs/seams.md, "Action executor"): a
    ``str`` is one name, not a collection, and is never split into its characters.

    Raises (from the returned function):
        SeamViolation: the answer is a ``str`` or ``bytes``, not iterable, or holds
            something other than ``str``.
    """

    def secret_arguments(tool: str) -> frozenset[str]:
        answer = ask(tool)
        names = None if isinstance(answer, str | bytes | bytearray) else _names_in(answer)
        if names is None:
            raise SeamViolation(
                f"action executor's secret_arguments({tool!r})",
                answer,
                "a collection of argument names (str), e.g. a tuple",
            )
        return names

    return secret_arguments


def _names_in(answer: object) -> frozenset[str] | None:
    """The str items of the iterable ``answer``; ``None`` when it is none or holds others."""
    try:
        names = frozenset(answer)  # type: ignore[call-overload]
    except TypeError:
        return None
    return names if all(isinstance(name, str) for name in names) else None
