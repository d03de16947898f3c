"""How tool images are placed in requests, where they come from, and what history holds of them.

The request bodies are built without a server (`request_body`); whole runs over a loopback
server are in tests/runtime/test_tool_images.py.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

import treadle
from treadle._budget import Group, Meter, with_markers
from treadle.actors import step_messages
from treadle.models import AnthropicMessagesClient, OpenAIChatClient
from treadle.models._transport import digest
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionOutcome,
    ActionStatus,
    DecisionKind,
    ImageRef,
    Message,
    ModelRequest,
    StepRecord,
    ToolCall,
)

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
A = ImageRef(url="ref:a", digest=digest(PNG), media_type="image/png")
B = ImageRef(url="https://example.org/b.png")


def _source(image: ImageRef) -> bytes:
    """The test's image store: only ``ref:a``; `KeyError` for any other."""
    return {"ref:a": PNG}[image.url]


CALLS = (ToolCall(id="c1", name="shot"), ToolCall(id="c2", name="look"))


def _history(*after: Message) -> tuple[Message, ...]:
    return (
        Message(role="user", content="go"),
        Message(role="assistant", tool_calls=CALLS),
        Message(role="tool", content="one", images=(A,), tool_call_id="c1", name="shot"),
        Message(role="tool", content="two", images=(A, B), tool_call_id="c2", name="look"),
        *after,
    )


def test_chat_completions_sends_a_runs_images_in_one_user_message_after_its_tool_messages():
    client = OpenAIChatClient(base_url="http://127.0.0.1:1/v1", image_source=_source)
    for after in ((), (Message(role="assistant", content="seen"),)):
        body = client.request_body(ModelRequest(messages=_history(*after)))
        messages = body["messages"]
        assert [m["role"] for m in messages] == [
            "user",
            "assistant",
            "tool",
            "tool",
            "user",
            *(m.role for m in after),
        ]
        assert messages[2] == {"role": "tool", "content": "one", "tool_call_id": "c1"}
        assert messages[4]["content"] == [
            {"type": "text", "text": "[1 image returned by the call c1 (shot):]"},
            {"type": "image_url", "image_url": {"url": DATA_URL}},
            {"type": "text", "text": "[2 images returned by the call c2 (look):]"},
            {"type": "image_url", "image_url": {"url": DATA_URL}},
            {"type": "image_url", "image_url": {"url": B.url}},
        ]


def test_anthropic_puts_the_images_inside_each_tool_result():
    client = AnthropicMessagesClient(api_key="k", image_source=_source)
    history = (*_history()[:2], Message(role="tool", images=(A,), tool_call_id="c1"))
    body = client.request_body(ModelRequest(messages=history))
    [result] = body["messages"][-1]["content"]
    source = {"type": "base64", "media_type": "image/png", "data": DATA_URL.split(",")[1]}
    assert result == {  # no text block for a result without text
        "type": "tool_result",
        "tool_use_id": "c1",
        "content": [{"type": "image", "source": source}],
    }
    body = client.request_body(ModelRequest(messages=_history()))
    second = body["messages"][-1]["content"][1]["content"]
    assert second[0] == {"type": "text", "text": "two"}
    assert second[2] == {"type": "image", "source": {"type": "url", "url": B.url}}


@pytest.mark.parametrize("make", [OpenAIChatClient, AnthropicMessagesClient])
def test_the_runs_image_source_answers_what_the_clients_own_does_not_hold(make: Any):
    client = make(base_url="http://127.0.0.1:1", api_key="k", image_source={}.__getitem__)
    request = ModelRequest(messages=_history()[:3])
    with pytest.raises(treadle.UsageError, match="could not be loaded"):
        client.request_body(request)
    assert DATA_URL.split(",")[1] in str(client.request_body(request, run_images=_source))
    bare = make(base_url="http://127.0.0.1:1", api_key="k")
    with pytest.raises(treadle.UsageError, match="needs an image_source"):
        bare.request_body(request)
    with pytest.raises(treadle.UsageError, match="digest"):
        bare.request_body(request, run_images=lambda _: b"other")


