"""Locating, loading and downloading the airline workload files.

The workload is a folder holding ``data/users.json``, ``data/reservations.json``,
``data/flights.json`` (the airline database as JSON documents keyed by id),
``trajectories.json`` (recorded conversations) and ``policy.md``. The files are never part of
this repository: `find_data_dir` locates the folder (argument, then the
``TREADLE_AIRLINE_DATA`` environment variable, then a ``shared/workloads/airline`` folder
found by walking upward from the current directory or from this package), and
`download_data` fetches the same files from the public tau-bench repository.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import httpx

from treadle.types import JSONValue

DATA_ENV_VAR: Final = "TREADLE_AIRLINE_DATA"
"""Environment variable naming the workload folder."""

SHARED_SUBDIR: Final = Path("shared") / "workloads" / "airline"
"""Where the workload folder sits below some ancestor of the working directory."""

TABLES: Final = ("users", "reservations", "flights")
"""The three database documents, in the order they are loaded."""

UPSTREAM_REPOSITORY: Final = "sierra-research/tau-bench"
"""The public repository the workload files come from."""

UPSTREAM_FILES: Final[Mapping[str, str]] = {
    "data/users.json": "tau_bench/envs/airline/data/users.json",
    "data/reservations.json": "tau_bench/envs/airline/data/reservations.json",
    "data/flights.json": "tau_bench/envs/airline/data/flights.json",
    "trajectories.json": "historical_trajectories/gpt-4o-airline.json",
    "policy.md": "tau_bench/envs/airline/wiki.md",
}
"""Local file name -> path in the upstream repository."""


class AirlineDataNotFound(FileNotFoundError):
    """No workload folder was found where it was looked for.

    Attributes:
        searched: the folders that were checked, in order.
    """

    def __init__(self, searched: Sequence[Path]) -> None:
        places = "\n  ".join(str(p) for p in searched) or "(nowhere)"
        super().__init__(
            "airline workload data not found; looked in:\n  "
            f"{places}\nset {DATA_ENV_VAR} to the folder, or fetch it with "
            "treadle.demo.airline.data.download_data(<folder>)"
        )
        self.searched = tuple(searched)


class AirlineDataUnreadable(ValueError):
    """A database file of the workload cannot be used: unreadable, not JSON, or not shaped.

    The message names the file and why: ``cannot read the airline data file
    <folder>/data/flights.json: not JSON (Expecting value: line 1 column 7 (char 6))``.

    Attributes:
        path: the file.
    """

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"cannot read the airline data file {path}: {why}")
        self.path = path


@attrs.frozen(kw_only=True)
class AirlineData:
    """The airline database as loaded from its three JSON files.

    Each mapping goes from a record id (user id, reservation id, flight number) to its JSON
    document, in file order. Treat the documents as read-only: the database layer copies them.
    """

    users: Mapping[str, JSONValue]
    reservations: Mapping[str, JSONValue]
    flights: Mapping[str, JSONValue]

    def tables(self) -> Iterator[tuple[str, Mapping[str, JSONValue]]]:
        """Yield ``(table name, documents)`` for users, reservations and flights."""
        yield "users", self.users
        yield "reservations", self.reservations
        yield "flights", self.flights


@attrs.frozen(kw_only=True)
class GroundTruthAction:
    """One expected tool call of a task: the tool name and its keyword arguments."""

    name: str
    kwargs: Mapping[str, JSONValue] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class AirlineTask:
    """What a conversation is scored against.

    Attributes:
        user_id: the simulated customer's user id.
        instruction: the text the simulated customer was given.
        actions: the ground-truth database-changing (and other) tool calls, in order.
        outputs: strings that must each appear in some assistant reply.
    """

    user_id: str
    instruction: str
    actions: tuple[GroundTruthAction, ...] = ()
    outputs: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Recording:
    """One recorded conversation.

    Attributes:
        task_id: the benchmark task number.
        trial: the trial number of that task (0-based).
        reward: the benchmark's score of the conversation, 0.0 or 1.0.
        task: the task the conversation is scored against.
        messages: the OpenAI chat messages in order, as recorded (plain dicts).
        expected_data_hash: the benchmark's content hash of the ground-truth database, when
            recorded.
    """

    task_id: int
    trial: int
    reward: float
    task: AirlineTask
    messages: tuple[Mapping[str, JSONValue], ...]
    expected_data_hash: str | None = None

    @property
    def name(self) -> str:
        """``task<id>-trial<n>``, a short label for messages and test ids."""
        return f"task{self.task_id}-trial{self.trial}"


# --------------------------------------------------------------------------- locating


def _has_files(folder: Path) -> bool:
    return (folder / "data" / "users.json").is_file()


def _ancestors(start: Path) -> Iterator[Path]:
    start = start.resolve()
    yield start
    yield from start.parents


def find_data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate the workload folder.

    Order: ``explicit`` when given (and then only it); else the ``TREADLE_AIRLINE_DATA``
    environment variable when set (and then only it); else ``shared/workloads/airline`` under
    the current directory or any of its ancestors, then under this package's folder or any
    of its ancestors (so a checkout with ``shared/`` as a sibling finds it).

    Args:
        explicit: a folder given by the caller.

    Returns:
        The folder holding ``data/users.json`` and the other workload files.

    Raises:
        AirlineDataNotFound: when no candidate folder holds the data files.
    """
    if explicit is not None:
        candidates = [Path(explicit)]
    elif os.environ.get(DATA_ENV_VAR):
        candidates = [Path(os.environ[DATA_ENV_VAR])]
    else:
        candidates = [p / SHARED_SUBDIR for p in _ancestors(Path.cwd())]
        candidates += [p / SHARED_SUBDIR for p in _ancestors(Path(__file__).parent)]
    for folder in candidates:
        if _has_files(folder):
            return folder
    raise AirlineDataNotFound(candidates)


