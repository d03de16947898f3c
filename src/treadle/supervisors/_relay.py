"""One task for many runs: a job hosted in the nursery of one member run at a time.

The runs of one store driven in one trio run share work that needs one task, not one per run:
renewing their leases (`treadle.supervisors._leasing.LeaseKeeper`) and reading their control
streams (`treadle.supervisors._control.ControlIndex`). A `Relay` runs such a job in the nursery
of one of its members; when that member leaves, the job is cancelled there and started again
in another member's nursery. The job keeps its timing in its own state, so it goes on where it
was. No task outlives the runs it serves, and a hundred runs cost one task instead of a hundred
(docs/decisions/0095-one-task-for-a-stores-runs.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import attrs
import trio


@attrs.define(eq=False)
class Relay:
    """Runs ``job`` in one member's nursery at a time, while it has members.

    ``job`` runs until cancelled. When its host's nursery is cancelled from outside, the job
    goes on at once in another member's nursery, not again in that one. When it raises into
    its host's nursery, it is not restarted there either; the next member to join or leave
    starts it in another one, so a job that keeps failing fails each member at most once.

    Attributes:
        job: the shared work, ``async def job() -> None``.
    """

    job: Callable[[], Awaitable[None]]
    _members: dict[int, trio.Nursery] = attrs.Factory(dict)
    _unfit: set[int] = attrs.Factory(set)
    _host: int | None = None
    _scope: trio.CancelScope | None = None
    _keys: itertools.count[int] = attrs.Factory(itertools.count)

    @property
    def hosted(self) -> bool:
        """Whether the job runs (or is starting) in a member's nursery."""
        return self._host is not None

    def join(self, nursery: trio.Nursery) -> int:
        """Make a member that can host the job in ``nursery``; returns its key for `leave`.

        Leave before ``nursery`` closes (in the block that opened it): leaving cancels the job
        if this member hosts it, and the nursery's exit then waits for the job's task.
        """
        key = next(self._keys)
        self._members[key] = nursery
        if self._host is None:
            self._start()
        return key

    def leave(self, key: int) -> None:
        """The member ``key`` (from `join`) leaves; a second call does nothing."""
        if self._members.pop(key, None) is None:
            return
        self._unfit.discard(key)
        if self._host == key:
            assert self._scope is not None
            self._scope.cancel()  # its task hands the job over as it ends
        elif self._host is None:
            self._start()

    def _start(self) -> None:
        """Start the job in the first member's nursery fit to host it, if there is one."""
        key = next((k for k in self._members if k not in self._unfit), None)
        if key is None:
            return
        scope = trio.CancelScope()
        self._host, self._scope = key, scope
        self._members[key].start_soon(self._hosted, key, scope, name=self.job)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def _hosted(self, key: int, scope: trio.CancelScope) -> None:
        failed = True
        try:
            with scope:
                await self.job()
            failed = False  # its host left (or it returned)
        except trio.Cancelled:
            failed = False  # its host is cancelled from outside: on to another at once
            raise
        finally:
            if self._host == key:
                self._host = self._scope = None
                if key in self._members:
                    self._unfit.add(key)  # ended while its host stays: not there again
                if not failed:
                    self._start()
