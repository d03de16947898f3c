"""Store addresses: telling a PostgreSQL DSN from a path, and hiding its password.

A password never appears in a message, a log line or a command's output (docs/fleet.md,
"Stores"): every place that shows a store's address shows `redact_dsn` of it.
"""

from __future__ import annotations

import re
from typing import Final

_URL: Final = re.compile(r"^(postgres(?:ql)?://)([^@/]*)@", re.IGNORECASE)
_KEYWORD: Final = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def is_dsn(store: str) -> bool:
    """Whether ``store`` names a PostgreSQL database (a URL or ``key=value`` keywords)."""
    lowered = store.lower()
    return lowered.startswith(("postgresql://", "postgres://")) or (
        "=" in store and ("dbname=" in lowered or "host=" in lowered or "user=" in lowered)
    )


def redact_dsn(store: str) -> str:
    """``store`` with any password replaced by ``***`` (a path comes back unchanged)."""

    def user_only(match: re.Match[str]) -> str:
        user = match.group(2).split(":", 1)[0]
        return f"{match.group(1)}{user}:***@" if ":" in match.group(2) else match.group(0)

    if store.lower().startswith(("postgresql://", "postgres://")):
        text = _URL.sub(user_only, store)
        return re.sub(r"([?&]password=)[^&]*", r"\1***", text, flags=re.IGNORECASE)
    return _KEYWORD.sub(lambda m: f"{m.group(1)}***", store)
