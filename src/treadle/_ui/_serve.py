"""Serving the console: Hypercorn's trio worker over the Starlette app (docs/ui.md)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette

from treadle._cli_common import bare_host, open_store
from treadle._ui._app import Settings, create_app


async def serve(
    store_path: str,
    *,
    host: str,
    port: int,
    settings: Settings,
    said: Callable[[str], None],
) -> None:
    """Serve the console for the store at ``store_path`` until SIGINT or SIGTERM.

    ``said`` is called once with the URL served (the bound port, for ``port`` 0).

    Raises:
        click.ClickException: nothing exists at ``store_path``.
        UsageError: the store keeps no run index.
        OSError: the address cannot be bound.
    """
    config = Config()
    config.bind = [f"fd://{listening_socket(host, port)}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    async with open_store(store_path) as store:
        app = create_app(store, settings)
        await _serve_app(app, config, said)


async def _serve_app(app: Starlette, config: Config, said: Callable[[str], None]) -> None:
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        nursery.start_soon(_stop_on_signal, stop)
        binds = await nursery.start(
            lambda task_status: hypercorn_serve(
                app,  # type: ignore[arg-type]
                config,
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
        )
        said(binds[0])
        await stop.wait()
        # hypercorn returns once its connections are closed (live streams within
        # graceful_timeout); the signal task has returned by then.


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


async def _stop_on_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return
