"""The public surface is pinned: adding or removing a name is a deliberate change here."""

from __future__ import annotations

import subprocess
import sys

import pytest

import treadle
import treadle.models
import treadle.testing
import treadle.types

TREADLE = sorted(
    [
        "InvalidRunId",
        "LeaseError",
        "LeaseLost",
        "RunLeased",
        "LEASE_TTL_S",
        "PostgresStore",
        "RepairRefused",
        "open_postgres_store",
        "finish_cancelled",
        "agent_tool",
        "child_run_id",
        "history",
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
        "ChildRunInterrupted",
        "Clock",
        "CombinedTools",
        "combine_tools",
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
        "Observed",
        "OpenAIChatClient",
        "ReplayPolicy",
        "RunHandle",
        "RunInput",
        "RunInterrupted",
        "RunResult",
        "RunState",
        "SchemaTooNew",
        "SeamViolation",
        "SnapshotMismatch",
        "JsonlStore",
        "SqliteStore",
        "StaleWrite",
        "StopReason",
        "StoreError",
        "StoreBusy",
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
        "ContractViolation",
        "CrashContractError",
        "CrashingExecutor",
        "CrashingStore",
        "FailingFileOps",
        "FailingStore",
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
    ]
)


MODELS = sorted(
    [
        "AnthropicMessagesClient",
        "Attempt",
        "ImageSource",
        "OpenAIChatClient",
        "SSEDecodeError",
        "SSEDecoder",
        "SSEEvent",
        "UsageObserver",
        "parse_retry_after",
        "probe",
    ]
)
"""`treadle.models`: the clients, and what a client of one's own needs (docs/models.md). What
the gateway hands an attempt is the `Attempt` record (docs/decisions/0091-explicit-seams.md):
no per-attempt context helpers."""

