"""Store addresses: telling a PostgreSQL DSN from a path, and hiding its passwords.

A password never appears in a message, a log line or a command's output (docs/fleet.md,
"Stores"): every place that shows a store's address shows `redact_dsn` of it. The passwords
are libpq's `SECRET_KEYWORDS`: the role's, and the one that unlocks the client's SSL key.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Final

_SCHEMES: Final = ("postgresql://", "postgres://")
SECRET_KEYWORDS: Final = frozenset({"password", "sslpassword"})
"""libpq keywords (and URL query parameters) whose value is a password, in lower case."""
_KEYWORD: Final = re.compile(
    r"(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+(?:\s+[^\s=]+(?=\s|$))*)",
    re.IGNORECASE,
)
"""A ``password=`` or ``sslpassword=`` keyword and its value: quoted, or up to the next
``key=`` (a password written with a raw space, which libpq cannot read, is hidden whole too)."""
_LIBPQ_KEYWORDS: Final = frozenset(
    {
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "sslpassword",
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
    """``store`` with every password replaced by ``***`` (a path comes back unchanged).

    In a URL, the user information runs to the last ``@`` (a password holding a raw ``/``
    or ``@`` is hidden whole), and a ``password`` or ``sslpassword`` query parameter is
    hidden however its name is percent-encoded; in ``key=value`` keywords, the values of
    both keywords are hidden (`SECRET_KEYWORDS`).
    """
    parts = _url_parts(store)
    if parts is None:
        return _KEYWORD.sub(lambda m: f"{m.group(1)}***", store)
    scheme, user, password, address = parts
    rest = address if user is None else f"{user}{'' if password is None else ':***'}@{address}"

    def hide(match: re.Match[str]) -> str:
        named = _is_secret(match.group(2))
        return f"{match.group(1)}{match.group(2)}=***" if named else match.group(0)

    return f"{scheme}://{_QUERY_PASSWORD.sub(hide, rest)}"


def scrub_password(text: str, store: str) -> str:
    """``text`` (a driver's message about ``store``) with each piece of its passwords hidden.

    libpq quotes what it misread of a URL whose password holds a raw ``@`` or ``/`` (as a
    host name, say), or of ``key=value`` keywords whose password holds a raw space (as a
    keyword): every piece of each password (`SECRET_KEYWORDS`) between those characters, 3
    characters long or more, is replaced by ``***``. Where ``text`` quotes ``store`` whole,
    it shows `redact_dsn` of it instead, unscrubbed: a user, host or database name that
    shares a piece with the password (``postgres:postgres``) stays readable there, as every
    message shows it (docs/fleet.md, "Stores").
    """
    pieces = [p for password in _passwords(store) for p in re.split(r"[@/\s]", password)]
    hidden = sorted((piece for piece in pieces if len(piece) >= 3), key=len, reverse=True)
    scrubbed = []
    for part in text.split(store):
        for piece in hidden:
            part = part.replace(piece, "***")
        scrubbed.append(part)
    return redact_dsn(store).join(scrubbed)


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


def _passwords(store: str) -> list[str]:
    """The passwords ``store`` holds: its user information's and every secret keyword's."""
    parts = _url_parts(store)
    if parts is None:
        return [keyword.group(2).strip("'") for keyword in _KEYWORD.finditer(store)]
    found = [parts[2]] if parts[2] is not None else []
    for match in _QUERY_PASSWORD.finditer(parts[3]):
        if _is_secret(match.group(2)):
            found += (match.group(3), urllib.parse.unquote(match.group(3)))
    return found


def _is_secret(name: str) -> bool:
    """Whether a URL query parameter's (percent-encoded) name is one of `SECRET_KEYWORDS`."""
    return urllib.parse.unquote(name).strip().lower() in SECRET_KEYWORDS


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
