"""Every implementation of the parser, executor and model-client seams passes the public
contract checks of `treadle.testing.seams` (and a broken one fails them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest
import trio

import treadle
from treadle import SeamViolation
from treadle.policies import POLICY_METHODS, policies_of
from treadle.testing.faults import CrashingExecutor, CrashingStore
from treadle.testing.invariants import check_invariants
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.testing.seams import (
    SeamContractError,
    check_action_executor,
    check_decision_parser,
    check_model_client,
    check_model_client_deadlines,
)
from treadle.types import (
    Action,
    ActionResult,
    ActionStatus,
    Attempt,
    DecisionKind,
    Message,
    ModelErrorInfo,
    ModelReply,
    ParsedReply,
    ToolCall,
    Usage,
)

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"


@pytest.mark.parametrize(
    "parser",
    [
        treadle.NativeToolCallParser(),
        treadle.NativeToolCallParser(text_reply_tool="respond"),
        treadle.JsonToolCallParser(),
    ],
    ids=["native", "native-text-reply-tool", "json-in-text"],
)
def test_parsers_keep_the_contract(parser):
    check_decision_parser(parser)


class RaisingParser:
    def parse(self, reply, tools):
        return ParsedReply(kind=DecisionKind.ACTIONS, history_message=Message(role="assistant"))


def test_a_broken_parser_fails_the_contract():
    with pytest.raises(SeamContractError, match="ACTIONS without actions"):
        check_decision_parser(RaisingParser())


class _Wrapping:
    """The native parser, its decision then changed by ``change``."""

    def __init__(self):
        self.inner = treadle.NativeToolCallParser()

    def parse(self, reply, tools):
        return self.change(self.inner.parse(reply, tools))

    @staticmethod
    def each_call(parsed, change):
        """``parsed`` with ``change(n)`` (field -> value) made to its n-th call, in history
        and actions alike."""
        calls = tuple(
            attrs.evolve(c, **change(n)) for n, c in enumerate(parsed.history_message.tool_calls)
        )
        actions = tuple(attrs.evolve(a, **change(n)) for n, a in enumerate(parsed.actions))
        history = attrs.evolve(parsed.history_message, tool_calls=calls)
        return attrs.evolve(parsed, history_message=history, actions=actions)


class RepeatsCallIds(_Wrapping):
    """Gives every call the same id: the tool messages can no longer tell them apart."""

    def change(self, parsed):
        return self.each_call(parsed, lambda n: {"id": "same"})


class DropsCallsFromHistory(_Wrapping):
    """Runs the native calls but leaves them out of the history message."""

    def change(self, parsed):
        history = attrs.evolve(parsed.history_message, tool_calls=())
        return attrs.evolve(parsed, history_message=history)


class RunsAHiddenAction(_Wrapping):
    """Runs one more action than the history message holds."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.ACTIONS:
            return parsed
        extra = attrs.evolve(parsed.actions[0], id="ghost")
        return attrs.evolve(parsed, actions=(*parsed.actions, extra))


class KeepsTheFirstCall(_Wrapping):
    """Of a parallel batch, keeps only the first call (in history and actions)."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.ACTIONS:
            return parsed
        history = attrs.evolve(
            parsed.history_message, tool_calls=parsed.history_message.tool_calls[:1]
        )
        return attrs.evolve(parsed, history_message=history, actions=parsed.actions[:1])


class RenamesCalls(_Wrapping):
    """Gives the calls ids of its own, in history and actions alike."""

    def change(self, parsed):
        return self.each_call(parsed, lambda n: {"id": f"mine{n}"})


class AnswersInsteadOfCalling(_Wrapping):
    """Turns a reply with calls into a final answer, dropping the calls."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.ACTIONS:
            return parsed
        history = attrs.evolve(parsed.history_message, tool_calls=())
        return attrs.evolve(
            parsed,
            kind=DecisionKind.FINAL_ANSWER,
            actions=(),
            text="Done.",
            history_message=history,
        )


class AnswersKeepingTheCalls(_Wrapping):
    """Takes the text of a reply with text and calls as the answer; history keeps the calls."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.ACTIONS or not parsed.history_message.content:
            return parsed
        return attrs.evolve(
            parsed, kind=DecisionKind.FINAL_ANSWER, actions=(), text=parsed.history_message.content
        )


class AnswersWithNothing(_Wrapping):
    """Gives every final answer the text "" (an empty reply is an invalid decision)."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.FINAL_ANSWER:
            return parsed
        return attrs.evolve(parsed, text="")


