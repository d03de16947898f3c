"""The PostgreSQL store beyond the contracts: lost connections, an unknown commit outcome, the
schema version, the DSN's password, and a stale writer filtered inside a shared batch."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import trio
import trio.testing

import treadle
from treadle.stores import _engine, _sql, postgres
from treadle.stores._codec import KIND_OF, encode_bytes, record_crc
from treadle.stores.postgres import PostgresStore
from treadle.testing.contracts import lease_generation
from treadle.types import CancelRequested, Message, ModelIntent, RunStarted, RunState

TS = "2026-01-01T00:00:00+00:00"


def started(run_id: str) -> RunStarted:
    return RunStarted(
        run_id=run_id, ts=TS, input=(Message(role="user", content="hi"),), snapshot={}
    )


def intent(run_id: str, n: int) -> ModelIntent:
    return ModelIntent(run_id=run_id, step=1, intent_id=f"{run_id}/m{n}", attempt=n, ts=TS)


async def test_a_dropped_committer_connection_is_made_again_and_the_write_lands(
    postgres_database: str,
) -> None:
    # A database of its own: the committers terminated are this store's only, not those of
    # tests running beside it on the same server.
    async with treadle.open_postgres_store(postgres_database) as store:
        gen = await lease_generation(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=gen)
        await store.write_intent(intent("r", 1), seq=2, generation=gen)
        with psycopg.connect(postgres_database, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'treadle committer' AND datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        assert killed  # the committer's connection is gone
        await store.write_intent(intent("r", 2), seq=3, generation=gen)  # a barrier
        log = await store.read_log("r")
    assert [type(r).__name__ for r in log.records] == ["RunStarted", "ModelIntent", "ModelIntent"]


def end_pooled_sessions(dsn: str) -> int:
    """End the store's pooled sessions as a server restart does; how many there were.

    Returns once the server has ended them (their backends gone from ``pg_stat_activity``).
    Only this test's database: never the sessions of tests running beside it.
    """
    with psycopg.connect(dsn, autocommit=True) as admin:
        ended = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
            "'treadle' AND datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
        left = 1
        while left:  # each ends within moments of its signal
            (left,) = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'treadle' "
                "AND datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
    return len(ended)


async def test_a_read_whose_pooled_connection_was_lost_is_made_again_on_a_new_one(
    postgres_database: str,
) -> None:
    # After the server ended the store's sessions (its restart, pg_terminate_backend), the
    # first read on each dead pooled connection failed ("terminating connection due to
    # administrator command"): a fleet counted the run's failed drive as its driver's death.
    async with treadle.open_postgres_store(postgres_database) as store:
        gen = await lease_generation(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=gen)
        assert len((await store.read_log("r")).records) == 1  # committed: a run to cancel
        await store.append_control(CancelRequested(run_id="r", ts=TS, reason="stop"))
        await store.submit("q", agent="calc", input=(Message(role="user", content="hi"),))
        reads: list[tuple[str, Callable[[], Any]]] = [
            ("read_log", lambda: store.read_log("r")),
            ("read_summary", lambda: store.read_summary("r")),
            ("read_control", lambda: store.read_control("r")),
            ("read_lease", lambda: store.read_lease("r")),
            ("read_submission", lambda: store.read_submission("q")),
            ("list_summaries", store.list_summaries),
            ("count_runs", store.count_runs),
            ("control_heads", lambda: store.control_heads(["r"])),
            ("read_generations", lambda: store.read_generations("r")),
            ("list_runs", store.list_runs),
        ]
        for name, read in reads:
            assert end_pooled_sessions(postgres_database) >= 1, name  # the last read's
            assert await read(), name
        # The log load of a run's first write after its lease was taken is a read too.
        gen = await lease_generation(store, "s")
        assert end_pooled_sessions(postgres_database) >= 1
        await store.write_run_started(started("s"), seq=1, generation=gen)
        assert len((await store.read_log("s")).records) == 1
        # A write is never run again (its outcome may be unknown): it fails, as before; the
        # pool's other idle connections went with the lost one, so the next call succeeds.
        assert end_pooled_sessions(postgres_database) >= 1
        with pytest.raises(treadle.StoreError, match="terminating connection"):
            await store.append_control(CancelRequested(run_id="r", ts=TS, reason="again"))
        await store.append_control(CancelRequested(run_id="r", ts=TS, reason="again"))
        assert [entry.position for entry in await store.read_control("r")] == [1, 2]


async def every_token_back(*limiters: trio.CapacityLimiter) -> None:
    """Wait until no token of ``limiters`` is borrowed (taking each one, then giving it back)."""
    for limiter in limiters:
        holders = [object() for _ in range(int(limiter.total_tokens))]
        for holder in holders:
            await limiter.acquire_on_behalf_of(holder)
        for holder in holders:
            limiter.release_on_behalf_of(holder)


class _StallingRelay:
    """A TCP relay to the test's server that can stop passing bytes on, both ways.

    As a server whose processes are stopped (SIGSTOP) or stuck on their storage: its
    connections stay up, since the kernel still answers at the TCP level (no keepalive or
    ``tcp_user_timeout`` ever fires), and nothing comes back. ``dsn`` connects through it.
    """

    def __init__(self, dsn: str) -> None:
        target = psycopg.conninfo.conninfo_to_dict(dsn)
        self._host = str(target.get("host") or "localhost")
        self._port = int(target.get("port") or 5432)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self.dsn = psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=port)
        self.asked = threading.Event()  # a client sent bytes while the relay was stalled
        self._passing = threading.Event()
        self._passing.set()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        """Pass nothing on from now, until `resume`."""
        self.asked.clear()
        self._passing.clear()

    def resume(self) -> None:
        """Pass on what came meanwhile, and what comes."""
        self._passing.set()

    def close(self) -> None:
        """Stop relaying: every relayed connection ends."""
        self.resume()
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = self._connect()
            self._sockets += [client, server]
            for source, sink, asks in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pass, args=(source, sink, asks), daemon=True).start()

    def _connect(self) -> socket.socket:
        """A connection to the server: its TCP port, or its socket in a directory."""
        if not self._host.startswith("/"):
            return socket.create_connection((self._host, self._port))
        server = socket.socket(socket.AF_UNIX)
        server.connect(f"{self._host}/.s.PGSQL.{self._port}")
        return server

    def _pass(self, source: socket.socket, sink: socket.socket, asks: bool) -> None:
        try:
            while data := source.recv(65536):
                if not self._passing.is_set():
                    if asks:
                        self.asked.set()
                    self._passing.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


async def test_a_call_to_a_server_that_stopped_answering_returns_when_cancelled(
    postgres_dsn: str, postgres_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that stopped answering (its processes stopped, its storage stuck) with its
    connections still up: a store call cancelled meanwhile waited for its thread until the
    server answered again, so ``move_on_after`` did not return, a worker ignored SIGTERM
    past its drain and ``treadle wait --timeout`` never ended. It returns at once, a write
    whose run was loading too (nothing of it is written); its thread ends once the server
    answers, and its connection is then closed, not pooled."""
    caplog.set_level(logging.INFO, logger="treadle.stores")
    relay = _StallingRelay(postgres_dsn)
    returned: list[str] = []
    scopes: list[trio.CancelScope] = []

    async def cut(name: str, call: Callable[[], Any]) -> None:
        with trio.CancelScope() as own:
            scopes.append(own)
            await call()
        returned.append(name)

    try:
        async with treadle.open_postgres_store(relay.dsn, schema=postgres_schema) as store:
            assert await store.read_summary("r") is None
            (pooled,) = store._pool._idle  # the connection the next call takes
            gen = await lease_generation(store, "w")
            engine = store._engine
            relay.stall()
            async with trio.open_nursery() as nursery:
                try:
                    nursery.start_soon(cut, "read", lambda: store.read_summary("r"))
                    write = functools.partial(store.write_run_started, started("w"), seq=1)
                    nursery.start_soon(cut, "write", functools.partial(write, generation=gen))
                    with trio.fail_after(30):  # a call's bytes reached the stalled relay
                        await trio.to_thread.run_sync(relay.asked.wait, abandon_on_cancel=True)
                    await trio.testing.wait_all_tasks_blocked()  # both wait on their threads
                    for scope in scopes:
                        scope.cancel()
                    await trio.testing.wait_all_tasks_blocked()
                    assert sorted(returned) == ["read", "write"]  # before: once answered
                    assert engine.workers.borrowed_tokens == 0  # their places are free
                    assert engine.left.borrowed_tokens >= 1  # what reached the relay waits
                finally:
                    relay.resume()
            with trio.fail_after(30):  # the threads end, once answered
                await every_token_back(engine.workers, engine.left)
            assert pooled.closed and pooled not in store._pool._idle
            assert await store.read_summary("r") is None  # on a new connection
            assert (await store.read_log("w")).records == ()  # the write was never queued
            await store.write_run_started(started("w"), seq=1, generation=gen)
            assert len((await store.read_log("w")).records) == 1
    finally:
        relay.close()
    # the call that reached the relay (the read, or the load) says how it ended
    assert "given up on by its caller while it ran, ended afterwards" in caplog.text


