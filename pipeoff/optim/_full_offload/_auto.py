"""``FullOffloadOptimizer(offload_fraction="auto")``: the fastest fraction whose device
part fits a device memory budget, by a step-time model of full offload from rates
measured at construction (the choice itself: ``_offload/_auto.py``'s ``choose``).

[Note: full offload's step-time model]

A device-part parameter keeps its FP32 master, optimizer state and FP32 gradient sum
in device memory (``w = 4·n·(2 + k)`` bytes for ``n`` elements and ``k`` state
tensors) and steps with torch's kernel on the device; a host-part parameter's
gradient goes to the host (``g`` bytes per element, the parameters' dtype), the host
step updates its master and state in host memory, and its weight comes back (``g``
bytes). The two parts run concurrently. With ``E_d``/``E_h`` elements in the device
and host parts and ``c`` elements in one chunk of the host pipeline::

    L    = g / B_d2h + g / B_h2d                 (the link, per element, both ways)
    t(f) = max(E_d / r_dev,  (E_h - c)·max(L, 1 / r_host) + c·(L + 1 / r_host))

with ``c = min(chunk, E_h)``: the host pipeline runs at its slower stage (the link,
both directions counted as sharing it, or the host step) plus one chunk's fill
through both (one chunk holding the whole host part does not pipeline). ``r_dev`` (the optimizer's
step on FP32 elements on the device), ``B_h2d``/``B_d2h`` (pinned copies) and
``r_host`` (full offload's own host step, native if it is to be had, else torch's, on
a scratch master and state of 1M elements with the rank's threads) are measured on
the parameters' device at construction.

The device memory of a fraction is the device part's masters, state and sums,
plus, with ``accumulate="gpu"``, the host part's FP32 gradient sums kept on the
device during an accumulation (``4·E_h`` bytes); full offload's gradient and weight
copies go through pinned host slots, and no other device staging is counted. Ties (within ``TIE``)
go to the largest fraction, as for ``OffloadOptimizer``: with a GPU (a fast device
step, a link-bound host part) that is the smallest fraction that fits; on a CPU
"device" where torch's device step is no faster than the host step, the fraction
that balances the two parts, or all on the host where the host step is faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pipeoff import _accel, _compat
from pipeoff._compat import local_tensor as local
from pipeoff._errors import ConfigError, PlanMismatchError
from pipeoff._validate import check_bytes
from pipeoff.optim import _update
from pipeoff.optim._full_offload import _host_kernel
from pipeoff.optim._full_offload._config import accepted, refuse_set
from pipeoff.optim._offload._auto import (
    FractionChoice,
    Rates,
    _budget,
    _seconds,
    agree,
    choose,
)

__all__ = ["full_auto", "full_seconds", "is_auto", "measure_full_rates", "numeric",
           "resolve"]


def _host_step_rate(optimizer_class: type[torch.optim.Optimizer], defaults: Mapping[str, Any],
                    threads: int | None, numel: int) -> float:
    """Elements per second of full offload's host step on ``numel`` FP32 elements."""
    p = torch.zeros(numel)
    g = torch.full_like(p, 1e-3)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    hyper = _host_kernel.adam_hyper(optimizer_class, {**defaults, "fused": True})
    kernel = _host_kernel.host_kernel(warn=False) if hyper is not None else None
    if kernel is not None and hyper is not None:
        n = threads or _host_kernel.default_threads()
        step = [0.0]

        def run() -> None:
            step[0] += 1
            kernel.adam_step(p, g, m, v, None, hyper, step=step[0], scale=None, threads=n,
                             announce=False)
    else:
        q = p.clone().requires_grad_(True)
        q.grad = g
        opt = optimizer_class([q], **accepted(optimizer_class, defaults))

        def run() -> None:
            _compat.step_body(type(opt))(opt)  # (no global step hooks)
    return numel / _seconds(run, lambda: None)


