"""Fault and delay injection and the mutation switches: what :mod:`pipeoff.testing` offers.

It lives in the core because every executor consults it before a task's work
runs (an execution takes the hooks installed when it is launched; with
nothing installed the check is one tuple test), and the features' safety
mechanisms (a wait, an event, a dependency) each ask :func:`disabled` whether
a test switched them off. Tests use it through :mod:`pipeoff.testing`, which
re-exports the public names (as ``trio.testing`` re-exports ``MockClock``
from ``trio._core``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeoff._errors import ConfigError
from pipeoff._validate import check_int

__all__ = ["MUTATIONS", "any_disabled", "delay_for", "delay_lane", "delay_task", "disable",
           "disabled", "fail_task", "fail_work", "failing_work", "hold_task", "installed",
           "run_hooks", "snapshot"]


@dataclass(frozen=True, slots=True)
class _Hook:
    lane: str | None
    pattern: re.Pattern[str] | None
    delay_s: float
    error: BaseException | Callable[[], BaseException] | None
    inside: bool = False
    """The error is raised inside the work (:func:`fail_work`), not before it."""
    after_ops: int | None = None
    hold: threading.Event | None = None
    """The task waits for this event before it runs (:func:`hold_task`)."""
    reached: threading.Event | None = None
    """Set when a task reaches the hold (:func:`hold_task`)."""


_lock = threading.Lock()
_hooks: list[_Hook] = []


def installed() -> bool:
    """Whether any hook is installed (executors skip the lookup when not)."""
    return bool(_hooks)


def snapshot() -> tuple[_Hook, ...]:
    """The hooks installed now. An execution takes them at launch: a delay or a
    failure applies to the executions launched inside its ``with`` block."""
    return tuple(_hooks)


def _match(task_name: str, lane: str, hooks: tuple[_Hook, ...] | None = None) -> list[_Hook]:
    return [
        h for h in (tuple(_hooks) if hooks is None else hooks)
        if (h.lane is None or h.lane == lane)
        and (h.pattern is None or h.pattern.fullmatch(task_name))
    ]


def delay_for(task_name: str, lane: str, hooks: tuple[_Hook, ...] | None = None) -> float:
    """Seconds of delay that the hooks (the installed ones by default) ask for this task."""
    return sum(h.delay_s for h in _match(task_name, lane, hooks))


def run_hooks(task_name: str, lane: str, *, sleep: bool = True,
              hooks: tuple[_Hook, ...] | None = None) -> None:
    """Apply the hooks for a task about to run: sleep, then maybe raise."""
    matched = _match(task_name, lane, hooks)
    for h in matched:
        if h.hold is not None:
            if h.reached is not None:
                h.reached.set()
            h.hold.wait()
    delay = sum(h.delay_s for h in matched)
    if delay and sleep:
        time.sleep(delay)
    for h in matched:
        if h.error is not None and not h.inside:
            raise h.error() if callable(h.error) else h.error


@contextlib.contextmanager
def failing_work(task_name: str, lane: str, hooks: tuple[_Hook, ...]) -> Iterator[None]:
    """Around a task's work: raise the :func:`fail_work` error inside it, if one matches."""
    hook = next((h for h in _match(task_name, lane, hooks) if h.inside), None)
    if hook is None:
        yield
        return
    err = hook.error() if callable(hook.error) else hook.error
    assert err is not None
    if hook.after_ops is None:
        yield  # the work ran to the end (its side effects happened); then it fails
        raise err
    mode = _FailAfter(hook.after_ops, err)
    with mode:
        yield
    if not mode.fired:
        # Fewer torch calls than after_ops: fail once the work is done, rather
        # than inject nothing.
        raise err


class _FailAfter:
    """A ``TorchFunctionMode`` that raises at the torch call after the first ``n``."""

    def __init__(self, n: int, err: BaseException) -> None:
        from torch.overrides import TorchFunctionMode

        outer = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                if outer.left == 0 and not outer.fired:
                    outer.fired = True  # once: cleanup after it runs normally
                    raise outer.err
                outer.left -= 1
                return func(*args, **(kwargs or {}))

        self.left = n
        self.err = err
        self.fired = False
        self.mode = _Mode()

    def __enter__(self) -> None:
        self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


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
    """Make the tasks whose names fully match ``pattern`` raise ``error`` instead of running
    (a ``must_run`` task's work runs anyway, and sees the failure in ``ctx.failed``).

    ``error`` may be an exception or a factory of one; the default is a
    ``RuntimeError`` naming the task pattern.
    """
    err = error if error is not None else RuntimeError(
        f"pipeoff.testing: injected failure in {pattern!r}"
    )
    return _install(_Hook(lane=None, pattern=re.compile(pattern), delay_s=0.0, error=err))