async def test_calls_given_up_on_give_their_places_back_up_to_a_bound_and_close_connections(
    postgres_dsn: str,
    postgres_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An abandoned call's thread keeps trio's limiter token until it ends: calls stuck on a
    server that answers nothing would hold the store object's places (the one of its lease
    and control calls too) for as long. Given up on, a call gives its place back at once, up
    to `MAX_LEFT_CALLS` calls left running; the connections they used are closed when their
    threads end, never pooled."""
    caplog.set_level(logging.INFO, logger="treadle.stores")
    entered: queue.SimpleQueue[Any] = queue.SimpleQueue()
    release = threading.Event()
    read = _sql.read_summary

    def read_that_blocks(dialect: Any, conn: Any, run_id: str) -> Any:
        if run_id.startswith("stuck"):
            entered.put(conn)
            release.wait()  # a server that answers nothing, until the test lets it
        return read(dialect, conn, run_id)

    monkeypatch.setattr(_sql, "read_summary", read_that_blocks)
    returned: list[str] = []
    used: list[Any] = []

    async def cancelled_read(run_id: str, scope: trio.CancelScope) -> None:
        with scope:
            await store.read_summary(run_id)
        returned.append(run_id)

    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        engine = store._engine
        async with trio.open_nursery() as nursery:
            try:
                for n in range(_engine.MAX_LEFT_CALLS + 1):
                    scope = trio.CancelScope()
                    nursery.start_soon(cancelled_read, f"stuck-{n}", scope)
                    with trio.fail_after(30):
                        conn = await trio.to_thread.run_sync(entered.get, abandon_on_cancel=True)
                    used.append(conn)
                    scope.cancel()
                    await trio.testing.wait_all_tasks_blocked()
                    assert returned[-1:] == [f"stuck-{n}"]  # before: still waiting
                    if n == 0:  # its place is free: another call runs meanwhile
                        assert engine.workers.borrowed_tokens == 0
                        assert engine.left.borrowed_tokens == 1
                        assert await store.read_summary("other") is None
                # past MAX_LEFT_CALLS calls left running, the last one kept its place
                assert engine.workers.borrowed_tokens == 1
                assert engine.left.borrowed_tokens == _engine.MAX_LEFT_CALLS
            finally:
                release.set()  # the server answers again
        with trio.fail_after(30):  # the threads end on their own and give their tokens back
            await every_token_back(engine.workers, engine.left)
        for conn in used:  # closed when its thread ended, not handed back to the pool
            assert conn.closed and conn not in store._pool._idle
        assert await store.read_summary("other") is None
    assert caplog.text.count("given up on by its caller while it ran, ended afterwards") == len(
        used
    )


class _LostAfterCommit(postgres.PostgresBackend):
    """The connection drops right after the server committed: the outcome looks unknown."""

    drops = 1

    def _statement(self, groups, **held):  # type: ignore[no-untyped-def]
        committed = super()._statement(groups, **held)
        if self.drops:
            self.drops -= 1
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return committed


async def test_a_commit_whose_outcome_was_lost_is_read_back_not_repeated(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "PostgresBackend", _LostAfterCommit)
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        gen = await lease_generation(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=gen)
        await store.write_intent(intent("r", 1), seq=2, generation=gen)  # lost after COMMIT
        await store.write_intent(intent("r", 2), seq=3, generation=gen)  # the next goes on
        log = await store.read_log("r")
        generations = await store.read_generations("r")
    assert [type(r).__name__ for r in log.records] == ["RunStarted", "ModelIntent", "ModelIntent"]
    assert generations == (gen, gen, gen)


async def test_a_stale_writer_is_filtered_inside_a_shared_batch(
    postgres_dsn: str, postgres_schema: str
) -> None:
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        old = await store.acquire_lease("stale", owner="a", ttl_s=600)
        await store.write_run_started(started("stale"), seq=1, generation=old.generation)
        await store.release_lease(old)
        await store.acquire_lease("stale", owner="b", ttl_s=600)
        others = [f"ok{n}" for n in range(5)]
        gens = {run_id: await lease_generation(store, run_id) for run_id in others}
        outcomes: dict[str, BaseException | None] = {}

        async def write(run_id: str, generation: int, seq: int) -> None:
            try:
                await store.write_intent(intent(run_id, 1), seq=seq, generation=generation)
            except treadle.TreadleError as exc:
                outcomes[run_id] = exc
            else:
                outcomes[run_id] = None

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, "stale", old.generation, 2)
            for run_id in others:
                nursery.start_soon(write, run_id, gens[run_id], 1)
        commits = store.statistics().commits
    assert isinstance(outcomes["stale"], treadle.LeaseLost)
    assert all(outcomes[run_id] is None for run_id in others)
    assert commits >= 1


async def test_a_newer_schema_is_refused(postgres_dsn: str, postgres_schema: str) -> None:
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema):
        pass
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        admin.execute(f"UPDATE {postgres_schema}.meta SET value = '99' WHERE key = 'layout'")
    with pytest.raises(treadle.SchemaTooNew) as info:
        await PostgresStore.open(postgres_dsn, schema=postgres_schema)
    # it said "log written with schema version 99", naming neither the store nor its tables
    said = str(info.value)
    assert said.startswith("the table layout of PostgreSQL store ") and postgres_schema in said
    assert "is at version 99, written by a newer treadle" in said and "upgrade treadle" in said


@pytest.mark.parametrize("layout", ["1", "0", "-3"])
async def test_a_layout_no_postgresql_store_had_is_refused(
    postgres_dsn: str, postgres_schema: str, layout: str
) -> None:
    """A meta table changed by hand to an older layout was used as it was."""
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema):
        pass
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        admin.execute(
            f"UPDATE {postgres_schema}.meta SET value = %s WHERE key = 'layout'", (layout,)
        )
    with pytest.raises(treadle.StoreError, match="which no PostgreSQL store had"):
        await PostgresStore.open(postgres_dsn, schema=postgres_schema)


@pytest.mark.parametrize("old_layout", ["2", "3"])
async def test_an_older_layout_schema_is_marked_4_and_its_rows_read_as_written(
    postgres_dsn: str, postgres_schema: str, old_layout: str
) -> None:
    """Rows written before the compact encoding (JSON objects) are read as they are; new rows
    of the same run are compact; the mark makes an older treadle refuse the schema
    (docs/crash-safety.md, "Versions": a layout-3 treadle met rows of record schema 3 it
    could not decode and called them damaged)."""
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema):
        pass
    old = [started("old"), intent("old", 1)]
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        admin.execute(
            f"UPDATE {postgres_schema}.meta SET value = %s WHERE key = 'layout'", (old_layout,)
        )
        admin.execute(
            f"INSERT INTO {postgres_schema}.runs(run_id, next_seq, state) "
            "VALUES ('old', 3, 'running')"
        )
        for seq, record in enumerate(old, start=1):
            kind, body = KIND_OF[type(record)], encode_bytes(record)
            admin.execute(
                f"INSERT INTO {postgres_schema}.records(run_id, seq, gen, kind, body, crc) "
                "VALUES ('old', %s, 0, %s, %s, %s)",
                (seq, kind, body, record_crc("old", seq, 0, kind, body)),
            )
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        assert (await store.read_log("old")).records == tuple(old)
        gen = await lease_generation(store, "old")
        await store.write_intent(intent("old", 2), seq=3, generation=gen)
        assert (await store.read_log("old")).records == (*old, intent("old", 2))
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        layout = admin.execute(
            f"SELECT value FROM {postgres_schema}.meta WHERE key = 'layout'"
        ).fetchone()
        kinds = admin.execute(
            f"SELECT kind, body FROM {postgres_schema}.records WHERE run_id = 'old' ORDER BY seq"
        ).fetchall()
    assert layout == (str(_sql.LAYOUT_VERSION),) == ("4",)
    assert [k for k, _ in kinds] == ["run_started", "model_intent", "mi"]
    assert bytes(kinds[-1][1]).startswith(b'["mi",1,2,')


async def _at_layout(dsn: str, schema: str, layout: str) -> None:
    """A store in ``schema`` whose meta table says ``layout``, as an older treadle left it."""
    async with treadle.open_postgres_store(dsn, schema=schema):
        pass
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"UPDATE {schema}.meta SET value = %s WHERE key = 'layout'", (layout,))


def _layout_of(dsn: str, schema: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute(f"SELECT value FROM {schema}.meta WHERE key = 'layout'").fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("old_layout", ["2", "3"])
async def test_an_older_layout_schema_is_marked_4_by_an_open_that_creates_nothing(
    postgres_dsn: str, postgres_schema: str, old_layout: str
) -> None:
    """Every command of the command line opens with ``create=False``: `treadle approve` and
    `treadle resume` wrote rows of record schema 3 into a layout-3 schema left at 3, and a
    layout-3 treadle then read the run as damaged ("record 17 (rf) does not decode") instead
    of refusing the schema as too new (docs/crash-safety.md, "Versions")."""
    await _at_layout(postgres_dsn, postgres_schema, old_layout)
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema, create=False):
        assert _layout_of(postgres_dsn, postgres_schema) == str(_sql.LAYOUT_VERSION) == "4"


async def test_treadles_opening_an_older_layout_schema_at_once_all_open_it_marked(
    postgres_dsn: str, postgres_schema: str
) -> None:
    await _at_layout(postgres_dsn, postgres_schema, "3")
    opened: list[int] = []

    async def open_one() -> None:
        async with treadle.open_postgres_store(
            postgres_dsn, schema=postgres_schema, create=False
        ) as store:
            assert await store.list_runs() == ()
            opened.append(1)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(open_one)
    assert len(opened) == 6
    assert _layout_of(postgres_dsn, postgres_schema) == "4"


async def test_an_older_layout_schema_that_cannot_be_marked_is_not_opened(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """A read-only session (a role without the privilege, a standby) cannot mark the schema:
    opening it would let this treadle's rows into a schema an older treadle still reads."""
    await _at_layout(postgres_dsn, postgres_schema, "3")
    read_only = psycopg.conninfo.make_conninfo(
        postgres_dsn, options="-c default_transaction_read_only=on"
    )
    with pytest.raises(treadle.StoreRefused) as info:
        await PostgresStore.open(read_only, schema=postgres_schema, create=False)
    said = str(info.value)
    assert "its tables are of the layout 3, which this treadle marks 4" in said
    assert "read-only transaction" in said and "treadle:treadle@" not in said
    assert _layout_of(postgres_dsn, postgres_schema) == "3"


