"""The model gateway alone: a real `ModelGateway` with a scripted model and a fake writer.

The test plays the coordinator (it sends `CallModel` requests through the gateway's inbox with
`treadle.actors._rpc.request`) and a `FakeWriter` plays the event writer, answering the intent
barriers (docs/design.md, "The five actors").
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator

import attrs
import pytest
import trio
import trio.testing
from actor_fakes import FakeWriter, start_fake_writer

from treadle._clock import FixedStepClock
from treadle._exceptions import ModelCallError
from treadle.actors import CallModel, ModelGateway, ModelOutcome, StepScope, WriterClient, request
from treadle.ports import ModelClient
from treadle.testing import ScriptedModel, say
from treadle.testing.scripted import STALLED
from treadle.types import (
    Attempt,
    Budgets,
    ImageRef,
    ImageSource,
    Limits,
    Message,
    ModelErrorInfo,
    ModelIntent,
    ModelRequest,
    ModelResult,
    StopReason,
    StoreOp,
    Usage,
)

REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),), model="m")

RATE_LIMITED = ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=2.0, status=429)


def _gateway(
    writer: WriterClient,
    model: ModelClient,
    budgets: Budgets | None = None,
    image_source: ImageSource | None = None,
    **limits: float | None,
) -> ModelGateway:
    return ModelGateway(
        run_id="r",
        client=model,
        writer=writer,
        clock=FixedStepClock(),
        limits=Limits(retry_initial_s=0.5, retry_max_s=4.0, **limits),  # type: ignore[arg-type]
        budgets=budgets or Budgets(),
        rng=random.Random(0),
        image_source=image_source,
    )


async def _call(
    inbox: trio.MemorySendChannel[CallModel], scope: StepScope | None = None, **fields: int
) -> ModelOutcome:
    """One `CallModel` of step 1 through the gateway's inbox, as the coordinator sends it."""
    counters = {"run_attempts": 0, "step_attempts": 0, "step_failures": 0, "tokens": 0}
    counters.update(fields)
    outcome: ModelOutcome = await request(
        inbox,
        lambda reply_to: CallModel(
            step=1,
            request=REQUEST,
            scope=scope or StepScope(),
            reply_to=reply_to,
            **counters,
        ),
    )
    return outcome


@contextlib.asynccontextmanager
async def _alone(
    model: ModelClient, fake: FakeWriter | None = None, **options: object
) -> AsyncIterator[tuple[trio.MemorySendChannel[CallModel], FakeWriter]]:
    """The gateway, started alone behind a fake writer.

    On exit its inbox is closed and the block waits for the gateway to return on its own
    (nothing cancels it), then closes the fake writer's inbox.
    """
    async with trio.open_nursery() as outer:
        writer, fake = await start_fake_writer(outer, fake)
        gateway = _gateway(writer, model, **options)  # type: ignore[arg-type]
        # 0: the gateway's inbox is unbuffered (docs/design.md, "The five actors").
        send, recv = trio.open_memory_channel[CallModel](0)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(gateway.run, recv)
                async with send:
                    yield send, fake
        finally:
            writer.inbox.close()


async def test_a_call_writes_its_intent_before_the_request_and_its_result_after(autojump_clock):
    model = ScriptedModel(turns=[say("hello", usage=Usage(input_tokens=5, output_tokens=2))])
    async with _alone(model) as (inbox, fake):
        outcome = await _call(inbox)
    assert outcome.reply is not None and outcome.reply.text == "hello"
    assert outcome.intent_id == "r/s1/m1" and outcome.stop is None
    ops = [(op, type(records[0])) for _, op, records in fake.appended]
    assert ops == [(StoreOp.INTENT, ModelIntent), (StoreOp.MODEL_RESULT, ModelResult)]
    assert outcome.written == tuple(fake.records())  # what it wrote comes back in its answer
    assert len(model.requests) == 1


