"""A scripted model client for tests and simulations.

`ScriptedModel` answers by the request's position in the conversation (the number of
assistant turns already in its history), so a request repeated after a crash gets the same
reply, exactly like a replayed recording. Failures can be scripted per turn and are consumed
one per attempt.

Every reply `say`, `call` and `calls` make reports `SCRIPTED_USAGE` (10 input and 5 output
tokens) unless it is given its own ``usage``; ``usage=Usage()`` scripts a reply whose usage
was never reported (docs/simulation.md, "Scripted replies").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from treadle._exceptions import ModelCallError, UsageError
from treadle.ports import DeltaCallback
from treadle.types import Attempt, ModelErrorInfo, ModelReply, ModelRequest, ToolCall, Usage

UNNAMED: str = ""
"""The id of a scripted call written without ``call_id``; `ScriptedModel` names it by position."""

STALLED = "stalled"
"""A scripted failure of this kind stalls the call forever instead of raising: the model
gateway's attempt deadline (or a cancel) must end it."""


SCRIPTED_USAGE = Usage(input_tokens=10, output_tokens=5)
"""The usage a scripted reply reports unless given its own: 10 input and 5 output tokens.

So each reply counts 15 tokens against a token budget (`Usage.known_total`), and an agent
with a token budget runs on a script as it runs on a provider that reports usage
(docs/simulation.md, "Scripted replies").
"""


def say(text: str, *, usage: Usage | None = None) -> ModelReply:
    """A reply with visible text only (a final answer for most parsers).

    Args:
        text: the visible text.
        usage: what the reply reports; `SCRIPTED_USAGE` when not given, ``Usage()`` for a
            reply whose usage was never reported (under a token budget it ends the run,
            docs/decisions/0114-a-token-budget-ends-at-a-reply-of-unknown-usage.md).
    """
    return ModelReply(text=text, finish_reason="stop", usage=_or_scripted(usage))


def call(name: str, /, *, call_id: str | None = None, **arguments: Any) -> ModelReply:
    """A reply with one native tool call ``name(**arguments)``, reporting `SCRIPTED_USAGE`.

    Without ``call_id`` the `ScriptedModel` playing it names the call by its place in the
    script, ``call_<turn>_<index>`` (both from 1), so the id is the same in every run of the
    script, every resume and every simulated twin, whatever else the process scripted.
    Another usage is given with ``attrs.evolve(call(...), usage=...)`` (every keyword is an
    argument of the call), or with `calls`.
    """
    return calls(ToolCall(id=call_id or UNNAMED, name=name, arguments=arguments))


def calls(*tool_calls: ToolCall, text: str | None = None, usage: Usage | None = None) -> ModelReply:
    """A reply with several native tool calls (a parallel batch).

    Args:
        tool_calls: the calls, in the order the provider gave them.
        text: visible text sent with them, if any.
        usage: what the reply reports; `SCRIPTED_USAGE` when not given, ``Usage()`` for a
            reply whose usage was never reported.
    """
    return ModelReply(
        text=text, tool_calls=tool_calls, finish_reason="tool_calls", usage=_or_scripted(usage)
    )


def _or_scripted(usage: Usage | None) -> Usage:
    """``usage``, or `SCRIPTED_USAGE` when it is ``None`` (``Usage()`` stays unknown)."""
    return SCRIPTED_USAGE if usage is None else usage


def _check_turns(model: object, field: attrs.Attribute[Any], turns: object) -> None:
    """Refuse a script that is no sequence of `ModelReply` (a lone reply, text).

    Raises:
        UsageError: naming the argument and, for a wrong turn, its index.
    """
    if isinstance(turns, ModelReply | str | bytes) or not isinstance(turns, Sequence):
        raise UsageError(
            f"ScriptedModel: turns must be a sequence of ModelReply (e.g. [say('hi')]), "
            f"not {turns!r:.100}"
        )
    for index, turn in enumerate(turns):
        if not isinstance(turn, ModelReply):
            raise UsageError(
                f"ScriptedModel: turns[{index}] must be a ModelReply (made by say, call or "
                f"calls), not {turn!r:.100}"
            )


def _check_failures(model: object, field: attrs.Attribute[Any], failures: object) -> None:
    """Refuse failures not keyed by turn index (an int) or not lists of `ModelErrorInfo`.

    Raises:
        UsageError: naming the argument and the wrong key.
    """
    if not isinstance(failures, Mapping):
        raise UsageError(
            f"ScriptedModel: failures must map turn indexes to errors, not {failures!r}"
        )
    for turn, errors in failures.items():
        if not isinstance(turn, int) or isinstance(turn, bool):
            raise UsageError(
                f"ScriptedModel: failures are keyed by turn index (an int), not {turn!r}"
            )
        if isinstance(errors, ModelErrorInfo) or not all(
            isinstance(error, ModelErrorInfo) for error in errors
        ):
            raise UsageError(
                f"ScriptedModel: failures[{turn}] must be a sequence of ModelErrorInfo, "
                f"not {errors!r:.100}"
            )


