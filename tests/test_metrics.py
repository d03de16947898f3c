"""Metrics (docs/metrics.md): one recorder, two outputs.

* ``treadle worker --metrics-port 0`` runs as a real subprocess on a SQLite store; after its
  runs finished, its real HTTP endpoint is scraped and every count is checked against what
  the runs' logs hold.
* The OpenTelemetry output, read with the SDK's in-memory reader, reports the same figures
  for runs of a fleet in this process.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import treadle
from treadle.metrics import UNKNOWN_TOOL, MetricsRecorder
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.types import (
    ActionResult,
    Liveness,
    ModelResult,
    RunFinished,
    RunLog,
    RunStarted,
    RunState,
    StepRecord,
    StopReason,
    StoreOp,
    ToolCall,
    Totals,
    Usage,
)

AGENTS = textwrap.dedent(
    '''
    """Agents of the metrics test's worker."""

    import treadle
    from treadle.testing.scripted import ScriptedModel, calls, say
    from treadle.types import ToolCall, Usage


    @treadle.tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b


    @treadle.tool
    async def fail(why: str) -> str:
        """Raise."""
        raise ValueError(why)


    def calc() -> treadle.Agent:
        turns = [
            calls(ToolCall(id="c1", name="add", arguments={"a": 2, "b": 3}),
                  usage=Usage(input_tokens=11, output_tokens=4)),
            calls(ToolCall(id="c2", name="nope", arguments={}),
                  usage=Usage(input_tokens=20, output_tokens=2, reasoning_tokens=1)),
            calls(ToolCall(id="c3", name="fail", arguments={"why": "no"}),
                  usage=Usage()),  # reports no usage: counts nothing
            say("5", usage=Usage(input_tokens=30, output_tokens=1)),
        ]
        return treadle.Agent(
            model=ScriptedModel(turns=turns),
            executor=treadle.Toolbox([add, fail]),
            parser=treadle.NativeToolCallParser(),
            version="v1",
        )
    '''
)

RUNS = ("m1", "m2", "m3")


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def _total(samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def _expected(logs: list[RunLog]) -> dict[str, Counter]:
    records = [r for log in logs for r in log.records]
    writes = Counter()
    for r in records:
        if not isinstance(r, ActionResult):  # results ride with their step record
            writes["all"] += 1
    barriers = sum(
        1
        for r in records
        if type(r).__name__ in {"ModelIntent", "ActionIntent", "RunFinished"}
        or type(r).__name__ in {"ApprovalRequested", "ApprovalDecided", "CancelRequested"}
    )
    writes["barriers"] = barriers
    return {
        "steps": Counter(steps=sum(isinstance(r, StepRecord) for r in records)),
        "attempts": Counter(
            "ok" if r.error is None and not r.abandoned else "failed"
            for r in records
            if isinstance(r, ModelResult)
        ),
        "tokens": Counter(
            {
                kind: sum(
                    getattr(r.usage, f"{kind}_tokens") or 0
                    for r in records
                    if isinstance(r, ModelResult)
                )
                for kind in ("input", "output", "reasoning")
            }
        ),
        # a tool the run's definition does not list is counted as UNKNOWN_TOOL
        "tools": Counter(
            (r.tool if r.tool in _listed(log) else UNKNOWN_TOOL, r.outcome.status.value)
            for log in logs
            for r in log.records
            if isinstance(r, ActionResult)
        ),
        "finished": Counter(
            (r.state.value, r.stop_reason.value) for r in records if isinstance(r, RunFinished)
        ),
        "writes": writes,
    }


def _listed(log: RunLog) -> set[str]:
    assert log.started is not None
    return {spec["name"] for spec in log.started.snapshot["tools"]}


def _read_logs(db: Path) -> list[RunLog]:
    async def go() -> list[RunLog]:
        async with open_sqlite_store(db) as store:
            return [await store.read_log(run_id) for run_id in RUNS]

    return trio.run(go)


def test_barrier_ops_are_the_ones_counted_here():
    # the expected barrier count above names the records of the barrier operations
    assert {op for op in StoreOp if op.barrier} == {
        StoreOp.INTENT,
        StoreOp.CONTROL,
        StoreOp.RUN_FINISHED,
    }


def test_a_worker_serves_prometheus_metrics_that_match_its_runs_logs(tmp_path: Path):
    db = tmp_path / "runs.db"
    (tmp_path / "metrics_agents.py").write_text(AGENTS, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "treadle",
        "worker",
        "--store",
        str(db),
        "--agent",
        "calc=metrics_agents:calc",
        "--claim-poll",
        "0.1",
        "--metrics-port",
        "0",
        "--metrics-refresh",
        "0.1",
    ]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the worker said nothing within 60 s"
        assert proc.stdout.readline().startswith("worker ")
        line = proc.stdout.readline()
        assert line.startswith("metrics at http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[-1]
        for run_id in RUNS:
            submitted = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "treadle",
                    "submit",
                    "--store",
                    str(db),
                    "--agent",
                    "calc",
                    "--run-id",
                    run_id,
                    "add",
                ],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert submitted.returncode == 0, submitted.stderr
        for run_id in RUNS:
            waited = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "treadle",
                    "wait",
                    run_id,
                    "--store",
                    str(db),
                    "--poll",
                    "0.1",
                ],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert waited.returncode == 0, waited.stdout + waited.stderr
        # The writer counts a record a scheduling step after the store holds it, and the
        # index gauge is read every few seconds: scrape until both caught up (bounded).
        for _ in range(400):
            samples = _samples(httpx.get(url, timeout=10).text)
            finished = _total(samples, "treadle_runs_finished_total")
            store_finished = _total(samples, "treadle_store_runs", liveness="finished")
            if finished == len(RUNS) and store_finished == len(RUNS):
                break
            trio.run(trio.sleep, 0.05)
        else:
            raise AssertionError(f"the metrics never caught up: {samples}")
    finally:
        proc.terminate()
        proc.communicate(timeout=60)

    expected = _expected(_read_logs(db))
    assert _total(samples, "treadle_runs_started_total") == len(RUNS)
    for (state, reason), count in expected["finished"].items():
        assert (
            _total(samples, "treadle_runs_finished_total", state=state, stop_reason=reason) == count
        )
    assert _total(samples, "treadle_steps_total") == expected["steps"]["steps"] == 12
    assert (
        _total(samples, "treadle_model_attempts_total", outcome="ok") == expected["attempts"]["ok"]
    )
    assert _total(samples, "treadle_model_attempts_total") == sum(expected["attempts"].values())
    for kind, count in expected["tokens"].items():
        assert _total(samples, "treadle_tokens_total", kind=kind) == count
    assert expected["tokens"]["input"] == 3 * (11 + 20 + 30)
    for (tool, outcome), count in expected["tools"].items():
        assert _total(samples, "treadle_tool_calls_total", tool=tool, outcome=outcome) == count
    assert expected["tools"][(UNKNOWN_TOOL, "not_executed")] == 3
    assert expected["tools"][("add", "executed")] == 3
    # every write of the runs' logs went through the worker's commit engine, in batches
    assert _total(samples, "treadle_commit_batch_writes_sum") == expected["writes"]["all"]
    batches = _total(samples, "treadle_commit_batch_writes_count")
    assert 1 <= batches <= expected["writes"]["all"]
    assert (
        _total(samples, "treadle_barrier_latency_seconds_count") == expected["writes"]["barriers"]
    )
    assert _total(samples, "treadle_barrier_latency_seconds_sum") > 0
    assert _total(samples, "treadle_store_runs", liveness="queued") == 0
    assert _total(samples, "treadle_worker_running_runs") == 0


def test_the_worker_refuses_a_metrics_port_it_cannot_bind(tmp_path: Path):
    (tmp_path / "metrics_agents.py").write_text(AGENTS, encoding="utf-8")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "treadle",
                "worker",
                "--store",
                str(tmp_path / "r.db"),
                "--agent",
                "calc=metrics_agents:calc",
                "--metrics-port",
                str(port),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_metrics_host_is_served_at_a_url_that_opens(host: str):
    """``--metrics-host ::1`` (or ``[::1]``): the URL said brackets the address, and opens."""
    from treadle._cli_fleet import _serve_metrics
    from treadle.sinks.prometheus import PrometheusOutput

    exporter = PrometheusOutput()
    try:
        url = _serve_metrics(exporter, 0, host)
        assert url.startswith("http://[::1]:") and url.endswith("/metrics"), url
        assert httpx.get(url, timeout=30).status_code == 200
    finally:
        exporter.close()


# --------------------------------------------------------------------------- OpenTelemetry


def _agent() -> treadle.Agent:
    @treadle.tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return treadle.Agent(
        model=ScriptedModel(
            turns=[
                calls(
                    ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2}),
                    usage=Usage(input_tokens=7, output_tokens=2),
                ),
                say("3", usage=Usage(input_tokens=9, output_tokens=1)),
            ]
        ),
        executor=treadle.Toolbox([add]),
        parser=treadle.NativeToolCallParser(),
    )


def _points(reader) -> dict[str, list]:
    found: dict[str, list] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def _sum(points, **attributes) -> float:
    return sum(p.value for p in points if attributes.items() <= dict(p.attributes).items())


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request, tmp_path: Path):
    if request.param == "sqlite":
        return lambda: open_sqlite_store(tmp_path / "runs.db")
    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    return lambda: treadle.open_postgres_store(dsn, schema=schema)


async def test_opentelemetry_metrics_report_the_same_figures(open_store):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from treadle.sinks.otel import OpenTelemetryMetrics

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    recorder = MetricsRecorder(outputs=(OpenTelemetryMetrics(meter=provider.get_meter("t")),))
    with trio.fail_after(60):
        async with (
            open_store() as store,
            treadle.open_fleet(
                store,
                {"calc": _agent},
                claim_poll_s=0.05,
                metrics=recorder,
                metrics_refresh_s=0.05,
            ) as fleet,
        ):
            ids = [await fleet.submit("calc", "1+2?", run_id=f"o{i}") for i in range(2)]
            for run_id in ids:
                assert (await fleet.result(run_id, poll_s=0.05)).final_answer == "3"
            logs = [await store.read_log(run_id) for run_id in ids]
            while True:  # the index gauge catches up at its next reading
                points = _points(reader)
                if _sum(points.get("treadle.store.runs", []), liveness="finished") == 2:
                    break
                await trio.sleep(0.05)
    points = _points(reader)
    expected = _expected(logs)
    assert _sum(points["treadle.runs.started"]) == 2
    assert _sum(points["treadle.runs.finished"], state="succeeded", stop_reason="final_answer") == 2
    assert _sum(points["treadle.steps"]) == expected["steps"]["steps"] == 4
    assert _sum(points["treadle.model.attempts"], outcome="ok") == expected["attempts"]["ok"] == 4
    assert _sum(points["treadle.tokens"], kind="input") == expected["tokens"]["input"] == 32
    assert _sum(points["treadle.tokens"], kind="output") == expected["tokens"]["output"] == 6
    assert _sum(points["treadle.tool.calls"], tool="add", outcome="executed") == 2
    (batch,) = points["treadle.commit.batch_writes"]
    assert batch.sum == expected["writes"]["all"] and batch.count >= 1
    assert tuple(batch.explicit_bounds) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    (latency,) = points["treadle.barrier.latency"]
    assert latency.count == expected["writes"]["barriers"]
    assert _sum(points["treadle.worker.running_runs"]) == 0


async def test_without_a_recorder_nothing_is_attached(tmp_path: Path):
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        result = await treadle.run(_agent(), "1+2?", store=store, run_id="plain")
        assert result.final_answer == "3"
        assert store._engine.metrics is None
        recorder = MetricsRecorder()
        assert recorder.watch(store) is True
        assert store._engine.metrics is recorder
    assert MetricsRecorder().watch(treadle.MemoryStore()) is False


def test_the_prometheus_output_names_every_metric_once():
    from treadle.metrics import METRICS
    from treadle.sinks.prometheus import PrometheusOutput

    output = PrometheusOutput()
    names = {family.name for family in output.registry.collect()}
    assert names == {m.prometheus for m in METRICS}
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusOutput(registry=output.registry)


def _counted(output, name: str) -> dict[tuple[str, ...], float]:
    """The samples of counter ``name`` a `PrometheusOutput` holds, by their label values."""
    return {
        tuple(sample.labels.values()): sample.value
        for family in output.registry.collect()
        for sample in family.samples
        if sample.name == name
    }


async def test_a_tool_the_run_does_not_have_is_one_series_whatever_its_name():
    # The model names tools: each name it makes up would be a new series in the exporter.
    made_up = [
        ToolCall(id=f"c{i}", name=f"nope_{i}" * (1 + 50 * i), arguments={}) for i in range(3)
    ]
    agent = attrs.evolve(
        _agent(),
        model=ScriptedModel(
            turns=[
                calls(ToolCall(id="a", name="add", arguments={"a": 1, "b": 2})),
                calls(*made_up),
                say("3"),
            ]
        ),
    )
    from treadle.sinks.prometheus import PrometheusOutput

    output = PrometheusOutput()
    result = await treadle.run(
        agent, "1+2?", store=treadle.MemoryStore(), metrics=MetricsRecorder(outputs=(output,))
    )
    assert result.final_answer == "3"
    tools = _counted(output, "treadle_tool_calls_total")
    assert tools == {("add", "executed"): 1, (UNKNOWN_TOOL, "not_executed"): 3}


class _Broken:
    """A metrics output whose exporter is down."""

    def __init__(self) -> None:
        self.calls = 0

    def add(self, metric, value: float, labels: tuple[str, ...]) -> None:
        self.calls += 1
        raise RuntimeError("exporter down")

    set = add
    observe = add


async def test_an_output_that_raises_is_logged_and_never_reaches_the_run(tmp_path: Path, caplog):
    from treadle.sinks.prometheus import PrometheusOutput

    broken, output = _Broken(), PrometheusOutput()
    recorder = MetricsRecorder(outputs=(broken, output))
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        assert recorder.watch(store)  # commit observations fail too
        result = await treadle.run(_agent(), "1+2?", store=store, run_id="m", metrics=recorder)
        log = await store.read_log("m")
    assert result.state is RunState.SUCCEEDED and result.final_answer == "3"
    assert log.finished is not None and log.finished.state is RunState.SUCCEEDED
    # the output after the broken one got every update
    finished = _counted(output, "treadle_runs_finished_total")
    assert finished[("succeeded", "final_answer")] == 1
    assert _counted(output, "treadle_steps_total")[()] == 2
    assert recorder.failures == broken.calls > 2
    logged = [r for r in caplog.records if r.name == "treadle.metrics"]
    assert len(logged) == 1  # its first failure, with the traceback
    assert "_Broken" in logged[0].getMessage() and logged[0].exc_info is not None


# --------------------------------------------------------------------------- the worker gauges


@attrs.define
class _Slots:
    """A metrics output that keeps, after each worker gauge set, the slots taken then.

    Slots taken: runs driven less those waiting on a child run (docs/metrics.md, "A
    dashboard").
    """

    gauges: dict[str, float] = attrs.Factory(dict)
    peaks: Counter[str] = attrs.Factory(Counter)
    taken: list[float] = attrs.Factory(list)

    def set(self, metric, value: float, labels: tuple[str, ...]) -> None:
        if metric.prometheus.startswith("treadle_worker_"):
            self.gauges[metric.prometheus] = value
            self.peaks[metric.prometheus] = max(self.peaks[metric.prometheus], int(value))
            driven = self.gauges.get("treadle_worker_running_runs", 0)
            self.taken.append(driven - self.gauges.get("treadle_worker_waiting_runs", 0))

    def add(self, metric, value: float, labels: tuple[str, ...]) -> None:
        pass

    observe = add


def _researcher() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[say("Oslo is sunny.")]),
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
    )


def _planner(store) -> treadle.Agent:
    research = treadle.agent_tool(
        _researcher(),
        store=store,
        name="research",
        description="Ask the research agent.",
        fleet_agent="researcher",
        control_poll_s=0.05,
    )
    return treadle.Agent(
        model=ScriptedModel(turns=[call("research", task="Weather in Oslo?"), say("Sunglasses.")]),
        executor=treadle.Toolbox([research]),
        parser=treadle.NativeToolCallParser(),
    )


async def test_parents_waiting_on_queued_children_are_told_from_the_slots_taken(fleet_store):
    """A parent waiting on its queued child frees its slot, yet counted in the running gauge
    like any drive: with one slot the gauge read 3 and the dashboard's free slots -2. The
    waiting gauge now says how many of the driven runs wait, whenever that changes, and
    running less waiting never exceeds ``max_running``."""
    slots = _Slots()
    agents = {"planner": lambda: _planner(fleet_store), "researcher": _researcher}
    with trio.fail_after(60):
        async with treadle.open_fleet(
            fleet_store,
            agents,
            max_running=1,
            claim_poll_s=0.05,
            metrics=MetricsRecorder(outputs=(slots,)),
        ) as fleet:
            for run_id in ("trip-1", "trip-2"):
                await fleet.submit("planner", "Plan a trip to Oslo", run_id=run_id)
            for run_id in ("trip-1", "trip-2"):
                assert (await fleet.result(run_id, poll_s=0.05)).final_answer == "Sunglasses."
    assert fleet.statistics().claimed == 4  # both planners and both children
    assert slots.peaks["treadle_worker_running_runs"] >= 2  # a planner waited beside a child
    assert min(slots.taken) >= 0 and max(slots.taken) <= 1, slots.taken
    assert slots.peaks["treadle_worker_waiting_runs"] >= 1
    assert set(slots.gauges.values()) == {0}  # all done


# --------------------------------------------------------------------------- the store gauge


@attrs.define
class _StoreGauge:
    """A metrics output that keeps the first reading of ``treadle_store_runs``."""

    read: trio.Event = attrs.Factory(trio.Event)
    runs: dict[str, float] = attrs.Factory(dict)

    def set(self, metric, value: float, labels: tuple[str, ...]) -> None:
        if metric.prometheus == "treadle_store_runs" and not self.read.is_set():
            self.runs[labels[0]] = value
            if len(self.runs) == len(Liveness):  # a reading sets every liveness
                self.read.set()

    def add(self, metric, value: float, labels: tuple[str, ...]) -> None:
        pass

    observe = add


async def test_the_store_gauge_counts_finished_runs_without_reading_them(fleet_store, monkeypatch):
    """The gauge's reading costs the store's unfinished runs, not every run it ever held."""
    from treadle.stores import _sql
    from treadle.testing.contracts import seed_log

    finished = [f"done-{i}" for i in range(5)]
    for run_id in finished:
        started = RunStarted(run_id=run_id, ts="2025-01-01T00:00:00+00:00", input=(), snapshot={})
        end = RunFinished(
            run_id=run_id,
            ts="2025-01-01T00:00:01+00:00",
            state=RunState.SUCCEEDED,
            stop_reason=StopReason.FINAL_ANSWER,
            totals=Totals(),
        )
        await seed_log(fleet_store, [started, end])
    await fleet_store.submit("waiting", agent="nobody-serves-it", input=())
    judged: list[str] = []
    summary_of = _sql.summary_of

    def spied(where: str, row, now: float):
        judged.append(row[0])
        return summary_of(where, row, now)

    monkeypatch.setattr(_sql, "summary_of", spied)
    gauge = _StoreGauge()
    with trio.fail_after(60):
        async with treadle.open_fleet(
            fleet_store, {"calc": _agent}, metrics=MetricsRecorder(outputs=(gauge,))
        ):
            await gauge.read.wait()
    assert gauge.runs["finished"] == len(finished)
    assert gauge.runs["queued"] == 1 and gauge.runs["driven"] == 0
    assert judged == ["waiting"]  # no finished row was read and judged


def test_the_worker_takes_its_store_gauge_interval_in_seconds(tmp_path: Path):
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "treadle",
            "worker",
            "--store",
            str(tmp_path / "r.db"),
            "--agent",
            "calc=metrics_agents:calc",
            "--metrics-refresh",
            "nan",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert "Invalid value for '--metrics-refresh'" in refused.stderr, refused.stderr


# --------------------------------------------------------------------------- the HTTP endpoint


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread not in before]


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=60)  # a bound for a broken server, not a timing assertion
    assert not [thread for thread in threads if thread.is_alive()]


def _silent_connection(port: int) -> socket.socket:
    silent = socket.create_connection(("127.0.0.1", port))
    silent.settimeout(60)  # the test's bound, far past the server's idle timeout
    return silent


def test_the_metrics_endpoint_hangs_up_on_a_client_that_sends_nothing():
    from treadle.sinks.prometheus import PrometheusOutput

    before = set(threading.enumerate())
    output = PrometheusOutput()
    port = output.serve(0, idle_timeout_s=0.2)
    try:
        silents = [_silent_connection(port) for _ in range(3)]
        for silent in silents:
            with silent:
                assert silent.recv(1) == b""  # the server closed it, unasked
        answered = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60)
        assert answered.status_code == 200 and "treadle_steps_total" in answered.text
    finally:
        output.close()
    _join(_new_threads(before))  # the connections' threads and the server's: none is left


def test_the_metrics_endpoint_serves_a_bounded_number_of_connections():
    from treadle.sinks.prometheus import PrometheusOutput

    before = set(threading.enumerate())
    output = PrometheusOutput()
    port = output.serve(0, idle_timeout_s=60, max_connections=2)
    try:
        held = [_silent_connection(port) for _ in range(2)]
        with _silent_connection(port) as third:  # accepted after the two: no slot is free
            assert third.recv(1) == b""
        assert len(_new_threads(before)) == 3  # the server's and one per held connection
        for silent in held:
            silent.close()
        _join([t for t in _new_threads(before) if t.name != "treadle metrics"])
        answered = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60)
        assert answered.status_code == 200  # their slots were given back
    finally:
        output.close()
    _join(_new_threads(before))
