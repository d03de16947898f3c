"""Run ids: what treadle accepts, and fresh ones (docs/concepts.md, "Run ids").

A run id names a run in every store, file name, URL and command line, so its form is fixed:
1 to 200 characters, ASCII letters and digits plus ``. _ - : @ / + =``, starting with a
letter or a digit. Anything else (an empty id, spaces, ``#``, control characters, non-ASCII
text, lone surrogates) is refused with `treadle.InvalidRunId` before anything is written.
"""

from __future__ import annotations

import re
import secrets
from typing import Final

from treadle._exceptions import InvalidRunId

MAX_RUN_ID_CHARS: Final = 200
"""The longest run id accepted."""

_ALLOWED: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]*")


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if treadle accepts it as a run id.

    Raises:
        InvalidRunId: it is not a string, is empty or longer than `MAX_RUN_ID_CHARS`, or
            holds a character outside the allowed set (the message names the first one).
    """
    if not isinstance(run_id, str):
        raise InvalidRunId(run_id, f"a run id is a string, not {type(run_id).__name__}")
    if not run_id:
        raise InvalidRunId(run_id, "a run id cannot be empty")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise InvalidRunId(run_id, f"longer than {MAX_RUN_ID_CHARS} characters")
    if _ALLOWED.fullmatch(run_id) is None:
        raise InvalidRunId(run_id, _why(run_id))
    return run_id


def _why(run_id: str) -> str:
    if not run_id[0].isascii() or not run_id[0].isalnum():
        return f"it must start with an ASCII letter or digit, not {run_id[0]!r}"
    bad = next(c for c in run_id if _ALLOWED.fullmatch("a" + c) is None)
    return (
        f"{bad!r} is not allowed (use ASCII letters, digits and . _ - : @ / + =; "
        'docs/concepts.md, "Run ids")'
    )


def new_run_id() -> str:
    """A fresh random run id: ``run-`` and 16 hex digits."""
    return f"run-{secrets.token_hex(8)}"
