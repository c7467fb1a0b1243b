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
    memory. Yields the :class:`~pipeoff.testing._simcuda.SimulatedCuda` device.
    Problems found off the raising thread (a storage freed while a stream may
    still use it) are raised when the block exits.
    """
    return _simulated_cuda()


@contextlib.contextmanager
def _simulated_cuda() -> Iterator[Any]:
    from pipeoff import _accel
    from pipeoff.testing._simcuda import SimulatedCuda

    sim = SimulatedCuda()
    try:
        with _accel.use(sim), sim.host_thread():
            try:
                yield sim
            finally:
                sim.synchronize()
    finally:
        sim.close()
    if sim.undelivered:
        raise sim.undelivered[0]


def __getattr__(name: str) -> Any:
    if name == "DataRaceError":
        from pipeoff.testing._simcuda import DataRaceError

        return DataRaceError
    raise AttributeError(f"module 'pipeoff.testing' has no attribute {name!r}")
