"""The trace of a run: its bookkeeping (status, times, gates, buffers) as trace records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeoff.graph import no_gc
from pipeoff.trace._records import GATE, BufferRecord, TaskRecord
from pipeoff.trace._trace import Trace

if TYPE_CHECKING:
    from pipeoff.executor._run import Run

__all__ = ["trace_of"]


def trace_of(run: Run, *, prefix: str = "", shift_ns: int = 0, execution: int = 0) -> Trace:
    """The trace of one finished run's bookkeeping (``Execution.trace`` calls this).

    ``prefix`` and ``shift_ns`` rename and re-time it, for a recorder that puts
    several executions on one timeline; ``execution`` numbers it there.
    """
    sched = run.plan.schedule
    lanes = run.plan.lanes
    status = run.status_names()
    rank = run.rank
    with no_gc():  # 100k small records, no cycles: a collection midway costs more
        records = [
            TaskRecord(
                name=prefix + t.name, kind=t.kind.value, lane=lanes[i],
                start_ns=run.start_ns[i] + shift_ns, end_ns=run.end_ns[i] + shift_ns,
                enqueue_ns=run.enqueue_ns[i] + shift_ns, nbytes=run.moved.get(i, t.nbytes),
                deps=tuple(prefix + d for d in t.deps) if prefix else t.deps,
                buffers=tuple(prefix + b for b in t.buffers) if prefix else t.buffers,
                status=status[i],  # type: ignore[arg-type]
                rank=rank,
                gates=tuple(prefix + g for g in t.gates) if prefix else t.gates,
                execution=execution,
            )
            for i, t in enumerate(run.tasks)
        ]
    gates = run.gates
    for k, name in enumerate(gates.names):
        # From a lane's first wait on the gate (or its opening, if none had
        # to wait) to its opening; a gate never settled is cancelled.
        state = gates.state_name(k)
        first = gates.first_wait_ns[k]
        end = gates.opened_ns[k] if state != "pending" else (first or 0)
        abandoned = gates.abandoned_ns
        late = False
        if abandoned is not None and (state == "pending" or end > abandoned):
            # Settled after the execution failed (or never): waits ended then.
            late = True
            end = min(end, abandoned) if state != "pending" else abandoned
        start = min(first, end) if first is not None else end
        payload = gates.payload[k]
        records.append(TaskRecord(
            name=prefix + name, kind=GATE, lane="gates", start_ns=start + shift_ns,
            end_ns=end + shift_ns, enqueue_ns=shift_ns, rank=rank,
            status=("failed" if state == "failed" else
                    "cancelled" if late or state == "pending" else "ok"),
            nbytes=(payload.numel() * payload.element_size()
                    if hasattr(payload, "element_size") else 0),
            execution=execution,
        ))
    buffers = tuple(
        BufferRecord(name=prefix + b.name, nbytes=b.nbytes, where=b.where, rank=rank)
        for b in run.graph.buffers.values()
    )
    meta = {
        "backend": run.backend,
        "schedule": sched.kind,
        "rank": rank,
        "origin_unix_ns": run.origin_unix_ns,
        "max_in_flight": sched.max_in_flight,
    }
    return Trace(tasks=tuple(records), buffers=buffers,
                 device_budget_bytes=sched.device_budget_bytes,
                 host_budget_bytes=sched.host_budget_bytes, metadata=meta)
