"""Run stores: implementations of `treadle.ports.RunStore` and its capabilities.

* `MemoryStore`: everything in memory, for tests and simulations (every capability).
* `SqliteStore` / `open_sqlite_store`: the embedded default, one SQLite file with group commit;
  several processes on one machine may share it (every capability, the fleet's queue too).
* `JsonlStore` / `open_jsonl_store`: one checksummed JSON-lines file per run in a directory
  (leases, control streams, run index; no queue).
* `PostgresStore` / `open_postgres_store`: PostgreSQL, for a fleet of workers on many
  machines (every capability).

The durable stores share one commit engine (group commit, barriers, prefix durability, error
reporting); their counters are a `StoreStatistics`, and `EngineStore` is their common base.

Shared by every store and by the supervisors and tools above them:

* records: `record_to_dict` (the named JSON form of a log record, as events and `treadle show`
  carry it), `event_to_dict` (an event's JSON form: its run id, kind and record),
  `record_to_json` (a record's form as one line of compact JSON), `check_schema` (refuse a
  run written by a newer schema), `write_records` (write records through a store's typed
  operations, as a driver would);
* leases: `LEASE_TTL_S`, `check_ttl`, `is_live`, `lease_owner`, `finishes_cancel`,
  `driver_owner`
  (docs/fleet.md, "Leases");
* store names: `is_dsn` (a PostgreSQL DSN rather than a path), `redact_dsn` (its password
  hidden).
"""

from __future__ import annotations

from treadle.stores._codec import check_schema as check_schema
from treadle.stores._codec import event_to_dict as event_to_dict
from treadle.stores._codec import record_to_dict as record_to_dict
from treadle.stores._codec import record_to_json as record_to_json
from treadle.stores._dsn import is_dsn as is_dsn
from treadle.stores._dsn import redact_dsn as redact_dsn
from treadle.stores._engine import StoreStatistics as StoreStatistics
from treadle.stores._leases import LEASE_TTL_S as LEASE_TTL_S
from treadle.stores._leases import check_ttl as check_ttl
from treadle.stores._leases import driver_owner as driver_owner
from treadle.stores._leases import finishes_cancel as finishes_cancel
from treadle.stores._leases import is_live as is_live
from treadle.stores._leases import lease_owner as lease_owner
from treadle.stores._ops import EngineStore as EngineStore
from treadle.stores._ops import write_records as write_records
from treadle.stores.jsonl import JsonlStore as JsonlStore
from treadle.stores.jsonl import TornTail as TornTail
from treadle.stores.jsonl import open_jsonl_store as open_jsonl_store
from treadle.stores.memory import MemoryStore as MemoryStore
from treadle.stores.sqlite import SqliteStore as SqliteStore
from treadle.stores.sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "LEASE_TTL_S",
    "EngineStore",
    "JsonlStore",
    "MemoryStore",
    "SqliteStore",
    "StoreStatistics",
    "TornTail",
    "check_schema",
    "check_ttl",
    "driver_owner",
    "event_to_dict",
    "finishes_cancel",
    "is_dsn",
    "is_live",
    "lease_owner",
    "open_jsonl_store",
    "open_sqlite_store",
    "record_to_dict",
    "record_to_json",
    "redact_dsn",
    "write_records",
]
