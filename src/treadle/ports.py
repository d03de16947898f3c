"""The five seams of treadle as `typing.Protocol`s (DESIGN §3), and nothing else.

Argument and return types live in `treadle.types`. Every implementation, ours and users',
is held to the contract suites in `treadle.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    Event,
    ModelIntent,
    ModelReply,
    ModelRequest,
    ModelResult,
    ParsedReply,
    ReplayPolicy,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
    ToolSpec,
)

DeltaCallback = Callable[[str, str], None]
"""Called synchronously with ``(channel, text)`` for each streamed fragment, where channel is
``"text"`` or ``"reasoning"``. It must not block; it is never called after the call returns."""


@runtime_checkable
class ModelClient(Protocol):
    """Seam 1: one model call attempt (DESIGN §3.1).

    Retries, deadlines and budgets belong to the model gateway actor, not to clients: one
    ``complete`` call is exactly one HTTP attempt.
    """

    async def complete(
        self, request: ModelRequest, *, on_delta: DeltaCallback | None = None
    ) -> ModelReply:
        """Send one request and return the assembled reply.

        Args:
            request: the model-visible request.
            on_delta: receives text and reasoning fragments as they stream.

        Returns:
            The reply; usage counts are ``None`` where the server did not report them.

        Raises:
            treadle.ModelCallError: the attempt failed; ``.info`` classifies it
                (``retryable``, ``retry_after_s``) and ``.usage`` holds any usage reported.

        Cancellation:
            A checkpoint. Cancelling closes the connection; nothing is left open.
        """
        ...


@runtime_checkable
class DecisionParser(Protocol):
    """Seam 2: turn a reply into actions, a final answer, or an invalid decision.

    It never raises for any input (DESIGN §3.2). If an implementation raises anyway, the
    library does not catch it: the run is left unfinished and resumable.
    """

    def parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        """Decide what ``reply`` asks for, given the declared ``tools``. Pure; never raises."""
        ...


@runtime_checkable
class ActionExecutor(Protocol):
    """Seam 3: carry out one action and report its outcome (DESIGN §3.3)."""

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The tools offered to the model, in declaration order."""
        ...

    def replay_policy(self, tool: str) -> ReplayPolicy:
        """The replay policy of ``tool`` (``NEVER`` for unknown tools)."""
        ...

    async def execute(self, action: Action) -> ActionOutcome:
        """Run ``action`` and return its outcome.

        A tool that raised, a non-zero exit or an SQL error is EXECUTED with the error text as
        observation. An unknown tool or invalid arguments is NOT_EXECUTED. ENV_ERROR means the
        environment can serve no more. For NOT_EXECUTED and ENV_ERROR the library replaces the
        observation with the definition's synthetic text and keeps this one as ``detail``.

        Cancellation:
            A checkpoint; a cancelled call raises `trio.Cancelled` and its outcome is unknown.
        """
        ...

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        """On resume, establish what an action whose result was never stored did.

        Returns:
            The outcome when it can be established (by ``action.intent_id``), else ``None``.
        """
        ...


@runtime_checkable
class RunStore(Protocol):
    """Seam 4: the durable run log (DESIGN §3.4, §4).

    Every operation names its ``run_id`` (inside the record). ``seq`` is the record's 1-based
    position in the run's log, assigned by the run's event writer. Barrier operations return
    only once the record and everything written before it is durable; the others may return
    earlier, and a later failure surfaces from the next operation (never swallowed).
    Prefix durability: once write *k* is durable, writes 1..k-1 are too.
    """

    async def write_run_started(self, record: RunStarted, *, seq: int) -> None:
        """Append the run-started record (not a barrier)."""
        ...

    async def write_intent(self, record: ModelIntent | ActionIntent, *, seq: int) -> None:
        """Append an intent. A barrier: durable before returning."""
        ...

    async def write_model_result(self, record: ModelResult, *, seq: int) -> None:
        """Append a model-call result (not a barrier)."""
        ...

    async def write_step(
        self, action_results: Sequence[ActionResult] | None, step: StepRecord, *, seq: int
    ) -> None:
        """Append the action results and their step record as one atomic write.

        ``action_results`` is required and ``None`` for a step without action; the records
        take seqs ``seq, seq + 1, ...`` with the step record last. Not a barrier.
        """
        ...

    async def write_control(
        self, record: CancelRequested | ApprovalRequested | ApprovalDecided, *, seq: int
    ) -> None:
        """Append an approval or cancel record. A barrier."""
        ...

    async def write_run_finished(self, record: RunFinished, *, seq: int) -> None:
        """Append the run-finished record. A barrier: durable before the caller is answered."""
        ...

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log; a run that does not exist reads as an empty log."""
        ...

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one record, in first-write order."""
        ...

    async def aclose(self) -> None:
        """Flush what is pending and release the store's resources."""
        ...


@runtime_checkable
class EventSink(Protocol):
    """Seam 5: receives a run's ordered events.

    A sink that fails or is slow never interrupts or stalls the loop: the event writer feeds
    it through a bounded buffer and counts its failures and drops on the run.
    """

    async def send(self, event: Event) -> None:
        """Receive one event, in seq order."""
        ...
