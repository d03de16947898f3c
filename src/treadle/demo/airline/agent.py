"""The airline agent definition: the recorded system prompt, the 14 tools, and the customer.

The model sees the 14 airline tools (`TOOL_SPECS`). A reply in plain text is a message to the
customer: `NativeToolCallParser` turns it into an action on the `RESPOND_TOOL` (``respond``,
not offered to the model) whose observation is the customer's answer, which enters history as
a ``user`` message, exactly as in the recordings. A customer message containing
``###STOP###`` and a transfer to a human agent are the environment's completion signal.

`AirlineExecutor` implements `treadle.ports.ActionExecutor` over one conversation's
`AirlineDatabase`:

* read tools (and ``transfer_to_human_agents``) are replayed as ``safe``: re-running a read
  after a crash gives the same text;
* the six database-changing tools are ``never`` replayed: each commits its change together
  with the action's intent id (`run_tool`), so on resume `AirlineExecutor.reconcile` finds
  out from the database whether the change happened (and returns its stored output) or
  did not (and then performs it, once, under the same intent id);
* ``respond`` is ``safe``: its observation is a pure function of its position among the
  run's replies (see `AirlineExecutor`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Protocol

import trio

from treadle.agent import Agent
from treadle.demo.airline.data import Recording
from treadle.demo.airline.db import AirlineDatabase, reconcile
from treadle.demo.airline.scoring import STOP_MARKER
from treadle.demo.airline.tools import (
    TERMINAL_TOOLS,
    TOOL_SPECS,
    WRITE_TOOLS,
    InvalidArgumentsError,
    UnknownToolError,
    run_tool,
)
from treadle.parsers import NativeToolCallParser
from treadle.ports import ModelClient
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionStatus,
    Budgets,
    Limits,
    ReplayPolicy,
    RunLog,
    ToolSpec,
)

RESPOND_TOOL: Final = "respond"
"""The action a plain-text reply becomes: a message to the customer."""

RECORDED_MODEL: Final = "gpt-4o"
"""The model the recordings were made with (the model name sent in replay)."""

MAX_STEPS: Final = 30
"""The benchmark's step limit: at most 30 assistant turns per conversation."""

SAMPLING_PARAMS: Final[Mapping[str, float]] = {"temperature": 0.0}
"""The benchmark ran its agent at temperature 0."""

_TOOL_NAMES: Final = frozenset(spec.name for spec in TOOL_SPECS)


class Customer(Protocol):
    """The other side of the conversation: answers the agent's replies."""

    async def answer(self, index: int, agent_text: str) -> str | None:
        """Return the customer's answer to reply number ``index`` of the run.

        Args:
            index: 0 for the agent's first reply to the customer, 1 for the next, ...
            agent_text: what the agent said.

        Returns:
            The customer's message (containing ``###STOP###`` when the customer ends the
            conversation), or ``None`` when the customer cannot answer at all.
        """
        ...


class RecordedCustomer:
    """The customer of a recording: answers reply ``k`` with the recorded ``k``-th answer.

    The recorded answers are the recording's ``user`` messages after the first one (the first
    one is the run input). The answer depends only on the position, so asking again after a
    crash gives the same text.

    Args:
        recording: the recorded conversation.
    """

    def __init__(self, recording: Recording) -> None:
        users = [m for m in recording.messages if m.get("role") == "user"]
        self.answers: tuple[str, ...] = tuple(str(m.get("content") or "") for m in users[1:])

    async def answer(self, index: int, agent_text: str) -> str | None:
        """The recorded answer number ``index``, or ``None`` past the recording's end."""
        await trio.lowlevel.checkpoint()
        return self.answers[index] if 0 <= index < len(self.answers) else None


ReadLine = Callable[[], Awaitable[str | None]]
"""Reads one line from the person (without its newline); ``None`` at end of input."""


