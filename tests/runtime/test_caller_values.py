"""Values a caller hands the API that are not what it takes.

Each is refused where it is handed over, with a `treadle.UsageError` naming it, and nothing is
written: a value the log's decoder refuses, once written, made the whole log read as damaged.
"""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path

import pytest

import treadle
import treadle.approvals
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import ActionResult, CancelRequested


@treadle.tool(requires_approval=True)
async def refund(order: str) -> str:
    """Refund an order."""
    return f"refunded {order}"


def refund_agent() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("refund", order="A1"), say("done")]),
        executor=treadle.Toolbox([refund]),
        parser=treadle.NativeToolCallParser(),
    )


async def _waiting(handle: treadle.RunHandle) -> None:
    async with aclosing(handle.events()) as events:
        async for event in events:
            if event.kind is treadle.EventKind.APPROVAL_REQUESTED:
                return


@pytest.mark.parametrize("reason", [None, 123, {"a": 1}, b"bytes"])
async def test_a_cancel_reason_that_is_not_text_is_refused_and_the_log_stays_readable(
    tmp_path: Path, reason: object
):
    async with treadle.open_sqlite_store(tmp_path / "runs.db") as store:
        async with treadle.open_run(refund_agent(), "go", store=store, run_id="r") as handle:
            await _waiting(handle)
            with pytest.raises(treadle.UsageError, match="a cancel's reason must be a str"):
                handle.cancel(reason)  # type: ignore[arg-type]
            with pytest.raises(treadle.UsageError, match="a cancel's canceller must be a str"):
                handle.cancel("stop", canceller=7)  # type: ignore[arg-type]
            with pytest.raises(treadle.UsageError, match="a cancel's reason must be a str"):
                await treadle.approvals.request_cancel(store, "r", reason=reason)  # type: ignore[arg-type]
            handle.cancel("a real reason")
        result = await handle.wait()
        log = await store.read_log("r")  # raised LogCorrupted once a bad reason was written
    assert result.stop_reason is treadle.StopReason.CANCELLED
    cancels = [r for r in log.records if isinstance(r, CancelRequested)]
    assert [c.reason for c in cancels] == ["a real reason"]


@pytest.mark.parametrize("through", ["handle", "store"])
async def test_a_rejection_message_that_is_not_text_is_refused_before_anything_is_written(
    tmp_path: Path, through: str
):
    """`decide(reject=42)` wrote the decision, then said another one had been written first;
    the run applied it anyway. Through the handle, the log read as damaged afterwards."""
    async with treadle.open_sqlite_store(tmp_path / "runs.db") as store:
        async with treadle.open_run(refund_agent(), "go", store=store, run_id="r") as handle:
            await _waiting(handle)
            with pytest.raises(treadle.UsageError, match=r"a rejection's message \(reject\)"):
                if through == "handle":
                    handle.approve(reject=42)  # type: ignore[arg-type]
                else:
                    await treadle.approvals.decide(store, "r", reject=42)  # type: ignore[arg-type]
            assert await treadle.approvals.read_control(store, "r") == ()  # nothing written
            with pytest.raises(treadle.UsageError, match="call_id must be a str or None"):
                handle.approve(call_id=1)  # type: ignore[arg-type]
            handle.approve(reject="no refunds today")
        result = await handle.wait()
        log = await store.read_log("r")
    assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    assert "no refunds today" in (log.steps[0].observations[0] or "")


@pytest.mark.parametrize("given", [5, None, object(), {"role": "user"}])
async def test_a_run_input_of_another_type_is_refused_before_anything_is_written(given: object):
    """`treadle.run(agent, 5)` interrupted the run with a TypeError from inside."""
    store = treadle.MemoryStore()
    if given is None:  # None is "resume": a run that does not exist cannot be
        with pytest.raises(treadle.UsageError, match="a new run needs an input"):
            await treadle.run(refund_agent(), None, store=store, run_id="r")
    else:
        with pytest.raises(treadle.UsageError, match="a run's input is a str, a Message"):
            await treadle.run(refund_agent(), given, store=store, run_id="r")  # type: ignore[arg-type]
    assert await store.list_runs() == ()