class CallsAnotherTool(_Wrapping):
    """Keeps every call id, but aims each call at ``refund`` (in history and actions alike)."""

    def change(self, parsed):
        return self.each_call(parsed, lambda n: {"name": "refund"})


class ReplacesArguments(_Wrapping):
    """Keeps every call id and tool, but replaces the arguments (in history and actions)."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.ACTIONS:
            return parsed
        return self.each_call(parsed, lambda n: {"arguments": {"q": "something else"}})


class RunsOtherArguments(_Wrapping):
    """Shows the reply's calls in history, but runs them with other arguments."""

    def change(self, parsed):
        if parsed.kind is not DecisionKind.ACTIONS:
            return parsed
        actions = tuple(attrs.evolve(a, arguments={"q": "other"}) for a in parsed.actions)
        return attrs.evolve(parsed, actions=actions)


@pytest.mark.parametrize(
    ("parser", "rule"),
    [
        (RepeatsCallIds(), "history call ids repeat|every call id must be kept"),
        (DropsCallsFromHistory(), "not in the history message|are not the history message's"),
        (RunsAHiddenAction(), "are not the history message's calls"),
        # These three passed: the check never compared the history with the reply's calls.
        (KeepsTheFirstCall(), "are not in the history message.*every call id must be kept"),
        (RenamesCalls(), "are not in the history message.*every call id must be kept"),
        (AnswersInsteadOfCalling(), "are not in the history message.*every call id must be kept"),
        # This one passed: the calls were kept in history, but never run nor answered.
        (AnswersKeepingTheCalls(), "FINAL_ANSWER whose history message holds the calls"),
        # These three passed: only the ids were compared, not what the calls call.
        (CallsAnotherTool(), "call another tool in the history"),
        (ReplacesArguments(), "have other arguments in the history message"),
        (RunsOtherArguments(), "call another tool or other arguments than the history"),
    ],
    ids=[
        "repeated-ids",
        "calls-dropped",
        "hidden-action",
        "all-but-the-first-dropped",
        "renamed",
        "calls-turned-into-an-answer",
        "calls-kept-in-an-answer",
        "another-tool",
        "other-arguments",
        "actions-with-other-arguments",
    ],
)
def test_a_parser_whose_actions_are_not_its_history_calls_fails_the_contract(parser, rule):
    with pytest.raises(SeamContractError, match=rule):
        check_decision_parser(parser)


def test_a_parser_whose_final_answer_is_empty_text_fails_the_contract():
    with pytest.raises(SeamContractError, match="FINAL_ANSWER without text \\(''\\)"):
        check_decision_parser(AnswersWithNothing())


@treadle.tool
async def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


async def test_a_run_whose_calls_were_turned_into_the_answer_fails_the_invariants():
    store = treadle.MemoryStore()
    agent = treadle.Agent(
        model=ScriptedModel(
            turns=[calls(ToolCall(id="c1", name="lookup", arguments={"q": "x"}), text="Looking.")]
        ),
        executor=treadle.Toolbox([lookup]),
        parser=AnswersKeepingTheCalls(),
    )
    result = await treadle.run(agent, "go", store=store, run_id="answered")
    assert result.final_answer == "Looking."  # the call never ran
    problems = check_invariants(await store.read_log("answered"))
    assert any(
        "asked for calls ['c1'], but the step was decided as the final answer" in p
        for p in problems
    ), problems


async def test_toolbox_keeps_the_contract():
    sample = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="lookup", arguments={"q": "x"}
    )
    await check_action_executor(treadle.Toolbox([lookup]), sample=sample)


class _Raising:
    """Toolbox over ``lookup``, whose ``execute`` or ``reconcile`` raises where told."""

    def __init__(self, where):
        self.inner = treadle.Toolbox([lookup])
        self.where = where
        self.executed = set()

    def tool_specs(self):
        return self.inner.tool_specs()

    def replay_policy(self, tool):
        if self.where == "policy" and tool == "lookup":
            return "sometimes"
        return self.inner.replay_policy(tool)

    async def execute(self, action):
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            if self.where == "cancelled":
                raise RuntimeError("connection torn down") from None
            raise
        self.executed.add(action.intent_id)
        if self.where == "unknown" and action.tool != "lookup":
            raise KeyError(action.tool)
        if self.where == "tool" and action.arguments == {"q": "x"}:
            raise ZeroDivisionError("tool bug")
        return await self.inner.execute(action)

    async def reconcile(self, action):
        if self.where == "reconcile":
            raise RuntimeError("reconcile db down")
        if self.where == "reconcile_written" and action.intent_id in self.executed:
            raise KeyError(action.intent_id)
        return await self.inner.reconcile(action)