SIMULATION = sorted(
    [
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
)
"""`treadle.testing.simulation`: the names its private ``_sim_*`` modules define, and the
invariant checkers it has always re-exported (docs/design.md, "The module map")."""

REPLAY = sorted(
    [
        "DEFAULT_CONCURRENCY",
        "DEMO_RECORDING",
        "MAX_CHILDREN",
        "RUN_ID_PREFIX",
        "STDERR_TAIL_BYTES",
        "ChildExit",
        "CrashMode",
        "CrashPoint",
        "LiveReport",
        "LiveShow",
        "ReplayObserver",
        "ReplayReport",
        "RunCounts",
        "Workspace",
        "agent_replies",
        "build_report",
        "crash_point",
        "default_cache_dir",
        "demo_crash_point",
        "expected_for",
        "expected_writes",
        "failed_report",
        "find_recording",
        "first_change_step",
        "live_run_id",
        "load_trajectories",
        "locate_workload",
        "open_workspace",
        "pick_demo_recording",
        "policy_text",
        "recorded_steps",
        "replay_recordings",
        "run_id_of",
        "run_live",
        "spawn_driver",
        "tasks_by_id",
    ]
)
"""`treadle.demo.airline.replay`: the names its private modules define, and the default
concurrency it re-exports."""

SPLIT = {
    "treadle.testing.simulation": (
        SIMULATION,
        ["_sim_faults", "_sim_scenario", "_sim_ledger", "_sim_checks", "_sim_run"],
    ),
    "treadle.demo.airline.replay": (
        REPLAY,
        ["_discovery", "_crash_points", "_workspace", "_report", "_drivers", "_live"],
    ),
}
"""Each module split into private ones by responsibility: its pinned names, its parts."""


@pytest.mark.parametrize("facade", sorted(SPLIT))
def test_a_split_module_keeps_its_public_names(facade):
    import importlib

    module = importlib.import_module(facade)
    pinned, _ = SPLIT[facade]
    assert sorted(module.__all__) == pinned
    assert all(hasattr(module, name) for name in module.__all__)


@pytest.mark.parametrize("facade", sorted(SPLIT))
def test_every_public_name_of_a_split_modules_parts_is_reexported_as_itself(facade):
    """Nothing public is reachable only through a private part (and nothing twice)."""
    import importlib

    module = importlib.import_module(facade)
    _, parts = SPLIT[facade]
    package = facade.rsplit(".", 1)[0]
    defined: dict[str, object] = {}
    for part in parts:
        private = importlib.import_module(f"{package}.{part}")
        for name, value in vars(private).items():
            if name.startswith("_") or getattr(value, "__module__", None) != private.__name__:
                continue
            if isinstance(value, type) or callable(value):
                assert name not in defined, f"{name} is defined in two parts"
                defined[name] = value
    hidden = sorted(n for n in defined if n not in module.__all__)
    assert hidden == []
    assert all(getattr(module, name) is value for name, value in defined.items())


def test_treadle_exports():
    assert sorted(treadle.__all__) == TREADLE
    assert all(hasattr(treadle, name) for name in treadle.__all__)


def test_models_exports():
    assert sorted(treadle.models.__all__) == MODELS
    assert all(hasattr(treadle.models, name) for name in treadle.models.__all__)
    assert treadle.models.Attempt is treadle.types.Attempt


ACTORS = sorted(
    [
        "CANCEL_GRACE_S",
        "DELTA_FLUSH_CHARS",
        "DELTA_FLUSH_S",
        "SINK_BUFFER",
        "STOP_GRACE_S",
        "SUBSCRIBER_BUFFER",
        "ActionsOutcome",
        "Append",
        "AwaitedChild",
        "AwaitingChildren",
        "CallModel",
        "Cancel",
        "Chain",
        "Compaction",
        "ContextHydrator",
        "Control",
        "Delta",
        "Drain",
        "Drained",
        "EventWriter",
        "Forward",
        "Hydrate",
        "InheritedRun",
        "KeepDecision",
        "MailboxReceiver",
        "MailboxSender",
        "ModelGateway",
        "ModelOutcome",
        "Offer",
        "Parked",
        "ReplySlot",
        "RunActions",
        "RunCoordinator",
        "SinkFeed",
        "StepScope",
        "Subscribe",
        "Subscription",
        "ToolExecutor",
        "Warn",
        "WriterClient",
        "WriterRequest",
        "WriterStatistics",
        "backoff_s",
        "check_from_seq",
        "durable_event",
        "ends_the_call",
        "open_mailbox",
        "read_chain",
        "read_continued",
        "recorded_history",
        "reply",
        "request",
        "resume_from",
        "seconds_between",
        "step_messages",
        "stored_events",
        "take_offer",
        "with_step_started",
    ]
)


SUPERVISORS = sorted(
    [
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
)


@pytest.mark.parametrize(
    ("package", "names"),
    [("treadle.actors", ACTORS), ("treadle.supervisors", SUPERVISORS)],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_package_face_exports_its_names_and_keeps_its_modules_private(package, names):
    """A package's public names are its face's ``__all__``; every module behind it is private
    (``_name.py``), so no implementation module is imported from outside by its own name."""
    import importlib
    import pkgutil

    face = importlib.import_module(package)
    assert sorted(face.__all__) == names
    assert all(hasattr(face, name) for name in face.__all__)
    modules = [m.name for m in pkgutil.iter_modules(face.__path__)]
    assert [m for m in modules if not m.startswith("_")] == []


STORES = sorted(
    [
        "LEASE_TTL_S",
        "EngineStore",
        "JsonlStore",
        "MemoryStore",
        "SqliteStore",
        "StoreStatistics",
        "TornTail",
        "check_schema",
        "check_ttl",
        "is_dsn",
        "is_live",
        "driver_owner",
        "event_to_dict",
        "finishes_cancel",
        "lease_owner",
        "open_jsonl_store",
        "open_sqlite_store",
        "record_to_dict",
        "record_to_json",
        "redact_dsn",
        "write_records",
    ]
)
JSONL = sorted(
    [
        "FileOps",
        "JsonlStore",
        "OsFileOps",
        "Repair",
        "TornTail",
        "open_jsonl_store",
        "run_file_name",
    ]
)


def test_stores_exports():
    import treadle.stores
    import treadle.stores.jsonl

    assert sorted(treadle.stores.__all__) == STORES
    assert all(hasattr(treadle.stores, name) for name in STORES)
    assert sorted(treadle.stores.jsonl.__all__) == JSONL
    assert all(hasattr(treadle.stores.jsonl, name) for name in JSONL)


def test_no_module_imports_another_packages_private_module():
    """``treadle.stores._codec`` is for ``treadle.stores`` alone: every other package reaches
    it through the face (``treadle.stores``) or a public module of the package."""
    import ast
    from pathlib import Path

    root = Path(treadle.__file__).parent
    crossings = []
    for path in sorted(root.rglob("*.py")):
        here = ".".join(("treadle", *path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                private = next((i for i, p in enumerate(parts) if p.startswith("_")), None)
                if parts[0] != "treadle" or private is None or private < 2:
                    continue  # not ours, public, or a private module of treadle itself
                owner = ".".join(parts[:private])
                if not (here == owner or here.startswith(owner + ".")):
                    crossings.append(f"{here} imports {name}")
    assert crossings == []


def test_testing_exports():
    assert sorted(treadle.testing.__all__) == TESTING
    assert all(hasattr(treadle.testing, name) for name in treadle.testing.__all__)


def _loaded_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter has loaded after running ``code``."""
    script = (
        f"import sys\n{code}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_import_treadle_loads_no_http_client_nor_schema_generator():
    """``import treadle`` stays light (issue: slow start): the model clients, httpx and its
    CLI dependencies load when a client is first used, msgspec when a tool is declared."""
    loaded = _loaded_after("import treadle")
    assert "treadle" in loaded
    assert not loaded & {"httpx", "httpcore", "click", "rich", "pygments", "msgspec", "psycopg"}
    used = _loaded_after("import treadle\ntreadle.OpenAIChatClient")
    assert "httpx" in used  # the lazy name still resolves to the real client


def test_the_lazy_names_are_the_real_ones():
    from treadle.models.anthropic import AnthropicMessagesClient
    from treadle.models.openai import OpenAIChatClient

    assert treadle.OpenAIChatClient is OpenAIChatClient
    assert treadle.AnthropicMessagesClient is AnthropicMessagesClient
    assert treadle.models.OpenAIChatClient is OpenAIChatClient
    with pytest.raises(AttributeError, match="NoSuchName"):
        treadle.NoSuchName  # noqa: B018


def _treadle_modules_after(code: str) -> set[str]:
    """The ``treadle.*`` modules a fresh interpreter has loaded after running ``code``."""
    script = (
        f"import sys\n{code}\nprint(' '.join(m for m in sys.modules if m.startswith('treadle')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_treadle_help_imports_no_command():
    """``treadle --help`` lists the commands without importing them (docs/design.md,
    "Start-up"): no store, no runtime, no command module; a command loads when it runs."""
    helped = (
        "from treadle.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    )
    loaded = _treadle_modules_after(helped)
    assert "treadle.cli" in loaded
    assert not {m for m in loaded if m.startswith(("treadle.stores", "treadle.supervisors"))}
    assert not {m for m in loaded if m.startswith("treadle._cli_")}
    assert not _loaded_after(helped) & {"trio", "rich", "httpx", "psycopg"}
    shown = "from treadle.cli import main\ntry:\n    main(['show', '--help'])\nexcept SystemExit:\n    pass"
    assert "treadle._cli_store" in _treadle_modules_after(shown)


def test_every_command_is_listed_with_its_own_help_line():
    import importlib

    import click

    from treadle.cli import COMMANDS, main

    modules = {entry.module for entry in COMMANDS.values()}
    defined = {
        value.name
        for module in modules
        for value in vars(importlib.import_module(module)).values()
        if isinstance(value, click.Command) and value.name is not None
    }
    assert defined - {"airline"} == set(COMMANDS)  # `airline` is a subcommand of `demo`
    for name, entry in COMMANDS.items():
        command = main.get_command(click.Context(main), name)
        assert command is not None and command.name == name
        assert command.get_short_help_str(limit=300) == entry.help, name


NOT_ERRORS = {"Parked", "AwaitingChildren", "Drained", "ChildPending", "SimulatedCrash"}
"""Exceptions that are control-flow signals, not errors (drawn apart in the tree's docstring)."""


def test_every_error_is_in_the_one_exception_tree():
    """Every exception class treadle defines (the demo workload aside) is a `TreadleError`,
    and the docstring that draws the tree names it (or names it a signal)."""
    import importlib
    import pkgutil

    import treadle._exceptions as tree

    found: dict[str, type] = {}
    for module in pkgutil.walk_packages(treadle.__path__, "treadle."):
        if module.name.startswith("treadle.demo") or module.name == "treadle.__main__":
            continue
        for name, value in vars(importlib.import_module(module.name)).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.name
                and not name.startswith("_")
            ):
                found[name] = value
    assert {"EnvironmentFailure", "SSEDecodeError", "FrameError", "StoreContractError"} <= set(
        found
    )
    outside = sorted(n for n, c in found.items() if not issubclass(c, treadle.TreadleError))
    assert outside == sorted(NOT_ERRORS)
    drawn = tree.__doc__ or ""
    assert [name for name in sorted(found) if name not in drawn] == []


def _public_surface() -> dict[str, dict[str, object]]:
    """Each public module (no ``_`` part in its name) and its public names: its ``__all__``,
    or, without one, what it defines under a name without a leading ``_``."""
    import importlib
    import pkgutil

    surface: dict[str, dict[str, object]] = {}
    for info in pkgutil.walk_packages(treadle.__path__, "treadle."):
        if info.name == "treadle.__main__" or any(p.startswith("_") for p in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        names = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        ]
        surface[info.name] = {name: getattr(module, name) for name in names}
    surface["treadle"] = {name: getattr(treadle, name) for name in treadle.__all__}
    return surface


def _public_docstrings(surface: dict[str, dict[str, object]]) -> list[str]:
    """The docstrings ``help()`` and the API reference show: of each public module, of each
    public class and function, and of a public class's own public methods and properties."""
    import inspect
    import sys

    texts = [sys.modules[name].__doc__ or "" for name in surface]
    for names in surface.values():
        for value in names.values():
            if not (inspect.isclass(value) or inspect.isroutine(value)):
                continue  # a constant's __doc__ is its type's
            texts.append(value.__doc__ or "")
            if inspect.isclass(value):
                texts.extend(
                    getattr(member, "__doc__", None) or ""
                    for name, member in vars(value).items()
                    if not name.startswith("_")
                    and (inspect.isroutine(member) or isinstance(member, property))
                )
    return texts


def test_every_exception_the_docs_or_a_public_docstring_name_is_exported():
    """``ChildRunInterrupted`` (docs/child-runs.md) and ``CrashContractError`` (the docstring
    of ``check_crash_recovery``) were named as raised, yet no public module exported them:
    telling them apart took a private import. Every exception treadle defines that README.md,
    docs/ or a public docstring names is a public name of some public module."""
    import re
    from pathlib import Path

    surface = _public_surface()
    defined = {
        value.__name__: value
        for module in list(sys.modules.values())
        if module is not None and module.__name__.startswith("treadle.")
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == module.__name__
        and not value.__name__.startswith("_")
    }
    assert {"ChildRunInterrupted", "ChildPending", "CrashContractError", "FrameError"} <= set(
        defined
    )
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    texts = [page.read_text(encoding="utf-8") for page in pages] + _public_docstrings(surface)
    named = {word for text in texts for word in re.findall(r"\b[A-Z]\w*", text)} & set(defined)
    exported = {
        name
        for names in surface.values()
        for name, value in names.items()
        if value is defined.get(name)
    }
    assert {"ChildRunInterrupted", "RunInterrupted", "StoreContractError"} <= named
    assert sorted(named - exported) == []


def test_no_public_constructor_takes_private_state():
    """``ScriptedModel(failed={0: 99})`` was accepted (and marked turn 0's scripted failures
    spent), ``MemoryStore(_logs=...)`` too: internal state in the signature ``help()`` shows,
    which no docstring names. A private field of a public attrs class is ``init=False``, or a
    required argument the function that builds the class passes (`open_run`, `open_fleet`)."""
    import inspect

    import attrs

    from treadle.testing import ScriptedModel, say

    preset = []
    for module, names in _public_surface().items():
        if module.startswith("treadle.demo"):
            continue  # the demo's own classes are no part of the library's surface
        for value in names.values():
            if inspect.isclass(value) and attrs.has(value):
                preset += [
                    f"{value.__qualname__}.{field.name}"
                    for field in attrs.fields(value)
                    if field.name.startswith("_")
                    and field.init
                    and field.default is not attrs.NOTHING
                ]
    assert sorted(set(preset)) == []
    assert list(inspect.signature(treadle.MemoryStore).parameters) == ["clock"]
    assert "failed" not in inspect.signature(ScriptedModel).parameters
    with pytest.raises(TypeError, match="failed"):
        ScriptedModel(turns=[say("x")], failed={0: 99})  # type: ignore[call-arg]
