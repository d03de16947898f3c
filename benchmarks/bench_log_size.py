"""Log bytes per step, by store and run length, and what encoding one record costs.

Workload (benchmarks/_workload.py): an instant model and a no-op tool; a step is one model call
plus one tool call: five records (model intent, model result, action intent, action result,
step record), written as four store operations. ``--total / S`` concurrent runs of S steps
each are driven to the end on a fresh store, which is then closed; the bytes are those of
every file the store left (SQLite: the database, its WAL checkpointed away on close; JSONL:
the run files and their lease files), divided by the steps. S=50 and S=1000 by default, the
same total of steps for both (so that what a store costs once, its tables and their first
pages, weighs the same): a log's bytes per step should not grow with its length.

The second table reads the records of one run back (the longest, of the first store given)
and times each encoding of the codec on them (`treadle.stores._codec`): the JSON objects every
log held before layout 3 / format 3, and the compact arrays written since
(docs/decisions/0085-compact-log-records.md). Run with:

    python benchmarks/bench_log_size.py [--total 10000] [--lengths 50,1000]
                                        [--stores sqlite,jsonl] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least, listed, one_of
from _workload import drive, load_note
from treadle.ports import RunStore
from treadle.stores import _codec

STORES: dict[str, tuple[Callable[[str], AbstractAsyncContextManager[RunStore]], str]] = {
    "sqlite": (treadle.open_sqlite_store, "bench.db"),
    "jsonl": (treadle.open_jsonl_store, "runs"),
}
"""Store kind -> its opener and the name of what it writes in the measured folder. The bytes
measured are the files a closed store left: a PostgreSQL store leaves none (its rows are the
server's), so it is not a kind here."""


async def measure(kind: str, runs: int, steps: int) -> tuple[int, list[Any]]:
    """Drive ``runs`` runs of ``steps`` steps; return the store's bytes and one run's records."""
    opener, name = STORES[kind]
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, name)
        async with opener(where) as store:
            await drive(store, runs, steps, "bench-run")
        async with opener(where) as store:
            log = await store.read_log("bench-run-0")
        size = tree_bytes(tmp)
    return size, list(log.records)


def tree_bytes(where: str) -> int:
    return sum(p.stat().st_size for p in Path(where).rglob("*") if p.is_file())


def medians(repeat: int, fns: Sequence[Callable[[], object]]) -> list[float]:
    """The median of ``repeat`` timings of each of ``fns``, seconds.

    The functions take turns within each repeat, so that a machine busy with other work slows
    them alike.
    """
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, taken in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            taken.append(time.perf_counter() - start)
    return [statistics.median(taken) for taken in times]


def codec_rows(records: list[Any], repeat: int) -> list[tuple[str, ...]]:
    """Per record kind: bytes and µs per record, objects encoding then compact."""
    compact = hasattr(_codec, "pack")
    by_kind: dict[str, list[Any]] = {}
    for record in records:
        by_kind.setdefault(_codec.KIND_OF[type(record)], []).append(record)
    rows = []
    for kind, group in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        run_id = group[0].run_id
        objects = [_codec.encode_bytes(r) for r in group]
        n = len(group)
        fns: list[Callable[[], object]] = [
            lambda g=group: [_codec.encode_bytes(r) for r in g],
            lambda b=objects: [_codec.decode(x) for x in b],
        ]
        if compact:
            tag = _codec.TAG_OF[type(group[0])]
            packed = [_codec.pack(r, run_id) for r in group]
            fns += [
                lambda g=group, i=run_id: [_codec.pack(r, i) for r in g],
                lambda b=packed, i=run_id, k=tag: [_codec.unpack(x, i, k) for x in b],
            ]
        taken = [f"{t / n * 1e6:.1f}" for t in medians(repeat, fns)]
        row = [kind, str(n), f"{sum(map(len, objects)) / n:,.0f}", *taken[:2]]
        if compact:
            row += [f"{sum(map(len, packed)) / n:,.0f}", *taken[2:]]
        else:
            row += ["—", "—", "—"]
        rows.append(tuple(row))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--total", type=at_least(1), default=10_000, help="steps per store and length"
    )
    parser.add_argument(
        "--lengths", type=listed(at_least(1)), default="50,1000", help="steps per run, a,b,..."
    )
    parser.add_argument(
        "--stores",
        type=listed(one_of(*STORES, what="store kind")),
        default="sqlite,jsonl",
        help=f"store kinds, a,b,... of {', '.join(STORES)}",
    )
    parser.add_argument("--repeat", type=at_least(1), default=5, help="timings per codec figure")
    args = parser.parse_args(argv)
    console = Console(width=120)
    sizes = Table(title="treadle log bytes per step (model call + tool call)")
    for column in ("store", "runs", "steps/run", "store bytes", "bytes/step"):
        sizes.add_column(column, justify="right")
    sample: list[Any] = []
    for kind in args.stores:
        for steps in args.lengths:
            runs = max(1, args.total // steps)
            size, records = trio.run(measure, kind, runs, steps)
            if len(records) > len(sample):  # the longest run of the first store measured
                sample = records
            total = runs * steps
            sizes.add_row(kind, str(runs), f"{steps:,}", f"{size:,}", f"{size / total:,.0f}")
    console.print(sizes)
    codec = Table(title="the codec on one run's records (bytes and µs per record)")
    columns = ("kind", "records", "objects bytes", "encode µs", "decode µs")
    for column in (*columns, "compact bytes", "encode µs", "decode µs"):
        codec.add_column(column, justify="right")
    for row in codec_rows(sample, args.repeat):
        codec.add_row(*row)
    console.print(codec)
    console.print(
        "Store bytes: every file the closed store left, divided by the steps. Codec: median of "
        f"{args.repeat} timings of encoding (decoding) every record of the kind, the four taking "
        "turns. " + load_note()
    )


if __name__ == "__main__":
    main()
