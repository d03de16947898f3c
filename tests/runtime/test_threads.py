"""Threads and forks end to end through the real actors, on every store we ship."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

import treadle
from treadle._exceptions import (
    InvalidRunId,
    LogCorrupted,
    RunInterrupted,
    StoreError,
    UsageError,
)
from treadle.agent import Agent
from treadle.ports import RunStore
from treadle.redaction import REDACTED
from treadle.stores.jsonl import JsonlStore
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import SqliteStore
from treadle.testing import InterceptingStore
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import Lease, Message, ModelIntent, RunLog, RunStarted, RunState, StopReason

# One script for the whole conversation: ScriptedModel answers turn i (i assistant messages in
# the request), so a thread's second run sees its turns only if it holds the first run's history.
TURNS = [
    call("add", a=1, b=2, call_id="c1"),
    say("1 + 2 = 3"),
    call("add", a=3, b=4, call_id="c2"),
    say("3 + 4 = 7"),
    say("bye"),
]


def agent(model: ScriptedModel, tools: LedgerTools) -> Agent:
    return Agent(model=model, executor=tools, parser=SimpleParser(), system_prompt="Be brief.")


StoreMaker = Callable[[], contextlib.AbstractAsyncContextManager[RunStore]]


@pytest.fixture(params=["memory", "sqlite", "jsonl", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreMaker:
    kind = request.param
    if kind == "memory":
        logs: dict = {}

        @contextlib.asynccontextmanager
        async def memory() -> AsyncIterator[RunStore]:
            store = MemoryStore()
            store._logs = logs  # reopened: the logs outlive the store object, as a file does
            yield store

        return memory
    if kind == "sqlite":
        return lambda: _closing(SqliteStore.open(tmp_path / "runs.db"))
    if kind == "jsonl":
        return lambda: _closing(JsonlStore.open(tmp_path / "runs"))
    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")

    def postgres() -> contextlib.AbstractAsyncContextManager[RunStore]:
        from treadle.stores.postgres import open_postgres_store

        return open_postgres_store(dsn, schema=schema)

    return postgres


@contextlib.asynccontextmanager
async def _closing(opening) -> AsyncIterator[RunStore]:
    store = await opening
    try:
        yield store
    finally:
        await store.aclose()


async def test_a_thread_continues_with_the_recorded_history(open_store: StoreMaker) -> None:
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    async with open_store() as store:
        first = await treadle.run(agent(model, tools), "add 1 and 2", store=store, run_id="t")
        second = await treadle.run(agent(model, tools), "now 3 and 4", store=store, thread_id="t")
        third = await treadle.run(agent(model, tools), "thanks", store=store, thread_id="t")
        logs = {r: await store.read_log(r) for r in ("t", "t.2", "t.3")}
        ended = await treadle.history(store, "t.3")
    assert (first.final_answer, second.final_answer, third.final_answer) == (
        "1 + 2 = 3",
        "3 + 4 = 7",
        "bye",
    )
    assert (second.run_id, third.run_id) == ("t.2", "t.3")
    # each run counts its own steps; no earlier model call or tool call ran again
    assert [len(log.steps) for log in logs.values()] == [2, 2, 1]
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert len(model.requests) == 5
    started = logs["t.3"].started
    assert (started.thread, started.continues, started.fork_step) == ("t", "t.2", None)
    assert [m.content for m in started.input] == ["thanks"]  # referenced, not copied
    # the third run's first request: system prompt, then the whole thread, then its message
    request = model.requests[4]
    assert request.messages[0] == Message(role="system", content="Be brief.")
    assert tuple(request.messages[1:]) == ended[:-1]
    assert [m.role for m in ended] == [
        *("user", "assistant", "tool", "assistant"),
        *("user", "assistant", "tool", "assistant"),
        *("user", "assistant"),
    ]
    assert [m.content for m in ended if m.role == "user"] == [
        "add 1 and 2",
        "now 3 and 4",
        "thanks",
    ]


async def test_history_of_a_plain_run_is_its_input_and_steps() -> None:
    store = MemoryStore()
    model = ScriptedModel(turns=TURNS)
    await treadle.run(agent(model, LedgerTools()), "add 1 and 2", store=store, run_id="r")
    ended = await treadle.history(store, "r")
    # what the model was asked last, plus the answer it gave
    assert ended[:-1] == tuple(model.requests[-1].messages[1:])
    assert ended[-1] == Message(role="assistant", content="1 + 2 = 3")
    with pytest.raises(UsageError, match="no run 'nope'"):
        await treadle.history(store, "nope")


@treadle.tool(secret_arguments=("card_number",))
async def charge(amount_cents: int, card_number: str) -> str:
    """Charge a card."""
    return f"charged {amount_cents} cents"


async def test_history_redacts_secret_arguments_of_every_run_of_the_chain() -> None:
    # treadle.history returned the card number in the clear, for the run itself and for the
    # thread's next run and the fork that inherit it, while treadle show redacted it.
    store = MemoryStore()
    turns = [call("charge", amount_cents=500, card_number="4111111111111111"), say("paid")]
    model = ScriptedModel(turns=[*turns, say("bye")])
    paying = Agent(
        model=model, executor=treadle.Toolbox([charge]), parser=treadle.NativeToolCallParser()
    )
    await treadle.run(paying, "pay 5", store=store, run_id="p")
    await treadle.run(paying, "thanks", store=store, thread_id="p")
    await treadle.run(paying, store=store, run_id="pf", fork_of="p", at_step=2)
    for run_id in ("p", "p.2", "pf"):
        (paid,) = [m for m in await treadle.history(store, run_id) if m.tool_calls]
        assert paid.tool_calls[0].arguments == {
            "amount_cents": 500,
            "card_number": REDACTED,
        }, run_id
    # the model's own history is the log's: it is sent the call as it made it
    sent = [m for m in model.requests[-1].messages if m.tool_calls]
    assert sent[0].tool_calls[0].arguments["card_number"] == "4111111111111111"


async def test_a_thread_after_a_final_answer_tool_call_sees_it_accepted() -> None:
    # The next run was told the accepted final_answer call's outcome was unknown, "the run
    # was interrupted while it ran": nothing was interrupted, and the answer went through.
    import attrs

    @attrs.frozen
    class Answer:
        value: int

    store = MemoryStore()
    first = ScriptedModel(turns=[call("final_answer", value=5, call_id="f1")])
    typed = Agent(
        model=first,
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
        output_type=Answer,
    )
    await treadle.run(typed, "2 + 3?", store=store, run_id="chat")
    second = ScriptedModel(turns=[call("final_answer", value=15, call_id="f2")], turn_offset=1)
    result = await treadle.run(
        attrs.evolve(typed, model=second), "plus 10?", store=store, thread_id="chat"
    )
    assert result.output == Answer(value=15)
    sent = second.requests[0].messages
    answered = [m for m in sent if m.role == "tool" and m.tool_call_id == "f1"]
    assert [m.content for m in answered] == ["Accepted: this is the run's final answer."]
    assert (await treadle.history(store, "chat"))[-1] == answered[0]


async def test_a_fork_tries_a_step_again_without_running_the_prefix(
    open_store: StoreMaker,
) -> None:
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    async with open_store() as store:
        await treadle.run(agent(model, tools), "add 1 and 2", store=store, run_id="r")
        await treadle.run(agent(model, tools), "now 3 and 4", store=store, thread_id="r")
        calls_before, executed_before = len(model.requests), len(tools.executed)
        # try the answer of r.2's step 2 again, with another script for that turn
        other = ScriptedModel(turns=[*TURNS[:3], say("3 + 4 is seven")])
        result = await treadle.run(
            agent(other, tools), store=store, run_id="f", fork_of="r.2", at_step=2
        )
        fork = await store.read_log("f")
        ended = await treadle.history(store, "f")
        source = await treadle.history(store, "r.2")
    assert result.final_answer == "3 + 4 is seven"
    assert (fork.started.continues, fork.started.fork_step, fork.started.thread) == ("r.2", 2, None)
    assert fork.started.input == ()
    # nothing before step 2 ran again: one model call, no tool call
    assert len(other.requests) == 1 and len(tools.executed) == executed_before
    assert len(model.requests) == calls_before
    assert [i for i in fork.records if isinstance(i, ModelIntent)][0].step == 1
    assert ended[:-1] == source[:-1]  # the shared prefix, read from r and r.2
    assert ended[-1].content == "3 + 4 is seven" and source[-1].content == "3 + 4 = 7"


async def test_a_fork_with_a_new_message_and_a_thread_of_its_own() -> None:
    store = MemoryStore()
    tools = LedgerTools()
    await treadle.run(agent(ScriptedModel(turns=TURNS), tools), "add", store=store, run_id="r")
    model = ScriptedModel(turns=[TURNS[0], say("fine: 3")])
    await treadle.run(
        agent(model, tools), "just say it", store=store, run_id="f", fork_of="r", at_step=2
    )
    assert [m.content for m in model.requests[0].messages if m.role == "user"][-1] == "just say it"
    follow = ScriptedModel(turns=[TURNS[0], say("x"), say("again")])
    later = await treadle.run(agent(follow, tools), "more", store=store, thread_id="f")
    assert later.run_id == "f.2" and later.final_answer == "again"
    assert [m.content for m in (await treadle.history(store, "f.2")) if m.role == "user"] == [
        "add",
        "just say it",
        "more",
    ]


async def test_a_thread_that_cannot_go_on_is_refused_and_nothing_is_written() -> None:
    store = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    with pytest.raises(UsageError, match="thread 'x' does not exist"):
        await treadle.run(agent(model, tools), "hi", store=store, thread_id="x")
    await treadle.run(agent(model, tools), "add", store=store, run_id="t")
    with pytest.raises(UsageError, match="needs an input"):
        await treadle.run(agent(model, tools), store=store, thread_id="t")
    with pytest.raises(UsageError, match="not both"):
        await treadle.run(agent(model, tools), "a", store=store, thread_id="t", fork_of="t")
    with pytest.raises(UsageError, match=r"goes on as run 't\.2', not 'other'"):
        await treadle.run(agent(model, tools), "a", store=store, thread_id="t", run_id="other")
    with pytest.raises(UsageError, match="at step 3: it has steps 1 to 2"):
        await treadle.run(agent(model, tools), store=store, fork_of="t", at_step=3)
    with pytest.raises(UsageError, match="needs at_step"):
        await treadle.run(agent(model, tools), store=store, fork_of="t")
    with pytest.raises(UsageError, match="cannot fork run 'zz'"):
        await treadle.run(agent(model, tools), store=store, fork_of="zz", at_step=1)
    await treadle.run(agent(model, tools), "more", store=store, thread_id="t")
    with pytest.raises(UsageError, match="continue the thread with thread_id='t'"):
        await treadle.run(agent(model, tools), "a", store=store, thread_id="t.2")
    assert sorted(await store.list_runs()) == ["t", "t.2"]


async def test_an_unfinished_latest_run_is_resumed_by_the_same_message_only() -> None:
    memory = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=memory, run_id="t")
    # the continuation dies after its model intent (write 2 of the new run)
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await treadle.run(
            agent(model, tools),
            "now 3 and 4",
            store=CrashingStore(inner=memory, crash_at=2, when="after"),
            thread_id="t",
        )
    with pytest.raises(UsageError, match=r"latest run 't\.2' is not finished"):
        await treadle.run(agent(model, tools), "something else", store=memory, thread_id="t")
    result = await treadle.run(agent(model, tools), "now 3 and 4", store=memory, thread_id="t")
    assert result.run_id == "t.2" and result.final_answer == "3 + 4 = 7"
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


async def test_a_thread_run_driven_elsewhere_is_not_driven_twice(tmp_path: Path) -> None:
    async with _closing(SqliteStore.open(tmp_path / "runs.db")) as store:
        tools = LedgerTools()
        await treadle.run(agent(ScriptedModel(turns=TURNS), tools), "add", store=store, run_id="t")
        slow = ScriptedModel(turns=TURNS, latency_s=1.0)
        async with treadle.open_run(
            agent(slow, tools), "now 3 and 4", store=store, thread_id="t", owner="a"
        ) as handle:
            while not slow.requests:  # noqa: ASYNC110 (a plain attribute)
                await trio.sleep(0.01)
            with pytest.raises(treadle.RunLeased):
                await treadle.run(
                    agent(slow, tools), "now 3 and 4", store=store, thread_id="t", owner="b"
                )
            with pytest.raises(UsageError, match="not finished"):
                await treadle.run(agent(slow, tools), "other", store=store, thread_id="t")
        assert (await handle.wait()).state is RunState.SUCCEEDED


async def test_a_missing_or_damaged_predecessor_stops_the_resume_and_loses_nothing() -> None:
    memory = MemoryStore()
    logs = memory._logs
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=memory, run_id="t")
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await treadle.run(
            agent(model, tools),
            "now 3 and 4",
            # dies before its second write, so its run-started record is surely stored
            store=CrashingStore(inner=memory, crash_at=2, when="before"),
            thread_id="t",
        )
    kept = list(logs["t.2"])
    root = logs.pop("t")  # the predecessor's log is gone
    with pytest.raises(StoreError, match="continues run 't', whose log is missing"):
        await treadle.run(agent(model, tools), store=memory, run_id="t.2")
    assert logs["t.2"] == kept  # nothing written, nothing lost
    logs["t"] = root[:-1]  # now it lost its run-finished record
    with pytest.raises(StoreError, match="which is not finished"):
        await treadle.run(agent(model, tools), store=memory, run_id="t.2")
    logs["t"] = root
    result = await treadle.run(agent(model, tools), store=memory, run_id="t.2")
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.final_answer == "3 + 4 = 7"


async def test_a_hydrator_without_a_store_refuses_a_thread_run() -> None:
    from treadle.actors import ContextHydrator

    started = RunStarted(run_id="t.2", ts="", input=(), snapshot={}, thread="t", continues="t")
    hydrator = ContextHydrator(
        started=started, system_prompt=None, tools=(), model="m", max_output_tokens=None, params={}
    )
    with pytest.raises(StoreError, match="given no store"):
        await hydrator.inherit()


async def test_a_retry_naming_its_run_starts_nothing_twice() -> None:
    store = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=store, run_id="t")
    first = await treadle.run(
        agent(model, tools), "now 3 and 4", store=store, thread_id="t", run_id="t.2"
    )
    calls = len(model.requests)
    again = await treadle.run(
        agent(model, tools), "now 3 and 4", store=store, thread_id="t", run_id="t.2"
    )
    assert again == first and len(model.requests) == calls
    assert sorted(await store.list_runs()) == ["t", "t.2"]
    with pytest.raises(UsageError, match="input differs"):
        await treadle.run(agent(model, tools), "other", store=store, thread_id="t", run_id="t.2")
    await treadle.run(agent(model, tools), "x", store=store, run_id="u")
    with pytest.raises(UsageError, match="'u' exists and is not a later run of thread 't'"):
        await treadle.run(agent(model, tools), "x", store=store, thread_id="t", run_id="u")


async def test_a_fork_naming_a_finished_run_of_another_lineage_is_refused() -> None:
    """It returned that run's result as the fork's: a plain run, a fork of another run, or
    the forked run itself (an unfinished one was refused already)."""
    store = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=store, run_id="a")
    await treadle.run(agent(model, tools), "add", store=store, run_id="b")
    fork = await treadle.run(agent(model, tools), store=store, fork_of="a", at_step=1, run_id="f")
    calls = len(model.requests)
    for fork_of, run_id, said in (
        ("a", "b", "'b' exists as a run of its own, not as the fork of a at step 1"),
        ("b", "f", "'f' exists as fork of a at step 1, not as the fork of b at step 1"),
    ):
        with pytest.raises(UsageError, match=said):
            await treadle.run(
                agent(model, tools), store=store, fork_of=fork_of, at_step=1, run_id=run_id
            )
    again = await treadle.run(agent(model, tools), store=store, fork_of="a", at_step=1, run_id="f")
    assert again == fork and len(model.requests) == calls  # the same fork: its result


async def test_a_fork_named_as_the_run_it_forks_is_told_so() -> None:
    # It was refused as a run "another caller started", whoever had started it, and so was
    # one named so whose forked run was missing.
    store = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=store, run_id="a")
    for fork_of in ("a", "gone"):
        with pytest.raises(UsageError) as refused:
            await treadle.run(
                agent(model, tools), store=store, fork_of=fork_of, at_step=1, run_id=fork_of
            )
        assert str(refused.value) == (
            f"run_id {fork_of!r} names the run to fork; a fork is a new run: give it an id "
            "of its own, or none for a fresh one"
        )
    assert sorted(await store.list_runs()) == ["a"]


async def test_recovery_resumes_a_crashed_thread_run_with_its_history(tmp_path: Path) -> None:
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    async with _closing(SqliteStore.open(tmp_path / "runs.db")) as store:
        await treadle.run(agent(model, tools), "add", store=store, run_id="t")
        with pytest.raises((RunInterrupted, SimulatedCrash)):
            await treadle.run(
                agent(model, tools),
                "now 3 and 4",
                store=CrashingStore(inner=store, crash_at=3, when="before"),
                thread_id="t",
            )
    async with _closing(SqliteStore.open(tmp_path / "runs.db")) as store:
        (result,) = await treadle.resume_unfinished(agent(model, tools), store=store)
        ended = await treadle.history(store, "t.2")
    assert (result.run_id, result.final_answer) == ("t.2", "3 + 4 = 7")
    assert [m.content for m in ended if m.role == "user"] == ["add", "now 3 and 4"]
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


async def test_a_new_run_over_a_damaged_chain_is_refused_before_it_is_written() -> None:
    """The thread's latest run is finished, but an earlier run's log is damaged: continuing
    the thread or forking its latest run is refused and writes nothing (no run left
    unfinished, the thread not blocked for another message); once the log is back, it goes on."""
    memory = MemoryStore()
    logs = memory._logs
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=memory, run_id="t")
    await treadle.run(agent(model, tools), "now 3 and 4", store=memory, thread_id="t")
    root = logs["t"]
    logs["t"] = root[:-1]  # the thread's first run lost its run-finished record
    requests = len(model.requests)
    with pytest.raises(StoreError, match=r"run 't\.2' continues run 't', which is not finished"):
        await treadle.run(agent(model, tools), "bye?", store=memory, thread_id="t")
    with pytest.raises(StoreError, match=r"run 't\.2' continues run 't', which is not finished"):
        await treadle.run(agent(model, tools), store=memory, fork_of="t.2", at_step=1, run_id="f")
    assert sorted(logs) == ["t", "t.2"] and len(model.requests) == requests
    logs["t"] = root
    result = await treadle.run(agent(model, tools), "bye?", store=memory, thread_id="t")
    assert (result.run_id, result.final_answer) == ("t.3", "bye")


async def test_a_cut_steps_history_says_what_its_finished_calls_returned() -> None:
    """A thread continuing a run cancelled during a parallel batch told the model that a
    call which had returned (its result, 200, in the log) had an unknown outcome, and to
    check its effect before trying again."""
    from treadle.testing.scripted import calls
    from treadle.tools import Toolbox, tool
    from treadle.types import ToolCall

    @tool
    async def slow(x: int) -> int:
        """Returns after a long while."""
        await trio.sleep(60)
        return x

    returned = trio.Event()

    @tool
    async def quick(x: int) -> int:
        """Returns at once."""
        returned.set()
        return x * 100

    def make(turns: list) -> Agent:
        return Agent(
            model=ScriptedModel(turns=turns),
            executor=Toolbox([slow, quick]),
            parser=treadle.NativeToolCallParser(),
        )

    store = MemoryStore()
    batch = calls(
        ToolCall(id="a", name="slow", arguments={"x": 1}),
        ToolCall(id="b", name="quick", arguments={"x": 2}),
    )
    async with treadle.open_run(make([batch, say("never")]), "go", store=store, run_id="t") as h:
        with trio.fail_after(30):
            await returned.wait()
        h.cancel("enough")
    history = {m.tool_call_id: m.content for m in await treadle.history(store, "t")}
    assert history["b"] == "200"  # it returned before the cut
    assert "unknown" in (history["a"] or "")  # cut while it ran
    second = make([say("x"), say("carry on")])
    await treadle.run(second, "and now?", store=store, thread_id="t")
    sent = {m.tool_call_id: m.content for m in second.model.requests[-1].messages}
    assert sent["b"] == "200" and "unknown" in (sent["a"] or "")


class _CountedReads(MemoryStore):
    """Counts the reads of each run's whole log, and the lookups in the run index."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: dict[str, int] = {}
        self.lookups = 0

    async def read_log(self, run_id: str) -> RunLog:
        self.reads[run_id] = self.reads.get(run_id, 0) + 1
        return await super().read_log(run_id)

    async def read_summary(self, run_id: str) -> treadle.RunSummary | None:
        self.lookups += 1
        return await super().read_summary(run_id)

    def forget(self) -> None:
        self.reads.clear()
        self.lookups = 0