@contextlib.contextmanager
def hold_task(pattern: str, *,
              reached: threading.Event | None = None) -> Iterator[threading.Event]:
    """Hold the tasks whose names fully match ``pattern`` until the event this yields
    is set (at the latest when the block exits): tests order events this way
    instead of racing a sleep against a delay. ``reached``, if given, is set when a
    task reaches the hold (it has started: an execution waits for it).

    On host lanes the task's thread waits; on a CUDA lane its dispatch thread
    does (later tasks of that lane are not issued). An inline execution (a
    synchronous schedule without gates) is refused: it runs inside
    ``execute()``, which could never return to release it. The simulator runs no
    work and ignores it.

    Example::

        with pipeoff.testing.hold_task("opt3") as release:
            opt.step()
            assert not opt.last_execution.done()  # opt3 cannot have run
            release.set()
    """
    event = threading.Event()
    hook = _Hook(lane=None, pattern=re.compile(pattern), delay_s=0.0, error=None, hold=event,
                 reached=reached)
    with _install(hook):
        try:
            yield event
        finally:
            event.set()


def fail_work(
    pattern: str, error: BaseException | Callable[[], BaseException] | None = None, *,
    after_ops: int | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Make the work of the tasks whose names fully match ``pattern`` raise ``error``
    *after it started*, unlike :func:`fail_task`, which raises before it runs.

    Args:
        pattern: a regular expression over task names.
        error: an exception or a factory of one; default a ``RuntimeError``.
        after_ops: raise at the torch function call that follows the first
            ``after_ops`` ones (``0``: at the first), with their effects done,
            once (later calls, cleanup, run normally); if the work makes no more
            calls than that, raise when it returns. ``None`` (default): raise
            once the work has returned, with all its effects done (a collective
            issued, a buffer written). The simulator runs no work and ignores it.

    Raises:
        ConfigError: ``after_ops`` is not an int >= 0 or ``None``.
    """
    check_int("after_ops", after_ops, minimum=0, optional=True)
    err = error if error is not None else RuntimeError(
        f"pipeoff.testing: injected failure inside the work of {pattern!r}"
    )
    return _install(_Hook(lane=None, pattern=re.compile(pattern), delay_s=0.0, error=err,
                          inside=True, after_ops=after_ops))


# -- mutation switches -----------------------------------------------------------------
_disabled: set[str] = set()
MUTATIONS = frozenset({
    "read_guard", "base_wait", "cross_lane_wait", "block_fence", "host_sync",
    "execution_sync", "record_stream", "hook_stream_wait", "fsdp_gather_wait", "gate_wait",
    "host_task_event", "accumulate_dep", "micro_step_order", "ddp_reduced",
    "adopt_waits_readers", "diloco_formed_wait", "grad_read_wait", "grad_edit_wait",
    "diloco_forward_wait", "diloco_tail_wait", "diloco_formation_guard",
    "device_part_wait", "host_part_join", "held_copy_dep", "held_release",
    "full_device_part_wait", "full_host_part_join", "outer_state_waits", "inner_post_hook_wait",
    "diloco_abandon_forms",
})
"""The safety mechanisms a test can switch off, to show that a test fails without them:

* ``"read_guard"``: the overlap optimizer's read guard (waits before eager reads
  of parameters that a step in flight is still writing).
* ``"base_wait"``: a CUDA lane's first ``wait_event`` on the caller's stream
  (work the caller enqueued before the launch).
* ``"cross_lane_wait"``: a CUDA task's ``wait_event`` on its dependencies on
  other lanes.
* ``"block_fence"``: the wait (a stream's ``wait_event``, or a host
  ``synchronize``) on a reused staging block's previous last user.
* ``"host_sync"``: a CUDA host task's ``synchronize`` on the device tasks it
  depends on.
