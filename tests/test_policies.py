"""What the library asks an executor is looked up once (`policies_of`), and seams say it all."""

from __future__ import annotations

import re

import pytest

import treadle
from treadle.policies import NO_POLICIES, POLICY_METHODS, policies_of
from treadle.testing.scripted import ScriptedModel, say
from treadle.types import Attempt, ImageRef


class Bare:
    """An executor with the four `ActionExecutor` methods only."""

    def tool_specs(self):
        return ()

    def replay_policy(self, tool):
        return treadle.ReplayPolicy.NEVER

    async def execute(self, action): ...

    async def reconcile(self, action):
        return None


class Partial(Bare):
    """Declares two policies; an answer may be any collection of names."""

    def secret_arguments(self, tool):
        return ["token", "token"]

    def timeout_s(self, tool):
        return 4.0


def test_an_executor_without_policies_gets_every_default():
    policies = policies_of(Bare())
    assert policies is NO_POLICIES and policies.declared == frozenset()
    assert policies.requires_approval("any") is False
    assert policies.secret_arguments("any") == frozenset()
    assert policies.invalid_arguments("any", {"a": 1}) is None
    assert policies.timeout_s("any") is None  # the tool executor applies its limit
    assert policies.writes("any") is None
    assert policies.image_source is None


def test_declared_policies_are_the_executors_own_and_the_rest_default():
    policies = policies_of(Partial())
    assert policies.declared == {"secret_arguments", "timeout_s"}
    assert policies.secret_arguments("send") == frozenset({"token"})
    assert policies.timeout_s("send") == 4.0
    assert policies.requires_approval("send") is False


def test_a_policy_that_is_not_a_method_is_refused():
    executor = Bare()
    executor.writes = "doc:{name}"  # type: ignore[attr-defined]
    with pytest.raises(treadle.UsageError, match=re.escape("writes is 'doc:{name}', not a")):
        policies_of(executor)


def test_an_agent_looks_its_executors_policies_up_once():
    tools = treadle.Toolbox([])
    agent = treadle.Agent(
        model=ScriptedModel(turns=[]), executor=tools, parser=treadle.NativeToolCallParser()
    )
    assert agent.tool_policies is agent.tool_policies
    assert agent.tool_policies.declared == set(POLICY_METHODS)
    with pytest.raises(KeyError):  # a toolbox keeps no images: the client's own source does
        agent.tool_policies.image_source(ImageRef(url="ref:x"))  # type: ignore[misc]


class OldClient:
    """A model client written before the seam passed ``attempt``."""

    async def complete(self, request, *, on_delta=None):
        return say("hi")


class ForwardingClient:
    """Takes whatever keywords the seam passes and hands them on."""

    def __init__(self):
        self.attempts = []

    async def complete(self, request, **options):
        self.attempts.append(options["attempt"])
        return await ScriptedModel(turns=[say("hi")]).complete(request, **options)


@pytest.mark.parametrize("role", ["model", "summariser"])
def test_an_agent_refuses_a_model_client_that_cannot_take_the_attempt(role):
    clients = {"model": ScriptedModel(turns=[]), role: OldClient()}
    with pytest.raises(treadle.UsageError, match=f"the {role}'s complete\\(\\) takes no attempt"):
        treadle.Agent(
            executor=treadle.Toolbox([]), parser=treadle.NativeToolCallParser(), **clients
        )


async def test_a_client_taking_keyword_options_gets_the_attempt_through_them():
    client = ForwardingClient()
    agent = treadle.Agent(
        model=client, executor=treadle.Toolbox([]), parser=treadle.NativeToolCallParser()
    )
    result = await treadle.run(agent, "x", store=treadle.MemoryStore())
    assert result.final_answer == "hi"
    [attempt] = client.attempts
    assert isinstance(attempt, Attempt) and attempt is not Attempt.STANDALONE


class OneSecretAsStr(Bare):
    """Answers one secret name as a bare str, not a collection of names."""

    def secret_arguments(self, tool):
        return "card_number"


@pytest.mark.parametrize("answer", ["card_number", b"card_number", 7, ["card_number", 1]])
def test_a_secret_arguments_answer_that_is_no_collection_of_names_is_refused(answer):
    executor = Bare()
    executor.secret_arguments = lambda tool: answer  # type: ignore[attr-defined]
    policies = policies_of(executor)
    with pytest.raises(treadle.SeamViolation, match="secret_arguments\\('charge'\\) returned"):
        policies.secret_arguments("charge")


async def test_a_run_refuses_secret_names_given_as_a_bare_str_and_never_splits_them():
    @treadle.tool
    async def charge(card_number: str) -> str:
        """Charge a card."""
        return "charged"

    class Executor(OneSecretAsStr):
        def tool_specs(self):
            return treadle.Toolbox([charge]).tool_specs()

    store = treadle.MemoryStore()
    agent = treadle.Agent(
        model=ScriptedModel(turns=[say("unused")]),
        executor=Executor(),
        parser=treadle.NativeToolCallParser(),
    )
    with pytest.raises(treadle.RunInterrupted) as caught:
        await treadle.run(agent, "go", store=store, run_id="secret-str")
    assert isinstance(caught.value.__cause__, treadle.SeamViolation)
    assert "returned 'card_number'" in str(caught.value.__cause__)
    assert (await store.read_log("secret-str")).records == ()  # nothing written with 'c', 'a'...
