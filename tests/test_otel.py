from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

import treadle
from treadle._exceptions import LeaseLost
from treadle.sinks.otel import OpenTelemetrySink
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_fleet, open_run
from treadle.testing import InterceptingStore
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import ModelReply, RunState, ToolCall, Usage


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@treadle.tool(requires_approval=True)
async def wire(amount: int) -> str:
    """Move money."""
    return "moved"


def exporter_and_tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider.get_tracer("test")


USAGE = Usage(input_tokens=10, output_tokens=2)


def reply(*calls, text=None, usage=USAGE):
    return ModelReply(
        text=text,
        tool_calls=calls,
        finish_reason="tool_calls" if calls else "stop",
        usage=usage,
        response_id="resp-1",
    )


async def run_with_sink(turns, sink, *, decide=None):
    agent = treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox([add, wire]),
        parser=treadle.NativeToolCallParser(),
        model_name="small-model",
    )
    async with open_run(agent, "x", store=MemoryStore(), run_id="r", sinks=[sink]) as handle:
        if decide is not None:
            await decide(handle)
        result = await handle.wait()
    return result


async def test_spans_follow_the_genai_conventions(autojump_clock):
    exporter, tracer = exporter_and_tracer()
    sink = OpenTelemetrySink(tracer=tracer, agent_name="calc", provider="openai")
    turns = [
        reply(ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2})),
        reply(text="3", usage=Usage(input_tokens=20, output_tokens=1)),
    ]
    await run_with_sink(turns, sink)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    finished = exporter.get_finished_spans()
    assert sorted(s.name for s in finished) == sorted(
        [
            "invoke_agent calc",
            "step 1",
            "step 2",
            "chat small-model",
            "chat small-model",
            "execute_tool add",
        ]
    )
    run = spans["invoke_agent calc"]
    assert run.parent is None
    assert run.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert run.attributes["gen_ai.conversation.id"] == "r"
    assert run.attributes["gen_ai.usage.input_tokens"] == 30
    assert run.attributes["gen_ai.usage.output_tokens"] == 3
    assert run.attributes["treadle.run.stop_reason"] == "final_answer"
    steps = [s for s in finished if s.name.startswith("step")]
    assert all(s.parent.span_id == run.context.span_id for s in steps)
    step1 = next(s for s in steps if s.name == "step 1")
    chats = [s for s in finished if s.name.startswith("chat")]
    first = next(s for s in chats if s.parent.span_id == step1.context.span_id)
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.provider.name"] == "openai"
    assert first.attributes["gen_ai.request.model"] == "small-model"
    assert first.attributes["gen_ai.usage.input_tokens"] == 10
    assert first.attributes["gen_ai.usage.output_tokens"] == 2
    assert first.attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert first.attributes["gen_ai.response.id"] == "resp-1"
    tool = spans["execute_tool add"]
    assert tool.parent.span_id == step1.context.span_id
    assert tool.attributes["gen_ai.tool.name"] == "add"
    assert tool.attributes["gen_ai.tool.call.id"] == "c1"
    assert tool.attributes["gen_ai.tool.type"] == "function"
    assert tool.status.status_code is not StatusCode.ERROR
    assert first.start_time <= first.end_time <= tool.start_time <= tool.end_time


async def test_unknown_usage_is_not_exported_as_zero_and_rejections_are_errors(autojump_clock):
    exporter, tracer = exporter_and_tracer()
    sink = OpenTelemetrySink(tracer=tracer)
    turns = [
        reply(ToolCall(id="w1", name="wire", arguments={"amount": 5}), usage=Usage()),
        reply(text="ok", usage=Usage()),
    ]

    async def reject(handle):

        await handle.wait_state(RunState.AWAITING_APPROVAL)
        handle.approve(reject="no")

    await run_with_sink(turns, sink, decide=reject)
    finished = exporter.get_finished_spans()
    chats = [s for s in finished if s.name.startswith("chat")]
    assert chats and all("gen_ai.usage.input_tokens" not in s.attributes for s in chats)
    (tool,) = [s for s in finished if s.name == "execute_tool wire"]
    assert tool.status.status_code is StatusCode.ERROR
    assert tool.attributes["error.type"] == "not_executed"
    step1 = next(s for s in finished if s.name == "step 1")
    assert [e.name for e in step1.events] == [
        "treadle.approval_requested",
        "treadle.approval_decided",
    ]