@pytest.mark.parametrize("failure", ["wrong password", "nothing listens"])
async def test_the_password_is_never_shown(postgres_dsn: str, failure: str) -> None:
    """The server refuses the password (it must ask for one: `.ci/run` uses scram-sha-256 on
    TCP), or no server answers at all: either error names the DSN with the password masked."""
    wrong = postgres_dsn.replace("treadle:treadle@", "treadle:not-the-secret-zz9@")
    assert wrong != postgres_dsn
    if failure == "nothing listens":
        with socket.socket() as probe:  # a port nobody listens on (bound, never listened)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        wrong = re.sub(r"@127\.0\.0\.1:\d+/", f"@127.0.0.1:{port}/", wrong)
        assert f":{port}/" in wrong
    with pytest.raises(treadle.StoreError) as info:
        await PostgresStore.open(wrong, schema="public")
    assert "not-the-secret-zz9" not in str(info.value)
    assert "***" in str(info.value)


@pytest.mark.parametrize(
    "password", ["50%off-hunter22", "my hunter22", "pa/hunter22", "pa@hunter22"]
)
async def test_a_password_written_raw_in_a_url_is_never_shown(
    postgres_dsn: str, password: str
) -> None:
    """A raw '%', space, '/' or '@' in a URL's password: the DSN cannot be read, or libpq
    misreads it (a host 'hunter22@127.0.0.1'); its message quoted the password, and the
    DSN's redaction stopped at the '/' or the first '@'."""
    wrong = postgres_dsn.replace("treadle:treadle@", f"treadle:{password}@")
    with pytest.raises((treadle.StoreError, treadle.UsageError)) as info:
        await PostgresStore.open(wrong, schema="public")
    assert "hunter22" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize("password", ["p@ss/word", "p@ss", "ab/cd", "x@y@z"])
async def test_a_raw_at_or_slash_in_a_url_password_is_refused_before_connecting(
    postgres_dsn: str, password: str
) -> None:
    """libpq ends the user information at the first '@': it connected to host 'ss' and named
    it in its error, two characters of the password too short to be masked."""
    wrong = postgres_dsn.replace("treadle:treadle@", f"treadle:{password}@")
    with pytest.raises(treadle.UsageError, match="is written %25, %20, %2F or %40") as info:
        await PostgresStore.open(wrong, schema="public")
    said = str(info.value)
    assert password not in said and "treadle:***@127.0.0.1:" in said  # hidden whole
    assert "host" not in said  # no host libpq made of a piece of the password
    escaped = postgres_dsn.replace(
        "treadle:treadle@", "treadle:" + password.replace("@", "%40").replace("/", "%2F") + "@"
    )
    with pytest.raises(treadle.StoreError, match="password authentication failed"):
        await PostgresStore.open(escaped, schema="public")  # read as meant: a wrong password