* ``"execution_sync"``: ``Execution.wait()``'s ``synchronize`` of device work
  before it returns.
* ``"record_stream"``: the optimizer's ``record_stream`` on a gradient its lane
  reads.
* ``"hook_stream_wait"``: a forward hook's ``wait_event`` on CUDA streams.
* ``"fsdp_gather_wait"``: the ``wait_event`` of an FSDP2 module's forward hook on
  FSDP's all-gather streams (the current stream still waits).
* ``"gate_wait"``: a CUDA lane's wait on the event of a gate's payload.
* ``"host_task_event"``: a CUDA lane's wait on the event a HOST task recorded on
  its thread's stream after its work (device work it enqueued).
* ``"accumulate_dep"``: a full-offload step chunk's dependency on the last
  accumulation of its parameters' gradients (set when the graph is built).
* ``"micro_step_order"``: a full-offload micro-step's wait (the ``prev`` gate)
  for the previous micro-step's accumulations and step.
* ``"held_copy_dep"``: full offload's dependency of a held gradient's ``acc`` task (after
  which the norm task folds it, or a step chunk folds it inside its pass) on its copy
  into the held buffer (set when the graph is built).
* ``"held_release"``: full offload's wait (the ``held`` gate) of a final backward's
  copies into the held buffer for the previous step that read it.
* ``"ddp_reduced"``: full offload under DDP taking ``param.grad`` only after
  DDP's reducer wrote the reduced gradient (a callback queued behind DDP's).
* ``"adopt_waits_readers"``: full offload's wait for the transfers reading the
  masters before it adopts weights written from outside as masters.
* ``"diloco_formed_wait"``: DiLoCo's wait, before the inner step after a sync's
  preparation, for the sync to have formed its pseudo-gradients (they read the
  parameters that step writes; ``fragment_sync_delay`` > 0).
* ``"diloco_abandon_forms"``: DiLoCo's wait, when its context exits with a sync in
  flight, for the sync to form every pseudo-gradient before it is abandoned (the
  peers average them, as torchft's formed at ``prepare_sync``).
* ``"diloco_formation_guard"``: the write guard that makes an eager write of those
  parameters on the training thread (a clamp, ``load_state_dict``) wait for them.
* ``"grad_read_wait"``: a full-offload gradient placeholder's wait, when the loop
  reads it (a clip call's norm), for the host folds of the gradients.
* ``"grad_edit_wait"``: full offload's wait, before a gradient the loop put in
  ``.grad`` by hand (or dropped) replaces a host sum, for the folds still writing it.
* ``"diloco_forward_wait"``: the next forward's waits (module hooks, read guard) for
  the writes of a DiLoCo sync that run on after its decision.
* ``"diloco_tail_wait"``: DiLoCo's wait for all of a sync's outer step and writes
  before the next inner step, the next sync, its exit and the readers of its figures.
* ``"inner_post_hook_wait"``: ``OffloadOptimizer``'s wait, before the step post hooks
  registered on the wrapped optimizer run, for the step's chunks.
* ``"outer_state_waits"``: the wait of an access to the user's DiLoCo outer
  optimizer's ``state`` (a read, an in-place edit right after ``step()``) for the
  outer step of a sync's tail still writing it.
* ``"device_part_wait"``: an ``OffloadOptimizer(offload_fraction < 1)`` step's join
  for its device part: ``wait_for_step()`` (so a chunked ``step()``, ``state_dict()``)
  synchronizing the event recorded after the device part's kernels on the caller's
  stream, before readers off that stream go on.
* ``"host_part_join"``: the same step's wait, when its device part raised, for its
  host part's chunks before the failure is reported (retry, or torn).
* ``"full_device_part_wait"``: a ``FullOffloadOptimizer(offload_fraction < 1)`` step's
  join for its device part: ``wait_for_step()`` (so a synchronous ``step()``,
  ``state_dict()``) synchronizing the event recorded after the device part's kernels
  on the caller's stream, before readers off that stream go on.
* ``"full_host_part_join"``: the same step's wait, when its device part raised, for its
  host part's chunks before the failure is reported (dirty, or torn).
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


def any_disabled() -> bool:
    """Whether any mechanism is switched off (a mutation test is running)."""
    return bool(_disabled)
