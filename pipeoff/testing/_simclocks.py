"""The simulated device's host clocks: one vector clock per host thread, and the
happens-before edges between host threads that ``pipeoff._happens`` reports."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from pipeoff.testing._simstreams import HostActor, merge

if TYPE_CHECKING:
    from pipeoff.testing._simstreams import SimStream

__all__ = ["Clocks"]


class Clocks:
    """The host threads' clocks, and what each thread is (a stream's worker or a host
    thread), in :attr:`tls`.

    Args:
        lock: the device's lock (every clock is read and merged under it).
    """

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.tls = threading.local()
        """Per thread: ``worker`` (the stream it drains), ``host`` (its actor),
        ``stream`` (its current stream), ``checking``, ``where``."""
        self._hosts: list[HostActor] = []
        self._sync: weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, int]]] = (
            weakref.WeakKeyDictionary())
        """Per object and key, the clock that :meth:`release` published there."""

    def worker(self) -> SimStream | None:
        """The stream whose worker this thread is, or ``None`` on a host thread."""
        return getattr(self.tls, "worker", None)

    def host_actor(self) -> HostActor:
        """This host thread as an actor (made at its first access)."""
        host: HostActor | None = getattr(self.tls, "host", None)
        if host is None:
            host = self.tls.host = HostActor(threading.current_thread().name)
            with self.lock:
                self._hosts.append(host)
        return host

    @property
    def host_vc(self) -> dict[Any, int]:
        """The calling host thread's clock."""
        return self.host_actor().vc

    def hosts_vc(self) -> dict[Any, int]:
        """What some host thread knows (the host as one: for frees, which the
        garbage collector runs on any thread)."""
        out: dict[Any, int] = {}
        with self.lock:
            for h in self._hosts:
                merge(out, h.vc)
        return out

    def enqueuer_clock(self) -> dict[Any, int]:
        """The clock that work enqueued from this thread inherits."""
        worker = self.worker()
        with self.lock:
            return dict(worker.vc if worker is not None else self.host_vc)

    def host_acquire(self, vc: dict[Any, int]) -> None:
        """This host thread learns ``vc`` (it waited for what ``vc`` stands for)."""
        if self.worker() is not None:
            return  # a stream worker blocking on an event learns nothing for the host
        with self.lock:
            merge(self.host_vc, vc)

    def tick(self, actor: Any) -> int:
        """A new epoch of ``actor``'s own clock: its next access's."""
        with self.lock:
            vc: dict[Any, int] = actor.vc
            epoch = vc.get(actor, 0) + 1
            vc[actor] = epoch
        return epoch

    def release(self, obj: Any, key: Any = None) -> None:
        """Publish this host thread's clock at ``(obj, key)``."""
        if self.worker() is not None:
            return
        vc = self.host_vc
        with self.lock:
            merge(self._sync.setdefault(obj, {}).setdefault(key, {}), vc)

    def acquire(self, obj: Any, key: Any = None) -> None:
        """Learn what was published at ``(obj, key)``."""
        if self.worker() is not None:
            return
        vc = self.host_vc
        with self.lock:
            published = self._sync.get(obj, {}).get(key)
            if published:
                merge(vc, published)
