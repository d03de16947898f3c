"""treadle's SQLite and JSONL stores before and after the store rewrite, side by side.

Workload: bench_runtime.py's (benchmarks/_workload.py): an instant model and a no-op tool, a
step being one model call plus one tool call. Each pass runs in a fresh process, with
PYTHONPATH at the ``src`` of either version and this working tree's benchmarks/ code:

- before: commit --before (default 82321cc, the last one before the rewrite), checked out
  with ``git worktree add`` into a temporary folder that is removed afterwards;
- after: this working tree (uncommitted changes included).

C=1 is one run of 5 x --steps steps, C=--runs that many concurrent runs of --steps steps.
--repeat rounds, before and after alternating which goes first; the table shows medians, and
each after/before ratio is the median of the rounds' ratios. Run with:

    python benchmarks/bench_stores_before_after.py [--steps 100] [--runs 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _args import at_least

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = ("sqlite", "jsonl")
VERSIONS = ("before", "after")


def one_pass(kind: str, runs: int, steps: int) -> dict[str, object]:
    """Measure in this process, with whichever treadle PYTHONPATH gives."""
    import trio

    import treadle
    from _stores import open_store
    from _workload import timed

    async def go() -> dict[str, object]:
        async with open_store(kind) as store:
            t = await timed(store, runs, steps)
        return {"steps_per_s": t.steps_per_s, "cpu_us_per_step": t.cpu_us_per_step}

    return {"treadle": treadle.__file__, **trio.run(go)}


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """``git worktree add`` of ``rev`` in a temporary folder, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="treadle-before-"))
    git = ["git", "-C", str(REPO)]
    subprocess.run(
        [*git, "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True
    )
    try:
        yield path
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run([*git, "worktree", "prune"], check=False)


def run_pass(src: Path, kind: str, runs: int, steps: int) -> dict[str, float] | str:
    """The pass's figures, or why it failed."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, __file__, "--pass", f"{kind},{runs},{steps}"]
    done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return (errors or done.stderr.strip().splitlines() or ["?"])[-1].strip()
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out["treadle"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"the pass with PYTHONPATH={src} imported treadle from {out['treadle']}")
    return {"steps_per_s": out["steps_per_s"], "cpu_us_per_step": out["cpu_us_per_step"]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=100, help="steps per run at C=--runs")
    parser.add_argument("--runs", type=at_least(1), default=100, help="concurrent runs")
    parser.add_argument("--repeat", type=at_least(1), default=3, help="rounds (medians are shown)")
    parser.add_argument("--before", default="82321cc", help="the commit before the rewrite")
    parser.add_argument("--pass", dest="one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # one measurement, in this fresh process
        kind, runs, steps = args.one.split(",")
        print(json.dumps(one_pass(kind, int(runs), int(steps))))
        return
    from _workload import load_note

    load_before = load_note()
    shapes = ((1, args.steps * 5), (args.runs, args.steps))
    results: dict[tuple[str, int, str], list[dict[str, float] | str]] = {}
    with worktree(args.before) as tree:
        sources = {"before": tree / "src", "after": REPO / "src"}
        for round_ in range(args.repeat):
            for kind in KINDS:
                for runs, steps in shapes:
                    order = VERSIONS if round_ % 2 == 0 else VERSIONS[::-1]
                    for version in order:
                        done = run_pass(sources[version], kind, runs, steps)
                        results.setdefault((kind, runs, version), []).append(done)
    console = Console()
    console.print(table(results, shapes, args))
    console.print("after/before steps/s of each round: " + "; ".join(round_ratios(results)))
    for (kind, runs, version), passes in results.items():
        for number, done in enumerate(passes, 1):
            if isinstance(done, str):
                console.print(f"FAILED {version} {kind} C={runs} round {number}: {done}")
    console.print(
        f"before: {args.before} (git worktree, removed); after: the working tree. "
        f"C=1: one run of {args.steps * 5} steps; C={args.runs}: {args.runs} runs of "
        f"{args.steps} steps. SQLite synchronous=FULL (both versions). CPU: the pass's process "
        f"(all its threads). Medians of {args.repeat} rounds (those whose two passes "
        "succeeded), ratios the median of the rounds' after/before ratios.\n"
        f"Machine: {load_before} before, {load_note()} after."
    )


def round_ratios(results: dict[tuple[str, int, str], list[dict[str, float] | str]]) -> list[str]:
    out = []
    for (kind, runs, version), befores in results.items():
        if version != "before":
            continue
        ratios = [
            f"{a['steps_per_s'] / b['steps_per_s']:.2f}"
            if not isinstance(a, str) and not isinstance(b, str)
            else "failed"
            for b, a in zip(befores, results[(kind, runs, "after")], strict=True)
        ]
        out.append(f"{kind} C={runs} {' '.join(ratios)}")
    return out


def table(
    results: dict[tuple[str, int, str], list[dict[str, float] | str]],
    shapes: Sequence[tuple[int, int]],
    args: argparse.Namespace,
) -> Table:
    title = f"treadle stores before ({args.before}) and after the rewrite, median of {args.repeat}"
    out = Table(title=title)
    for column in ("store", "C", "steps/s\nbefore", "steps/s\nafter", "after/\nbefore"):
        out.add_column(column, justify="right")
    for column in ("CPU µs/\nstep before", "CPU µs/\nstep after", "after/\nbefore"):
        out.add_column(column, justify="right")
    for kind in KINDS:
        for runs, _ in shapes:
            befores, afters = results[(kind, runs, "before")], results[(kind, runs, "after")]
            pairs = [
                (b, a)
                for b, a in zip(befores, afters, strict=True)
                if not isinstance(b, str) and not isinstance(a, str)
            ]
            cells = [kind, str(runs)]
            for key in ("steps_per_s", "cpu_us_per_step"):
                if not pairs:
                    cells += ["failed", "failed", ""]
                    continue
                cells += [
                    f"{statistics.median(b[key] for b, _ in pairs):,.0f}",
                    f"{statistics.median(a[key] for _, a in pairs):,.0f}",
                    f"{statistics.median(a[key] / b[key] for b, a in pairs):.2f}x",
                ]
            out.add_row(*cells)
    return out


if __name__ == "__main__":
    main()