async def test_a_retryable_error_is_retried_after_retry_after_with_its_own_intent(autojump_clock):
    model = ScriptedModel(turns=[say("ok")], failures={0: [RATE_LIMITED]})
    async with _alone(model) as (inbox, fake):
        before = trio.current_time()
        outcome = await _call(inbox)
        waited = trio.current_time() - before
    assert outcome.reply is not None
    assert outcome.intent_id == "r/s1/m2"
    results = fake.records(ModelResult)
    assert [r.error.kind if r.error else None for r in results] == ["rate_limited", None]  # type: ignore[attr-defined]
    assert waited >= RATE_LIMITED.retry_after_s  # exactly the server's Retry-After, not backoff


async def test_a_final_error_is_answered_not_raised(autojump_clock):
    final = ModelErrorInfo(kind="bad_request", status=400)
    model = ScriptedModel(turns=[say("never")], failures={0: [final]})
    async with _alone(model) as (inbox, _):
        outcome = await _call(inbox)
    assert outcome.reply is None and outcome.error == final and outcome.stop is None
    assert len(model.requests) == 1


async def test_the_attempt_budget_stops_the_call_before_any_attempt(autojump_clock):
    model = ScriptedModel(turns=[say("never")])
    async with _alone(model, budgets=Budgets(max_model_attempts=3)) as (inbox, fake):
        outcome = await _call(inbox, run_attempts=3)
    assert outcome.stop is StopReason.MAX_MODEL_ATTEMPTS
    assert model.requests == [] and fake.appended == []


@pytest.mark.parametrize(
    "error",
    [RATE_LIMITED, attrs.evolve(RATE_LIMITED, retry_after_s=None)],
    ids=["retry-after", "backoff"],
)
async def test_no_retry_wait_is_slept_once_the_attempt_budget_is_spent(autojump_clock, error):
    # The call slept the server's wait (or the backoff) and only then found that no attempt
    # was left: the run stalled for nothing, the wait counted as active time.
    model = ScriptedModel(turns=[say("never")], failures={0: [error]})
    async with _alone(model, budgets=Budgets(max_model_attempts=2)) as (inbox, _):
        before = trio.current_time()
        outcome = await _call(inbox, run_attempts=1)
        waited = trio.current_time() - before
    assert outcome.stop is StopReason.MAX_MODEL_ATTEMPTS and len(model.requests) == 1
    assert waited == 0


async def test_a_resumed_step_with_no_attempt_left_skips_the_rest_of_its_wait(autojump_clock):
    model = ScriptedModel(turns=[say("never")])
    refused = ModelResult(
        run_id="r",
        step=1,
        intent_id="r/s1/m1",
        ts=FixedStepClock().now_iso(),
        error=attrs.evolve(RATE_LIMITED, retry_after_s=60.0),
    )
    async with _alone(model, budgets=Budgets(max_model_attempts=1)) as (inbox, fake):
        before = trio.current_time()
        outcome = await _call(inbox, run_attempts=1, step_attempts=1, last_failure=refused)  # type: ignore[arg-type]
        waited = trio.current_time() - before
    assert outcome.stop is StopReason.MAX_MODEL_ATTEMPTS and waited == 0
    assert model.requests == [] and fake.appended == []


async def test_cancelling_the_step_cuts_the_stream_and_records_the_cut_attempt(autojump_clock):
    model = ScriptedModel(turns=[say("never")], failures={0: [ModelErrorInfo(kind=STALLED)]})
    scope = StepScope()

    async def cancel_once_called() -> None:
        await trio.testing.wait_all_tasks_blocked()  # the stalled attempt is in flight
        assert len(model.requests) == 1
        scope.cancel("user cancel")

    async with trio.open_nursery() as nursery, _alone(model) as (inbox, fake):
        nursery.start_soon(cancel_once_called)
        outcome = await _call(inbox, scope)
    assert outcome.stop is StopReason.CANCELLED and outcome.reply is None
    (result,) = fake.records(ModelResult)
    assert result.error is not None and result.error.kind == "cancelled"  # type: ignore[attr-defined]


