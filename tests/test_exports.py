"""The public surface is pinned: adding or removing a name is a deliberate change here."""

from __future__ import annotations

import treadle
import treadle.testing

TREADLE = sorted(
    [
        "InvalidRunId",
        "LeaseError",
        "LeaseLost",
        "RunLeased",
        "LEASE_TTL_S",
        "PostgresStore",
        "open_postgres_store",
        "finish_cancelled",
        "Fleet",
        "FleetStatistics",
        "open_fleet",
        "wait_result",
        "Lease",
        "Liveness",
        "RunSummary",
        "ActorContext",
        "Actors",
        "ActionStatus",
        "Agent",
        "AnthropicMessagesClient",
        "Budgets",
        "Clock",
        "ConflictError",
        "EnvironmentFailure",
        "Event",
        "EventKind",
        "FixedStepClock",
        "ImageRef",
        "JsonToolCallParser",
        "Limits",
        "LogCorrupted",
        "MemoryStore",
        "Message",
        "ModelCallError",
        "NativeToolCallParser",
        "OpenAIChatClient",
        "ReplayPolicy",
        "RunHandle",
        "RunInput",
        "RunInterrupted",
        "RunResult",
        "RunState",
        "SchemaTooNew",
        "SnapshotMismatch",
        "JsonlStore",
        "SqliteStore",
        "StopReason",
        "StoreError",
        "SyntheticObservations",
        "SystemClock",
        "Tool",
        "ToolContext",
        "Toolbox",
        "TreadleError",
        "Usage",
        "UsageError",
        "open_jsonl_store",
        "open_run",
        "open_sqlite_store",
        "resume_unfinished",
        "run",
        "tool",
    ]
)

TESTING = sorted(
    [
        "FaultPlan",
        "simulate",
        "with_latency",
        "CannedResponse",
        "CrashingExecutor",
        "CrashingStore",
        "FailingFileOps",
        "FailingStore",
        "InterceptingStore",
        "ScriptedModel",
        "SeamContractError",
        "SimulatedCrash",
        "call",
        "calls",
        "canned",
        "check_action_executor",
        "check_crash_recovery",
        "check_decision_parser",
        "check_model_client",
        "check_run_store",
        "open_loopback_server",
        "say",
        "seed_log",
    ]
)


def test_treadle_exports():
    assert sorted(treadle.__all__) == TREADLE
    assert all(hasattr(treadle, name) for name in treadle.__all__)


def test_testing_exports():
    assert sorted(treadle.testing.__all__) == TESTING
    assert all(hasattr(treadle.testing, name) for name in treadle.testing.__all__)
