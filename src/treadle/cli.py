"""The ``treadle`` command (click for parsing, rich for output).

Commands, each in the module that implements it:

* ``treadle probe``: one streaming call to an OpenAI-compatible endpoint (`treadle._cli_probe`).
* ``treadle runs`` / ``show`` / ``resume``: a store's runs, one run's trajectory, resuming
  unfinished runs (`treadle._cli_store`).
* ``treadle approve`` / ``cancel`` / ``tail`` / ``repair``: acting on one run
  (`treadle._cli_runs`).
* ``treadle worker`` / ``submit`` / ``wait`` / ``unquarantine``: a fleet over one store
  (`treadle._cli_fleet`).
* ``treadle simulate``: seeded simulations (`treadle._cli_simulate`).
* ``treadle ui``: the run console in the browser (`treadle._cli_ui`, which loads `treadle._ui`).
* ``treadle demo``: the airline replay demo (`treadle.demo.cli`), when the demo is installed.

The group loads a command's module only when that command runs (docs/design.md, "Start-up"):
``treadle --help`` lists the commands from `COMMANDS` and imports none of them, so it does not
load the stores, the runtime or the model clients. `tests/test_cli.py` checks that each entry's
help line is the command's own.

Around every command the group applies `treadle._terminal`: characters standard output or
error cannot encode are escaped instead of ending the command in a traceback, and Ctrl-C
prints one line and exits with status 130. For ``treadle worker`` it first holds the stop
signals (`treadle._stop_signals`), before it loads the command's module, so that one that
arrives while the worker is starting stops it cleanly (docs/fleet.md, "Shutting a worker down").
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Final

import attrs
import click

from treadle._stop_signals import hold_stop_signals
from treadle._terminal import escape_unencodable_text, on_interrupt


@attrs.frozen
class Entry:
    """Where a command lives and the line ``treadle --help`` shows for it.

    Attributes:
        module: the module defining the command.
        attribute: the `click.Command` in it.
        help: its short help (the first sentence of its docstring).
        holds_stop_signals: the command takes SIGTERM, SIGINT and SIGHUP from before its
            module loads (`treadle._stop_signals.hold_stop_signals`): ``treadle worker``.
    """

    module: str
    attribute: str
    help: str
    holds_stop_signals: bool = False


COMMANDS: Final = {
    "approve": Entry(
        "treadle._cli_runs",
        "approve_command",
        "Approve (or reject, or edit) the tool call a run waits on.",
    ),
    "cancel": Entry(
        "treadle._cli_runs", "cancel_command", "Cancel a run (durable; works from any process)."
    ),
    "demo": Entry(
        "treadle.demo.cli",
        "demo",
        "Replay a recorded airline conversation, kill it with SIGKILL midway, resume it.",
    ),
    "probe": Entry(
        "treadle._cli_probe",
        "probe",
        "Make one streaming call and print the assembled reply as JSON.",
    ),
    "repair": Entry(
        "treadle._cli_runs",
        "repair_command",
        "Cut a damaged JSONL run log at its first damaged line, keeping what it removes.",
    ),
    "resume": Entry(
        "treadle._cli_store",
        "resume",
        "Resume an unfinished run (or every one, with --all) and print how it ended.",
    ),
    "runs": Entry(
        "treadle._cli_store", "runs", "List the runs of a store: state, who drives each, steps."
    ),
    "show": Entry(
        "treadle._cli_store",
        "show",
        "Show a run's trajectory as a table (or its events as JSON lines).",
    ),
    "simulate": Entry(
        "treadle._cli_simulate",
        "simulate_command",
        "Simulate runs under seeded faults and check the durability invariants.",
    ),
    "submit": Entry(
        "treadle._cli_fleet",
        "submit_command",
        "Queue a run of an agent on TEXT; print its run id (submitting it again is idempotent).",
    ),
    "tail": Entry(
        "treadle._cli_runs",
        "tail_command",
        "Print a run's events from a seq on, live, until the run finishes.",
    ),
    "ui": Entry(
        "treadle._cli_ui",
        "ui_command",
        "Serve a run console for a store in the browser: runs, timelines, approvals, cancel.",
    ),
    "unquarantine": Entry(
        "treadle._cli_fleet",
        "unquarantine_command",
        "Make a quarantined run claimable again (its takeover count starts afresh).",
    ),
    "wait": Entry(
        "treadle._cli_fleet",
        "wait_command",
        "Wait until a run finished (whoever drives it); exit 0 when it succeeded, else 1.",
    ),
    "worker": Entry(
        "treadle._cli_fleet",
        "worker_command",
        "Serve agents from a store's queue until SIGTERM, SIGINT or SIGHUP, then drain and exit 0.",
        holds_stop_signals=True,
    ),
}
"""Every ``treadle`` command: name -> where it lives and its help line."""


def _installed(entry: Entry) -> bool:
    """Whether ``entry``'s package is part of this install (the demo may be left out)."""
    package = entry.module.rpartition(".")[0]
    return package == "treadle" or importlib.util.find_spec(package) is not None


class _Commands(click.Group):
    """A group that imports a command's module only when the command is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """The command names, sorted (those of packages left out of the install omitted)."""
        return sorted(name for name, entry in COMMANDS.items() if _installed(entry))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command ``cmd_name``, its module imported now; ``None`` for an unknown one.

        A command that holds its stop signals has them held before its module loads
        (docs/fleet.md, "Shutting a worker down").
        """
        entry = COMMANDS.get(cmd_name)
        if entry is None or not _installed(entry):
            return None
        if entry.holds_stop_signals:
            hold_stop_signals()
        command = getattr(importlib.import_module(entry.module), entry.attribute)
        assert isinstance(command, click.Command)
        return command

    def invoke(self, ctx: click.Context) -> object:
        """Run the command, its output encodable and Ctrl-C exiting 130 (`treadle._terminal`).

        A command that knows what an interruption leaves says it with its own
        `treadle._terminal.on_interrupt`; any other prints ``interrupted``, wherever it
        came (loading the command's module included).
        """
        escape_unencodable_text()
        with on_interrupt():
            return super().invoke(ctx)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The "Commands" section of ``--help``, from `COMMANDS` (no command is imported)."""
        rows = [(name, COMMANDS[name].help) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Commands)
@click.version_option(package_name="treadle")
def main() -> None:
    """treadle: durable, cancellable, budgeted LLM agent runs."""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
