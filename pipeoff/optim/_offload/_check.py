"""check_overlap: train a few steps in overlap mode with the optimizer held back, and compare.

Overlap mode is exact only if nothing reads a parameter before the chunk that
writes it has finished. pipeoff's forward waits cover module calls, functional
reads, aliases and compiled code (``docs/optimizer.md``); what they cannot see
is a read on another thread, through code that bypasses torch functions, or a
compiled read that the first forward after ``attach()`` did not show. This
checker finds such reads on a user's own model: it trains the model in
``mode="chunked"`` (bitwise the wrapped optimizer) and in ``mode="overlap"``
with its chunks held back, so a missing wait reads the previous step's values,
and compares bit for bit. On a difference it searches, by holding back chunks
from k on and letting the earlier ones finish first, for the last chunk whose
lateness still shows: the chunk (hence the parameters) read too early. It then
watches an eager forward to name the modules that read those parameters.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pipeoff import _compat, _faults
from pipeoff._errors import ConfigError
from pipeoff._validate import short_repr

__all__ = ["OverlapReport", "check_overlap"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapReport:
    """What :func:`check_overlap` found."""

    ok: bool
    """Whether overlap mode was bitwise equal to chunked mode at every step."""
    steps: int
    """How many steps were compared."""
    first_bad_step: int | None = None
    """The first step (0-based) whose loss, or whose parameters at the end, differed."""
    parameters: tuple[str, ...] = ()
    """The parameters of the chunk that is read before it has finished (qualified names;
    one of them at least is read too early)."""
    owners: tuple[str, ...] = ()
    """The modules owning those parameters."""
    readers: tuple[str, ...] = ()
    """The modules seen reading them on the training thread (``"<outside any module>"``
    for a read outside every forward); empty if no read was seen there."""

    def format(self) -> str:
        """A report for people."""
        if self.ok:
            return (f"check_overlap: OK: overlap mode was bitwise equal to chunked mode over "
                    f"{self.steps} steps with the optimizer held back.")
        lines = [f"check_overlap: FAILED: overlap mode differs from chunked mode from step "
                 f"{self.first_bad_step} (of {self.steps})."]
        if self.parameters:
            shown = ", ".join(f"{n!r} (of module {o!r})"
                              for n, o in zip(self.parameters, self.owners))
            lines.append(f"  read before the chunk that writes it has finished: {shown}.")
            if self.readers and not set(self.readers) <= set(self.owners):
                lines.append(f"  on the training thread it is read by: {', '.join(self.readers)}"
                             " (a read that a compiled forward makes before its module runs;"
                             " run that forward eagerly, or read the parameter after its module"
                             " has run).")
            else:
                seen = (f"only its own module ({', '.join(self.readers)}) reads it, after "
                        "waiting" if self.readers else "no torch function reads it there")
                lines.append(f"  on the training thread {seen}: the early read is on another "
                             "thread, or outside torch functions. Call opt.wait_for_step() "
                             "before that read.")
        return "\n".join(lines)


def check_overlap(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    chunk_bytes: int | None = None,
    delay_s: float = 0.02,
    attach: bool = True,
    read_guard: bool = True,
) -> OverlapReport:
    """Check that ``OffloadOptimizer(mode="overlap")`` is exact on this model; the first thing
    to run on a new model.

    Args:
        model: the model, deep-copied for each run (it is not changed), or a
            function returning a fresh, identical model (for a model that does
            not deep-copy, or compiles itself).
        make_optimizer: builds the optimizer to wrap from a model, for example
            ``lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)``.
        batches: one input per step (a list; 3 to 5 are enough).
        loss_fn: ``loss_fn(model, batch) -> loss`` (a scalar tensor). The default
            calls ``model(**batch)`` for a dict batch (a tokenizer's output),
            ``model(*batch)`` for a tuple, else ``model(batch)``, and takes the
            output's ``.loss`` when it has one (a transformers model given
            ``labels``), else the mean square of the output (or of its
            ``.logits``). Pass one for anything else.
        chunk_bytes: the optimizer's ``chunk_bytes``; the default cuts the
            state into about 16 chunks, so that each holds few parameters.
        delay_s: how long each chunk is held back (seconds).
        attach: call ``opt.attach(model)``, as training should.
        read_guard: the optimizer's ``read_guard`` (check the setting you train with).

    Returns:
        An :class:`OverlapReport`; ``report.format()`` explains it.

    Raises:
        ConfigError: an argument of the wrong kind (an optimizer class for
            ``make_optimizer``), fewer than 2 batches, a bad ``delay_s``, or a model whose runs
            differ before any optimizer step (not deterministic: nothing to compare).
    """
    from pipeoff.optim.offload import OffloadOptimizer

    given: Any = make_optimizer
    if isinstance(given, torch.optim.Optimizer) or (
            isinstance(given, type) and issubclass(given, torch.optim.Optimizer)):
        name = given.__qualname__ if isinstance(given, type) else type(given).__qualname__
        what = "the class" if isinstance(given, type) else "an instance of"
        raise ConfigError(
            f"make_optimizer must build the optimizer from a model (each run trains a fresh "
            f"copy), got {what} {name}: pass lambda m: torch.optim.{name}(m.parameters(), "
            "lr=...)")
    for name, fn in (("make_optimizer", make_optimizer), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise ConfigError(f"{name} must be a function, got {short_repr(fn)}")
    if not (isinstance(model, torch.nn.Module) or callable(model)):
        raise ConfigError(f"model must be a torch.nn.Module or a function returning a fresh "
                          f"one, got {short_repr(model)}")
    for name, flag in (("attach", attach), ("read_guard", read_guard)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}")
    try:
        xs = list(batches)
    except TypeError:
        raise ConfigError(f"batches must be an iterable of inputs (a list; 3 to 5 are "
                          f"enough), got {short_repr(batches)}") from None
    if len(xs) < 2:
        raise ConfigError(f"batches must hold at least 2 inputs (a race shows from the second "
                          f"step on), got {len(xs)}")
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not delay_s > 0:
        raise ConfigError(f"delay_s must be a number of seconds > 0, got {delay_s!r}")
    fresh = _factory(model)
    loss_of = loss_fn or _default_loss
    # Every run starts from the same random state, so dropout and the like draw the
    # same numbers in each: a difference is the optimizer's, not the RNG's.
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def reseed() -> None:
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    if chunk_bytes is None:
        probe = OffloadOptimizer(make_optimizer(fresh()), mode="chunked", chunk_bytes=None)
        total = probe.plan.chunks[0].nbytes if probe.plan.chunks else 0
        chunk_bytes = max(64, total // 16)

    def run(mode: str, late_from: int | None) -> tuple[list[torch.Tensor],
                                                       list[torch.Tensor], Any]:
        """Train; in overlap mode chunks ``late_from`` and later are held back (all if 0)."""
        m = fresh()
        reseed()
        opt = OffloadOptimizer(make_optimizer(m), mode=mode,  # type: ignore[arg-type]
                               chunk_bytes=chunk_bytes, read_guard=read_guard)
        if attach:
            opt.attach(m)
        losses = []
        # A lane is FIFO: holding chunk k back holds back every later chunk too.
        delay = (contextlib.nullcontext() if late_from is None
                 else _faults.delay_task(f"opt{late_from}", delay_s))
        with delay:
            for x in xs:
                loss = loss_of(m, x)
                losses.append(loss.detach().clone())
                loss.backward()
                opt.step()
                ex = opt.last_execution
                if late_from and ex is not None and mode == "overlap":
                    # The chunks before the held-back one are done before the forward.
                    for comp in ex.events_for([f"opt{k}" for k in range(late_from)]):
                        comp.synchronize()
                opt.zero_grad()
            opt.wait_for_step()
        return losses, [p.detach().clone() for p in m.parameters()], opt

    ref_losses, ref_params, ref_opt = run("chunked", None)

    def first_bad(late_from: int) -> int | None:
        losses, params, _ = run("overlap", late_from)
        for k, (a, b) in enumerate(zip(ref_losses, losses)):
            if not torch.equal(a, b):
                return k
        if not all(torch.equal(a, b) for a, b in zip(ref_params, params)):
            return len(xs)
        return None

    bad = first_bad(0)
    if bad is None:
        return OverlapReport(ok=True, steps=len(xs))
    if bad == 0:
        # Step 0's forward runs before any optimizer step: no race can show there.
        raise ConfigError(
            "the model is not deterministic: two runs from the same state and random "
            "seed differ before any optimizer step (step 0's loss), so a race cannot be "
            "told from that. Make the forward and loss_fn deterministic (no data "
            "shuffling inside them, torch.use_deterministic_algorithms) and check again")
    # Find the last chunk whose lateness still shows: the chunk read too early.
    lo, hi = 0, len(ref_opt.plan.chunks) - 1  # first_bad(lo) is not None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if first_bad(mid) is not None:
            lo = mid
        else:
            hi = mid - 1
    m = fresh()
    root = type(_compat.compiled_original(m)).__name__
    names = {id(p): _compat.uncompiled_name(n) for n, p in m.named_parameters()}
    owners_of = {id(p): _compat.uncompiled_name(mn) or root for mn, mod in m.named_modules()
                 for p in mod.parameters(recurse=False)}
    layout = OffloadOptimizer(make_optimizer(m), mode="chunked", chunk_bytes=chunk_bytes)
    idx = sorted({s.param for s in layout.plan.chunks[lo].segments})
    # Plan segments index the parameters in param-group order (chunked modes
    # refuse duplicates, so the order is unambiguous).
    order = [p for g in layout.param_groups for p in g["params"]]
    ps = [order[i] for i in idx]
    readers = _readers(m, ps, xs[0], loss_of)
    return OverlapReport(
        ok=False, steps=len(xs), first_bad_step=bad,
        parameters=tuple(names.get(id(p), f"#{i}") for i, p in zip(idx, ps)),
        owners=tuple(owners_of.get(id(p), "?") for p in ps),
        readers=readers,
    )


class _Watch(TorchFunctionMode):
    """Records the module stack at each torch function that reads one of ``params``."""

    def __init__(self, params: Sequence[torch.Tensor], stack: list[str]) -> None:
        super().__init__()
        self.ids = {id(p) for p in params} | {id(_compat.local_tensor(p)) for p in params}
        self.ptrs = {_ptr(p) for p in params} - {0}
        self.stack = stack
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            for t in items:
                if isinstance(t, torch.Tensor) and (id(t) in self.ids or _ptr(t) in self.ptrs):
                    where = self.stack[-1] if self.stack else "<outside any module>"
                    if where not in self.seen:
                        self.seen.append(where)
        return func(*args, **kwargs)


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _readers(model: torch.nn.Module, params: Sequence[torch.Tensor], batch: Any,
             loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]) -> tuple[str, ...]:
    """The modules that read ``params`` in one eager forward (and loss) on this thread."""
    from torch.nn.modules import module as nn_module

    from pipeoff import _compat

    root = type(_compat.compiled_original(model)).__name__
    names = {m: _compat.uncompiled_name(n) or root for n, m in model.named_modules()}
    stack: list[str] = []
    def enter(m: torch.nn.Module, args: Any) -> None:
        stack.append(names.get(m, type(m).__name__))

    def leave(m: torch.nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()

    pre = nn_module.register_module_forward_pre_hook(enter)
    post = nn_module.register_module_forward_hook(leave)
    prior = _compat.force_eager()
    watch = _Watch(params, stack)
    try:
        with watch, torch.no_grad():
            loss_of(model, batch)
    finally:
        _compat.restore_stance(prior)
        pre.remove()
        post.remove()
    return tuple(watch.seen)




def _factory(model: torch.nn.Module | Callable[[], torch.nn.Module]
             ) -> Callable[[], torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        pristine = copy.deepcopy(model)
        return lambda: copy.deepcopy(pristine)
    if callable(model):
        return model
    raise ConfigError(f"model must be a torch.nn.Module or a function returning one, "
                      f"got {model!r}")


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch)`` for a dict (a tokenizer's output, the HF Trainer's batches),
    ``model(*batch)`` for a tuple, else ``model(batch)``; then the output's ``.loss``
    when it has one (a transformers ``ModelOutput`` given ``labels``), else the mean
    square of the output (its first element, or its ``.logits``)."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, tuple):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        out = logits
    elif isinstance(out, Mapping):
        out = next(iter(out.values()))
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"check_overlap cannot make a loss of the model's output ({type(out).__name__}); "
            "pass loss_fn=lambda model, batch: ... returning a scalar tensor")
    result: torch.Tensor = out.float().pow(2).mean()
    return result