async def test_continuing_a_thread_reads_each_earlier_log_once() -> None:
    """Each new message of a thread read every earlier run's log twice (to check the chain,
    then in the hydrator) and looked every earlier run up in the run index: every message
    cost more than the one before. The check's reading now goes to the hydrator, and the
    latest run is found in about 3 log2(n) lookups (docs/threads.md, "How history is
    inherited"); a fork of the thread reads its chain once too."""
    store = _CountedReads()
    runs = 40
    model = ScriptedModel(turns=[say(f"answer {n}") for n in range(1, runs + 2)])
    definition = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    await treadle.run(definition, "first", store=store, run_id="t")
    for n in range(2, runs + 1):
        await treadle.run(definition, f"message {n}", store=store, thread_id="t")
    earlier = ["t", *(f"t.{n}" for n in range(2, runs + 1))]
    store.forget()
    result = await treadle.run(definition, "one more", store=store, thread_id="t")
    assert result.run_id == f"t.{runs + 1}"
    assert {run_id: store.reads.get(run_id) for run_id in earlier} == dict.fromkeys(earlier, 1)
    assert 0 < store.lookups <= 3 * math.ceil(math.log2(runs)) + 3
    sent = [m.content for m in model.requests[-1].messages if m.role == "user"]
    assert sent == ["first", *(f"message {n}" for n in range(2, runs + 1)), "one more"]
    store.forget()
    fork = await treadle.run(definition, store=store, run_id="f", fork_of=f"t.{runs}", at_step=1)
    assert fork.final_answer == f"answer {runs}"
    assert {run_id: store.reads.get(run_id) for run_id in earlier} == dict.fromkeys(earlier, 1)


