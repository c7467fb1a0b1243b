"""The records a trace is made of, and the pure functions over them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "COPY_KINDS", "GATE", "HOOK_WAIT", "MARKERS", "TRAIN",
           "BufferRecord", "Status", "TaskRecord", "gate_meaning", "hook_wait_record",
           "staging_timeline", "train_record", "train_step"]

Status = Literal["ok", "failed", "cancelled"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskRecord:
    """What one task did. Times are nanoseconds from the trace's origin."""

    name: str
    """The task's name."""
    kind: str
    """The :class:`~pipeoff.TaskKind` value, e.g. ``"d2h"``."""
    lane: str
    """The lane it ran on."""
    start_ns: int
    """When it started (a CUDA event on GPU lanes, a monotonic clock on host)."""
    end_ns: int
    """When it ended; equal to ``start_ns`` for a cancelled task."""
    enqueue_ns: int = 0
    """When the host issued it."""
    nbytes: int = 0
    """Bytes moved or computed on."""
    deps: tuple[str, ...] = ()
    """The tasks it depended on."""
    buffers: tuple[str, ...] = ()
    """The staging buffers it used."""
    status: Status = "ok"
    """``"ok"``, ``"failed"`` (it raised), or ``"cancelled"`` (it never ran)."""
    rank: int = 0
    """The process's rank when recorded."""
    gates: tuple[str, ...] = ()
    """The gates it waited on (each has a record of kind ``"gate"``)."""
    execution: int = 0
    """Which execution of a recorded region it belongs to (0 for a single one)."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferRecord:
    """A staging buffer of a traced execution."""

    name: str
    nbytes: int
    where: str
    """``"device"`` or ``"host"``."""
    rank: int = 0


HOOK_WAIT = "hook_wait"
"""The ``kind`` of records that time a forward hook blocked on a step in flight."""
GATE = "gate"
"""The ``kind`` of records that time a gate: from a lane's first wait on it to
its opening (see :meth:`pipeoff.TaskGraph.add_gate`)."""
TRAIN = "train"
"""The ``kind`` of records of the training thread's work while a region is recorded
(``forward 3``, ``backward 3``, ``step 3``, ``sync 3``), on the ``train`` row."""
MARKERS = (HOOK_WAIT, GATE, TRAIN)
"""Kinds of records that are not tasks (no lane time, no makespan)."""
COPY_KINDS = ("d2h", "h2d")
COMPUTE_KINDS = ("optimizer_chunk",)
COMM_KINDS = ("allreduce",)


_GATE_MEANINGS = {
    # Full offload (pipeoff/optim/_full_offload/_graph.py).
    "prev": "the previous micro-step's writes",
    "step": "step()'s hyperparameters, clipping and gradient edits",
    "reduce": "the caller letting the clipping norm's all-reduce go",
    # DiLoCo (pipeoff/ft/_diloco_graph.py).
    "commit": "the quorum's commit decision (should_commit)",
}


def gate_meaning(name: str) -> str:
    """What a gate's lanes wait for, from the name its feature gave it (a recorded
    region's ``x3/`` prefix aside): full offload's ``grad:<param>`` gates wait for the
    backward's gradients, its ``prev``, ``step`` and ``reduce`` for the previous
    micro-step, ``step()`` and the norm's all-reduce; DiLoCo's ``commit`` for the
    quorum's decision. Any other gate: an input from outside the execution."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith("grad:"):
        return "gradients from the backward"
    return _GATE_MEANINGS.get(base, "inputs from outside the execution")


def hook_wait_record(name: str, start_ns: int, end_ns: int, *, origin_ns: int,
                     rank: int) -> TaskRecord:
    """The record of a forward hook that blocked from ``start_ns`` to ``end_ns``
    (``perf_counter_ns``), on a timeline that starts at ``origin_ns``."""
    return TaskRecord(name=name, kind=HOOK_WAIT, lane="forward hooks",
                      start_ns=start_ns - origin_ns, end_ns=end_ns - origin_ns,
                      enqueue_ns=start_ns - origin_ns, rank=rank)


def train_record(what: str, step: int, start_ns: int, end_ns: int, *, origin_ns: int,
                 rank: int) -> TaskRecord:
    """The record of the training thread's ``what`` (``"forward"``, ``"backward"``,
    ``"step"``, ``"sync"``) for step ``step``, from ``start_ns`` to ``end_ns``
    (``perf_counter_ns``), on a timeline that starts at ``origin_ns``."""
    return TaskRecord(name=f"{what} {step}", kind=TRAIN, lane="train",
                      start_ns=start_ns - origin_ns, end_ns=end_ns - origin_ns,
                      enqueue_ns=start_ns - origin_ns, rank=rank)


def train_step(record: TaskRecord) -> tuple[str, int] | None:
    """``(what, step)`` of a train record (``"step 3"`` -> ``("step", 3)``), else ``None``."""
    if record.kind != TRAIN:
        return None
    what, _, step = record.name.rpartition(" ")
    return (what, int(step)) if step.isdigit() else None


def staging_timeline(tasks: Iterable[TaskRecord],
                     buffers: Iterable[BufferRecord]) -> list[tuple[int, int, int]]:
    """``(time_ns, device_bytes, host_bytes)`` after each change of live staging.

    A buffer is live from its first user's start to its last user's end.
    """
    spans: dict[tuple[int, str], list[int]] = {}
    for t in tasks:
        for b in t.buffers:
            span = spans.setdefault((t.rank, b), [t.start_ns, t.end_ns])
            span[0] = min(span[0], t.start_ns)
            span[1] = max(span[1], t.end_ns)
    sizes = {(b.rank, b.name): b for b in buffers}
    changes: list[tuple[int, int, str, int]] = []  # (time, order, where, delta)
    for key, (s, e) in spans.items():
        spec = sizes.get(key)
        if spec is None:
            continue
        changes.append((s, 1, spec.where, spec.nbytes))
        changes.append((e, 0, spec.where, -spec.nbytes))  # releases sort first
    changes.sort()
    live = {"device": 0, "host": 0}
    out: list[tuple[int, int, int]] = []
    for time_ns, _, where, delta in changes:
        live[where] += delta
        out.append((time_ns, live["device"], live["host"]))
    return out
