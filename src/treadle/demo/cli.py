"""``treadle demo``: recorded airline conversations replayed through treadle, with real crashes.

* ``treadle demo``: replays one recorded conversation that cancels reservations, shows it as
  it goes, kills the process driving it with SIGKILL right after the first cancellation ran
  (before its result reached the log), resumes it from the log in a new process, and prints
  the score, the recorded score and the command to read the log.
* ``treadle demo airline --trajectories PATH [--store PATH] [--crash none|random] [--seed N]
  [--concurrency N] [--json]``: replays every recording of a file, one JSON line each.
* ``treadle demo airline --live --base-url URL --model NAME [--api-key-env VAR]
  [--task-id N]``: the same agent against a live endpoint, the person at the terminal being
  the customer.

This module declares the commands only; what they do is in `treadle.demo._app`, imported
when one runs (the replay brings httpx, the simulation and the workload code with it).
"""

from __future__ import annotations

import re
from typing import Any

import click

from treadle.demo._defaults import DEFAULT_CONCURRENCY


def _store_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse an empty ``--store`` (it stood for no store, and a new one was made)."""
    if value == "":
        raise click.BadParameter("give a file path (or leave --store out for a new store)")
    return value


def _recording_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a ``--recording`` that is not ``TASK-TRIAL`` (an empty one stood for the default)."""
    if value is not None and not re.fullmatch(r"[0-9]+-[0-9]+", value):
        raise click.BadParameter(f"{value!r} is not TASK-TRIAL, e.g. 30-1")
    return value


def _refuse_demo_options(
    ctx: click.Context, *, store_path: str | None, data_dir: str | None, key: str | None
) -> None:
    """Refuse an option of ``treadle demo`` given before one of its subcommands.

    The subcommand never sees the demo's options: a ``--store`` given there was dropped, and
    the runs went to a temporary store that was then removed (docs/demo.md, "`treadle demo
    airline`").

    Raises:
        click.UsageError: such an option was given (exit status 2), before anything is made.
    """
    command = f"treadle demo {ctx.invoked_subcommand}"
    if store_path is not None or data_dir is not None:
        name = "--store" if store_path is not None else "--data"
        raise click.UsageError(
            f"{name} before {ctx.invoked_subcommand!r} is an option of `treadle demo` itself, "
            f"which `{command}` would ignore; give it after {ctx.invoked_subcommand!r}",
            ctx,
        )
    if key is not None:
        raise click.UsageError(
            f"--recording is an option of `treadle demo` itself; `{command}` replays every "
            "recording of its --trajectories file",
            ctx,
        )


@click.group(invoke_without_command=True)
@click.option(
    "--store",
    "store_path",
    type=click.Path(dir_okay=False),
    default=None,
    callback=_store_path,
    help="SQLite store file (default: a new file in ./.treadle/).",
)
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Airline workload folder (default: found or downloaded).",
)
@click.option(
    "--recording",
    "key",
    default=None,
    callback=_recording_key,
    metavar="TASK-TRIAL",
    help="Recording to replay, e.g. 30-1 (default: 30-1).",
)
@click.pass_context
def demo(ctx: click.Context, store_path: str | None, data_dir: str | None, key: str | None) -> None:
    """Replay a recorded airline conversation, kill it with SIGKILL midway, resume it."""
    if ctx.invoked_subcommand is not None:
        _refuse_demo_options(ctx, store_path=store_path, data_dir=data_dir, key=key)
        return
    from treadle.demo import _app

    _app.run_demo(store_path, data_dir, key)


@demo.command()
@click.option(
    "--trajectories",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Recordings file (default: the workload's trajectories.json).",
)
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Airline workload folder holding data/*.json (default: found or downloaded).",
)
@click.option(
    "--store",
    "store_path",
    type=click.Path(dir_okay=False),
    default=None,
    callback=_store_path,
    help="SQLite store file; running again with it resumes or reports (default: a "
    "temporary store).",
)
@click.option(
    "--crash",
    type=click.Choice(["none", "random"]),
    default="none",
    show_default=True,
    help="random: kill each run's process with SIGKILL at a seeded point, resume it.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the crash points.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=DEFAULT_CONCURRENCY,
    show_default=True,
    help="Runs driven at the same time.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per recording.")
@click.option("--live", is_flag=True, help="Talk to a live model as the customer.")
@click.option("--base-url", default=None, help="Live: the API root, e.g. https://api.openai.com/v1")
@click.option("--model", default=None, help="Live: the model name.")
@click.option("--api-key-env", default=None, help="Live: environment variable holding the key.")
@click.option(
    "--task-id",
    type=int,
    default=None,
    help="Live: play this task's customer and get the conversation scored.",
)
def airline(**options: Any) -> None:
    """Replay recorded airline conversations through treadle (or talk to a live model)."""
    from treadle.demo import _app

    _app.run_airline(**options)
