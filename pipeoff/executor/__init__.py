"""Executors: run a planned graph on CUDA streams, host threads, or inline."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pipeoff import _accel
from pipeoff._errors import ConfigError
from pipeoff.executor._backend import Backend
from pipeoff.executor._run import Run
from pipeoff.graph import TaskGraph
from pipeoff.recording import _recorder as recording
from pipeoff.schedule import Schedule
from pipeoff.staging import pools_for

if TYPE_CHECKING:
    from pipeoff.execution import Execution
    from pipeoff.sim._costmodel import CostModel

__all__ = ["BACKENDS", "execute", "register_backend"]

BackendName = Literal["auto", "inline", "threads", "cuda", "sim"]
BACKENDS = ("auto", "inline", "threads", "cuda", "sim")


_registered: dict[str, Callable[[Any], Backend]] = {}


def register_backend(name: str, factory: Callable[[Any], Backend]) -> None:
    """Make ``execute(..., backend=name)`` use ``factory(cost_model)`` (the simulator
    registers ``"sim"`` when :mod:`pipeoff.sim` is imported, which ``import pipeoff``
    does)."""
    _registered[name] = factory


def _backend(name: str, cost_model: CostModel | None = None) -> Backend:
    if name in _registered:
        return _registered[name](cost_model)
    if name == "sim":
        raise ConfigError("backend='sim' needs pipeoff.sim; import pipeoff (or pipeoff.sim)")
    if name == "inline":
        from pipeoff.executor.inline import InlineBackend

        return InlineBackend()
    if name == "threads":
        from pipeoff.executor.threads import ThreadsBackend

        return ThreadsBackend()
    from pipeoff.executor.cuda import CudaBackend

    return CudaBackend()


def resolve_backend(graph: TaskGraph, schedule: Schedule, backend: str) -> str:
    """The concrete backend ``backend`` names for this graph and schedule."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "sim":
        return "sim"
    accel = _accel.current()
    on_device = accel.is_device(graph.device)
    if on_device and not accel.available():
        raise ConfigError(
            f"the graph is on {graph.device}, but this torch has no usable CUDA device; "
            "build it on 'cpu' (also what backend='sim' takes)"
        )
    if backend == "cuda" and not on_device:
        raise ConfigError(
            f"backend='cuda' needs a graph on a CUDA device, but the graph's device is "
            f"{graph.device}; build it with TaskGraph(device='cuda')"
        )
    if backend == "threads" and on_device:
        raise ConfigError(
            f"backend='threads' cannot run a graph on {graph.device}: its lanes would report "
            "tasks done while their kernels still run on the device. Use backend='cuda' "
            "(or 'auto'), or 'inline' with Schedule.synchronous()"
        )
    if backend == "inline" and graph.gates:
        raise ConfigError(
            f"backend='inline' cannot run a graph with gates ({', '.join(graph.gates[:3])}"
            f"{', ...' if len(graph.gates) > 3 else ''}): it runs every task inside "
            "execute(), so nobody could open a gate on the Execution it returns. Use "
            "backend='auto' (a synchronous schedule then runs its one lane on a "
            "background thread)"
        )
    if backend != "auto":
        return backend
    if schedule.is_synchronous and not graph.gates:
        return "inline"
    return "cuda" if on_device else "threads"


def execute(
    graph: TaskGraph,
    schedule: Schedule | None = None,
    *,
    backend: BackendName = "auto",
    cost_model: CostModel | None = None,
) -> Execution:
    """Plan ``graph`` with ``schedule`` and launch it.

    Args:
        graph: the tasks to run.
        schedule: how to run them; the default is ``Schedule.pipelined()``.
        backend: ``"auto"`` picks ``"inline"`` for a synchronous schedule
            (unless the graph has gates), ``"cuda"`` for a graph on a CUDA
            device, else ``"threads"``. Under ``"sim"`` every gate is open at
            launch.
            ``"sim"`` never runs the work: it times the plan against
            ``cost_model`` and returns a finished execution whose trace
            holds the predicted times.
        cost_model: the :class:`pipeoff.sim.CostModel` for ``backend="sim"``
            (default: ``CostModel.h200_pcie5()``); refused for other backends.

    Returns:
        The :class:`Execution`. On ``threads`` and ``cuda`` it returns before
        the work is done; call :meth:`Execution.wait`.

    Raises:
        GraphError: the graph is malformed.
        BudgetError: the schedule's budgets cannot be met.
        ConfigError: ``schedule`` or ``backend`` is invalid.
    """
    if schedule is None:
        schedule = Schedule.pipelined()
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule must be a pipeoff.Schedule, got {schedule!r}")
    if not isinstance(graph, TaskGraph):
        raise ConfigError(f"graph must be a pipeoff.TaskGraph, got {graph!r}")
    from pipeoff.execution import Execution

    name = resolve_backend(graph, schedule, backend)
    if cost_model is not None and name != "sim":
        raise ConfigError(f"cost_model is only for backend='sim', not {name!r}")
    plan = schedule.plan(graph)
    impl = _backend(name, cost_model)
    run = Run(graph, plan, pools_for(graph.device), impl.name)
    execution = Execution(run, impl)
    if recording.active():
        recording.on_execution(execution)
    impl.launch(run)
    return execution
