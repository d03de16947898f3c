"""A model with a real context window, for tests of the context budget (docs/context.md).

`WindowedModel` behaves as a provider does: it counts each request's tokens its own way
(characters / 4, not the library's estimate), refuses a request over its window with the
OpenAI-compatible context-length error, and reports the input tokens it counted. It plays a
counting task: each step reads the newest ``n=K`` a tool returned and calls ``fetch(n=K+1)``,
until ``n`` reaches ``goal``; a summary request (its system prompt is the summariser's) is
answered with a summary that cites the newest fact it was shown.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import attrs

from treadle._budget import DEFAULT_SUMMARY_PROMPT
from treadle._exceptions import ModelCallError
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.ports import DeltaCallback, ModelClient
from treadle.testing.invariants import check_context
from treadle.testing.simulation import FaultPlan
from treadle.tools import Toolbox, tool
from treadle.types import (
    ActionResult,
    Attempt,
    Budgets,
    Limits,
    Message,
    ModelErrorInfo,
    ModelReply,
    ModelRequest,
    RunFinished,
    RunLog,
    StopReason,
    ToolCall,
    ToolSpec,
    Usage,
)

_FACT = re.compile(r"n=(\d+)")


def provider_tokens(request: ModelRequest) -> int:
    """The request's size as this provider counts it: characters / 4, 4 per message."""
    chars = sum(_chars(m) for m in request.messages) + sum(_spec_chars(t) for t in request.tools)
    return chars // 4 + 4 * len(request.messages)


def _chars(message: Message) -> int:
    calls = sum(len(c.name) + len(json.dumps(c.arguments)) + len(c.id) for c in message.tool_calls)
    return len(message.content or "") + calls


def _spec_chars(spec: ToolSpec) -> int:
    return len(spec.name) + len(spec.description) + len(json.dumps(spec.parameters))


@attrs.define(eq=False)
class WindowedModel:
    """A `treadle.ports.ModelClient` with a context window of ``window`` tokens.

    Attributes:
        window: tokens a request and its output cap may take together.
        goal: the ``n`` at which the task is done (a final answer).
        sizes: every request's size as counted here, in order (summaries included).
        summaries: summary requests answered.
        refused: requests refused for their length.
        failures: per call (in order), an error to raise instead of answering, or ``None``.
        requests: every request received, in order.
    """

    window: int
    goal: int
    sizes: list[int] = attrs.Factory(list)
    summaries: int = 0
    refused: int = 0
    failures: list[ModelErrorInfo | None] = attrs.Factory(list)
    requests: list[ModelRequest] = attrs.Factory(list)

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        """Answer one request (see the module docstring).

        The usage of an answer is reported to ``attempt.report_usage`` before it is returned.

        Raises:
            ModelCallError: a scripted failure, ``context_length_exceeded`` for a request over
                the window, or the error ``attempt.report_usage`` raised.
        """
        self.requests.append(request)
        if self.failures:
            failure = self.failures.pop(0)
            if failure is not None:
                raise ModelCallError(failure, usage=Usage())
        size = provider_tokens(request)
        self.sizes.append(size)
        if size + (request.max_output_tokens or 0) > self.window:
            self.refused += 1
            raise ModelCallError(
                ModelErrorInfo(
                    kind="context_length_exceeded",
                    message=f"maximum context length is {self.window} tokens, got {size}",
                    status=400,
                ),
                usage=Usage(),
            )
        usage = Usage(input_tokens=size, output_tokens=8)
        attempt.report_usage(usage)
        if _is_summary(request):
            self.summaries += 1
            newest = _newest(request)
            text = f"Goal: count to {self.goal}. Facts: n={newest} (step {newest})."
            return ModelReply(text=text, finish_reason="stop", usage=usage)
        newest = _newest(request)
        if newest >= self.goal:
            return ModelReply(text=f"done at n={newest}", finish_reason="stop", usage=usage)
        call = ToolCall(id=f"c{newest + 1}", name="fetch", arguments={"n": newest + 1})
        return ModelReply(tool_calls=(call,), finish_reason="tool_calls", usage=usage)