@pytest.mark.parametrize("make", [OpenAIChatClient, AnthropicMessagesClient])
def test_images_on_an_assistant_message_are_refused(make: Any):
    client = make(base_url="http://127.0.0.1:1", api_key="k")
    request = ModelRequest(messages=(Message(role="assistant", content="x", images=(B,)),))
    with pytest.raises(treadle.UsageError, match="only allowed on user and tool"):
        client.request_body(request)


def _step(observations: tuple[str, ...], images: Any, calls: tuple[ToolCall, ...]) -> StepRecord:
    return StepRecord(
        run_id="r",
        step=1,
        ts="2026-12-01T00:00:00Z",
        model_intent_id="r/s1/m1",
        decision=DecisionKind.ACTIONS,
        history_message=Message(role="assistant", content="t", tool_calls=calls),
        observations=observations,
        observation_images=images,
    )


def test_history_gives_each_observation_its_images():
    messages = step_messages(_step(("one", "two"), ((A,), ()), CALLS))
    assert [(m.role, m.content, m.images) for m in messages[1:]] == [
        ("tool", "one", (A,)),
        ("tool", "two", ()),
    ]
    plain = step_messages(_step(("one", "two"), (), CALLS))  # an older log: no images
    assert [m.images for m in plain[1:]] == [(), ()]
    text_action = step_messages(_step(("seen",), ((B,),), ()))
    assert [(m.role, m.images) for m in text_action[1:]] == [("user", (B,))]


def test_an_elided_observation_leaves_its_images_out_too():
    big = Message(role="tool", content="x" * 1000, images=(A,), tool_call_id="c1", name="shot")
    small = Message(role="tool", content="ok", images=(B,), tool_call_id="c2", name="look")
    marked, count = with_markers(Group(step=1, messages=(big, small)), Meter())
    assert count == 1
    assert marked.messages[0].images == () and marked.messages[0].content.startswith("[elided")
    assert marked.messages[1] == small


class _Shots:
    """An executor whose outcomes carry images (or, when ``bad``, bytes where images go)."""

    def __init__(self, status: ActionStatus, images: Any) -> None:
        self._tools = treadle.Toolbox([])
        self.status, self.images = status, images

    def tool_specs(self) -> Any:
        return (treadle.types.ToolSpec(name="shot"),)

    def replay_policy(self, tool: str) -> Any:
        return treadle.ReplayPolicy.NEVER

    async def execute(self, action: Any) -> ActionOutcome:
        return ActionOutcome(status=self.status, observation="seen", images=self.images)

    async def reconcile(self, action: Any) -> ActionOutcome | None:
        return None


def _agent(executor: Any, model: ScriptedModel) -> treadle.Agent:
    return treadle.Agent(
        model=model, executor=executor, parser=treadle.NativeToolCallParser(), model_name="m"
    )


async def test_only_an_executed_outcome_shows_its_images():
    for status, shown in ((ActionStatus.EXECUTED, (A,)), (ActionStatus.NOT_EXECUTED, ())):
        model = ScriptedModel(turns=[call("shot", call_id="c1"), say("done")])
        store = treadle.MemoryStore()
        await treadle.run(_agent(_Shots(status, (A,)), model), "go", store=store, run_id="r")
        [tool_message] = [m for m in model.requests[1].messages if m.role == "tool"]
        assert tool_message.images == shown
        log = await store.read_log("r")
        assert log.steps[0].observation_images == (((A,),) if shown else ())


async def test_bytes_where_image_references_go_interrupt_the_run():
    model = ScriptedModel(turns=[call("shot", call_id="c1"), say("done")])
    store = treadle.MemoryStore()
    with pytest.raises(treadle.RunInterrupted) as info:
        await treadle.run(
            _agent(_Shots(ActionStatus.EXECUTED, (PNG,)), model), "go", store=store, run_id="r"
        )
    assert isinstance(info.value.__cause__, treadle.SeamViolation)
    log = await store.read_log("r")
    assert log.finished is None and log.steps == ()
