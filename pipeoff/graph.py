"""Task graphs: the transfers, collectives and optimizer work of one offload operation.

A :class:`TaskGraph` is built by a feature (the offload optimizer, LocalSGD)
and handed to :func:`pipeoff.execute` with a :class:`~pipeoff.Schedule`.
Tasks name their dependencies and the staging buffers they use; the graph
itself knows nothing about lanes, streams or budgets.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import heapq
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pipeoff._errors import ConfigError, GraphError
from pipeoff._validate import check_int

if TYPE_CHECKING:
    import torch

__all__ = ["BufferSpec", "Task", "TaskContext", "TaskGraph", "TaskKind"]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector around allocation-heavy bookkeeping.

    Planning a 100k-task graph allocates hundreds of thousands of small
    containers and no reference cycles; collections triggered midway would
    cost more than the planning itself.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

def _is_async(work: Callable[..., Any]) -> bool:
    """Whether ``work`` is an async function (or a partial of one, or an object with an
    async ``__call__``)."""
    code = getattr(work, "__code__", None)
    if code is not None:  # a plain function: one flag test
        return bool(code.co_flags & inspect.CO_COROUTINE)
    call = vars(type(work)).get("__call__")
    return inspect.iscoroutinefunction(work) or inspect.iscoroutinefunction(call)


Where = Literal["device", "host"]
_WHERE = ("device", "host")


class TaskKind(enum.Enum):
    """What a task does; it picks the task's default lane and its trace category."""

    D2H = "d2h"
    """A copy from device memory to (pinned) host memory."""
    H2D = "h2d"
    """A copy from (pinned) host memory to device memory."""
    ALLREDUCE = "allreduce"
    """A collective over a process group."""
    OPTIMIZER_CHUNK = "optimizer_chunk"
    """An optimizer update over one chunk of parameters."""
    HOST = "host"
    """Host-side work: a CPU optimizer, an RPC, a wait on a future."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferSpec:
    """A staging buffer that one or more tasks use.

    It is live from the start of its first user (in issue order) to the end of
    its last user, and its bytes count against the budget of its memory kind.
    """

    name: str
    """Unique among the graph's buffers."""
    nbytes: int
    """Size in bytes; the task sees a flat ``torch.uint8`` tensor of this size."""
    where: Where
    """``"device"`` (accelerator memory) or ``"host"`` (pinned host memory)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"buffer name must be a non-empty string, got {self.name!r}")
        check_int(f"buffer {self.name!r}: nbytes", self.nbytes)
        if self.where not in _WHERE:
            raise ConfigError(
                f"buffer {self.name!r}: where must be 'device' or 'host', got {self.where!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """One node of a :class:`TaskGraph`."""

    name: str
    """Unique among the graph's tasks; it names the task in errors and traces."""
    kind: TaskKind
    """What the task does; it picks the default lane."""
    work: Callable[[TaskContext], Any] | None
    """Called with a :class:`TaskContext`. On CUDA it enqueues onto the current
    stream (the lane's); on host it runs. ``None`` is a null task."""
    deps: tuple[str, ...] = ()
    """Names of the tasks that must finish before this one starts."""
    nbytes: int = 0
    """Bytes moved or computed on, for the trace and the cost model."""
    buffers: tuple[str, ...] = ()
    """Names of the staging buffers this task uses."""
    lane: str | None = None
    """Overrides the lane the schedule would pick from ``kind``."""
    must_run: bool = False
    """Run even after another task of the execution failed (its work sees
    :attr:`TaskContext.failed`). For a collective that peers are waiting for:
    skipping it would leave them waiting until a timeout. Its dependents that
    are not ``must_run`` are cancelled as usual."""
    gates: tuple[str, ...] = ()
    """Names of the gates (inputs from outside the execution, see
    :meth:`TaskGraph.add_gate`) that must be opened or closed before it starts."""


