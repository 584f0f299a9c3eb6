"""The policy versions of one set of served weights, kept here and nowhere else.

V (``served``) is the version the servers hold: a group started now samples it. T (``trainer``)
is the trainer's, one ahead of V while a push is in flight. Weight sync, adapter pushes and a
restore move them; everyone else watches them and keeps no copy. Runs on the base weights share
one record; a serve_adapter run, or one with its own partition of the pool, has its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class VersionChange:
    """What moved, told to every watcher."""

    committed: bool
    """A push committed (a resend of the current version's weights included)."""
    served_moved: bool
    """V moved forward."""
    previous_trainer: int
    """T before the change, so a watcher can close the version that ended."""


class PolicyVersion:
    def __init__(self, served: int = 0) -> None:
        self._served = served
        self._trainer = served
        self._watchers: list[Callable[[VersionChange], None]] = []

    @property
    def served(self) -> int:
        return self._served

    @property
    def trainer(self) -> int:
        return self._trainer

    def watch(self, watcher: Callable[[VersionChange], None]) -> Callable[[], None]:
        """Call ``watcher`` (synchronously) on every change; returns the call that stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    def begin(self, resend: bool = False) -> None:
        """A push began: the trainer's weights are one version ahead (a resend: the same)."""
        self.set_trainer(self._served if resend else self._served + 1)

    def abort(self) -> None:
        """The push in flight was aborted: the trainer is back at the servers' version."""
        self.set_trainer(self._served)

    def set_trainer(self, version: int) -> None:
        """T moves forward to ``version``, or back to it but never below V."""
        previous = self._trainer
        self._trainer = version if version > previous else max(version, self._served)
        self._tell(VersionChange(committed=False, served_moved=False, previous_trainer=previous))

    def commit(self, version: int) -> None:
        """The servers hold ``version`` (the current one again: a resend, which moves nothing)."""
        previous = self._trainer
        moved = version > self._served
        if moved:
            self._served = version
            self._trainer = max(version, previous)
        self._tell(VersionChange(committed=True, served_moved=moved, previous_trainer=previous))

    def _tell(self, change: VersionChange) -> None:
        for watcher in list(self._watchers):
            watcher(change)