class TerminalCustomer:
    """The person at the terminal is the customer.

    Each answer is one line; a line ending with a backslash continues on the next line (the
    backslash becomes a newline), so a multi-line message can be typed or scripted. End of
    input means the customer leaves: the answer is ``###STOP###``.

    Args:
        read_line: reads one line (see `ReadLine`).
        show: prints the agent's reply before the person answers.
    """

    def __init__(self, read_line: ReadLine, show: Callable[[str], None]) -> None:
        self._read_line = read_line
        self._show = show

    async def first_message(self) -> str | None:
        """Read the customer's opening message; ``None`` when input ended at once."""
        return await self.read_message()

    async def read_message(self) -> str | None:
        """Read one message (joining continued lines); ``None`` at end of input."""
        lines: list[str] = []
        while True:
            line = await self._read_line()
            if line is None:
                return "\n".join(lines) if lines else None
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)

    async def answer(self, index: int, agent_text: str) -> str | None:
        """Show the agent's reply and read the person's answer (``###STOP###`` at EOF)."""
        self._show(agent_text)
        message = await self.read_message()
        return STOP_MARKER if message is None else message


OutcomeObserver = Callable[[Action, ActionOutcome], None]
"""Called after each action the executor ran or reconciled (for progress output)."""


class AirlineExecutor:
    """The airline environment of one conversation as a treadle action executor.

    ``respond`` actions are numbered by their position among the run's replies: the step of
    each one is mapped to the next free number the first time it is seen, and the map is
    seeded from the run's stored intents on resume (`respond_positions`), so a reply
    re-executed after a crash gets the same number and therefore the same answer.

    Args:
        db: the conversation's database (one file per conversation).
        customer: who answers the agent's replies.
        respond_positions: step -> reply number, for the replies already in the run's log.
        observer: called after every action with its outcome.
    """

    def __init__(
        self,
        db: AirlineDatabase,
        customer: Customer,
        *,
        respond_positions: Mapping[int, int] | None = None,
        observer: OutcomeObserver | None = None,
    ) -> None:
        self.db = db
        self.customer = customer
        self._positions: dict[int, int] = dict(respond_positions or {})
        self._observer = observer

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The 14 airline tools (``respond`` is not offered: a text reply is one)."""
        return TOOL_SPECS

    def replay_policy(self, tool: str) -> ReplayPolicy:
        """``never`` for the six database-changing tools and unknown tools, else ``safe``."""
        if tool == RESPOND_TOOL or (tool in _TOOL_NAMES and tool not in WRITE_TOOLS):
            return ReplayPolicy.SAFE
        return ReplayPolicy.NEVER

    async def execute(self, action: Action) -> ActionOutcome:
        """Run one tool call, or deliver a reply to the customer.

        Returns:
            EXECUTED with the tool's exact output text (refusals included, they start with
            ``Error:``); NOT_EXECUTED for an unknown tool or arguments that do not match the
            tool's schema; ENV_ERROR when the database fails or the customer cannot answer.
            ``task_completed`` is set by a transfer to a human agent and by a customer message
            containing ``###STOP###``.

        Raises:
            IntentConflictError: the intent id was applied by another tool (a broken log).

        Cancellation:
            A checkpoint. A database call already handed to its thread finishes (its
            transaction commits or rolls back as a whole); its outcome is then unknown to the
            run and is found again by `reconcile`.
        """
        if action.tool == RESPOND_TOOL:
            outcome = await self._respond(action)
        else:
            outcome = await self._run_tool(action)
        self._observe(action, outcome)
        return outcome

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        """Establish what a database-changing action interrupted by a crash did.

        The change and its intent id commit in one transaction, so the database tells
        exactly: applied (the stored output is returned, nothing is repeated) or not applied
        (nothing of it happened, so it is performed now, once, under the same intent id).

        Returns:
            The outcome; NOT_EXECUTED for a tool that does not exist; ``None`` for an action
            this executor cannot account for.

        Raises:
            IntentConflictError: as `execute`.
            sqlite3.Error: the database cannot be read; the run is left interrupted (and
                resumable) rather than recording an outcome nobody established.
        """
        if action.tool not in _TOOL_NAMES and action.tool != RESPOND_TOOL:
            return await self.execute(action)
        if action.tool not in WRITE_TOOLS:
            return None
        stored = await trio.to_thread.run_sync(reconcile, self.db, action.intent_id)
        if stored is None:
            return await self.execute(action)
        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation=stored)
        self._observe(action, outcome)
        return outcome

    def respond_position(self, step: int) -> int:
        """The reply number of the ``respond`` action of ``step`` (assigned on first use)."""
        if step not in self._positions:
            self._positions[step] = len(self._positions)
        return self._positions[step]

    async def _respond(self, action: Action) -> ActionOutcome:
        text = action.arguments.get("content")
        answer = await self.customer.answer(self.respond_position(action.step), str(text or ""))
        if answer is None:
            return ActionOutcome(
                status=ActionStatus.ENV_ERROR,
                observation="the customer has nothing more to say",
            )
        return ActionOutcome(
            status=ActionStatus.EXECUTED,
            observation=answer,
            task_completed=STOP_MARKER in answer,
        )

    async def _run_tool(self, action: Action) -> ActionOutcome:
        arguments = dict(action.arguments)
        try:
            output = await trio.to_thread.run_sync(
                run_tool, self.db, action.tool, arguments, action.intent_id
            )
        except (UnknownToolError, InvalidArgumentsError) as exc:
            return ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=str(exc))
        except sqlite3.Error as exc:
            return ActionOutcome(
                status=ActionStatus.ENV_ERROR,
                observation=f"the airline database failed: {type(exc).__name__}: {exc}",
            )
        return ActionOutcome(
            status=ActionStatus.EXECUTED,
            observation=output,
            task_completed=action.tool in TERMINAL_TOOLS,
        )

    def _observe(self, action: Action, outcome: ActionOutcome) -> None:
        if self._observer is not None:
            self._observer(action, outcome)


def respond_positions(log: RunLog) -> dict[int, int]:
    """Step -> reply number for the ``respond`` intents stored in a run's log.

    Args:
        log: the run's log (empty for a new run).

    Returns:
        The steps of the stored ``respond`` intents, in step order, numbered 0, 1, ...
    """
    steps = sorted(
        {r.step for r in log.records if isinstance(r, ActionIntent) and r.tool == RESPOND_TOOL}
    )
    return {step: position for position, step in enumerate(steps)}


def system_prompt(recording: Recording) -> str:
    """The recording's system message (the airline policy)."""
    first = recording.messages[0]
    if first.get("role") != "system":
        raise ValueError(f"{recording.name}: the first message is not a system message")
    return str(first.get("content") or "")


def first_customer_message(recording: Recording) -> str:
    """The customer's opening message: the run input of a replay."""
    for message in recording.messages:
        if message.get("role") == "user":
            return str(message.get("content") or "")
    raise ValueError(f"{recording.name}: the recording has no customer message")


def airline_agent(
    *,
    model: ModelClient,
    executor: AirlineExecutor,
    system: str,
    model_name: str = RECORDED_MODEL,
) -> Agent:
    """The airline agent definition, as the recordings were made.

    Args:
        model: the model client (the replay server's or a live endpoint's).
        executor: the conversation's environment.
        system: the system prompt (the airline policy).
        model_name: sent with every request.

    Returns:
        The agent: 14 tools, text replies as ``respond`` actions, temperature 0, at most
        `MAX_STEPS` steps, observations entering history as the exact tool output (never cut).
    """
    return Agent(
        model=model,
        executor=executor,
        parser=NativeToolCallParser(text_reply_tool=RESPOND_TOOL),
        model_name=model_name,
        system_prompt=system,
        params=dict(SAMPLING_PARAMS),
        budgets=Budgets(max_steps=MAX_STEPS),
        limits=Limits(max_observation_chars=None),
        observation_template="{observation}",
    )