@pytest.mark.parametrize(
    ("dsn", "said"),
    [
        (
            "postgresql://treadle@127.0.0.1:54329/db?connect_timout=3",
            'invalid URI query parameter: "connect_timout"',
        ),
        ("postgresql://[::1:54329/db", 'looking for matching "]" in IPv6 host address'),
        ("postgresql://u:hunter22@[::1:54329/db", '"postgresql://u:***@[::1:54329/db"'),
        ("postgresql://u%zz:hunter22@h/db", 'invalid percent-encoded token: "u%zz"'),
        # the user and the database share the password's text: libpq's quote of the URL
        # was scrubbed after its redaction, "***ql://***:***@[::1:54329/***_prod"
        ("postgresql://postgres:postgres@[::1:54329/postgres_prod", '"postgresql://postgres:***@['),
    ],
)
def test_a_url_unreadable_for_another_reason_than_its_password_says_libpqs_complaint(
    dsn: str, said: str
) -> None:
    """A misspelt query parameter or an unclosed '[' was reported as a password that needs
    escaping (every URL libpq could not read was)."""
    from treadle.stores.postgres import _check_readable

    with pytest.raises(treadle.UsageError) as info:
        _check_readable(dsn)
    message = str(info.value)
    assert said in message and "%25" not in message
    assert "hunter22" not in message


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://postgres:postgres@127.0.0.1:{port}/postgres_prod",
        "host=127.0.0.1 port={port} user=postgres password=postgres dbname=postgres_prod",
    ],
)
async def test_a_refused_connection_names_a_user_and_database_that_share_the_password(
    dsn: str,
) -> None:
    """The pieces of the password were hidden across the whole message, the store's own
    redacted description included: ``cannot connect to PostgreSQL store
    ***ql://***:***@127.0.0.1:1/***_prod`` named no user, database or even scheme."""
    from treadle.stores import redact_dsn

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
        dsn = dsn.format(port=closed.getsockname()[1])
        with pytest.raises(treadle.StoreError) as info:
            await PostgresStore.open(dsn, schema="public")
    said = str(info.value)
    assert f"cannot connect to PostgreSQL store {redact_dsn(dsn)} (schema public): " in said
    assert ":postgres@" not in said and "password=postgres" not in said


@pytest.mark.parametrize("password", ["50%off", "p%zz", "my pass", "100%"])
def test_a_url_unreadable_for_its_password_says_how_to_write_it(password: str) -> None:
    from treadle.stores.postgres import _check_readable

    with pytest.raises(treadle.UsageError, match="is written %25, %20, %2F or %40") as info:
        _check_readable(f"postgresql://u:{password}@h/db")
    assert password not in str(info.value)


def test_a_dsn_is_told_from_a_path_and_its_password_hidden_however_written() -> None:
    from treadle.stores import is_dsn, redact_dsn

    assert is_dsn("port=5432 password=hunter22") and is_dsn("sslmode=require host=db")
    assert not is_dsn("runs.db") and not is_dsn("./data/runs")
    hidden = {
        "postgresql://u:pa/hunter22@h/db": "postgresql://u:***@h/db",
        "postgresql://u:p@hunter22@h/db": "postgresql://u:***@h/db",
        "postgresql://u@h/db?%70assword=hunter22&x=1": "postgresql://u@h/db?%70assword=***&x=1",
        "port=5432 password=hunter22": "port=5432 password=***",
        # a raw space in an unquoted password: libpq cannot read it; it is hidden whole
        "host=h password=hun ter22 dbname=d": "host=h password=*** dbname=d",
        "host=h password='hun ter22' dbname=d": "host=h password=*** dbname=d",
    }
    for dsn, shown in hidden.items():
        assert redact_dsn(dsn) == shown


def test_the_password_of_the_ssl_key_is_hidden_as_the_roles_is() -> None:
    # `sslpassword` (the passphrase of the client's SSL key) was printed in every store
    # error message, in a URL's query string and in keywords alike.
    from treadle.stores import redact_dsn
    from treadle.stores._dsn import scrub_password

    hidden = {  # DSN: (as shown, the SSL key's password as a driver may quote it)
        "postgresql://u:hunter22@h/db?sslpassword=keypass9&sslmode=require": (
            "postgresql://u:***@h/db?sslpassword=***&sslmode=require",
            "keypass9",
        ),
        "postgresql://u@h/db?SSL%70assword=keypass9": (
            "postgresql://u@h/db?SSL%70assword=***",
            "keypass9",
        ),
        "host=h password=hunter22 sslpassword=keypass9 dbname=d": (
            "host=h password=*** sslpassword=*** dbname=d",
            "keypass9",
        ),
        "host=h SSLPassword = 'key pass9' dbname=d": (
            "host=h SSLPassword = *** dbname=d",
            "key pass9",
        ),
    }
    for dsn, (shown, password) in hidden.items():
        assert redact_dsn(dsn) == shown
        said = scrub_password(f"could not decrypt the SSL key with {password}", dsn)
        assert "pass9" not in said and "hunter22" not in said


@pytest.mark.parametrize(
    ("dsn", "said"),
    [
        ("host=127.0.0.1 password=hunter22 foo=bar", 'invalid connection option "foo"'),
        ("host=127.0.0.1 password=hun ter22 dbname=d", 'missing "=" after "***"'),
        ("postgresql://u:50%off-hunter22@127.0.0.1/d", "in a URL, a '%'"),
    ],
)
async def test_a_dsn_libpq_cannot_read_is_refused_with_its_reason_and_no_password(dsn, said):
    """A key=value DSN with an unknown keyword got the hint about escaping a URL's password."""
    with pytest.raises(treadle.UsageError) as info:
        await PostgresStore.open(dsn, schema="public")
    assert said in str(info.value)
    assert "hunter22" not in str(info.value) and "ter22" not in str(info.value)


async def test_an_invalid_schema_name_is_refused(postgres_dsn: str) -> None:
    with pytest.raises(treadle.UsageError, match="schema"):
        await PostgresStore.open(postgres_dsn, schema="Robert'); DROP TABLE runs;--")


async def test_lease_writes_do_not_wait_for_their_wal_flush(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renewals and releases commit with synchronous_commit off (docs/decisions/0016); an
    acquisition, the log's group commits and control appends keep the server's setting (on):
    a driver outlives a server crash, so an acquisition lost with it could hand out its
    generation twice."""
    seen: list[str] = []
    real = _sql.write_transaction.__enter__

    def enter(self: _sql.write_transaction) -> None:
        real(self)
        seen.append(self._conn.execute("SHOW synchronous_commit").fetchone()[0])

    monkeypatch.setattr(_sql.write_transaction, "__enter__", enter)
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        lease = await store.acquire_lease("r", owner="o", ttl_s=30)
        await store.write_run_started(started("r"), seq=1, generation=lease.generation)
        (lease,) = await store.renew_leases([lease], ttl_s=30)
        await store.release_lease(lease)
        await store.append_control(CancelRequested(run_id="r", ts=TS, reason="test"))
    assert seen == ["on", "off", "off", "on"]


async def test_the_schema_comes_from_the_dsn_options(
    postgres_dsn: str, postgres_schema: str
) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(postgres_dsn)
    params["options"] = f"-c search_path={postgres_schema} -c statement_timeout=60000"
    dsn = make_conninfo(**params)
    async with treadle.open_postgres_store(dsn) as store:
        assert f"schema {postgres_schema}" in store.description
        gen = await lease_generation(store, "r")
        await store.write_intent(intent("r", 1), seq=1, generation=gen)
    with psycopg.connect(postgres_dsn) as admin:
        (count,) = admin.execute(f"SELECT count(*) FROM {postgres_schema}.records").fetchone()
    assert count == 1


def _locked(dsn: str, schema: str, run_id: str) -> bool:
    """Whether another transaction holds ``run_id``'s ``runs`` row lock (probed with NOWAIT)."""
    with psycopg.connect(dsn, options=f"-c search_path={schema}") as probe:
        try:
            probe.execute("SELECT 1 FROM runs WHERE run_id = %s FOR UPDATE NOWAIT", (run_id,))
        except psycopg.errors.LockNotAvailable:
            return True
        probe.rollback()
        return False


async def _waiting_for_a_lock(dsn: str, application: str, holder: int) -> None:
    """Until a session named ``application`` waits for a lock the backend ``holder`` holds
    (not a lock of a test running beside this one on the same server)."""
    with trio.fail_after(30):
        while True:
            with psycopg.connect(dsn, autocommit=True) as admin:
                waiting = admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = %s "
                    "AND %s = ANY(pg_blocking_pids(pid))",
                    (application, holder),
                ).fetchall()
            if waiting:
                return
            await trio.sleep(0.02)


