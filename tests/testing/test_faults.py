"""The fault injectors keep what they wrap: a crashing executor is the same executor until it dies."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from tests.fixtures.log_only_store import LogOnlyStore

import treadle
from treadle import NativeToolCallParser, RunState
from treadle.approvals import requires_approval
from treadle.policies import policies_of
from treadle.ports import ControlStream, LeaseStore, RunCounts, RunIndex, RunQueue, RunStore
from treadle.stores import MemoryStore
from treadle.testing import InterceptingStore, check_crash_recovery, say
from treadle.testing.faults import CrashingExecutor, CrashingStore, FailingStore
from treadle.testing.scripted import ScriptedModel
from treadle.types import Record


@treadle.tool(requires_approval=True, secret_arguments=["api_key"], timeout_s=7)
async def charge(amount: int, api_key: str) -> str:
    """Charge ``amount`` with the given key."""
    return "charged"


@treadle.tool
async def look(query: str) -> str:
    """Look something up."""
    return "found"


def agent(executor) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[]), executor=executor, parser=treadle.NativeToolCallParser()
    )


def test_a_crashing_executor_keeps_the_wrapped_tools_policies():
    tools = treadle.Toolbox([charge, look])
    wrapped = CrashingExecutor(inner=tools, crash_at=1)
    assert agent(wrapped).snapshot() == agent(tools).snapshot()  # secrets included
    assert requires_approval(policies_of(wrapped), None, "charge", {"amount": 1, "api_key": "k"})
    assert not requires_approval(policies_of(wrapped), None, "look", {"query": "q"})
    assert wrapped.timeout_s("charge") == tools.timeout_s("charge") == 7
    assert wrapped.secret_arguments("charge") == frozenset({"api_key"})
    policies = policies_of(wrapped)  # what a run of the wrapped executor asks
    assert policies.declared == policies_of(tools).declared
    assert policies.timeout_s("charge") == 7 and policies.image_source is not None


def test_a_crashing_executor_has_only_the_policies_its_inner_executor_has():
    class Bare:
        def tool_specs(self):
            return ()

        def replay_policy(self, tool):
            return treadle.ReplayPolicy.NEVER

        async def execute(self, action): ...

        async def reconcile(self, action):
            return None

    wrapped = CrashingExecutor(inner=Bare(), crash_at=1)
    assert getattr(wrapped, "timeout_s", None) is None
    assert policies_of(wrapped).declared == frozenset()  # every default
    with pytest.raises(AttributeError, match="no attribute 'anything'"):
        wrapped.anything  # noqa: B018


# ---------------------------------------------------------------- store wrappers


def _wrappers(inner: RunStore) -> list[RunStore]:
    return [
        InterceptingStore(inner),
        CrashingStore(inner=inner, crash_at=10**9),
        FailingStore(inner=inner, fail_at=10**9),
    ]


CAPABILITIES = [LeaseStore, ControlStream, RunIndex, RunCounts, RunQueue]


@pytest.mark.parametrize("inner", [LogOnlyStore, MemoryStore], ids=lambda c: c.__name__)
def test_a_store_wrapper_has_exactly_the_capabilities_of_its_inner_store(inner) -> None:
    # A wrapper had every capability: one around a store without leases made its run take a
    # lease and fail "TypeError: ... is no LeaseStore"; one around SQLite did not count runs.
    store = inner()
    for wrapper in _wrappers(store):
        has = [isinstance(wrapper, capability) for capability in CAPABILITIES]
        assert has == [isinstance(store, capability) for capability in CAPABILITIES]
        assert type(wrapper).__name__ in {"InterceptingStore", "CrashingStore", "FailingStore"}


async def test_a_run_on_a_wrapped_store_without_leases_takes_no_lease() -> None:
    store = LogOnlyStore()
    model = ScriptedModel(turns=[say("hi")])
    for n, wrapper in enumerate(_wrappers(store)):
        result = await treadle.run(
            treadle.Agent(model=model, executor=treadle.Toolbox([]), parser=NativeToolCallParser()),
            "go",
            store=wrapper,
            run_id=f"wrapped-{n}",
        )
        assert result.state is RunState.SUCCEEDED
        assert (await store.read_log(f"wrapped-{n}")).finished is not None


async def test_crash_recovery_holds_a_store_without_leases(tmp_path) -> None:
    logs: dict[str, list[Record]] = {}

    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = LogOnlyStore(logs)
        try:
            yield store
        finally:
            await store.aclose()

    report = await check_crash_recovery(open_store, workdir=tmp_path)
    assert report.crashes > 0
