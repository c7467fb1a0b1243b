"""The sim backend: the same plan, timed against a cost model instead of run.

Lanes are FIFO and wait for their cross-lane dependencies exactly as on the
real backends, and the host issues tasks in plan order paying a launch
overhead each (with ``lookahead``, task *i* is issued only after task
*i - lookahead* finished). Copies are simulated as fluids: a copy's rate
changes when a copy in the other direction starts or ends, which is how
bidirectional contention slows both. Task ``work`` is never called.
"""

from __future__ import annotations

import math

from pipeoff import testing
from pipeoff.executor._backend import HostBackend
from pipeoff.executor._run import OK, Run
from pipeoff.graph import TaskKind
from pipeoff.sim._costmodel import CostModel

_COPY = {TaskKind.H2D: "h2d", TaskKind.D2H: "d2h"}
_EPS = 1e-12  # seconds: a picosecond is simultaneous


class SimBackend(HostBackend):
    """Computes every task's start and end from ``cost_model``; returns finished."""

    name = "sim"

    def __init__(self, cost_model: CostModel) -> None:
        self.cost = cost_model

    def fixed_seconds(self, run: Run, i: int) -> float:
        """Duration of a task that is not a host-link copy."""
        t = run.tasks[i]
        c = self.cost
        if t.kind is TaskKind.ALLREDUCE:
            # The bucket's device staging copy is an HBM read and write.
            return c.allreduce_s(t.nbytes) + 2 * t.nbytes / (c.hbm_gbps * 1e9)
        if t.kind is TaskKind.OPTIMIZER_CHUNK:
            return c.optimizer_s(t.nbytes)
        if t.kind is TaskKind.HOST:
            return c.optimizer_s(t.nbytes, on_host=True) if t.nbytes else 0.0
        return 0.0  # a copy of no bytes

    def launch(self, run: Run) -> None:
        plan = run.plan
        n = run.n
        cost = self.cost
        lookahead = plan.schedule.lookahead
        lanes: dict[str, list[int]] = {}
        for i, lane in enumerate(plan.lanes):
            lanes.setdefault(lane, []).append(i)
        head = dict.fromkeys(lanes, 0)
        busy: dict[str, int | None] = dict.fromkeys(lanes, None)
        start = [math.nan] * n
        end = [math.nan] * n
        issue = [math.nan] * n
        extra_delay = [0.0] * n
        if testing.installed():
            for i in range(n):
                extra_delay[i] = testing.delay_for(run.tasks[i].name, plan.lanes[i])
        copy_left: dict[int, float] = {}  # active copies: bytes left
        fixed_end: dict[int, float] = {}  # active other tasks: end time
        now = 0.0
        next_issue = 0  # the next task the host issues
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

        def copy_rates() -> dict[int, float]:
            active = {_COPY[run.tasks[i].kind] for i in copy_left}
            return {
                i: cost.copy_rate(_COPY[run.tasks[i].kind],
                                  ("d2h" if _COPY[run.tasks[i].kind] == "h2d" else "h2d")
                                  in active)
                for i in copy_left
            }

        try_issue()
        while finished < n:
            # Start whatever can start now.
            progressed = True
            while progressed:
                progressed = False
                for lane in lanes:
                    i = startable(lane)
                    if i is None:
                        continue
                    busy[lane] = i
                    head[lane] += 1
                    start[i] = now
                    t = run.tasks[i]
                    if t.kind in _COPY and t.nbytes:
                        copy_left[i] = float(t.nbytes)
                        if extra_delay[i]:
                            fixed_end[i] = now + extra_delay[i]  # delay first, copy after
                            copy_left.pop(i)
                            extra_delay[i] = -1.0  # marks "copy still to do"
                    else:
                        fixed_end[i] = now + extra_delay[i] + self.fixed_seconds(run, i)
                    progressed = True
            # The next event: a fixed task ends, a copy ends, or an issue time comes.
            rates = copy_rates()
            candidates = list(fixed_end.values())
            candidates += [now + left / rates[i] for i, left in copy_left.items()]
            candidates += [issue[lanes[ln][head[ln]]] for ln in lanes
                           if busy[ln] is None and head[ln] < len(lanes[ln])
                           and not math.isnan(issue[lanes[ln][head[ln]]])
                           and issue[lanes[ln][head[ln]]] > now + _EPS]
            if not candidates:
                raise AssertionError("simulation stalled: a plan wait points forward")
            t_next = min(candidates)
            dt = t_next - now
            for i in list(copy_left):
                copy_left[i] -= rates[i] * dt
            now = t_next
            done = [i for i, e in fixed_end.items() if e <= now + _EPS]
            # A copy is done when what is left would take no representable time
            # (float rounding leaves crumbs of bytes behind).
            done += [i for i, left in copy_left.items() if left / rates[i] <= _EPS
                     or now + left / rates[i] <= now]
            for i in done:
                if i in fixed_end and extra_delay[i] == -1.0:
                    # A delayed copy: the delay is over, the bytes start moving.
                    del fixed_end[i]
                    extra_delay[i] = 0.0
                    copy_left[i] = float(run.tasks[i].nbytes)
                    continue
                fixed_end.pop(i, None)
                copy_left.pop(i, None)
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
