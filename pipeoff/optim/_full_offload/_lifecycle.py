"""Full offload's lifecycle: one owner for an accumulation, from its first gradient
through the step in flight to its end, one execution per backward. The phases, the
transition table and the records are in ``_common.py``. The :class:`Lifecycle` holds
the accumulation in progress (``IDLE`` without one) and the step in flight
(``STEPPING`` until ``wait_for_step()``); every ``.phase`` change is made here
(``Accumulation.move``). Its state is written on the thread running the backward's hooks
(the caller's on CPU; autograd's device thread on CUDA) and on the caller's between
backwards; lanes write only what ``[Note: lane writes]`` in ``_lanes.py`` lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _compat, _faults
from pipeoff._contract import Health
from pipeoff._errors import ConfigError, GradientError
from pipeoff._lowlevel import is_failure_of, report_unraised_at_exit, settle
from pipeoff.execution import Execution
from pipeoff.optim._full_offload import _one_pass
from pipeoff.optim._full_offload._common import (
    CLIPPED_TWICE,
    Accumulation,
    MicroStep,
    Phase,
    Shipped,
    after_final_message,
    backward_mark,
    capture_hyper,
    checked_gradient,
    classify,
    root_cause,
    twice_message,
    unfinished_before,
    unmarked_is_final,
    writes_to,
)
from pipeoff.optim._full_offload._config import FullOffloadConfig
from pipeoff.optim._full_offload._grads import LoopGrads, is_placeholder
from pipeoff.optim._full_offload._graph import NORM, STEP
from pipeoff.optim._full_offload._lanes import LaneResults, gate_name
from pipeoff.optim._full_offload._launcher import Launcher
from pipeoff.optim._full_offload._param import ParamRegistry

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._one_pass import HostStepPath
    from pipeoff.optim._readers import Readers

__all__ = ["Lifecycle"]


class Lifecycle:
    """One owner for the accumulation and the step in flight: one execution per
    backward, the end of each backward, and every transition (``Accumulation.move``).

    Args:
        registry: the parameters.
        config: the optimizer's configuration.
        health: what failed steps left (shared with the optimizer).
        readers: transfers reading the host state: a final micro-step waits for them.
        param_groups: the optimizer's live ``param_groups`` (read for hyperparameters).
    """

    def __init__(self, registry: ParamRegistry, config: FullOffloadConfig, health: Health,
                 readers: Readers, param_groups: Callable[[], list[dict[str, Any]]]) -> None:
        self.registry = registry
        self.config = config
        self.health = health
        self.readers = readers
        self.param_groups = param_groups
        # hook state: the thread running the backward's hooks, or the caller's
        self.acc: Accumulation | None = None
        """The accumulation in progress (``None``: ``IDLE``)."""
        self.micro: MicroStep | None = None
        """The micro-step whose backward is running (or whose end is deferred)."""
        self.inflight: Accumulation | None = None
        """The step in flight (``STEPPING``): from ``step()`` until :meth:`wait_step`."""
        report_unraised_at_exit(self, lambda lc: lc.inflight and lc.inflight.execution,
                                "FullOffloadOptimizer")
        self.ended: Accumulation | None = None
        """The step that ended, until the optimizer takes its traces (whoever waited)."""
        self.last_norm: torch.Tensor | None = None
        """The total gradient norm of the last step waited for."""
        self.grads = LoopGrads(self, config.overlap)
        """The placeholders the loop sees in ``param.grad`` (the host sums, see
        ``_grads.py``): in from the end of each backward, out at the next forward."""
        self.ddp: Any = None if registry.model is None else _compat.data_parallel(registry.model)
        """The ``DistributedDataParallel`` around the model, or ``None``. Under one, the
        gradients stay in ``param.grad`` (the wrapper reduces and accumulates them
        there) and a final micro-step takes them at the end of its backward."""
        self.launcher = Launcher(registry, config, param_groups)
        """Builds and launches each micro-step's execution (and orders them)."""
        self.last_path: HostStepPath | None = None  # the last step's (host_step_status)
        self.device_part = False
        """A device part steps at ``step()`` (``_fraction.py``): a failed copy after every
        host chunk stepped is then a torn step, not a stale one (``classify``)."""

    @property
    def phase(self) -> Phase:
        """The accumulation's phase (``IDLE`` without one; the step's: :attr:`inflight`)."""
        return Phase.IDLE if self.acc is None else self.acc.phase

    def use_wrapper(self, ddp: Any) -> None:
        """A ``DistributedDataParallel`` around the model (``None``: none found).

        Raises:
            GradientError: it was put around the model mid-accumulation.
        """
        if ddp is None:
            return
        if self.acc is not None:
            raise GradientError(
                "the model was wrapped in DistributedDataParallel in the middle of "
                "gradient accumulation: wrap it before the first backward, or "
                "after step()")
        self.ddp = ddp

    # -- gradients in ----------------------------------------------------------------------
    def receive(self, i: int, payload: torch.Tensor, *, marked: Callable[[], bool]) -> None:
        """The gradient of parameter ``i`` (admitted by the intake; flat, in its memory
        order), during a backward: into its micro-step (launched by the first one;
        ``marked`` says whether this backward is marked non-final)."""
        rec = self.registry[i]
        ms = self.micro
        if ms is not None and ms.deferred is not None:
            if _compat.outermost_backward_frame() is ms.deferred:
                # Still the backward whose inner (reentrant) part ended: end the
                # micro-step when this, its outer graph task, ends.
                ms.deferred = None
                outer = ms
                _compat.queue_backward_callback(lambda: self.end_backward(outer))
            else:
                self.end_backward(ms, force=True)  # that backward is over
                ms = self.micro
        # A backward inside a backward (a reentrant checkpoint's recomputation)
        # has a graph task of its own; its gradients belong to the outer one.
        if ms is None or ms.ended:
            ms = self._begin(marked())
        if i in ms.received or unfinished_before(ms.began_in):
            twice = GradientError(twice_message(rec.name, ms.began_in))
            self.fail_current(twice)
            raise twice
        ms.received.add(i)
        rec.param.grad = None
        acc = self.acc
        assert acc is not None
        acc.touched.add(i)
        if self.config.accumulate == "gpu":
            sums = acc.device_sums
            if not ms.final:
                s = sums.get(i)
                if s is None:
                    sums[i] = payload.to(torch.float32, copy=True)  # the first: a copy
                else:
                    s.add_(payload)
                return
            s = sums.pop(i, None)
            if s is not None:
                s.add_(payload)
                payload = s
        assert ms.execution is not None
        ms.execution.gate(gate_name(rec)).open(Shipped(payload))

    def _before_final(self, acc: Accumulation) -> None:
        """What a final micro-step needs before its launch: the transfers reading the
        host state done, and under ``overlap="backward"`` the hyperparameters."""
        # Hazard: the final micro-step's graph steps the masters and moments (under
        # overlap="backward" during this backward) while a transfer still reads them.
        self.readers.wait()
        if self.config.overlap == "backward":
            acc.hyper = capture_hyper(self.param_groups())

    def receive_reduced_later(self, i: int, *, marked: Callable[[], bool]) -> None:
        """Under DDP: parameter ``i`` has a gradient in this backward, which the wrapper
        reduces into ``param.grad``; the end of the backward takes it."""
        ms = self.micro
        if ms is None or ms.ended:
            ms = self._begin(marked())
        ms.received.add(i)

    def _begin(self, marked: bool) -> MicroStep:
        """The first gradient of a backward: launch its execution."""
        acc = self.acc
        if acc is None:
            acc = self.acc = Accumulation(results=LaneResults.for_params(len(self.registry)))
        steps = self.config.gradient_accumulation_steps
        final = not marked and unmarked_is_final(self.config.overlap, steps, acc)
        if acc.final is not None:
            err = GradientError(after_final_message(self.config.overlap, steps, acc.final))
            self.health.dirty = err
            raise err
        ms = MicroStep(final=final, began_in=backward_mark())
        if final:
            self._before_final(acc)
        if final or (self.config.accumulate == "cpu" and self.ddp is None):
            ms.execution, ms.lanes = self.launcher.launch(acc, final=ms.final, known=True)
        acc.marked = acc.marked or marked
        # Launched: now the accumulation holds it (an interrupt above leaves it as it was).
        if final:
            acc.final = ms
            acc.move(Phase.FINAL)
        acc.micro.append(ms)
        self.micro = ms
        _compat.queue_backward_callback(lambda: self.end_backward(ms))
        return ms

    # -- the end of a backward ---------------------------------------------------------------
    def end_backward(self, ms: MicroStep, *, force: bool = False) -> None:
        """Autograd's end-of-backward callback: settle the gates no gradient opened.

        Under a reentrant checkpoint the first gradient may come from the backward
        its recomputation runs *inside* the user's backward: the callback then
        fires when that inner backward ends. The micro-step goes on until the
        outer one ends (:meth:`receive` queues a callback there, or the next
        ``step()``, ``zero_grad()`` or backward settles it).
        """
        if ms.ended:
            return
        if not force:
            outer = _compat.outer_backward_frame()
            if outer is not None:
                ms.deferred = outer
                return
        ms.deferred = None
        if self.micro is ms:
            self.micro = None
        ms.ended, ms.began_in = True, None
        ex = ms.execution
        if ex is None:
            self._show()
            return
        if (self.ddp is not None and ms.final and _compat.backward_id() >= 0
                and not _faults.disabled("ddp_reduced")):
            # Hazard: taking param.grad before DDP's reducer has written the
            # reduced gradient into it: its finalize callback, queued during this
            # backward after ours, runs after this one; a callback queued now
            # runs after it.
            def take() -> None:
                self.take_gradients(ms)
                self._show()

            _compat.queue_backward_callback(take)
        else:
            self.take_gradients(ms)
            self._show()

    def _show(self) -> None:
        """The backward ended: the loop sees the host sums in ``param.grad``."""
        if self.acc is not None:
            self.grads.install(self.acc, self.registry.params)

    def take_gradients(self, ms: MicroStep) -> None:
        """Settle every gradient gate this backward's hooks did not open: a final
        micro-step takes what ``param.grad`` holds (a wrapper's reduced gradient, one
        set by hand) and the device sums of non-final ones; other gates close."""
        ex = ms.execution
        assert ex is not None
        acc = self.acc
        for i, rec in enumerate(self.registry):
            if i in ms.received and self.ddp is None:
                continue
            gate = ex.gate(gate_name(rec))
            s = acc.device_sums.pop(i, None) if (acc is not None and ms.final) else None
            g = rec.param.grad if ms.final else None
            if is_placeholder(g):
                g = None  # it stands for the host sum: nothing new
            if g is not None:
                try:
                    payload = checked_gradient(rec, g)
                except GradientError as err:
                    self.health.dirty = err
                    self.abandon(ms, str(err), err)
                    raise
                rec.param.grad = None
                if acc is not None:
                    acc.touched.add(i)
                if s is not None:
                    s.add_(payload)
                    payload = s
                gate.open(Shipped(payload))
            elif s is not None:
                gate.open(Shipped(s))  # only non-final micro-steps had a gradient for it
            else:
                gate.close()

    def settle_deferred(self) -> None:
        """End a micro-step whose reentrant inner backward ended, once no backward runs."""
        ms = self.micro
        if ms is not None and ms.deferred is not None and _compat.backward_id() < 0:
            self.end_backward(ms, force=True)

    # -- failures --------------------------------------------------------------------------
    def fail_current(self, err: BaseException) -> None:
        """A gradient was refused: this step is lost (dirty) and its backward abandoned."""
        ms = self.micro
        self.health.dirty = err
        if ms is not None:
            self.abandon(ms, str(err), err)

    def abandon(self, ms: MicroStep, why: str, err: BaseException | None = None) -> None:
        """Fail what of a micro-step's execution still waits for a gate (a backward that
        never ended, a step that will not come)."""
        ms.ended, ms.began_in = True, None
        if self.micro is ms:
            self.micro = None
        if err is None:
            err = GradientError(f"a micro-step was abandoned: {why}")
            self.health.dirty = self.health.dirty or err
        self.launcher.fail_pending(ms, err)

    def close_open_backward(self, why: str) -> None:
        """``step()`` during a backward (or with its end missed): abandon it and wait
        for what of its execution runs."""
        self.settle_deferred()
        ms = self.micro
        if ms is not None:
            self.abandon(ms, why)
            if ms.execution is not None:
                settle(ms.execution, timeout=self.config.timeout)  # failed by abandon()

    def settle_failure(self) -> Execution | None:
        """A micro-step of the accumulation failed: let every execution settle, and say
        what the failure left (a final micro-step may have stepped chunks). Returns the
        final execution once it settled.

        Raises:
            KeyboardInterrupt: while waiting (the accumulation stays as it was).
        """
        acc = self.acc
        assert acc is not None
        settled = None
        for ms in acc.micro:
            ex = ms.execution
            if ex is None:
                continue
            self.abandon(ms, "an earlier failure of this step",
                         GradientError("an earlier failure of this step"))
            settle(ex, timeout=self.config.timeout)  # its failure is classified below
            if ex.exception is not None:
                self.health.dirty = self.health.dirty or ex.exception
            if ms.final and ex.done():
                cause = ex.exception or self.health.dirty
                assert cause is not None
                classify(self.health, acc, cause, device_part=self.device_part)
                settled = ex
        return settled

    def settle_final_backward(self) -> Execution | None:
        """Under ``overlap="backward"``, wait for the chunks a final backward started
        before ``step()``; if they failed, drop the accumulation (classified) and
        return the execution."""
        acc = self.acc
        fin = acc.final if acc is not None else None
        if acc is None or fin is None or fin.execution is None or self.config.overlap != "backward":
            return None
        ex = fin.execution
        self.settle_deferred()
        if not fin.ended:
            return None  # inside that backward: nothing more can be waited for here
        self.launcher.reduce_norm(acc)
        settle(ex, timeout=self.config.timeout)  # its failure is classified below
        if ex.exception is None:
            return None
        self.acc = None
        acc.move(Phase.DISCARDED)
        classify(self.health, acc, root_cause(acc, ex.exception),
                 device_part=self.device_part)
        return ex

    # -- transitions step() and zero_grad() drive ---------------------------------------------
    def begin_from_params(self) -> bool:
        """``step()`` with no gradient from a backward: gradients set by hand in
        ``param.grad`` (as ``torch.distributed.checkpoint`` does to create state) are
        this step's. Returns whether there were any."""
        if not any(rec.param.grad is not None for rec in self.registry):
            return False
        self.acc = Accumulation(results=LaneResults.for_params(len(self.registry)))
        return True

    def finalize(self) -> Accumulation | None:
        """End the accumulation (no backward may follow before ``step()``), launching a final
        micro-step of no gradient of its own if no backward was the final one; ``None``
        without one (or, under ``overlap="backward"``, no final backward: it would step)."""
        acc = self.acc
        if acc is None:
            return None
        self.settle_deferred()
        if acc.final is None and (self.micro is not None or self.config.overlap == "backward"):
            return None
        if acc.final is None or self.grads.edited():
            # Hazard: a gradient dropped or replaced (p.grad = None, = t) before this
            # read (the loop's clip, grad_norm): the final micro-step took the replacement
            # as one more gradient and showed the dropped sum again, or (a known-final
            # backward's) the norm missed the edit. Edits reach the sums first.
            self.grads.withdraw(stepping=False, keep=True)
            acc = self.acc
            if acc is None:
                return None  # every gradient was dropped: nothing is left to end
            if acc.final is not None:
                self._show()  # (withdrawn: the loop sees the sums again)
        if acc.final is None:
            self._launch_final(acc)
        return acc

    def _launch_final(self, acc: Accumulation) -> None:
        """A final micro-step with no backward: its gradients are the sums so far, and
        what ``param.grad`` holds."""
        ms = MicroStep(final=True, backward=False)
        self._before_final(acc)
        ms.execution, ms.lanes = self.launcher.launch(acc, final=ms.final)
        acc.final = ms
        acc.move(Phase.FINAL)
        acc.micro.append(ms)
        self.end_backward(ms)

    def current_norm(self, why: str = "grad_norm was read") -> torch.Tensor | None:
        """The norm of the accumulation in progress, which it ends (:meth:`finalize`), or
        ``None``. Waits for the norm, not for the step (``why``: see ``_one_pass.fold``)."""
        had, acc = self.acc is not None, self.finalize()
        if acc is None:  # (every gradient dropped: 0, as torch's clip_grad_norm_ says)
            return torch.zeros(()) if had and self.acc is None else None
        _one_pass.fold(acc, why)
        self.launcher.reduce_norm(acc)
        norm = acc.wait_norm(self.config.timeout)
        self.grads.restore_kept()  # (after the folds: the sums hold what it replaced)
        return norm

    def prepare_hand_over(self) -> None:
        """``step()``'s waits before :meth:`hand_over` (a Ctrl-C may cut them): a final
        micro-step of no gradient of its own launched if none was; the masters' readers."""
        acc = self.acc
        assert acc is not None and self.inflight is None
        if acc.final is None:
            self._launch_final(acc)
        elif self.config.overlap != "backward":
            # Hazard: the chunks stepping the masters while a transfer launched after the
            # final backward began (its execution waits for this gate) still reads them.
            self.readers.wait()

    def hand_over(self, hyper: list[dict[str, Any]] | None,
                  edits: Mapping[int, tuple[Any, ...]] | None = None) -> Accumulation:
        """``step()``, after :meth:`prepare_hand_over`, waiting for nothing: the step in
        flight (:attr:`inflight`); under ``overlap="forward"`` or ``"none"`` its chunks may
        start (``hyper``, the clipping norm, the loop's ``edits`` of each gradient first)."""
        acc = self.acc
        assert acc is not None and acc.final is not None and self.inflight is None
        # The clipping norm: clip_grad_norm_()'s, else the optimizer's max_norm.
        max_norm = self.config.max_norm if acc.max_norm is None else acc.max_norm
        self.launcher.reduce_norm(acc)
        if self.config.overlap != "backward":
            _one_pass.one_pass(acc)  # (unless a read of the sums chose the fold)
            acc.execution.gate(STEP).open((hyper, max_norm, dict(edits or {})))
        self.last_path = acc.path
        acc.move(Phase.STEPPING)
        self.acc = None
        self.inflight = acc
        self.grads.clear()  # step() consumes the gradients
        return acc

    def discard(self, why: str, *, classify_final: bool) -> None:
        """Drop the accumulation: fail what of its executions waits for a gate, and wait
        for them; with ``classify_final``, say what a final one that stepped chunks
        before it failed left (a torn step, which this does not clear).

        Raises:
            KeyboardInterrupt: while waiting (the accumulation stays, to discard again).
        """
        acc = self.acc
        self.grads.clear()
        if acc is not None:
            for ms in acc.micro:
                ex = ms.execution
                if ex is None:
                    continue
                # Discarded: a gate left pending (the step's, or a backward that
                # never ended) would hold its lanes until the timeout.
                self.abandon(ms, why, GradientError(why))
                settle(ex, timeout=self.config.timeout)  # failed by abandon()
                cause = ex.exception or self.health.dirty
                if classify_final and ms.final and ex.done() and cause is not None:
                    # Chunks that stepped before the failure make a torn step.
                    classify(self.health, acc, cause, device_part=self.device_part)
            acc.move(Phase.DISCARDED)
        self.acc = None
        self.micro = None
        self.health.dirty = None

    def edit_sums(self, replaced: Mapping[int, torch.Tensor], dropped: Sequence[int]) -> None:
        """The loop put a gradient in ``param.grad`` by hand (``replaced``: flat, in memory
        order) or set it to ``None`` (``dropped``) after a backward: the host sums (under
        ``accumulate="gpu"`` before the final micro-step, the device sums) say so now."""
        acc = self.acc
        assert acc is not None
        if self.config.accumulate == "gpu" and acc.final is None:
            acc.edit_device_sums(replaced, dropped)
            return
        # Hazard: writing a host sum (and its count) that a fold of this
        # accumulation's executions is still writing on the accumulate lane.
        for ms in acc.micro if not _faults.disabled("grad_edit_wait") else ():
            if ms.execution is None:
                continue
            if ms.final:
                _one_pass.fold(acc, "a gradient was set by hand or dropped")
                # Its folds and each gradient's norm (its chunks wait for step()); not the
                # all-reduce of the norms, which is to take the edits (renorm, below).
                ms.execution.wait(NORM, timeout=self.config.timeout)
            else:
                settle(ms.execution, timeout=self.config.timeout)
        for i, t in replaced.items():
            rec = self.registry[i]
            with torch.no_grad():
                rec.flat_acc.copy_(t)  # widening: exact
            acc.results.counts[i] = 1
            acc.touched.add(i)
        for i in dropped:
            acc.results.counts[i] = 0  # (a later micro-step's gradient starts the sum again)
            acc.touched.discard(i)
        if acc.final is not None and acc.final.lanes is not None:
            # (Else grad_norm was the known-final backward's, before the edits.)
            acc.final.lanes.renorm(acc.results, [*replaced, *dropped])

    # -- the step in flight --------------------------------------------------------------------
    def set_clip(self, max_norm: float, *, unbounded: bool) -> torch.Tensor | None:
        """``clip_grad_norm_()``: end the accumulation and clip its step to ``max_norm``
        (``unbounded``: only the norm). The norm, or ``None``; ConfigError if called twice."""
        if self.acc is None:
            return None
        norm = self.current_norm("clip_grad_norm_() was called")
        acc = self.acc
        if norm is None or acc is None:
            return norm
        if acc.max_norm is not None:
            raise ConfigError(CLIPPED_TWICE)
        if not (unbounded and self.config.overlap == "backward"):
            acc.max_norm = float(max_norm)  # (inf: scaled by 1.0, as torch does)
        return norm

    def norm(self) -> torch.Tensor | None:
        """The total gradient norm: of the accumulation in progress (which reading it
        ends), else of the step in flight (waited for), else of the last step."""
        if self.acc is not None:
            return self.current_norm()
        if self.inflight is not None:
            return self.inflight.wait_norm(self.config.timeout)
        return self.last_norm

    def wait_step(self) -> list[str]:
        """Wait for the step in flight and end it (``DONE``, also when it failed).
        Returns the names of weights its copy overwrote after something else wrote
        them during the final backward (``overlap="backward"``).

        Raises:
            BaseException: the step's failure (its earliest micro-step's), classified on
                :attr:`health`; KeyboardInterrupt while waiting: the step is in flight.
        """
        acc = self.inflight
        if acc is None:
            return []
        ex = acc.execution
        try:
            ex.wait(timeout=self.config.timeout)
        except BaseException as err:
            if not is_failure_of(err, ex):
                raise  # interrupted or timed out: still in flight
            self._end_step(acc)
            classify(self.health, acc, err, device_part=self.device_part)
            root = root_cause(acc, err)
            if root is not err:
                raise root from err
            raise
        self._end_step(acc)
        self.last_norm = acc.results.total_norm
        acc.device_sums.clear()
        fin = acc.final
        names: list[str] = []
        if (over := acc.results.overwritten) and fin is not None and fin.lanes is not None:
            names = [fin.lanes.params[i].name for i in sorted(over)]
        return names

    def _end_step(self, acc: Accumulation) -> None:
        self.inflight = None
        self.ended = acc
        acc.move(Phase.DONE)

    def take_ended(self) -> Accumulation | None:
        acc, self.ended = self.ended, None  # (once)
        return acc

    def writes_to(self, param: torch.Tensor) -> tuple[Execution | None, list[str]]:
        """The execution that writes ``param``'s master, moments and weight, and its
        tasks that do: the step in flight's, or under ``overlap="backward"`` the final
        backward's (its chunks step before ``step()``). Raises ConfigError: ``param`` is
        not one of the optimizer's parameters."""
        acc = self.inflight
        if acc is None and self.config.overlap == "backward" and self.phase is Phase.FINAL:
            acc = self.acc
        return writes_to(acc, self.registry, param)
