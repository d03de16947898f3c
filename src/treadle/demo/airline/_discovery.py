"""Finding the airline workload and its recordings: the data folder, trajectories, run ids.

Part of `treadle.demo.airline.replay`, which re-exports the public names (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from treadle.demo.airline.data import (
    DATA_ENV_VAR,
    AirlineDataNotFound,
    Recording,
    _recording_from_json,
    download_data,
    find_data_dir,
    recording_key,
)
from treadle.demo.airline.scoring import (
    recorded_tool_calls,
)

RUN_ID_PREFIX: Final = "airline"
"""Run ids are ``airline-<task_id>-<trial>``."""


DEMO_RECORDING: Final = "30-1"
"""The recording `treadle demo` replays: two cancellations, 16 steps, recorded reward 1."""


def run_id_of(recording: Recording) -> str:
    """The run id of a recording's replay: ``airline-<task_id>-<trial>``."""
    return f"{RUN_ID_PREFIX}-{recording.task_id}-{recording.trial}"


def load_trajectories(path: str | os.PathLike[str]) -> tuple[Recording, ...]:
    """Read a recordings file (the format of the workload's ``trajectories.json``).

    Raises:
        FileNotFoundError: no such file.
        TypeError: JSON, but not a list.
        ValueError: not JSON, a recording without a needed field, or two recordings with the
            same task and trial.
    """
    with Path(path).open(encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, list):
        raise TypeError(f"{path}: expected a JSON list of recordings")
    try:
        recordings = tuple(_recording_from_json(item) for item in raw)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: a recording lacks a field: {exc!r}") from exc
    keys = [recording_key(r) for r in recordings]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"{path}: several recordings for task-trial {', '.join(duplicates)}")
    return recordings


def find_recording(recordings: Sequence[Recording], key: str) -> Recording:
    """The recording with key ``<task_id>-<trial>``.

    Raises:
        LookupError: when there is none.
    """
    for recording in recordings:
        if recording_key(recording) == key:
            return recording
    raise LookupError(f"no recording {key!r} (keys are <task_id>-<trial>)")


def default_cache_dir() -> Path:
    """Where downloaded workload files go: ``$XDG_CACHE_HOME/treadle/airline``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "treadle" / "airline"


def locate_workload(
    explicit: str | os.PathLike[str] | None = None,
    *,
    download: bool = True,
    cache_dir: Path | None = None,
    notify: Callable[[str], None] | None = None,
) -> Path:
    """Find the workload folder, downloading it when it is nowhere to be found.

    The search is `find_data_dir`'s (the explicit folder, else ``TREADLE_AIRLINE_DATA``, else
    ``shared/workloads/airline`` above the working directory or this package). When neither
    an explicit folder nor the environment variable was given and nothing was found, the
    files are fetched once from the public tau-bench repository into ``cache_dir`` (default
    `default_cache_dir`), with the address-key alignment applied.

    Raises:
        AirlineDataNotFound: not found, and downloading is off or not applicable.
        httpx.HTTPError: the download failed (nothing partial is left behind).
    """
    try:
        return find_data_dir(explicit)
    except AirlineDataNotFound:
        if explicit is not None or os.environ.get(DATA_ENV_VAR) or not download:
            raise
    cache = cache_dir or default_cache_dir()
    if (cache / "data" / "users.json").is_file() and (cache / "trajectories.json").is_file():
        return cache
    if notify is not None:
        notify(f"airline workload not found locally; downloading it into {cache}")
    return download_data(cache)


def recorded_steps(recording: Recording) -> int:
    """The number of assistant messages (treadle steps) of a recording."""
    return sum(1 for m in recording.messages if m.get("role") == "assistant")


def expected_writes(recording: Recording) -> int:
    """Store writes of an uninterrupted replay: run-started, four per step, run-finished."""
    return 4 * recorded_steps(recording) + 2


def pick_demo_recording(recordings: Sequence[Recording]) -> Recording:
    """`DEMO_RECORDING` when present, else the first reward-1 recording that books or cancels.

    Raises:
        LookupError: no recording books or cancels anything with reward 1.
    """
    with contextlib.suppress(LookupError):
        return find_recording(recordings, DEMO_RECORDING)
    for recording in recordings:
        tools = {tool for _, tool, _, _ in recorded_tool_calls(recording)}
        if recording.reward == 1.0 and tools & {"book_reservation", "cancel_reservation"}:
            return recording
    raise LookupError("no recording with reward 1 books or cancels a reservation")