async def test_a_thread_run_after_a_gap_in_its_names_is_refused() -> None:
    """The latest run is found without asking about every earlier one: a run named like a
    later run of the thread but not of it still stops the thread, as a run named like its
    next run does. (A new run cannot take such a name while run t exists: this one took it
    before t was started.)"""
    store = MemoryStore()
    model, tools = ScriptedModel(turns=[say("a"), say("b"), say("c")]), LedgerTools()
    await treadle.run(agent(model, tools), "plain", store=store, run_id="t.4")
    await treadle.run(agent(model, tools), "one", store=store, run_id="t")
    await treadle.run(agent(model, tools), "two", store=store, thread_id="t")
    with pytest.raises(UsageError, match=r"run 't\.4' exists but is not a run of thread 't'"):
        await treadle.run(agent(model, tools), "three", store=store, thread_id="t")
    assert sorted(await store.list_runs()) == ["t", "t.2", "t.4"]


FORK_TURNS = [TURNS[0], call("add", a=3, b=4, call_id="c2"), say("7")]
"""A model trying step 2 of a run of `TURNS` again: it calls add(3, 4), then answers."""


async def test_a_fork_named_by_its_run_id_is_retried_by_the_same_call() -> None:
    """docs/threads.md, "Crashes and resume": the same fork call again resumes the fork only
    when it named its run (decision 0109); without run_id each call is a new fork."""
    memory = MemoryStore()
    tools = LedgerTools()
    await treadle.run(agent(ScriptedModel(turns=TURNS), tools), "add", store=memory, run_id="r")
    model = ScriptedModel(turns=FORK_TURNS)

    async def fork(store: RunStore, run_id: str | None) -> treadle.RunResult:
        return await treadle.run(
            agent(model, tools), "now 3 and 4", store=store, run_id=run_id, fork_of="r", at_step=2
        )

    # the fork dies after its action ran, before its result is written (its 5th write):
    # run-started, model intent, model result, action intent, then the lost action result
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await fork(CrashingStore(inner=memory, crash_at=5, when="before"), "r-try")
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    again = await fork(memory, "r-try")
    assert (again.run_id, again.state) == ("r-try", RunState.SUCCEEDED)
    assert len(tools.executed) == 2  # the add of the crashed drive was not run again
    assert sorted(await memory.list_runs()) == ["r", "r-try"]
    # without run_id, the same call is a new fork each time: two calls, two forks
    first, second = await fork(memory, None), await fork(memory, None)
    assert first.run_id != second.run_id
    assert len(await memory.list_runs()) == 4


