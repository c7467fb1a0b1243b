"""Full offload with a device part: the lifecycle of a step whose parameters are split
between the host part (the pipeline) and the device part (``_device_part.py``).

[Note: the two parts of a full-offload step]

With ``offload_fraction < 1`` a step has two parts that touch disjoint parameters,
gradients, masters and state, so nothing orders one after the other; what needs
ordering is the norm they share, and their readers:

* the gradients: a device-part parameter's gradient is folded into its FP32 sum as
  autograd finalizes it (the optimizer's own hook, as the host part's), and at the
  end of each backward the loop sees that sum in ``param.grad`` through a
  placeholder, as it sees the host part's (``_grads.py``): its clip call's norm is
  over both parts, its coefficient and ``p.grad = None`` reach the device sums;
* the norm: ``step()`` waits for the host part's gradient norm (the folds of the
  final backward, the ``norm`` task), then takes the total over both parts in
  param-group order, as ``clip_grad_norm_(foreach=False)`` over every gradient
  would, once per step (before the loop's edits, as the host part's norms are
  taken); the host part's chunks (after the ``step`` gate, opened next) and the
  device part clip with that one coefficient;
* the host part's chunks are launched first (the ``step`` gate), then the device part
  steps with torch's kernel on the caller's thread and stream, so both run at once;
* the host part's readers wait for its chunks, as without a device part (the
  forward's hooks, ``wait_for_step()``); the device part's readers on the caller's
  stream (the next forward) are ordered by the stream, and a reader off it waits
  for the event recorded after the device part's kernels: ``wait_for_step()``
  synchronizes it (switch ``"full_device_part_wait"``);
* a failure of either part is reported once both have finished: a device part that
  raised waits for the host part first (switch ``"full_host_part_join"``), and a host
  part that failed after the device part stepped leaves the step torn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _compat, _faults
from pipeoff._errors import ConfigError, GradientError
from pipeoff._lowlevel import settle
from pipeoff.execution import Execution
from pipeoff.optim._full_offload._common import (
    Accumulation,
    after_final_message,
    backward_mark,
    capture_hyper,
    twice_message,
    unfinished_before,
)
from pipeoff.optim._full_offload._device_part import DeviceParam, FullDevicePart
from pipeoff.optim._full_offload._graph import step_task
from pipeoff.optim._full_offload._lanes import LaneResults
from pipeoff.optim._full_offload._lifecycle import Lifecycle

if TYPE_CHECKING:
    from pipeoff._contract import Health
    from pipeoff.optim._full_offload._config import FullOffloadConfig
    from pipeoff.optim._full_offload._param import ParamRegistry
    from pipeoff.optim._readers import Readers

__all__ = ["FractionLifecycle", "NO_DDP"]

NO_DDP = ("offload_fraction < 1 (a device part) is not available under "
          "DistributedDataParallel yet: use offload_fraction=1.0")


class FractionLifecycle(Lifecycle):
    """The lifecycle of a full-offload optimizer, with its device part (see the Note).
    Without device-part parameters every method is :class:`Lifecycle`'s.

    Args:
        part: the device part.
        (the rest): :class:`Lifecycle`'s.
    """

    def __init__(self, registry: ParamRegistry, config: FullOffloadConfig, health: Health,
                 readers: Readers, param_groups: Callable[[], list[dict[str, Any]]], *,
                 part: FullDevicePart) -> None:
        super().__init__(registry, config, health, readers, param_groups)
        self.part = part
        part.groups = param_groups
        self._shown_in = -1
        """The backward whose end shows the device part's sums (its id)."""
        self._both: tuple[Accumulation | None, torch.Tensor | None] = (None, None)
        """The accumulation whose total norm over both parts was taken, and that norm."""
        self._received: tuple[tuple[int, Any] | None, set[int]] = (None, set())
        """The backward running (``backward_mark()``) and the device-part
        parameters it gave a gradient (a second one is refused, as the host part's)."""
        self._open = False
        """A backward gave device-part gradients and has not ended since (its end
        callback never ran: it raised, or a Ctrl-C stopped it): its gradients are
        partial. (A reentrant checkpoint's inner backward ends it too: a backward
        stopped after one, before another device gradient, is not seen here.)"""

    def split(self, probe: torch.optim.Optimizer) -> None:
        """Decide the device part over the groups the optimizer was built with (before the
        registry first indexes them).

        Raises:
            ConfigError: naming ``offload_fraction``: a ``DistributedDataParallel``
                around the model.
        """
        on = self.part.split(self.param_groups(), probe, self.registry.names)
        self.registry.on_device = on
        # Hazard: half a step taken as a whole one. Under overlap="backward" the host
        # part's chunks step during the final backward, the device part at step(),
        # which raised first: said stale, refresh_device_weights() and the loop trained
        # on from the mix (a tester's find, 3.7e-2 off). A failed copy after every host
        # chunk stepped is torn wherever it is classified (the error then said stale
        # and torn: a tester's find).
        self.device_part = bool(self.part.params)
        if on and self.ddp is not None:
            raise ConfigError(NO_DDP)

    def use_wrapper(self, ddp: Any) -> None:
        if ddp is not None and self.part.params:
            raise ConfigError(NO_DDP)
        super().use_wrapper(ddp)

    def all_tensors(self) -> list[torch.Tensor]:
        """The parameters of both parts (the host part's first)."""
        return [*self.registry.tensors(), *self.part.tensors()]

    # -- gradients in ------------------------------------------------------------------------
    def receive_device(self, rec: DeviceParam, *,
                       marked: Callable[[], bool] | None = None) -> None:
        """A device-part parameter's gradient, during a backward (admitted by the intake):
        into its sum; the end of the backward shows the sums in ``param.grad``.
        ``marked``: whether this backward is marked non-final.

        Raises:
            GradientError: the accumulation was ended (a read of the gradients, the
                norm) before this backward.
        """
        acc = self.acc
        if self.health.dirty is not None or self.health.torn is not None:
            rec.param.grad = None  # dropped: step() refuses until zero_grad()
            return
        steps = self.config.gradient_accumulation_steps
        if acc is not None and acc.final is not None and self.micro is not acc.final:
            err = GradientError(after_final_message(self.config.overlap, steps, acc.final))
            self.health.dirty = err
            raise err
        if marked is not None and (self.micro is None or self.micro.ended):
            non_final = marked()
            if (steps is not None or non_final or (acc is not None and acc.marked)
                    or self.config.overlap == "backward"):
                # Where backwards are counted or marked (or each is final, under
                # overlap="backward"), one whose first gradient is the device part's
                # begins the host part's micro-step, as a host gradient would: the count,
                # the final one's hyperparameters and the refusal of one more, the
                # sums' reads (at offload_fraction=0 too, where no host gradient ever
                # comes: a tester found the count unenforced there).
                self._begin(non_final)
        began_in = self._received[0] if self._open else None
        mark = backward_mark()
        if self._received[0] != mark and not unfinished_before(began_in):
            self._received = (mark, set())
        if id(rec.param) in self._received[1] or unfinished_before(began_in):
            twice = GradientError(twice_message(rec.name, began_in))
            self.fail_current(twice)
            raise twice
        self._received[1].add(id(rec.param))
        self._open = True
        self.part.fold(rec, rec.param.grad)  # type: ignore[arg-type]
        ms = self.micro
        if ms is not None and ms.deferred is not None:
            # A reentrant checkpoint's inner backward ended the host part's micro-step
            # early: end it with this (outer) backward, as a host gradient would.
            if _compat.outermost_backward_frame() is ms.deferred:
                ms.deferred = None
                _compat.queue_backward_callback(lambda: self.end_backward(ms))
            else:
                self.end_backward(ms, force=True)  # that backward is over
        bid = _compat.backward_id()
        if self._shown_in != bid:
            self._shown_in = bid
            _compat.queue_backward_callback(self._show_device)

    def _show_device(self) -> None:
        """The end of a backward with device-part gradients (or of a reentrant
        checkpoint's inner one: a gradient of the outer backward takes the placeholders
        out, and its end shows them again): the loop sees their sums."""
        self._shown_in = -1
        self._open = False  # (an inner backward's end too: what came so far is whole)
        if _compat.outer_backward_frame() is None:  # the outermost backward ended
            self._received = (None, set())
        if self._device_only():
            assert self.acc is not None
            if self.micro is None or self.micro.ended:
                # No host gradient in this backward: the host sums of earlier ones, whose
                # placeholders its first (device) gradient took out, are shown again. (A
                # loop's clip left them out, silently: a tester's find.)
                super()._show()
            self.grads.install_device(self.acc, self.part.with_sums())

    def close_open_backward(self, why: str) -> None:
        """As :class:`Lifecycle`'s; a backward whose device-part gradients came but whose
        end never did (it raised, or was interrupted) leaves the step dirty too: its
        sums hold part of its gradients."""
        super().close_open_backward(why)
        if self._open and _compat.backward_id() < 0:
            self._open = False
            self._received = (None, set())
            if self.health.dirty is None:
                self.health.dirty = GradientError(
                    "a backward with device-part gradients did not finish (it raised, or "
                    "was interrupted): its gradients are partial")

    def _show(self) -> None:
        """The end of a backward with host-part gradients: the loop sees both parts'
        sums (a device part's shown at an inner backward's end and taken out since)."""
        super()._show()
        if self.acc is not None and self.part.params:
            self.grads.install_device(self.acc, self.part.with_sums())

    # -- transitions -----------------------------------------------------------------------
    def begin_from_params(self) -> bool:
        """As :class:`Lifecycle`'s; also a step whose only gradients are the device part's
        (an accumulation with no host gradient, whose graph steps nothing)."""
        return super().begin_from_params() or self._device_only()

    def _device_only(self) -> bool:
        """Begin the accumulation of a step whose gradients so far are all the device
        part's (no host gradient began one). Returns whether there is one now."""
        if self.acc is None and self.micro is None and self.part.pending():
            self.acc = Accumulation(results=LaneResults.for_params(len(self.registry)))
        return self.acc is not None

    def set_clip(self, max_norm: float, *, unbounded: bool) -> torch.Tensor | None:
        self._device_only()
        return super().set_clip(max_norm, unbounded=unbounded)

    def norm(self) -> torch.Tensor | None:
        self._device_only()
        return super().norm()

    def current_norm(self, why: str = "grad_norm was read") -> torch.Tensor | None:
        """The total norm over both parts (the host part's norms waited for), taken once
        per step: before the loop's edits of the gradients, as the host part's are.

        Raises:
            Exception: the host part's norm (or a fold before it) failed: the step is
                dirty from now on (``step()`` refuses until ``zero_grad()``), whether or
                not its execution has finished failing yet.
        """
        try:
            norm = super().current_norm(why)
        except Exception as err:
            if self.health.dirty is None:
                self.health.dirty = err
            raise
        acc = self.acc
        if norm is None or acc is None or not self.part.params:
            return norm
        res = acc.results
        took = self.part.take_hand_set(self.grads.device_shown())  # (this step's)
        # Sharded, the total is reduced over the ranks once per step. Hazard: a rank that
        # edited a gradient joining the norm's collectives again where the others do not.
        if self._both[0] is acc and (not took or self._sharded()):
            res.total_norm = self._both[1]
            return res.total_norm
        fin = acc.final
        assert fin is not None and fin.lanes is not None
        lanes = fin.lanes

        def host_norm(p: torch.Tensor) -> tuple[torch.Tensor | None, tuple[Any, ...]] | None:
            i = lanes.position_of(p)
            if i is None:
                return None
            return (None if res.counts[i] == 0 else res.norms[i]), lanes.norm_groups[i]

        # The norm task has ended (waited for above); the chunks read total_norm only
        # after the step gate, which hand_over() opens later on this thread.
        res.total_norm = self.part.total_norm(self.param_groups(), host_norm)
        self._both = (acc, res.total_norm)
        return res.total_norm

    def prepare_hand_over(self) -> None:
        """As :class:`Lifecycle`'s, after the norm over both parts (its waits)."""
        acc = self.acc
        if self.part.params and acc is not None:
            self.part.adopt()  # weights written from outside become masters, as the host's
            if self.config.overlap == "backward" and acc.final is None and self.micro is None:
                # No final backward stepped the host part (its gradients, if any, came
                # under no_sync()): the final micro-step the host part's hand_over would
                # launch, launched first so that its norm joins the device part's.
                self._launch_final(acc)
            self.current_norm("a device part steps")  # (grad_norm: both parts')
        super().prepare_hand_over()

    def hand_over(self, hyper: list[dict[str, Any]] | None,
                  edits: Mapping[int, tuple[Any, ...]] | None = None) -> Accumulation:
        """As :class:`Lifecycle`'s, then the device part steps (see the Note)."""
        if not self.part.params:
            return super().hand_over(hyper, edits)
        acc = self.acc
        assert acc is not None
        total = self.current_norm("a device part steps")  # (prepare_hand_over's: no wait)
        assert total is not None
        # (None under overlap="backward", which refuses clipping.)
        max_norm = self.config.max_norm if acc.max_norm is None else acc.max_norm
        # torch.nn.utils.clip_grad_norm_'s expressions, as the host part's chunks take them.
        coef = None if max_norm is None else torch.clamp(max_norm / (total + 1e-6), max=1.0)
        acc = super().hand_over(hyper, edits)  # the host part's chunks go
        # Under overlap="backward" the host part stepped during the final backward with
        # the hyperparameters of when it began: the device part steps with the same (an
        # edit in between is refused by step(), after the step, as without a device part).
        step_hyper = (acc.hyper if self.config.overlap == "backward" else None) or hyper \
            or capture_hyper(self.param_groups())
        self._both = (None, None)
        try:
            self.part.step(self.param_groups(), step_hyper, self.registry.probe, coef)
        except BaseException as err:
            self._device_failed(acc, err)
            raise
        return acc

    def _device_failed(self, acc: Accumulation, err: BaseException) -> None:
        """The device part raised ``err`` while the host part was in flight: wait for the
        host part, end the step and say what both parts left."""
        if not _faults.disabled("full_host_part_join"):
            try:
                # Hazard: reporting the step (refused until zero_grad(), or torn)
                # while the host part's chunks still write their masters and
                # weights: the report would miss them, a retry would step them
                # twice, a loaded checkpoint would be overwritten.
                host_err = settle(acc.execution, timeout=self.config.timeout)
            except BaseException:
                self.health.torn_cause = err
                self.health.torn = ("a step failed in its device part, and the wait for its "
                                    "host part was interrupted")
                raise
            if host_err is not None:
                err.add_note(f"pipeoff: the step's host part failed too: {host_err!r}")
        self._end_step(acc)
        self._report(acc, err, "the device part")

    def _report(self, acc: Accumulation, err: BaseException, failed: str) -> None:
        """Say what a step that failed in ``failed`` left, over both parts: torn if any
        master was written (load a checkpoint), else dirty (``zero_grad()``)."""
        ex = acc.execution
        fin = acc.final
        nchunks = len(fin.lanes.plan.chunks) if fin is not None and fin.lanes else 0
        res = acc.results
        stepped = sorted({k for k in range(nchunks)
                          if ex.events_for(step_task(k))[0].status == "ok"}
                         | res.stepped_chunks | res.torn_chunks)
        parts = ([f"host chunk(s) {stepped}"] if stepped else []) + (
            ["the device part"] if self.part.written else [])
        if parts:
            noted = self.health.torn is not None  # (by the host part's classification)
            self.health.dirty = None
            self.health.torn_cause = err
            self.health.torn = (f"a step failed in {failed} after {' and '.join(parts)} "
                                "had (or may have) written their masters")
            if not noted:
                err.add_note(f"pipeoff: {self.health.torn}; later steps are refused until "
                             "a checkpoint is loaded (model and optimizer load_state_dict)")
        else:
            self.health.dirty = err
            err.add_note("pipeoff: no master was stepped, in either part; step() refuses "
                         "until opt.zero_grad()")

    def wait_step(self) -> list[str]:
        """As :class:`Lifecycle`'s, and the join with the device part (see the Note)."""
        acc = self.inflight
        try:
            return super().wait_step()
        except BaseException as err:
            if (acc is not None and self.inflight is None and self.part.written
                    and acc.execution.exception is not None):
                # The host part failed after the device part stepped: torn. (Not a
                # Ctrl-C that came once the step had ended whole.)
                self._report(acc, err, "its host part")
            raise
        finally:
            if self.inflight is None:  # the step ended (a wait interrupted goes on)
                self.part.wait()

    def discard(self, why: str, *, classify_final: bool) -> None:
        super().discard(why, classify_final=classify_final)
        self.part.discard()
        self._both = (None, None)
        if _compat.backward_id() < 0:  # (zero_grad() after a backward that raised)
            self._open = False
            self._received = (None, set())

    def edit_sums(self, replaced: Mapping[int, torch.Tensor], dropped: Sequence[int]) -> None:
        super().edit_sums(replaced, dropped)
        if not self._sharded():  # (the host part's norms changed: the total is taken again)
            self._both = (None, None)

    def _sharded(self) -> bool:
        return (any(self.registry.norm_groups)
                or any(rec.norm_key for rec in self.part.params.values()))

    def edit_device_sums(self, replaced: Mapping[DeviceParam, torch.Tensor],
                         dropped: list[DeviceParam]) -> None:
        """The loop put a gradient in a device-part ``param.grad`` by hand (or wrote
        through it) or set it to ``None`` after a backward: the sums say so from now on
        (on the caller's stream, before the step's kernels)."""
        for rec, t in replaced.items():
            self.part.replace(rec, t)
        for rec in dropped:
            self.part.drop(rec)
        if not self._sharded():  # (the total over both parts is taken again)
            self._both = (None, None)

    def writes_to(self, param: torch.Tensor) -> tuple[Execution | None, list[str]]:
        """As :class:`Lifecycle`'s; a device-part parameter is written on the caller's
        stream, which orders its readers there: no task to wait for."""
        if self.part.owns(param) is not None:
            return None, []
        return super().writes_to(param)
