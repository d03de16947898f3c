"""``treadle worker``, ``submit``, ``wait`` and ``unquarantine``: running a fleet (docs/fleet.md).

``worker`` serves named agents from a store with a queue (SQLite on one machine, PostgreSQL on
many) until SIGTERM, SIGINT or SIGHUP, then drains: it stops claiming, stops its runs at a safe
point, releases their leases and exits 0 (1 when closing the store then fails: its stopped line
says why). ``submit`` queues a run and prints its id; ``wait`` waits for a run's result
whichever worker drives it; ``unquarantine`` makes a quarantined run claimable again.
"""

from __future__ import annotations

import functools
import gc
import math
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

import click
import trio

from treadle._cli_common import (
    FiniteRange,
    Seconds,
    agent_block,
    bare_host,
    counted,
    in_queue,
    made_agent,
    open_queue,
    open_store,
    printable,
    printable_json,
    redact,
    run_async,
    run_id_argument,
    store_option,
    url_host,
)
from treadle._exceptions import StoreError, TreadleError, UsageError
from treadle._stop_signals import STOP_SIGNALS, hold_stop_signals
from treadle._terminal import on_interrupt
from treadle._text import valid_text
from treadle.agent import Agent
from treadle.metrics import MetricsRecorder
from treadle.ports import RunIndex, RunQueue, RunStore
from treadle.stores import LEASE_TTL_S
from treadle.supervisors import (
    BACKOFF_S,
    CLAIM_POLL_S,
    DRAIN_S,
    MAX_TAKEOVERS,
    METRICS_REFRESH_S,
    FleetStatistics,
    open_fleet,
)
from treadle.types import Liveness, Message, RunResult, RunState

if TYPE_CHECKING:
    from treadle.sinks.prometheus import PrometheusOutput


GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the youngest generation in a worker process
(Python's default is 700): see `tune_collector`."""


def tune_collector() -> None:
    """Tune the cyclic garbage collector of a worker process for many concurrent runs.

    With a hundred runs at once, the suspended coroutines and reply slots of their actors fill
    the youngest generation, and Python's default of a collection every 700 allocations took
    about a fifth of the CPU per step (docs/performance.md, "Garbage collection"). A worker
    owns its process, so it collects the youngest generation every `GC_YOUNG_THRESHOLD`
    allocations instead (never less often than the process asked for already), and freezes
    what importing its agents left (`gc.freeze`), which full collections then skip. An
    embedding program decides this for itself: treadle as a library changes nothing.
    """
    young, middle, old = gc.get_threshold()
    if young != 0:  # 0: the process turned automatic collection off; leave it so
        gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)
    gc.freeze()


AgentSource = Callable[[], Agent] | AbstractAsyncContextManager[Agent]
"""What ``--agent`` names: a factory called per run, or a block entered once (`_served`)."""


def _unservable(name: str) -> str | None:
    """Why no worker can serve the agent name ``name``; ``None`` when one can.

    A worker's ``--agent NAME=MODULE:FACTORY`` ends NAME at its first ``=``: an empty name
    and a name holding ``=`` cannot be written there. The one rule of `treadle worker`'s
    specs and `treadle submit --agent` (docs/fleet.md, "The queue"), so that no run is
    queued for an agent nobody can serve.
    """
    if not name:
        return "the agent name is empty"
    if "=" in name:
        return f"the agent name {name!r} holds '=' (a worker's --agent NAME ends at the first '=')"
    return None