@pytest.mark.parametrize(
    ("where", "rule"),
    [
        ("unknown", "execute raised KeyError.* for an unknown tool"),
        ("tool", "execute raised ZeroDivisionError.* for the sample action"),
        ("reconcile", "reconcile raised RuntimeError.* for an action never written"),
        # The check never asked reconcile about an action it had run, nor the replay policy
        # of a declared tool, and a cancelled execute's RuntimeError escaped it.
        ("reconcile_written", "reconcile raised KeyError.* for an action written and run"),
        ("policy", "replay_policy\\('lookup'\\).*'sometimes'"),
        ("cancelled", "a cancelled execute raised RuntimeError"),
    ],
)
async def test_an_executor_that_raises_fails_the_contract(where, rule):
    sample = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="lookup", arguments={"q": "x"}
    )
    with pytest.raises(SeamContractError, match=rule):
        await check_action_executor(_Raising(where), sample=sample)


class SafeByValue(_Raising):
    """``replay_policy`` answers the value ``"safe"`` for ``lookup``, not the member."""

    def __init__(self):
        super().__init__(where=None)

    def replay_policy(self, tool):
        return "safe" if tool == "lookup" else treadle.ReplayPolicy.NEVER


async def test_a_replay_policy_given_by_its_value_is_kept_by_the_check_and_the_run():
    # "safe" passed the check (it equals ReplayPolicy.SAFE) but resume compared with `is`
    # and recorded the call unknown instead of running it again.
    await check_action_executor(SafeByValue())
    store = treadle.MemoryStore()
    crashing = CrashingStore(inner=store, crash_at=10**9)

    def agent(executor):
        model = ScriptedModel(turns=[call("lookup", q="x"), say("done")])
        return treadle.Agent(model=model, executor=executor, parser=treadle.NativeToolCallParser())

    dying = CrashingExecutor(inner=SafeByValue(), crash_at=1, when="before", store=crashing)
    with pytest.raises(BaseException):  # noqa: B017 - the process "dies" before the tool ran
        await treadle.run(agent(dying), "go", store=crashing, run_id="r")
    await treadle.run(agent(SafeByValue()), "go", store=store, run_id="r")
    log = await store.read_log("r")
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.EXECUTED
    assert result.outcome.observation == "found x"


async def test_a_replay_policy_that_is_no_policy_interrupts_the_run():
    class Sometimes(SafeByValue):
        def replay_policy(self, tool):
            return "sometimes"

    model = ScriptedModel(turns=[call("lookup", q="x"), say("done")])
    agent = treadle.Agent(model=model, executor=Sometimes(), parser=treadle.NativeToolCallParser())
    with pytest.raises(treadle.RunInterrupted) as caught:
        await treadle.run(agent, "go", store=treadle.MemoryStore(), run_id="r")
    assert isinstance(caught.value.__cause__, SeamViolation)
    assert "'sometimes'" in str(caught.value.__cause__)


async def test_a_wrapped_toolbox_keeps_its_policies_and_the_contract():
    from treadle.testing import CrashingExecutor

    @treadle.tool(requires_approval=True, secret_arguments=["key"], timeout_s=3)
    async def charge(amount: int, key: str) -> str:
        """Charge."""
        return "ok"

    wrapped = CrashingExecutor(inner=treadle.Toolbox([lookup, charge]), crash_at=99)
    await check_action_executor(wrapped)
    assert policies_of(wrapped).declared == set(POLICY_METHODS)  # all of them were checked


class Declaring:
    """An executor of one tool, ``lookup(q)``, declaring the policies it is given."""

    def __init__(self, **policies):
        self.__dict__.update(policies)

    def tool_specs(self):
        return treadle.Toolbox([lookup]).tool_specs()

    def replay_policy(self, tool):
        return treadle.ReplayPolicy.NEVER

    async def execute(self, action):
        return await treadle.Toolbox([lookup]).execute(action)

    async def reconcile(self, action):
        return None


def _lenient(tool, arguments):
    return None


def _unknown_image(image):
    raise KeyError(image.url)


def _broken_image(image):
    raise ValueError("disk on fire")