def _is_summary(request: ModelRequest) -> bool:
    first = request.messages[0] if request.messages else None
    return first is not None and first.role == "system" and first.content == DEFAULT_SUMMARY_PROMPT


def _newest(request: ModelRequest) -> int:
    """The largest ``n=K`` in the request (the newest fact), 0 for none."""
    found = [int(k) for m in request.messages for k in _FACT.findall(m.content or "")]
    return max(found, default=0)


def fetch_toolbox(payload_chars: int) -> Toolbox:
    """A toolbox with ``fetch(n)``, whose result is ``n=<n>`` and ``payload_chars`` of data."""

    @tool
    async def fetch(n: int) -> str:
        """Fetch record ``n``.

        Args:
            n: the record number.
        """
        return f"n={n} " + "data " * (payload_chars // 5)

    return Toolbox([fetch])


def windowed_agent(
    model: ModelClient,
    *,
    window: int | None,
    payload_chars: int = 400,
    max_output_tokens: int = 64,
    summariser: ModelClient | None = None,
    token_counter: Callable[..., int] | None = None,
    budgets: Budgets | None = None,
) -> Agent:
    """An agent on ``model`` with the fetch toolbox and ``context_window=window``."""
    return Agent(
        model=model,
        executor=fetch_toolbox(payload_chars),
        parser=NativeToolCallParser(),
        model_name="windowed",
        system_prompt="Count with fetch until you reach the goal.",
        max_output_tokens=max_output_tokens,
        context_window=window,
        summariser=summariser,
        token_counter=token_counter,
        budgets=budgets or Budgets(max_steps=200, max_model_attempts=1_000),
        limits=Limits(retry_initial_s=0.001, retry_max_s=0.001),
    )


@attrs.define(eq=False)
class _World:
    provider: WindowedModel
    declared: int


@attrs.frozen(kw_only=True)
class ContextScenario:
    """A simulation scenario that compacts (docs/simulation.md; `FaultPlan.compaction`).

    A counting task of ``goal`` steps whose history outgrows ``window`` several times. With
    ``model_context_length`` on, the provider's real window is smaller than the one the
    agent declares, so the provider refuses some requests; with ``model_5xx`` on, some calls
    (summaries included) fail once and are retried.
    """

    goal: int = 24
    window: int = 1400

    def world(self, rng: random.Random, plan: FaultPlan, counts: dict[str, int]) -> Any:
        """A windowed provider, perhaps with a smaller window than declared, and its faults."""
        real = self.window
        if plan.roll(rng, "model_context_length"):
            counts["model_context_length"] = counts.get("model_context_length", 0) + 1
            real = self.window * 3 // 4
        failures: list[ModelErrorInfo | None] = []
        for _ in range(self.goal * 2):
            if plan.roll(rng, "model_5xx"):
                counts["model_5xx"] = counts.get("model_5xx", 0) + 1
                failures.append(ModelErrorInfo(kind="server_error", retryable=True, status=503))
            else:
                failures.append(None)
        provider = WindowedModel(window=real, goal=self.goal, failures=failures)
        return _World(provider=provider, declared=self.window)

    def agent(self, world: Any) -> Agent:
        """The counting agent declaring the scenario's window."""
        return windowed_agent(world.provider, window=world.declared, payload_chars=300)

    def input(self, world: Any) -> str:
        """A fixed instruction."""
        return f"count to {self.goal}"

    def check(self, log: RunLog, world: Any) -> list[str]:
        """A finished run counted to the goal; every request the budget built fits."""
        problems = check_context(log)
        last = log.records[-1] if log.records else None
        answered = isinstance(last, RunFinished) and last.stop_reason is StopReason.FINAL_ANSWER
        if answered and isinstance(last, RunFinished) and last.final_answer != self.answer:
            problems.append(f"{log.run_id}: ended with {last.final_answer!r}")
        return problems

    @property
    def answer(self) -> str:
        """The final answer of a run that reached the goal."""
        return f"done at n={self.goal}"

    def changed_observation(self, result: ActionResult) -> bool:
        """``fetch`` is deterministic: no outcome is established after a crash."""
        return False
