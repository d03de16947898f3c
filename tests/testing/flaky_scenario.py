"""A scenario whose check fails whenever a crash left an abandoned model call (for CLI tests)."""

from __future__ import annotations

import attrs

from treadle import Agent, NativeToolCallParser, Toolbox
from treadle.testing import ScriptedModel, say
from treadle.testing.simulation import LedgerScenario
from treadle.types import ModelResult


@attrs.frozen(kw_only=True)
class AbandonedIsABug(LedgerScenario):
    """The ledger scenario, with one more (deliberately wrong) invariant."""

    def check(self, log, world):
        problems = super().check(log, world)
        if any(isinstance(r, ModelResult) and r.abandoned for r in log.records):
            problems.append(f"{log.run_id}: a model call was abandoned")
        return problems


def scenario() -> AbandonedIsABug:
    return AbandonedIsABug(steps=6)


def agent_factory() -> Agent:
    """Not a scenario: what `treadle resume --agent` takes."""
    return Agent(
        model=ScriptedModel(turns=[say("hi")]), executor=Toolbox([]), parser=NativeToolCallParser()
    )


@attrs.frozen(kw_only=True)
class CheckRaises(LedgerScenario):
    """A scenario whose own check raises (a bug of its author's)."""

    def check(self, log, world):
        raise KeyError("check broke")


def check_raises() -> CheckRaises:
    return CheckRaises(steps=3)
