"""Serving the console: Hypercorn's trio worker over the Starlette app (docs/ui.md)."""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import NoReturn

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette

from treadle._cli_common import bare_host, open_store
from treadle._ui._app import Settings, create_app

STOP_GRACE_S = 1.0
"""Seconds a stopping console gives its connections (Hypercorn's ``graceful_timeout``): live
streams end, and answers still being sent after it are cancelled (docs/ui.md, "Starting it")."""
HARD_STOP_S = 3.0
"""Seconds after SIGINT or SIGTERM after which the console exits though its serving has not
ended: Hypercorn shields each write to a socket from cancellation and waits for it as long as
the client does not read, so one client that stopped reading would hold the console forever
(docs/ui.md, "Starting it")."""


async def serve(
    store_path: str,
    *,
    host: str,
    port: int,
    settings: Settings,
    said: Callable[[str], None],
    certfile: str | None = None,
    keyfile: str | None = None,
) -> None:
    """Serve the console for the store at ``store_path`` until SIGINT or SIGTERM.

    ``said`` is called once with the URL served (the bound port, for ``port`` 0).

    Plain HTTP/1.1 unless ``certfile`` is given (a PEM certificate chain, with ``keyfile``
    its key unless it holds the key too: `treadle._cli_ui.check_tls` checked them): then
    HTTPS, HTTP/2 to a client that offers it (a browser does), which carries every tab's
    page, stream and action over one connection (docs/ui.md, "Many tabs").

    On the first signal the console stops taking connections and gives the open ones
    `STOP_GRACE_S`, then returns. A second signal, or `HARD_STOP_S` after the first without
    the serving ending (a client that does not read its answer holds a write), ends the
    process at once with status 128 plus the signal's number, the store left as a crash
    leaves it (docs/ui.md, "Starting it").

    Raises:
        click.ClickException: nothing exists at ``store_path``.
        UsageError: the store keeps no run index.
        OSError: the address cannot be bound.
    """
    config = Config()
    config.bind = [f"fd://{listening_socket(host, port)}"]
    config.accesslog = None
    config.graceful_timeout = STOP_GRACE_S
    if certfile is not None:  # Hypercorn offers h2 over TLS; it serves TLS given both files
        config.certfile, config.keyfile = certfile, keyfile or certfile
    async with open_store(store_path) as store:
        app = create_app(store, settings)
        await _serve_app(app, config, said)


async def _serve_app(app: Starlette, config: Config, said: Callable[[str], None]) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, stop)
        serving = functools.partial(_serve_until, app, config, stop, nursery.cancel_scope)
        binds = await nursery.start(serving)
        said(binds[0])


async def _serve_until(
    app: Starlette,
    config: Config,
    stop: trio.Event,
    served: trio.CancelScope,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    """Serve ``app`` until ``stop`` is set and Hypercorn has closed its connections.

    Then ``served`` is cancelled: the signal task waits no more for a second signal.
    """
    await hypercorn_serve(
        app,  # type: ignore[arg-type]
        config,
        shutdown_trigger=stop.wait,
        task_status=task_status,
    )
    served.cancel()


def listening_socket(host: str, port: int) -> int:
    """A TCP socket bound to ``host:port``, as a file descriptor Hypercorn takes over.

    Binding here (not in Hypercorn) closes the socket when the bind fails.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    host = bare_host(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock.detach()


async def _stop_on_signals(stop: trio.Event) -> None:
    """Set ``stop`` on the first SIGINT or SIGTERM; exit at once on a second one.

    Cancelled when the serving ends (`_serve_until`); while it has not ended
    `HARD_STOP_S` after the first signal, the process exits then.
    """
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        first = await anext(signals)
        stop.set()
        with trio.move_on_after(HARD_STOP_S):
            await anext(signals)
        _exit_now(first)


def _exit_now(signum: int) -> NoReturn:
    """End the process now, with status 128 plus ``signum``, saying why on standard error.

    Nothing is unwound: a task Hypercorn shields in a write to a client that does not read
    cannot be; the store is left as a crash leaves it (docs/crash-safety.md, "What is
    guaranteed").
    """
    name = signal.Signals(signum).name
    print(
        f"treadle ui: stopped on {name} without waiting for its open connections to close",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)