def _checked_agent_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``submit --agent NAME``, refused (exit 2) when no worker could serve it (`_unservable`)."""
    why = _unservable(value)
    if why is not None:
        raise click.BadParameter(why, ctx=ctx, param=param)
    return value


def _agent_factory(spec: str) -> tuple[str, AgentSource]:
    """``NAME=MODULE:FACTORY`` as ``(name, factory or block)`` (see `made_agent`).

    A FACTORY whose call returns an async context manager (the agent's model client and
    whatever else it needs, opened once) gives its `agent_block`, entered when the worker
    starts and left when it stops (`_served`); any other is called per run.

    Raises:
        click.BadParameter: the spec is malformed, or as `made_agent`.
    """
    name, sep, target = spec.partition("=")
    if not sep or not target:
        raise click.BadParameter(f"{spec!r} is not NAME=MODULE:FACTORY", param_hint="--agent")
    why = _unservable(name)
    if why is not None:
        raise click.BadParameter(
            f"{spec!r} is not NAME=MODULE:FACTORY: {why}", param_hint="--agent"
        )
    factory, made = made_agent(target)
    if not isinstance(made, Agent):
        return name, agent_block(target, made)

    def each() -> Agent:
        made = factory()
        if not isinstance(made, Agent):
            raise TypeError(f"{target}() gave {type(made).__name__}, not a treadle.Agent")
        return made

    return name, each


def _agent_sources(specs: tuple[str, ...]) -> dict[str, AgentSource]:
    """The worker's ``--agent NAME=MODULE:FACTORY`` specs, by name (see `_agent_factory`).

    Raises:
        click.BadParameter: a spec is malformed (as `_agent_factory`), or a NAME is given
            twice: a worker serves one definition under a name, and which of two it should
            serve is not the worker's to guess (before, the last one won, silently).
    """
    sources: dict[str, AgentSource] = {}
    for spec in specs:
        name = spec.partition("=")[0]  # as `_agent_factory` reads it, before FACTORY is loaded
        if name in sources:
            raise click.BadParameter(
                f"{spec!r}: the agent name {name!r} is given twice; a worker serves one "
                "agent under each NAME",
                param_hint="--agent",
            )
        sources[name] = _agent_factory(spec)[1]
    return sources


@asynccontextmanager
async def _served(
    agents: Mapping[str, AgentSource],
) -> AsyncIterator[dict[str, Callable[[], Agent]]]:
    """The worker's agents, the blocks among them entered for as long as it serves."""
    async with AsyncExitStack() as stack:
        served: dict[str, Callable[[], Agent]] = {}
        for name, source in agents.items():
            if isinstance(source, AbstractAsyncContextManager):
                served[name] = functools.partial(_same, await stack.enter_async_context(source))
            else:
                served[name] = source
        yield served


def _same(agent: Agent) -> Agent:
    """The agent a worker's block yielded, for each run (`_served`)."""
    return agent


@click.command("worker")
@store_option
@click.option(
    "--agent",
    "agent_specs",
    multiple=True,
    required=True,
    help="NAME=MODULE:FACTORY: serve under NAME the agent FACTORY() builds for each run, or "
    "the one the async context manager it returns yields (entered once) (repeatable).",
)
@click.option("--max-running", default=16, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--lease-ttl",
    "lease_ttl_s",
    default=LEASE_TTL_S,
    show_default=True,
    type=FiniteRange(min=0.1, max=3600),
    help="Seconds a lease lasts unless renewed (every third of it).",
)
@click.option(
    "--claim-poll",
    "claim_poll_s",
    default=CLAIM_POLL_S,
    show_default=True,
    type=Seconds(above_zero=True),
)
@click.option(
    "--max-takeovers",
    default=MAX_TAKEOVERS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Deaths of a run's driver after which the run is quarantined.",
)
@click.option("--backoff", "backoff_s", default=BACKOFF_S, show_default=True, type=Seconds())
@click.option(
    "--drain",
    "drain_s",
    default=DRAIN_S,
    show_default=True,
    type=Seconds(),
    help="Seconds runs get to reach a safe point after SIGTERM before being cut.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; needs "
    "treadle[metrics]).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="The address the metrics endpoint listens on (an IPv6 one bare or in brackets).",
)
@click.option(
    "--metrics-refresh",
    "metrics_refresh_s",
    default=METRICS_REFRESH_S,
    show_default=True,
    type=Seconds(above_zero=True),
    help="Seconds between two readings of the store's run index for treadle_store_runs.",
)
def worker_command(
    store_path: str,
    agent_specs: tuple[str, ...],
    max_running: int,
    lease_ttl_s: float,
    claim_poll_s: float,
    max_takeovers: int,
    backoff_s: float,
    drain_s: float,
    metrics_port: int | None,
    metrics_host: str,
    metrics_refresh_s: float,
) -> None:
    """Serve agents from a store's queue until SIGTERM, SIGINT or SIGHUP, then drain and exit 0.

    Exit 1 when closing the store failed after the drain (writes of runs whose drives had
    stopped waiting for them failed, or its committer did not stop in time): the stopped
    line says so (docs/fleet.md, "Shutting a worker down").
    """
    # a stop asked for before the worker is up (while this module loaded too, when the group
    # held the signals: `treadle.cli`): it claims nothing
    early = hold_stop_signals()
    agents = _agent_sources(agent_specs)
    tune_collector()
    exporter = _prometheus() if metrics_port is not None else None
    recorder = MetricsRecorder(outputs=(exporter,)) if exporter is not None else None
    endpoint: str | None = None

    async def serve(store: RunStore) -> FleetStatistics:
        """Serve until a stop signal, then drain; the worker's statistics once drained."""
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async with (
                _served(agents) as served_agents,
                open_fleet(
                    store,
                    served_agents,
                    max_running=max_running,
                    lease_ttl_s=lease_ttl_s,
                    claim_poll_s=claim_poll_s,
                    max_takeovers=max_takeovers,
                    backoff_s=backoff_s,
                    drain_s=drain_s,
                    metrics=recorder,
                    metrics_refresh_s=metrics_refresh_s,
                ) as fleet,
            ):
                served = ", ".join(sorted(agents))
                click.echo(f"worker {fleet.owner} serves {served} from {redact(store_path)}")
                if endpoint is not None:
                    click.echo(f"metrics at {endpoint}")
                sys.stdout.flush()  # a supervisor waits for this line
                await _until_stopped(signals, early, drain_s)
            return fleet.statistics()

    async def go() -> StoreError | None:
        """Serve, drain, close the store; print the stopped line. The close's error, if any."""
        if early:
            click.echo("stopped before it started: nothing claimed")
            return None
        stats: FleetStatistics | None = None
        try:
            async with open_queue(store_path) as store:
                stats = await serve(store)
        except StoreError as exc:
            if stats is None:  # the worker did not drain: an error like any other
                raise
            click.echo(stopped_line(stats, closing=exc))  # the drained worker's store closing
            return exc
        assert stats is not None  # `serve` returned
        click.echo(stopped_line(stats))
        return None

    try:
        if exporter is not None:  # bound before the worker claims anything
            endpoint = _serve_metrics(exporter, metrics_port, metrics_host)
        closing = run_async(go)
    finally:
        if exporter is not None:
            exporter.close()
    if closing is not None:  # said in the stopped line: docs/fleet.md, "Shutting a worker down"
        sys.exit(1)


