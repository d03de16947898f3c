"""treadle: durable, cancellable, budgeted LLM agent runs on trio.

Every run is a write-ahead log: an intent is durable before each model call and each tool
call, results follow. A run survives a crash, resumes without repeating a side effect, streams
ordered events, and can be replayed and tested in deterministic simulation.

The public names are re-exported here; implementation modules are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle._exceptions import ChildRunInterrupted as ChildRunInterrupted
from treadle._exceptions import ConflictError as ConflictError
from treadle._exceptions import InvalidRunId as InvalidRunId
from treadle._exceptions import LeaseError as LeaseError
from treadle._exceptions import LeaseLost as LeaseLost
from treadle._exceptions import LogCorrupted as LogCorrupted
from treadle._exceptions import ModelCallError as ModelCallError
from treadle._exceptions import RepairRefused as RepairRefused
from treadle._exceptions import RunInterrupted as RunInterrupted
from treadle._exceptions import RunLeased as RunLeased
from treadle._exceptions import SchemaTooNew as SchemaTooNew
from treadle._exceptions import SeamViolation as SeamViolation
from treadle._exceptions import SnapshotMismatch as SnapshotMismatch
from treadle._exceptions import StoreBusy as StoreBusy
from treadle._exceptions import StoreError as StoreError
from treadle._exceptions import StoreRefused as StoreRefused
from treadle._exceptions import StoreStopped as StoreStopped
from treadle._exceptions import StoreUnavailable as StoreUnavailable
from treadle._exceptions import TreadleError as TreadleError
from treadle._exceptions import UsageError as UsageError
from treadle._lazy import lazy_names

if TYPE_CHECKING:  # each name loads with its module on first use (docs/design.md, "Start-up")
    from treadle._clock import Clock as Clock
    from treadle._clock import FixedStepClock as FixedStepClock
    from treadle._clock import SystemClock as SystemClock
    from treadle._combined import CombinedTools as CombinedTools
    from treadle._combined import combine_tools as combine_tools
    from treadle.agent import Agent as Agent
    from treadle.agent import RunInput as RunInput
    from treadle.models.anthropic import AnthropicMessagesClient as AnthropicMessagesClient
    from treadle.models.openai import OpenAIChatClient as OpenAIChatClient
    from treadle.parsers import JsonToolCallParser as JsonToolCallParser
    from treadle.parsers import NativeToolCallParser as NativeToolCallParser
    from treadle.revisions import Observed as Observed
    from treadle.revisions import StaleWrite as StaleWrite
    from treadle.stores import LEASE_TTL_S as LEASE_TTL_S
    from treadle.stores.jsonl import JsonlStore as JsonlStore
    from treadle.stores.jsonl import open_jsonl_store as open_jsonl_store
    from treadle.stores.memory import MemoryStore as MemoryStore
    from treadle.stores.postgres import PostgresStore as PostgresStore
    from treadle.stores.postgres import open_postgres_store as open_postgres_store
    from treadle.stores.sqlite import SqliteStore as SqliteStore
    from treadle.stores.sqlite import open_sqlite_store as open_sqlite_store
    from treadle.supervisors import ActorContext as ActorContext
    from treadle.supervisors import Actors as Actors
    from treadle.supervisors import Fleet as Fleet
    from treadle.supervisors import FleetStatistics as FleetStatistics
    from treadle.supervisors import RunHandle as RunHandle
    from treadle.supervisors import agent_tool as agent_tool
    from treadle.supervisors import child_run_id as child_run_id
    from treadle.supervisors import finish_cancelled as finish_cancelled
    from treadle.supervisors import history as history
    from treadle.supervisors import open_fleet as open_fleet
    from treadle.supervisors import open_run as open_run
    from treadle.supervisors import resume_unfinished as resume_unfinished
    from treadle.supervisors import run as run
    from treadle.supervisors import wait_result as wait_result
    from treadle.tools import EnvironmentFailure as EnvironmentFailure
    from treadle.tools import Tool as Tool
    from treadle.tools import Toolbox as Toolbox
    from treadle.tools import ToolContext as ToolContext
    from treadle.tools import ToolResult as ToolResult
    from treadle.tools import tool as tool
    from treadle.types import ActionStatus as ActionStatus
    from treadle.types import Budgets as Budgets
    from treadle.types import Event as Event
    from treadle.types import EventKind as EventKind
    from treadle.types import ImageRef as ImageRef
    from treadle.types import Lease as Lease
    from treadle.types import Limits as Limits
    from treadle.types import Liveness as Liveness
    from treadle.types import Message as Message
    from treadle.types import ReplayPolicy as ReplayPolicy
    from treadle.types import RunResult as RunResult
    from treadle.types import RunState as RunState
    from treadle.types import RunSummary as RunSummary
    from treadle.types import StopReason as StopReason
    from treadle.types import SyntheticObservations as SyntheticObservations
    from treadle.types import Usage as Usage

__getattr__ = lazy_names(
    __name__,
    {
        "ActionStatus": "treadle.types",
        "ActorContext": "treadle.supervisors",
        "Actors": "treadle.supervisors",
        "Agent": "treadle.agent",
        "AnthropicMessagesClient": "treadle.models.anthropic",
        "Budgets": "treadle.types",
        "Clock": "treadle._clock",
        "CombinedTools": "treadle._combined",
        "EnvironmentFailure": "treadle.tools",
        "Event": "treadle.types",
        "EventKind": "treadle.types",
        "FixedStepClock": "treadle._clock",
        "Fleet": "treadle.supervisors",
        "FleetStatistics": "treadle.supervisors",
        "ImageRef": "treadle.types",
        "JsonToolCallParser": "treadle.parsers",
        "JsonlStore": "treadle.stores.jsonl",
        "LEASE_TTL_S": "treadle.stores",
        "Lease": "treadle.types",
        "Limits": "treadle.types",
        "Liveness": "treadle.types",
        "MemoryStore": "treadle.stores.memory",
        "Message": "treadle.types",
        "NativeToolCallParser": "treadle.parsers",
        "Observed": "treadle.revisions",
        "OpenAIChatClient": "treadle.models.openai",
        "PostgresStore": "treadle.stores.postgres",
        "ReplayPolicy": "treadle.types",
        "RunHandle": "treadle.supervisors",
        "RunInput": "treadle.agent",
        "RunResult": "treadle.types",
        "RunState": "treadle.types",
        "RunSummary": "treadle.types",
        "SqliteStore": "treadle.stores.sqlite",
        "StaleWrite": "treadle.revisions",
        "StopReason": "treadle.types",
        "SyntheticObservations": "treadle.types",
        "SystemClock": "treadle._clock",
        "Tool": "treadle.tools",
        "ToolContext": "treadle.tools",
        "ToolResult": "treadle.tools",
        "Toolbox": "treadle.tools",
        "Usage": "treadle.types",
        "agent_tool": "treadle.supervisors",
        "child_run_id": "treadle.supervisors",
        "combine_tools": "treadle._combined",
        "finish_cancelled": "treadle.supervisors",
        "history": "treadle.supervisors",
        "open_fleet": "treadle.supervisors",
        "open_jsonl_store": "treadle.stores.jsonl",
        "open_postgres_store": "treadle.stores.postgres",
        "open_run": "treadle.supervisors",
        "open_sqlite_store": "treadle.stores.sqlite",
        "resume_unfinished": "treadle.supervisors",
        "run": "treadle.supervisors",
        "tool": "treadle.tools",
        "wait_result": "treadle.supervisors",
    },
)

__all__ = [
    "LEASE_TTL_S",
    "ActionStatus",
    "ActorContext",
    "Actors",
    "Agent",
    "AnthropicMessagesClient",
    "Budgets",
    "ChildRunInterrupted",
    "Clock",
    "CombinedTools",
    "ConflictError",
    "EnvironmentFailure",
    "Event",
    "EventKind",
    "FixedStepClock",
    "Fleet",
    "FleetStatistics",
    "ImageRef",
    "InvalidRunId",
    "JsonToolCallParser",
    "JsonlStore",
    "Lease",
    "LeaseError",
    "LeaseLost",
    "Limits",
    "Liveness",
    "LogCorrupted",
    "MemoryStore",
    "Message",
    "ModelCallError",
    "NativeToolCallParser",
    "Observed",
    "OpenAIChatClient",
    "PostgresStore",
    "RepairRefused",
    "ReplayPolicy",
    "RunHandle",
    "RunInput",
    "RunInterrupted",
    "RunLeased",
    "RunResult",
    "RunState",
    "RunSummary",
    "SchemaTooNew",
    "SeamViolation",
    "SnapshotMismatch",
    "SqliteStore",
    "StaleWrite",
    "StopReason",
    "StoreBusy",
    "StoreError",
    "StoreRefused",
    "StoreStopped",
    "StoreUnavailable",
    "SyntheticObservations",
    "SystemClock",
    "Tool",
    "ToolContext",
    "ToolResult",
    "Toolbox",
    "TreadleError",
    "Usage",
    "UsageError",
    "agent_tool",
    "child_run_id",
    "combine_tools",
    "finish_cancelled",
    "history",
    "open_fleet",
    "open_jsonl_store",
    "open_postgres_store",
    "open_run",
    "open_sqlite_store",
    "resume_unfinished",
    "run",
    "tool",
    "wait_result",
]
