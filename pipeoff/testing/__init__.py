"""Fault and delay injection, so tests can provoke races and failures on purpose.

Every executor consults these hooks before a task's work runs; an execution
takes the hooks installed when it is launched. With nothing installed the
check is one tuple test. The mechanism lives in the core (``pipeoff._faults``);
this module is its public face, with the simulated CUDA device.

Example::

    with pipeoff.testing.delay_lane("compute", 0.05):
        ...  # every task on lane "compute" starts 50 ms late
    with pipeoff.testing.fail_task("allreduce:bucket3", RuntimeError("boom")):
        ...  # that task raises instead of running
    with pipeoff.testing.fail_work("allreduce:bucket3", after_ops=1):
        ...  # that task's work raises after one torch operation
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pipeoff._faults import MUTATIONS as MUTATIONS
from pipeoff._faults import (
    delay_lane,
    delay_task,
    disable,
    disabled,
    fail_task,
    fail_work,
    hold_task,
    installed,
)

__all__ = ["DataRaceError", "delay_lane", "delay_task", "disable", "disabled",
           "fail_task", "fail_work", "hold_task", "installed", "simulated_cuda"]


# -- the simulated CUDA device -----------------------------------------------------------
def simulated_cuda() -> contextlib.AbstractContextManager[Any]:
    """Run pipeoff's CUDA paths on a simulated CUDA device, on the CPU, inside the block.

    The device is ``torch.device("cpu")``: graphs, optimizers and LocalSGD on it
    take their CUDA paths (the CUDA backend, streams, events, pinned host memory).
    Streams run asynchronously; every read and write is checked against CUDA's
    ordering rules, and a race raises :class:`DataRaceError` naming the tensor and
    both accesses (see :mod:`pipeoff.testing._simcuda` and ``docs/concepts.md``).
    Host memory is what ``device.host_empty(...)`` returns; other tensors are device
    memory. pipeoff's accelerator is the real :class:`pipeoff._accel.Cuda` class over
    the device's fake of the torch and CUDA runtime calls it makes
    (:class:`~pipeoff.testing._simruntime.SimRuntime`): a task's work runs when it is
    issued, on the issuing thread with its lane's stream current, as on a GPU.
    Yields the :class:`~pipeoff.testing._simcuda.SimulatedCuda` device.
    Problems found off the raising thread (a storage freed while a stream may
    still use it) are raised when the block exits.
    """
    return _simulated_cuda()


@contextlib.contextmanager
def _simulated_cuda() -> Iterator[Any]:
    from pipeoff import _accel, _happens
    from pipeoff.testing._simcuda import SimulatedCuda
    from pipeoff.testing._simruntime import SimRuntime

    sim = SimulatedCuda()
    # The real Cuda class, over a fake of the torch.cuda entry points it calls: a
    # mistake in it (a launch without its stream current, a record_stream that
    # does nothing) is a race here as on a GPU.
    sim.runtime = SimRuntime(sim)
    sim.accelerator = _accel.Cuda(sim.runtime)
    prior = _happens.install(sim)  # the order pipeoff's threads hand tensors over in
    try:
        with _accel.use(sim.accelerator), sim.host_thread():
            try:
                yield sim
            finally:
                sim.synchronize()
    finally:
        _happens.install(prior)
        sim.close()
    late = sim.reports.unreported()
    if late is not None:
        raise late


def __getattr__(name: str) -> Any:
    if name == "DataRaceError":
        from pipeoff.testing._simcuda import DataRaceError

        return DataRaceError
    raise AttributeError(f"module 'pipeoff.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
    # Tab completion (and dir()) lists the names imported on first use too.
    return sorted(set(globals()) | set(__all__))
