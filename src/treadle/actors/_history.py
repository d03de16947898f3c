"""The history a log holds, and the chain of runs a run inherits it from (docs/threads.md).

What each step record says entered a run's history (`step_messages`), every tool call
answered (`answer_every_call`), and the history a run inherits from the runs its run-started
``continues``: `read_chain` reads their logs, each once, and checks that they hold what the
run takes from them; `inherited_context` turns a `Chain` into messages (and the newest summary
the chain wrote, docs/context.md, "Threads"). `recorded_history` does both, for a run's whole
history. The context hydrator and the check made before a new thread run or fork starts
share one reading (docs/decisions/0080-check-the-chain-before-a-new-run.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

from treadle._budget import Summary, inherited_groups
from treadle._exceptions import StoreError, UsageError
from treadle.ports import RunStore
from treadle.redaction import Redaction
from treadle.types import (
    DecisionKind,
    Message,
    ModelResult,
    RunLog,
    RunStarted,
    StepRecord,
    SyntheticObservations,
    ToolCall,
)

_SYNTHETIC = SyntheticObservations()


def step_messages(step: StepRecord) -> list[Message]:
    """The history messages one step contributes, as stored in its step record.

    An action answering a native tool call becomes a ``tool`` message; an action without a
    call id (a text reply treated as an action) becomes a ``user`` message. Either carries
    the images the action returned (``observation_images``; docs/models.md, "Images returned
    by tools"). An invalid decision
    answers every call of the sanitised assistant message with the feedback, or else becomes a
    ``user`` message, and a final answer given by calling the final-answer tool is answered by
    `FINAL_ANSWER_ACCEPTED`, so every tool-call id is always answered.
    """
    if step.decision is None or step.history_message is None:
        return []
    calls = step.history_message.tool_calls
    # An assistant turn with neither text nor calls is refused by providers: leave it out
    # and let the feedback speak for it.
    empty = not step.history_message.content and not calls
    messages = [] if empty else [step.history_message]
    if step.decision is DecisionKind.ACTIONS:
        images = step.observation_images or ((),) * len(step.observations)
        if calls:
            for call, observation, shown in zip(calls, step.observations, images, strict=False):
                messages.append(
                    Message(
                        role="tool",
                        content=observation,
                        images=shown,
                        tool_call_id=call.id,
                        name=call.name,
                    )
                )
        else:
            messages.extend(
                Message(role="user", content=o, images=shown)
                for o, shown in zip(step.observations, images, strict=False)
            )
    elif step.decision is DecisionKind.INVALID:
        feedback = step.feedback or ""
        if calls:
            messages.extend(
                Message(role="tool", content=feedback, tool_call_id=c.id, name=c.name)
                for c in calls
            )
        else:
            messages.append(Message(role="user", content=feedback))
    elif step.decision is DecisionKind.FINAL_ANSWER:
        messages.extend(
            Message(role="tool", content=FINAL_ANSWER_ACCEPTED, tool_call_id=c.id, name=c.name)
            for c in calls
        )
    return messages


FINAL_ANSWER_ACCEPTED: Final = "Accepted: this is the run's final answer."
"""What answers the final-answer tool call of a run's last step in the history a thread's
next run inherits (docs/structured-output.md, "Native or a final-answer tool"): the call never
reaches the executor, and without an answer it would read as a call whose outcome is unknown."""


def answer_every_call(
    messages: Sequence[Message], synthetic: SyntheticObservations
) -> list[Message]:
    """``messages`` with every tool call of an assistant message answered by a tool message.

    A call that no ``tool`` message answers before the next message of another role (or the
    end) gets one there, whose text is ``synthetic.unknown`` for its tool: the history never
    claims an outcome the log does not hold. ``messages`` that answer every call are returned
    unchanged (as a new list).
    """
    out: list[Message] = []
    waiting: list[ToolCall] = []
    answered: set[str] = set()

    def close() -> None:
        for call in waiting:
            if call.id not in answered:
                text = synthetic.unknown.format(tool=call.name, detail="")
                out.append(Message(role="tool", content=text, tool_call_id=call.id, name=call.name))
        waiting.clear()
        answered.clear()

    for message in messages:
        if message.role == "tool" and message.tool_call_id is not None:
            answered.add(message.tool_call_id)
            out.append(message)
            continue
        close()
        out.append(message)
        if message.role == "assistant":
            waiting.extend(message.tool_calls)
    close()
    return out


@attrs.frozen(kw_only=True)
class InheritedRun:
    """What one run of a chain gives the run after it, as its log holds it.

    Attributes:
        run_id: the run.
        input: its run input, as stored in its run-started record.
        steps: its step records that its successor inherits, in step order: all of them, or
            for the run a fork forks, those before the fork's step.
        summary: the newest summary it wrote of what it held (written before the fork's
            step, for the run a fork forks), its ``through`` numbered as that run numbers
            its steps (up to 0 for what it inherited); ``None`` when it wrote none.
    """

    run_id: str
    input: tuple[Message, ...]
    steps: tuple[StepRecord, ...]
    summary: Summary | None

    @classmethod
    def of(cls, log: RunLog, before_step: int | None, *, redact: bool = False) -> InheritedRun:
        """What ``log`` gives its successor (only steps before ``before_step``, if given).

        With ``redact``, the step records as they may leave the log: the values of secret
        arguments read ``[redacted]``, as the run's own snapshots declare them
        (`treadle.redaction.Redaction.of_log`; docs/events.md, "Secret arguments").
        """
        assert log.started is not None
        steps = log.steps
        if before_step is not None:
            steps = tuple(step for step in steps if step.step < before_step)
        if redact:
            steps = _redacted(steps, Redaction.of_log(log))
        return cls(
            run_id=log.run_id,
            input=log.started.input,
            steps=steps,
            summary=_latest_summary(log, before_step),
        )


@attrs.frozen(kw_only=True)
class Chain:
    """The runs whose recorded history a run holds or inherits, read by `read_chain`.

    One reading of the store, shared by whoever needs it: the check made before a new thread
    run or fork is written and that run's context hydrator (docs/threads.md, "How history is
    inherited").

    Attributes:
        continues: the run the chain ends with (the run a successor continues).
        before_step: for a fork, the step of ``continues`` tried again (its steps from it
            on are not part of the chain); ``None``: all of its steps.
        runs: the runs, oldest first (a run that continues nothing), ``continues`` last.
    """

    continues: str
    before_step: int | None
    runs: tuple[InheritedRun, ...]

    def inherited_by(self, started: RunStarted) -> bool:
        """Whether this is the chain the run of ``started`` inherits (what it continues)."""
        return started.continues == self.continues and started.fork_step == self.before_step


_NONE_READ: Final[Sequence[RunLog]] = ()


async def read_chain(
    store: RunStore,
    run_id: str,
    *,
    before_step: int | None = None,
    successor: str | None = None,
    read: Sequence[RunLog] = _NONE_READ,
    redact: bool = False,
) -> Chain:
    """Read run ``run_id``'s log and those of the runs it continues, each once.

    The one place a run's history is loaded from a store (docs/threads.md, "How history is
    inherited"): from ``run_id`` back to a run that continues nothing, each log is read and
    checked to hold what the run after it takes from it. A thread's run needs its
    predecessor finished; a fork's run needs the steps before the step it tries again.

    Args:
        store: the store holding the runs.
        run_id: the run the chain ends with.
        before_step: keep only the steps before this one (a fork's prefix); ``None``: all.
        successor: the run that continues ``run_id``, named in errors; ``None`` when the
            history is asked for by itself (``run_id`` may then be unfinished).
        read: logs the caller read already (finding the run it continues), taken instead
            of reading them again; checked as the others are.
        redact: give each run's steps as they may leave the log, secret argument values
            redacted by that run's own snapshots (`InheritedRun.of`): for a reader outside
            the run (`treadle.history`); a run's hydrator takes them as logged.

    Returns:
        The chain; cost: one `RunStore.read_log` per run of it not in ``read``.

    Raises:
        UsageError: ``successor`` is ``None`` and ``run_id`` does not exist.
        StoreError: a run of the chain is missing or unreadable, a thread's predecessor is
            not finished, a fork's run has fewer steps than the fork needs, or the chain
            runs in a circle. Each message names which run continues which, and why.
    """
    known = {log.run_id: log for log in read}
    runs: list[InheritedRun] = []
    seen: set[str] = set()
    current: str | None = run_id
    upto = before_step
    while current is not None:
        if current in seen:
            raise StoreError(f"run {run_id!r}: its history continues itself ({current!r})")
        seen.add(current)
        log = await _read_link(store, current, upto, successor, known.get(current))
        runs.append(InheritedRun.of(log, upto, redact=redact))
        started = log.started
        assert started is not None  # _read_link refused it otherwise
        successor, current, upto = current, started.continues, started.fork_step
    runs.reverse()
    return Chain(continues=run_id, before_step=before_step, runs=tuple(runs))


async def recorded_history(
    store: RunStore,
    run_id: str,
    *,
    before_step: int | None = None,
    synthetic: SyntheticObservations = _SYNTHETIC,
    successor: str | None = None,
    redact: bool = False,
) -> list[Message]:
    """The history run ``run_id`` holds, read from its log and those of the runs it continues.

    For each run of the chain (`read_chain`, each log read once), oldest first: its input,
    then what each step record says entered history (`step_messages`), every tool call
    answered (`answer_every_call`). Nothing is recomputed. The system prompt is not part of
    it (it belongs to the agent definition).

    Args:
        store: the store holding the runs.
        run_id: the run.
        before_step: keep only the steps before this one (a fork's prefix); ``None``: all.
        synthetic: the texts answering a call the log gives no observation for.
        successor: the run that continues ``run_id``, named in errors; ``None`` when the
            history is asked for by itself.
        redact: the values of secret arguments read ``[redacted]`` (`read_chain`).

    Returns:
        The messages, oldest first (``role`` user, assistant or tool).

    Raises:
        UsageError, StoreError: as `read_chain`.
    """
    chain = await read_chain(
        store, run_id, before_step=before_step, successor=successor, redact=redact
    )
    history, _ = inherited_context(chain, synthetic=synthetic)
    return history


def inherited_context(
    chain: Chain,
    *,
    synthetic: SyntheticObservations = _SYNTHETIC,
    summaries: bool = False,
) -> tuple[list[Message], Summary | None]:
    """The history ``chain`` holds, and with ``summaries`` the latest summary it wrote.

    The history as `recorded_history` gives it. The summary is the newest one a run of the
    chain wrote of what it held (the newest run that wrote one; for a fork's run, one
    covering only steps before the fork), mapped onto the returned history as
    `inherited_groups` numbers it: its ``through`` is the last group it covers (up to 0) and
    its ``run_id`` the run that wrote it (docs/context.md, "Threads"). ``None`` without
    ``summaries``, when no run of the chain wrote one, or when what it covers does not end
    where a group of the history does.

    Returns:
        The messages, oldest first, and the summary or ``None``.
    """
    history: list[Message] = []
    carried: tuple[Summary, int] | None = None  # the newest summary, and the messages it covers
    for run in chain.runs:
        inherited = len(history)
        history.extend(answer_every_call(run.input, synthetic))
        ends: dict[int, int] = {}
        for step in run.steps:
            history.extend(answer_every_call(step_messages(step), synthetic))
            ends[step.step] = len(history)
        own = run.summary if summaries else None
        if own is not None:
            if own.through > 0:
                covered = ends.get(own.through)
            else:
                covered = _group_end(history[:inherited], own.through)
            if covered is not None:
                carried = (own, covered)
    return history, _mapped(history, carried)


def _redacted(steps: tuple[StepRecord, ...], redaction: Redaction) -> tuple[StepRecord, ...]:
    """``steps`` as `Redaction.record` shows them (the same tuple when nothing is secret)."""
    if not redaction:
        return steps
    shown: list[StepRecord] = []
    for step in steps:
        record = redaction.record(step)
        assert isinstance(record, StepRecord)  # a step record is shown as one
        shown.append(record)
    return tuple(shown)


def _latest_summary(log: RunLog, before_step: int | None) -> Summary | None:
    """The newest summary ``log`` holds, or with ``before_step`` written in a step before it.

    Those the log held when a fork was made: the forked run, still unfinished, may write
    more later, and a resumed fork must find the same one.
    """
    found: Summary | None = None
    for record in log.records:
        if not isinstance(record, ModelResult) or record.reply is None:
            continue
        through = record.summary_through
        if through is not None and (before_step is None or record.step < before_step):
            found = Summary(
                intent_id=record.intent_id,
                through=through,
                text=record.reply.text or "",
                run_id=log.run_id,
            )
    return found


def _group_end(messages: Sequence[Message], through: int) -> int | None:
    """How many of ``messages`` the inherited groups up to ``through`` (<= 0) hold."""
    groups = inherited_groups(messages)
    last = len(groups) - 1 + through
    if last < 0:
        return None
    return sum(len(group.messages) for group in groups[: last + 1])


def _mapped(history: Sequence[Message], carried: tuple[Summary, int] | None) -> Summary | None:
    """The carried summary with ``through`` the group of ``history`` its coverage ends with."""
    if carried is None:
        return None
    summary, covered = carried
    held = 0
    for group in inherited_groups(history):
        held += len(group.messages)
        if held == covered:
            return attrs.evolve(summary, through=group.step)
        if held > covered:
            return None
    return None


async def _read_link(
    store: RunStore,
    run_id: str,
    before_step: int | None,
    successor: str | None,
    read: RunLog | None,
) -> RunLog:
    """The log of ``run_id`` (``read``, or read now), checked to hold what ``successor`` takes."""
    whose = _whose(run_id, successor)
    log = read if read is not None else await read_continued(store, run_id, successor)
    if log.started is None:
        if successor is None:
            raise UsageError(f"no run {run_id!r} in the store")
        raise StoreError(f"{whose}, whose log is missing")
    if successor is None:
        return log
    if before_step is None and log.finished is None:
        raise StoreError(f"{whose}, which is not finished")
    if before_step is not None and len(log.steps) < before_step - 1:
        raise StoreError(f"{whose} from step {before_step}, but it holds {len(log.steps)} steps")
    return log


async def read_continued(store: RunStore, run_id: str, successor: str | None) -> RunLog:
    """The log of run ``run_id``, read for run ``successor``, which continues it or would.

    The one way a log a run inherits from is read: by the chain's reading (`read_chain`),
    and when the run a new thread run or fork continues is looked for. A log that cannot be
    read is refused naming both runs (docs/threads.md, "When a thread cannot go on").

    Args:
        store: the store holding the run.
        run_id: the run read.
        successor: the run continuing it, named in the error; ``None``: none (the history
            is asked for by itself).

    Returns:
        The log, as `RunStore.read_log` gives it (no run-started record for a missing run).

    Raises:
        StoreError: the log cannot be read: ``run S continues run R, whose log cannot be
            read: <why>`` (``the log of run R cannot be read: <why>`` without a successor),
            chained from the store's error.
    """
    try:
        return await store.read_log(run_id)
    except StoreError as exc:
        if successor is None:
            raise StoreError(f"the log of run {run_id!r} cannot be read: {exc}") from exc
        raise StoreError(f"{_whose(run_id, successor)}, whose log cannot be read: {exc}") from exc


def _whose(run_id: str, successor: str | None) -> str:
    """``run S continues run R``, or ``run R`` without a successor."""
    return f"run {successor!r} continues run {run_id!r}" if successor else f"run {run_id!r}"
