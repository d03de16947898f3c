"""The five seams of treadle as `typing.Protocol`s, and nothing else (docs/seams.md).

The run store seam comes with four capability protocols that a store implements when it
supports them: `LeaseStore` (leases and fencing), `ControlStream` (cancels and decisions from
other processes), `RunIndex` (listing without reading every log; with `RunCounts`, counting
runs by liveness without listing them) and `RunQueue` (a fleet's queue). Argument and return
types live in `treadle.types`. Every implementation, ours and users', is held to the contract
suites in `treadle.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ApprovalDecided,
    Attempt,
    BudgetCaps,
    CancelRequested,
    Claim,
    ControlEntry,
    ControlRecord,
    Event,
    ImageRef,
    Lease,
    Liveness,
    Message,
    ModelIntent,
    ModelReply,
    ModelRequest,
    ModelResult,
    ParsedReply,
    ReplayPolicy,
    RunFinished,
    RunLog,
    RunStarted,
    RunSummary,
    StepRecord,
    Submission,
    ToolSpec,
)

DeltaCallback = Callable[[str, str], None]
"""Called synchronously with ``(channel, text)`` for each streamed fragment, where channel is
``"text"`` or ``"reasoning"``. It must not block; it is never called after the call returns."""


@runtime_checkable
class ModelClient(Protocol):
    """Seam 1: one model call attempt (docs/seams.md, "Model client").

    Retries, the attempt total and budgets belong to the model gateway actor, not to clients:
    one ``complete`` call is exactly one HTTP attempt. What the gateway hands the attempt (its
    connect, first-byte and idle deadlines, the usage observer of the token budget, the run's
    image source) comes as the ``attempt`` argument, and nowhere else.
    """

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        """Send one request and return the assembled reply.

        Args:
            request: the model-visible request.
            on_delta: receives text and reasoning fragments as they stream.
            attempt: the attempt's deadlines (seconds; the client applies the smaller of
                each and its own), usage observer and run image source (`Attempt`). The
                model gateway always passes one; `Attempt.STANDALONE` for a call made
                outside a run.

        Returns:
            The reply; usage counts are ``None`` where the server did not report them.

        Raises:
            treadle.ModelCallError: the attempt failed; ``.info`` classifies it
                (``retryable``, ``retry_after_s``) and ``.usage`` holds any usage reported.
                A deadline of ``attempt`` that passed is kind ``timeout`` (retryable); an
                error ``attempt.report_usage`` raised propagates unchanged.

        Cancellation:
            A checkpoint. Cancelling closes the connection; nothing is left open.
        """
        ...


@runtime_checkable
class DecisionParser(Protocol):
    """Seam 2: turn a reply into actions, a final answer, or an invalid decision.

    It never raises for any input (docs/seams.md, "Decision parser"). If an implementation raises
    anyway, the
    library does not catch it: the run is left unfinished and resumable.
    """

    def parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        """Decide what ``reply`` asks for, given the declared ``tools``. Pure; never raises."""
        ...


@runtime_checkable
class ActionExecutor(Protocol):
    """Seam 3: carry out one action and report its outcome (docs/seams.md, "Action executor").

    What else the library may ask an executor about its tools is `ToolPolicies`.
    """

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
class ToolPolicies(Protocol):
    """What the library asks an action executor about its tools, when it can answer.

    Each method is optional: `treadle.policies.policies_of` looks each one up on the
    executor by name, once for an agent (its `treadle.Agent.tool_policies`), and an executor
    without it gets the default named below; nothing else in the library asks the executor
    by name. `treadle.Toolbox` has them all (it satisfies this Protocol; docs/seams.md,
    "Action executor"). `treadle.testing.seams.check_action_executor` checks the answers of
    those an executor has.
    """

    def requires_approval(self, tool: str) -> bool:
        """Whether every call of ``tool`` waits for a human (default: never)."""
        ...

    def secret_arguments(self, tool: str) -> frozenset[str]:
        """Names of ``tool``'s arguments redacted out of the log (default: none)."""
        ...

    def invalid_arguments(self, tool: str, arguments: Mapping[str, Any]) -> str | None:
        """Why a call cannot run, before any human is asked about it (default: ``None``).

        An unknown tool, or arguments that do not validate against its schema, give a reason
        (a call the executor would answer NOT_EXECUTED); such a call waits for no human.
        """
        ...

    def timeout_s(self, tool: str) -> float | None:
        """Seconds one call of ``tool`` may run, when shorter than `Limits.tool_timeout_s`.

        ``math.inf`` for a call the run's budgets bound instead (a child run); ``None`` for
        a tool without a timeout of its own. Default: the limit, enforced by the tool
        executor; an executor that answers times its calls out itself and is given one more
        second to answer (docs/seams.md, "Action executor").
        """
        ...

    def writes(self, tool: str) -> str | None:
        """The key template of the resource ``tool`` writes (default: ``None``)."""
        ...

    def image_source(self, image: ImageRef) -> bytes:
        """The bytes of a ``ref:`` image one of the executor's tool results returned.

        The model client asks it when its own ``image_source`` does not hold the image
        (docs/models.md, "Images returned by tools"); it raises `LookupError` for an image
        it does not keep (default: the executor keeps none).
        """
        ...


