"""Checkpoint I/O of full offload: torch's optimizer state dict over the registry.

Each parameter's entry is torch's (the optimizer's per-element state and its
scalars) plus ``"master"``, the FP32 master, as host tensors (DTensors like
the parameter under FSDP2). Loading checks everything before it writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError
from pipeoff.optim import _update
from pipeoff.optim._full_offload._param import ParamRegistry
from pipeoff.optim._tensors import casts_to, flat, flat_like, host_alloc, version_of, wrap_like

__all__ = ["elementwise", "entries", "entry_of", "foreign_masters_message", "foreign_master",
           "load", "pack", "plan_load", "step_entry", "write_entry"]

Plan = list[tuple[int, Mapping[str, Any]]]
"""Per parameter with a saved entry, its position and the entry."""


def elementwise(key: str, val: Any, keys: Sequence[str]) -> bool:
    """Whether a saved entry is per-element state (a tensor the parameter's size) rather
    than a scalar (``step``): by its key (the master, and the keys the optimizer
    keeps per element; a 0-d parameter's are 0-d too), else by its shape."""
    if not isinstance(val, torch.Tensor):
        return False
    return key == "master" or key in keys or val.dim() > 0


def entries(registry: ParamRegistry) -> dict[torch.Tensor, dict[str, Any]]:
    """Per parameter stepped at least once (or loaded with state), torch's state entry
    plus ``"master"``."""
    return {rec.param: entry for rec in registry if (entry := entry_of(rec))}


def entry_of(rec: Any) -> dict[str, Any]:
    """One parameter's entry (``{}``: never stepped nor loaded)."""
    if not rec.stepped and not rec.scalars and not rec.present:
        return {}
    p = rec.param
    entry: dict[str, Any] = dict(rec.scalars)
    for key in rec.present:
        entry[key] = wrap_like(p, rec.state[key])
    entry["master"] = wrap_like(p, rec.master)
    return entry


def pack(registry: ParamRegistry, param_groups: Sequence[Mapping[str, Any]],
         others: Mapping[torch.Tensor, dict[str, Any]] | None = None) -> dict[str, Any]:
    """torch's optimizer state dict (parameters numbered in ``param_groups`` order);
    ``others``: the entries of parameters the registry does not hold (a device part)."""
    state = {**entries(registry), **(others or {})}
    ids: dict[int, int] = {}
    groups = []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [ids.setdefault(id(p), len(ids)) for p in g["params"]]
        groups.append(packed)
    # (numbered and ordered as torch numbers them, whichever part holds the entry)
    numbered = sorted((ids[id(p)], v) for p, v in state.items())
    return {"state": dict(numbered), "param_groups": groups}


def plan_load(registry: ParamRegistry, param_groups: Sequence[Mapping[str, Any]],
              state_dict: Any, others: dict[int, Mapping[str, Any]] | None = None,
              defaults: Mapping[str, Any] | None = None) -> Plan:
    """Check ``state_dict`` against the live groups; what to load, by position. The
    entries of parameters the groups list but the registry does not hold (a device
    part) go into ``others``, by the parameter's ``id()``, checked alike.

    Raises:
        ConfigError: not an optimizer state dict, groups of other sizes, a group
            without a numeric hyperparameter of ``defaults`` (another optimizer
            class's), state for a parameter no group lists, or a state tensor of
            another size than its parameter.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ConfigError("load_state_dict expects an optimizer state dict (a dict with "
                          f"'state' and 'param_groups'), got {type(state_dict).__name__}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, param_groups)):
        raise ConfigError(
            "the state dict's param groups do not match this optimizer's: "
            f"{[len(s['params']) for s in saved_groups]} parameters per group saved, "
            f"{[len(g['params']) for g in param_groups]} here")
    for gi, saved in enumerate(saved_groups):
        # (Flags torch's __setstate__ fills in for older checkpoints are not asked for.)
        missing = [k for k, v in (defaults or {}).items() if k not in saved
                   and isinstance(v, (int, float, tuple)) and not isinstance(v, bool)]
        if missing:
            raise ConfigError(
                f"param group {gi} of the state dict has no {', '.join(map(repr, missing))}, "
                "which this optimizer steps with (saved by another optimizer class? torch's "
                "own would fail at its next step); nothing was loaded")
    by_id = {}
    tensor_of: dict[Any, torch.Tensor] = {}
    keys_of: dict[Any, tuple[str, ...]] = {}
    required_of: dict[Any, tuple[str, ...]] = {}
    for gi, (s, g) in enumerate(zip(saved_groups, param_groups)):
        saved_names, names = s.get("param_names"), g.get("param_names")
        if saved_names is not None and names is not None and list(saved_names) != list(names):
            bad = next(k for k, (a, b) in enumerate(zip(saved_names, names)) if a != b)
            raise ConfigError(
                f"param group {gi}: the state dict's parameter {bad} is "
                f"{saved_names[bad]!r}, this optimizer's is {names[bad]!r} (a checkpoint "
                "saved with the parameters in another order); nothing was loaded")
        for pid, p in zip(s["params"], g["params"]):
            by_id[pid] = registry.position(p)
            tensor_of[pid] = p
            keys_of[pid] = registry.state_keys(g)
            required_of[pid] = _update.required_keys(registry.probe, s)
    plan: Plan = []
    for pid, entry in state_dict["state"].items():
        if pid not in tensor_of:
            raise ConfigError(f"the state dict has state for parameter {pid!r}, which no "
                              "param group lists")
        p = tensor_of[pid]
        i = by_id[pid]
        name = registry.names.get(id(p), str(pid))
        _update.check_loaded_entry(f"parameter {pid} ({name!r})", entry, required_of[pid])
        for key, val in entry.items():
            if not elementwise(key, val, keys_of[pid]):
                continue
            # torch's shapes (global, for a DTensor): one of the same size but another
            # shape is another parameter's state (a checkpoint in another order), which
            # torch's optimizers refuse at the next step.
            if tuple(val.shape) != tuple(p.shape) or local(val).numel() != local(p).numel():
                raise ConfigError(
                    f"state {key!r} of parameter {pid} ({name!r}) has shape "
                    f"{tuple(val.shape)}, the parameter {tuple(p.shape)} (a "
                    "checkpoint saved with the parameters in another order, or of another "
                    "model); nothing was loaded")
        if i is not None:
            plan.append((i, entry))
        elif others is not None:
            others[id(p)] = entry
        else:
            raise ConfigError(f"the state dict has state for parameter {pid!r}, which this "
                              "optimizer does not hold")
    return plan


def load(registry: ParamRegistry, param_groups: Sequence[dict[str, Any]],
         saved_groups: Sequence[Mapping[str, Any]], plan: Plan) -> tuple[list[str], set[int]]:
    """Write a checked state dict: the groups' hyperparameters, each parameter's state
    and master (a parameter without a saved master, or without an entry, or whose saved
    master is another optimizer's (:func:`foreign_master`), takes the model's weight as
    its master: load the model's state dict first). Does not write the device weights.

    Returns:
        The names of the parameters whose saved master was another optimizer's; the
        positions of those whose weight was written since and is not the saved
        master's cast: their weights are to be left as they are, and the next
        adoption decides (the weight, unless by then it is the master's cast).
    """
    for s, g in zip(saved_groups, param_groups):
        for k, v in s.items():
            if k != "params":
                g[k] = v
    # Weights written since this optimizer last wrote them (the model's checkpoint,
    # loaded first; or a clamp, with the model's load to come: set_state_dict loads
    # the optimizer first): a saved master whose cast is not that weight may not be
    # the weight's master (a fresh optimizer's own, in a template a partial load left
    # as it was; a checkpoint of another run). The weight is left as it is, as torch's
    # load leaves the weights, and the next adoption takes it unless by then it is the
    # saved master's cast (the model's load came after: the FP32 bits kept; taken at
    # once, they were lost, a tester's find). A master that casts to it keeps its FP32
    # bits. Written: the version counters moved, or the weight is not the current
    # master's cast (a write that bumps none: DCP loading in place into an FSDP2
    # model's state dict).
    written = {i for i, entry in plan if "master" in entry and written_since(registry[i])}
    for rec in registry:
        rec.forget_state()
    foreign: list[str] = []
    deferred: set[int] = set()
    with torch.no_grad():
        loaded = {i for i, _ in plan}
        for i, rec in enumerate(registry):
            if i not in loaded:
                rec.flat_master.copy_(flat(rec.local, rec.order))
        for i, entry in plan:
            rec = registry[i]
            take_weight = "master" not in entry or foreign_master(entry)
            if not take_weight and i in written and not casts_to(
                    flat_like(local(entry["master"]), rec.order), flat(rec.local, rec.order)):
                deferred.add(i)
            keys = []
            keys_of_group = registry.state_keys(param_groups[rec.group])
            st = rec.ensure_state(keys_of_group, registry.pin)
            for key, val in entry.items():
                if elementwise(key, val, keys_of_group):
                    src = flat_like(local(val), rec.order)
                    if key == "master":
                        if not take_weight:
                            rec.flat_master.copy_(src)
                        continue
                    if key not in st:
                        st[key] = host_alloc([(rec.local.shape, torch.float32, rec.order)],
                                             False)[0]
                    flat(st[key], rec.order).copy_(src)
                    keys.append(key)
                elif key == "step":
                    rec.scalars[key] = step_entry(val, param_groups[rec.group])
                else:
                    rec.scalars[key] = (val.detach().clone().cpu()
                                        if isinstance(val, torch.Tensor) else val)
            rec.present = tuple(keys)
            rec.stepped = True
            if take_weight:
                rec.master.copy_(rec.local)
            if foreign_master(entry):
                foreign.append(rec.name)
    return foreign, deferred


def write_entry(registry: ParamRegistry, i: int, entry: Mapping[str, Any],
                group: Mapping[str, Any]) -> None:
    """Make parameter ``i``'s state ``entry`` (``opt.state[p] = entry``; ``{}``: none, as
    if never stepped), as torch's optimizer keeps what is written there: each
    per-element value copied into the host state, ``step`` and the other scalars kept
    as given. Its master stays (``"master"``, if given, must be it).

    Raises:
        ConfigError: a per-element value not of the parameter's shape, or a ``"master"``
            that is not the parameter's master.
    """
    rec = registry[i]
    keys_of_group = registry.state_keys(group)
    for key, val in entry.items():
        if key == "master":
            if not torch.equal(flat_like(local(val).detach().cpu(), rec.order),
                               rec.flat_master):
                raise ConfigError(
                    f"opt.state[p]['master'] of {rec.name!r} was written: the FP32 master "
                    "follows the weight (write the parameter) or load_state_dict()")
        elif elementwise(key, val, keys_of_group) and (
                tuple(local(val).shape) != tuple(rec.local.shape)):
            raise ConfigError(
                f"opt.state[p][{key!r}] of {rec.name!r} was set to a tensor of shape "
                f"{tuple(local(val).shape)}; the parameter's is {tuple(rec.local.shape)}")
    scalars: dict[str, Any] = {}
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, val in entry.items():
            if key == "master":
                continue
            if not elementwise(key, val, keys_of_group):
                scalars[key] = val  # (torch keeps the object written, a step included)
                continue
            src = flat_like(local(val).detach(), rec.order)
            cur = rec.state.get(key)
            if cur is not None and flat(cur, rec.order).data_ptr() == src.data_ptr():
                state[key] = cur  # (written back as it is)
                continue
            # A tensor of its own: one handed out before (an entry popped, kept, then
            # written back) stays the caller's, as torch's does; the step never writes it.
            state[key] = host_alloc([(rec.local.shape, torch.float32, rec.order)],
                                    registry.pin)[0]
            flat(state[key], rec.order).copy_(src)
    rec.state.clear()
    rec.state.update(state)
    rec.scalars, rec.present, rec.stepped = scalars, tuple(state), bool(entry)


def as_torch_loads(optimizer_class: type[torch.optim.Optimizer], defaults: Mapping[str, Any],
                   param_groups: Sequence[dict[str, Any]]) -> None:
    """Fill in and force the loaded groups' flags as the class's own ``load_state_dict``
    does (its ``__setstate__``): AdamW sets ``decoupled_weight_decay=True`` over an Adam
    checkpoint's ``False`` (kept, it stepped Adam's L2 decay: 2.5e-2 off torch, a
    tester's find), Adam fills in the flags an older checkpoint lacks. Run on a bare
    instance holding copies of the groups (no parameters, no state)."""
    bare = optimizer_class.__new__(optimizer_class)
    bare.__dict__["defaults"] = dict(defaults)
    groups = [{**g, "params": []} for g in param_groups]
    bare.__setstate__({"state": {}, "param_groups": groups})
    for g, done in zip(param_groups, bare.param_groups):
        g.update({k: v for k, v in done.items() if k != "params"})


def written_since(rec: Any) -> bool:
    """Whether ``rec``'s weight was written since this optimizer last wrote it: its
    version counters moved, or it is not its master's cast (a copy to the host)."""
    return version_of(rec.param) != rec.version or not casts_to(
        rec.flat_master, flat(rec.local, rec.order))


def foreign_masters_message(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more"
                                                     if len(names) > 3 else "")
    return (f"FullOffloadOptimizer.load_state_dict: {len(names)} saved 'master' "
            f"entries ({shown}) are not FP32, so this optimizer did not save them: the state "
            "dict went through another optimizer (torch's, or OffloadOptimizer), which kept "
            "them as state, cast to the parameter's dtype, and never stepped them. Those "
            "masters were taken from the model's weights (widened), as for a plain "
            "optimizer's state dict: load the model's state dict before the optimizer's.")


def foreign_master(entry: Mapping[str, Any]) -> bool:
    """Whether ``entry``'s ``"master"`` is not one this optimizer saved (always FP32):
    another optimizer kept it as state, cast to the parameter's dtype, and never stepped
    it. Writing the weight from it would silently roll the model back."""
    m = entry.get("master")
    return isinstance(m, torch.Tensor) and m.dtype != torch.float32


def step_entry(val: Any, group: Mapping[str, Any]) -> Any:
    """A loaded ``step`` as torch's optimizers keep it after ``load_state_dict``: a
    tensor (an older checkpoint's plain number becomes one), FP32 for a fused or
    capturable group (``Optimizer._process_value_according_to_param_policy`` and
    ``Adam.__setstate__``)."""
    fused = bool(group.get("fused") or group.get("capturable"))
    if not isinstance(val, torch.Tensor):
        dtype = (torch.float32 if fused or torch.get_default_dtype() != torch.float64
                 else torch.float64)
        return torch.tensor(float(val), dtype=dtype)
    t = val.detach().clone().cpu()
    return t.to(torch.float32) if fused else t

