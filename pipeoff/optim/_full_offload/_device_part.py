"""Full offload's device part: parameters whose master, optimizer state and gradient sum
stay in device memory (``FullOffloadOptimizer(..., offload_fraction=f)``, ``f < 1``).

The split is OffloadOptimizer's rule (:func:`~pipeoff.optim._offload._device_part.
split_params`): parameters in param-group order, each joining the device part while
the device part's weight stays within ``(1 - f)`` of the total; here a parameter's
weight is its bytes of FP32 master, FP32 gradient sum and per-element optimizer state
together (``4 * numel * (2 + state tensors)``). It is decided once, over the groups
the optimizer is built with; parameters added later are the host part's.

A device-part parameter's math is the reference's (``tests/optim/full_reference.py``):
its gradients are summed in FP32 on the device as autograd finalizes them (the first
copied, widened), the norm of its sum joins the host part's in param-group order
(``torch.nn.utils.clip_grad_norm_(foreach=False)``'s expressions), the sum is scaled by
the same clipping coefficient, torch's own kernel for the wrapped optimizer (fused
where the group says so) steps the FP32 master, and the weight is written as the
master's cast. See ``[Note: the two parts of a full-offload step]`` in
``_fraction.py`` for how the two parts run and join.

Gradients come in through the optimizer's own gradient hooks (``_intake.py``), which
hand a device-part parameter's to :meth:`FullDevicePart.fold`; between the backward and
``step()`` the loop sees the sums in ``param.grad`` through placeholders
(``_grads.py``), whose reads and edits call down into :meth:`FullDevicePart.norm_of`,
:meth:`~FullDevicePart.scale`, :meth:`~FullDevicePart.replace` and
:meth:`~FullDevicePart.drop`.

Written and read on the caller's thread (a gradient: on the thread running the
backward's hooks, while the caller is in ``backward()``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import torch

from pipeoff import _accel, _compat, _faults
from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError
from pipeoff._held_interrupt import HeldInterrupt
from pipeoff.optim import _update
from pipeoff.optim._full_offload import _checkpoint
from pipeoff.optim._full_offload._edits import Edit, apply_edits
from pipeoff.optim._offload._device_part import DEVICE_PART_TASK, split_params
from pipeoff.optim._tensors import casts_to, version_of, wrap_like
from pipeoff.optim._update import mark_step, wrote_before_failing

__all__ = ["DeviceParam", "FullDevicePart", "HostNorm", "full_weights"]

HostNorm = tuple[torch.Tensor | None, tuple[Any, ...]]
"""A host-part parameter's gradient norm (``None`` without a gradient) and the process
groups its square is summed over (``_param.norm_groups``)."""

_LANE = "caller"


def full_weights(param_groups: Sequence[Mapping[str, Any]],
                 probe: torch.optim.Optimizer) -> list[int]:
    """Per parameter (in param-group order), its weight in the split: bytes of its FP32
    master, FP32 gradient sum and per-element optimizer state (global shapes)."""
    return [4 * p.numel() * (2 + len(_update.state_keys(probe, g)))
            for g in param_groups for p in g["params"]]


class DeviceParam:
    """One device-part parameter: its FP32 master (laid out as the parameter's local
    tensor: a DTensor's local shard), its FP32 gradient sum (``None`` without a
    gradient since the last step), and torch's state entry for it (on the device), all
    local tensors; ``norm_key``: the process groups its squared norm is summed over
    (``_param.norm_groups``)."""

    __slots__ = ("master", "name", "norm_key", "param", "state", "stepped", "sum", "version")

    def __init__(self, param: torch.Tensor, name: str) -> None:
        from pipeoff.optim._full_offload._param import norm_groups

        self.param = param
        self.name = name
        self.norm_key = norm_groups(param, None)
        weight = local(param)
        with torch.no_grad():
            self.master = torch.empty_like(weight, dtype=torch.float32)
            self.master.copy_(weight)  # widening: exact
        self.sum: torch.Tensor | None = None
        self.state: dict[str, Any] = {}
        self.stepped = False
        """Stepped at least once (or loaded with a master): its entry is saved, also
        without state (SGD without momentum), as the host part's."""
        self.version = version_of(param)
        """The weight's version counters (``version_of``) after this optimizer's last
        write to it."""

    @property
    def weight(self) -> torch.Tensor:
        """The weight the step writes: the parameter, or a DTensor's local shard (looked
        up each time: FSDP2 may swap the local tensor at its lazy init)."""
        return local(self.param)