def stopped_line(stats: FleetStatistics, closing: StoreError | None = None) -> str:
    """The worker's last line: what it finished, left, and whether it released every lease.

    ``closing``: the error closing the store raised once the worker drained (writes of runs
    whose drives had stopped waiting for them failed, or the committer did not stop in
    time); the line ends with it and its cause (docs/fleet.md, "Shutting a worker down").
    """
    leases = "leases released"
    if stats.unreleased:
        leases = (
            f"{counted(stats.unreleased, 'lease')} not released (each expires after its TTL; "
            "an unfinished run left so is then taken over, unless it is quarantined)"
        )
    line = (
        f"worker stopped: {counted(stats.finished, 'run')} finished here, "
        f"{counted(stats.left, 'drive')} ended with the run unfinished (parked, drained, "
        f"taken over or failed: each run goes on from its log), {leases}"
    )
    if closing is None:
        return line
    cause = f" ({closing.__cause__})" if closing.__cause__ is not None else ""
    return (
        f"{line}; then closing the store failed: {closing}{cause}: each run concerned goes "
        "on from what its log holds"
    )


def _prometheus() -> PrometheusOutput:
    """A Prometheus output, or a usage error naming the extra to install."""
    try:
        from treadle.sinks.prometheus import PrometheusOutput
    except ImportError as exc:
        raise click.UsageError(
            f"--metrics-port needs prometheus-client: pip install 'treadle[metrics]' ({exc})"
        ) from exc
    return PrometheusOutput()


def _serve_metrics(exporter: PrometheusOutput, port: int | None, host: str) -> str:
    """Serve ``exporter`` on ``host`` (an IPv6 address bare or in brackets); return its URL.

    The URL brackets an IPv6 address (``http://[::1]:9464/metrics``), as a browser needs.

    Raises:
        click.ClickException: the address cannot be bound.
    """
    try:
        bound = exporter.serve(port or 0, bare_host(host))
    except OSError as exc:
        raise click.ClickException(
            f"cannot serve metrics on {url_host(host)}:{port}: {exc}"
        ) from exc
    return f"http://{url_host(host)}:{bound}/metrics"


async def _until_stopped(signals: AsyncIterator[int], early: list[int], drain_s: float) -> None:
    """Wait for a stop signal (or take one that came while the worker was starting)."""
    number = early[0] if early else None
    if number is None:
        async for signum in signals:
            number = signum
            break
    if number is not None:
        click.echo(f"{signal.Signals(number).name}: draining (at most {drain_s:g} s)")


@click.command("submit")
@store_option
@click.option(
    "--agent",
    "agent_name",
    required=True,
    callback=_checked_agent_name,
    help="The agent name a worker serves (its --agent NAME=...): not empty, no '='.",
)
@click.option("--run-id", default=None, help="The run's id (default: a fresh one).")
@click.argument("text")
def submit_command(store_path: str, agent_name: str, run_id: str | None, text: str) -> None:
    """Queue a run of an agent on TEXT; print its run id (submitting it again is idempotent)."""
    from treadle._ids import check_run_id, new_run_id

    try:
        chosen = check_run_id(run_id) if run_id is not None else new_run_id()
    except TreadleError as exc:
        raise click.BadParameter(str(exc), param_hint="--run-id") from exc

    async def go() -> None:
        async with open_queue(store_path) as store:
            assert isinstance(store, RunQueue)  # open_queue refuses a store without one
            await store.submit(
                chosen,
                agent=agent_name,
                input=(Message(role="user", content=valid_text(text)[0]),),
            )

    run_async(go)
    click.echo(chosen)


