"""Deterministic simulation of runs under a seeded fault plan, with invariant checks.

`simulate(seed)` runs one or more scripted runs on trio's virtual clock (``MockClock`` with
autojump), drives them through the real actors and a memory store, injects the faults of a
`FaultPlan` chosen from the seed (process crashes before or after store writes, store write
failures, model errors, tool exceptions, timeouts, ENV_ERROR, cancellation, approval decisions
at random delays, latency between the coordinator and the actors, runs that continue a
thread), resumes every crashed run
from its log as a restarted process would, and checks the invariants of docs/crash-safety.md on what
was written (`check_invariants`, from `treadle.testing.invariants`). The same seed gives a
byte-identical log: ids and timestamps come from an injected clock and the run's seeded random
source, and trio's own scheduling randomness is seeded too.

Actors are swapped through `treadle.Actors`: `with_latency` wraps any actor's factory so that
its requests arrive after a seeded delay on the virtual clock.

The code lives in private modules by responsibility: `_sim_faults` (the plan and its
injectors), `_sim_scenario` (the protocol), `_sim_ledger` (the built-in scenario),
`_sim_checks` (what is checked after the runs) and `_sim_run` (the drivers).
"""

from __future__ import annotations

from treadle.testing._sim_checks import check_child_runs as check_child_runs
from treadle.testing._sim_checks import log_digest as log_digest
from treadle.testing._sim_faults import LATENCY_MAX_S as LATENCY_MAX_S
from treadle.testing._sim_faults import ApprovalPlan as ApprovalPlan
from treadle.testing._sim_faults import DelayedActor as DelayedActor
from treadle.testing._sim_faults import FaultPlan as FaultPlan
from treadle.testing._sim_faults import with_latency as with_latency
from treadle.testing._sim_ledger import APPROVAL_TIMEOUT_S as APPROVAL_TIMEOUT_S
from treadle.testing._sim_ledger import CHILD_ANSWER as CHILD_ANSWER
from treadle.testing._sim_ledger import CONTROL_POLL_S as CONTROL_POLL_S
from treadle.testing._sim_ledger import RECONCILED as RECONCILED
from treadle.testing._sim_ledger import Ledger as Ledger
from treadle.testing._sim_ledger import LedgerScenario as LedgerScenario
from treadle.testing._sim_ledger import check_ledger_approvals as check_ledger_approvals
from treadle.testing._sim_run import APPROVER_POLL_S as APPROVER_POLL_S
from treadle.testing._sim_run import MAX_RESTARTS as MAX_RESTARTS
from treadle.testing._sim_run import THREAD_FIRST_ANSWER as THREAD_FIRST_ANSWER
from treadle.testing._sim_run import SimulationResult as SimulationResult
from treadle.testing._sim_run import run_seeds as run_seeds
from treadle.testing._sim_run import simulate as simulate
from treadle.testing._sim_scenario import ActorScenario as ActorScenario
from treadle.testing._sim_scenario import ApprovingScenario as ApprovingScenario
from treadle.testing._sim_scenario import Scenario as Scenario
from treadle.testing._sim_scenario import StoreScenario as StoreScenario
from treadle.testing.faults import FAULT_KINDS as FAULT_KINDS
from treadle.testing.invariants import TIME_SLACK_S as TIME_SLACK_S
from treadle.testing.invariants import VIRTUAL_TIME_SLACK_S as VIRTUAL_TIME_SLACK_S
from treadle.testing.invariants import EffectLedger as EffectLedger
from treadle.testing.invariants import check_approvals as check_approvals
from treadle.testing.invariants import check_budgets as check_budgets
from treadle.testing.invariants import check_invariants as check_invariants
from treadle.testing.invariants import check_tool_replies as check_tool_replies

__all__ = [
    "APPROVAL_TIMEOUT_S",
    "APPROVER_POLL_S",
    "CHILD_ANSWER",
    "CONTROL_POLL_S",
    "FAULT_KINDS",
    "LATENCY_MAX_S",
    "MAX_RESTARTS",
    "RECONCILED",
    "THREAD_FIRST_ANSWER",
    "TIME_SLACK_S",
    "VIRTUAL_TIME_SLACK_S",
    "ActorScenario",
    "ApprovalPlan",
    "ApprovingScenario",
    "DelayedActor",
    "EffectLedger",
    "FaultPlan",
    "Ledger",
    "LedgerScenario",
    "Scenario",
    "SimulationResult",
    "StoreScenario",
    "check_approvals",
    "check_budgets",
    "check_child_runs",
    "check_invariants",
    "check_ledger_approvals",
    "check_tool_replies",
    "log_digest",
    "run_seeds",
    "simulate",
    "with_latency",
]