class FullDevicePart:
    """The device part of a full-offload optimizer: its parameters, their sums, and
    their step (see the module docstring).

    Args:
        fraction: the ``offload_fraction``.
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.params: dict[int, DeviceParam] = {}
        """The device part, by the parameter's ``id()`` (param-group order)."""
        self.groups: Callable[[], Sequence[Mapping[str, Any]]] = lambda: ()
        """The live ``param_groups`` (set by the lifecycle): a parameter removed from them
        is ignored by its hook, its gradient left in ``.grad``, as torch leaves it."""
        self._listed: tuple[int, frozenset[int]] = (-2, frozenset())
        """The ``id()`` of the parameters the groups list, as of a backward (its id)."""
        # CUDA events for stream synchronization: recorded on the caller's stream after
        # the device part's kernels, waited for by wait().
        self._event: Any = None
        self._pending = False
        self.written = False
        """Whether the last step may have written device-part masters or weights (also
        when it raised)."""
        self.interrupt = HeldInterrupt()
        """A Ctrl-C held back while the device part stepped, until the step passes it on."""

    # -- the split ---------------------------------------------------------------------------
    def split(self, param_groups: Sequence[Mapping[str, Any]], probe: torch.optim.Optimizer,
              names: Mapping[int, str]) -> frozenset[int]:
        """Decide the device part over ``param_groups`` (once, at construction) and create
        its masters; returns the ``id()`` of its parameters.

        The weights are of global shapes, so every rank of an FSDP2 mesh makes the same
        split (and issues the same norm collectives).
        """
        if self.fraction >= 1.0:
            return frozenset()
        tensors = [p for g in param_groups for p in g["params"]]
        on = split_params(full_weights(param_groups, probe), self.fraction).on_device
        for i in sorted(on):
            p = tensors[i]
            self.params[id(p)] = DeviceParam(p, names.get(id(p), f"param {i}"))
        return frozenset(self.params)

    def owns(self, p: torch.Tensor) -> DeviceParam | None:
        rec = self.params.get(id(p))
        return rec if rec is not None and rec.param is p else None

    # -- gradients in ------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The device part's parameters."""
        return [rec.param for rec in self.params.values()]

    def fold(self, rec: DeviceParam, g: torch.Tensor) -> None:
        """Fold ``g`` (the gradient a backward left in ``rec.param.grad``) into the FP32
        sum (the first: a widening copy), then release it: the reference's
        accumulation, on the device (a DTensor's local shard)."""
        g = local(g)
        with torch.no_grad():
            if rec.sum is None:
                rec.sum = g.to(torch.float32, copy=True)
            else:
                rec.sum.add_(g)
        rec.param.grad = None

    def with_sums(self) -> list[DeviceParam]:
        """The parameters with a gradient sum, listed in the live groups."""
        return [rec for rec in self.params.values()
                if rec.sum is not None and self.listed(rec.param)]

    # -- what the loop does to param.grad (through its placeholder) --------------------------
    def norm_of(self, rec: DeviceParam, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.linalg.vector_norm(sum, *args, **kwargs)`` of ``rec``'s FP32 sum."""
        assert rec.sum is not None
        out: torch.Tensor = torch.linalg.vector_norm(rec.sum, *args, **kwargs)
        return out

    def scale(self, rec: DeviceParam, edits: Sequence[Edit]) -> None:
        """Apply the loop's in-place edits (a clip coefficient...) to ``rec``'s sum now, in
        order, with torch's ops on the FP32 sum (the caller's stream orders them before
        the step's kernels)."""
        assert rec.sum is not None
        with torch.no_grad():
            apply_edits(rec.sum, edits)

    def replace(self, rec: DeviceParam, g: torch.Tensor) -> None:
        """A gradient the loop put in ``param.grad`` (or wrote through its copy) after the
        backward: the sum from now on (widened: exact)."""
        with torch.no_grad():
            rec.sum = local(g).detach().to(torch.float32, copy=True)

    @staticmethod
    def drop(rec: DeviceParam) -> None:
        """``param.grad = None`` after the backward: no gradient (a later backward starts
        the sum again)."""
        rec.sum = None

    def listed(self, p: torch.Tensor) -> bool:
        """Whether the live groups list ``p`` (looked up once per backward)."""
        bid = _compat.backward_id()
        if self._listed[0] != bid or bid < 0:
            self._listed = (bid, frozenset(id(q) for g in self.groups() for q in g["params"]))
        return id(p) in self._listed[1]

    def take_hand_set(self, shown: Container[int] = ()) -> bool:
        """A gradient put in ``param.grad`` by hand where no backward left one (``step()``
        with gradients set by hand, as ``torch.distributed.checkpoint`` does) becomes the
        parameter's sum. ``shown``: the ``id()`` of parameters whose ``.grad`` is the
        loop's view of their sum (``_grads.py``), passed over. Returns whether any
        was taken."""
        took = False
        for rec in self.params.values():
            g = rec.param.grad
            if g is None or id(rec.param) in shown or not self.listed(rec.param):
                continue
            if g.shape != rec.param.shape or g.device != rec.param.device or g.is_sparse:
                raise ConfigError(f"the gradient set by hand for {rec.name!r} is not dense, of "
                                  "the parameter's shape and device")
            with torch.no_grad():
                rec.sum = local(g).to(torch.float32, copy=True)
            rec.param.grad = None
            took = True
        return took

    def pending(self) -> bool:
        """Whether a device-part parameter has a gradient (a sum, or one set by hand)."""
        return any(rec.sum is not None or (rec.param.grad is not None and self.listed(rec.param))
                   for rec in self.params.values())

    def discard(self) -> None:
        """Drop the sums (``zero_grad()``, which sets ``.grad`` itself, or a loaded state
        dict, which leaves ``.grad`` as torch's ``load_state_dict`` does)."""
        for rec in self.params.values():
            rec.sum = None

    # -- the norm ----------------------------------------------------------------------------
    def total_norm(self, param_groups: Sequence[Mapping[str, Any]],
                   host_norm: Callable[[torch.Tensor], HostNorm | None]) -> torch.Tensor:
        """The total 2-norm of every gradient, both parts, as ``clip_grad_norm_(foreach=
        False)`` takes it over the parameters in param-group order: one norm per sum,
        then the norm of their stack. ``host_norm(p)``: a host-part parameter's norm
        (``None`` without a gradient) and the groups it is summed over; ``None`` for a
        parameter the host part does not hold.

        Sharded parameters (FSDP2): per set of groups the stack of its parameters'
        norms, both parts, in param-group order, then the host part's reduction
        (``_lanes.reduce_norms``): a collective per group, joined by every rank, also
        without gradients, as the host part's norm task does.
        """
        order: list[tuple[tuple[Any, ...], torch.Tensor | int]] = []
        device: list[torch.Tensor] = []
        keys: dict[tuple[Any, ...], torch.device] = {}  # every parameter's, in order
        for g in param_groups:
            for p in g["params"]:
                rec = self.owns(p)
                if rec is None:
                    got = host_norm(p)
                    if got is None:
                        continue
                    n, key = got
                    if key:
                        keys.setdefault(key, local(p).device)
                    if n is not None:
                        order.append((key, n))
                else:
                    if rec.norm_key:
                        keys.setdefault(rec.norm_key, rec.master.device)
                    if rec.sum is not None:
                        order.append((rec.norm_key, len(device)))
                        device.append(torch.linalg.vector_norm(rec.sum, 2.0))
        if not order and not keys:
            return torch.tensor(0.0)
        # One blocking copy of the device part's norms (the host waits for their
        # kernels on the caller's stream): the total is taken on the host, as the
        # host part's norm task takes it.
        on_host = torch.stack(device).cpu().unbind() if device else ()
        by_key: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for key, at in order:
            by_key.setdefault(key, []).append(on_host[at] if isinstance(at, int) else at)
        partial: dict[tuple[Any, ...], torch.Tensor] = {
            key: torch.linalg.vector_norm(torch.stack(norms), 2.0)
            for key, norms in by_key.items()}
        if not keys:  # nothing to reduce: the norm is this rank's
            return partial[()]
        from pipeoff.optim._full_offload._lanes import reduce_norms

        return reduce_norms(partial, list(keys), keys)

    # -- the step ----------------------------------------------------------------------------
    def step(self, param_groups: Sequence[Mapping[str, Any]], hyper: Sequence[Mapping[str, Any]],
             probe: torch.optim.Optimizer, clip_coef: torch.Tensor | None) -> int:
        """Step the device-part parameters that have a sum, with torch's own kernel for
        the wrapped optimizer on their FP32 masters (on the caller's stream), then write
        each weight as its master's cast. Returns how many were stepped; :attr:`written`
        says whether any master may have been written (also when it raised). Ctrl-C is
        held back meanwhile (:attr:`interrupt`; the optimizer passes it on).

        Raises:
            BaseException: what the optimizer raised (state a first step made is then
                not kept).
        """
        # Hazard: a KeyboardInterrupt between two parameters' updates (or the sums'
        # scaling) leaves the device part half-stepped: a torn step for one Ctrl-C.
        with self.interrupt.hold():
            return self._step(param_groups, hyper, probe, clip_coef)

    def _step(self, param_groups: Sequence[Mapping[str, Any]], hyper: Sequence[Mapping[str, Any]],
              probe: torch.optim.Optimizer, clip_coef: torch.Tensor | None) -> int:
        self.written = False
        by_group: dict[int, list[DeviceParam]] = collections.defaultdict(list)
        for gi, g in enumerate(param_groups):
            for p in g["params"]:
                rec = self.owns(p)
                if rec is not None and rec.sum is not None:
                    by_group[gi].append(rec)
        recs = [rec for gi in sorted(by_group) for rec in by_group[gi]]
        for rec in set(self.params.values()) - set(recs):
            rec.sum = None  # (removed from the groups mid-accumulation: not stepped)
        if not recs:
            return 0
        shadow = _update.make_shadow(probe)
        shadow.param_groups = [{**hyper[gi], "params": [rec.master for rec in by_group[gi]]}
                               for gi in sorted(by_group)]
        state: collections.defaultdict[torch.Tensor, dict[str, Any]] = (
            collections.defaultdict(dict))
        coef = None if clip_coef is None else clip_coef.to(recs[0].master.device)
        for rec in recs:
            state[rec.master] = dict(rec.state)
            assert rec.sum is not None
            if coef is not None:
                # clip_grad_norm_(foreach=False)'s expression, for the same bits.
                rec.sum.mul_(coef)
            rec.master.grad = rec.sum
        shadow.state = state
        masters = [rec.master for rec in recs]
        marks = mark_step(masters, [state[m] for m in masters], _accel.current().on_device)
        hooks = _faults.snapshot() if _faults.installed() else ()
        body = _compat.step_body(type(shadow))
        try:
            _faults.run_hooks(DEVICE_PART_TASK, _LANE, hooks=hooks)  # (raises: nothing written)
            with _faults.failing_work(DEVICE_PART_TASK, _LANE, hooks), torch.no_grad():
                # No compile-session guard (eager_math): this runs on the caller's
                # thread inside step(), where that thread cannot be compiling.
                body(shadow)
        except BaseException:
            self.written = wrote_before_failing(shadow, marks, masters,
                                                [state[m] for m in masters])
            raise
        finally:
            for rec in recs:
                rec.master.grad = None
            shadow.state = collections.defaultdict(dict)
            shadow.param_groups = []
        self.written = True
        with torch.no_grad():
            for rec in recs:
                rec.state = state[rec.master]
                rec.stepped = True
                rec.sum = None
                rec.weight.copy_(rec.master)  # the weight: the master's cast
                rec.version = version_of(rec.param)
        self._record(recs[0].param.device)
        return len(recs)

    def _record(self, device: torch.device) -> None:
        accel = _accel.current()
        if not accel.is_device(device):
            return  # (on the CPU the kernels ran inside step())
        if self._event is None:
            self._event = accel.new_event()  # created once, recorded at every step
        # Hazard: none here; this marks the end of the device part's kernels on the
        # caller's stream for the readers off it (see wait()).
        self._event.record(accel.current_stream(device))
        self._pending = True

    def wait(self) -> None:
        """Block the host until the last device part's kernels have run (nothing to do on
        the CPU). The step's join waits for it (``wait_for_step()``)."""
        if not self._pending:
            return
        if not _faults.disabled("full_device_part_wait"):
            # Hazard: a reader off the caller's stream (another thread, a stream of
            # its own, the host reading the state after wait_for_step() or a
            # synchronous step) reading device-part weights, masters or state the
            # caller's stream has not written yet.
            self._event.synchronize()
        self._pending = False

    # -- the weights written from outside ----------------------------------------------------
    def adopt(self, params: Sequence[torch.Tensor] | None = None, *,
              only_written: bool = True) -> None:
        """Make the masters of weights written from outside (their version counters moved;
        ``only_written=False``: every one given) the widened weights, unless a weight
        holds exactly its master's cast (the master's low bits are kept)."""
        recs = (list(self.params.values()) if params is None
                else [r for r in map(self.owns, params) if r is not None])
        with torch.no_grad():
            for rec in recs:
                w = rec.weight
                if only_written and version_of(rec.param) == rec.version:
                    continue
                if not casts_to(rec.master, w):
                    rec.master.copy_(w.detach())
                rec.version = version_of(rec.param)

    def weights_from_masters(self) -> None:
        """Write every device-part weight from its master."""
        with torch.no_grad():
            for rec in self.params.values():
                rec.weight.copy_(rec.master)
                rec.version = version_of(rec.param)
        if self.params:  # (after a load too: the readers off the caller's stream wait)
            self._record(next(iter(self.params.values())).param.device)

    # -- checkpoints and memory --------------------------------------------------------------
    def entries(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per device-part parameter stepped at least once (or loaded with state), torch's
        entry plus ``"master"`` (per-element tensors as DTensors like a DTensor parameter,
        as torch's optimizer keeps them under FSDP2)."""
        out = {}
        for rec in self.params.values():
            if not (rec.state or rec.stepped):
                continue
            entry = {k: wrap_like(rec.param, v) if _per_element(k, v, rec.master) else v
                     for k, v in rec.state.items()}
            entry["master"] = wrap_like(rec.param, rec.master)
            out[rec.param] = entry
        return out

    def write_entry(self, rec: DeviceParam, entry: Mapping[str, Any]) -> None:
        """``opt.state[p] = entry`` for a device-part parameter (``{}``: no state): torch's
        own state for its kernel, the values written moved to the master's device. Its
        master stays (``"master"``, if given, must be it).

        Raises:
            ConfigError: a ``"master"`` that is not the parameter's master.
        """
        master = entry.get("master")
        if master is not None and not torch.equal(
                local(master).to(rec.master.device).reshape(rec.master.shape), rec.master):
            raise ConfigError(
                f"opt.state[p]['master'] of {rec.name!r} was written: the FP32 master "
                "follows the weight (write the parameter) or load_state_dict()")
        state = {}
        for key, val in entry.items():
            if key == "master":
                continue
            if isinstance(val, torch.Tensor) and _per_element(key, val, rec.master):
                val = local(val).to(rec.master.device).reshape(rec.master.shape)
            state[key] = val
        rec.state, rec.stepped = state, bool(entry)

    def load(self, entries: Mapping[int, Mapping[str, Any]],
             param_groups: Sequence[Mapping[str, Any]]) -> list[str]:
        """Load checked entries (by ``id()`` of the parameter); a parameter without one
        takes its weight as its master and no state; one whose saved master is another
        optimizer's takes its weight as its master (their names are returned). As torch's
        ``load_state_dict``, a ``step`` stays on the host unless the group is fused or
        capturable."""
        group_of = {id(p): g for g in param_groups for p in g["params"]}
        foreign: list[str] = []
        with torch.no_grad():
            for pid, rec in self.params.items():
                entry = entries.get(pid)
                rec.stepped = entry is not None and "master" in entry
                if (rec.stepped and entry is not None
                        and not _checkpoint.foreign_master(entry)
                        and (version_of(rec.param) != rec.version
                             or not casts_to(rec.master, rec.weight))
                        and not casts_to(
                            local(entry["master"]).reshape(rec.master.shape), rec.weight)):
                    # (not the master of the weight written since: see _checkpoint.load)
                    entry = {k: v for k, v in entry.items() if k != "master"}
                rec.sum = None
                rec.state = {}
                if entry is None or "master" not in entry:
                    rec.master.copy_(rec.weight)
                for key, val in (entry or {}).items():
                    if key == "master":
                        rec.master.copy_(local(val).reshape(rec.master.shape))
                    elif isinstance(val, torch.Tensor) and (val.dim() > 0 or key != "step"):
                        rec.state[key] = local(val).to(rec.master.device, torch.float32,
                                                       copy=True).reshape(rec.master.shape)
                    elif key == "step":
                        g = group_of[pid]
                        t = _checkpoint.step_entry(val, g)
                        rec.state[key] = (t.to(rec.master.device) if g.get("fused")
                                          or g.get("capturable") else t)
                    else:
                        rec.state[key] = val
                if entry is not None and _checkpoint.foreign_master(entry):
                    rec.master.copy_(rec.weight)  # (another optimizer's: see _checkpoint)
                    foreign.append(rec.name)
                rec.version = version_of(rec.param)
        return foreign

    def memory(self) -> dict[str, int]:
        """Bytes of the device part: ``master_bytes_device``, ``grad_sum_bytes_device``
        (its sums), ``state_bytes_device`` (its per-element state and a step kept in
        device memory); and ``params_device``."""
        recs = list(self.params.values())
        accel = _accel.current()
        state = 0
        for rec in recs:
            for k, v in rec.state.items():
                # A step counts only where it is in an accelerator's memory (fused).
                if isinstance(v, torch.Tensor) and (k != "step" or (
                        accel.is_device(v.device) and accel.on_device(v))):
                    state += v.numel() * v.element_size()
        return {"master_bytes_device": sum(_nbytes(r.master) for r in recs),
                "grad_sum_bytes_device": sum(_nbytes(r.sum) for r in recs if r.sum is not None),
                "state_bytes_device": state, "params_device": len(recs)}


def _per_element(key: str, val: Any, master: torch.Tensor) -> bool:
    """Whether a state entry is per-element (saved like the parameter), not a scalar."""
    return (isinstance(val, torch.Tensor) and key != "step" and val.dim() > 0
            and val.shape == master.shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
