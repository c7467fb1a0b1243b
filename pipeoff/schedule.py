"""Schedules: how a task graph is ordered, laid onto lanes and kept within budgets.

A :class:`Schedule` is a frozen value. :meth:`Schedule.plan` turns a graph into
a :class:`Plan`: the issue order, each task's lane, and the cross-lane waits
that executors enforce with events. The waits include, besides the graph's
dependencies, the *budget waits* that keep live staging under the budget when
the lanes run concurrently (see :func:`_budget_waits`).
"""

from __future__ import annotations

import heapq
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeoff._errors import BudgetError, ConfigError
from pipeoff._validate import check_int
from pipeoff.graph import TaskGraph, TaskKind, no_gc

__all__ = ["DEFAULT_LANES", "Plan", "Schedule"]

DEFAULT_LANES: Mapping[TaskKind, str] = {
    TaskKind.D2H: "d2h",
    TaskKind.H2D: "h2d",
    TaskKind.ALLREDUCE: "comm",
    TaskKind.OPTIMIZER_CHUNK: "compute",
    TaskKind.HOST: "host",
}
"""The lane each kind of task runs on under :meth:`Schedule.pipelined`."""

SYNC_LANE = "main"
_SEARCH_LIMIT = 200_000


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """How to run a graph. Build one with :meth:`synchronous` or :meth:`pipelined`."""

    kind: Literal["synchronous", "pipelined"]
    """``"synchronous"``: one lane, each task waited on before the next starts.
    ``"pipelined"``: one lane per task kind, all running concurrently."""
    device_budget_bytes: int | None = None
    """Most bytes of device staging live at once; ``None`` is unbounded."""
    host_budget_bytes: int | None = None
    """Most bytes of host staging live at once; ``None`` is unbounded."""
    max_in_flight: int | None = None
    """Flow control: task ``i`` (in issue order) starts only once task
    ``i - max_in_flight`` has finished; ``None`` issues all at once. It keeps
    issue from running far ahead of execution (a CUDA launch queue), but it is
    not a bound on the tasks running at once (with ``i - k`` finished early,
    ``i`` may start while older tasks on other lanes still run) nor on memory:
    the staging budgets bound memory. (Formerly ``lookahead``.)"""

    def __post_init__(self) -> None:
        if self.kind not in ("synchronous", "pipelined"):
            raise ConfigError(
                f"Schedule kind must be 'synchronous' or 'pipelined', got {self.kind!r}"
            )
        check_int("device_budget_bytes", self.device_budget_bytes, optional=True)
        check_int("host_budget_bytes", self.host_budget_bytes, optional=True)
        check_int("max_in_flight", self.max_in_flight, optional=True)

    @classmethod
    def synchronous(cls) -> Schedule:
        """The degenerate schedule: one lane, strictly sequential, a host wait per task."""
        return cls(kind="synchronous")

    @classmethod
    def pipelined(
        cls,
        *,
        device_budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        max_in_flight: int | None = None,
        lookahead: int | None = None,
    ) -> Schedule:
        """All lanes run concurrently; live staging stays within the budgets.

        Args:
            device_budget_bytes: cap on live device staging bytes, or ``None``.
            host_budget_bytes: cap on live host staging bytes, or ``None``.
            max_in_flight: cap on tasks issued but unfinished, or ``None``.
            lookahead: the old name of ``max_in_flight`` (deprecated; a
                ``FutureWarning``).

        Raises:
            ConfigError: a budget or ``max_in_flight`` is not a positive int, or
                both ``max_in_flight`` and ``lookahead`` are given.
        """
        if lookahead is not None:
            if max_in_flight is not None:
                raise ConfigError("give max_in_flight (the new name of lookahead), not both")
            check_int("lookahead", lookahead, optional=True)
            warnings.warn("Schedule.pipelined(lookahead=...) is now max_in_flight=...; "
                          "lookahead will be removed", FutureWarning, stacklevel=2)
            max_in_flight = lookahead
        return cls(
            kind="pipelined",
            device_budget_bytes=device_budget_bytes,
            host_budget_bytes=host_budget_bytes,
            max_in_flight=max_in_flight,
        )

    @property
    def lookahead(self) -> int | None:
        """The old name of :attr:`max_in_flight` (deprecated)."""
        warnings.warn("Schedule.lookahead is now Schedule.max_in_flight; lookahead will be "
                      "removed", FutureWarning, stacklevel=2)
        return self.max_in_flight

    @property
    def is_synchronous(self) -> bool:
        return self.kind == "synchronous"

    def budget(self, where: str) -> int | None:
        """The budget for ``"device"`` or ``"host"`` staging."""
        return self.device_budget_bytes if where == "device" else self.host_budget_bytes

    def plan(self, graph: TaskGraph) -> Plan:
        """Order ``graph`` for this schedule.

        Raises:
            GraphError: the graph is malformed.
            BudgetError: a buffer is larger than its budget, or no issue order
                keeps live staging within the budgets.
        """
        # (The default lanes are in the key: they decide a task's lane, and they
        # are a public mapping a caller may edit. A huge graph is not cached.)
        key = ((self, tuple(DEFAULT_LANES.items()), graph.structure_key())
               if len(graph.tasks) <= _PLAN_CACHE_MAX_TASKS else None)
        cached = _PLANS.get(key) if key is not None else None
        if cached is not None:  # the same structure: validated and planned before
            graph.adopt_validation(cached[1])
            return cached[0]
        graph.validate()
        for spec in graph.buffers.values():
            cap = self.budget(spec.where)
            if cap is not None and spec.nbytes > cap:
                raise BudgetError(
                    f"staging buffer {spec.name!r} needs {spec.nbytes} bytes of {spec.where} "
                    f"memory, more than the {spec.where}_budget_bytes={cap}"
                )
        if self.is_synchronous:
            order = graph.topological_order()
            lanes = tuple(SYNC_LANE for _ in order)
        else:
            order = _issue_order(graph, self)
            lanes = tuple(
                graph.tasks[n].lane or DEFAULT_LANES[graph.tasks[n].kind] for n in order
            )
        plan = _make_plan(graph, self, order, lanes)
        if key is None:
            return plan
        entry = (plan, graph.topological_order())
        with _PLANS_LOCK:  # (executions are launched from several threads)
            if len(_PLANS) >= _PLAN_CACHE_SIZE:
                _PLANS.pop(next(iter(_PLANS)), None)  # the oldest
            _PLANS[key] = entry
        return plan


