"""The supervisors: one run, a fleet, recovery, finishing (docs/design.md, "Supervisors").

Everything public of the supervisors is here; the modules behind it are private.

* One run: `open_run` and `run` drive a run (new or resumed) under its lease and give a
  `RunHandle`; its five actors are built by the factories of an `Actors` record (the real
  ones by default, `real_writer` ... `real_coordinator`), each filling a role `Protocol`.
* Many runs: `open_fleet` is a worker of a fleet over one store (`Fleet`, `wait_result`).
* Child runs: `agent_tool` makes a tool whose calls run another agent (`child_run_id`); a
  call whose child stopped unfinished raises `ChildRunInterrupted`, and one that parks its run
  while its queued child works raises the signal `ChildPending` (docs/child-runs.md).
* Threads: `history` of a run, `thread_run_id`, `Lineage`.
* Recovery and finishing: `resume_unfinished` (`resume_failed` tells its errors apart),
  `finish_cancelled` (`finish_cancelled_here` tells whether it finished the run).
"""

from treadle._exceptions import ChildPending as ChildPending
from treadle._exceptions import ChildRunInterrupted as ChildRunInterrupted
from treadle.supervisors._children import CHILD_CANCEL_GRACE_S as CHILD_CANCEL_GRACE_S
from treadle.supervisors._children import agent_tool as agent_tool
from treadle.supervisors._children import child_run_id as child_run_id
from treadle.supervisors._children import parent_of as parent_of
from treadle.supervisors._driver import CONTROL_POLL_S as CONTROL_POLL_S
from treadle.supervisors._driver import PARK_AFTER_S as PARK_AFTER_S
from treadle.supervisors._driver import WRITER_INBOX as WRITER_INBOX
from treadle.supervisors._factories import DEFAULT_ACTORS as DEFAULT_ACTORS
from treadle.supervisors._factories import ActorContext as ActorContext
from treadle.supervisors._factories import Actors as Actors
from treadle.supervisors._factories import CoordinatorActor as CoordinatorActor
from treadle.supervisors._factories import CoordinatorContext as CoordinatorContext
from treadle.supervisors._factories import ExecutorActor as ExecutorActor
from treadle.supervisors._factories import GatewayActor as GatewayActor
from treadle.supervisors._factories import HydratorActor as HydratorActor
from treadle.supervisors._factories import InboxActor as InboxActor
from treadle.supervisors._factories import WriterActor as WriterActor
from treadle.supervisors._factories import WriterContext as WriterContext
from treadle.supervisors._factories import real_coordinator as real_coordinator
from treadle.supervisors._factories import real_executor as real_executor
from treadle.supervisors._factories import real_gateway as real_gateway
from treadle.supervisors._factories import real_hydrator as real_hydrator
from treadle.supervisors._factories import real_writer as real_writer
from treadle.supervisors._finishing import finish_cancelled as finish_cancelled
from treadle.supervisors._finishing import finish_cancelled_here as finish_cancelled_here
from treadle.supervisors._fleet import BACKOFF_S as BACKOFF_S
from treadle.supervisors._fleet import CHILD_RECHECK_S as CHILD_RECHECK_S
from treadle.supervisors._fleet import CLAIM_POLL_S as CLAIM_POLL_S
from treadle.supervisors._fleet import DRAIN_S as DRAIN_S
from treadle.supervisors._fleet import MAX_TAKEOVERS as MAX_TAKEOVERS
from treadle.supervisors._fleet import METRICS_REFRESH_S as METRICS_REFRESH_S
from treadle.supervisors._fleet import AgentFactory as AgentFactory
from treadle.supervisors._fleet import Fleet as Fleet
from treadle.supervisors._fleet import FleetStatistics as FleetStatistics
from treadle.supervisors._fleet import open_fleet as open_fleet
from treadle.supervisors._fleet import wait_result as wait_result
from treadle.supervisors._handle import RunHandle as RunHandle
from treadle.supervisors._leasing import leases_of as leases_of
from treadle.supervisors._recovery import resume_failed as resume_failed
from treadle.supervisors._recovery import resume_unfinished as resume_unfinished
from treadle.supervisors._run import open_run as open_run
from treadle.supervisors._run import run as run
from treadle.supervisors._threads import Lineage as Lineage
from treadle.supervisors._threads import history as history
from treadle.supervisors._threads import thread_run_id as thread_run_id

__all__ = [
    "BACKOFF_S",
    "CHILD_CANCEL_GRACE_S",
    "CHILD_RECHECK_S",
    "CLAIM_POLL_S",
    "CONTROL_POLL_S",
    "DEFAULT_ACTORS",
    "DRAIN_S",
    "MAX_TAKEOVERS",
    "METRICS_REFRESH_S",
    "PARK_AFTER_S",
    "WRITER_INBOX",
    "ActorContext",
    "Actors",
    "AgentFactory",
    "ChildPending",
    "ChildRunInterrupted",
    "CoordinatorActor",
    "CoordinatorContext",
    "ExecutorActor",
    "Fleet",
    "FleetStatistics",
    "GatewayActor",
    "HydratorActor",
    "InboxActor",
    "Lineage",
    "RunHandle",
    "WriterActor",
    "WriterContext",
    "agent_tool",
    "child_run_id",
    "finish_cancelled",
    "finish_cancelled_here",
    "history",
    "leases_of",
    "open_fleet",
    "open_run",
    "parent_of",
    "real_coordinator",
    "real_executor",
    "real_gateway",
    "real_hydrator",
    "real_writer",
    "resume_failed",
    "resume_unfinished",
    "run",
    "thread_run_id",
    "wait_result",
]