async def test_a_finished_named_fork_is_retried_without_the_run_it_forks() -> None:
    """docs/threads.md, "Forks": the same call again returns a finished fork's result, as a
    thread's named retry does. It read the forked run first, and once that log was gone it
    said "cannot fork run 'r': no such run in the store"."""
    memory = MemoryStore()
    logs = memory._logs
    model, tools = ScriptedModel(turns=FORK_TURNS), LedgerTools()
    await treadle.run(agent(ScriptedModel(turns=TURNS), tools), "add", store=memory, run_id="r")
    fork = await treadle.run(agent(model, tools), store=memory, run_id="f", fork_of="r", at_step=2)
    calls, forked = len(model.requests), logs.pop("r")
    again = await treadle.run(agent(model, tools), store=memory, run_id="f", fork_of="r", at_step=2)
    assert again == fork and len(model.requests) == calls
    with pytest.raises(
        UsageError, match="'f' exists as fork of r at step 2, not as the fork of r at step 1"
    ):
        await treadle.run(agent(model, tools), store=memory, run_id="f", fork_of="r", at_step=1)
    with pytest.raises(UsageError, match="cannot fork run 'r': no such run"):  # a new fork
        await treadle.run(agent(model, tools), store=memory, run_id="g", fork_of="r", at_step=2)
    logs["r"] = forked
    assert sorted(await memory.list_runs()) == ["f", "r"]