@pytest.mark.parametrize("what", ["commit", "renewal"])
async def test_a_commit_and_a_renewal_lock_their_runs_rows_in_run_id_order(
    postgres_dsn: str, postgres_schema: str, what: str
) -> None:
    # Both take the row locks of several runs in one transaction. Taken in an order of their
    # own (a batch's order of first writes, the order of the leases asked), the renewal and
    # the group commit deadlocked under load and the runs of the batch failed. The commit now
    # takes the free rows without waiting and commits their runs; it waits for a held row
    # alone, so it holds no other row meanwhile.
    from treadle.stores import _sql
    from treadle.stores._engine import Write

    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        leases = {r: await store.acquire_lease(r, owner="o", ttl_s=600) for r in "abc"}
        for run_id, lease in leases.items():
            await store.write_run_started(started(run_id), seq=1, generation=lease.generation)
        # run-started is not a barrier: under load it could still be in flight when the row
        # of 'b' is locked below, and its own commit then waited for that lock and failed
        await store._engine.settle()
        dialect, pool = store._dialect, store._pool
        application = f"test {what}"
        with dialect.connect(application) as conn:  # closed however the test ends
            if what == "commit":
                backend = postgres.PostgresBackend(dialect, conn, pool)
                writes = [
                    Write(
                        run_id=r,
                        seq=2,
                        generation=leases[r].generation,
                        records=(intent(r, 1),),
                        payload=_sql.encode_values(r, 2, leases[r].generation, (intent(r, 1),)),
                        barrier=True,
                        closes=False,
                        delta=None,
                    )
                    for r in "cba"  # the batch's order
                ]
                job = functools.partial(backend.commit, writes)
            else:  # through the store (its pooled connections are named "treadle")
                application = "treadle"
                ordered = [leases[r] for r in "cba"]
                renew = functools.partial(store.renew_leases, ordered, ttl_s=600)
                job = functools.partial(trio.from_thread.run, renew)
            with psycopg.connect(
                postgres_dsn, options=f"-c search_path={postgres_schema}"
            ) as other:
                other.execute("SELECT 1 FROM runs WHERE run_id = 'b' FOR UPDATE")
                done: dict[str, object] = {}

                async def run_job() -> None:
                    done["out"] = await trio.to_thread.run_sync(job)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_job)
                    try:
                        holder = other.info.backend_pid
                        await _waiting_for_a_lock(postgres_dsn, application, holder)  # for 'b'
                        held = [_locked(postgres_dsn, postgres_schema, r) for r in "ac"]
                        durable = _records(postgres_dsn, postgres_schema)
                    finally:
                        other.rollback()  # 'b' is free: the job goes on and ends
        if what == "commit":
            assert held == [False, False]  # 'a' and 'c' committed, not waiting for 'b'
            assert (durable["a"], durable["c"]) == (2, 2)  # started, and the intent of the batch
        else:
            assert held == [True, False]  # 'a' taken before waiting for 'b', 'c' not yet
        if what == "commit":
            assert [w.error for w in writes] == [None, None, None]
            logs = [await store.read_log(r) for r in "abc"]
            assert [len(log.records) for log in logs] == [2, 2, 2]
        else:
            assert sorted(lease.run_id for lease in done["out"]) == ["a", "b", "c"]


def _records(dsn: str, schema: str) -> dict[str, int]:
    """How many records each run has, read by another connection."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT run_id, count(*) FROM {schema}.records GROUP BY run_id")
        return {run_id: int(n) for run_id, n in rows.fetchall()}


class _Refused(Exception):
    """A driver error with a SQLSTATE, as psycopg's errors carry it."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def test_a_transaction_ended_as_a_deadlock_victim_is_made_again_and_nothing_else_is() -> None:
    from treadle.stores import _sql

    tries: list[int] = []

    def transaction(failures: int, sqlstate: str) -> str:
        tries.append(1)
        if len(tries) <= failures:
            raise _Refused(sqlstate)
        return "committed"

    assert _sql.again_on_deadlock(lambda: transaction(2, "40P01")) == "committed"
    assert len(tries) == 3
    tries.clear()
    with pytest.raises(_Refused):  # another error: not made again
        _sql.again_on_deadlock(lambda: transaction(1, "23505"))
    assert len(tries) == 1
    tries.clear()
    with pytest.raises(_Refused):  # deadlocked every time: the last one is raised
        _sql.again_on_deadlock(lambda: transaction(99, "40P01"))
    assert len(tries) == _sql.DEADLOCK_RETRIES + 1


async def test_opening_a_store_at_its_layout_takes_no_lock_on_its_tables(
    postgres_dsn: str, postgres_schema: str
) -> None:
    # Every open ran the schema's DDL: CREATE INDEX IF NOT EXISTS waits for writers of
    # `runs` to finish, and every commit of the fleet then queued behind it (a worker paused
    # in a commit, plus any CLI command, stalled them all).
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema):
        pass  # lays the schema out
    with psycopg.connect(postgres_dsn, autocommit=True) as writer:
        writer.execute(f"SET search_path = {postgres_schema}")
        writer.execute("BEGIN")
        writer.execute("LOCK TABLE runs IN ROW EXCLUSIVE MODE")  # as a commit in flight
        with trio.fail_after(60):  # before: until the writer's transaction ended
            async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
                assert await store.list_runs() == ()
        writer.execute("ROLLBACK")


