"""``offload_fraction="auto"``: the fraction a device memory budget allows, chosen by a
cost model of the step from rates measured at construction.

[Note: the step-time model]

``OffloadOptimizer`` steps every parameter with the device's kernels: the device
part in one call, the host part chunk by chunk, each chunk's state copied in
before its step and out after. With ``E`` elements in all, ``S_h`` bytes of the
host part's state and a chunk of ``c`` bytes (``e`` elements), a step takes
about::

    t(f) = max(E / r_step + c / B_h2d + c / B_d2h,  S_h / B_h2d + S_h / B_d2h + e / r_step)

the device's kernels and the state's two passes over the host link overlapping
(the two directions counted as sharing the link, as they do on a PCIe switch
shared by two GPUs; the worst case): kernel-bound, the first chunk's copy in and
the last one's copy out are exposed; link-bound, one chunk's step. ``r_step``
(elements per second of the wrapped optimizer's step on the device) and
``B_h2d``/``B_d2h`` (pinned copies) are measured at construction, on the
parameters' device, in about 50 ms. The device holds the device part's state
and, when there is a host part, ``(prefetch + 1)`` chunks of staging.

A fraction is *feasible* when that device memory fits the budget; ``auto`` takes
the fastest feasible fraction, and among fractions within 2 % of the fastest (below
what rates measured in milliseconds resolve) the largest: device memory is not
spent for no time. In ``overlap`` mode the copies
also hide under the next forward, which the model does not know: its time is the
chunks' own makespan, an upper bound on what the loop sees.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pipeoff import _accel, _compat
from pipeoff._errors import ConfigError
from pipeoff._validate import check_int, parse_bytes
from pipeoff.optim._offload._args import DEFAULT_CHUNK_BYTES
from pipeoff.optim._offload._device_part import split_params

__all__ = ["FractionChoice", "Rates", "agree", "auto_fraction", "choose", "choose_fraction",
           "measure_rates", "step_seconds"]

GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Fractions always reported beside the chosen one."""
TIE = 1.02
"""Fractions within this factor of the fastest count as equally fast."""
STAGING_SHARE = 4
"""Staging gets at most a ``1 / STAGING_SHARE`` of the budget (smaller chunks)..."""
MIN_CHUNK_BYTES = 1024
"""...but chunks of at least this (128 elements of AdamW's FP32 state)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """What the model needs from the machine, measured on the parameters' device."""

    h2d_bytes_per_s: float
    """Pinned host-to-device copy bandwidth."""
    d2h_bytes_per_s: float
    """Device-to-pinned-host copy bandwidth."""
    step_elements_per_s: float
    """Elements per second of the wrapped optimizer's step on the device."""
    host_step_elements_per_s: float | None = None
    """Elements per second of the host step (full offload's; ``None`` for
    ``OffloadOptimizer``, whose steps all run on the device)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One fraction as the model sees it."""

    fraction: float
    device_bytes: int
    """The device part's state plus staging."""
    step_ms: float
    """The model's step time (:func:`step_seconds`)."""
    fits: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class FractionChoice:
    """What ``offload_fraction="auto"`` chose, and why (``repr`` and the trace's
    metadata show it).

    Sizes are bytes, times milliseconds.
    """

    fraction: float
    """The chosen ``offload_fraction``."""
    budget_bytes: int
    """The device memory the optimizer may use (state and staging)."""
    budget_source: str
    """``"device_budget_bytes"`` or ``"free device memory"``."""
    state_bytes: int
    """All of the optimizer's state."""
    staging_bytes: int
    """Device staging of the host part's chunks (``(prefetch + 1)`` chunks)."""
    chunk_bytes: int
    prefetch: int
    rates: Rates
    candidates: tuple[Candidate, ...] = field(default=())
    """The chosen fraction and :data:`GRID`, in order of fraction."""

    @property
    def reason(self) -> str:
        """One sentence: the choice, its device memory and its predicted step time."""
        mine = next(c for c in self.candidates if c.fraction == self.fraction)
        return (f"offload_fraction={self.fraction:.4g}: {mine.device_bytes} B of device "
                f"memory of a {self.budget_bytes} B budget ({self.budget_source}), predicted "
                f"step {mine.step_ms:.3g} ms; the fastest fraction that fits "
                f"(all on the host: {self.candidates[-1].step_ms:.3g} ms)")

    def as_dict(self) -> dict[str, Any]:
        """The choice as plain values (a trace's metadata)."""
        return {**asdict(self), "reason": self.reason}