@click.command("wait")
@run_id_argument()
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option(
    "--poll",
    "poll_s",
    default=CLAIM_POLL_S,
    show_default=True,
    type=Seconds(above_zero=True),
    help="Seconds between two looks at the run.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=Seconds(),
    default=None,
    help="Give up after this many seconds (exit 2), having looked once at least (0: look once);"
    " default: wait as long as it takes.",
)
def wait_command(
    run_id: str, store_path: str, as_json: bool, poll_s: float, timeout_s: float | None
) -> None:
    """Wait until a run finished (whoever drives it); exit 0 when it succeeded, else 1.

    Exit 2 when --timeout passed first (it looks once at least: 0 looks once). A run
    that is quarantined (no worker takes it until treadle unquarantine) is said so on
    stderr, once, and waited for on.
    """

    async def go() -> RunResult | None:
        async with open_store(store_path) as store:
            return await _wait(store, run_id, poll_s, timeout_s)

    with on_interrupt(f"stopped waiting for run {run_id}, which is left as it was"):
        result = run_async(go)
    if result is None:
        click.echo(f"run {run_id} has not finished after {timeout_s:g} s", err=True)
        sys.exit(2)
    if as_json:
        click.echo(
            printable_json(
                {
                    "run_id": result.run_id,
                    "state": result.state.value,
                    "stop_reason": result.stop_reason.value,
                    "final_answer": result.final_answer,
                    "output": result.output,
                    "error": result.error,
                    "steps": result.totals.steps,
                }
            )
        )
    else:
        answer = f": {printable(result.final_answer)}" if result.final_answer else ""
        if result.output is not None:
            answer = ": " + printable_json(result.output)
        click.echo(f"{result.run_id}: {result.state.value} ({result.stop_reason.value}){answer}")
    if result.state is not RunState.SUCCEEDED:
        sys.exit(1)


async def _wait(
    store: RunStore, run_id: str, poll_s: float, timeout_s: float | None
) -> RunResult | None:
    """The run's result, or ``None`` once ``timeout_s`` seconds passed; it looks once at least.

    Each look reads the run's summary, and its log only once the run finished, every
    ``poll_s`` seconds; a quarantined run is said so on stderr, once. The first look is never
    cut short, so ``--timeout 0`` answers a finished run with its result and an unknown run
    with its error however long a read of the store takes; a later look still under way at
    the deadline is cut there (a server that stopped answering, say; docs/fleet.md, "Poison
    runs").

    Raises:
        UsageError: the store knows no such run.
    """
    deadline = trio.current_time() + (math.inf if timeout_s is None else timeout_s)
    said = False
    cut_at = math.inf  # the first look runs to its end
    while True:
        with trio.move_on_at(cut_at):
            summary = await store.read_summary(run_id) if isinstance(store, RunIndex) else None
            if summary is None or summary.liveness is Liveness.FINISHED:
                found = await _finished_result(store, run_id)
                if found is not None:
                    return found
            elif not said and summary.liveness is Liveness.QUARANTINED:
                said = True
                click.echo(f"run {run_id} is {in_queue(summary)}; waiting on", err=True)
        cut_at = deadline
        left = deadline - trio.current_time()
        if left <= 0:
            return None
        await trio.sleep(min(poll_s, left))


async def _finished_result(store: RunStore, run_id: str) -> RunResult | None:
    """The result of ``run_id`` read from its log; ``None`` while it has not finished.

    Raises:
        UsageError: the run has no records and no summary: the store knows no such run.
    """
    log = await store.read_log(run_id)
    if log.finished is not None:
        return RunResult.from_finished(log.finished)
    if not log.records:
        raise UsageError(f"there is no run {run_id!r} in this store")
    return None


@click.command("unquarantine")
@run_id_argument()
@store_option
def unquarantine_command(run_id: str, store_path: str) -> None:
    """Make a quarantined run claimable again (its takeover count starts afresh)."""

    async def go() -> bool:
        async with open_store(store_path) as store:
            if not isinstance(store, RunQueue):
                raise click.ClickException(f"{redact(store_path)} has no queue")
            if await store.release_quarantine(run_id):
                return True
            if isinstance(store, RunIndex) and await store.read_summary(run_id) is None:
                raise click.ClickException(f"no run {run_id!r} in {redact(store_path)}")
            return False

    if not run_async(go):
        raise click.ClickException(f"run {run_id} is not quarantined")
    click.echo(f"run {run_id} is claimable again")