async def test_a_connection_paused_inside_a_transaction_is_ended_by_the_server(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped in the middle of a commit (SIGSTOP) kept its row locks for as long
    as it stayed stopped: no other worker could take its runs over."""
    monkeypatch.setattr(postgres, "IDLE_IN_TRANSACTION_S", 1)
    dialect = postgres.PostgresDialect(postgres_dsn, postgres_schema)
    paused = dialect.connect("treadle paused")
    pid = paused.execute("SELECT pg_backend_pid()").fetchone()[0]
    paused.execute("BEGIN")
    paused.execute("SELECT 1")  # then nothing more: the process is stopped
    with psycopg.connect(postgres_dsn, autocommit=True) as admin, trio.fail_after(60):
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():  # noqa: ASYNC110 (polling the server)
            await trio.sleep(0.1)
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
        paused.execute("SELECT 1")
    paused.close()


class _Clock:
    """The committer's clock: its sleeps move it on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        monkeypatch.setattr(postgres.time, "sleep", self.sleep)
        monkeypatch.setattr(postgres.time, "monotonic", lambda: self.now)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class _Conn:
    """A connection whose read-back loses it while ``drop`` says so (at the clock's time)."""

    def __init__(self, drop: Callable[[], bool]) -> None:
        self.drop = drop
        self.closed = self.broken = False

    def execute(self, sql: str, params: object = None) -> Any:
        if self.drop():
            self.broken = True
            raise psycopg.errors.AdminShutdown("terminating connection")
        return self

    def fetchall(self) -> list[tuple[str, int, int]]:
        return [("r", 3, 1)]

    def fetchone(self) -> tuple[int]:
        return (1,)

    def close(self) -> None:
        self.closed = True


def _read_back_once(connect: Callable[[], Any]) -> set[str]:
    """`PostgresBackend._read_back` of run ``r``'s write at seq 2 (generation 1)."""
    committer = postgres.PostgresBackend.__new__(postgres.PostgresBackend)
    dialect = type("Dialect", (), {"connect": lambda self, application: connect()})()
    committer._conn, committer._dialect, committer.description = _Conn(bool), dialect, "store"
    group = type("Group", (), {"run_id": "r", "stop": 3, "generation": 1, "writes": []})()
    return committer._read_back([group], psycopg.OperationalError("gone"))  # type: ignore[list-item]


def test_the_committer_keeps_trying_to_reconnect_through_a_server_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It gave up after five attempts (about 3 s): its thread ended, and the worker went on
    claiming runs that could never be written (each quarantined in the end)."""
    clock = _Clock(monkeypatch)
    back_at = [20.0]  # the server is back 20 s after the connection was lost

    def connect() -> _Conn:
        if clock.now < back_at[0]:
            raise psycopg.OperationalError("connection refused")
        return _Conn(lambda: False)

    assert _read_back_once(connect) == {"r"}
    assert len(clock.slept) > 5 and max(clock.slept) <= 5.0
    clock.now, back_at[0] = 0.0, float("inf")  # a server that never comes back
    with pytest.raises(treadle.StoreError, match="could not be made again in 60 s"):
        _read_back_once(connect)
    assert 55.0 <= clock.now <= 60.0


def test_a_read_back_that_loses_its_new_connection_is_tried_again_in_the_same_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The committer read back which commits happened on its new connection with no handler:
    a connection ended again there (a server restarting twice, an administrator ending the
    committer's connections) killed the committer thread, and every worker exited."""
    clock = _Clock(monkeypatch)
    connects: list[float] = []

    def connect() -> _Conn:  # each new connection is ended during its read-back for 10 s
        connects.append(clock.now)
        return _Conn(lambda: clock.now < 10.0)

    assert _read_back_once(connect) == {"r"}
    assert len(connects) > 3 and max(clock.slept) <= 5.0
    clock.now, connects[:] = 0.0, []
    with pytest.raises(treadle.StoreError, match="could not be made again in 60 s"):
        _read_back_once(lambda: _Conn(lambda: True))  # never reads back
    assert 55.0 <= clock.now <= 60.0


class _ReadBackLost(_LostAfterCommit):
    """The connection drops after the commit, and the first two read-backs lose theirs."""

    read_backs_lost = 2

    def _committed(self, groups):  # type: ignore[no-untyped-def]
        if type(self).read_backs_lost:
            type(self).read_backs_lost -= 1
            self._conn.close()
            raise psycopg.errors.AdminShutdown("terminating connection due to administrator")
        return super()._committed(groups)


async def test_a_commit_whose_read_back_loses_the_connection_again_lands_once(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "PostgresBackend", _ReadBackLost)
    monkeypatch.setattr(_ReadBackLost, "read_backs_lost", 2)
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        gen = await lease_generation(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=gen)
        await store.write_intent(intent("r", 1), seq=2, generation=gen)  # lost, read back x3
        await store.write_intent(intent("r", 2), seq=3, generation=gen)  # the committer lives
        log = await store.read_log("r")
    assert _ReadBackLost.read_backs_lost == 0
    assert [type(r).__name__ for r in log.records] == ["RunStarted", "ModelIntent", "ModelIntent"]


async def test_the_cli_never_shows_the_password_of_its_store(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """``treadle show`` of a missing run printed the DSN as given, and ``treadle tail`` its
    hint for approving a parked run too: both with the password in clear."""
    from click.testing import CliRunner

    from treadle._cli_runs import _hint_approval
    from treadle.cli import main
    from treadle.types import ApprovalRequested

    password = postgres_dsn.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert password
    sep = "&" if "?" in postgres_dsn else "?"
    dsn = f"{postgres_dsn}{sep}options=-csearch_path%3D{postgres_schema}"
    async with treadle.open_postgres_store(dsn) as store:  # a run parked on an approval
        lease = await store.acquire_lease("parked", owner="gone", ttl_s=60)
        ts = "2026-01-01T00:00:00+00:00"
        started = RunStarted(run_id="parked", ts=ts, input=(), snapshot={})
        await store.write_run_started(started, seq=1, generation=lease.generation)
        asked = ApprovalRequested(
            run_id="parked",
            step=1,
            call_id="c1",
            tool="wire",
            arguments_digest="d",
            arguments={"amount": 5},
            deadline_ts="2027-01-01T00:00:00+00:00",
            ts=ts,
        )
        await store.write_control(asked, seq=2, generation=lease.generation)
        await store.release_lease(lease)
        log = await store.read_log("parked")
    out = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["show", "nosuch", "--store", dsn])
    )
    said: list[str] = []
    _hint_approval(log, None, dsn, said.append)  # what `tail` says while the run waits
    for text in (out.output, *said):
        assert f":{password}@" not in text and ":***@" in text, text
    assert "no run 'nosuch'" in out.output
    assert "treadle approve parked --store" in said[0]


class _OneRunFails(postgres.PostgresBackend):
    """Statements holding run ``bad`` fail while ``failing`` (the server refuses its row);
    the first statement, of run ``slow``, takes a while, so the others meet in one batch."""

    failing = True
    error: type[Exception] = psycopg.errors.DataError
    statements: list[list[str]] = []
    reconnects = 0

    def _connect(self):  # type: ignore[no-untyped-def]
        type(self).reconnects += 1
        super()._connect()

    def _statement(self, groups, **held):  # type: ignore[no-untyped-def]
        ids = sorted(g.run_id for g in groups)
        type(self).statements.append(ids)
        if ids == ["slow"]:
            time.sleep(0.3)
        if type(self).failing and "bad" in ids:
            raise type(self).error("the server refuses this row")
        return super()._statement(groups, **held)


@pytest.mark.parametrize(
    "error", [psycopg.errors.DataError, psycopg.errors.QueryCanceled], ids=["refused", "timeout"]
)
async def test_one_runs_failing_write_fails_only_that_run_and_it_can_be_driven_again(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch, error
) -> None:
    """One run's write failed the shared statement, and every run of the batch failed with it;
    the failed run's later drives in the same store object were refused for good."""
    monkeypatch.setattr(postgres, "PostgresBackend", _OneRunFails)
    monkeypatch.setattr(_OneRunFails, "statements", [])
    monkeypatch.setattr(_OneRunFails, "error", error)
    monkeypatch.setattr(_OneRunFails, "failing", True)
    monkeypatch.setattr(_OneRunFails, "reconnects", 0)
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        leases = {
            r: await store.acquire_lease(r, owner="w", ttl_s=60) for r in ("slow", "a", "b", "bad")
        }
        failures: dict[str, Exception] = {}

        async def start(run_id: str) -> None:
            generation = leases[run_id].generation
            try:
                await store.write_run_started(started(run_id), seq=1, generation=generation)
                await store.write_intent(intent(run_id, 1), seq=2, generation=generation)
            except treadle.StoreError as exc:  # the barrier reports the batch's failure
                failures[run_id] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start, "slow")
            await trio.sleep(0.05)  # the committer is in the slow statement: the rest queue
            for run_id in ("a", "b", "bad"):
                nursery.start_soon(start, run_id)
        assert any(len(ids) > 1 and "bad" in ids for ids in _OneRunFails.statements)
        assert set(failures) == {"bad"}
        # the statement's failure left the connection as it was: it was not made again
        assert _OneRunFails.reconnects == 0
        for run_id in ("slow", "a", "b"):
            assert (await store.read_log(run_id)).started is not None
        # The cause is gone: the same store object drives the failed run again.
        _OneRunFails.failing = False
        await store.release_lease(leases["bad"])
        again = await store.acquire_lease("bad", owner="w", ttl_s=60)
        await store.write_run_started(started("bad"), seq=1, generation=again.generation)
        await store.write_intent(intent("bad", 1), seq=2, generation=again.generation)
        log = await store.read_log("bad")
    assert [type(r).__name__ for r in log.records] == ["RunStarted", "ModelIntent"]