async def test_a_sink_of_a_resumed_run_names_the_model_it_was_given(autojump_clock):
    """A resumed run never sends its run-started record again: its chat spans were named
    "chat" with an empty gen_ai.request.model."""
    store = MemoryStore()
    agent = treadle.Agent(
        model=ScriptedModel(
            turns=[reply(ToolCall(id="w1", name="wire", arguments={"amount": 5})), reply(text="ok")]
        ),
        executor=treadle.Toolbox([add, wire]),
        parser=treadle.NativeToolCallParser(),
        model_name="small-model",
    )
    with pytest.raises(KeyError):  # an error in the block leaves the run unfinished
        async with open_run(agent, "x", store=store, run_id="r") as first:
            await first.wait_state(RunState.AWAITING_APPROVAL)
            raise KeyError("the process stops here")
    exporter, tracer = exporter_and_tracer()
    sink = OpenTelemetrySink(tracer=tracer, model="small-model")
    async with open_run(agent, "x", store=store, run_id="r", sinks=[sink]) as again:
        await again.wait_state(RunState.AWAITING_APPROVAL)
        again.approve()
        result = await again.wait()
    assert result.state is RunState.SUCCEEDED
    chats = [s for s in exporter.get_finished_spans() if s.name.startswith("chat")]
    assert [s.name for s in chats] == ["chat small-model"]
    assert chats[0].attributes["gen_ai.request.model"] == "small-model"


class Traced:
    """An in-memory exporter, and every span started (to find those never ended)."""

    def __init__(self):
        self.exporter = InMemorySpanExporter()
        self.started = []
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        started = self.started

        class Starts(SimpleSpanProcessor):
            def on_start(self, span, parent_context=None):
                started.append(span)

        provider.add_span_processor(Starts(InMemorySpanExporter()))
        self.tracer = provider.get_tracer("test")

    def finished(self):
        return self.exporter.get_finished_spans()

    def never_ended(self):
        return [s.name for s in self.started if s.end_time is None]

    def root(self, span):
        """The span at the top of ``span``'s parents (``None`` when a parent is missing)."""
        by_id = {s.context.span_id: s for s in self.finished()}
        while span is not None and span.parent is not None:
            span = by_id.get(span.parent.span_id)
        return span

    def named(self, prefix):
        return [s for s in self.finished() if s.name.startswith(prefix)]


async def test_one_sink_serves_the_concurrent_runs_of_a_fleet(autojump_clock):
    """A fleet gives its sinks to every run it drives. The sink kept one run span and steps by
    number: three runs at once made five run spans (two never ended) and hung one run's steps
    and tool calls under another's."""
    traced = Traced()
    sink = OpenTelemetrySink(tracer=traced.tracer, agent_name="calc")
    arrived, everyone = [0], trio.Event()

    @treadle.tool
    async def meet(n: int) -> int:
        """Wait until the three runs are all in their tool call."""
        arrived[0] += 1
        if arrived[0] == 3:
            everyone.set()
        await everyone.wait()
        return n

    def agent(i):
        return treadle.Agent(
            model=ScriptedModel(turns=[call("meet", n=i, call_id=f"r{i}-c1"), say("ok")]),
            executor=treadle.Toolbox([meet]),
            parser=treadle.NativeToolCallParser(),
            model_name="small-model",
        )

    agents = {f"a{i}": functools.partial(agent, i) for i in range(3)}
    with trio.fail_after(60):
        async with open_fleet(MemoryStore(), agents, sinks=[sink], max_running=3) as fleet:
            ids = {f"r{i}": await fleet.submit(f"a{i}", "x") for i in range(3)}
            for run_id in ids.values():
                assert (await fleet.result(run_id)).state is RunState.SUCCEEDED
    assert traced.never_ended() == []
    runs = traced.named("invoke_agent")
    assert sorted(r.attributes["gen_ai.conversation.id"] for r in runs) == sorted(ids.values())
    assert all(r.attributes["treadle.run.state"] == "succeeded" for r in runs)
    for span in traced.named("step") + traced.named("chat"):
        assert traced.root(span) in runs, span.name
    for run in runs:
        steps = [s for s in traced.named("step") if s.parent.span_id == run.context.span_id]
        assert sorted(s.name for s in steps) == ["step 1", "step 2"]
    for tool in traced.named("execute_tool"):
        prefix = tool.attributes["gen_ai.tool.call.id"].split("-")[0]
        assert traced.root(tool).attributes["gen_ai.conversation.id"] == ids[prefix]


