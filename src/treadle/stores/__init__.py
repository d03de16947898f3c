"""Run stores: implementations of `treadle.ports.RunStore`.

* `MemoryStore`: everything in memory, for tests and simulations.
* `SqliteStore` / `open_sqlite_store`: the embedded default, one SQLite file with group commit.
* `JsonlStore` / `open_jsonl_store`: one checksummed JSON-lines file per run in a directory.
"""

from __future__ import annotations

from treadle.stores.jsonl import JsonlStatistics as JsonlStatistics
from treadle.stores.jsonl import JsonlStore as JsonlStore
from treadle.stores.jsonl import TornTail as TornTail
from treadle.stores.jsonl import open_jsonl_store as open_jsonl_store
from treadle.stores.memory import MemoryStore as MemoryStore
from treadle.stores.sqlite import SqliteStore as SqliteStore
from treadle.stores.sqlite import StoreStatistics as StoreStatistics
from treadle.stores.sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "JsonlStatistics",
    "JsonlStore",
    "MemoryStore",
    "SqliteStore",
    "StoreStatistics",
    "TornTail",
    "open_jsonl_store",
    "open_sqlite_store",
]