@runtime_checkable
class RunStore(Protocol):
    """Seam 4: the durable run log (docs/seams.md, "Run store"; docs/crash-safety.md).

    Every operation names its ``run_id`` (inside the record). ``seq`` is the record's 1-based
    position in the run's log, assigned by the run's event writer. ``generation`` is the
    writer's lease generation (`treadle.types.Lease`): a store that keeps leases
    (`LeaseStore`) checks it in the same transaction as the write and refuses a stale one
    with `treadle.LeaseLost`; a store without leases takes 0. Barrier operations return only
    once the record and everything written before it is durable; the others may return
    earlier, and a later failure surfaces from the next operation (never swallowed).
    Prefix durability: once write *k* is durable, writes 1..k-1 are too.
    """

    async def write_run_started(self, record: RunStarted, *, seq: int, generation: int) -> None:
        """Append the run-started record (not a barrier)."""
        ...

    async def write_intent(
        self, record: ModelIntent | ActionIntent, *, seq: int, generation: int
    ) -> None:
        """Append an intent. A barrier: durable before returning."""
        ...

    async def write_model_result(self, record: ModelResult, *, seq: int, generation: int) -> None:
        """Append a model-call result (not a barrier)."""
        ...

    async def write_step(
        self,
        action_results: Sequence[ActionResult] | None,
        step: StepRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        """Append the action results and their step record as one atomic write.

        ``action_results`` is required and ``None`` for a step without action; the records
        take seqs ``seq, seq + 1, ...`` with the step record last. Not a barrier.
        """
        ...

    async def write_control(
        self,
        record: ControlRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        """Append a control record (approval, cancel, accepted definition) to the log. A barrier."""
        ...

    async def write_run_finished(self, record: RunFinished, *, seq: int, generation: int) -> None:
        """Append the run-finished record. A barrier: durable before the caller is answered."""
        ...

    async def read_log(self, run_id: str) -> RunLog:
        """Read the run's whole log; a run that does not exist reads as an empty log.

        Raises:
            InvalidRunId: ``run_id`` is not a run id (docs/concepts.md, "Run ids"); nothing
                is read.
        """
        ...

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one record, in the order the runs entered the store.

        A run whose log cannot be read is listed too (reading it raises the error).
        """
        ...

    async def aclose(self) -> None:
        """Flush what is pending and release the store's resources."""
        ...


@runtime_checkable
class LeaseStore(Protocol):
    """Capability of a store that several drivers can open: per-run leases with fencing.

    docs/fleet.md, "Leases": a run is driven only by the holder of its lease. Acquiring
    succeeds when the run has no live lease, the lease expired (judged by the store's own
    clock), or the caller already holds it; a takeover by another owner increments the
    fencing generation. Every write of the run carries the generation (`RunStore`).
    """

    async def acquire_lease(self, run_id: str, *, owner: str, ttl_s: float) -> Lease:
        """Take (or renew, for its holder) the lease on ``run_id`` for ``ttl_s`` seconds.

        Raises:
            RunLeased: another owner holds an unexpired lease (the error names it).
            InvalidRunId: ``run_id`` is not an allowed run id.
            StoreError: the store failed.
        """
        ...

    async def renew_leases(self, leases: Sequence[Lease], *, ttl_s: float) -> tuple[Lease, ...]:
        """Extend the leases still held by their owners, in one transaction.

        Returns:
            The renewed leases, in the order given; a lease missing from the result was lost
            (taken over or released), and its holder must stop.

        Raises:
            StoreError: the store failed (nothing is known about the leases).
        """
        ...

    async def release_lease(self, lease: Lease, *, control_seen: int = 0) -> None:
        """Give the lease up, if still held; a lost lease is left alone.

        Args:
            lease: the lease to release.
            control_seen: the control-stream position the holder handled (copied into the
                log or found stale); a parked run becomes claimable again only when its
                control stream grows past it, or at its approval deadline.
        """
        ...

    async def read_lease(self, run_id: str) -> Lease | None:
        """The run's lease as the store holds it (``owner == ""`` once released), or ``None``."""
        ...


@runtime_checkable
class ControlStream(Protocol):
    """Capability: a per-run stream of cancel requests and approval decisions.

    Processes that do not drive a run (``treadle cancel``, ``treadle approve``, a web console)
    append here; the run's driver reads the stream and copies each record into the log in
    order (docs/decisions/0007-external-control.md). The stream is ordered, durable, and
    never listed as a run.
    """

    async def append_control(self, record: CancelRequested | ApprovalDecided) -> ControlEntry:
        """Append ``record`` to its run's control stream; durable on return.

        Returns:
            The entry, with its position in the run's stream.

        Raises:
            InvalidRunId: ``record.run_id`` is not an allowed run id.
            StoreError: the write failed.
        """
        ...

    async def read_control(self, run_id: str, *, after: int = 0) -> tuple[ControlEntry, ...]:
        """The run's control entries with positions above ``after``, in order."""
        ...

    async def control_heads(self, run_ids: Sequence[str]) -> Mapping[str, int]:
        """The last control position of each of ``run_ids`` (runs without entries are absent).

        One cheap read for many runs: the driving processes poll it to learn which runs have
        new control entries before reading any stream.
        """
        ...


@runtime_checkable
class RunIndex(Protocol):
    """Capability: list runs with their state and liveness without reading every log."""

    async def list_summaries(self, *, last: int | None = None) -> tuple[RunSummary, ...]:
        """Every run of the store (queued ones included), in the order they entered it.

        A run whose log cannot be read is listed with ``error`` and ``where`` set; it never
        hides the others, nor is it left out.

        Args:
            last: only the ``last`` runs that entered the store last (the end of the whole
                listing), found without summarising the others; ``None``, or any number at or
                above the number of runs (``2**64`` too): every run.

        Raises:
            UsageError: ``last`` is below 1.
        """
        ...

    async def read_summary(self, run_id: str) -> RunSummary | None:
        """One run's summary, or ``None`` for a run the store does not know."""
        ...


@runtime_checkable
class RunCounts(Protocol):
    """Capability, next to `RunIndex`: count runs by liveness without listing every run.

    What a gauge of the whole store needs (docs/metrics.md, "What is counted"): a store that
    keeps many finished runs counts them without reading them. A `RunIndex` without it is
    counted from `RunIndex.list_summaries`.
    """

    async def count_runs(self) -> Mapping[Liveness, int]:
        """Liveness -> how many runs `RunIndex.list_summaries` would list with it.

        A liveness no run has may be absent. Judged by the same rule as the summaries
        (`treadle.types.Liveness`), at one instant of the store's clock.
        """
        ...


@runtime_checkable
class RunQueue(Protocol):
    """Capability: the durable queue of a fleet (docs/fleet.md, "The queue").

    Submitted runs wait in state ``queued``; workers claim them, and orphaned or claimable
    parked runs, with one atomic statement, oldest first, up to their free slots.
    """

    async def submit(
        self,
        run_id: str,
        *,
        agent: str,
        input: tuple[Message, ...],
        caps: BudgetCaps | None = None,
        parent: tuple[str, str] | None = None,
    ) -> Submission:
        """Queue a new run; submitting an existing run id again returns its first submission.

        Args:
            run_id: the run.
            agent: the agent name it is served under.
            input: its input.
            caps: for a child run, the bounds its parent's remaining budgets put on its own
                (docs/child-runs.md, "Budgets"); kept with the entry, not compared when the
                same run is submitted again.
            parent: for a child run, ``(parent run id, parent intent id)``.

        Raises:
            UsageError: the run id exists and was submitted for another agent or input, or
                was started without the queue.
            InvalidRunId: ``run_id`` is not allowed.
        """
        ...

    async def claim(
        self,
        *,
        owner: str,
        agents: Mapping[str, Sequence[str]],
        limit: int,
        ttl_s: float,
        max_takeovers: int,
        backoff_s: float,
        driving: Collection[str] = (),
    ) -> tuple[Claim, ...]:
        """Claim up to ``limit`` runs for ``owner``, taking their leases.

        Args:
            owner: the claiming worker's owner id.
            agents: the agent names served, each with the versions served (a run already
                started is claimed only by a worker serving its recorded version).
            limit: free slots.
            ttl_s: lease duration.
            max_takeovers: a run whose drivers died this many times is quarantined instead
                of claimed again.
            backoff_s: base delay before a run whose driver died is claimed again (doubled
                at each further takeover).
            driving: the runs the claiming worker drives now: never claimed, even when
                their leases expired (the worker was paused past the TTL; its next renewal
                keeps them, or tells it they were taken over). Claiming one would take a
                worker's own run over from itself: docs/fleet.md, "Claiming".
        """
        ...

    async def release_quarantine(self, run_id: str) -> bool:
        """Make a quarantined run claimable again; ``False`` when it was not quarantined."""
        ...

    async def wake(self, run_id: str) -> bool:
        """Make a run parked on child runs claimable now (state ``awaiting_child``).

        Called once one of its children finished (docs/child-runs.md, "In a fleet"), and
        by the run's own driver once its park is durable, when a child finished before it.
        ``False`` (nothing changed) when the run is in any other state (a parent still
        driven is woken by that look, docs/child-runs.md, "Parking while the child works").
        """
        ...

    async def read_submission(self, run_id: str) -> Submission | None:
        """The run's queue entry (agent, input, submitted at), or ``None`` if never queued."""
        ...


@runtime_checkable
class EventSink(Protocol):
    """Seam 5: receives a run's ordered events.

    A sink that fails or is slow never interrupts or stalls the loop: the event writer feeds
    it through a bounded buffer and counts its failures and drops on the run. One sink object
    may serve several runs at once (a fleet's sinks): events name their run. When this
    process stops feeding it a run it did not finish, it gets a last ``run_left`` event for
    that run (docs/seams.md, "Event sink").
    """

    async def send(self, event: Event) -> None:
        """Receive one event, in seq order for its run."""
        ...
