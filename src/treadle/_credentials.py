"""What of a model request is a credential, and hiding it in what is shown.

A request carries credentials in its headers (the API key, an ``Authorization`` header a
gateway wants, Azure's ``api-key``) and in its URL (the password of the user information,
``?key=`` and the signatures of signed URLs). None of them may reach a record, an event or a
log line (docs/concepts.md, "Data that stays in"; docs/models.md, "Credentials"): the model
clients hide each one `credentials_sent` names in their error messages, and every URL a
message or a log line quotes goes through `redact_url_secrets`.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Mapping

from treadle._exceptions import UsageError


def check_base_url(base_url: str) -> str:
    """``base_url`` as given, refused unless it is an http(s) URL a request can go to.

    Raises:
        UsageError: it does not start with ``http://`` or ``https://``; it cannot be parsed
            (an unclosed ``[`` of an IPv6 address, a port that is no number or out of range);
            it holds whitespace or a control character where no request can carry one (a
            control character anywhere, whitespace in the host); or it has no host. The
            message quotes the URL with its credentials hidden (`redact_url_secrets`;
            docs/models.md, "Credentials", "Connections and headers").
    """
    if not base_url.startswith(("http://", "https://")):
        raise UsageError(
            f"base_url must start with http:// or https://, got {shown_url(base_url)!r}"
        )
    try:
        _check_url_parts(base_url)
    except ValueError as exc:
        reason = _without(str(exc), _url_credentials(base_url))
        raise UsageError(f"base_url {shown_url(base_url)!r} is not a valid URL: {reason}") from exc
    return base_url


def _check_url_parts(url: str) -> None:
    """Raise `ValueError` saying what of ``url`` no HTTP request can go to."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise ValueError("it holds a control character (a line break?)")
    parts = urllib.parse.urlsplit(url)
    parts.port  # noqa: B018 (raises ValueError for a port that is no number or out of range)
    host = parts.hostname or ""
    if not host:
        raise ValueError("it names no host")
    if any(ch.isspace() for ch in host):
        raise ValueError("its host holds whitespace")


def _without(text: str, secrets: set[str]) -> str:
    """``text`` with each of ``secrets`` (longest first) replaced by ``***``."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


def shown_url(url: str) -> str:
    """``url`` as a message may quote it: `redact_url_secrets`, even without a scheme.

    A URL whose scheme is missing (``bob:pw@host/v1``) has the password of its user
    information hidden too.
    """
    if "://" in url:
        return redact_url_secrets(url)
    return redact_url_secrets("x://" + url)[len("x://") :]


CREDENTIAL_HEADER = re.compile(
    r"auth|key|token|secret|signature|password|credential|cookie|session", re.IGNORECASE
)
"""What marks a request header as carrying a credential: a name holding one of these words
(``Authorization``, Azure's ``api-key``, ``x-goog-api-key``, ``Ocp-Apim-Subscription-Key``,
``X-Amz-Security-Token``, ``Cookie`` ...)."""
MIN_CREDENTIAL_CHARS = 4
"""A header value (or URL password) shorter than this is not redacted on its own: it would
hide every such run of characters in a message (an API key is redacted whatever its length)."""


def credentials_sent(
    api_key: str | None, headers: Mapping[str, str], base_url: str
) -> tuple[str, ...]:
    """Every credential a client sends with each request, longest first, for `StreamReader._redact`.

    They are the API key; the value of each header whose name `CREDENTIAL_HEADER` marks (and
    for ``Scheme token`` values such as ``Bearer ...`` or ``Basic ...``, the token alone,
    with the ``user:password`` a Basic token encodes and its password); the password of
    ``base_url``'s user information (as written and decoded), with the Basic token httpx
    makes of it; and the values of ``base_url``'s credential query parameters
    (`SECRET_QUERY_NAMES`). Values shorter than `MIN_CREDENTIAL_CHARS` are left out, the
    API key excepted (docs/models.md, "Credentials").
    """
    found = {api_key} if api_key else set()
    for name, value in headers.items():
        if CREDENTIAL_HEADER.search(name):
            found.update(_header_credentials(value))
    found.update(_url_credentials(base_url))
    found = {v for v in found if v == api_key or len(v) >= MIN_CREDENTIAL_CHARS}
    return tuple(sorted(found, key=len, reverse=True))


def _header_credentials(value: str) -> set[str]:
    """A credential header's value, its token after a scheme, and what a Basic token encodes."""
    found = {value.strip()}
    scheme, _, token = value.strip().partition(" ")
    if not token.strip():
        return found
    found.add(token.strip())
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
        except ValueError:
            return found
        found |= {decoded, decoded.partition(":")[2]}
    return found


def _url_credentials(base_url: str) -> set[str]:
    """What of ``base_url`` is a credential, in every form it may be quoted.

    The password of its user information (written, decoded, and inside the Basic token
    httpx makes of it), and the values of its credential query parameters.
    """
    found: set[str] = set()
    userinfo = _USERINFO.match(base_url)
    if userinfo is not None:
        user, password = userinfo[2], userinfo[3]
        plain = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
        token = base64.b64encode(plain.encode("utf-8")).decode("ascii")
        found |= {password, urllib.parse.unquote(password), token}
    for match in _QUERY_PARAM.finditer(base_url):
        if urllib.parse.unquote(match[2]).lower() in SECRET_QUERY_NAMES:
            found |= {match[3], urllib.parse.unquote(match[3])}
    return found


SECRET_QUERY_NAMES: frozenset[str] = frozenset(
    {
        "key",
        "api-key",
        "api_key",
        "apikey",
        "x-api-key",
        "token",
        "access_token",
        "auth",
        "password",
        "secret",
        "sig",
        "signature",
        "code",
        "subscription-key",
        "x-goog-api-key",
        "x-goog-signature",
        "x-goog-credential",
        "x-amz-signature",
        "x-amz-security-token",
        "x-amz-credential",
    }
)
"""Query parameters whose value is a credential (lower case, compared case-insensitively);
redacted as ``***``: API keys (Google's ``key``, Azure's ``api-key``, API Management's
``subscription-key``), tokens, and the signature, credential and session token of AWS and
Google Cloud signed URLs."""

_QUERY_PARAM = re.compile(r"([?&;])([^=&;#\s\"']+)=([^&;#\s\"']*)")


_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)([^/@\s:\"']*):([^/@\s\"']*)@")


def redact_url_secrets(text: str) -> str:
    """``text`` with URL credentials replaced by ``***``.

    That is, the password of a URL's user information (``https://user:***@host/``) and the
    value of every credential query parameter: one whose name, case-insensitively, is in
    `SECRET_QUERY_NAMES` (``?key=...`` as Google's APIs use, ``api-key=`` as Azure's may,
    signatures of signed URLs).
    """

    def hide(match: re.Match[str]) -> str:
        name = urllib.parse.unquote(match[2]).lower()
        return f"{match[1]}{match[2]}=***" if name in SECRET_QUERY_NAMES else match[0]

    return _QUERY_PARAM.sub(hide, _USERINFO.sub(r"\1\2:***@", text))
