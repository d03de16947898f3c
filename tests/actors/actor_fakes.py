"""Fakes that stand on the other side of one actor's channels, so that it runs alone.

`FakeWriter` serves a `WriterClient`'s inbox in place of the event writer: it numbers what it
is handed, answers barriers at once and keeps every write for the test to read. `RecordingExecutor`
is an action executor that records its calls and can block, fail or answer oddly on request.
"""

from __future__ import annotations

import attrs
import trio

from treadle.actors import (
    Append,
    Delta,
    MailboxReceiver,
    Subscribe,
    Warn,
    WriterClient,
    WriterRequest,
    open_mailbox,
)
from treadle.types import (
    Action,
    ActionOutcome,
    ActionStatus,
    Message,
    Record,
    ReplayPolicy,
    RunStarted,
    StoreOp,
    ToolSpec,
)

TS = "2026-01-01T00:00:00.000000Z"
"""The timestamp of every record the tests build."""


def started(run_id: str = "r", *, text: str = "hello", **fields: object) -> RunStarted:
    """A run-started record whose input is one user message ``text``."""
    return RunStarted(
        run_id=run_id,
        ts=TS,
        input=(Message(role="user", content=text),),
        snapshot={},
        **fields,  # type: ignore[arg-type]
    )


@attrs.define(eq=False)
class FakeWriter:
    """Stands in for the event writer behind a `WriterClient` (no store, no subscribers).

    Attributes:
        appended: every `Append` handed over, with the seq its first record got.
        deltas: every delta offered.
        warnings: the text of every live warning offered (an abandoned call's late return).
        fail_at: the `Append` (1-based) the writer fails on: it closes that request's reply
            channel unanswered and stops serving, as a writer whose store write failed.
        hold: while set and not yet set, barriers wait for it before being answered.
    """

    appended: list[tuple[int, StoreOp, tuple[Record, ...]]] = attrs.Factory(list)
    deltas: list[Delta] = attrs.Factory(list)
    warnings: list[str] = attrs.Factory(list)
    fail_at: int | None = None
    hold: trio.Event | None = None
    next_seq: int = 1

    async def run(
        self,
        inbox: MailboxReceiver[WriterRequest],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``inbox`` until it ends (or until the `fail_at` write)."""
        task_status.started()
        async with inbox:
            async for message in inbox:
                if isinstance(message, Delta):
                    self.deltas.append(message)
                elif isinstance(message, Subscribe):
                    message.reply_to.close()
                elif isinstance(message, Warn):
                    self.warnings.append(message.text)
                elif not await self._append(message):
                    return

    async def _append(self, message: Append) -> bool:
        if self.fail_at is not None and len(self.appended) + 1 >= self.fail_at:
            if message.reply_to is not None:
                message.reply_to.close()
            return False
        self.appended.append((self.next_seq, message.op, message.records))
        self.next_seq += len(message.records)
        if message.reply_to is not None:
            if self.hold is not None:
                await self.hold.wait()
            with message.reply_to:
                message.reply_to.send_nowait(self.next_seq - 1)
        return True

    def records(self, kind: type[Record] | None = None) -> list[Record]:
        """Every record written so far, in order (only those of ``kind`` when given)."""
        every = [r for _, _, records in self.appended for r in records]
        return [r for r in every if kind is None or isinstance(r, kind)]


async def start_fake_writer(
    nursery: trio.Nursery, fake: FakeWriter | None = None
) -> tuple[WriterClient, FakeWriter]:
    """Start ``fake`` (a new `FakeWriter` by default) in ``nursery``; return its client."""
    fake = fake if fake is not None else FakeWriter()
    # 64: the real writer's inbox is buffered the same (docs/design.md, "The five actors").
    send, recv = open_mailbox[WriterRequest](64)
    await nursery.start(fake.run, recv)
    return WriterClient(inbox=send), fake


@attrs.define(eq=False)
class RecordingExecutor:
    """An action executor: ``add`` adds, ``wait`` blocks until released, ``boom`` raises,
    ``odd`` answers something that is not an outcome; ``safe`` tools replay, others never."""

    calls: list[Action] = attrs.Factory(list)
    reconciled: list[Action] = attrs.Factory(list)
    release: trio.Event = attrs.Factory(trio.Event)
    reconcile_with: ActionOutcome | None = None
    safe: frozenset[str] = frozenset({"add"})

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        return tuple(ToolSpec(name=n) for n in ("add", "wait", "boom", "odd", "write"))

    def replay_policy(self, tool: str) -> ReplayPolicy:
        return ReplayPolicy.SAFE if tool in self.safe else ReplayPolicy.NEVER

    async def execute(self, action: Action) -> ActionOutcome:
        self.calls.append(action)
        await trio.lowlevel.checkpoint()
        if action.tool == "add":
            total = action.arguments["a"] + action.arguments["b"]
            return ActionOutcome(status=ActionStatus.EXECUTED, observation=str(total))
        if action.tool == "wait":
            await self.release.wait()
            return ActionOutcome(status=ActionStatus.EXECUTED, observation="released")
        if action.tool == "boom":
            raise RuntimeError("the tool blew up")
        if action.tool == "odd":
            return "not an outcome"  # type: ignore[return-value]
        return ActionOutcome(status=ActionStatus.EXECUTED, observation="written")

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        self.reconciled.append(action)
        await trio.lowlevel.checkpoint()
        return self.reconcile_with
