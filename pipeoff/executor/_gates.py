"""The gates of one execution: inputs that arrive from outside it while it runs.

A gate is *pending* until the caller opens it (with a payload, and on CUDA
the event after which the payload is ready), closes it empty, or fails it.
Tasks that wait on a gate start only after that (see
:meth:`pipeoff.TaskGraph.add_gate`). Lanes and the CUDA dispatcher wait here;
the caller of :func:`pipeoff.execute` never does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipeoff import _happens
from pipeoff._errors import ConfigError

PENDING, OPEN, CLOSED, FAILED = 0, 1, 2, 3
_RECHECK_S = 0.1
"""How often (seconds) a parked waiter looks at its gates again without a wake-up."""
STATE_NAMES = {PENDING: "pending", OPEN: "open", CLOSED: "closed", FAILED: "failed"}


class GateStates:
    """State, payload, ready event and timing of each gate of one run."""

    def __init__(self, names: Sequence[str], origin_ns: int,
                 on_fail: Callable[[str, BaseException], None]) -> None:
        self.names = tuple(names)
        self.index = {n: k for k, n in enumerate(self.names)}
        n = len(self.names)
        self.state = [PENDING] * n
        self.payload: list[Any] = [None] * n
        self.event: list[Any] = [None] * n
        """What a reader waits on before touching the payload: a CUDA event, a
        :class:`~pipeoff.Completion`, or ``None`` (ready when opened)."""
        self.opened_ns = [0] * n
        """When the gate left ``pending`` (ns from the run's origin)."""
        self.first_wait_ns: list[int | None] = [None] * n
        """When a lane first waited on the gate (ns from the run's origin)."""
        self._origin_ns = origin_ns
        self._on_fail = on_fail
        # Hazard: a Ctrl-C leaving the lock held (see _LaneWorker.__init__ in threads.py):
        # ``with self._lock``, the C lock; the Condition waited on and notified under it.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._abandoned = False
        self.simulated = False
        """Opened by the simulator at launch: the producer's open/close/fail are no-ops."""
        self.abandoned_ns: int | None = None
        """When the execution failed and gate waits stopped (ns from the origin)."""

    def settle(self, k: int, state: int, payload: Any = None, event: Any = None,
               error: BaseException | None = None) -> None:
        """Open, close or fail gate ``k``.

        Raises:
            ConfigError: the gate was already opened, closed or failed.
        """
        with self._lock:
            if self.simulated:
                return  # the simulator opened it at launch; the producer's call is moot
            if self.state[k] != PENDING:
                raise ConfigError(
                    f"gate {self.names[k]!r} is already {STATE_NAMES[self.state[k]]}; a gate "
                    "is opened, closed or failed once per execution"
                )
            # Published before the state: a lane that sees the gate settled sees
            # what the producer's thread did before (the payload's host writes).
            _happens.release(self, k)
            self.state[k] = state
            self.payload[k] = payload
            self.event[k] = event
            self.opened_ns[k] = time.perf_counter_ns() - self._origin_ns
            self._cond.notify_all()
        if error is not None:
            self._on_fail(self.names[k], error)

    def open(self, k: int, payload: Any, event: Any) -> None:
        self.settle(k, OPEN, payload, event)

    def close(self, k: int) -> None:
        self.settle(k, CLOSED)

    def fail(self, k: int, error: BaseException) -> None:
        self.settle(k, FAILED, error=error)

    def open_all(self, at_ns: int = 0) -> None:
        """Open every pending gate, without payload, at ``at_ns`` (the simulator:
        its inputs are there at launch)."""
        with self._lock:
            for k, st in enumerate(self.state):
                if st == PENDING:
                    self.state[k] = OPEN
                    self.opened_ns[k] = at_ns
            self.simulated = True
            self._cond.notify_all()

    def abandon(self) -> None:
        """The execution failed: waiters stop waiting for gates that may never open."""
        with self._lock:
            if not self._abandoned:
                self._abandoned = True
                self.abandoned_ns = time.perf_counter_ns() - self._origin_ns
            self._cond.notify_all()

    def wait(self, ks: Sequence[int], deadline: float | None = None) -> bool:
        """Block until gates ``ks`` are all settled, or the execution failed.

        Returns ``False`` if ``deadline`` (``time.monotonic()``) passed first.
        """
        state = self.state
        if any(state[k] == PENDING for k in ks) and not self._park(ks, deadline):
            return False
        for k in ks:
            _happens.acquire(self, k)
        return True

    def _park(self, ks: Sequence[int], deadline: float | None) -> bool:
        state = self.state
        now = time.perf_counter_ns() - self._origin_ns
        with self._lock:
            for k in ks:
                if self.first_wait_ns[k] is None:
                    self.first_wait_ns[k] = now
            while not self._abandoned and any(state[k] == PENDING for k in ks):
                timeout = _RECHECK_S
                if deadline is not None:
                    timeout = min(timeout, deadline - time.monotonic())
                    if timeout <= 0:
                        return False
                # Hazard: a Ctrl-C in the main thread inside notify_all() (Python
                # frames, where CPython runs the handler) settles the gate without
                # waking this waiter, which would sleep for good: it looks again
                # every _RECHECK_S.
                self._cond.wait(timeout)
        return True

    def state_name(self, k: int) -> str:
        return STATE_NAMES[self.state[k]]

    def pending(self) -> tuple[str, ...]:
        return tuple(n for n, s in zip(self.names, self.state) if s == PENDING)

    def payloads(self, ks: Sequence[int]) -> dict[str, Any]:
        return {self.names[k]: self.payload[k] for k in ks}