async def test_a_retry_that_would_outlast_the_step_deadline_is_not_slept(autojump_clock):
    model = ScriptedModel(turns=[say("ok")], failures={0: [RATE_LIMITED]})
    async with _alone(model) as (inbox, _):
        deadline = trio.current_time() + 1.0  # less than the 2 s Retry-After
        before = trio.current_time()
        outcome = await _call(inbox, StepScope(deadline))
        assert trio.current_time() - before < 1.0
    assert outcome.stop is StopReason.TIME_BUDGET and len(model.requests) == 1


@pytest.mark.parametrize(("cap", "slept"), [(600.0, False), (None, True), (3600.0, True)])
async def test_a_server_directed_wait_past_the_cap_ends_the_call_with_its_error(
    autojump_clock, cap, slept
):
    """Without a time budget, `Retry-After: 99999999` kept a run asleep for three years."""
    quota = attrs.evolve(RATE_LIMITED, retry_after_s=3600.0)  # an hourly quota spent
    model = ScriptedModel(turns=[say("ok")], failures={0: [quota]})
    async with _alone(model, retry_after_max_s=cap) as (inbox, fake):
        before = trio.current_time()
        outcome = await _call(inbox)
        waited = trio.current_time() - before
    if slept:
        assert outcome.reply is not None and waited >= 3600.0 and len(model.requests) == 2
    else:
        assert outcome.reply is None and outcome.stop is None and outcome.error == quota
        assert waited < 1.0 and len(model.requests) == 1
        (result,) = fake.records(ModelResult)
        assert result.error == quota  # type: ignore[attr-defined]  # the wait it asked for


async def test_a_writer_that_fails_before_the_intent_is_durable_fails_the_gateway(autojump_clock):
    """No request leaves before its intent is durable: a failed writer means no model call."""
    model = ScriptedModel(turns=[say("never")])
    with pytest.RaisesGroup(trio.EndOfChannel, flatten_subgroups=True):
        async with _alone(model, FakeWriter(fail_at=1)) as (inbox, _):
            await _call(inbox)
    assert model.requests == []


@attrs.define(eq=False)
class AttemptSpy:
    """A model client that keeps the `Attempt` of every call, answered by ``inner``."""

    inner: ScriptedModel
    attempts: list[Attempt] = attrs.Factory(list)

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        self.attempts.append(attempt)
        return await self.inner.complete(request, on_delta=on_delta, attempt=attempt)


def _images(image: ImageRef) -> bytes:
    raise KeyError(image.url)


async def test_every_attempt_gets_its_own_record_of_the_limits_budget_and_images(autojump_clock):
    # a reply of unknown usage would end the call under the token budget (decision 0114)
    ok = attrs.evolve(say("ok"), usage=Usage(input_tokens=10, output_tokens=2))
    spy = AttemptSpy(ScriptedModel(turns=[ok], failures={0: [RATE_LIMITED]}))
    options = {"model_connect_s": 3.0, "model_first_byte_s": 4.0, "model_idle_s": 5.0}
    budgets = Budgets(token_budget=100)
    async with _alone(spy, budgets=budgets, image_source=_images, **options) as (inbox, _):
        outcome = await _call(inbox, tokens=40)
    assert outcome.reply is not None
    first, second = spy.attempts
    assert first is not second  # one record per attempt, never shared with the next
    for attempt in spy.attempts:
        assert (attempt.connect_s, attempt.first_byte_s, attempt.idle_s) == (3.0, 4.0, 5.0)
        assert attempt.image_source is _images
    assert second.report_usage(Usage(input_tokens=30, output_tokens=30)) is None  # 60 left
    with pytest.raises(ModelCallError) as cut:
        second.report_usage(Usage(input_tokens=31, output_tokens=30))
    assert cut.value.info.kind == "token_budget"