def gated_agent():
    """An agent whose one tool call waits for ``gate`` (``entered`` is set once it waits)."""
    entered, gate = trio.Event(), trio.Event()

    @treadle.tool
    async def hold(n: int) -> int:
        """Wait for the gate."""
        entered.set()
        await gate.wait()
        return n

    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("hold", n=1, call_id="c1"), reply(text="done")]),
        executor=treadle.Toolbox([hold]),
        parser=treadle.NativeToolCallParser(),
        model_name="small-model",
    )
    return agent, entered, gate


async def test_a_drive_drained_in_a_tool_call_ends_its_spans(autojump_clock):
    """A drained drive writes no run_finished record: its run span never ended (so it was
    never exported) and its exported step span named a parent that did not exist. The drive
    that resumes the run draws its own run span."""
    traced = Traced()
    sink = OpenTelemetrySink(tracer=traced.tracer, model="small-model")
    agent, entered, gate = gated_agent()
    store = MemoryStore()
    with trio.fail_after(60):
        async with open_run(agent, "x", store=store, run_id="r", sinks=[sink]) as handle:
            await entered.wait()
            handle.drain()
            gate.set()
            with pytest.raises(treadle.RunInterrupted):
                await handle.wait()
    assert traced.never_ended() == []
    (run,) = traced.named("invoke_agent")
    assert run.attributes["treadle.run.left"] == "drained"
    assert "treadle.run.state" not in run.attributes
    (step,) = traced.named("step")
    assert step.parent.span_id == run.context.span_id
    assert {traced.root(s) for s in traced.finished()} == {run}
    traced.exporter.clear()
    with trio.fail_after(60):
        async with open_run(agent, "x", store=store, run_id="r", sinks=[sink]) as again:
            assert (await again.wait()).state is RunState.SUCCEEDED
    assert traced.never_ended() == []
    (resumed,) = traced.named("invoke_agent")
    assert resumed.attributes["treadle.run.state"] == "succeeded"
    assert "treadle.run.left" not in resumed.attributes
    assert resumed.context.trace_id != run.context.trace_id
    assert [s.name for s in traced.named("step")] == ["step 2"]
    assert {traced.root(s) for s in traced.finished()} == {resumed}


async def test_a_run_parked_on_an_approval_then_drained_ends_its_spans(autojump_clock):
    """Step 1 waits on a human when the drive stops: it and the run span never ended, and the
    exported chat span hung under a step that was never exported."""
    traced = Traced()
    sink = OpenTelemetrySink(tracer=traced.tracer)
    turns = [reply(ToolCall(id="w1", name="wire", arguments={"amount": 5})), reply(text="ok")]
    agent = treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox([add, wire]),
        parser=treadle.NativeToolCallParser(),
    )
    with trio.fail_after(60):
        async with open_run(
            agent, "x", store=MemoryStore(), run_id="r", sinks=[sink], park_after_s=1
        ) as handle:
            assert await handle.wait_parked()
            handle.drain()
            with pytest.raises(treadle.RunInterrupted):
                await handle.wait()
    assert traced.never_ended() == []
    (run,) = traced.named("invoke_agent")
    (step,) = traced.named("step")
    assert run.attributes["treadle.run.left"] == step.attributes["treadle.run.left"] == "parked"
    assert [e.name for e in step.events] == ["treadle.approval_requested"]
    assert {traced.root(s) for s in traced.finished()} == {run}


