"""The inline backend: every task runs on the caller's thread, in issue order."""

from __future__ import annotations

import time

from pipeoff import _accel
from pipeoff._errors import ConfigError
from pipeoff.executor._backend import HostBackend
from pipeoff.executor._run import Run


class InlineBackend(HostBackend):
    """Runs the plan to completion inside :func:`pipeoff.execute`.

    It is the natural backend of :meth:`Schedule.synchronous`. On a CUDA graph
    each task is followed by a synchronize of the current stream, so each task
    is waited on before the next starts, as the synchronous schedule promises.
    """

    name = "inline"

    def launch(self, run: Run) -> None:
        if any(h.hold is not None for h in run.hooks):
            raise ConfigError(
                "pipeoff.testing.hold_task() cannot hold a task of an inline execution (a "
                "synchronous schedule): it runs inside execute(), which would never return "
                "to release it. Use Schedule.pipelined(), or backend='threads'")
        accel = _accel.current()
        device = run.graph.device
        stream = accel.current_stream(accel.normalize(device)) if accel.is_device(device) else None
        now = time.perf_counter_ns() - run.origin_ns
        for i in range(run.n):
            run.enqueue_ns[i] = now
        for i in range(run.n):
            run.run_task(i, run.plan.lanes[i])
            if stream is not None:
                # The synchronous schedule's contract: task i has finished on
                # the device before task i+1 starts (RFC 0003's sequential path),
                # and, after a failure, before its staging goes back to the pool
                # (hazard: another execution reusing a block a copy still reads).
                stream.synchronize()
