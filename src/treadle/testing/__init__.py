"""The public test and simulation kit.

* `ScriptedModel` (+ `say`, `call`, `calls`): a model client that plays a script by turn.
* `CrashingStore`, `CrashingExecutor`, `SimulatedCrash`: a simulated process crash at any store
  write or in the middle of any action; `FailingStore`, `FailingFileOps`: a write that fails
  (a full disk, a failed sync) without a crash.
* `InterceptingStore`: a store wrapper that forwards everything and lets a subclass act around
  each of the six log writes (the base of the fault injectors above; write your own on it).
* `check_crash_recovery`: crash a scripted run at every write and in every action, reopen the
  store, resume, and check what survived (`treadle.testing.crashes`);
  `check_thread_crash_recovery` does the same to a run that continues a thread
  (docs/threads.md, "Crashes and resume"). A failed check raises `CrashContractError`.
* `seed_log`: write a run's log into any store as a driver would (fixtures for tests).
* `check_run_store` (store contract), `check_decision_parser`, `check_action_executor`,
  `check_model_client`, `check_model_client_deadlines`: the seam contracts, reusable for your
  own implementations; a broken one raises `StoreContractError` or `SeamContractError`.
  Every failed check of the kit is a `ContractViolation` (an `AssertionError` too).
* `open_loopback_server`, `CannedResponse`, `canned`: a real HTTP server on 127.0.0.1 for
  testing model clients without mocking the transport.
* `simulate`, `FaultPlan`, `with_latency`: deterministic simulation under a seeded fault plan
  (`treadle.testing.simulation`, docs/simulation.md); `with_latency` wraps any actor factory of
  `treadle.Actors` so its requests arrive after seeded delays on the virtual clock.
* `treadle.testing.postgres.fresh_database`: a throwaway PostgreSQL database for one test.

On pytest-trio's ``autojump_clock`` the virtual clock jumps whenever every task waits, also
while a worker thread, a child process or a socket works: a durable store's writes then spend
virtual time (a time budget or deadline runs out early), and a plain ``def`` or process tool
times out while it still runs. Give such tests a `treadle.MemoryStore`, and call
`treadle.tools.call_tools_inline` first in a test whose agent has ``def`` or process tools
(docs/simulation.md, "Your own tests on a virtual clock"). `simulate` and `run_seeds` are
trio runs of their own: call them from a plain (not ``async``) test function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle._exceptions import ContractViolation as ContractViolation
from treadle._lazy import lazy_names
from treadle.testing._intercept import InterceptingStore as InterceptingStore
from treadle.testing.faults import CrashingExecutor as CrashingExecutor
from treadle.testing.faults import CrashingStore as CrashingStore
from treadle.testing.faults import FailingFileOps as FailingFileOps
from treadle.testing.faults import FailingStore as FailingStore
from treadle.testing.faults import SimulatedCrash as SimulatedCrash
from treadle.testing.scripted import ScriptedModel as ScriptedModel
from treadle.testing.scripted import call as call
from treadle.testing.scripted import calls as calls
from treadle.testing.scripted import say as say

if TYPE_CHECKING:  # loaded on first use: the simulation and the contracts bring trio.testing
    from treadle.testing.contracts import StoreContractError as StoreContractError
    from treadle.testing.contracts import check_run_store as check_run_store
    from treadle.testing.contracts import seed_log as seed_log
    from treadle.testing.crashes import CrashContractError as CrashContractError
    from treadle.testing.crashes import check_crash_recovery as check_crash_recovery
    from treadle.testing.crashes import (
        check_thread_crash_recovery as check_thread_crash_recovery,
    )
    from treadle.testing.loopback import CannedResponse as CannedResponse
    from treadle.testing.loopback import canned as canned
    from treadle.testing.loopback import open_loopback_server as open_loopback_server
    from treadle.testing.seams import SeamContractError as SeamContractError
    from treadle.testing.seams import check_action_executor as check_action_executor
    from treadle.testing.seams import check_decision_parser as check_decision_parser
    from treadle.testing.seams import check_model_client as check_model_client
    from treadle.testing.seams import (
        check_model_client_deadlines as check_model_client_deadlines,
    )
    from treadle.testing.simulation import FaultPlan as FaultPlan
    from treadle.testing.simulation import simulate as simulate
    from treadle.testing.simulation import with_latency as with_latency

__getattr__ = lazy_names(
    __name__,
    {
        "StoreContractError": "treadle.testing.contracts",
        "check_run_store": "treadle.testing.contracts",
        "seed_log": "treadle.testing.contracts",
        "CrashContractError": "treadle.testing.crashes",
        "check_crash_recovery": "treadle.testing.crashes",
        "check_thread_crash_recovery": "treadle.testing.crashes",
        "CannedResponse": "treadle.testing.loopback",
        "canned": "treadle.testing.loopback",
        "open_loopback_server": "treadle.testing.loopback",
        "SeamContractError": "treadle.testing.seams",
        "check_action_executor": "treadle.testing.seams",
        "check_decision_parser": "treadle.testing.seams",
        "check_model_client": "treadle.testing.seams",
        "check_model_client_deadlines": "treadle.testing.seams",
        "FaultPlan": "treadle.testing.simulation",
        "simulate": "treadle.testing.simulation",
        "with_latency": "treadle.testing.simulation",
    },
)

__all__ = [
    "CannedResponse",
    "ContractViolation",
    "CrashContractError",
    "CrashingExecutor",
    "CrashingStore",
    "FailingFileOps",
    "FailingStore",
    "FaultPlan",
    "InterceptingStore",
    "ScriptedModel",
    "SeamContractError",
    "SimulatedCrash",
    "StoreContractError",
    "call",
    "calls",
    "canned",
    "check_action_executor",
    "check_crash_recovery",
    "check_decision_parser",
    "check_model_client",
    "check_model_client_deadlines",
    "check_run_store",
    "check_thread_crash_recovery",
    "open_loopback_server",
    "say",
    "seed_log",
    "simulate",
    "with_latency",
]
