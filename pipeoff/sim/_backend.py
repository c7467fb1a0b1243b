"""The sim backend: the same plan, timed against a cost model instead of run.

Lanes are FIFO and wait for their cross-lane dependencies exactly as on the
real backends, and the host issues tasks in plan order paying a launch
overhead each (with ``max_in_flight``, task *i* is issued only after task
*i - max_in_flight* finished). Copies are simulated as fluids: a copy's rate
changes when a copy in the other direction starts or ends, which is how
bidirectional contention slows both; optimizer chunks and copies can be set
to slow each other too (they share memory bandwidth on a CPU). With a host
model (:class:`~pipeoff.sim.HostCosts`) the rank's host tasks and pinned copies
share its part of the node's memory bandwidth. Task ``work`` is never called.
"""

from __future__ import annotations

import math

from pipeoff import _faults
from pipeoff._errors import ConfigError
from pipeoff.executor._backend import HostBackend
from pipeoff.executor._run import OK, Run
from pipeoff.graph import TaskKind
from pipeoff.sim._compute import TRAIN_LANES
from pipeoff.sim._costmodel import CostModel

_COPY = {TaskKind.H2D: "h2d", TaskKind.D2H: "d2h"}
_EPS = 1e-12  # seconds: a picosecond is simultaneous


def _op_lane(run: Run, i: int) -> str:
    """The lane that names what host task ``i`` does: the one its graph gave it (a
    synchronous schedule runs every task on one lane, the op is the same)."""
    return run.tasks[i].lane or run.plan.lanes[i]


