"""Store addresses: telling a PostgreSQL DSN from a path, and hiding its password.

A password never appears in a message, a log line or a command's output (docs/fleet.md,
"Stores"): every place that shows a store's address shows `redact_dsn` of it.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Final

_SCHEMES: Final = ("postgresql://", "postgres://")
_KEYWORD: Final = re.compile(
    r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+(?:\s+[^\s=]+(?=\s|$))*)", re.IGNORECASE
)
"""A ``password=`` keyword and its value: quoted, or up to the next ``key=`` (a password
written with a raw space, which libpq cannot read, is hidden whole too)."""
_LIBPQ_KEYWORDS: Final = frozenset(
    {
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "passfile",
        "service",
        "sslmode",
        "options",
        "application_name",
        "connect_timeout",
        "target_session_attrs",
    }
)
"""Keywords of libpq's ``key=value`` connection strings that mark one (any of them will do:
the others can come from ``PG*`` environment variables)."""
_FIRST_KEY: Final = re.compile(r"^\s*([a-z_]+)\s*=")
_QUERY_PASSWORD: Final = re.compile(r"([?&])([^=&]*)=([^&]*)")


def is_dsn(store: str) -> bool:
    """Whether ``store`` names a PostgreSQL database (a URL or ``key=value`` keywords)."""
    if store.lower().startswith(_SCHEMES):
        return True
    first = _FIRST_KEY.match(store.lower())
    return first is not None and first.group(1) in _LIBPQ_KEYWORDS


def redact_dsn(store: str) -> str:
    """``store`` with any password replaced by ``***`` (a path comes back unchanged).

    In a URL, the user information runs to the last ``@`` (a password holding a raw ``/``
    or ``@`` is hidden whole), and a ``password`` query parameter is hidden however its name
    is percent-encoded.
    """
    parts = _url_parts(store)
    if parts is None:
        return _KEYWORD.sub(lambda m: f"{m.group(1)}***", store)
    scheme, user, password, address = parts
    rest = address if user is None else f"{user}{'' if password is None else ':***'}@{address}"

    def hide(match: re.Match[str]) -> str:
        named = urllib.parse.unquote(match.group(2)).strip().lower() == "password"
        return f"{match.group(1)}{match.group(2)}=***" if named else match.group(0)

    return f"{scheme}://{_QUERY_PASSWORD.sub(hide, rest)}"


def scrub_password(text: str, store: str) -> str:
    """``text`` (a driver's message about ``store``) with each piece of its password hidden.

    libpq quotes what it misread of a URL whose password holds a raw ``@`` or ``/`` (as a
    host name, say), or of ``key=value`` keywords whose password holds a raw space (as a
    keyword): every piece of the password between those characters, 3 characters long or
    more, is replaced by ``***``.
    """
    parts = _url_parts(store)
    password = parts[2] if parts is not None else None
    if parts is None and (keyword := _KEYWORD.search(store)) is not None:
        password = keyword.group(2).strip("'")
    for piece in sorted(re.split(r"[@/\s]", password or ""), key=len, reverse=True):
        if len(piece) >= 3:
            text = text.replace(piece, "***")
    return text


def quotes_password(text: str, store: str) -> bool:
    """Whether ``text``, libpq's complaint about the URL ``store``, quotes its password.

    libpq quotes the token it could not read: a password with a raw ``%`` or space is
    quoted whole or in part (``invalid percent-encoded token: "p%zz"``). A complaint about
    another part of the URL (a misspelt query parameter, an unclosed ``[`` of an IPv6 host)
    quotes something else, or the whole URL.
    """
    parts = _url_parts(store)
    password = parts[2] if parts is not None else None
    if not password:
        return False
    return any(token and token in password for token in re.findall(r'"([^"]*)"', text))


def _url_parts(store: str) -> tuple[str, str | None, str | None, str] | None:
    """``(scheme, user, password, the rest)`` of a DSN URL; ``None`` for anything else.

    Its user information runs to the last ``@``; a path or libpq keywords give ``None``.
    """
    if not store.lower().startswith(_SCHEMES):
        return None
    scheme, rest = store.split("://", 1)
    userinfo, at, address = rest.rpartition("@")
    if not at:
        return scheme, None, None, rest
    user, colon, password = userinfo.partition(":")
    return scheme, user, password if colon else None, address