@dataclass(slots=True)
class TaskContext:
    """What a task's ``work`` receives when it runs."""

    task: Task
    """The task being run."""
    lane: str
    """The lane it runs on."""
    buffers: Mapping[str, torch.Tensor]
    """Its staging buffers by name, each a flat ``torch.uint8`` tensor."""
    stream: Any = None
    """The CUDA stream of the lane (already current), or ``None`` on host lanes."""
    results: Mapping[str, Any] = field(default_factory=dict)
    """The return values of the tasks finished so far, by task name."""
    retire: Callable[[str], None] | None = None
    """See :meth:`retire_buffer`."""
    failed: BaseException | None = None
    """The execution's first failure when this task started (``must_run`` tasks run
    after one), else ``None``."""
    failed_task: str | None = None
    """The name of the task (or gate) that raised :attr:`failed`."""
    gates: Mapping[str, Any] = field(default_factory=dict)
    """The payloads of the task's gates by name: what ``open(payload)`` gave, or
    ``None`` for a gate closed empty."""
    on_moved: Callable[[int], None] | None = None
    """See :meth:`moved`."""

    def moved(self, nbytes: int) -> None:
        """Say that this run of the task moved ``nbytes`` bytes, not the ``nbytes`` it
        declared: its trace record (and the step statistics made from it) then show
        that. A copy whose gate was closed empty, with nothing to copy, says 0."""
        if self.on_moved is not None:
            self.on_moved(nbytes)

    def buffer(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return staging buffer ``name``, viewed as ``dtype`` if given."""
        try:
            buf = self.buffers[name]
        except KeyError:
            raise GraphError(
                f"task {self.task.name!r} asked for buffer {name!r}, but it declares only "
                f"{sorted(self.buffers)}"
            ) from None
        return buf if dtype is None else buf.view(dtype)

    def gate(self, name: str) -> Any:
        """The payload of gate ``name`` (``None`` if it was closed empty)."""
        try:
            return self.gates[name]
        except KeyError:
            raise GraphError(
                f"task {self.task.name!r} asked for gate {name!r}, but it waits only on "
                f"{sorted(self.gates)}"
            ) from None

    def retire_buffer(self, name: str) -> None:
        """Never hand staging buffer ``name`` out again: drop it when it is released.

        For a buffer that work this task cannot wait for may still write, such
        as a collective whose ``wait()`` failed (it may still be running).
        Memory is freed once that work drops its own reference.
        """
        self.buffer(name)  # checks the name
        if self.retire is not None:
            self.retire(name)


class TaskGraph:
    """A directed acyclic graph of tasks and the staging buffers they use.

    Build it with :meth:`add_buffer` and :meth:`add_task`; dependencies may name
    tasks added later. :meth:`validate` (called by :func:`pipeoff.execute`)
    checks names, dependencies and cycles. The topological order is
    deterministic: among ready tasks, the one added first comes first.

    Args:
        device: the device that ``"device"`` buffers live on. ``None`` means
            the CPU (the ``threads`` backend); a CUDA device selects the
            ``cuda`` backend under ``backend="auto"``.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        import torch

        try:
            self.device: torch.device = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as err:
            raise ConfigError(
                f"device must be a torch.device or a device string such as 'cpu' or "
                f"'cuda:0', got {device!r} ({err})"
            ) from None
        self._tasks: dict[str, Task] = {}
        self._buffers: dict[str, BufferSpec] = {}
        self._gates: dict[str, None] = {}
        self._validated = False
        self._order: tuple[str, ...] = ()

    # -- building ---------------------------------------------------------
    def add_buffer(self, name: str, nbytes: int, *, where: Where = "device") -> str:
        """Declare a staging buffer and return its name.

        Raises:
            GraphError: a buffer with this name exists.
            ConfigError: ``nbytes`` is not positive or ``where`` is unknown.
        """
        if name in self._buffers:
            raise GraphError(f"duplicate buffer name {name!r}")
        self._buffers[name] = BufferSpec(name=name, nbytes=nbytes, where=where)
        self._validated = False
        return name

    def add_gate(self, name: str) -> str:
        """Declare a gate and return its name.

        A gate is an input that arrives from outside the execution while it
        runs: a gradient that an autograd hook produces, or a tensor another
        execution is still writing. Tasks list the gates they wait on
        (``add_task(..., gates=[name])``); the caller opens each one on the
        :class:`~pipeoff.Execution` (``execution.gate(name).open(payload)``),
        fails it, or closes it empty. Names share one namespace with tasks.

        Raises:
            GraphError: a gate or task with this name exists.
            ConfigError: ``name`` is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"gate name must be a non-empty string, got {name!r}")
        if name in self._gates or name in self._tasks:
            raise GraphError(f"duplicate name {name!r}: gates and tasks share one namespace")
        self._gates[name] = None
        self._validated = False
        return name

    def add_task(
        self,
        name: str,
        kind: TaskKind,
        work: Callable[[TaskContext], Any] | None = None,
        *,
        deps: Iterable[str] = (),
        nbytes: int = 0,
        buffers: Iterable[str] = (),
        lane: str | None = None,
        must_run: bool = False,
        gates: Iterable[str] = (),
    ) -> str:
        """Add a task and return its name.

        ``must_run`` marks a task that runs even after another task failed
        (see :attr:`Task.must_run`). ``gates`` names the gates (see
        :meth:`add_gate`) it waits on besides its ``deps``.

        Raises:
            GraphError: a task with this name exists.
            ConfigError: ``kind`` is not a :class:`TaskKind`, ``lane`` is not a
                non-empty string, ``work`` is not callable, or ``nbytes`` is negative.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"task name must be a non-empty string, got {name!r}")
        if name in self._tasks:
            raise GraphError(f"duplicate task name {name!r}")
        if name in self._gates:
            raise GraphError(f"duplicate name {name!r}: gates and tasks share one namespace")
        if not isinstance(kind, TaskKind):
            raise ConfigError(f"task {name!r}: kind must be a pipeoff.TaskKind, got {kind!r}")
        if lane is not None and (not isinstance(lane, str) or not lane):
            raise ConfigError(
                f"task {name!r}: lane must be a non-empty string or None (the default "
                f"lane of its kind), got {lane!r}"
            )
        if work is not None and not callable(work):
            raise ConfigError(f"task {name!r}: work must be callable or None, got {work!r}")
        if work is not None and _is_async(work):
            raise ConfigError(
                f"task {name!r}: work is an async function, but task work runs synchronously "
                "on a lane; make it a plain function (to await an RPC inside it, use "
                "anyio.from_thread.run or asyncio.run_coroutine_threadsafe). To await an "
                "execution from async code, use Execution.wait_async()")
        check_int(f"task {name!r}: nbytes", nbytes, minimum=0)
        deps_t = (deps,) if isinstance(deps, str) else tuple(deps)
        bufs_t = (buffers,) if isinstance(buffers, str) else tuple(buffers)
        gates_t = () if not gates else (gates,) if isinstance(gates, str) else tuple(gates)
        if not isinstance(must_run, bool):
            raise ConfigError(f"task {name!r}: must_run must be True or False, got {must_run!r}")
        self._tasks[name] = Task(
            name=name, kind=kind, work=work, deps=deps_t, nbytes=nbytes, buffers=bufs_t,
            lane=lane, must_run=must_run, gates=gates_t,
        )
        self._validated = False
        return name

    # -- reading ----------------------------------------------------------
    @property
    def tasks(self) -> Mapping[str, Task]:
        """The tasks by name, in the order they were added."""
        return self._tasks

    @property
    def buffers(self) -> Mapping[str, BufferSpec]:
        """The staging buffers by name, in the order they were declared."""
        return self._buffers

    @property
    def gates(self) -> tuple[str, ...]:
        """The gates' names, in the order they were declared."""
        return tuple(self._gates)

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def validate(self) -> None:
        """Check the graph.

        Raises:
            GraphError: a dependency, buffer or gate is unknown, a task depends
                on itself, a buffer or gate has no user, or the dependencies form
                a cycle (the message prints it).
        """
        if self._validated:
            return
        tasks = self._tasks
        used: set[str] = set()
        waited: set[str] = set()
        for t in tasks.values():
            for d in t.deps:
                if d not in tasks:
                    raise GraphError(f"task {t.name!r} depends on unknown task {d!r}"
                                     + (" (it is a gate: list it in gates)"
                                        if d in self._gates else ""))
                if d == t.name:
                    raise GraphError(f"task {t.name!r} depends on itself")
            for b in t.buffers:
                if b not in self._buffers:
                    raise GraphError(f"task {t.name!r} uses unknown buffer {b!r}")
                used.add(b)
            for gname in t.gates:
                if gname not in self._gates:
                    raise GraphError(f"task {t.name!r} waits on unknown gate {gname!r}"
                                     + (" (it is a task: list it in deps)"
                                        if gname in tasks else ""))
                waited.add(gname)
        for b in self._buffers:
            if b not in used:
                raise GraphError(f"buffer {b!r} is declared but no task uses it")
        for gname in self._gates:
            if gname not in waited:
                raise GraphError(f"gate {gname!r} is declared but no task waits on it")
        with no_gc():
            self._order = self._topological_order()  # raises on a cycle
        self._validated = True

    def structure_key(self) -> tuple[Any, ...]:
        """Everything about the graph but its work: two graphs with equal keys are
        validated and planned alike (:meth:`pipeoff.schedule.Schedule.plan` caches
        plans by it; a step that rebuilds the same graph plans it once)."""
        return (str(self.device),
                tuple((t.name, t.kind, t.deps, t.nbytes, t.buffers, t.lane, t.must_run, t.gates)
                      for t in self._tasks.values()),
                tuple((b.name, b.nbytes, b.where) for b in self._buffers.values()),
                tuple(self._gates))

    def adopt_validation(self, order: tuple[str, ...]) -> None:
        """Take the validation of a graph with the same :meth:`structure_key` (which
        checked exactly what :meth:`validate` would) and its topological order."""
        self._order = order
        self._validated = True

    def topological_order(self) -> tuple[str, ...]:
        """Task names in a deterministic topological order (ties: first added first)."""
        self.validate()
        return self._order

    def _topological_order(self) -> tuple[str, ...]:
        index = {name: i for i, name in enumerate(self._tasks)}
        names = list(self._tasks)
        indegree = [0] * len(names)
        children: dict[int, list[int]] = {}
        for i, t in enumerate(self._tasks.values()):
            deps = t.deps if len(t.deps) < 2 else set(t.deps)
            for d in deps:
                indegree[i] += 1
                j = index[d]
                kids = children.get(j)
                if kids is None:
                    children[j] = [i]
                else:
                    kids.append(i)
        heap = [i for i, n in enumerate(indegree) if n == 0]
        heapq.heapify(heap)
        order: list[str] = []
        while heap:
            i = heapq.heappop(heap)
            order.append(names[i])
            for c in children.get(i, ()):
                indegree[c] -= 1
                if indegree[c] == 0:
                    heapq.heappush(heap, c)
        if len(order) != len(names):
            raise GraphError(
                "dependency cycle (each task must finish before the next): "
                + " -> ".join(self._find_cycle())
            )
        return tuple(order)

    def _find_cycle(self) -> list[str]:
        color: dict[str, int] = {}
        stack: list[str] = []
        for root in self._tasks:
            if color.get(root):
                continue
            # Iterative DFS: (node, iterator over its deps).
            frames = [(root, iter(self._tasks[root].deps))]
            color[root] = 1
            stack.append(root)
            while frames:
                node, it = frames[-1]
                nxt = next(it, None)
                if nxt is None:
                    frames.pop()
                    stack.pop()
                    color[node] = 2
                elif color.get(nxt) == 1:
                    cycle = stack[stack.index(nxt) :] + [nxt]
                    return cycle[::-1]  # in execution direction
                elif not color.get(nxt):
                    color[nxt] = 1
                    stack.append(nxt)
                    frames.append((nxt, iter(self._tasks[nxt].deps)))
        raise AssertionError("no cycle found in a graph that has one")