# --------------------------------------------------------------------------- loading


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def load_data(data_dir: str | os.PathLike[str]) -> AirlineData:
    """Read the three database files of a workload folder.

    Args:
        data_dir: the workload folder (see `find_data_dir`).

    Returns:
        The users, reservations and flights documents, keyed by id, in file order.

    Raises:
        AirlineDataUnreadable: a file is missing or unreadable, is not JSON, or is not a
            JSON object whose values are objects (the documents keyed by id); the message
            names the file.
    """
    folder = Path(data_dir) / "data"
    tables = {name: _read_table(folder / f"{name}.json") for name in TABLES}
    return AirlineData(
        users=tables["users"], reservations=tables["reservations"], flights=tables["flights"]
    )


def _read_table(path: Path) -> dict[str, JSONValue]:
    try:
        value = _read_json(path)
    except OSError as exc:
        raise AirlineDataUnreadable(path, exc.strerror or str(exc)) from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise AirlineDataUnreadable(path, f"not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise AirlineDataUnreadable(
            path, f"expected a JSON object keyed by id, got {type(value).__name__}"
        )
    for key, document in value.items():
        if not isinstance(document, dict):
            raise AirlineDataUnreadable(
                path, f"expected an object for {key!r}, got {type(document).__name__}"
            )
    return value


def _task_from_json(raw: Mapping[str, Any]) -> AirlineTask:
    return AirlineTask(
        user_id=raw["user_id"],
        instruction=raw.get("instruction", ""),
        actions=tuple(
            GroundTruthAction(name=a["name"], kwargs=a.get("kwargs", {}))
            for a in raw.get("actions", ())
        ),
        outputs=tuple(raw.get("outputs", ())),
    )


def _recording_from_json(raw: Mapping[str, Any]) -> Recording:
    info = raw["info"]
    reward_info = info.get("reward_info") or {}
    return Recording(
        task_id=int(raw["task_id"]),
        trial=int(raw.get("trial", 0)),
        reward=float(raw["reward"]),
        task=_task_from_json(info["task"]),
        messages=tuple(raw["traj"]),
        expected_data_hash=(reward_info.get("info") or {}).get("gt_data_hash"),
    )