@pytest.mark.parametrize("revoked", ["UPDATE ON {schema}.runs", "INSERT ON {schema}.records"])
async def test_a_worker_whose_role_may_not_claim_ends_instead_of_trying_for_good(
    postgres_dsn: str, postgres_schema: str, revoked: str
) -> None:
    """A role without the privileges a claim needs: the worker logged "trying again" every
    interval for good, alive and doing nothing. One that may claim but not write a run's
    records took the run over again and again until it was quarantined."""
    from treadle.testing.scripted import ScriptedModel, say

    def agent() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[say("hi")]),
            executor=treadle.Toolbox([]),
            parser=treadle.NativeToolCallParser(),
        )

    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        await store.submit("r", agent="calc", input=(Message(role="user", content="hi"),))
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute(f"REVOKE {revoked.format(schema=postgres_schema)} FROM CURRENT_USER")
        with (
            trio.fail_after(30),
            pytest.RaisesGroup(
                pytest.RaisesExc(treadle.StoreRefused, match="permission denied"),
                flatten_subgroups=True,
                allow_unwrapped=True,
            ),
        ):
            async with treadle.open_fleet(store, {"calc": agent}, claim_poll_s=0.05):
                await trio.sleep_forever()
        summary = await store.read_summary("r")
        assert summary is not None and summary.takeovers == 0 and summary.quarantined is None
        # The refused run was released, not left to expire: a claim of it is no takeover.
        assert summary.lease is None or summary.lease.owner == ""
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            admin.execute(f"GRANT {revoked.format(schema=postgres_schema)} TO CURRENT_USER")
        async with treadle.open_fleet(store, {"calc": agent}, claim_poll_s=0.05):
            result = await treadle.wait_result(store, "r", poll_s=0.05)
        summary = await store.read_summary("r")
    assert result.final_answer == "hi"
    assert summary is not None and summary.takeovers == 0 and summary.quarantined is None


