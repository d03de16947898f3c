"""The one-shot reply slot of actor requests behaves as the one-slot channel it replaces."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from treadle.actors import ReplySlot, reply, request


async def test_a_reply_sent_before_the_wait_is_returned_without_blocking() -> None:
    slot = ReplySlot[int]()
    with slot:
        slot.send_nowait(7)
    with pytest.raises(trio.ClosedResourceError):
        slot.send_nowait(8)
    with trio.testing.assert_no_checkpoints():
        assert await slot.receive() == 7


async def test_a_waiting_requester_gets_the_reply_or_end_of_channel() -> None:
    answered, refused = ReplySlot[str](), ReplySlot[str]()
    got: list[object] = []

    async def wait(slot: ReplySlot[str]) -> None:
        try:
            got.append(await slot.receive())
        except trio.EndOfChannel:
            got.append("end")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, answered)
        nursery.start_soon(wait, refused)
        await trio.testing.wait_all_tasks_blocked()
        reply(answered, "ok")
        refused.close()  # the replier failed without answering
    assert sorted(map(str, got)) == ["end", "ok"]


async def test_a_second_value_would_block() -> None:
    slot = ReplySlot[int]()
    slot.send_nowait(1)
    with pytest.raises(trio.WouldBlock):
        slot.send_nowait(2)
    assert await slot.receive() == 1


async def test_a_cancelled_requester_refuses_the_late_reply_and_reply_ignores_it() -> None:
    slot = ReplySlot[int]()
    with trio.move_on_after(0) as scope:  # cancelled as soon as it blocks
        await slot.receive()
    assert scope.cancelled_caught
    with pytest.raises(trio.BrokenResourceError):
        slot.send_nowait(1)
    late = ReplySlot[int]()
    late.abandon()
    reply(late, 3)  # a requester that went away is ignored, never raised at the replier
    with pytest.raises(trio.ClosedResourceError):
        late.send_nowait(4)


async def test_request_round_trip_and_a_replier_that_fails() -> None:
    send, recv = trio.open_memory_channel[ReplySlot[int]](1)

    async def replier() -> None:
        async with recv:
            first = await recv.receive()
            reply(first, 41)
            second = await recv.receive()
            second.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(replier)
        assert await request(send, lambda slot: slot) == 41
        with pytest.raises(trio.EndOfChannel):
            await request(send, lambda slot: slot)