def load_recordings(data_dir: str | os.PathLike[str]) -> tuple[Recording, ...]:
    """Read ``trajectories.json`` of a workload folder.

    Args:
        data_dir: the workload folder (see `find_data_dir`).

    Returns:
        The recordings in file order.

    Raises:
        FileNotFoundError: when the file is missing.
        json.JSONDecodeError: when it is not JSON (a ``ValueError``).
        TypeError: when it is JSON but not a list.
        KeyError: when a recording lacks a field.
    """
    raw = _read_json(Path(data_dir) / "trajectories.json")
    if not isinstance(raw, list):
        raise TypeError(f"{data_dir}/trajectories.json: expected a JSON list")
    return tuple(_recording_from_json(r) for r in raw)


# --------------------------------------------------------------------------- alignment


def _aligned_address(address: Mapping[str, JSONValue]) -> dict[str, JSONValue]:
    if "state" not in address or "province" in address:
        return dict(address)
    return {("province" if key == "state" else key): value for key, value in address.items()}


def align_users(users: Mapping[str, JSONValue]) -> dict[str, JSONValue]:
    """Give user addresses the key the recordings were made with.

    The recordings show addresses with a ``province`` key; some versions of the upstream
    ``users.json`` call it ``state``. Each address with ``state`` (and no ``province``) gets
    the key renamed in place, keeping the key order, since the order shows in tool outputs.
    The input is not modified.

    Args:
        users: user id -> user document.

    Returns:
        A new mapping, user id -> user document, with addresses aligned.
    """
    aligned: dict[str, JSONValue] = {}
    for user_id, user in users.items():
        if isinstance(user, dict) and isinstance(user.get("address"), dict):
            user = {**user, "address": _aligned_address(user["address"])}
        aligned[user_id] = user
    return aligned


# --------------------------------------------------------------------------- download


def _raw_url(path: str, ref: str) -> str:
    return f"https://raw.githubusercontent.com/{UPSTREAM_REPOSITORY}/{ref}/{path}"


def _write_atomically(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        Path(tmp).replace(target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def download_data(
    dest: str | os.PathLike[str],
    *,
    ref: str = "main",
    client: httpx.Client | None = None,
    timeout_s: float = 60.0,
) -> Path:
    """Fetch the workload files from the public tau-bench repository.

    Downloads users, reservations and flights, the historical GPT-4o airline trajectories
    (saved as ``trajectories.json``) and the policy (saved as ``policy.md``), then applies
    `align_users`. Every file is fetched before any is written, and each is written
    atomically, so a failed download leaves no partial file.

    Args:
        dest: the folder to create or fill; it becomes a workload folder.
        ref: the upstream branch, tag or commit.
        client: an HTTP client to use (one is opened and closed otherwise).
        timeout_s: per-request timeout in seconds when this function opens the client.

    Returns:
        ``dest`` as a `Path`.

    Raises:
        httpx.HTTPError: when a request fails or answers with an error status.
        json.JSONDecodeError: when the downloaded users file is not JSON.
        TypeError: when it is JSON but not an object.
    """
    folder = Path(dest)
    own = client is None
    http = client if client is not None else httpx.Client(timeout=timeout_s, follow_redirects=True)
    try:
        texts = {}
        for local, upstream in UPSTREAM_FILES.items():
            response = http.get(_raw_url(upstream, ref))
            response.raise_for_status()
            texts[local] = response.text
    finally:
        if own:
            http.close()
    users = json.loads(texts["data/users.json"])
    if not isinstance(users, dict):
        raise TypeError("downloaded users.json is not a JSON object")
    texts["data/users.json"] = json.dumps(align_users(users), indent=4)
    for local, text in texts.items():
        _write_atomically(folder / local, text)
    return folder


def recording_key(recording: Recording) -> str:
    """The key routing requests to a recording: ``<task_id>-<trial>``."""
    return f"{recording.task_id}-{recording.trial}"