def _seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls (after one untimed)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_rates(optimizer: torch.optim.Optimizer, device: torch.device, *, pin: bool,
                  nbytes: int = 8 << 20, numel: int = 1 << 20) -> Rates:
    """Time pinned copies of ``nbytes`` each way and the wrapped optimizer's class
    stepping ``numel`` elements on ``device`` (the first group's hyperparameters)."""
    accel = _accel.current()
    on_accel = accel.is_device(device)

    def sync() -> None:
        if on_accel:
            accel.synchronize(device)

    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = accel.host_empty((nbytes,), torch.uint8, pinned=pin)
    h2d = _seconds(lambda: dev.copy_(host, non_blocking=pin), sync)
    d2h = _seconds(lambda: host.copy_(dev, non_blocking=pin), sync)
    first = optimizer.param_groups[0]
    dtype = first["params"][0].dtype if first["params"] else torch.float32
    p = torch.zeros(numel, dtype=dtype if dtype.is_floating_point else torch.float32,
                    device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    accepted = inspect.signature(type(optimizer)).parameters  # (defaults may hold more)
    hyper = {k: first[k] for k in optimizer.defaults if k in first and k in accepted}
    probe = type(optimizer)([p], **hyper)
    # The class's step without torch's hooks: a global step hook (a logger, a
    # counter) must not see these scratch steps.
    body = _compat.step_body(type(probe))
    step = _seconds(lambda: body(probe), sync)  # (the untimed call creates the state)
    return Rates(h2d_bytes_per_s=nbytes / h2d, d2h_bytes_per_s=nbytes / d2h,
                 step_elements_per_s=numel / step)


def step_seconds(rates: Rates, *, elements: int, host_bytes: int, chunk_bytes: int,
                 bytes_per_element: float) -> float:
    """The model's step time (see [Note: the step-time model])."""
    device = elements / rates.step_elements_per_s
    if host_bytes == 0:
        return device
    link = host_bytes / rates.h2d_bytes_per_s + host_bytes / rates.d2h_bytes_per_s
    c = min(chunk_bytes, host_bytes)
    return max(device + c / rates.h2d_bytes_per_s + c / rates.d2h_bytes_per_s,
               link + c / bytes_per_element / rates.step_elements_per_s)


def choose(weights: Sequence[int], elements: int, *, budget: int, budget_source: str,
           chunk_bytes: int, prefetch: int, rates: Rates,
           seconds: Callable[[int], float] | None = None,
           staging_of: Callable[[int], int] | None = None,
           staging_is: str | None = None,
           split_weights: Sequence[int] | None = None,
           scalars: Sequence[int] | None = None) -> FractionChoice:
    """The fastest fraction of parameters of state ``weights`` (bytes) whose device
    memory fits ``budget``; ``split_weights``: the weights the optimizer's split is made
    on, where they are not ``weights`` (FSDP2: the split over global shapes, the bytes
    of each parameter's largest shard); ``scalars``: bytes of each parameter's scalar
    state (``step``) that a device-part parameter keeps in device memory.

    ``seconds(host_bytes)`` is the model's step time with ``host_bytes`` of the weights in
    host memory, ``staging_of(host_bytes)`` the device staging it needs beside the device
    part (defaults: ``OffloadOptimizer``'s, :func:`step_seconds` and ``(prefetch + 1)``
    chunks), ``staging_is`` what that staging is and how to shrink it (for the error).

    Raises:
        ConfigError: naming ``device_budget_bytes``: not even all state on the host
            (the staging alone) fits.
    """
    total = sum(weights)
    per_element = total / max(elements, 1)
    if seconds is None:
        def seconds(host_bytes: int) -> float:
            return step_seconds(rates, elements=elements, host_bytes=host_bytes,
                                chunk_bytes=chunk_bytes, bytes_per_element=per_element)
    if staging_of is None:
        staging = (prefetch + 1) * chunk_bytes

        def staging_of(host_bytes: int) -> int:
            return (prefetch + 1) * min(chunk_bytes, host_bytes) if host_bytes else 0
    else:
        staging = staging_of(total)
    best_share = 0.0 if total <= budget else max(0.0, 1.0 - (budget - staging) / max(total, 1))
    fractions = sorted({min(1.0, best_share), *GRID})
    cands = []
    for f in fractions:
        split = split_params(weights if split_weights is None else split_weights, f)
        on_device = sum(weights[i] for i in split.on_device)
        host_bytes = total - on_device
        used = on_device + staging_of(host_bytes) + (
            0 if scalars is None else sum(scalars[i] for i in split.on_device))
        cands.append(Candidate(fraction=f, device_bytes=used, fits=used <= budget,
                               step_ms=1e3 * seconds(host_bytes)))
    feasible = [c for c in cands if c.fits]
    if not feasible:
        raise ConfigError(
            f"device_budget_bytes={budget} (the budget of offload_fraction='auto') cannot "
            f"hold even the staging of an all-host step: {cands[-1].device_bytes} B "
            + (f"({staging_is})" if staging_is else
               f"({prefetch + 1} chunks of {chunk_bytes} B); give a larger budget, or a "
               "smaller chunk_bytes or prefetch"))
    fastest = min(c.step_ms for c in feasible)
    chosen = max((c for c in feasible if c.step_ms <= fastest * TIE), key=lambda c: c.fraction)
    return FractionChoice(fraction=chosen.fraction, budget_bytes=budget,
                          budget_source=budget_source, state_bytes=total,
                          staging_bytes=staging, chunk_bytes=chunk_bytes, prefetch=prefetch,
                          rates=rates, candidates=tuple(cands))


def _budget(device: torch.device, given: int | str | None) -> tuple[int, str]:
    if given is not None:
        return parse_bytes(given, name="device_budget_bytes"), "device_budget_bytes"
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "free device memory"
    raise ConfigError(
        "offload_fraction='auto' needs device_budget_bytes here: the parameters are on "
        f"{device}, which reports no free device memory to budget from; give the bytes "
        "of device memory the optimizer may use (state and staging)")


Reduce = Callable[[list[float], Any], list[float]]
"""``values`` all-reduced (float64) by a ``dist.ReduceOp`` over the ranks that agree."""


def agree(budget: int, rates: Rates, over: Reduce, sizes: Sequence[int] = ()
          ) -> tuple[list[int], int, Rates]:
    """What every rank chooses from, so that all choose the same fraction: the largest
    of each of ``sizes``, the smallest budget and the slowest rates (the slowest rank
    sets the step's time). Each rank measures its own, and they differ (a busy rank,
    another GPU's free memory): ranks that chose apart would disagree on the chunk
    plan, or step their parameters apart."""
    import torch.distributed as dist

    most = over([*sizes, -budget], dist.ReduceOp.MAX)
    fields = [f.name for f in dataclasses.fields(rates)]
    vals = [getattr(rates, f) for f in fields]
    least = over([float("inf") if v is None else v for v in vals], dist.ReduceOp.MIN)
    new: dict[str, Any] = {f: None if v is None else x for f, v, x in zip(fields, vals, least)}
    agreed: Rates = dataclasses.replace(rates, **new)
    return [int(n) for n in most[:-1]], int(-most[-1]), agreed


def _over_group(group: Any, device: torch.device) -> Reduce | None:
    """The reduction over ``group`` (default: the world), or ``None`` without
    torch.distributed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from pipeoff import _dist

    def over(values: list[float], op: Any) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        out: list[float] = _dist.all_reduce_host(
            t, dist.group.WORLD if group is None else group, device, op=op).tolist()
        return out

    return over


def _auto_on_every_rank_or_none(auto: bool, optimizer: torch.optim.Optimizer,
                                group: Any) -> None:
    """With torch.distributed, check that every rank of ``group`` asks for ``"auto"``
    or none does (every rank of a chunked mode calls this, a collective).

    Hazard: ranks asking for ``"auto"`` agreeing (:func:`agree`) while the others are
    already in the plan check: the two collectives meet each other, and both block
    until the group's timeout.

    Raises:
        ConfigError: on every rank, when some ask for ``"auto"`` and others do not.
    """
    import torch.distributed as dist

    params = [p for g in optimizer.param_groups for p in g["params"]]
    over = _over_group(group, params[0].device if params else torch.device("cpu"))
    if over is None:
        return
    flag = 1.0 if auto else 0.0
    most, least = over([flag, -flag], dist.ReduceOp.MAX)
    if most != -least:
        raise ConfigError(
            "offload_fraction='auto' was given on some ranks of process_group and a number "
            "on others: give every rank the same offload_fraction (the ranks choose "
            "'auto' together, from the smallest budget and the slowest rates)")


def choose_fraction(optimizer: torch.optim.Optimizer, weights: Sequence[int], elements: int,
                    device: torch.device, *, chunk_bytes: Any, prefetch: int | None,
                    device_budget_bytes: int | str | None, pin: bool,
                    measure: Callable[..., Rates] | None = None,
                    scalars: Sequence[int] | None = None,
                    process_group: Any = None) -> FractionChoice:
    """``offload_fraction="auto"``: the budget (``device_budget_bytes``, or the free
    device memory on CUDA), the staging (``prefetch`` chunks ahead, default 2, of
    ``chunk_bytes``, at most a quarter of the budget), the rates (measured), the
    choice.

    Raises:
        ConfigError: no budget to be had (no ``device_budget_bytes`` off CUDA), a bad
            ``chunk_bytes``/``prefetch``, or a budget that holds not even the staging.
    """
    budget, source = _budget(device, device_budget_bytes)
    check_int("prefetch", prefetch, minimum=0, optional=True)
    prefetch = 2 if prefetch is None else prefetch
    chunk = (DEFAULT_CHUNK_BYTES if chunk_bytes is None
             else parse_bytes(chunk_bytes, name="chunk_bytes"))
    rates = (measure or measure_rates)(optimizer, device, pin=pin)
    over = _over_group(process_group, device)
    if over is not None:  # (the ranks of process_group check the plan collectively)
        _, budget, rates = agree(budget, rates, over)
    chunk = max(min(chunk, MIN_CHUNK_BYTES), min(chunk, budget // (STAGING_SHARE * (prefetch + 1))))
    return choose(weights, elements, budget=budget, budget_source=source, chunk_bytes=chunk,
                  prefetch=prefetch, rates=rates, scalars=scalars)


def scalar_bytes(optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any],
                 device: torch.device) -> int:
    """Bytes of scalar state (``step``) that one parameter of ``group`` keeps where
    ``memory_stats()`` counts it as device memory: on an accelerator, the tensors on it
    (a fused or capturable optimizer's); elsewhere all of them. Found by stepping the
    class once on a one-element parameter on ``device`` (0 if that fails)."""
    taken = inspect.signature(optimizer_class).parameters
    hyper = {k: v for k, v in group.items() if k != "params" and k in taken}
    accel = _accel.current()
    try:
        probe = torch.zeros(1, device=device, requires_grad=True)
        opt = optimizer_class([probe], **hyper)
        probe.grad = torch.zeros_like(probe)
        _compat.step_body(optimizer_class)(opt)  # (no step hooks: this is no step of theirs)
        state = opt.state[probe]
    except Exception:  # noqa: BLE001 - an estimate: none where the probe cannot run
        return 0
    return sum(v.numel() * v.element_size() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() == 0
               and (accel.on_device(v) if accel.is_device(device) else True))


def auto_fraction(optimizer: torch.optim.Optimizer, mode: str, fraction: Any,
                  chunk_bytes: Any, prefetch: int | None, lookahead: int | None,
                  device_budget_bytes: int | str | None, pin_memory: bool,
                  process_group: Any = None) -> FractionChoice | None:
    """``OffloadOptimizer``'s ``"auto"``: the :class:`FractionChoice` for its live param
    groups (``None`` for any other ``fraction``). ``chunk_bytes`` is ``None`` for the
    default; ``lookahead`` is ``prefetch``'s old name. With torch.distributed the ranks
    of ``process_group`` (default: the world) agree on what they choose from
    (:func:`agree`): a collective, as the constructor's plan check is.

    Raises:
        ConfigError: as :func:`choose_fraction`; or in ``single_pass`` (its step holds
            all the state on the device), or both of ``prefetch`` and ``lookahead``.
    """
    auto = isinstance(fraction, str) and fraction == "auto"
    if mode != "single_pass":
        _auto_on_every_rank_or_none(auto, optimizer, process_group)
    if not auto:
        return None
    from pipeoff.optim._offload._layout import build_layout
    from pipeoff.optim._plan import planned_numel

    if mode == "single_pass":
        raise ConfigError("offload_fraction='auto' needs a chunked mode: mode='single_pass' "
                          "holds all of the state on the device during its step")
    if prefetch is not None and lookahead is not None:
        raise ConfigError("give prefetch (the new name of lookahead), not both")
    layout = build_layout(optimizer, chunked=True, chunk_bytes=None)
    pin = bool(pin_memory) and _accel.current().available()
    per_group = [scalar_bytes(type(optimizer), g, layout.device)
                 for g in optimizer.param_groups]
    return choose_fraction(optimizer, layout.split.weights,
                           sum(planned_numel(p) for p in layout.params), layout.device,
                           chunk_bytes=chunk_bytes, prefetch=prefetch if lookahead is None
                           else lookahead, device_budget_bytes=device_budget_bytes, pin=pin,
                           scalars=[per_group[g] for g in layout.group_of],
                           process_group=process_group)
