from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

import treadle
from treadle.sinks.otel import OpenTelemetrySink
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel
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