_PLAN_CACHE_SIZE = 64
_PLAN_CACHE_MAX_TASKS = 4096
"""Graphs of more tasks are planned every time (their keys would hold megabytes)."""
_PLANS: dict[tuple[Any, ...], tuple[Plan, tuple[str, ...]]] = {}
_PLANS_LOCK = threading.Lock()
"""Plans by schedule and graph structure (:meth:`TaskGraph.structure_key`): a
training loop rebuilds the same step graph every step, and plans it once. Plans
are immutable and name tasks by position, so one serves every such graph."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A graph laid out by a schedule. Indices refer to positions in ``order``."""

    schedule: Schedule
    """The schedule that made the plan."""
    order: tuple[str, ...]
    """Task names in issue order (a topological order)."""
    lanes: tuple[str, ...]
    """The lane of each task."""
    waits: tuple[tuple[int, ...], ...]
    """Per task, the earlier tasks on *other* lanes it must wait for: its
    dependencies, the previous user of each of its buffers, and budget waits,
    reduced to the latest one per lane (a lane is
    FIFO, so waiting on its latest implies the earlier ones)."""
    acquire: tuple[tuple[str, ...], ...]
    """Per task, the buffers it is the first user of."""
    release: tuple[tuple[str, ...], ...]
    """Per task, the buffers it is the last user of."""
    planned_peak_bytes: Mapping[str, int]
    """Per memory kind, the most staging bytes that can be live at once under
    this plan (at most the budget, when there is one)."""

    @property
    def lane_names(self) -> tuple[str, ...]:
        """The distinct lanes, in order of first use."""
        return tuple(dict.fromkeys(self.lanes))


def _issue_order(graph: TaskGraph, schedule: Schedule) -> tuple[str, ...]:
    """A topological order whose open staging stays within the budgets.

    A buffer is *open* from the issue of its first user to the issue of its
    last. Greedy: issue the earliest-added ready task whose new buffers fit.
    If that gets stuck, search the orders exhaustively (bounded) before giving up.
    """
    budgets = {w: schedule.budget(w) for w in ("device", "host")}
    if not graph.buffers or all(b is None for b in budgets.values()):
        return graph.topological_order()
    problem = _OrderProblem(graph, budgets)
    order = problem.greedy()
    if order is None:
        order = problem.search()
    return tuple(problem.names[i] for i in order)