class SimBackend(HostBackend):
    """Computes every task's start and end from ``cost_model``; returns finished."""

    name = "sim"

    def __init__(self, cost_model: CostModel) -> None:
        self.cost = cost_model

    def full_speed_seconds(self, run: Run, i: int) -> float:
        """How long task ``i`` takes with nothing contending with it."""
        t = run.tasks[i]
        c = self.cost
        if _op_lane(run, i) in TRAIN_LANES:
            # The training step's own compute: its FLOPs, in nbytes (sim graphs only).
            if c.compute is None:
                raise ConfigError(f"task {t.name!r} is training compute (FLOPs) and the "
                                  f"cost model {c.name!r} has none (CostModel.compute)")
            return c.compute.seconds(t.nbytes)
        if run.plan.lanes[i] == "d2d":
            # A copy within device memory (a state transfer's): an HBM read and write.
            return 2 * t.nbytes / (c.hbm_gbps * 1e9)
        if t.kind in _COPY:
            return t.nbytes / c.copy_rate(_COPY[t.kind], False) if t.nbytes else 0.0
        if t.kind is TaskKind.ALLREDUCE:
            # The bucket's device staging copy is an HBM read and write.
            return c.allreduce_s(t.nbytes) + 2 * t.nbytes / (c.hbm_gbps * 1e9)
        if t.kind is TaskKind.OPTIMIZER_CHUNK:
            return c.optimizer_s(t.nbytes)
        if not t.nbytes:
            return 0.0
        if c.host is not None:
            s = c.host.task_seconds(_op_lane(run, i), t.nbytes / c.optimizer_bytes_per_elem)
            if s is not None:
                return s
        return c.optimizer_s(t.nbytes, on_host=True)

    def _host_draw(self, run: Run, i: int, speed: float) -> float:
        """Bytes per second of host memory task ``i`` draws at ``speed``: a copy its
        link rate (a pinned buffer read or written), a host task on a lane the host
        model knows all of the rank's bandwidth, others nothing."""
        t = run.tasks[i]
        c = self.cost
        if c.host is None or not t.nbytes or run.plan.lanes[i] == "d2d":
            return 0.0
        if t.kind in _COPY:
            return speed * c.copy_rate(_COPY[t.kind], False)
        if t.kind is TaskKind.HOST and _op_lane(run, i) in c.host.bytes_per_elem:
            return speed * c.host.rank_bytes_per_s
        return 0.0

    def speeds(self, run: Run, working: list[int]) -> dict[int, float]:
        """Share of full speed each of ``working`` runs at while they all run: the
        link and compute contention of :meth:`speed`, then, with a host model, the
        rank's host memory bandwidth shared in proportion to what each draws."""
        kinds = {run.tasks[i].kind for i in working}
        out = {i: self.speed(run, i, kinds) for i in working}
        if self.cost.host is None:
            return out
        draw = {i: self._host_draw(run, i, out[i]) for i in working}
        total = sum(draw.values())
        cap = self.cost.host.rank_bytes_per_s
        if total > cap:
            for i, d in draw.items():
                if d:
                    out[i] *= cap / total
        return out

    def speed(self, run: Run, i: int, active_kinds: set[TaskKind]) -> float:
        """Share of full speed task ``i`` runs at while ``active_kinds`` run."""
        kind = run.tasks[i].kind
        c = self.cost
        f = 1.0
        if run.plan.lanes[i] == "d2d":
            return f  # HBM: no share of the host link
        if kind in _COPY:
            other = TaskKind.D2H if kind is TaskKind.H2D else TaskKind.H2D
            if other in active_kinds:
                f *= c.h2d_bidir_factor if kind is TaskKind.H2D else c.d2h_bidir_factor
            if TaskKind.OPTIMIZER_CHUNK in active_kinds:
                f *= c.copy_compute_factor
        elif kind is TaskKind.OPTIMIZER_CHUNK and active_kinds & _COPY.keys():
            f *= c.copy_compute_factor
        return f

    def launch(self, run: Run) -> None:
        # The simulator's inputs from outside the execution are there at launch.
        run.gates.open_all(0)
        plan = run.plan
        n = run.n
        cost = self.cost
        # The synchronous schedule waits for each task before issuing the next:
        # a window of one, so every task pays its launch overhead after the last.
        lookahead = 1 if plan.schedule.kind == "synchronous" else plan.schedule.max_in_flight
        lanes: dict[str, list[int]] = {}
        for i, lane in enumerate(plan.lanes):
            lanes.setdefault(lane, []).append(i)
        head = dict.fromkeys(lanes, 0)
        busy: dict[str, int | None] = dict.fromkeys(lanes, None)
        start = [math.nan] * n
        end = [math.nan] * n
        issue = [math.nan] * n
        # Active tasks: a delay (from pipeoff.testing, at full speed, contending
        # with nothing) and then their work, in seconds at full speed.
        delay_left: dict[int, float] = {}
        work_left: dict[int, float] = {}
        now = 0.0
        next_issue = 0
        host_free = 0.0
        finished = 0

        def try_issue() -> None:
            nonlocal next_issue, host_free
            while next_issue < n:
                i = next_issue
                if lookahead is not None and i >= lookahead:
                    prev = end[i - lookahead]
                    if math.isnan(prev):
                        return
                    host_free = max(host_free, prev)
                issue[i] = host_free + cost.launch_overhead_s
                host_free = issue[i]
                next_issue += 1

        def startable(lane: str) -> int | None:
            k = head[lane]
            if busy[lane] is not None or k >= len(lanes[lane]):
                return None
            i = lanes[lane][k]
            if math.isnan(issue[i]) or issue[i] > now + _EPS:
                return None
            if any(math.isnan(end[j]) or end[j] > now + _EPS for j in plan.waits[i]):
                return None
            return i

        try_issue()
        while finished < n:
            progressed = True
            while progressed:  # start whatever can start now
                progressed = False
                for lane in lanes:
                    ready = startable(lane)
                    if ready is None:
                        continue
                    i = ready
                    busy[lane] = i
                    head[lane] += 1
                    start[i] = now
                    delay = (_faults.delay_for(run.tasks[i].name, lane)
                             if _faults.installed() else 0.0)
                    if delay:
                        delay_left[i] = delay
                    work_left[i] = self.full_speed_seconds(run, i)
                    progressed = True
            working = [i for i in work_left if i not in delay_left]
            speeds = self.speeds(run, working)
            # The next event: a delay or a task ends, or the host issues a lane's head.
            candidates = [now + d for d in delay_left.values()]
            candidates += [now + work_left[i] / speeds[i] for i in working]
            for ln in lanes:
                if busy[ln] is None and head[ln] < len(lanes[ln]):
                    t_issue = issue[lanes[ln][head[ln]]]
                    if not math.isnan(t_issue) and t_issue > now + _EPS:
                        candidates.append(t_issue)
            if not candidates:
                raise AssertionError("simulation stalled: a plan wait points forward")
            t_next = min(candidates)
            dt = t_next - now
            for i in working:
                work_left[i] -= speeds[i] * dt
            for i in list(delay_left):
                delay_left[i] -= dt
                if delay_left[i] <= _EPS:
                    del delay_left[i]
            now = t_next
            # Done when what is left takes no representable time (float
            # rounding leaves crumbs behind).
            done = [i for i in working
                    if work_left[i] / speeds[i] <= _EPS or now + work_left[i] / speeds[i] <= now]
            for i in done:
                del work_left[i]
                end[i] = now
                busy[run.plan.lanes[i]] = None
                finished += 1
            try_issue()

        for i in range(n):
            run.enqueue_ns[i] = int(issue[i] * 1e9)
            run.start_ns[i] = int(start[i] * 1e9)
            run.end_ns[i] = int(end[i] * 1e9)
        for i in range(n):
            run.finish(i, OK)