def measure_full_rates(optimizer_class: type[torch.optim.Optimizer],
                       defaults: Mapping[str, Any], device: torch.device, *, pin: bool,
                       threads: int | None, nbytes: int = 8 << 20,
                       numel: int = 1 << 20) -> Rates:
    """Pinned copies of ``nbytes`` each way and ``optimizer_class``'s step of ``numel``
    FP32 elements on ``device``; full offload's host step of ``numel`` elements."""
    accel = _accel.current()
    on_accel = accel.is_device(device)

    def sync() -> None:
        if on_accel:
            accel.synchronize(device)

    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = accel.host_empty((nbytes,), torch.uint8, pinned=pin)
    h2d = _seconds(lambda: dev.copy_(host, non_blocking=pin), sync)
    d2h = _seconds(lambda: host.copy_(dev, non_blocking=pin), sync)
    p = torch.zeros(numel, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    probe = optimizer_class([p], **accepted(optimizer_class, defaults))
    # The class's step without torch's hooks: a global step hook (a logger, a
    # counter) must not see these scratch steps.
    body = _compat.step_body(type(probe))
    step = _seconds(lambda: body(probe), sync)
    host_rate = _host_step_rate(optimizer_class, defaults, threads, numel)
    return Rates(h2d_bytes_per_s=nbytes / h2d, d2h_bytes_per_s=nbytes / d2h,
                 step_elements_per_s=numel / step, host_step_elements_per_s=host_rate)


def full_seconds(rates: Rates, *, device_elements: float, host_elements: float,
                 chunk_elements: int, grad_bytes: int) -> float:
    """The model's step time (see [Note: full offload's step-time model])."""
    device = device_elements / rates.step_elements_per_s
    if host_elements <= 0:
        return device
    r_host = rates.host_step_elements_per_s or rates.step_elements_per_s
    link_per_element = grad_bytes / rates.d2h_bytes_per_s + grad_bytes / rates.h2d_bytes_per_s
    c = min(chunk_elements, host_elements)
    pipeline = ((host_elements - c) * max(link_per_element, 1 / r_host)
                + c * (link_per_element + 1 / r_host))
    return max(device, pipeline)


def full_auto(fraction: Any, params: Sequence[torch.Tensor], probe: torch.optim.Optimizer,
              optimizer_class: type[torch.optim.Optimizer], *, overlap: str,
              process_group: Any, chunk_numel: int, pin_memory: bool,
              threads: int | None, device_budget_bytes: int | str | None,
              ddp: bool = False, accumulate: str = "cpu",
              measure: Callable[..., Rates] | None = None) -> FractionChoice | None:
    """``FullOffloadOptimizer``'s ``"auto"``: the :class:`FractionChoice` for ``params``
    (``None`` for any other ``fraction``, and a budget given without ``"auto"``
    refused).

    Raises:
        ConfigError: naming ``offload_fraction``: a mode that refuses a device part
            (a ``process_group``, a model under DDP); no
            budget to be had (no ``device_budget_bytes`` off CUDA); or naming
            ``device_budget_bytes``: a budget without ``"auto"``.
    """
    if not is_auto(fraction):
        if device_budget_bytes is not None:
            check_bytes("device_budget_bytes", device_budget_bytes)
            raise ConfigError("device_budget_bytes is the budget of offload_fraction='auto' "
                              f"(got offload_fraction={fraction!r}); give both or neither")
        return None
    why = None
    if process_group is not None:
        why = "a process_group"
    elif ddp:
        why = "DistributedDataParallel"
    if why is not None:
        raise ConfigError(f"offload_fraction='auto' (a device part) is not available with "
                          f"{why}; use offload_fraction=1.0")
    params = [p for p in params if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    budget, source = _budget(device, device_budget_bytes)
    group = {"params": params, **probe.defaults}
    sizes = [local(p).numel() for p in params]  # (this rank's shard of a DTensor's)
    grad_bytes = params[0].element_size() if params else 2
    pin = bool(pin_memory) and _accel.current().available()
    rates = (measure or measure_full_rates)(optimizer_class, probe.defaults, device, pin=pin,
                                            threads=threads)
    per = 4 * (2 + len(_update.state_keys(probe, group)))
    split_weights = None
    sharded = [p for p in params if _is_dtensor(p)]
    if sharded:
        sizes, budget, rates = _agree(sizes, budget, rates, local(params[0]).device,
                                      getattr(sharded[0], "device_mesh", None))
        split_weights = [per * p.numel() for p in params]  # (global: the optimizer's split)
    weights = [per * n for n in sizes]
    total = sum(weights)
    elements = sum(sizes)
    per_element = total / max(elements, 1)

    def seconds(host_bytes: int) -> float:
        host = host_bytes / per_element if total else 0.0
        return full_seconds(rates, device_elements=elements - host, host_elements=host,
                            chunk_elements=chunk_numel, grad_bytes=grad_bytes)

    def staging_of(host_bytes: int) -> int:
        # accumulate="gpu": the host part's FP32 gradient sums on the device, 4 B an element.
        return 0 if accumulate != "gpu" or not total else int(4 * host_bytes / per_element)

    return choose(weights, elements, budget=budget, budget_source=source,
                  split_weights=split_weights,
                  chunk_bytes=int(chunk_numel * per_element), prefetch=0, rates=rates,
                  seconds=seconds, staging_of=staging_of,
                  staging_is="the host part's FP32 gradient sums, which accumulate='gpu' keeps "
                  "on the device during an accumulation, 4 B an element); give a larger "
                  "budget, or accumulate='cpu' (no device staging")


def _agree(sizes: list[int], budget: int, rates: Rates, device: torch.device,
           mesh: Any) -> tuple[list[int], int, Rates]:
    """Sharded parameters (FSDP2): what every rank of their mesh chooses from
    (:func:`~pipeoff.optim._offload._auto.agree`: the split, of global shapes, is the
    same on every rank, and so are the norm's collectives), over the mesh's groups, one
    dimension after another (a pipeline stage's mesh holds only its ranks)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return sizes, budget, rates

    def over(values: list[float], op: Any) -> list[float]:
        return _over_mesh(values, op, device, mesh)

    return agree(budget, rates, over, sizes)


def _over_mesh(values: list[float], op: Any, device: torch.device, mesh: Any) -> list[float]:
    """``values`` all-reduced (float64) over ``mesh``'s groups, one dimension after
    another (a pipeline stage's mesh holds only its ranks); the world without one."""
    import torch.distributed as dist

    from pipeoff import _dist

    groups = ([dist.group.WORLD] if mesh is None
              else [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1])
    t = torch.tensor(values, dtype=torch.float64)
    for g in groups:
        t = _dist.all_reduce_host(t, g, device, op=op)
    out: list[float] = t.tolist()
    return out


def check_same_fraction(fraction: float | str, params: Sequence[torch.Tensor]) -> None:
    """Sharded parameters (FSDP2): every rank of their mesh must split at the same
    numeric ``fraction``, or every one ask for ``"auto"``: ranks that split differently
    issue different norm collectives, and hang; ranks asking for ``"auto"`` agree on
    what they choose from (another collective) while the others would be here. One
    all-reduce at construction (none without sharded parameters or torch.distributed).

    Raises:
        ConfigError: some ranks ask for ``"auto"``, others give a number (on every rank).
        PlanMismatchError: the ranks' fractions differ (on every rank alike).
    """
    import torch.distributed as dist

    sharded = [p for p in params if _is_dtensor(p)]
    if not sharded or not dist.is_available() or not dist.is_initialized():
        return
    value = _AUTO if is_auto(fraction) else float(fraction)
    most = _over_mesh([value, -value], dist.ReduceOp.MAX, local(sharded[0]).device,
                      getattr(sharded[0], "device_mesh", None))
    high, low = most[0], -most[1]
    if high == low:
        return
    if low == _AUTO:
        raise ConfigError(
            "offload_fraction='auto' was given on some ranks of the parameters' mesh and a "
            "number on others: give every rank the same offload_fraction (the ranks choose "
            "'auto' together, from the smallest budget and the slowest rates)")
    raise PlanMismatchError(
        f"offload_fraction differs between the ranks of the parameters' mesh (from "
        f"{low:g} to {high:g}); every rank must pass the same value (ranks "
        "that split differently issue different collectives and hang)")


_AUTO = -1.0
"""``"auto"`` in :func:`check_same_fraction`'s all-reduce (a fraction is in [0, 1])."""


def is_auto(fraction: Any) -> bool:
    """Whether ``fraction`` is ``"auto"``."""
    return isinstance(fraction, str) and fraction == "auto"


def numeric(fraction: Any) -> Any:
    """``fraction`` for the config before the choice (``1.0`` for ``"auto"``)."""
    return 1.0 if is_auto(fraction) else fraction


def _is_dtensor(p: torch.Tensor) -> bool:
    """As the device part's split tells a DTensor (``_device_part.py``)."""
    return getattr(p, "placements", None) is not None or local(p) is not p


def resolve(config: Any, fraction: Any, params: Any, found: torch.nn.Module | None,
            probe: torch.optim.Optimizer, device_budget_bytes: int | str | None,
            ) -> tuple[Any, FractionChoice | None, Any]:
    """The constructor's step: ``config`` (built with ``offload_fraction=1.0`` for
    ``"auto"``) at the chosen fraction, the choice (``None`` without ``"auto"``), and
    ``params`` (a list with ``"auto"``, which reads them)."""
    if params is not None:  # (read twice: a group's iterator of parameters, listed)
        for item in params:  # (listed below: refused first, as check_group would)
            if isinstance(item, Mapping):
                refuse_set(item.get("params"), "a param group's 'params'")
        params = [{**item, "params": ([item["params"]] if isinstance(item["params"], torch.Tensor)
                                      else list(item["params"]))}
                  if isinstance(item, Mapping) and "params" in item else item
                  for item in params]
    if params is None:
        flat = [] if found is None else list(found.parameters())
    else:
        flat = []
        for item in params:
            flat.extend(item["params"] if isinstance(item, Mapping) else [item])
        flat = [t for t in flat if isinstance(t, torch.Tensor)]
    if not is_auto(fraction):
        full_auto(fraction, [], probe, config.optimizer_class, overlap=config.overlap,
                  process_group=None, chunk_numel=1, pin_memory=False, threads=None,
                  device_budget_bytes=device_budget_bytes)  # (refuses a lone budget)
        check_same_fraction(config.offload_fraction, flat)
        return config, None, params
    # Hazard: "auto" on some ranks only. Those would agree (a collective) while the
    # others checked their fraction (another): the two meet, and both hang.
    check_same_fraction(fraction, flat)
    choice = full_auto(fraction, flat, probe, config.optimizer_class, overlap=config.overlap,
                       process_group=config.process_group, chunk_numel=config.chunk_numel,
                       pin_memory=config.pin_memory, threads=config.num_threads,
                       device_budget_bytes=device_budget_bytes,
                       ddp=isinstance(found, torch.nn.parallel.DistributedDataParallel),
                       accumulate=config.accumulate)
    assert choice is not None
    return dataclasses.replace(config, offload_fraction=choice.fraction), choice, params