def _agent(**changed: object) -> treadle.Agent:
    parts: dict[str, object] = {
        "model": ScriptedModel(turns=[say("ok")]),
        "executor": treadle.Toolbox([refund]),
        "parser": treadle.NativeToolCallParser(),
    }
    return treadle.Agent(**{**parts, **changed})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"model": None}, r"Agent.model must have complete\(\)"),
        ({"executor": [refund]}, r"Agent.executor must have tool_specs\(\) and execute\(\)"),
        ({"executor": None, "output_type": {"type": "object"}}, "Agent.executor must have"),
        ({"parser": None}, r"Agent.parser must have parse\(\)"),
        ({"summariser": object()}, r"Agent.summariser must have complete\(\)"),
        ({"budgets": {"max_steps": 3}}, "Agent.budgets must be a treadle.Budgets, not dict"),
        ({"limits": None}, "Agent.limits must be a treadle.Limits"),
        ({"synthetic": "text"}, "Agent.synthetic must be a treadle.SyntheticObservations"),
        ({"params": {"x": object()}}, "Agent.params must be JSON data"),
        ({"params": {"t": float("nan")}}, "Agent.params must be JSON data"),
        ({"params": [("t", 1)]}, "Agent.params must be a mapping"),
        ({"model_name": 3}, "Agent.model_name must be a str, not 3"),
        ({"system_prompt": b"be nice"}, "Agent.system_prompt must be a str or None"),
    ],
)
async def test_an_agent_part_of_the_wrong_kind_is_refused_when_it_is_built(changed, said):
    """Such an agent was built; its first run was written to the store and interrupted by an
    AttributeError at its first step, at every resume."""
    with pytest.raises(treadle.UsageError, match=said):
        _agent(**changed)
    assert (await treadle.run(_agent(), "go", store=treadle.MemoryStore())).final_answer == "ok"


_CLIENTS = {
    "openai": lambda: treadle.OpenAIChatClient(base_url="http://127.0.0.1:9/v1"),
    "anthropic": lambda: treadle.AnthropicMessagesClient(base_url="http://127.0.0.1:9"),
}


@pytest.mark.parametrize(
    ("client", "changed", "key"),
    [
        ("openai", {"params": {"stream": False}}, "stream"),
        ("openai", {"params": {"stream_options": {}, "temperature": 0}}, "stream_options"),
        ("openai", {"params": {"model": "other"}}, "model"),
        (
            "openai",
            {"params": {"response_format": {"type": "text"}}, "output_type": {"type": "object"}},
            "response_format",
        ),
        ("anthropic", {"params": {"system": "be nice"}}, "system"),
        ("anthropic", {"params": {"tools": []}}, "tools"),
    ],
)
async def test_params_the_model_client_sets_itself_are_refused_when_the_agent_is_built(
    client: str, changed: dict[str, object], key: str
):
    """`Agent(params={"stream": False})` was built; each run of it wrote run-started and a model
    call intent, then raised at the first attempt: the run stayed orphaned, and every resume
    added an attempt recorded as abandoned after a crash, though nothing was sent."""
    async with _CLIENTS[client]() as model:
        with pytest.raises(treadle.UsageError, match=f"request params may not set .*'{key}'"):
            _agent(model=model, **changed)
        allowed = {"temperature": 0.2, "response_format": {"type": "text"}}
        assert _agent(model=model, params=allowed).params == allowed  # no output type: allowed


@treadle.tool
async def message_customer(message: str) -> str:
    """Send a message to the customer."""
    return "read"


@treadle.tool
async def answer_customer(content: str) -> str:
    """Answer the customer."""
    return "read"