@pytest.mark.parametrize(
    ("policies", "rule"),
    [
        ({"requires_approval": True}, "requires_approval is True, not a method"),
        ({"requires_approval": lambda tool: "yes"}, "must be a bool"),
        ({"secret_arguments": lambda tool: [1]}, "must be a collection of argument names"),
        ({"secret_arguments": lambda tool: "q"}, "returned 'q': it must be a collection"),
        ({"secret_arguments": lambda tool: b"q"}, "never a bare str"),
        ({"timeout_s": lambda tool: 0}, "seconds above 0"),
        ({"timeout_s": lambda tool: True}, "seconds above 0"),
        ({"writes": lambda tool: ""}, "a key template"),
        ({"invalid_arguments": _lenient}, "invalid_arguments must give the reason"),
        ({"image_source": _broken_image}, "must raise LookupError"),
        ({"image_source": lambda image: b"?"}, "for an image it never returned"),
    ],
    ids=[
        "not-callable",
        "approval-not-bool",
        "secrets-not-names",
        "secrets-a-bare-str",
        "secrets-bytes",
        "zero-timeout",
        "bool-timeout",
        "empty-template",
        "lenient-argument-check",
        "image-error",
        "invented-image",
    ],
)
async def test_an_executor_declaring_a_broken_policy_fails_the_contract(policies, rule):
    with pytest.raises(SeamContractError, match=rule):
        await check_action_executor(Declaring(**policies))


async def test_an_executor_declaring_sound_policies_keeps_the_contract():
    executor = Declaring(
        requires_approval=lambda tool: tool == "lookup",
        secret_arguments=lambda tool: ("q",) if tool == "lookup" else (),
        timeout_s=lambda tool: None if tool == "lookup" else float("inf"),
        writes=lambda tool: None,
        invalid_arguments=treadle.Toolbox([lookup]).invalid_arguments,
        image_source=_unknown_image,
    )
    await check_action_executor(executor)
    assert policies_of(executor).declared == set(POLICY_METHODS)  # all of them were checked


async def test_airline_executor_keeps_the_contract(tmp_path):
    from treadle.demo.airline.agent import AirlineExecutor
    from treadle.demo.airline.data import AirlineDataNotFound, find_data_dir, load_data
    from treadle.demo.airline.db import AirlineDatabase

    try:
        data_dir = find_data_dir()
    except AirlineDataNotFound:
        if os.environ.get("CI"):
            raise
        pytest.skip("airline workload data not found (set TREADLE_AIRLINE_DATA)")

    class QuietCustomer:
        async def answer(self, index, agent_text):
            return "thanks ###STOP###"

    db = AirlineDatabase.create(tmp_path / "airline.sqlite3", load_data(data_dir))
    sample = Action(
        run_id="r", step=1, intent_id="r/s1/a1", call_id="c", tool="list_all_airports", arguments={}
    )
    await check_action_executor(AirlineExecutor(db, QuietCustomer()), sample=sample)


USED = Usage(input_tokens=12, output_tokens=3)


@pytest.mark.parametrize(
    ("reply", "reports"),
    [
        (say("hello"), True),
        (call("lookup", q="x", call_id="c1"), True),
        (say("hello", usage=USED), True),
        (say("hello", usage=USED), False),
        (say("hello", usage=Usage()), True),
    ],
    ids=["text", "tool-call", "reported-usage", "unreported-usage", "unknown-usage"],
)
async def test_scripted_model_keeps_the_contract(reply, reports):
    model = ScriptedModel(turns=[reply], stream_chunk_chars=2, reports_usage=reports)
    got = await check_model_client(model)
    assert got == reply
    # a second call (a report that raises) is made only of a client that reported usage
    # (scripted replies report SCRIPTED_USAGE unless given another); the last is made in a
    # cancelled scope
    reported = reports and reply.usage.known_total is not None
    assert len(model.requests) == (2 if reported else 1) + 1


@pytest.mark.parametrize(
    "case",
    [
        "05-usage-chunk-empty-choices",
        "08-parallel-toolcalls-interleaved",
        "09-toolcall-name-every-delta-no-id",
    ],
)
async def test_openai_client_keeps_the_contract(case):
    body = (CASES / f"{case}.sse").read_bytes()
    response = CannedResponse(
        headers={"content-type": "text/event-stream"}, chunks=[body], pause_s=0
    )
    async with open_loopback_server(canned(response)) as server:
        client = treadle.OpenAIChatClient(base_url=server.base_url)
        try:
            reply = await check_model_client(client)
        finally:
            await client.aclose()
    assert isinstance(reply, ModelReply)


