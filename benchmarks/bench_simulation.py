"""Simulated runs per minute with faults on (issue target: >= 1,000 ten-step runs per minute).

"all (default)" is `FaultPlan.default()`: crashes, store failures, model and tool faults,
cancels, approval decisions at seeded delays and seeded actor latency.

python benchmarks/bench_simulation.py [--seeds 300]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from _args import at_least
from treadle.testing.simulation import FaultPlan, simulate


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=at_least(1), default=300, help="seeds per row")
    args = parser.parse_args(argv)
    # A tool call abandoned in the tool host logs its late return; under `tool_stuck` that is
    # the injected fault itself, as in `treadle simulate`, which quiets it the same way.
    logging.getLogger("treadle.tools").setLevel(logging.ERROR)
    table = Table(title="treadle simulation throughput (1 run of 10 steps per seed)")
    for column in ("faults", "seeds", "steps", "runs/min", "failing"):
        table.add_column(column, justify="right")
    for label, plan in (("none", FaultPlan(rates={})), ("all (default)", FaultPlan.default())):
        started = time.perf_counter()
        results = [simulate(seed, plan=plan) for seed in range(args.seeds)]
        elapsed = time.perf_counter() - started
        table.add_row(
            label,
            str(args.seeds),
            str(sum(r.steps for r in results)),
            f"{args.seeds / elapsed * 60:,.0f}",
            str(sum(not r.ok for r in results)),
        )
    Console().print(table)
    Console().print("Each seed also runs the fault-free twin used by the trajectory check.")


if __name__ == "__main__":
    main()