async def test_a_new_run_cannot_take_the_name_of_a_threads_run() -> None:
    # A fork (or a plain run) named r.2 was accepted, and thread r could then never go on:
    # "run 'r.2' exists but is not a run of thread 'r'".
    store = MemoryStore()
    model, tools = ScriptedModel(turns=[say("a"), say("b"), say("c")]), LedgerTools()
    await treadle.run(agent(model, tools), "hi", store=store, run_id="r")
    taken = "is the name of run {} of thread 'r'"
    with pytest.raises(UsageError, match=taken.format(2)):
        await treadle.run(agent(model, tools), store=store, run_id="r.2", fork_of="r", at_step=1)
    with pytest.raises(UsageError, match=taken.format(17)):
        await treadle.run(agent(model, tools), "x", store=store, run_id="r.17")
    assert sorted(await store.list_runs()) == ["r"]
    second = await treadle.run(agent(model, tools), "next", store=store, thread_id="r")
    assert second.run_id == "r.2"
    again = await treadle.run(agent(model, tools), store=store, run_id="r.2")  # resumed by id
    assert again == second
    # names of no thread's run: a run of a thread starts none, nor does a number below 2 or
    # one with a leading zero, nor a run that does not exist
    for run_id in ("r.2.2", "r.1", "r.02", "s.2"):
        await treadle.run(agent(model, tools), "x", store=store, run_id=run_id)
    await treadle.run(agent(model, tools), store=store, run_id="r.2.3", fork_of="r.2", at_step=1)
    third = await treadle.run(agent(model, tools), "more", store=store, thread_id="r")
    assert third.run_id == "r.3"