async def test_submits_of_one_run_id_at_once_all_return_its_submission(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """Two submits both found no row and both inserted one: the second failed on the unique
    key (`StoreError`), where submitting the same run again is idempotent (a client retrying
    a submit whose answer it did not get)."""
    message = (Message(role="user", content="go"),)
    async with (
        treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as one,
        treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as two,
    ):
        for attempt in range(25):
            run_id = f"race-{attempt}"
            answers: list[object] = []

            async def submit(store: PostgresStore, answers=answers, run_id=run_id) -> None:
                answers.append(await store.submit(run_id, agent="a", input=message))

            async with trio.open_nursery() as nursery:
                for store in (one, two, one, two):
                    nursery.start_soon(submit, store)
            assert len(answers) == 4 and len({a.submitted_at for a in answers}) == 1  # type: ignore[attr-defined]


async def test_a_renewal_passes_over_a_row_kept_locked_and_renews_the_other_leases(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """One run's row locked by another transaction held up the renewal of every lease of the
    holder until they all expired, and each of its runs was taken over."""
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        held = [await store.acquire_lease(r, owner="w", ttl_s=60) for r in ("a", "b", "c")]
        with psycopg.connect(postgres_dsn) as other:  # a transaction that keeps b locked
            other.execute(f"SELECT 1 FROM {postgres_schema}.runs WHERE run_id = 'b' FOR UPDATE")
            # Let go after 10 s whatever happens, so that a renewal that waits for the lock
            # fails the assertions below instead of hanging the test.
            letting_go = threading.Timer(10.0, other.rollback)
            letting_go.start()
            try:
                renewed = {x.run_id: x for x in await store.renew_leases(held, ttl_s=60)}
                assert letting_go.is_alive()  # b was passed over, not waited for
            finally:
                letting_go.cancel()
            assert set(renewed) == {"a", "b", "c"}  # b is still held, not lost
            assert renewed["b"] == held[1]  # not renewed this time
            assert renewed["a"].heartbeat_at > held[0].heartbeat_at
            assert renewed["c"].heartbeat_at > held[2].heartbeat_at
            other.rollback()
        again = {x.run_id: x for x in await store.renew_leases(held, ttl_s=60)}
    assert again["b"].heartbeat_at > held[1].heartbeat_at  # its turn came


async def two_records_each(store: PostgresStore, run_ids: str) -> dict[str, int]:
    """Lease each run (one letter each) and make its run-started and an intent durable; the
    generations by run."""
    gens = {r: await lease_generation(store, r) for r in run_ids}
    for r, gen in gens.items():
        await store.write_run_started(started(r), seq=1, generation=gen)
        await store.write_intent(intent(r, 1), seq=2, generation=gen)  # a barrier
    return gens


async def third_writes_while_locked(
    dsn: str, schema: str, store: PostgresStore, gens: dict[str, int], locked: str
) -> dict[str, BaseException]:
    """Write each run's third record (a barrier) at once while another transaction keeps the
    rows of ``locked`` (letters) locked; the `StoreError` of each run whose write failed.

    The lock is let go after 20 s whatever happens, so that a write that waits it out fails
    the assertion here instead of hanging the test.
    """
    failed: dict[str, BaseException] = {}

    async def write(r: str) -> None:
        try:
            await store.write_intent(intent(r, 2), seq=3, generation=gens[r])
        except treadle.StoreError as exc:
            failed[r] = exc

    with psycopg.connect(dsn) as other:
        other.execute(
            f"SELECT 1 FROM {schema}.runs WHERE run_id = ANY(%s) FOR UPDATE", (list(locked),)
        )
        letting_go = threading.Timer(20.0, other.rollback)
        letting_go.start()
        try:
            async with trio.open_nursery() as nursery:
                for r in gens:
                    nursery.start_soon(write, r)
            assert letting_go.is_alive()  # the writes gave up; they did not wait it out
        finally:
            letting_go.cancel()
        other.rollback()
    return failed


async def test_a_write_waits_alone_and_bounded_for_a_row_kept_locked(
    postgres_dsn: str, postgres_schema: str
) -> None:
    """One run's row locked by another transaction held up the commit of every run of the
    store's batch, for as long as the lock was kept: a worker's runs all stood still."""
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        gens = await two_records_each(store, "abc")
        failed = await third_writes_while_locked(postgres_dsn, postgres_schema, store, gens, "b")
        assert set(failed) == {"b"}
        assert "the row of run 'b' stayed locked by another transaction" in str(failed["b"])
        logs = {r: await store.read_log(r) for r in gens}
    assert [len(logs[r].records) for r in ("a", "b", "c")] == [3, 2, 3]  # nothing of b's write


class _CountsWaits(postgres.PostgresBackend):
    """Records the runs of each commit statement that waits for rows held elsewhere."""

    waits: list[list[str]] = []

    def _statement(self, groups, **held):  # type: ignore[no-untyped-def]
        if "held" not in held:
            type(self).waits.append(sorted(g.run_id for g in groups))
        return super()._statement(groups, **held)


async def test_runs_whose_rows_are_kept_locked_wait_once_together(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each held row was waited for alone, one after the other: with 8 rows held, a worker's
    other runs stood still 8 times 2 s."""
    monkeypatch.setattr(postgres, "PostgresBackend", _CountsWaits)
    monkeypatch.setattr(_CountsWaits, "waits", [])
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        gens = await two_records_each(store, "abcd")
        _CountsWaits.waits.clear()
        failed = await third_writes_while_locked(postgres_dsn, postgres_schema, store, gens, "bcd")
        assert set(failed) == {"b", "c", "d"}
        # one wait, for the held rows together (a batch may hold a, or not)
        assert [w for w in _CountsWaits.waits if w != ["a"]] == [["b", "c", "d"]]


async def test_a_call_waits_for_a_row_kept_locked_at_most_its_lock_wait(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease release, a cancel's control append: they waited for as long as another
    transaction kept the run's row (a worker's drain and a `treadle cancel` hung with it)."""
    monkeypatch.setattr(postgres, "CALL_LOCK_WAIT_MS", 300)
    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        held = await store.acquire_lease("r", owner="w", ttl_s=60)
        await store.write_run_started(started("r"), seq=1, generation=held.generation)
        await store.read_log("r")
        with psycopg.connect(postgres_dsn) as other:
            other.execute(f"SELECT 1 FROM {postgres_schema}.runs WHERE run_id = 'r' FOR UPDATE")
            letting_go = threading.Timer(20.0, other.rollback)
            letting_go.start()
            try:
                with pytest.raises(treadle.StoreError, match="kept a lock this needs"):
                    await store.release_lease(held)
                cancel = CancelRequested(run_id="r", ts=TS, reason="stop")
                with pytest.raises(treadle.StoreError, match="kept a lock this needs"):
                    await store.append_control(cancel)
                assert letting_go.is_alive()
            finally:
                letting_go.cancel()
            other.rollback()
        await store.release_lease(held)  # once let go, it works


async def test_a_run_whose_write_gave_up_on_a_locked_row_is_released_not_taken_over(
    postgres_dsn: str, postgres_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its drive ended on the lock and left the lease to expire, so the next claim counted a
    takeover: five operator locks quarantined a run for no fault of its own."""
    from treadle.testing.scripted import ScriptedModel, call, say

    monkeypatch.setattr(postgres, "COMMIT_LOCK_WAIT_MS", 200)
    gate, called = trio.Event(), trio.Event()

    @treadle.tool(replay=treadle.ReplayPolicy.SAFE)
    async def wait() -> str:
        """Wait for the test."""
        called.set()
        await gate.wait()
        return "waited"

    def agent() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[call("wait", call_id="w1"), say("done")]),
            executor=treadle.Toolbox([wait]),
            parser=treadle.NativeToolCallParser(),
        )

    async with treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
        await store.submit("r", agent="a", input=(Message(role="user", content="go"),))
        with psycopg.connect(postgres_dsn) as other, trio.fail_after(60):
            async with treadle.open_fleet(store, {"a": agent}, claim_poll_s=0.05) as fleet:
                await called.wait()
                other.execute(f"SELECT 1 FROM {postgres_schema}.runs WHERE run_id = 'r' FOR UPDATE")
                letting_go = threading.Timer(1.5, other.rollback)  # past the write's wait
                letting_go.start()
                gate.set()  # the call's result and the next intent meet the locked row
                try:
                    result = await fleet.result("r", poll_s=0.05)
                finally:
                    letting_go.cancel()
                    other.rollback()
        summary = await store.read_summary("r")
    assert result.final_answer == "done"
    assert summary is not None and summary.takeovers == 0 and summary.claims == 2


async def test_a_run_whose_drive_found_no_connection_slot_is_released_not_taken_over(
    postgres_dsn: str,
    postgres_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server refused a pooled connection for lack of slots (``max_connections``): the
    drive failed, its lease was left to expire and the next claim counted a takeover, so a
    healthy run was quarantined after ``max_takeovers`` such drives. A connection the store
    cannot open is its own failure, not the run's: the drive releases the lease (its release
    tried again until a slot is free), and the run's next claim is no takeover."""
    from treadle.supervisors._fleet_drive import current_drive
    from treadle.testing.scripted import ScriptedModel, say

    refusals = [0]  # connections the server still refuses to the run's drive
    connect = postgres.PostgresDialect.connect

    def short_of_slots(
        self: postgres.PostgresDialect, application: str = "treadle", **kwargs: Any
    ) -> Any:
        if refusals[0] and current_drive.get() is not None:  # a call of the run's drive
            refusals[0] -= 1
            raise psycopg.OperationalError(
                'connection failed: connection to server at "db", port 5432 failed: FATAL:  '
                "remaining connection slots are reserved for non-replication superuser "
                "connections"
            )
        return connect(self, application, **kwargs)

    monkeypatch.setattr(postgres.PostgresDialect, "connect", short_of_slots)

    def agent() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[say("done")]),
            executor=treadle.Toolbox([]),
            parser=treadle.NativeToolCallParser(),
        )

    async with (
        treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as store,
        treadle.open_postgres_store(postgres_dsn, schema=postgres_schema) as watcher,
    ):
        await store.submit("r", agent="a", input=(Message(role="user", content="go"),))
        store._pool._keep = 0  # every call opens a connection of its own
        claim = store.claim
        armed: list[bool] = []

        async def claim_then_run_short(**kwargs: Any) -> Any:
            made = await claim(**kwargs)
            if made and not armed:  # the first drive's read, then its release's first try
                armed.append(True)
                refusals[0] = 2
            return made

        monkeypatch.setattr(store, "claim", claim_then_run_short)
        with trio.fail_after(60):
            async with treadle.open_fleet(
                store, {"a": agent}, claim_poll_s=0.05, lease_ttl_s=1, max_takeovers=1
            ):
                summary = await watcher.read_summary("r")
                while summary is None or summary.liveness not in (
                    treadle.types.Liveness.FINISHED,
                    treadle.types.Liveness.QUARANTINED,
                ):
                    await trio.sleep(0.05)
                    summary = await watcher.read_summary("r")
    # before: quarantined (its one takeover allowed counted), its lease left to expire
    assert (summary.state, summary.takeovers, summary.claims) == (RunState.SUCCEEDED, 0, 2)
    assert refusals == [0]  # the release found no slot once, and was tried again
    assert "stopped unfinished: cannot connect to PostgreSQL store" in caplog.text
    assert "remaining connection slots are reserved" in caplog.text
    assert "the lease was not released" not in caplog.text


def test_a_damaged_database_is_named_without_an_offset_it_does_not_have():
    """PostgreSQL reporting its own data or an index damaged was said "(at offset 0)", as if
    the first byte of some file were the damage; no record's place is known."""
    for damage in (psycopg.errors.DataCorrupted, psycopg.errors.IndexCorrupted):
        said = postgres._translate("postgresql://u:***@h/db", damage("invalid page"), "read")
        assert isinstance(said, treadle.LogCorrupted) and said.offset is None
        assert str(said) == "postgresql://u:***@h/db: the database is damaged: invalid page"
