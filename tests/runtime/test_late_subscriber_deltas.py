"""A subscriber that joins during a model call gets the rest of that call's deltas
(docs/events.md, "Reading events"): the writer decides per delta whether anyone listens,
not once per attempt. Fragments coalesced just before it joined may come with them."""

from __future__ import annotations

import trio

import treadle
from treadle.types import Attempt, EventKind, ModelReply


class TwoHalves:
    """Streams "early " before anyone listens, waits for ``listening``, then "late"."""

    def __init__(self) -> None:
        self.streaming = trio.Event()
        self.listening = trio.Event()

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE) -> ModelReply:
        if on_delta is not None:
            on_delta("text", "early ")
        self.streaming.set()
        await self.listening.wait()
        if on_delta is not None:
            on_delta("text", "late")
        return ModelReply(text="early late", finish_reason="stop")


async def test_a_subscriber_joining_mid_call_gets_the_rest_of_its_deltas():
    model = TwoHalves()
    agent = treadle.Agent(
        model=model, executor=treadle.Toolbox([]), parser=treadle.NativeToolCallParser()
    )
    deltas: list[str] = []
    with trio.fail_after(30):
        async with treadle.open_run(agent, "hi", store=treadle.MemoryStore()) as handle:
            await model.streaming.wait()
            async for event in handle.events():
                model.listening.set()  # the subscription is live once it yields
                if event.kind is EventKind.TEXT_DELTA:
                    deltas.append(event.text)
    assert "".join(deltas) in ("late", "early late")  # "early " only if still coalescing
    assert deltas and deltas[-1].endswith("late")
    assert handle.result is not None and handle.result.final_answer == "early late"
