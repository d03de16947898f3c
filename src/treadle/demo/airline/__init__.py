"""The airline customer-service environment of the recorded tau-bench conversations.

Plain synchronous Python over SQLite: `AirlineDatabase` (one file per conversation),
the 14 tools behind `run_tool` / `AirlineTools` with their `TOOL_SPECS`, idempotent writes
with `reconcile`, and the benchmark's scoring (`score`). The workload files are read from a
folder located by `find_data_dir` and are never part of this repository.

Typical use::

    folder = find_data_dir()
    fresh = AirlineDatabase.create(tmp / "fresh.sqlite3", load_data(folder))
    db = fresh.copy_to(tmp / "conversation.sqlite3")
    text = run_tool(db, "get_user_details", {"user_id": "mia_li_3668"}, intent_id="a1")
"""

from treadle.demo.airline.data import (
    DATA_ENV_VAR,
    AirlineData,
    AirlineDataNotFound,
    AirlineDataUnreadable,
    AirlineTask,
    GroundTruthAction,
    Recording,
    align_users,
    download_data,
    find_data_dir,
    load_data,
    load_recordings,
)
from treadle.demo.airline.db import (
    AirlineDatabase,
    content_hash,
    reconcile,
)
from treadle.demo.airline.scoring import (
    Score,
    assistant_replies,
    conversation_completed,
    score,
)
from treadle.demo.airline.tools import (
    TOOL_SPECS,
    WRITE_TOOLS,
    AirlineToolError,
    AirlineTools,
    IntentConflictError,
    InvalidArgumentsError,
    UnknownToolError,
    run_tool,
)

__all__ = [
    "DATA_ENV_VAR",
    "TOOL_SPECS",
    "WRITE_TOOLS",
    "AirlineData",
    "AirlineDataNotFound",
    "AirlineDataUnreadable",
    "AirlineDatabase",
    "AirlineTask",
    "AirlineToolError",
    "AirlineTools",
    "GroundTruthAction",
    "IntentConflictError",
    "InvalidArgumentsError",
    "Recording",
    "Score",
    "UnknownToolError",
    "align_users",
    "assistant_replies",
    "content_hash",
    "conversation_completed",
    "download_data",
    "find_data_dir",
    "load_data",
    "load_recordings",
    "reconcile",
    "run_tool",
    "score",
]
