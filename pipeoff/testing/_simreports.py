"""What the simulated device found: the access records a race is checked against,
and the races and stream errors, each reported once."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from pipeoff.testing._simclocks import Clocks
from pipeoff.testing._simstreams import DataRaceError

__all__ = ["Access", "AccessLog", "Reports", "is_seen", "rw"]

_MAX_RECORDS = 8192  # access records kept per storage (the latest per range, actor, kind)


@dataclass(slots=True)
class Access:
    """One recorded access of a byte range of a storage."""

    lo: int
    hi: int
    actor: Any
    epoch: int
    write: bool
    op: str
    where: str


def rw(acc: Access) -> str:
    return "write" if acc.write else "read"


def is_seen(err: BaseException) -> bool:
    """Whether ``err`` reached the test (or is an echo of one that did)."""
    return getattr(err, "pipeoff_seen", False)


class AccessLog:
    """Per storage base, the latest access of each (byte range, actor, write): an actor's
    earlier access to the same range is ordered before its later one, so it needs no
    record of its own. Read and written under the device's lock."""

    def __init__(self) -> None:
        self.by_base: dict[int, dict[tuple[int, int, Any, bool], Access]] = {}

    def record(self, base: int, lo: int, hi: int, actor: Any, epoch: int, write: bool,
               op: str, where: str) -> None:
        recs = self.by_base.setdefault(base, {})
        key = (lo, hi, actor, write)
        recs.pop(key, None)  # re-inserted last: the dict stays in access order
        recs[key] = Access(lo, hi, actor, epoch, write, op, where)
        if len(recs) > _MAX_RECORDS:
            del recs[next(iter(recs))]

    def conflict(self, base: int, lo: int, hi: int, write: bool, actor: Any,
                 vc: dict[Any, int]) -> Access | None:
        """An earlier access by another actor that overlaps ``[lo, hi)``, one of the two a
        write, and that clock ``vc`` does not order before this one."""
        for acc in list(self.by_base.get(base, {}).values()):
            if acc.actor == actor or acc.hi <= lo or hi <= acc.lo:
                continue
            if not (write or acc.write):
                continue
            if vc.get(acc.actor, 0) >= acc.epoch:
                continue
            return acc
        return None

    def pop(self, base: int) -> list[Access]:
        """Forget a storage (freed, or memory reused): its records."""
        return list(self.by_base.pop(base, {}).values())


class Reports:
    """The races and stream errors found, each reported once.

    Args:
        lock: the device's lock.
        clocks: the device's clocks (whether this thread is a stream's worker).
    """

    def __init__(self, lock: threading.RLock, clocks: Clocks) -> None:
        self.lock = lock
        self.clocks = clocks
        self.errors: list[BaseException] = []
        """Every data race found, raised where it happened."""
        self.undelivered: list[BaseException] = []
        """Problems found off any caller's path (a storage freed too early, an error
        inside a stream's worker): raised when the device exits."""
        self.owner = threading.current_thread()
        """The thread that entered the device (a test's)."""
        self.muted = False
        """A race (or a stream's error) reached :attr:`owner`, which has not synchronized
        the device since: later ones are its echoes, not reported again."""

    def race(self, err: DataRaceError) -> None:
        """A race, found where it happened (the caller raises it)."""
        self.errors.append(err)
        self.found(err)

    def deliver(self) -> None:
        """Raise on the host, at a synchronization, the first error that stream work
        raised (as CUDA reports an asynchronous kernel error at the next one)."""
        if self.undelivered and self.clocks.worker() is None:
            with self.lock:
                err = next((e for e in self.undelivered if not is_seen(e)), None)
                self.errors.extend(self.undelivered)
                self.undelivered.clear()
            if err is not None:
                self.seen(err)
                raise err

    def found(self, err: BaseException) -> None:
        """Note an error as it is found: while an earlier one has been reported and the
        test has not synchronized the device since, it is that failure's echo (a
        sticky CUDA error: one report)."""
        if self.muted or threading.current_thread() is self.owner:
            self.seen(err)  # an echo, or it propagates to the caller from here

    def later(self, err: BaseException) -> None:
        """Report ``err`` (found off any caller's path: a free) at the next
        synchronization, unless it is the echo of a failure already reported."""
        if self.muted:
            err.pipeoff_seen = True  # type: ignore[attr-defined]
        self.undelivered.append(err)

    def seen(self, err: BaseException) -> None:
        """``err`` reached the test: what was found before it is of the same episode
        (found on other threads before this one reached the caller), reported with it."""
        with self.lock:
            for e in (err, *self.errors, *self.undelivered):
                e.pipeoff_seen = True  # type: ignore[attr-defined]
            self.muted = True

    def synchronized(self) -> None:
        """The test synchronized the device after a reported race: what came of it has
        run; a race found from now on is news."""
        with self.lock:
            for e in self.undelivered:
                self.seen(e)
            self.errors.extend(self.undelivered)
            self.undelivered.clear()
            self.muted = False

    def unreported(self) -> BaseException | None:
        """The first race or stream error found that never reached the thread that
        entered the device (a race after a test's last wait, one in an execution
        nobody waited for): raised when the device exits."""
        return next((e for e in (*self.undelivered, *self.errors) if not is_seen(e)), None)
