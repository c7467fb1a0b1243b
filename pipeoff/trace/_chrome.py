"""Chrome trace JSON (Perfetto, chrome://tracing, HTA) for pipeoff traces."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeoff._errors import TraceFormatError
from pipeoff.trace._records import TRAIN, BufferRecord, TaskRecord, staging_timeline

if TYPE_CHECKING:
    from pipeoff.trace._trace import Trace

FORMAT_VERSION = 1

# Categories and name prefixes follow the profiler's conventions, so HTA and
# Perfetto queries written for torch.profiler traces find pipeoff's tasks.
_CATEGORY = {
    "d2h": "gpu_memcpy",
    "h2d": "gpu_memcpy",
    "allreduce": "kernel",  # NCCL kernels are "kernel" in torch.profiler traces
    "optimizer_chunk": "kernel",
    "host": "cpu_op",
    # The training loop's spans: what torch.profiler calls record_function ranges.
    "train": "user_annotation",
}
_PREFIX = {
    "d2h": "Memcpy DtoH ",
    "h2d": "Memcpy HtoD ",
    # HTA recognizes collectives by NCCL's kernel names (^nccl.*Kernel).
    "allreduce": "ncclDevKernel_AllReduce ",
    "optimizer_chunk": "",
    "host": "",
}
_DEVICE_KINDS = frozenset({"d2h", "h2d", "allreduce", "optimizer_chunk"})
"""Kinds that run on a lane stream (a CUDA stream; a lane thread standing in for
one on CPU, and in the simulator): HTA finds device work by its ``stream``."""
_FIRST_STREAM = 7  # torch's traces number CUDA streams from 7 (the default stream)


def _us(ns: int) -> float:
    return ns / 1e3


# HTA does not count a kernel as computation if its name matches this (its
# NCCL_COMPUTE_KERNEL_RE); an optimizer chunk's name must not.
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


def _display_name(t: TaskRecord) -> str:
    """The event's name: the profiler's prefix for the kind, then the task's name, which
    for compute is altered where HTA would read it as a copy or a collective
    (the task's own name stays in ``args["pipeoff.task"]``)."""
    name = t.name
    if t.kind in ("optimizer_chunk",) and _NOT_COMPUTE.match(name):
        name = "chunk " + name.replace("Sync", "sync").replace("Memcpy", "memcpy").replace(
            "Memset", "memset")
    return _PREFIX.get(t.kind, "") + name


def to_chrome(trace: Trace) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for t in trace.tasks:
        if (t.rank, t.lane) not in tids:
            tid = len(tids) + 1
            tids[(t.rank, t.lane)] = tid
            events.append(
                {"ph": "M", "name": "thread_name", "pid": t.rank, "tid": tid,
                 "args": {"name": f"pipeoff {t.lane}"}}
            )
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": t.rank, "tid": tid,
                 # The training loop's row on top, as in `pipeoff trace plot`.
                 "args": {"sort_index": 0 if t.lane == "train" else tid}}
            )
    # Perfetto shows the process names: a prediction says so there too.
    predicted = trace.predicted_by
    suffix = f" (PREDICTED by {predicted}, not measured)" if predicted is not None else ""
    for rank in sorted({r for r, _ in tids}):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank,
             "args": {"name": f"rank {rank}{suffix}"}}
        )
    streams: dict[tuple[int, str], int] = {}
    for t in trace.tasks:
        if t.kind in _DEVICE_KINDS and (t.rank, t.lane) not in streams:
            streams[(t.rank, t.lane)] = _FIRST_STREAM + sum(r == t.rank for r, _ in streams)
    by_name: dict[tuple[int, str], TaskRecord] = {}
    for k, t in enumerate(trace.tasks):
        by_name[(t.rank, t.name)] = t
        device = {"stream": streams[(t.rank, t.lane)], "correlation": k + 1,
                  "device": t.rank} if t.kind in _DEVICE_KINDS else {}
        events.append(
            {
                "ph": "X",
                "name": _display_name(t),
                "cat": _CATEGORY.get(t.kind, "cpu_op"),
                "pid": t.rank,
                "tid": tids[(t.rank, t.lane)],
                # Whole microseconds, the start rounded down and the end up: HTA
                # rounds ts and dur apart, and a sub-microsecond task would end
                # before it starts. The exact times are in args["t_ns"].
                "ts": t.start_ns // 1000,
                "dur": -(-t.end_ns // 1000) - t.start_ns // 1000,
                "args": {
                    "pipeoff.task": t.name,
                    "kind": t.kind,
                    "lane": t.lane,
                    "bytes": t.nbytes,
                    "status": t.status,
                    "deps": list(t.deps),
                    "buffers": list(t.buffers),
                    "t_ns": [t.enqueue_ns, t.start_ns, t.end_ns],
                    **({"gates": list(t.gates)} if t.gates else {}),
                    **({"execution": t.execution} if t.execution else {}),
                    **device,
                },
            }
        )
    flow_id = 0
    for t in trace.tasks:
        for d in (*t.deps, *t.gates):
            src = by_name.get((t.rank, d))
            if src is None or src.lane == t.lane or "cancelled" in (src.status, t.status):
                continue
            flow_id += 1
            common = {"name": "dependency", "cat": "pipeoff.dep", "id": flow_id, "pid": t.rank}
            events.append({**common, "ph": "s", "tid": tids[(t.rank, src.lane)],
                           "ts": src.start_ns // 1000})
            # Same whole-microsecond start as the consumer's slice, so the flow binds to it.
            events.append({**common, "ph": "f", "bp": "e", "tid": tids[(t.rank, t.lane)],
                           "ts": t.start_ns // 1000})
    ranks = sorted({b.rank for b in trace.buffers})
    for rank in ranks:
        for time_ns, dev, host in staging_timeline(
                (t for t in trace.tasks if t.rank == rank),
                (b for b in trace.buffers if b.rank == rank)):
            events.append(
                {"ph": "C", "name": "staging bytes", "pid": rank, "ts": _us(time_ns),
                 "args": {"device": dev, "host": host}}
            )
    metadata = dict(trace.metadata)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        # HTA reads rank (and world_size) here; torchft replicas are each rank 0
        # of their own group, so the replica id goes alongside when recorded.
        "distributedInfo": {
            "rank": int(metadata.get("rank", 0)),
            **{k: metadata[k] for k in ("world_size", "replica_id") if k in metadata},
        },
        "pipeoff": {
            "version": FORMAT_VERSION,
            "device_budget_bytes": trace.device_budget_bytes,
            "host_budget_bytes": trace.host_budget_bytes,
            "buffers": [
                {"name": b.name, "nbytes": b.nbytes, "where": b.where, "rank": b.rank}
                for b in trace.buffers
            ],
            "metadata": metadata,
        },
    }


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    if path.is_dir():
        raise TraceFormatError(f"{str(path)!r} is a directory, not a trace file")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        # (RecursionError: nested too deep to be a trace; a tester's traceback)
        raise TraceFormatError(f"{str(path)!r} is not valid JSON: {err}") from None


def from_chrome(doc: Any, *, source: str = "<trace>") -> dict[str, Any]:
    """The fields of the :class:`Trace` in a parsed Chrome trace document.

    Raises:
        TraceFormatError: ``doc`` is not a trace pipeoff wrote (or a torch.profiler
            trace with pipeoff ranges), or one of its fields is malformed.
    """
    try:
        return _from_chrome(doc, source)
    except TraceFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError,
            ArithmeticError) as err:
        raise TraceFormatError(
            f"{source!r} is not a well-formed pipeoff trace: {type(err).__name__}: {err}"
        ) from None


def check_readable(trace: Trace, source: str) -> None:
    """Read every field the trace tools use, turning a malformed one into TraceFormatError."""
    try:
        trace.summary()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError,
            ArithmeticError) as err:
        raise TraceFormatError(
            f"{source!r} is not a well-formed pipeoff trace: {type(err).__name__}: {err}"
        ) from None


def _from_chrome(doc: Any, source: str) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceFormatError(
            f"{source!r} is not a Chrome trace: expected an object with a 'traceEvents' list"
        )
    section = doc.get("pipeoff")
    if not isinstance(section, dict):
        profiled = _from_profiler(doc)
        if profiled is not None:
            return profiled
        raise TraceFormatError(
            f"{source!r} is a Chrome trace but not one pipeoff wrote (no 'pipeoff' section, "
            "and no 'pipeoff::' ranges from torch.profiler); write traces with Trace.save "
            "or pipeoff.trace.record"
        )
    try:
        tasks = []
        for ev in doc["traceEvents"]:
            if ev.get("ph") != "X" or "pipeoff.task" not in ev.get("args", {}):
                continue
            a = ev["args"]
            enq, start, end = (int(x) for x in a["t_ns"])
            if end < start or int(a["bytes"]) < 0:  # (a tester's: negative figures, a plot's
                # raster overflow)
                raise ValueError(f"task {a['pipeoff.task']!r} has t_ns {a['t_ns']!r} and "
                                 f"bytes {a['bytes']!r}: it ends before it starts, or moves "
                                 "fewer than 0 bytes")
            tasks.append(
                TaskRecord(
                    name=str(a["pipeoff.task"]),
                    kind=str(a["kind"]),
                    lane=str(a["lane"]),
                    start_ns=start,
                    end_ns=end,
                    enqueue_ns=enq,
                    nbytes=int(a["bytes"]),
                    deps=tuple(a["deps"]),
                    buffers=tuple(a["buffers"]),
                    status=a["status"],
                    rank=int(ev.get("pid", 0)),
                    gates=tuple(a.get("gates", ())),
                    execution=int(a.get("execution", 0)),
                )
            )
        buffers = tuple(
            BufferRecord(name=b["name"], nbytes=int(b["nbytes"]), where=b["where"],
                         rank=int(b.get("rank", 0)))
            for b in section.get("buffers", [])
        )
    except (KeyError, TypeError, ValueError) as err:
        raise TraceFormatError(f"{source!r} has a malformed pipeoff event: {err!r}") from None
    for b in buffers:
        if b.where not in ("device", "host"):
            raise TraceFormatError(
                f"{source!r}: buffer {b.name!r} is in {b.where!r}; expected 'device' or 'host'")
    for key in ("device_budget_bytes", "host_budget_bytes"):
        v = section.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise TraceFormatError(f"{source!r}: {key} must be a byte count or null, got {v!r}")
    return {
        "tasks": tuple(tasks),
        "buffers": buffers,
        "device_budget_bytes": section.get("device_budget_bytes"),
        "host_budget_bytes": section.get("host_budget_bytes"),
        "metadata": dict(section.get("metadata", {})),
    }


def _from_profiler(doc: dict[str, Any]) -> dict[str, Any] | None:
    """A trace from the ``pipeoff::<kind>::<name>`` ranges of a torch.profiler trace.

    Only what the ranges carry survives: lane (the profiler thread), start,
    duration and kind. Dependencies, bytes and staging are not in the ranges.
    """
    thread_names: dict[tuple[Any, Any], str] = {}
    ranges = []
    for ev in doc["traceEvents"]:
        if not isinstance(ev, dict):
            continue
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            thread_names[(ev.get("pid"), ev.get("tid"))] = str(ev.get("args", {}).get("name"))
        elif ev.get("ph") == "X" and str(ev.get("name", "")).startswith("pipeoff::"):
            ranges.append(ev)
    if not ranges:
        return None
    rank = int((doc.get("distributedInfo") or {}).get("rank", 0))
    origin = min(float(ev["ts"]) for ev in ranges)
    tasks = []
    for k, ev in enumerate(sorted(ranges, key=lambda e: float(e["ts"]))):
        _, kind, name = str(ev["name"]).split("::", 2)
        start = int(round((float(ev["ts"]) - origin) * 1e3))
        lane = thread_names.get((ev.get("pid"), ev.get("tid")), f"tid {ev.get('tid')}")
        if kind == TRAIN:
            # The training thread's "step 3" (a span's name carries its step number),
            # on the train row, as a pipeoff trace has them.
            lane = TRAIN
        else:
            name = f"{name}#{k}"
        tasks.append(TaskRecord(name=name, kind=kind, lane=lane, start_ns=start,
                                end_ns=start + int(round(float(ev.get("dur", 0)) * 1e3)),
                                enqueue_ns=start, rank=rank))
    return {"tasks": tuple(tasks), "metadata": {"source": "torch.profiler", "rank": rank}}