def _anthropic_event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


ANTHROPIC_HELLO = [
    _anthropic_event(
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "usage": {"input_tokens": 12, "output_tokens": 1},
            },
        }
    ),
    _anthropic_event(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    ),
    _anthropic_event(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}
    ),
    _anthropic_event({"type": "content_block_stop", "index": 0}),
    _anthropic_event(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 3},
        }
    ),
    _anthropic_event({"type": "message_stop"}),
]
SSE = {"content-type": "text/event-stream"}


async def test_anthropic_client_keeps_the_contract():
    response = CannedResponse(headers=SSE, chunks=ANTHROPIC_HELLO, pause_s=0)
    async with (
        open_loopback_server(canned(response)) as server,
        treadle.AnthropicMessagesClient(base_url=server.base_url, api_key="k") as client,
    ):
        reply = await check_model_client(client)
    assert reply.text == "Hi" and reply.usage.input_tokens == 12
    assert len(server.requests) == 2  # it reports usage: the second call's report raised


OPENAI_FIRST_EVENT = (CASES / "05-usage-chunk-empty-choices.sse").read_bytes().split(b"\n\n")[0]
OPENAI_FIRST_EVENT += b"\n\n"


def _client(make, server):
    if make is treadle.OpenAIChatClient:
        return make(base_url=server.base_url + "/v1")
    return make(base_url=server.base_url, api_key="k")


@pytest.mark.parametrize("make", [treadle.OpenAIChatClient, treadle.AnthropicMessagesClient])
@pytest.mark.parametrize("stall", ["before-the-first-byte", "mid-stream"])
async def test_the_http_clients_keep_the_attempts_deadlines(make, stall):
    first = OPENAI_FIRST_EVENT if make is treadle.OpenAIChatClient else ANTHROPIC_HELLO[0]
    if stall == "before-the-first-byte":
        response = CannedResponse(headers=SSE, delay_s=3600.0, chunks=[first])
    else:
        response = CannedResponse(headers=SSE, chunks=[first, 3600.0, first])
    async with open_loopback_server(canned(response)) as server, _client(make, server) as client:
        error = await check_model_client_deadlines(client, deadline_s=0.2)
        with trio.fail_after(10):
            await server.wait_early_disconnect()  # the stalled response was abandoned
    assert error.info.kind == "timeout" and error.info.retryable
    assert ("idle" in error.info.message) is (stall == "mid-stream")


class SlowModel:
    """Ignores the attempt's deadlines: waits for a first byte forever."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.sleep_forever()


class PromptModel:
    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        return say("too fast")


class FinalTimeoutModel:
    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.sleep(attempt.first_byte_s)
        raise treadle.ModelCallError(ModelErrorInfo(kind="timeout", retryable=False))


class ShieldedModel:
    """Ignores the deadlines and cancellation (a blocking SDK call in a thread is alike)."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        with trio.CancelScope(shield=True):
            await trio.sleep(30)
        return say("late")


class ShieldedRaisingModel:
    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        with trio.CancelScope(shield=True):
            await trio.sleep(30)
        raise RuntimeError("the SDK's own timeout")


class RaisingModel:
    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.sleep(attempt.first_byte_s)
        raise RuntimeError("socket timed out")


class TimesOutShielded:
    """Keeps its deadlines, but shields the call: a cancel ends it only at its deadline."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        with trio.CancelScope(shield=True):
            await trio.sleep(attempt.first_byte_s)  # the server sent nothing
            raise treadle.ModelCallError(ModelErrorInfo(kind="timeout", retryable=True))


@pytest.mark.parametrize(
    ("model", "rule"),
    [
        (SlowModel(), "past the attempt's 0.5 s deadlines"),
        (PromptModel(), "from a server that should stall"),
        (FinalTimeoutModel(), "must raise a retryable timeout"),
        (ShieldedModel(), "past the attempt's 0.5 s deadlines.*ModelReply"),
        (ShieldedRaisingModel(), "past the attempt's 0.5 s deadlines.*RuntimeError"),
        (RaisingModel(), "must raise a retryable timeout.*RuntimeError"),
        (TimesOutShielded(), "a call cancelled 0.5 s in ended with ModelCallError"),
    ],
    ids=[
        "ignores-deadlines",
        "did-not-stall",
        "not-retryable",
        "ignores-cancel",
        "ignores-cancel-then-raises",
        "raises-another-error",
        "times-out-but-ignores-cancel",
    ],
)
async def test_a_client_that_breaks_the_deadlines_fails_the_contract(autojump_clock, model, rule):
    with pytest.raises(SeamContractError, match=rule):
        await check_model_client_deadlines(model)


class AnswersShielded:
    """Answers, but shields its call from cancellation."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        with trio.CancelScope(shield=True):
            await trio.sleep(0.1)
        return say("hi")


