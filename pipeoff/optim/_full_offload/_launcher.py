"""Full offload's executions: each micro-step's graph built and launched, in order.

The :class:`Launcher` is the lifecycle's part that talks to the runtime: it builds
a micro-step's graph (``_graph.py``) over the lane work (``_lanes.py``), launches
it, orders it after the previous execution (the ``prev`` gate), lets the norm's
all-reduce go and fails the gates of an abandoned one. It holds one fact, the
latest execution; the accumulation's records are the lifecycle's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipeoff import _faults
from pipeoff._errors import GradientError
from pipeoff.execution import Execution
from pipeoff.executor import execute
from pipeoff.graph import TaskGraph
from pipeoff.optim._full_offload import _one_pass
from pipeoff.optim._full_offload._common import Accumulation, MicroStep
from pipeoff.optim._full_offload._config import FullOffloadConfig
from pipeoff.optim._full_offload._graph import (
    DONE,
    NORM_ALLREDUCE,
    PATH,
    PREV,
    REDUCE,
    STEP,
    grad_gate,
)
from pipeoff.optim._full_offload._lanes import LaneWork
from pipeoff.optim._full_offload._param import ParamRegistry
from pipeoff.schedule import Schedule

__all__ = ["Launcher"]


class Launcher:
    """Builds and launches the executions of one optimizer's micro-steps.

    Args:
        registry: the parameters.
        config: the optimizer's configuration.
        param_groups: the optimizer's live ``param_groups`` (a final micro-step's plan).
    """

    def __init__(self, registry: ParamRegistry, config: FullOffloadConfig,
                 param_groups: Callable[[], list[dict[str, Any]]]) -> None:
        self.registry = registry
        self.config = config
        self.param_groups = param_groups
        self.prev: Execution | None = None
        """The latest execution that writes accumulators or masters: the next
        micro-step's accumulations wait for it (its ``prev`` gate)."""
        self.held = _one_pass.HeldGrads()
        """The buffer a final backward's gradients wait in for a one-pass step."""

    def graph(self, *, final: bool, grad_itemsize: Mapping[int, int] | None = None,
              lanes: LaneWork | None = None,
              acc: Accumulation | None = None) -> tuple[TaskGraph, Schedule]:
        """The graph and schedule of a micro-step (shape-only without ``lanes``)."""
        config = self.config
        plan = self.registry.plan if lanes is None else lanes.plan
        work = None
        if lanes is not None:
            assert acc is not None
            work = lanes.bind(acc.results, final=final, hyper=acc.hyper)
        groups = self.registry.norm_groups if lanes is None else lanes.norm_groups
        held = lanes.held if lanes is not None else None
        graph = plan.graph(self.registry.device, final=final,
                           norm_first=config.overlap != "backward",
                           allreduce=any(groups), step_gate=config.overlap != "backward",
                           grad_itemsize=grad_itemsize,
                           held=frozenset(held.views) if held else frozenset(), work=work)
        return graph, plan.schedule(config.overlap)

    def launch(self, acc: Accumulation, *, final: bool,
               known: bool = False) -> tuple[Execution, LaneWork]:
        """Launch a micro-step's execution (its lane work bound to ``acc``'s results),
        after the previous; returns it and its lane work (the micro-step's to hold).
        A final one (``known``: final when its backward began) may hold its gradients
        for a one-pass step (``_one_pass.plan``)."""
        itemsize = None
        if final and self.config.accumulate == "gpu":
            itemsize = {i: 4 for i in acc.device_sums}
        views = None
        if final:
            held, path = _one_pass.plan(self.config, self.registry.params, self.param_groups(),
                                        self.registry.norm_groups, known=known)
            acc.path = path  # (None: chosen at the first read of the sums, or step())
            if held:
                views = self.held.views(self.registry.params, held, self.registry.pin)
        lanes = LaneWork(self.registry, self.config, views)
        graph, schedule = self.graph(final=final, grad_itemsize=itemsize, lanes=lanes, acc=acc)
        ex = execute(graph, schedule)
        prev = self.prev
        ours = [ms.execution for ms in acc.micro if ms.execution is not None]
        failed = next((e.exception for e in ours if e.done() and e.exception is not None), None)
        try:
            if views is not None:
                self.held.order_after_reader(ex)
            if failed is not None:
                # Hazard: sums an earlier micro-step of this step failed to add to,
                # folded into and (under overlap="backward") stepped: a tester's find,
                # the step taken on the later micro-steps' gradients alone.
                ex.gate(PREV).fail(GradientError(
                    f"an earlier micro-step of this step failed ({failed!r})"))
            elif prev is None or prev.done() or _faults.disabled("micro_step_order"):
                ex.gate(PREV).close()
            else:
                # Hazard: folding into accumulators (or stepping masters) that the
                # previous micro-step's execution, or a step still in flight, is
                # still reading or writing. (If it fails, its 'done' is cancelled
                # and so fail the tasks that wait for this gate.)
                ex.gate(PREV).open(None, event=prev.events_for(DONE)[0])
        except BaseException as err:
            # The previous execution failed meanwhile: this one must not wait on
            # gates nobody will open.
            for name in graph.gates:
                if ex.gate(name).state == "pending":
                    ex.gate(name).fail(err)
            raise
        self.prev = ex
        return ex, lanes

    def reduce_norm(self, acc: Accumulation) -> None:
        """Let the final execution all-reduce the norm (its gate ``reduce``): called on
        the caller's thread, which then waits for it."""
        # Hazard: the lane's all-reduce of the norm and the caller's own
        # collectives (a loss all-reduce, FSDP2's all-gathers) issued on one
        # process group from two threads, in an order that may differ between
        # ranks: the caller opens it, then waits for it before going on.
        fin = acc.final
        if fin is None or fin.execution is None or (
                NORM_ALLREDUCE not in fin.execution.plan.order):
            return
        gate = fin.execution.gate(REDUCE)
        if gate.state == "pending":
            gate.open(None)

    def fail_pending(self, ms: MicroStep, err: BaseException) -> None:
        """Fail what of ``ms``'s execution still waits for a gate (a backward that never
        ended, a step that will not come), so that its lanes do not wait for the
        timeout."""
        ex = ms.execution
        if ex is None or ex.done():
            return
        names = [grad_gate(rec.name) for rec in self.registry]
        if ms.final and self.config.overlap != "backward":
            names.append(STEP)
        if ms.final and ms.lanes is not None and ms.lanes.held is not None:
            names.append(PATH)
        if ms.final and NORM_ALLREDUCE in ex.plan.order:
            names.append(REDUCE)
        for name in names:
            gate = ex.gate(name)
            if gate.state == "pending":
                gate.fail(err)
