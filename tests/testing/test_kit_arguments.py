"""The test kits refuse a wrong argument when made, naming it, instead of misbehaving later.

A string given for the fault kinds was read letter by letter, a misspelt crash side acted as
``after``, ``crash_at=0`` never crashed, a lone reply or text given as a script interrupted
the run with a TypeError, and failures keyed by a string were ignored. A simulation started
inside a trio run failed with trio's own error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from treadle import MemoryStore, Toolbox, UsageError
from treadle.testing import CrashingExecutor, CrashingStore, FailingStore, ScriptedModel, say
from treadle.testing.crashdriver import KillingStore
from treadle.testing.simulation import FaultPlan, run_seeds, simulate
from treadle.types import ModelErrorInfo

_RATE_LIMITED = ModelErrorInfo(kind="rate_limited", message="slow down")

MISUSES: list[tuple[str, Callable[[], object], str]] = [
    ("kinds as a string", lambda: FaultPlan.of("crash"), r"not the string 'crash'"),
    (
        "rates by kind",
        lambda: FaultPlan.of({"crash": 0.9, "cancel": 0.5}),
        r"FaultPlan.of: kinds must be a collection of fault kinds, not the mapping .*'crash': "
        r"0.9.* \(rates by kind are FaultPlan\(rates=\{'crash': 0.9, 'cancel': 0.5\}\)\)",
    ),
    ("plan as a string", lambda: simulate(0, plan="crash"), r"plan must be a FaultPlan"),  # type: ignore[arg-type]
    ("one seed for seeds", lambda: run_seeds(5), r"seeds must be an iterable"),  # type: ignore[arg-type]
    (
        "no scenario",
        lambda: simulate(0, scenario=object()),  # type: ignore[arg-type]
        r"scenario must be a Scenario .* has no method world, agent, input, check",
    ),
    (
        "misspelt crash side",
        lambda: CrashingStore(inner=MemoryStore(), crash_at=1, when="befor"),  # type: ignore[arg-type]
        r"when must be 'before' or 'after', not 'befor'",
    ),
    (
        "crash at write 0",
        lambda: CrashingStore(inner=MemoryStore(), crash_at=0),
        r"crash_at must be a whole number of 1 or more",
    ),
    (
        "fail at write 0",
        lambda: FailingStore(inner=MemoryStore(), fail_at=0),
        r"fail_at must be a whole number",
    ),
    (
        "misspelt failure side",
        lambda: FailingStore(inner=MemoryStore(), fail_at=1, when="afterwards"),  # type: ignore[arg-type]
        r"when must be",
    ),
    (
        "crash in action 0",
        lambda: CrashingExecutor(inner=Toolbox([]), crash_at=0),
        r"crash_at must be a whole number",
    ),
    ("kill at write -1", lambda: KillingStore(MemoryStore(), kill_at=-1), r"kill_at must be"),
    ("a lone reply", lambda: ScriptedModel(turns=say("hi")), r"turns must be a sequence"),  # type: ignore[arg-type]
    ("text for a turn", lambda: ScriptedModel(turns=["hi"]), r"turns\[0\] must be a ModelReply"),  # type: ignore[list-item]
    (
        "failures keyed by text",
        lambda: ScriptedModel(turns=[say("hi")], failures={"0": [_RATE_LIMITED]}),  # type: ignore[dict-item]
        r"keyed by turn index \(an int\), not '0'",
    ),
    (
        "a lone failure",
        lambda: ScriptedModel(turns=[say("hi")], failures={0: _RATE_LIMITED}),  # type: ignore[dict-item]
        r"failures\[0\] must be a sequence of ModelErrorInfo",
    ),
]


@pytest.mark.parametrize(("make", "message"), [m[1:] for m in MISUSES], ids=[m[0] for m in MISUSES])
def test_a_kit_refuses_a_wrong_argument_when_made(make: Callable[[], object], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        make()


def test_the_kits_take_their_documented_arguments() -> None:
    FaultPlan.of(["crash"])
    assert set(FaultPlan.of(k for k in ("crash", "cancel")).rates) == {"crash", "cancel"}
    CrashingStore(inner=MemoryStore(), crash_at=3, when="after")
    KillingStore(MemoryStore())  # kill_at None: never
    ScriptedModel(turns=(say("a"), say("b")), failures={1: (_RATE_LIMITED,)})
    assert run_seeds([]) == []


@pytest.mark.parametrize(
    "start", [lambda: simulate(0), lambda: run_seeds([0])], ids=["simulate", "run_seeds"]
)
async def test_a_simulation_started_inside_a_trio_run_says_to_call_it_from_plain_code(
    start: Callable[[], object],
) -> None:
    """Not trio's own "Attempted to call run() from inside a run()"."""
    with pytest.raises(UsageError, match=r"called inside a trio run .* no async form.* plain"):
        start()
