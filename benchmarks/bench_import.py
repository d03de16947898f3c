"""Start-up time: ``import treadle`` and ``treadle --help`` beside ``import trio, attrs, cattrs``.

Each command runs in a fresh interpreter ``--repeat`` times, the three interleaved; the table
shows the median wall time of each and its ratio to the baseline (the libraries treadle cannot
start without). Targets (issue "what a new user trips over", item 8): ``import treadle``
<= 1.5x the baseline, ``treadle --help`` <= 2x. Run with:

    python benchmarks/bench_import.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from _args import at_least

COMMANDS = {
    "import trio, attrs, cattrs": [sys.executable, "-c", "import trio, attrs, cattrs"],
    "import treadle": [sys.executable, "-c", "import treadle"],
    "treadle --help": [sys.executable, "-m", "treadle", "--help"],
    "import treadle; treadle.run": [sys.executable, "-c", "import treadle; treadle.run"],
}
"""The last row, without a target, is what a run needs before its first step (the runtime,
the stores and the supervisors, loaded on first use of any of their names)."""
TARGETS = {"import treadle": 1.5, "treadle --help": 2.0}


def timed(command: Sequence[str]) -> float:
    """Seconds one run of ``command`` takes, from start to exit."""
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def main(argv: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=at_least(1), default=15, help="runs of each command")
    args = parser.parse_args(argv)
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeat):
        for name, command in COMMANDS.items():
            samples[name].append(timed(command))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["import trio, attrs, cattrs"]
    table = Table(title=f"start-up, median of {args.repeat} interleaved runs")
    for column in ("command", "ms", "x baseline", "target", "met"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name, median in medians.items():
        target = TARGETS.get(name)
        ratio = median / base
        table.add_row(
            name,
            f"{median * 1e3:.0f}",
            f"{ratio:.2f}x",
            f"<= {target}x" if target else "",
            ("yes" if ratio <= target else "NO") if target else "",
        )
    console = Console()
    console.print(table)
    load = os.getloadavg()
    console.print(f"Machine: load average {load[0]:.1f} (1 min) on {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
