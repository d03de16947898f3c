"""Run stores: implementations of `treadle.ports.RunStore`.

* `MemoryStore`: everything in memory, for tests and simulations.
* `SqliteStore` / `open_sqlite_store`: the embedded default, one SQLite file with group commit.
"""

from __future__ import annotations

from treadle.stores.memory import MemoryStore as MemoryStore
from treadle.stores.sqlite import SqliteStore as SqliteStore
from treadle.stores.sqlite import StoreStatistics as StoreStatistics
from treadle.stores.sqlite import open_sqlite_store as open_sqlite_store

__all__ = ["MemoryStore", "SqliteStore", "StoreStatistics", "open_sqlite_store"]
