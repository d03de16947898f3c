"""Run stores: implementations of `treadle.ports.RunStore` and its capabilities.

* `MemoryStore`: everything in memory, for tests and simulations (every capability).
* `SqliteStore` / `open_sqlite_store`: the embedded default, one SQLite file with group commit;
  several processes on one machine may share it (every capability, the fleet's queue too).
* `JsonlStore` / `open_jsonl_store`: one checksummed JSON-lines file per run in a directory
  (leases, control streams, run index; no queue).
* `PostgresStore` / `open_postgres_store`: PostgreSQL, for a fleet of workers on many
  machines (every capability).

The durable stores share one commit engine (group commit, barriers, prefix durability, error
reporting); their counters are a `StoreStatistics`.
"""

from __future__ import annotations

from treadle.stores._engine import StoreStatistics as StoreStatistics
from treadle.stores._leases import LEASE_TTL_S as LEASE_TTL_S
from treadle.stores._leases import lease_owner as lease_owner
from treadle.stores.jsonl import JsonlStore as JsonlStore
from treadle.stores.jsonl import TornTail as TornTail
from treadle.stores.jsonl import open_jsonl_store as open_jsonl_store
from treadle.stores.memory import MemoryStore as MemoryStore
from treadle.stores.sqlite import SqliteStore as SqliteStore
from treadle.stores.sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "LEASE_TTL_S",
    "JsonlStore",
    "MemoryStore",
    "SqliteStore",
    "StoreStatistics",
    "TornTail",
    "lease_owner",
    "open_jsonl_store",
    "open_sqlite_store",
]