async def test_a_fork_of_a_run_without_steps_says_it_has_none() -> None:
    memory = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    with pytest.raises((RunInterrupted, SimulatedCrash)):  # dies with its run-started only
        await treadle.run(
            agent(model, tools),
            "add",
            store=CrashingStore(inner=memory, crash_at=2, when="before"),
            run_id="z",
        )
    for at_step in (0, 1):
        with pytest.raises(UsageError) as refused:
            await treadle.run(agent(model, tools), store=memory, fork_of="z", at_step=at_step)
        assert str(refused.value) == (
            f"cannot fork run 'z' at step {at_step}: it has no completed step yet"
        )
    assert await memory.list_runs() == ("z",)


class _RaceLost(InterceptingStore):
    """Before this caller takes the lease of ``run_id``, another caller drives ``other``."""

    def __init__(self, inner: RunStore, run_id: str, other: Callable[[], Awaitable[object]]):
        super().__init__(inner)
        self.run_id, self.other = run_id, other

    async def acquire_lease(self, run_id: str, *, owner: str, ttl_s: float) -> Lease:
        if run_id == self.run_id:
            await self.other()
        assert isinstance(self.inner, treadle.ports.LeaseStore)
        return await self.inner.acquire_lease(run_id, owner=owner, ttl_s=ttl_s)


