"""The fault injectors keep what they wrap: a crashing executor is the same executor until it dies."""

from __future__ import annotations

import pytest

import treadle
from treadle.approvals import requires_approval
from treadle.policies import policies_of
from treadle.testing.faults import CrashingExecutor
from treadle.testing.scripted import ScriptedModel


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