class RaisesRaw:
    """Lets a connection error out as it is, not as a ModelCallError."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        raise ConnectionResetError("peer reset")


class NoAttemptModel:
    async def complete(self, request, *, on_delta=None):
        return say("hi")


class RequiredAttemptModel:
    async def complete(self, request, *, on_delta=None, attempt):
        return say("hi")


class SwallowingModel:
    """Reports usage, and answers even when the report ends the attempt."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        try:
            attempt.report_usage(USED)
        except treadle.ModelCallError:
            pass
        return say("hi", usage=USED)


class RelabellingModel:
    """Reports usage, and turns the error that ends the attempt into one of its own."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        try:
            attempt.report_usage(USED)
        except treadle.ModelCallError as exc:
            raise treadle.ModelCallError(ModelErrorInfo(kind="upstream_error")) from exc
        return say("hi", usage=USED)


class DropsReportedUsage:
    """Reports the server's usage while it streams, then answers with usage unknown."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        attempt.report_usage(USED)
        return say("hi")


@pytest.mark.parametrize(
    ("model", "rule"),
    [
        (NoAttemptModel(), "must take the keyword argument attempt"),
        (RequiredAttemptModel(), "attempt needs a default"),
        (SwallowingModel(), "went on after attempt.report_usage raised"),
        (RelabellingModel(), "replaced the error report_usage raised"),
        # A shielded call and a raw exception passed, or escaped the check unreported.
        (AnswersShielded(), "a call cancelled 0 s in ended with ModelReply"),
        (RaisesRaw(), "complete raised ConnectionResetError.*ModelCallError"),
        # Passed: the run records the reply's usage, so the reported tokens were lost.
        (DropsReportedUsage(), "the reply's usage .* is not the last usage reported"),
    ],
    ids=[
        "no-attempt",
        "attempt-required",
        "swallows-the-cut",
        "relabels-the-cut",
        "ignores-cancel",
        "raises-a-raw-error",
        "drops-reported-usage",
    ],
)
async def test_a_client_that_ignores_its_attempt_fails_the_contract(model, rule):
    with pytest.raises(SeamContractError, match=rule):
        await check_model_client(model)


class LyingModel:
    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        if on_delta:
            on_delta("text", "abc")
        return ModelReply(text="xyz")


class EmptyTextBesideCalls:
    """Answers a tool-only turn with text "" instead of None."""

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        return ModelReply(text="", tool_calls=(ToolCall(id="c1", name="lookup", arguments={}),))


async def test_a_client_whose_text_is_empty_for_nothing_fails_the_contract():
    with pytest.raises(SeamContractError, match=r'reply\.text is "": a reply without visible'):
        await check_model_client(EmptyTextBesideCalls())


async def test_a_broken_model_client_fails_the_contract():
    with pytest.raises(SeamContractError, match="add up"):
        await check_model_client(LyingModel())


class BadErrorUsageModel:
    """Fails its attempt with an error whose usage is no count of tokens."""

    def __init__(self, usage):
        self.usage = usage

    async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
        await trio.lowlevel.checkpoint()
        info = ModelErrorInfo(kind="server_error", retryable=True)
        raise treadle.ModelCallError(info, usage=self.usage)


@pytest.mark.parametrize(
    "usage",
    [Usage(input_tokens=2.5), Usage(input_tokens="lots"), Usage(output_tokens=-1000)],
    ids=["float", "text", "negative"],
)
async def test_a_client_whose_error_carries_a_broken_usage_fails_the_contract(usage):
    with pytest.raises(SeamContractError, match=r"usage\.\w+ must be None or a count of tokens"):
        await check_model_client(BadErrorUsageModel(usage))


async def test_a_client_whose_error_carries_a_valid_usage_keeps_the_contract():
    with pytest.raises(treadle.ModelCallError):  # the first call failed, its error checked
        await check_model_client(BadErrorUsageModel(Usage(input_tokens=7)))
