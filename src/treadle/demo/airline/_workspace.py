"""What a replay keeps next to its run store: databases, crash and resume counts, mismatches.

Part of `treadle.demo.airline.replay`, which re-exports the public names (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from treadle._exceptions import StoreError
from treadle.demo.airline.data import (
    load_data,
)
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.replay_server import HistoryMismatch


def _reason(exc: OSError | sqlite3.Error) -> str:
    """Why a write failed, as its message says it (``No space left on device`` …)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


@contextlib.contextmanager
def _writing(path: Path, what: str, *, tmp: Path | None = None) -> Iterator[None]:
    """Turn a failed write of ``path`` inside the block into a `StoreError` naming it.

    ``what`` says what the file is (``the airline database …``); ``tmp``, the file being
    written in its place until it is renamed to ``path``, is removed then, with the
    rollback journal SQLite may have left beside it.

    Raises:
        StoreError: an `OSError` or `sqlite3.Error` (a full disk, a file-size limit, no
            permission) was raised inside; it is the ``__cause__``.
    """
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        for partial in () if tmp is None else (tmp, tmp.with_name(f"{tmp.name}-journal")):
            with contextlib.suppress(OSError):  # the write's error is the one raised
                partial.unlink(missing_ok=True)
        raise StoreError(f"cannot write {path}, {what}: {_reason(exc)}") from exc


def _write_json_atomically(path: Path, value: Any, what: str) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file renamed over it.

    Raises:
        StoreError: it could not be written (see `_writing`).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _writing(path, what, tmp=tmp):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value), encoding="utf-8")
        tmp.replace(path)


@attrs.frozen(kw_only=True)
class RunCounts:
    """Driver processes of one run: how many were killed, and how many resumed it."""

    crashes: int = 0
    resumes: int = 0


@attrs.frozen(kw_only=True)
class Workspace:
    """The files of a replay: the run store and, beside it, ``<store>.airline/``.

    Attributes:
        store: the SQLite run store file.
        root: the folder holding ``fresh.sqlite3`` (the database every conversation starts
            from), ``conversations/<run_id>.sqlite3``, ``runs/<run_id>.json`` (crash and
            resume counts) and ``mismatches/<run_id>.jsonl`` (one history mismatch a line).
    """

    store: Path
    root: Path

    @classmethod
    def beside(cls, store: str | os.PathLike[str]) -> Workspace:
        """The workspace of a store file: ``<store>.airline/`` next to it (created).

        Raises:
            StoreError: the folder cannot be made there (its parent missing or not a folder,
                a read-only file system, no permission); the `OSError` is its ``__cause__``.
        """
        path = Path(store).absolute()
        root = path.with_name(path.name + ".airline")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot make {root}, the folder of the airline databases beside the store "
                f"{path}: {exc.strerror or exc}"
            ) from exc
        return cls(store=path, root=root)

    def fresh_database(self, data_dir: Path) -> AirlineDatabase:
        """The database every conversation starts from, built from the JSON files once.

        Raises:
            AirlineDataUnreadable: a data file of ``data_dir`` cannot be used.
            StoreError: the database cannot be written beside the store (a full disk);
                nothing of it is left there.
        """
        path = self.root / "fresh.sqlite3"
        if not path.is_file():
            data = load_data(data_dir)
            tmp = path.with_name(f".fresh.{os.getpid()}.sqlite3")
            with _writing(path, self._describe("the airline database"), tmp=tmp):
                tmp.unlink(missing_ok=True)
                AirlineDatabase.create(tmp, data)
                tmp.replace(path)
        return AirlineDatabase(path)

    def conversation_path(self, run_id: str) -> Path:
        """The database file of one conversation."""
        return self.root / "conversations" / f"{run_id}.sqlite3"

    def conversation(self, run_id: str, fresh: AirlineDatabase) -> AirlineDatabase:
        """The conversation's database; a copy of ``fresh`` made (atomically) if missing.

        Raises:
            StoreError: the copy cannot be written beside the store (a full disk); nothing
                of it is left there.
        """
        path = self.conversation_path(run_id)
        if not path.is_file():
            tmp = path.with_name(f".{run_id}.{os.getpid()}.sqlite3")
            with _writing(path, self._describe(f"the airline database of {run_id}"), tmp=tmp):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.unlink(missing_ok=True)
                fresh.copy_to(tmp)
                tmp.replace(path)
        return AirlineDatabase(path)

    def _describe(self, what: str) -> str:
        """``what``, followed by where it is: ``<what> beside the store <store>``."""
        return f"{what} beside the store {self.store}"

    def counts(self, run_id: str) -> RunCounts:
        """The run's crash and resume counts so far (zeros for a run never driven)."""
        path = self.root / "runs" / f"{run_id}.json"
        if not path.is_file():
            return RunCounts()
        raw = json.loads(path.read_text(encoding="utf-8"))
        return RunCounts(crashes=int(raw["crashes"]), resumes=int(raw["resumes"]))

    def save_counts(self, run_id: str, counts: RunCounts) -> None:
        """Store the run's counts (atomically).

        Raises:
            StoreError: they cannot be written (a full disk); the stored ones are kept.
        """
        value = {"crashes": counts.crashes, "resumes": counts.resumes}
        what = self._describe(f"the crash and resume counts of {run_id}")
        _write_json_atomically(self.root / "runs" / f"{run_id}.json", value, what)

    def record_mismatch(self, run_id: str, mismatch: HistoryMismatch) -> None:
        """Append one history mismatch to the run's file.

        Raises:
            StoreError: it cannot be written (a full disk).
        """
        path = self.root / "mismatches" / f"{run_id}.jsonl"
        with _writing(path, self._describe(f"the history mismatches of {run_id}")):
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(mismatch.to_json(), ensure_ascii=False) + "\n")

    def mismatches(self, run_id: str) -> list[dict[str, Any]]:
        """Every history mismatch recorded for the run, oldest first."""
        path = self.root / "mismatches" / f"{run_id}.jsonl"
        if not path.is_file():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]


@contextlib.contextmanager
def open_workspace(store: str | os.PathLike[str] | None) -> Iterator[Workspace]:
    """The workspace of ``store``; without a store, a temporary one removed afterwards."""
    if store is not None:
        yield Workspace.beside(store)
        return
    with tempfile.TemporaryDirectory(prefix="treadle-airline-") as tmp:
        yield Workspace.beside(Path(tmp) / "runs.db")