class FrozenRenewals(InterceptingStore):
    """Renewals reach no store once frozen, but report the leases as renewed (a hung host)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.frozen = False

    async def renew_leases(self, leases, *, ttl_s):
        if self.frozen:
            await trio.lowlevel.checkpoint()
            return tuple(leases)
        return await super().renew_leases(leases, ttl_s=ttl_s)


async def test_a_drive_that_lost_its_lease_ends_its_spans(autojump_clock):
    """The lease lapses during a tool call and another driver takes the run: the drive stops
    with LeaseLost, and its run span (and the tool's) were never ended."""
    traced = Traced()
    sink = OpenTelemetrySink(tracer=traced.tracer)
    agent, entered, gate = gated_agent()
    raw = MemoryStore(clock=lambda: 1e9 + trio.current_time())
    store = FrozenRenewals(raw)
    with trio.fail_after(60):
        async with open_run(
            agent, "x", store=store, run_id="r", sinks=[sink], owner="a", lease_ttl_s=3
        ) as handle:
            await entered.wait()
            store.frozen = True
            await trio.sleep(5)  # the lease lapses unrenewed
            await raw.acquire_lease("r", owner="b", ttl_s=3600)
            gate.set()  # the tool's result is the stale driver's next write: refused
            with pytest.raises(LeaseLost):
                await handle.wait()
    assert traced.never_ended() == []
    (run,) = traced.named("invoke_agent")
    (tool,) = traced.named("execute_tool")
    assert run.attributes["treadle.run.left"] == tool.attributes["treadle.run.left"]
    assert run.attributes["treadle.run.left"] == "interrupted"
    assert {traced.root(s) for s in traced.finished()} == {run}


async def test_a_drive_cut_from_outside_ends_its_spans(autojump_clock):
    """A drive cut by a cancellation from outside (a cancel scope around open_run, an error in
    its block) cut its sinks off without a run_left event: the sink kept the run's open spans
    for good, and the run span was never ended nor exported. The sink is now told it was cut
    off, and ends them with ``treadle.run.left`` = ``cut_off``."""
    traced = Traced()
    sink = OpenTelemetrySink(tracer=traced.tracer, model="small-model")
    agent, entered, _ = gated_agent()
    with trio.fail_after(60):
        with trio.CancelScope() as cut:
            async with open_run(agent, "x", store=MemoryStore(), run_id="r", sinks=[sink]):
                await entered.wait()
                await trio.testing.wait_all_tasks_blocked()  # the sink took what it was given
                cut.cancel()
    assert traced.never_ended() == []
    (run,) = traced.named("invoke_agent")
    (tool,) = traced.named("execute_tool")
    assert run.attributes["treadle.run.left"] == tool.attributes["treadle.run.left"] == "cut_off"
    assert run.status.status_code is StatusCode.UNSET
    assert "treadle.run.state" not in run.attributes
    assert {traced.root(s) for s in traced.finished()} == {run}


async def test_a_sink_that_fell_behind_still_ends_the_run_span(autojump_clock):
    """A sink whose first send was slow (an exporter's first connection) dropped the run's
    last events from its full buffer, run_finished among them, and got no run_left (the run
    finished): its run span was never ended nor exported, and the sink kept the run's spans
    for good. It now gets the run's end after its buffer, and ends every span it opened."""
    traced = Traced()
    gate = trio.Event()

    class SlowFirst(OpenTelemetrySink):
        async def send(self, event):
            await gate.wait()
            await super().send(event)

    sink = SlowFirst(tracer=traced.tracer, agent_name="calc")
    turns = [call("add", a=1, b=i, call_id=f"c{i}") for i in range(150)] + [say("ok")]
    agent = treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox([add]),
        parser=treadle.NativeToolCallParser(),
        budgets=treadle.Budgets(max_steps=200, max_model_attempts=200),
    )
    with trio.fail_after(60):
        async with open_run(agent, "x", store=MemoryStore(), run_id="r", sinks=[sink]) as handle:
            assert (await handle.wait()).state is RunState.SUCCEEDED
            assert handle.statistics().sink_drops > 0  # its buffer overflowed
            gate.set()  # it keeps up from now on, well within the grace
    assert traced.never_ended() == []
    (run,) = traced.named("invoke_agent")
    assert run.attributes["treadle.run.state"] == "succeeded"
    assert {traced.root(s) for s in traced.finished()} == {run}
