"""The signals that stop ``treadle worker``, held from the moment the command is chosen.

SIGTERM, SIGINT and SIGHUP drain a worker (docs/fleet.md, "Shutting a worker down"): SIGHUP
too, the signal of a closed terminal or a dropped ssh session, which would otherwise kill the
worker without a drain (a worker has no configuration to reload). One that arrives while the
worker is still starting makes it claim nothing and exit 0. Loading the worker's module (the
stores, the runtime, trio, the database drivers) takes most of its start-up, so the group
(`treadle.cli`) holds these signals before it loads that module, and the command takes what
came meanwhile (docs/decisions/0143-a-worker-holds-its-stop-signals-before-it-loads.md).

This module imports only the standard library, as the group loads it for ``--help`` too
(docs/design.md, "Start-up").
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Final

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that drain a worker."""

_HELD: Final[list[int]] = []
"""The stop signals this process received while they were held, in order of arrival."""


def _hold(number: int, frame: FrameType | None) -> None:
    """The handler of a held stop signal: it is recorded, and the process goes on."""
    _HELD.append(number)


def hold_stop_signals() -> list[int]:
    """Record the stop signals instead of letting them end the process; the list they go to.

    Each call installs the same handler for every signal of `STOP_SIGNALS` and returns the same
    list, so that the command sees the signals that came while its module loaded. Call it in
    the main thread (`signal.signal` refuses any other).

    Returns:
        The numbers of the stop signals received since they were first held, in order of
        arrival (empty while none came).
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, _hold)
    return _HELD