class _OrderProblem:
    def __init__(self, graph: TaskGraph, budgets: Mapping[str, int | None]) -> None:
        self.names = list(graph.tasks)
        index = {n: i for i, n in enumerate(self.names)}
        self.n = len(self.names)
        self.budgets = budgets
        self.specs = graph.buffers
        self.deps = [tuple({index[d] for d in t.deps}) for t in graph.tasks.values()]
        self.children: list[list[int]] = [[] for _ in range(self.n)]
        for i, ds in enumerate(self.deps):
            for d in ds:
                self.children[d].append(i)
        self.uses = [t.buffers for t in graph.tasks.values()]
        self.users: dict[str, int] = {b: 0 for b in graph.buffers}
        for bufs in self.uses:
            for b in set(bufs):
                self.users[b] += 1

    def _fits(self, i: int, opened: Mapping[str, int], open_bytes: Mapping[str, int]) -> bool:
        need = {"device": 0, "host": 0}
        for b in set(self.uses[i]):
            if b not in opened:
                need[self.specs[b].where] += self.specs[b].nbytes
        for w, cap in self.budgets.items():
            if cap is not None and need[w] and open_bytes[w] + need[w] > cap:
                return False
        return True

    def _place(self, i: int, opened: dict[str, int], open_bytes: dict[str, int]) -> None:
        for b in set(self.uses[i]):
            w = self.specs[b].where
            if b not in opened:
                opened[b] = 0
                open_bytes[w] += self.specs[b].nbytes
            opened[b] += 1
            if opened[b] == self.users[b]:
                open_bytes[w] -= self.specs[b].nbytes

    def greedy(self) -> list[int] | None:
        indegree = [len(d) for d in self.deps]
        ready = [i for i in range(self.n) if indegree[i] == 0]
        heapq.heapify(ready)
        opened: dict[str, int] = {}
        open_bytes = {"device": 0, "host": 0}
        order: list[int] = []
        while ready:
            skipped: list[int] = []
            chosen = -1
            while ready:
                i = heapq.heappop(ready)
                if self._fits(i, opened, open_bytes):
                    chosen = i
                    break
                skipped.append(i)
            for s in skipped:
                heapq.heappush(ready, s)
            if chosen < 0:
                return None
            self._place(chosen, opened, open_bytes)
            order.append(chosen)
            for c in self.children[chosen]:
                indegree[c] -= 1
                if indegree[c] == 0:
                    heapq.heappush(ready, c)
        return order

    def search(self) -> list[int]:
        """Depth-first search over the downsets of the graph, memoizing dead ends.

        Iterative (an explicit stack), so a long graph cannot exhaust Python's
        recursion limit.
        """
        dead: set[frozenset[int]] = set()
        expansions = 0
        order: list[int] = []
        placed: set[int] = set()
        # Per depth d (= len(order)): the next candidate to try, and the open
        # buffers once order[:d] is issued (None until the state is entered).
        cursor: list[int] = [0]
        state: list[tuple[dict[str, int], dict[str, int]] | None] = [None]
        while len(order) < self.n:
            d = len(order)
            if state[d] is None and frozenset(placed) not in dead:
                # A state entered for the first time (a dead one is skipped below).
                expansions += 1
                if expansions > _SEARCH_LIMIT:
                    raise BudgetError(
                        f"no issue order found within the search limit ({_SEARCH_LIMIT} "
                        "states); raise the budgets or make buffers' users more local"
                    )
                opened: dict[str, int] = {}
                open_bytes = {"device": 0, "host": 0}
                for i in order:
                    self._place(i, opened, open_bytes)
                state[d] = (opened, open_bytes)
            st = state[d]
            chosen = -1
            if st is not None:
                for i in range(cursor[d], self.n):
                    if (i not in placed and all(dep in placed for dep in self.deps[i])
                            and self._fits(i, *st)):
                        chosen = i
                        break
            if chosen >= 0:
                cursor[d] = chosen + 1
                order.append(chosen)
                placed.add(chosen)
                cursor.append(0)
                state.append(None)
                continue
            # Nothing more to try from here: a dead end; back up one task.
            dead.add(frozenset(placed))
            if d == 0:
                raise BudgetError(self._explain())
            cursor.pop()
            state.pop()
            placed.discard(order.pop())
        return order

    def _explain(self) -> str:
        big = sorted(self.specs.values(), key=lambda s: -s.nbytes)[:3]
        caps = ", ".join(f"{w}_budget_bytes={c}" for w, c in self.budgets.items() if c)
        return (
            f"no issue order keeps live staging within {caps}: buffers stay open across "
            f"tasks that need others; largest buffers: "
            + ", ".join(f"{s.name!r} ({s.nbytes} B {s.where})" for s in big)
        )


def _make_plan(
    graph: TaskGraph, schedule: Schedule, order: tuple[str, ...], lanes: tuple[str, ...]
) -> Plan:
    with no_gc():
        return _make_plan_impl(graph, schedule, order, lanes)


