"""The peer benchmark in DBOS: the instant workload as a workflow of ``@DBOS.step()`` steps.

Run by bench_postgres.py with the Python of a virtualenv that has ``dbos`` (never treadle's
environment); prints one JSON object on its last stdout line. One step of the workload is two
DBOS steps (the model call, then the tool call; the last step only answers), i.e. two durable
commits, as a treadle step has two barriers. DBOS's system tables live in a database of their
own (created here, dropped afterwards) on the same server, so that the server's
``pg_stat_database.xact_commit`` delta counts DBOS's transactions and nobody else's.

    TREADLE_BENCH_POSTGRES=DSN python _dbos_peer.py --runs 100 --steps 200
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from dbos import DBOS, DBOSConfig
from psycopg import conninfo, sql
from sqlalchemy.engine import URL

from _args import at_least

STATS_FLUSH_S = 1.5
"""Seconds PostgreSQL 15 may take to publish a backend's counters once it is idle (1 s)."""


@DBOS.step()
def model_call(turn: int, steps: int) -> dict[str, Any]:
    if turn >= steps - 1:
        return {"text": "done", "finish_reason": "stop"}
    return {"tool_calls": [{"id": f"c{turn}", "name": "noop", "arguments": {}}]}


@DBOS.step()
def noop(call: dict[str, Any]) -> str:
    return "ok"


@DBOS.workflow()
def agent(steps: int) -> str:
    for turn in range(steps):
        reply = model_call(turn, steps)
        for call in reply.get("tool_calls", ()):
            noop(call)
    return "done"


def drive(runs: int, steps: int) -> None:
    handles = [DBOS.start_workflow(agent, steps) for _ in range(runs)]
    for handle in handles:
        handle.get_result()


def xact_commit(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def database_url(dsn: str, database: str) -> str:
    """``dsn`` (a URL or libpq keywords) as the SQLAlchemy URL of ``database`` DBOS takes."""
    parts = conninfo.conninfo_to_dict(dsn)
    url = URL.create(
        "postgresql",
        username=parts.get("user"),
        password=parts.get("password"),
        host=parts.get("host"),
        port=int(parts["port"]) if parts.get("port") else None,
        database=database,
    )
    return url.render_as_string(hide_password=False)


def measure(dsn: str, runs: int, steps: int) -> dict[str, Any]:
    DBOS(config=DBOSConfig(name="treadle-peer-bench", system_database_url=dsn, log_level="ERROR"))
    DBOS.launch()
    try:
        drive(1, 5)  # warm-up
        time.sleep(STATS_FLUSH_S)
        commits0 = xact_commit(dsn)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        drive(runs, steps)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        time.sleep(STATS_FLUSH_S)
        commits = xact_commit(dsn) - commits0 - 1  # less our own reading transaction
    finally:
        DBOS.destroy()
    return {"steps": runs * steps, "wall_s": wall, "cpu_s": cpu, "xact_commits": commits}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("TREADLE_BENCH_POSTGRES"),
        help="a database of the server (default $TREADLE_BENCH_POSTGRES)",
    )
    parser.add_argument("--runs", type=at_least(1), default=1)
    parser.add_argument("--steps", type=at_least(1), default=200)
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("give --dsn or set TREADLE_BENCH_POSTGRES")
    logging.getLogger("dbos").setLevel(logging.ERROR)
    database = f"treadle_bench_dbos_{secrets.token_hex(4)}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        try:
            result = measure(database_url(args.dsn, database), args.runs, args.steps)
        finally:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )
    result["dbos"] = _version()
    print(json.dumps(result))


def _version() -> str:
    from importlib.metadata import version

    return version("dbos")


if __name__ == "__main__":
    main()