async def test_a_caller_losing_a_thread_race_is_told_the_thread_moved_on() -> None:
    """Both callers name run t.2; the other one starts it first, with its own message."""
    memory = MemoryStore()
    model, tools = ScriptedModel(turns=TURNS), LedgerTools()
    await treadle.run(agent(model, tools), "add", store=memory, run_id="t")

    async def winner() -> None:
        await treadle.run(agent(model, tools), "now 3 and 4", store=memory, thread_id="t")

    racing = _RaceLost(memory, "t.2", winner)
    with pytest.raises(UsageError) as lost:
        await treadle.run(agent(model, tools), "something else", store=racing, thread_id="t")
    assert str(lost.value) == (
        "thread 't' moved on: its run 't.2' was started by another caller with another "
        "message; call again to continue the thread after it"
    )
    # as it says: the same call again continues the thread after t.2
    later = await treadle.run(agent(model, tools), "something else", store=memory, thread_id="t")
    assert later.run_id == "t.3"
    started = (await memory.read_log("t.3")).started
    assert (started.continues, [m.content for m in started.input]) == ("t.2", ["something else"])


async def test_a_thread_with_a_long_id_goes_on_to_the_last_valid_run_id() -> None:
    """Finding the latest run asked about ids beyond the thread's end, and an id too long to be
    a run id stopped the thread while its next run's id was still valid: a thread with a
    198-character id stopped at its 9th message. Such an id names no run; the thread goes on
    up to ``.9`` and its 10th message is refused because ``.10`` is too long, writing nothing
    (docs/decisions/0055-thread-ids.md, "Consequences")."""
    store = MemoryStore()
    thread = "t" * 198
    model = ScriptedModel(turns=[say(f"answer {n}") for n in range(1, 12)])
    definition = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    await treadle.run(definition, "first", store=store, run_id=thread)
    for n in range(2, 10):
        result = await treadle.run(definition, f"message {n}", store=store, thread_id=thread)
        assert result.run_id == f"{thread}.{n}"
    with pytest.raises(InvalidRunId, match="longer than 200 characters"):
        await treadle.run(definition, "message 10", store=store, thread_id=thread)
    assert len(await store.list_runs()) == 9


class _DamagedLogs(MemoryStore):
    """A memory store whose logs of the runs in ``damaged`` cannot be decoded."""

    def __init__(self) -> None:
        super().__init__()
        self.damaged: set[str] = set()

    async def read_log(self, run_id: str) -> RunLog:
        if run_id in self.damaged:
            raise LogCorrupted("record 2 fails its checksum", where=f"memory {run_id}", offset=2)
        return await super().read_log(run_id)


