"""The messages the actors of a run exchange, in one place (docs/design.md, "The five actors").

Each actor serves one inbox (`treadle.actors._mailbox`); a request that wants an answer
carries a one-shot `ReplySlot`. The coordinator's requests go to the hydrator (`Hydrate`),
the gateway (`CallModel`) and the executor (`RunActions`); every actor's writes go to the
event writer (`Append`, `Delta`, `Warn`, `Forward`, `Subscribe`); the run's handle, its
control stream and its supervisor reach the coordinator with `Control` messages (`Cancel`,
`Offer`, `Drain`). The step's cancellation and active-time deadline travel as a `StepScope`,
the one object the actors of a step share.

Actor modules import their messages from here, never from each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

import attrs
import trio

from treadle._budget import Summary
from treadle.actors._rpc import ReplySlot, StepScope
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    Event,
    ModelErrorInfo,
    ModelReply,
    ModelRequest,
    ModelResult,
    Record,
    StepRecord,
    StopReason,
    StoreOp,
    ToolCall,
)


@attrs.frozen(kw_only=True)
class Hydrate:
    """Ask for the next model request, after adding ``new_steps`` to the history.

    Attributes:
        new_steps: step records not yet handed over, oldest first.
        summary: the latest durable summary of the run, ``None`` for none.
        calibration: ``(counted, reported)`` input tokens of the run's latest step request
            (not a summary's) with a context record: the counter's count and the provider's
            report (docs/context.md, "Counting tokens").
        force: the provider refused the step's last attempt for its context length:
            summarise every step but the newest.
        refused_tokens: with ``force``, the estimated size of the refused request (from its
            result's context record), ``None`` when unknown.
        refused_window: with ``force``, the window the provider's error stated, tokens,
            ``None`` when it stated none.
    """

    new_steps: tuple[StepRecord, ...]
    reply_to: ReplySlot[ModelRequest | Compaction]
    summary: Summary | None = None
    calibration: tuple[int, int] | None = None
    force: bool = False
    refused_tokens: int | None = None
    refused_window: int | None = None


@attrs.frozen(kw_only=True)
class Compaction:
    """The hydrator's answer when older steps must be summarised before the request fits.

    Attributes:
        request: the summariser's request (docs/context.md, "Summaries").
        through: the last step the summary will cover.
    """

    request: ModelRequest
    through: int


@attrs.frozen(kw_only=True)
class CallModel:
    """Make the model call of ``step``.

    Attributes:
        step: the step index.
        request: the model request.
        run_attempts: model attempts the run has made so far (budget accounting).
        step_attempts: attempts already made in this step (resume), so ids stay unique.
        step_failures: failed attempts already made of this call, a summary's or the step's
            own (retry accounting, `treadle._state.PendingStep.failures_of`).
        tokens: reported tokens used by the run so far.
        scope: the step's cancellation and active-time deadline.
        summary_through: set for a compaction: the request asks for a summary of the steps
            up to this one (docs/context.md, "Summaries"); its intent and result say so.
        last_failure: the step's last failed attempt already in the log (a resumed step),
            whose server-directed wait the next attempt keeps; ``None`` otherwise.
    """

    step: int
    request: ModelRequest
    run_attempts: int
    step_attempts: int
    step_failures: int
    tokens: int
    scope: StepScope
    reply_to: ReplySlot[ModelOutcome]
    summary_through: int | None = None
    last_failure: ModelResult | None = None


@attrs.frozen(kw_only=True)
class ModelOutcome:
    """The gateway's answer.

    Attributes:
        reply: the successful reply, or ``None``.
        intent_id: the intent of the successful attempt.
        error: the last attempt's error when the call failed for good.
        stop: a budget that ended the call (``max_model_attempts``, ``token_budget``,
            ``time_budget``) or ``cancelled``; ``None`` otherwise.
        written: every record the gateway wrote, in order (the coordinator folds them).
    """

    reply: ModelReply | None = None
    intent_id: str | None = None
    error: ModelErrorInfo | None = None
    stop: StopReason | None = None
    written: tuple[Record, ...] = ()


@attrs.frozen(kw_only=True)
class RunActions:
    """Run the actions of ``step``.

    Attributes:
        calls: the tool calls, in the order the model gave them.
        existing: action intents already in the log for this step (resume), in call order.
        scope: the step's cancellation and active-time deadline.
        rejected: calls a human rejected (or whose approval expired), by call id, with the
            detail of their synthetic observation; they get no intent and never run.
        handed: the executor appends each intent here once it handed it to the writer, so
            that the coordinator can give it a result even if no answer comes.
        revisions: the revisions the run observed before this step, folded from its log
            (`treadle._state.RunView.revisions`), handed to every action of the step.
        tokens_left: the run's token budget minus what it spent (``None``: no budget),
            handed to every action of the step (a child run draws from it).
    """

    step: int
    calls: tuple[ToolCall, ...]
    existing: tuple[ActionIntent, ...]
    scope: StepScope
    reply_to: ReplySlot[ActionsOutcome]
    rejected: Mapping[str, str] = attrs.field(factory=dict)
    handed: list[ActionIntent] = attrs.field(factory=list)
    revisions: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    tokens_left: int | None = None


@attrs.frozen(kw_only=True)
class AwaitedChild:
    """A call of the step that parked while its queued child run works.

    Attributes:
        intent_id: the call's action intent.
        child_run_id: the child run it waits on.
        recheck_s: seconds after which the parked run is claimable again without a wake-up.
    """

    intent_id: str
    child_run_id: str
    recheck_s: float


@attrs.frozen(kw_only=True)
class ActionsOutcome:
    """The executor actor's answer.

    Attributes:
        results: one result per call, in call order. When the step was cancelled or cut
            by the time budget: one result per action whose intent was written, marked
            ``late`` (never applied). Empty when calls parked (``awaiting``).
        observations: the text each result put into history, in call order.
        stop: ``cancelled`` or ``time_budget`` when the step was cut off mid-action.
        written: the intents written, in order.
        awaiting: the calls that parked on child runs, in call order; non-empty only when
            every other call ended and all of them may run again on resume (their
            results are dropped: the step runs its calls again, docs/child-runs.md, "In a
            fleet").
        reported_active_s: the most active seconds a call of the step reported spending on
            the run's behalf as another log records them (`treadle.types.Action`
            ``report_active_s``: a child run's); 0.0 when none did.
    """

    results: tuple[ActionResult, ...] = ()
    observations: tuple[str, ...] = ()
    stop: StopReason | None = None
    written: tuple[Record, ...] = ()
    awaiting: tuple[AwaitedChild, ...] = ()
    reported_active_s: float = 0.0


@attrs.frozen(kw_only=True)
class Append:
    """Write ``records`` with store operation ``op``.

    ``reply_to`` is set for barriers: the writer answers once the write is durable. For a
    `StoreOp.STEP` the records are the action results followed by the step record.
    """

    op: StoreOp
    records: tuple[Record, ...]
    reply_to: ReplySlot[int] | None = None


@attrs.frozen(kw_only=True)
class Delta:
    """An ephemeral text or reasoning fragment (already coalesced by the sender)."""

    channel: str
    text: str


@attrs.frozen(kw_only=True)
class Warn:
    """A live warning for the run's subscribers (never stored, never sent to sinks)."""

    text: str


@attrs.frozen(kw_only=True)
class Forward:
    """Another run's event (a child run's) for this run's live subscribers only."""

    event: Event


@attrs.frozen(kw_only=True)
class Subscribe:
    """Join the live event stream.

    The reply is the seq of the last durable event and the channel that receives every
    later event (durable and deltas).
    """

    reply_to: ReplySlot[Subscription]


@attrs.frozen(kw_only=True)
class Subscription:
    """Answer to `Subscribe`.

    Attributes:
        last_seq: the seq of the last durable event before ``events`` starts.
        tail: recent durable events up to ``last_seq`` (may start after seq 1).
        events: later events; closed when the run ends or the subscriber fell too far behind.
    """

    last_seq: int
    tail: tuple[Event, ...]
    events: trio.MemoryReceiveChannel[Event]


WriterRequest = Append | Delta | Warn | Forward | Subscribe


@attrs.frozen(kw_only=True)
class Cancel:
    """Cancel the run (docs/concepts.md, "Stop reasons" rule A): the step in flight is cut.

    Attributes:
        reason: why, in words (recorded in the cancel record).
        canceller: who asked (recorded too).
        here: asked through this process's handle, so not durable yet (``False``: read from
            the run's control stream).
    """

    reason: str = ""
    canceller: str = ""
    here: bool = False


@attrs.frozen(kw_only=True)
class Offer:
    """An approval decision for the run (from its handle or its control stream).

    Approve, reject or edit, or the expiry the run's driver wrote to the control stream at
    the deadline: of those for the request the run waits on, the first that counts
    (`treadle.approvals.counts`) is applied; one that matches no request of the run, of no
    known kind, or a human's stamped after the deadline, never is (docs/events.md, "Human
    approval").

    Attributes:
        decided: the decision.
        here: handed over through this process's handle, so not durable yet (``False``: read
            from the run's control stream); the run reads its control stream once before it
            takes such a decision (`take_offer`).
    """

    decided: ApprovalDecided
    here: bool = False


@attrs.frozen(kw_only=True)
class Drain:
    """Stop driving the run at its next safe point; the run stays unfinished (docs/fleet.md)."""


Control = Cancel | Offer | Drain
"""What the run coordinator's inbox carries."""


KeepDecision = Callable[
    [ApprovalRequested, ApprovalDecided], Awaitable[tuple[ApprovalDecided, Sequence[Control]]]
]
"""``keep(request, decided) -> (counting, unseen)``: keep a handle's decision, say which counts.

It makes ``decided``, handed over by the run's handle for ``request``, durable in the run's
control stream, then reads the stream once. ``counting`` is the first decision there that
counts for ``request`` (`treadle.approvals.first_counting`: the handle's, or one another
process wrote before it); ``unseen`` are the stream's entries not handed over yet, as
`Control` messages in order. Raises `StoreError` when the write or the reading fails.
"""


async def take_offer(
    offer: Offer,
    read_control: Callable[[], Awaitable[Sequence[Control]]] | None,
    apply: Callable[[Control], None],
    cancelled: Callable[[], bool],
    *,
    keep: Callable[[ApprovalDecided], Awaitable[tuple[ApprovalDecided, Sequence[Control]]]]
    | None = None,
) -> ApprovalDecided | None:
    """The decision the run takes for ``offer``; ``None`` when a cancel comes first.

    The one rule for a driven run (`treadle.actors.RunCoordinator`) and a parked one
    (`treadle.supervisors`), live or resumed after a crash: of the decisions for a call, the
    first one made durable in the run's control stream counts, and a cancel the run knows of
    when it takes a decision wins, and the decision is not applied (docs/events.md, "Human
    approval"). A decision handed over by the run's handle (``offer.here``) is in no control
    stream yet: ``keep`` appends it there and reads the stream once, so a decision another
    process wrote before it (`treadle.approvals.decide`, ``treadle approve``) is the one
    taken, as a run resumed from the stream would take it, and a cancel written there before
    that reading (`treadle.approvals.request_cancel`, ``treadle cancel``) is known, and wins.
    Without ``keep`` the stream is only read (``read_control``) for such a cancel. A cancel
    written after the reading does not undo the decision: it cancels the run from there on.

    Args:
        offer: the first decision that counts for the request the run waits on, of those
            the run knows of.
        read_control: reads the run's control stream once, now: its entries not handed over
            yet, in order (``None``: the store has no control streams).
        apply: applies one control message to the run (`RunCoordinator.apply`,
            ``Parking.apply``).
        cancelled: whether the run knows of a cancel now.
        keep: makes a handle's decision durable in the control stream and says which one
            counts: a `KeepDecision` given the request the run waits on (``None``: the
            store has no control streams).

    Raises:
        StoreError: the write or the reading of the control stream failed (nothing was
            taken).
    """
    decided = offer.decided
    if offer.here and read_control is not None and not cancelled():
        if keep is not None:
            decided, unseen = await keep(decided)
        else:
            unseen = await read_control()
        for message in unseen:
            apply(message)
    return None if cancelled() else decided
