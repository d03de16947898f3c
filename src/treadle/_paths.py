"""Looking at a store's files by path: a missing file is an answer, any other failure a StoreError.

A file system that refuses a look for a moment (a folder's permissions changed, a network
mount gone) fails the store's operation with `treadle.StoreError`, the `OSError` as its
``__cause__``, the way a write that cannot be made does (docs/crash-safety.md, "What is
guaranteed", item 7), never with the raw `OSError` that readers of the store take for a bug.
"""

from __future__ import annotations

import os
import stat

from treadle._exceptions import StoreError


def stat_or_none(path: str) -> os.stat_result | None:
    """``os.stat(path)``, or ``None`` when nothing is at ``path``.

    Raises:
        StoreError: ``path`` cannot be looked at (no permission on its folder, a file where
            a folder of it should be, an I/O error); the `OSError` is its ``__cause__``.
    """
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _look_failed(path, exc) from exc


def is_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory (``False``: nothing there, or a file on its way).

    `pathlib.Path.is_dir` raises the `PermissionError` of a folder that cannot be searched
    (Python 3.11); this says so as a `StoreError` instead.

    Raises:
        StoreError: ``path`` cannot be looked at (no permission on its folder, an I/O
            error); the `OSError` is its ``__cause__``.
    """
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise _look_failed(path, exc) from exc


def _look_failed(path: str | os.PathLike[str], exc: OSError) -> StoreError:
    return StoreError(f"cannot look at {os.fspath(path)}: {exc.strerror or exc}")