@attrs.define(eq=False)
class ScriptedModel:
    """A `treadle.ports.ModelClient` that plays a script.

    Args:
        turns: the reply for each assistant turn, in order; ``turns[i]`` answers a request
            whose history holds *i* assistant messages. Messages and call ids number the
            turns from 1: ``turns[0]`` is turn 1, its calls ``call_1_1``, ``call_1_2`` ...
            Each reply reports its own ``usage`` (`SCRIPTED_USAGE` for those `say`, `call`
            and `calls` make unless told otherwise).
        failures: per turn index (from 0, as in ``turns``), errors to raise on the first
            attempts of that turn (one consumed per attempt), e.g.
            ``{0: [ModelErrorInfo(kind="rate_limited", ...)]}`` for turn 1; kind `STALLED`
            hangs the attempt instead.
        latency_s: trio-clock seconds each call takes (virtual under ``autojump_clock``).
        stream_chunk_chars: when > 0, the reply text is streamed to ``on_delta`` in pieces of
            this many characters.
        turn_offset: assistant messages of a request's history the script does not count
            (those a run inherited from the runs its thread continues, docs/threads.md).
        reports_usage: report a reply's known usage to the attempt's observer before
            returning it, as a server that reports usage in its last event does (the token
            budget then cuts the attempt, docs/models.md, "Budgets during a call"); ``False``
            plays a client that reports none (the gateway checks the reply's usage when the
            call ends).

    Attributes:
        requests: every request received, in order.

    Raises:
        UsageError: when made, ``turns`` is no sequence of `ModelReply` (a lone reply or
            text), or ``failures`` is not keyed by turn index or holds no `ModelErrorInfo`.
    """

    turns: Sequence[ModelReply] = attrs.field(validator=_check_turns)
    failures: Mapping[int, Sequence[ModelErrorInfo]] = attrs.field(
        factory=dict, validator=_check_failures
    )
    latency_s: float = 0.0
    stream_chunk_chars: int = 0
    turn_offset: int = 0
    reports_usage: bool = True
    requests: list[ModelRequest] = attrs.Factory(list)
    _failed: dict[int, int] = attrs.field(init=False, factory=dict)

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        """Answer with the scripted reply for this turn (or raise its scripted failure).

        With ``reports_usage``, a reply whose usage is known is reported to
        ``attempt.report_usage`` once, before it is returned. The attempt's deadlines do not
        apply: nothing is read from a network (``latency_s`` is not a wait for a first byte),
        and a `STALLED` failure ends only at the gateway's attempt total or a cancel.

        Raises:
            ModelCallError: a scripted failure, ``invalid_response`` when the script ran out
                (``script has no turn 3 (it has 2 turns, numbered from 1)``) or the request
                holds fewer assistant messages than ``turn_offset``, or the error
                ``attempt.report_usage`` raised (e.g. ``token_budget``).
        """
        self.requests.append(request)
        if self.latency_s > 0:
            await trio.sleep(self.latency_s)
        else:
            await trio.lowlevel.checkpoint()
        assistants = sum(1 for m in request.messages if m.role == "assistant")
        turn = assistants - self.turn_offset
        scripted = self.failures.get(turn, ())
        failed = self._failed.get(turn, 0)
        if failed < len(scripted):
            self._failed[turn] = failed + 1
            if scripted[failed].kind == STALLED:
                await trio.sleep_forever()  # a stream that never sends another byte
            raise ModelCallError(scripted[failed])
        if turn < 0:
            raise ModelCallError(
                ModelErrorInfo(kind="invalid_response", message=self._before_offset(assistants))
            )
        if turn >= len(self.turns):
            raise ModelCallError(
                ModelErrorInfo(kind="invalid_response", message=self._ran_out(turn))
            )
        reply = _named(self.turns[turn], turn)
        if on_delta is not None and reply.text and self.stream_chunk_chars > 0:
            size = self.stream_chunk_chars
            for start in range(0, len(reply.text), size):
                on_delta("text", reply.text[start : start + size])
        if self.reports_usage and reply.usage != _UNKNOWN_USAGE:
            attempt.report_usage(reply.usage)
        return reply

    def _before_offset(self, assistants: int) -> str:
        """The message for a request whose history holds fewer assistant messages than skipped.

        ``turn_offset`` counts the assistant messages a run inherited (docs/threads.md); a
        request holding ``assistants`` of them, fewer, is of no turn of the script.
        """
        held = "1 assistant message" if assistants == 1 else f"{assistants} assistant messages"
        return (
            f"the request's history holds {held}, fewer than the turn_offset of "
            f"{self.turn_offset} the script skips (the assistant messages of the runs a "
            "thread continues): it is of no turn of the script"
        )

    def _ran_out(self, turn: int) -> str:
        """The message for a request at ``turn`` (an index from 0) the script has no reply for.

        Turns are numbered from 1 in it, as in the names of scripted calls
        (``call_<turn>_<index>``).
        """
        count = len(self.turns)
        turns = "1 turn" if count == 1 else f"{count} turns"
        return f"script has no turn {turn + 1} (it has {turns}, numbered from 1)"


_UNKNOWN_USAGE = Usage()


def _named(reply: ModelReply, turn: int) -> ModelReply:
    """``reply`` with its unnamed calls named by their place: ``call_<turn>_<index>``."""
    if all(c.id != UNNAMED for c in reply.tool_calls):
        return reply
    named = tuple(
        attrs.evolve(c, id=f"call_{turn + 1}_{index + 1}") if c.id == UNNAMED else c
        for index, c in enumerate(reply.tool_calls)
    )
    return attrs.evolve(reply, tool_calls=named)