@pytest.mark.parametrize(
    ("damaged", "whose"),
    [
        ("t", r"run 't\.2' continues run 't'"),  # the thread's first run
        ("t.3", r"run 't\.4' continues run 't\.3'"),  # its latest
        ("t.2", r"run 't\.3' continues run 't\.2'"),  # one in between
    ],
)
async def test_a_damaged_run_of_a_thread_is_named_with_the_run_continuing_it(
    damaged: str, whose: str
) -> None:
    """The thread's first and latest runs were read apart from the chain's reading: their
    damage came out as a bare LogCorrupted, without the run that continues them. Every run a
    new thread run or fork inherits from is read one way (docs/threads.md, "When a thread
    cannot go on"), and nothing is written."""
    store = _DamagedLogs()
    model = ScriptedModel(turns=[say(f"answer {n}") for n in range(1, 6)])
    definition = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    await treadle.run(definition, "first", store=store, run_id="t")
    for n in (2, 3):
        await treadle.run(definition, f"message {n}", store=store, thread_id="t")
    store.damaged.add(damaged)
    why = f"{whose}, whose log cannot be read: memory {damaged}: record 2 fails its checksum"
    with pytest.raises(StoreError, match=why) as raised:
        await treadle.run(definition, "message 4", store=store, thread_id="t")
    assert isinstance(raised.value.__cause__, LogCorrupted)
    with pytest.raises(StoreError, match=rf"run 'f' continues run '{damaged}', whose log"):
        await treadle.run(definition, store=store, run_id="f", fork_of=damaged, at_step=1)
    assert sorted(await store.list_runs()) == ["t", "t.2", "t.3"]


async def test_the_history_of_a_damaged_run_names_it_in_a_whole_sentence() -> None:
    """Asked for by itself, a run whose own log cannot be read was named in half a sentence
    ("run 't.2', whose log cannot be read: ...")."""
    store = _DamagedLogs()
    model = ScriptedModel(turns=[say("answer 1"), say("answer 2")])
    definition = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    await treadle.run(definition, "first", store=store, run_id="t")
    await treadle.run(definition, "second", store=store, thread_id="t")
    store.damaged.add("t.2")
    with pytest.raises(StoreError, match=r"^the log of run 't\.2' cannot be read: memory t\.2"):
        await treadle.history(store, "t.2")


async def test_a_thread_whose_first_run_is_missing_says_so_and_writes_nothing() -> None:
    """A thread whose first run's log was removed was called a thread that "does not exist",
    though its later runs are stored; its history's error said "nothing was written", which
    no reading writes. Both name the run that continues the missing one."""
    store = _MissingRuns()
    model = ScriptedModel(turns=[say(f"answer {n}") for n in range(1, 4)])
    definition = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    await treadle.run(definition, "first", store=store, run_id="t")
    await treadle.run(definition, "second", store=store, thread_id="t")
    store.missing.add("t")
    why = r"^run 't\.2' continues run 't', whose log is missing$"
    with pytest.raises(StoreError, match=why):
        await treadle.run(definition, "third", store=store, thread_id="t")
    with pytest.raises(StoreError, match=why):
        await treadle.history(store, "t.2")
    assert (await store.read_log("t.3")).records == ()


class _MissingRuns(MemoryStore):
    """A memory store in which the runs in ``missing`` are gone (their logs and index rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: set[str] = set()

    async def read_log(self, run_id: str) -> RunLog:
        if run_id in self.missing:
            return RunLog(run_id=run_id)
        return await super().read_log(run_id)

    async def read_summary(self, run_id: str) -> treadle.RunSummary | None:
        return None if run_id in self.missing else await super().read_summary(run_id)


async def test_a_run_missing_from_the_middle_of_a_thread_is_not_named_again() -> None:
    """With a run's log removed from the middle of a thread, the lookup of the latest run could
    stop at the gap: the new message became a new run under the missing run's id, and every
    later run, which continues that id, inherited it. The lookup looks past the end it found,
    so continuing the thread is refused naming the missing run, and nothing is written
    (docs/threads.md, "When a thread cannot go on"), wherever a single run is missing."""
    store = _MissingRuns()
    runs = 20
    model = ScriptedModel(turns=[say(f"answer {n}") for n in range(1, runs + 1)])
    definition = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    await treadle.run(definition, "first", store=store, run_id="t")
    for n in range(2, runs + 1):
        await treadle.run(definition, f"message {n}", store=store, thread_id="t")
    gaps = [{f"t.{n}"} for n in range(2, runs)] + [{"t.5", "t.6"}, {"t.9", "t.10", "t.11"}]
    for gap in gaps:
        store.missing = gap
        last = max(gap, key=lambda run_id: int(run_id.split(".")[1]))  # the one continued
        with pytest.raises(StoreError, match=rf"continues run '{last}', whose log is missing"):
            await treadle.run(definition, "one more", store=store, thread_id="t")
    store.missing = set()
    assert len(await store.list_runs()) == runs
    result = await treadle.run(definition, "one more", store=store, thread_id="t")
    assert result.run_id == f"t.{runs + 1}"