def _make_plan_impl(
    graph: TaskGraph, schedule: Schedule, order: tuple[str, ...], lanes: tuple[str, ...]
) -> Plan:
    pos = {n: i for i, n in enumerate(order)}
    tasks = [graph.tasks[n] for n in order]
    n = len(order)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, t in enumerate(tasks):
        for b in t.buffers:
            first.setdefault(b, i)
            last[b] = i
    empty: tuple[str, ...] = ()
    acquire: list[tuple[str, ...]] = [empty] * n
    release: list[tuple[str, ...]] = [empty] * n
    for b, i in first.items():
        acquire[i] += (b,)
    for b, i in last.items():
        release[i] += (b,)

    extra, peaks = _budget_waits(graph, schedule, lanes, acquire, release)
    # Tasks that share a buffer use it one after another, in issue order: each
    # waits for the previous user, so no two users of a buffer ever overlap.
    prev_user: dict[str, int] = {}
    for i, t in enumerate(tasks):
        for b in t.buffers:
            if b in prev_user:
                extra.setdefault(i, []).append(prev_user[b])
            prev_user[b] = i
    no_waits: tuple[int, ...] = ()
    waits: list[tuple[int, ...]] = [no_waits] * n
    for i, t in enumerate(tasks):
        more = extra.get(i)
        if not t.deps and not more:
            continue
        mine = lanes[i]
        if len(t.deps) == 1 and not more:
            j = pos[t.deps[0]]
            if lanes[j] != mine:
                waits[i] = (j,)
            continue
        latest: dict[str, int] = {}
        for j in (*(pos[d] for d in t.deps), *(more or ())):
            lane = lanes[j]
            if lane != mine and j > latest.get(lane, -1):
                latest[lane] = j
        if latest:
            waits[i] = tuple(sorted(latest.values()))
    return Plan(
        schedule=schedule,
        order=order,
        lanes=lanes,
        waits=tuple(waits),
        acquire=tuple(acquire),
        release=tuple(release),
        planned_peak_bytes=peaks,
    )


def _budget_waits(
    graph: TaskGraph,
    schedule: Schedule,
    lanes: tuple[str, ...],
    acquire: list[tuple[str, ...]],
    release: list[tuple[str, ...]],
) -> tuple[dict[int, list[int]], dict[str, int]]:
    """Extra waits that bound *live* staging when lanes run concurrently.

    Along the issue order a buffer is open from its first user to its last;
    the order keeps open bytes within budget. At run time a closed buffer stays
    live until its last user *finishes*, possibly on another lane. So a task
    that acquires bytes on lane L first waits for the oldest closed buffers
    that L does not yet know to be released, until open + new + unknown fit.
    Each lane remembers the prefix of closed buffers it has waited for (FIFO
    makes that knowledge hold for its later tasks).
    """
    specs = graph.buffers
    extra: dict[int, list[int]] = {}
    peaks = {"device": 0, "host": 0}
    open_bytes = {"device": 0, "host": 0}
    closed: dict[str, list[tuple[int, int]]] = {"device": [], "host": []}  # (bytes, last user)
    closed_cum: dict[str, list[int]] = {"device": [0], "host": [0]}
    known: dict[tuple[str, str], int] = {}
    if not specs:
        return extra, peaks
    for i, lane in enumerate(lanes):
        if not acquire[i] and not release[i]:
            continue
        need = {"device": 0, "host": 0}
        for b in acquire[i]:
            need[specs[b].where] += specs[b].nbytes
        for w in ("device", "host"):
            if not need[w]:
                continue
            cap = schedule.budget(w)
            pending = 0
            if not schedule.is_synchronous:
                k = known.get((lane, w), 0)
                pending = closed_cum[w][-1] - closed_cum[w][k]
                while cap is not None and open_bytes[w] + need[w] + pending > cap:
                    nbytes, user = closed[w][k]
                    extra.setdefault(i, []).append(user)
                    pending -= nbytes
                    k += 1
                known[(lane, w)] = k
            open_bytes[w] += need[w]
            # What may be live when this task starts: open buffers, its own,
            # and closed ones whose release this lane has not waited for.
            peaks[w] = max(peaks[w], open_bytes[w] + pending)
        for b in release[i]:
            w = specs[b].where
            open_bytes[w] -= specs[b].nbytes
            closed[w].append((specs[b].nbytes, i))
            closed_cum[w].append(closed_cum[w][-1] + specs[b].nbytes)
    return extra, peaks
