"""``treadle ui``: the run console in the browser (docs/ui.md).

This module imports nothing of the web stack: the command loads `treadle._ui` when it runs,
and says which extra to install when its packages are missing.
"""

from __future__ import annotations

import ipaddress
import secrets

import click

from treadle._cli_common import bare_host, printable, run_async, store_option, url_host
from treadle._exceptions import UsageError, raised

TOKEN_ENV = "TREADLE_UI_TOKEN"
"""The environment variable ``--token`` is read from when not given."""
TOKEN_CHARACTERS = frozenset(map(chr, range(0x21, 0x7F)))
"""What a console's token may hold: printable ASCII other than space (``!`` to ``~``)."""


def check_token(token: str) -> str:
    """``token``, once it is a token the console can carry in a header and a cookie.

    A request header and a cookie hold ASCII (a server reads their bytes as Latin-1, a
    browser sends a header's ``€`` as UTF-8) and lose spaces at their ends, so a token of
    other characters could never be presented (docs/ui.md, "Starting it").

    Raises:
        UsageError: ``token`` is empty or holds a character outside `TOKEN_CHARACTERS`.
    """
    odd = sorted({c for c in token if c not in TOKEN_CHARACTERS})
    if not token or odd:
        found = ", ".join(f"'{printable(c)}'" for c in odd)
        raise UsageError(
            "a console's token is one or more printable ASCII characters other than space "
            "(! to ~)" + (f"; it holds {found}" if found else "")
        )
    return token


def _token_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--token`` checked (`check_token`) before anything starts."""
    if value is None:
        return None
    try:
        return check_token(value)
    except UsageError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """Refuse TLS files the console could not serve with, before it starts.

    ``certfile`` is a PEM certificate chain, ``keyfile`` its private key (PEM, unencrypted;
    ``None`` when ``certfile`` holds it too). Checked here, a mismatched or unreadable pair is
    told as such, not as an address that cannot be bound; a key with a passphrase is refused,
    never asked for on the terminal (docs/ui.md, "Many tabs").

    Raises:
        click.UsageError: ``keyfile`` without ``certfile``, or files that do not load as a
            certificate and its key.
    """
    if certfile is None:
        if keyfile is not None:
            raise click.UsageError("--keyfile needs --certfile, the certificate of that key")
        return
    import ssl  # only when serving TLS: `treadle --help` stays light

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except (ssl.SSLError, OSError) as exc:
        files = f"--certfile {certfile}" + (f" and --keyfile {keyfile}" if keyfile else "")
        raise click.UsageError(
            f"cannot serve TLS with {files}: {exc} (a PEM certificate and its unencrypted "
            "private key are needed)"
        ) from None


def _no_passphrase() -> bytes:
    """The passphrase given to an encrypted key: none, so it fails to load (`check_tls`)."""
    return b""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare_host(host)).is_loopback
    except ValueError:
        return False


@click.command("ui")
@store_option
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to bind.")
@click.option(
    "--port",
    default=8765,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="The port (0: any free one; the URL printed names it).",
)
@click.option(
    "--token",
    default=None,
    envvar=TOKEN_ENV,
    show_envvar=True,
    callback=_token_option,
    help=(
        "A secret the console asks for (needed to bind an address other than loopback): "
        "printable ASCII characters other than space."
    ),
)
@click.option(
    "--certfile",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help=(
        "A PEM certificate (chain) to serve HTTPS with: browsers then speak HTTP/2, which "
        "carries every tab's page and live stream over one connection."
    ),
)
@click.option(
    "--keyfile",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="The certificate's private key (PEM, unencrypted), unless --certfile holds it.",
)
def ui_command(
    store_path: str,
    host: str,
    port: int,
    token: str | None,
    certfile: str | None,
    keyfile: str | None,
) -> None:
    """Serve a run console for a store in the browser: runs, timelines, approvals, cancel.

    It binds 127.0.0.1 by default. Another address is refused unless --token is given; then
    every page needs the token (open /?token=TOKEN once). State-changing requests always need
    the console's token and a same-origin request (docs/ui.md, "Safety"). With --certfile it
    serves HTTPS and HTTP/2, so a browser's tabs share one connection (docs/ui.md, "Many
    tabs").
    """
    loopback = is_loopback(host)
    if not loopback and not token:
        raise click.UsageError(
            f"refusing to serve {host}, which is not a loopback address, without --token "
            f"(or {TOKEN_ENV}): anyone who reaches it could approve or cancel runs"
        )
    check_tls(certfile, keyfile)
    try:
        from treadle._ui._app import Settings
        from treadle._ui._serve import serve
    except ImportError as exc:
        if exc.name is None or exc.name.partition(".")[0] == "treadle":
            raise  # treadle's own import failed: not a missing package, and pip cannot fix it
        raise click.ClickException(
            f"treadle ui needs the ui extra ({exc.name} is missing): "
            "python3 -m pip install 'treadle[ui]'"
        ) from exc
    # a Host header brackets an IPv6 address
    hosts = ("127.0.0.1", "localhost", "[::1]", url_host(host)) if loopback else ("*",)
    settings = Settings(
        token=token or secrets.token_urlsafe(24),
        token_for_reads=token is not None,
        allowed_hosts=tuple(dict.fromkeys(hosts)),
    )

    def said(url: str) -> None:
        click.echo(f"treadle ui: serving {url}", err=False)

    try:
        run_async(
            lambda: serve(
                store_path,
                host=host,
                port=port,
                settings=settings,
                said=said,
                certfile=certfile,
                keyfile=keyfile,
            )
        )
    except BaseExceptionGroup as group:
        unbound = raised(group, OSError)
        if unbound is None:
            raise
        raise click.ClickException(f"cannot serve {host}:{port}: {unbound}") from group
    except OSError as exc:
        raise click.ClickException(f"cannot serve {host}:{port}: {exc}") from exc
