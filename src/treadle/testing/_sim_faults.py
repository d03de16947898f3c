"""The simulation's fault plan and its injectors: seeded actor latency, lease takeovers.

Part of `treadle.testing.simulation`, which re-exports the public names (docs/simulation.md).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import attrs
import trio
import trio.testing

from treadle._exceptions import UsageError
from treadle.actors import MailboxReceiver, StepScope, open_mailbox
from treadle.approvals import Decision
from treadle.ports import RunStore
from treadle.stores import LEASE_TTL_S
from treadle.stores.memory import MemoryStore
from treadle.supervisors import InboxActor
from treadle.testing._intercept import InterceptingStore
from treadle.testing.faults import FAULT_KINDS
from treadle.testing.scripted import STALLED
from treadle.types import (
    ModelErrorInfo,
    Record,
    RunFinished,
    StoreOp,
)

LATENCY_MAX_S = 0.2
"""The longest delay `with_latency` adds to one request in the simulation (virtual seconds)."""


def _check_kinds(kinds: Iterable[str]) -> None:
    """Refuse a kind not in `FAULT_KINDS`.

    Raises:
        UsageError: (a `ValueError`) naming the unknown kinds.
    """
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        raise UsageError(f"unknown fault kinds: {', '.join(map(repr, unknown))}")


def _check_rates(rates: Mapping[str, float]) -> None:
    """Refuse unknown kinds and rates outside 0..1 (docs/simulation.md, "Faults").

    Raises:
        UsageError: (a `ValueError`) ``rates`` is no mapping, holds an unknown kind or a
            rate that is not a number within 0..1.
    """
    if not isinstance(rates, Mapping):
        raise UsageError(f"FaultPlan: rates must map fault kinds to rates, not {rates!r}")
    _check_kinds(rates)
    for kind, rate in rates.items():
        number = isinstance(rate, int | float) and not isinstance(rate, bool)
        if not (number and 0 <= rate <= 1):
            raise UsageError(f"rate must be within 0..1, got {rate!r} for {kind}")


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Which faults are on and how often (probability per opportunity, 0..1).

    Attributes:
        rates: fault kind -> rate. A kind not present is off.

    Raises:
        UsageError: (a `ValueError`) when built: a kind not in `FAULT_KINDS` (a misspelt kind
            would leave its fault off without a word), or a rate that is not a number within
            0..1.
    """

    rates: dict[str, float] = attrs.field(factory=dict, validator=lambda _, __, v: _check_rates(v))

    @classmethod
    def default(cls) -> FaultPlan:
        """Every kind on, at rates that let most runs reach their end.

        Crashes are frequent (0.5 per process incarnation); fatal model and environment
        faults are rare. ``approval`` is the rate of steps calling a tool that needs a human
        decision; ``latency`` the rate of requests to the gateway and executor delayed;
        ``takeover`` the rate of incarnations whose lease another driver takes over at a
        seeded write (the incarnation is refused and stops, as a paused process woken after a
        takeover would); ``thread`` the rate of simulated runs that continue a thread (see
        `FaultPlan.threads`); ``child_run`` the rate of steps handing a task to a child run
        (`treadle.agent_tool`, docs/child-runs.md), whose writes go through the same faulty
        store, so crashes, store errors, takeovers and cancels hit the child too.
        """
        return cls(
            rates={
                "crash": 0.5,
                "store_error": 0.1,
                "model_429": 0.05,
                "model_5xx": 0.05,
                "model_reset": 0.05,
                "model_truncated": 0.05,
                "model_stalled": 0.03,
                "model_context_length": 0.01,
                "tool_exception": 0.1,
                "tool_timeout": 0.05,
                "tool_stuck": 0.03,
                "bad_text": 0.05,
                "env_error": 0.02,
                "cancel": 0.05,
                "approval": 0.1,
                "latency": 0.2,
                "takeover": 0.1,
                "child_run": 0.1,
                "thread": 0.2,
            }
        )

    @classmethod
    def compaction(cls) -> FaultPlan:
        """The faults that meet compaction: for `treadle.testing.windowed.ContextScenario`.

        Crashes at any write (so at every write of a summary's intent and result), failed
        store writes, lease takeovers, latency, retryable provider errors (a summary call
        retried), and ``model_context_length``: the provider's real window is smaller than
        the agent declares, so it refuses requests and the step compacts and retries
        (docs/context.md, "Context-length errors"). Every log is checked by
        `treadle.testing.invariants.check_context` besides the usual invariants.
        """
        return cls(
            rates={
                "crash": 0.7,
                "store_error": 0.1,
                "takeover": 0.1,
                "latency": 0.2,
                "model_5xx": 0.05,
                "model_context_length": 0.3,
            }
        )

    @classmethod
    def threads(cls) -> FaultPlan:
        """The default plan with every simulated run continuing a thread.

        Before such a run, its thread's first run (``sim-<seed>-<i>``, a final answer of the
        same agent) is driven to its end without faults; the simulated run is the thread's
        second (``sim-<seed>-<i>.2``), started with ``thread_id`` and resumed by its id
        after every crash. On top of the other checks, every request the model received in
        it must start with the first run's recorded history (docs/threads.md). Only runs
        whose agent's model is a `treadle.testing.ScriptedModel` the world holds can be
        continued so (its ``turn_offset`` skips the inherited turn); others run as single
        runs, and `SimulationResult.skipped` says so.
        """
        default = cls.default()
        return cls(rates={**default.rates, "thread": 1.0})

    @classmethod
    def of(cls, kinds: Iterable[str] = FAULT_KINDS, *, rate: float = 0.1) -> FaultPlan:
        """A plan with ``kinds`` switched on at ``rate``.

        Raises:
            UsageError: (a `ValueError`) an unknown kind, ``kinds`` a string (one kind is
                ``["crash"]``) or a mapping (its rates would be dropped for ``rate``: a
                rate per kind is ``FaultPlan(rates={kind: rate})``), or a rate outside 0..1.
        """
        if isinstance(kinds, str):  # its letters are no kinds
            raise UsageError(
                f"FaultPlan.of: kinds must be a collection of fault kinds, not the string "
                f"{kinds!r} (write [{kinds!r}])"
            )
        if isinstance(kinds, Mapping):  # its values would be dropped for ``rate``
            raise UsageError(
                f"FaultPlan.of: kinds must be a collection of fault kinds, not the mapping "
                f"{dict(kinds)!r}, whose rates it would drop (rates by kind are "
                f"FaultPlan(rates={dict(kinds)!r}))"
            )
        return cls(rates=dict.fromkeys(kinds, rate))

    def roll(self, rng: random.Random, kind: str) -> bool:
        """Whether fault ``kind`` happens at this opportunity.

        Raises:
            UsageError: (a `ValueError`) ``kind`` is not in `FAULT_KINDS` (it would never
                happen).
        """
        _check_kinds((kind,))
        rate = self.rates.get(kind, 0.0)
        return rate > 0 and rng.random() < rate