class _HiddenReplies:
    """An executor that runs text replies as "respond" without offering it to the model."""

    def tool_specs(self) -> tuple[treadle.ToolSpec, ...]:
        return ()

    async def execute(self, action: object) -> treadle.ActionOutcome:
        return treadle.ActionOutcome(status=treadle.ActionStatus.EXECUTED, observation="read")


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("reply", "unknown tool 'reply'"),
        ("message_customer", "required field missing @ $.message; extra fields found (content)"),
    ],
)
async def test_a_text_reply_tool_the_executor_refuses_is_refused_when_the_agent_is_built(
    name: str, said: str
):
    """Such an agent was built; every answer of the model was then a call that was not
    executed, and each run ended failed with max_steps."""
    parser = treadle.NativeToolCallParser(text_reply_tool=name)
    with pytest.raises(treadle.UsageError) as refused:
        _agent(executor=treadle.Toolbox([message_customer]), parser=parser)
    assert f"every text reply a call of {name!r}" in str(refused.value)
    assert said in str(refused.value)
    answering = treadle.NativeToolCallParser(text_reply_tool="answer_customer")
    built = _agent(
        model=ScriptedModel(turns=[say("Hello!")]),
        executor=treadle.Toolbox([message_customer, answer_customer]),
        parser=answering,
        budgets=treadle.Budgets(max_steps=1),
    )
    store = treadle.MemoryStore()
    await treadle.run(built, "hi", store=store, run_id="r")
    results = [r for r in (await store.read_log("r")).records if isinstance(r, ActionResult)]
    assert [(r.tool, r.outcome.status) for r in results] == [
        ("answer_customer", treadle.ActionStatus.EXECUTED)
    ]
    # A tool the model is not offered, of an executor that declares no argument check.
    hidden = treadle.NativeToolCallParser(text_reply_tool="respond")
    assert _agent(executor=_HiddenReplies(), parser=hidden).parser is hidden


def test_a_tool_argument_named_self_is_refused_with_a_clear_error():
    """It raised a SyntaxError from the generated arguments record."""

    async def f(self: int) -> int:
        """A tool whose argument is named self."""
        return self

    with pytest.raises(treadle.UsageError, match="an argument named 'self' is not allowed"):
        treadle.tool(f)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str fails")


class _UnprintableText(str):
    def __str__(self) -> str:
        raise RuntimeError("str fails")


@treadle.tool
async def unprintable(fail: bool) -> str:
    """Raise an exception, or return a text, that cannot be printed."""
    if fail:
        raise _Unprintable()
    return _UnprintableText("the text")


@pytest.mark.parametrize(
    ("fail", "observation"),
    [
        (True, "Error: _Unprintable: (its message could not be read: RuntimeError)"),
        (False, "the text"),
    ],
)
async def test_a_tool_whose_exception_or_text_cannot_be_printed_is_still_executed(
    fail: bool, observation: str
):
    """Such a call interrupted the run, and its resume recorded the outcome as unknown."""
    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("unprintable", fail=fail), say("done")]),
        executor=treadle.Toolbox([unprintable]),
        parser=treadle.NativeToolCallParser(),
    )
    store = treadle.MemoryStore()
    result = await treadle.run(agent, "go", store=store, run_id="r")
    assert result.final_answer == "done"
    (step, _) = (await store.read_log("r")).steps
    assert step.observations == (observation,)


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"seed": None}, "seed must be a whole number of 0 or more, not None"),
        ({"seed": "1"}, "seed must be a whole number of 0 or more"),
        ({"seed": 1.5}, "seed must be a whole number of 0 or more"),
        ({"seed": True}, "seed must be a whole number of 0 or more"),
        # It ran, while `treadle simulate --from -1` is refused.
        ({"seed": -1}, "seed must be a whole number of 0 or more, not -1"),
        ({"seed": 1, "runs": 0}, "runs must be a whole number of 1 or more"),
        ({"seed": 1, "steps": -1}, "steps must be a whole number of 1 or more"),
    ],
)
def test_a_simulation_needs_a_seed_that_reproduces_it(arguments: dict[str, object], said: str):
    """`simulate(None)` ran, unseeded: two calls gave two digests and no seed to replay."""
    from treadle.testing.simulation import simulate

    with pytest.raises(treadle.UsageError, match=said):
        simulate(**arguments)  # type: ignore[arg-type]


async def test_approving_a_finished_run_says_it_finished():
    """It said the run "is being cancelled" of a run that had finished cancelled."""
    store = treadle.MemoryStore()
    async with treadle.open_run(refund_agent(), "go", store=store, run_id="r") as handle:
        await _waiting(handle)
        handle.cancel("no")
        await handle.wait()
        with pytest.raises(treadle.UsageError, match="run 'r' finished cancelled: nothing waits"):
            handle.approve()
