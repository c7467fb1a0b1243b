"""One parameter's host side (:class:`OffloadedParam`) and the registry that follows
``param_groups`` and the model (:class:`ParamRegistry`).

The registry is the only owner of the parameters' host tensors; everything
else addresses a parameter by its position in it (its order in
``param_groups``, each parameter once).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from pipeoff import _accel
from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError
from pipeoff.optim import _update
from pipeoff.optim._full_offload._config import FullOffloadConfig, refuse_set
from pipeoff.optim._full_offload._graph import MicroStepPlan, ParamSizes
from pipeoff.optim._tensors import (
    casts_to,
    flat,
    host_alloc,
    index_of,
    memory_order,
    version_of,
)

__all__ = ["OffloadedParam", "ParamRegistry", "norm_groups"]

_STATE_LOCK = threading.Lock()
"""Makes an allocation of missing state keys one step (see ``ensure_state``)."""


_FLOAT64 = ("parameter {name!r} is float64: FullOffloadOptimizer keeps FP32 masters and "
            "gradient sums, which would round its gradients and updates; use "
            "OffloadOptimizer (state in the parameter's dtype) or torch's optimizer")

class OffloadedParam:
    """One parameter and its host state: the FP32 master, the FP32 gradient accumulator
    and the optimizer's per-element state, each laid out in the parameter's memory
    order (a flat view of each is a flat view of the others), pinned where an
    accelerator is present.

    Which thread writes what: see ``[Note: lane writes]`` in ``_lanes.py``.
    """

    __slots__ = ("acc", "flat_acc", "flat_master", "group", "master", "name", "order", "param",
                 "present", "scalars", "state", "stepped", "version")

    def __init__(self, param: torch.Tensor, name: str, master: torch.Tensor,
                 acc: torch.Tensor) -> None:
        order = memory_order(local(param))
        assert order is not None  # checked by ParamRegistry.check_group
        self.param = param
        self.name = name
        self.order: tuple[int, ...] = order
        # Host tensors: the lanes write their elements, nobody swaps them.
        self.master = master
        self.acc = acc
        self.flat_master = flat(master, order)
        self.flat_acc = flat(acc, order)
        self.state: dict[str, torch.Tensor] = {}
        """Per-element state (``exp_avg``...), allocated once per key."""
        # Bookkeeping of the step chunk that steps it (host_step lane).
        self.scalars: dict[str, Any] = {}
        """The other state entries (``step``)."""
        self.present: tuple[str, ...] = ()
        """The keys of ``state`` that hold the optimizer's state (a key allocated
        ahead of the first step holds nothing yet)."""
        self.stepped = False
        """Stepped at least once (an optimizer without per-parameter state, SGD without
        momentum, has no other trace of it)."""
        # Bookkeeping of the caller's thread.
        self.group = 0
        """Index of its param group."""
        self.version = version_of(param)
        """The weight's version counters (:func:`version_of`) after this optimizer's last
        write to it."""

    @property
    def local(self) -> torch.Tensor:
        """The device weight (its local shard)."""
        return local(self.param)

    @property
    def numel(self) -> int:
        return self.local.numel()

    def ensure_state(self, keys: Sequence[str], pin: bool) -> dict[str, torch.Tensor]:
        """The per-element host state for ``keys`` (the missing ones allocated, zeroed).

        Called by a step chunk's lane and by the registry on the caller's thread (a
        re-index while a step is in flight).
        """
        if all(k in self.state for k in keys):
            return self.state
        # Hazard: two threads each allocating a missing key, one replacing the
        # tensor the other has already stepped into.
        with _STATE_LOCK:
            missing = [k for k in keys if k not in self.state]
            if missing:
                made = host_alloc(
                    [(self.local.shape, torch.float32, self.order)] * len(missing), pin)
                for k, t in zip(missing, made):
                    t.zero_()
                    self.state[k] = t
        return self.state

    def weight_from_master(self) -> None:
        """Write the device weight from the master (cast to the weight's dtype)."""
        loc = self.local
        with torch.no_grad():
            flat(loc, self.order).copy_(self.flat_master)
        self.version = version_of(self.param)

    def master_from_weight(self) -> None:
        """Make the master the (widened) device weight."""
        loc = self.local
        with torch.no_grad():
            self.flat_master.copy_(flat(loc, self.order))
        self.version = version_of(self.param)

    def forget_state(self) -> None:
        """Drop the optimizer state's entries (its host tensors are kept for reuse)."""
        self.scalars = {}
        self.present = ()
        self.stepped = False


def norm_groups(p: torch.Tensor, process_group: Any) -> tuple[Any, ...]:
    """The process groups over which ``p``'s squared gradient norm is summed: the
    groups of the mesh dimensions its placements shard it on (as DTensor's
    ``clip_grad_norm_`` reduces; under HSDP the shard dimension, not the
    replicas), or ``process_group`` if one is given; none for a parameter each
    rank holds whole (DDP, a single process)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return ()
    if process_group is not None:
        return (process_group,) if dist.get_world_size(process_group) > 1 else ()
    placements = getattr(p, "placements", None)
    if placements is None:
        return ()
    mesh = p.device_mesh  # type: ignore[attr-defined]
    return tuple(mesh.get_group(d) for d, pl in enumerate(placements)
                 if pl.is_shard() and mesh.size(d) > 1)


class ParamRegistry:
    """The parameters of the live ``param_groups``, each an :class:`OffloadedParam`, in
    order: host state for new ones, hooks' lookups, the chunk plan, and what follows
    the model between steps (parameters moved between groups, weights written from
    outside).

    Written only on the caller's thread, between steps.
    """

    def __init__(self, model: torch.nn.Module | None, config: FullOffloadConfig,
                 probe: torch.optim.Optimizer) -> None:
        self.model = model
        """The model, or ``None`` until the optimizer, built from parameters only, has
        seen it (:meth:`adopt_model`)."""
        self.config = config
        self.probe = probe
        self.names: dict[int, str] = {} if model is None else {
            id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        """Every parameter of the model, by ``id()``, to its name (without a model: the
        parameters given, by their ``param_names`` or their place in the groups)."""
        self.params: list[OffloadedParam] = []
        self._by_id: dict[int, int] = {}
        self._retired: dict[int, OffloadedParam] = {}
        """Parameters removed from ``param_groups``: kept, as torch keeps ``opt.state[p]``,
        for when they come back."""
        self._fingerprint: tuple[Any, ...] = ()
        self.device = torch.device("cpu")
        self.plan = MicroStepPlan.build([], chunk_numel=config.chunk_numel,
                                        slot_bytes=config.slot_bytes, slots=config.slots)
        self.norm_groups: list[tuple[Any, ...]] = []
        """Per parameter, :func:`norm_groups`."""
        self.on_device: frozenset[int] = frozenset()
        """The ``id()`` of the parameters of the device part (``_device_part.py``): the
        registry holds no host state for them, and leaves them out of its order."""
        self.outside_writes = 0
        """Parameters found written outside the optimizer (tests: FSDP2 must not trigger
        it every step, which would copy weights to the host)."""

    # -- lookups -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[OffloadedParam]:
        return iter(self.params)

    def __getitem__(self, i: int) -> OffloadedParam:
        return self.params[i]

    def position(self, p: torch.Tensor) -> int | None:
        """``p``'s position, or ``None`` if it is not in ``param_groups``."""
        i = self._by_id.get(id(p))
        return i if i is not None and self.params[i].param is p else None

    def index_of(self, p: torch.Tensor) -> int:
        """``p``'s position.

        Raises:
            ConfigError: ``p`` is not one of the parameters.
        """
        i = self.position(p)
        return index_of(self.tensors(), p) if i is None else i  # (the error names it)

    def host_tensor(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """``p``'s FP32 ``"master"`` or per-element state ``key`` (``"exp_avg"``...: they
        exist from the first ``step()`` on).

        Raises:
            ConfigError: ``p`` is not one of the parameters, or has no such state.
        """
        i = self.index_of(p)
        rec = self.params[i]
        host = rec.master if key == "master" else rec.state.get(key)
        if host is None:
            raise ConfigError(
                f"parameter {i} has no state {key!r} (it has 'master' and "
                f"{sorted(rec.state)}; moments exist from the first step() on)")
        return host

    def tensors(self) -> list[torch.Tensor]:
        return [rec.param for rec in self.params]

    @property
    def pin(self) -> bool:
        """Whether host state is pinned (an accelerator holds the weights, and
        ``pin_memory``)."""
        return self.config.pin_memory and _accel.current().is_device(self.device)

    def state_keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The per-element state keys the optimizer keeps for parameters of ``group``."""
        return _update.state_keys(self.probe, group)

    # -- following param_groups ------------------------------------------------------------
    def check_group(self, param_group: Mapping[str, Any],
                    param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """A new group, its ``params`` a list: refused if its hyperparameters are, or
        its parameters are not the model's, listed twice, or not dense floating-point
        tensors.

        Raises:
            ConfigError: naming the parameter or the hyperparameters.
        """
        group = dict(param_group)
        if "params" not in group:
            raise ConfigError("a param group needs a 'params' entry (its parameters), got keys "
                              f"{sorted(group)}")
        ps = group["params"]
        refuse_set(ps, "a param group's 'params'")
        params = group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        if params and all(isinstance(p, tuple) and len(p) == 2 for p in params):
            # Named parameters (torch 2.6+): as torch does, names go to "param_names".
            group["param_names"] = [name for name, _ in params]
            params = group["params"] = [p for _, p in params]
        self.config.probe(**{k: v for k, v in group.items()
                             if k not in ("params", "param_names")})
        seen = {id(p) for g in param_groups for p in g["params"]}
        given = group.get("param_names")
        for k, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise ConfigError(f"param groups hold tensors, got {p!r}")
            name = self.name_of(p)
            if name is None and self.model is None and id(p) not in seen:
                # Built from parameters only: named by torch's param_names, else by
                # their place (renamed once the model is seen).
                name = (str(given[k]) if isinstance(given, (list, tuple)) and k < len(given)
                        else f"param_groups[{len(param_groups)}][{k}]")
                self.names[id(p)] = name
            if name is None:
                raise ConfigError(f"a parameter of shape {tuple(p.shape)} is not in the model "
                                  "given to FullOffloadOptimizer")
            if id(p) in seen:
                raise ConfigError(f"parameter {name!r} is listed twice (a tied weight is one "
                                  "parameter: list it once)")
            seen.add(id(p))
            if not p.dtype.is_floating_point or memory_order(local(p)) is None:
                raise ConfigError(f"parameter {name!r} must be a dense floating-point tensor, "
                                  f"got {p.dtype} with strides {local(p).stride()}")
            if p.dtype == torch.float64:  # (a tester's find: it trained in FP32, silently)
                raise ConfigError(_FLOAT64.format(name=name))
        return group

    def name_of(self, p: torch.Tensor) -> str | None:
        """``p``'s name in the model (``None``: not in it), looked up again in the model
        when not known: a module added to it since (a new head, then
        ``add_param_group``)."""
        name = self.names.get(id(p))
        if name is None and self.model is not None:
            self.names.update({id(q): n for n, q in
                               self.model.named_parameters(remove_duplicate=True)})
            name = self.names.get(id(p))
        return name

    @staticmethod
    def fingerprint(param_groups: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
        return tuple(tuple((id(p), p.requires_grad, p.dtype) for p in g["params"])
                     for g in param_groups)

    def changed(self, param_groups: Sequence[Mapping[str, Any]]) -> bool:
        """Whether ``param_groups``' parameters changed since they were indexed."""
        return self.fingerprint(param_groups) != self._fingerprint

    def check_groups(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Refuse groups edited in place to hold a tensor of another model, or one
        parameter twice.

        Raises:
            ConfigError: naming the tensor.
        """
        seen: set[int] = set()
        for gi, g in enumerate(param_groups):
            for k, q in enumerate(g["params"]):
                name = self.name_of(q)
                if name is None and self.model is None and isinstance(q, torch.Tensor):
                    name = self.names[id(q)] = f"param_groups[{gi}][{k}]"
                if name is None:
                    raise ConfigError(f"param_groups holds a tensor of shape {tuple(q.shape)} "
                                      "that is not a parameter of the model")
                if id(q) in seen:
                    raise ConfigError(f"parameter {name!r} is listed twice in param_groups")
                seen.add(id(q))
                if q.dtype == torch.float64:  # (cast after construction: model.double())
                    raise ConfigError(_FLOAT64.format(name=name))

    def index(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Follow ``param_groups``: host state for new parameters (the master copied from
        the weight: widening, exact), retired ones kept, returning ones restored, the
        chunk plan redone.

        Raises:
            ConfigError: parameters on several devices.
        """
        tensors = [p for g in param_groups for p in g["params"] if id(p) not in self.on_device]
        kept = {id(rec.param): rec for rec in self.params}
        now = {id(p) for p in tensors}
        devices = {local(p).device for g in param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ConfigError(f"parameters on several devices {sorted(map(str, devices))}; "
                              "FullOffloadOptimizer needs one device per rank")
        for rec in self.params:
            if id(rec.param) not in now:
                self._retired[id(rec.param)] = rec
        self.device = devices.pop() if devices else torch.device("cpu")
        back = {id(p): self._retired.pop(id(p)) for p in tensors
                if id(p) not in kept and id(p) in self._retired
                and self._retired[id(p)].param is p}
        new = [p for p in tensors if id(p) not in kept and id(p) not in back]
        specs: list[Any] = []
        for p in new:
            specs += [(local(p).shape, torch.float32, memory_order(local(p)))] * 2
        made = host_alloc(specs, self.pin) if specs else []
        fresh = {id(p): OffloadedParam(p, self.names[id(p)], made[2 * k], made[2 * k + 1])
                 for k, p in enumerate(new)}
        for rec in fresh.values():
            with torch.no_grad():
                rec.master.copy_(rec.local)  # widening: exact
        params = [kept.get(id(p)) or back.get(id(p)) or fresh[id(p)] for p in tensors]
        group_of = [gi for gi, g in enumerate(param_groups) for p in g["params"]
                    if id(p) not in self.on_device]
        for rec, gi in zip(params, group_of):
            rec.group = gi  # (version: kept, so a write while it was out is adopted)
        self.params = params
        self.norm_groups = [norm_groups(rec.param, self.config.process_group) for rec in params]
        self._by_id = {id(rec.param): i for i, rec in enumerate(params)}
        self._fingerprint = self.fingerprint(param_groups)
        self.plan = MicroStepPlan.build(
            [ParamSizes(name=rec.name, numel=rec.numel, grad_itemsize=rec.param.dtype.itemsize,
                        weight_itemsize=rec.param.dtype.itemsize) for rec in params],
            chunk_numel=self.config.chunk_numel, slot_bytes=self.config.slot_bytes,
            slots=self.config.slots, forward_order=self.config.overlap != "backward")
        for rec in params:
            rec.ensure_state(self.state_keys(param_groups[rec.group]), self.pin)

    def adopt_model(self, model: torch.nn.Module) -> None:
        """The model of an optimizer built from parameters only, now seen: its names.
        (The caller re-indexes, so that the plan's gates take them.)

        Raises:
            ConfigError: a parameter of the optimizer is not in ``model``.
        """
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        missing = [rec.name for rec in self.params if id(rec.param) not in names]
        if missing:
            raise ConfigError(f"the parameters {missing[:4]} are not in the model "
                              f"{type(model).__name__}")
        for rec in [*self.params, *self._retired.values()]:
            rec.name = names.get(id(rec.param), rec.name)
        self.names = names
        self.model = model
        self._fingerprint = ()  # (re-index: the names are in the plan)

    def host_bytes(self) -> dict[str, int]:
        """Bytes of host state: ``master_bytes_host``, ``grad_sum_bytes_host`` and
        ``state_bytes_host`` (the per-element optimizer state), of every parameter it
        holds, retired ones too."""
        recs = [*self.params, *self._retired.values()]
        return {"master_bytes_host": sum(_nbytes(rec.master) for rec in recs),
                "grad_sum_bytes_host": sum(_nbytes(rec.acc) for rec in recs),
                "state_bytes_host": sum(_nbytes(t) for rec in recs for t in rec.state.values())}

    # -- following the model ---------------------------------------------------------------
    def written_from_outside(self) -> list[OffloadedParam]:
        """Parameters whose weight something else wrote since this optimizer last did
        (``model.load_state_dict``, an initializer: their version counters moved)."""
        return [rec for rec in self.params if version_of(rec.param) != rec.version]

    def adopt(self, changed: Sequence[OffloadedParam], *, outside: bool = True) -> int:
        """Make the weights written from outside the masters, unless a weight holds
        exactly its master's cast (a checkpoint of this very state, or a weight nothing
        wrote: the FP32 master's low bits are kept). Returns how many were adopted.

        ``outside``: the writes were found by their version counters (counted in
        :attr:`outside_writes`), not asked for (``refresh_masters()``)."""
        if outside:
            self.outside_writes += len(changed)
        adopted = 0
        with torch.no_grad():
            for rec in changed:
                loc = rec.local
                w = flat(loc, rec.order).to("cpu", copy=True)
                m = rec.flat_master
                if not casts_to(m, w):
                    m.copy_(w)
                    adopted += 1
                rec.version = version_of(rec.param)
        return adopted


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