_PLANNED_DECISIONS = (Decision.APPROVE.value, Decision.REJECT.value, Decision.EDIT.value)
"""The decisions a simulated human can take (``expired`` is the deadline's, not a human's)."""

_PATHS = ("handle", "control")


def _check_delay(plan: ApprovalPlan, field: attrs.Attribute[float], value: float) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value >= 0):
        raise UsageError(f"ApprovalPlan: delay_s must be seconds >= 0, not {value!r}")


def _check_choice(choices: tuple[str, ...]) -> Callable[[Any, attrs.Attribute[str], str], None]:
    def check(plan: Any, field: attrs.Attribute[str], value: str) -> None:
        if value not in choices:
            raise UsageError(
                f"ApprovalPlan: {field.name} must be one of {', '.join(choices)}, not {value!r}"
            )

    return check


def _check_plan(plan: ApprovalPlan) -> None:
    if not isinstance(plan.message, str):
        raise UsageError(f"ApprovalPlan: message must be text, not {plan.message!r}")
    if plan.decision == Decision.EDIT.value and not isinstance(plan.edit, Mapping):
        raise UsageError(
            f"ApprovalPlan: edit must be the edited arguments (a mapping) for decision edit, "
            f"not {plan.edit!r}"
        )


@attrs.frozen(kw_only=True)
class ApprovalPlan:
    """How the simulated human decides one tool call that needs approval.

    Attributes:
        delay_s: virtual seconds from seeing the request to deciding. Longer than the
            agent's approval deadline means the deadline ends the wait first.
        decision: ``approve``, ``reject`` or ``edit``.
        via: ``handle`` (`RunHandle.approve`, in-process) or ``control`` (`decide` on the
            run's control log, as another process would).
        restart: the driving process dies once while the call waits (before the decision
            for ``handle``, right after writing it for ``control``); the next incarnation
            gets the decision.
        message: the rejection message.
        edit: the edited arguments (required for ``edit``); arguments that do not fit the
            tool's schema make the simulation raise `UsageError` when the human decides.

    Raises:
        UsageError: when built: ``delay_s`` is not a finite number >= 0, ``decision`` or
            ``via`` is not one of the values above, ``message`` is not text, or an ``edit``
            decision has no ``edit`` mapping (the message names the field).
    """

    delay_s: float = attrs.field(validator=_check_delay)
    decision: str = attrs.field(
        default=Decision.APPROVE.value, validator=_check_choice(_PLANNED_DECISIONS)
    )
    via: str = attrs.field(default="handle", validator=_check_choice(_PATHS))
    restart: bool = False
    message: str = ""
    edit: Mapping[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        _check_plan(self)


C_contra = TypeVar("C_contra", contravariant=True)


Q = TypeVar("Q")


C = TypeVar("C")


@attrs.define(eq=False)
class DelayedActor(Generic[Q]):
    """Forwards each request to ``inner`` after a seeded delay on the trio clock.

    A request that carries a step scope (model calls, actions) waits inside that scope: a
    cancel or the active-time deadline ends the wait, and the inner actor then sees the step
    cut exactly as if the request had come at once. Requests keep their order.

    Attributes:
        inner: the wrapped actor.
        rng: draws whether a request is delayed (probability ``rate``) and by how long
            (uniform in ``0..max_s`` seconds).
        on_delay: called with each delay drawn (e.g. to count injected faults).
    """

    inner: InboxActor[Q]
    rng: random.Random
    rate: float
    max_s: float
    on_delay: Callable[[float], None] | None = None

    async def run(
        self,
        inbox: MailboxReceiver[Q],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``inbox`` through the delay until it ends; then the inner actor ends too."""
        # 1: the inner actor takes one request at a time, like the coordinator's inboxes.
        send, recv = open_mailbox[Q](1)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.inner.run, recv)
            task_status.started()
            async with inbox, send:
                async for message in inbox:
                    await self._delay(message)
                    await send.send(message)

    async def _delay(self, message: Q) -> None:
        if not (self.rate > 0 and self.rng.random() < self.rate):
            return
        delay = self.rng.uniform(0.0, self.max_s)
        if self.on_delay is not None:
            self.on_delay(delay)
        scope = getattr(message, "scope", None)
        if isinstance(scope, StepScope):
            with scope.open():
                await trio.sleep(delay)
        else:
            await trio.sleep(delay)


def with_latency(
    factory: Callable[[C], InboxActor[Q]],
    *,
    seed: int,
    rate: float = 1.0,
    max_s: float = LATENCY_MAX_S,
    on_delay: Callable[[float], None] | None = None,
) -> Callable[[C], DelayedActor[Q]]:
    """Wrap an actor factory so its requests arrive after seeded delays (virtual seconds).

    Use on any role served from an inbox, e.g.
    ``Actors(gateway=with_latency(real_gateway, seed=7))``; the other actors stay as they
    are. The same seed draws the same delays for the same sequence of requests.

    Args:
        factory: the actor factory to wrap (e.g. `treadle.supervisors.real_gateway`).
        seed: seeds the delays.
        rate: the probability (0..1) that a request is delayed.
        max_s: the longest delay, seconds (finite, at least 0).
        on_delay: called with each delay drawn.

    Raises:
        UsageError: (a `ValueError`) ``rate`` no number within 0..1 (a bool included), or a
            ``max_s`` that is negative
            or not finite (NaN, infinity), refused here rather than by the run that draws a
            delay from it (docs/simulation.md, "Swapping actors").
    """
    number = isinstance(rate, int | float) and not isinstance(rate, bool)
    if not (number and 0 <= rate <= 1):  # a bool is no probability, though True == 1
        raise UsageError(f"with_latency: rate must be a number within 0..1, not {rate!r}")
    if not (math.isfinite(max_s) and max_s >= 0):
        raise UsageError(
            f"with_latency: max_s must be a finite number of seconds >= 0, not {max_s!r}"
        )

    def build(context: C) -> DelayedActor[Q]:
        return DelayedActor(
            inner=factory(context),
            rng=random.Random(seed),
            rate=rate,
            max_s=max_s,
            on_delay=on_delay,
        )

    return build


_MODEL_FAULTS: dict[str, ModelErrorInfo] = {
    "model_429": ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=2.0, status=429),
    "model_5xx": ModelErrorInfo(kind="server_error", retryable=True, status=503),
    "model_reset": ModelErrorInfo(kind="connection", retryable=True),
    "model_truncated": ModelErrorInfo(kind="incomplete_stream", retryable=True),
    "model_stalled": ModelErrorInfo(kind=STALLED),
    "model_context_length": ModelErrorInfo(kind="context_length_exceeded", status=400),
}


_PERSISTENT = 1_000
"""Attempts a persistent scripted model failure lasts (more than any budget allows)."""


@attrs.define(eq=False)
class _LeaseClock:
    """The simulated store's clock: trio's virtual time, which a takeover fault moves ahead."""

    ahead_s: float = 0.0

    def now(self) -> float:
        return 1_800_000_000.0 + trio.current_time() + self.ahead_s


@attrs.define(eq=False)
class _TakenOver(InterceptingStore):
    """At write ``at``, another driver takes the run's lease over (after letting it expire).

    The write then reaches the store with the old generation and is refused (`LeaseLost`):
    the incarnation stops, and the next one takes the run over again from its log.
    """

    inner: MemoryStore
    at: int
    clock: _LeaseClock
    writes: int = 0

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        self.writes += 1
        if self.writes == self.at:
            run_id = records[0].run_id
            self.clock.ahead_s += LEASE_TTL_S + 1.0  # the driver looked dead for a TTL
            thief = await self.inner.acquire_lease(run_id, owner="another-driver", ttl_s=1.0)
            await self.inner.release_lease(thief)
        return False


@attrs.define(eq=False)
class _CancelAt(InterceptingStore):
    """Cancels the run right after write ``at`` of the incarnation reached the store.

    Writes are counted from 1, those of the run's child runs included (they share the
    store), as for a crash (docs/simulation.md, "Faults"). ``cancel`` (set by `arm` once the
    run's handle exists) is called then, in the task that wrote, before the run goes on;
    when the write came before `arm`, `arm` calls it. The write that finishes ``run_id``
    (its `RunFinished`) calls nothing: the run has ended.
    """

    inner: RunStore
    run_id: str
    at: int
    writes: int = 0
    due: bool = False
    cancel: Callable[[], None] | None = None

    def arm(self, cancel: Callable[[], None]) -> None:
        """Call ``cancel`` at the write (now, if it was made already)."""
        self.cancel = cancel
        self._fire()

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        self.writes += 1
        if self.writes == self.at:
            self.due = not any(
                isinstance(r, RunFinished) and r.run_id == self.run_id for r in records
            )
            self._fire()

    def _fire(self) -> None:
        if self.due and self.cancel is not None:
            self.due = False
            self.cancel()
