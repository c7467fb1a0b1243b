"""Fault and delay injection, so tests can provoke races and failures on purpose.

Every executor consults these hooks before a task's work runs. With nothing
installed the check is one dictionary lookup.

Example::

    with pipeoff.testing.delay_lane("compute", 0.05):
        ...  # every task on lane "compute" starts 50 ms late
    with pipeoff.testing.fail_task("allreduce:bucket3", RuntimeError("boom")):
        ...  # that task raises instead of running
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeoff._errors import ConfigError

__all__ = ["delay_lane", "delay_task", "disable", "disabled", "fail_task", "installed"]


@dataclass(frozen=True, slots=True)
class _Hook:
    lane: str | None
    pattern: re.Pattern[str] | None
    delay_s: float
    error: BaseException | Callable[[], BaseException] | None


_lock = threading.Lock()
_hooks: list[_Hook] = []


def installed() -> bool:
    """Whether any hook is installed (executors skip the lookup when not)."""
    return bool(_hooks)


def _match(task_name: str, lane: str) -> list[_Hook]:
    return [
        h for h in list(_hooks)
        if (h.lane is None or h.lane == lane)
        and (h.pattern is None or h.pattern.fullmatch(task_name))
    ]


def delay_for(task_name: str, lane: str) -> float:
    """Seconds of delay that the installed hooks ask for this task."""
    return sum(h.delay_s for h in _match(task_name, lane))


def run_hooks(task_name: str, lane: str, *, sleep: bool = True) -> None:
    """Apply the hooks for a task about to run: sleep, then maybe raise."""
    hooks = _match(task_name, lane)
    delay = sum(h.delay_s for h in hooks)
    if delay and sleep:
        time.sleep(delay)
    for h in hooks:
        if h.error is not None:
            raise h.error() if callable(h.error) else h.error


@contextlib.contextmanager
def _install(hook: _Hook) -> Iterator[None]:
    with _lock:
        _hooks.append(hook)
    try:
        yield
    finally:
        with _lock:
            _hooks.remove(hook)


def _seconds(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"seconds must be a number >= 0, got {value!r}")
    return float(value)


def delay_lane(lane: str, seconds: float) -> contextlib.AbstractContextManager[None]:
    """Delay every task on ``lane`` by ``seconds`` before it runs.

    On CUDA lanes the delay is a GPU-side sleep on the lane's stream, so it
    delays the stream, not the host.
    """
    return _install(_Hook(lane=lane, pattern=None, delay_s=_seconds(seconds), error=None))


def delay_task(pattern: str, seconds: float) -> contextlib.AbstractContextManager[None]:
    """Delay the tasks whose names fully match the regular expression ``pattern``."""
    return _install(
        _Hook(lane=None, pattern=re.compile(pattern), delay_s=_seconds(seconds), error=None)
    )


def fail_task(
    pattern: str, error: BaseException | Callable[[], BaseException] | None = None
) -> contextlib.AbstractContextManager[None]:
    """Make the tasks whose names fully match ``pattern`` raise ``error`` instead of running.

    ``error`` may be an exception or a factory of one; the default is a
    ``RuntimeError`` naming the task pattern.
    """
    err = error if error is not None else RuntimeError(
        f"pipeoff.testing: injected failure in {pattern!r}"
    )
    return _install(_Hook(lane=None, pattern=re.compile(pattern), delay_s=0.0, error=err))


# -- mutation switches -----------------------------------------------------------------
_disabled: set[str] = set()
MUTATIONS = frozenset({"read_guard"})
"""The safety mechanisms a test can switch off, to show that a test fails without them:

* ``"read_guard"``: the overlap optimizer's read guard (waits before eager reads
  of parameters that a step in flight is still writing).
"""


def disabled(name: str) -> bool:
    """Whether the mechanism ``name`` is switched off by :func:`disable` (test-only)."""
    return name in _disabled


@contextlib.contextmanager
def disable(*names: str) -> Iterator[None]:
    """Switch off safety mechanisms (see :data:`MUTATIONS`) inside the block.

    For tests only: a test that passes with a mechanism switched off proves
    nothing about that mechanism.

    Raises:
        ConfigError: an unknown mechanism name.
    """
    unknown = sorted(set(names) - MUTATIONS)
    if unknown:
        raise ConfigError(f"unknown mechanism(s) {unknown}; known: {sorted(MUTATIONS)}")
    with _lock:
        added = set(names) - _disabled
        _disabled.update(added)
    try:
        yield
    finally:
        with _lock:
            _disabled.difference_update(added)
