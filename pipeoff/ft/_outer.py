"""DiLoCo's outer optimizer, stepped in host memory on the backup of the global parameters.

torchft steps the user's outer optimizer on the device: the parameters are
restored from the backup, their ``.grad`` set to the averaged pseudo-gradients,
and the optimizer's state (SGD's momentum, Adam's moments) lives beside them
for the whole run. :class:`HostOuterOptimizer` runs the same optimizer class,
with the same hyperparameters and flags, on the host backup itself: its
parameters *are* the backup tensors, so a step writes the new global
parameters where torchft's ``save_parameters`` would copy them, and its state
is created in host memory. The user's optimizer keeps its ``param_groups``
(a learning-rate schedule edits them; they are read at every sync) and never
holds state.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import optim

from pipeoff._errors import ConfigError
from pipeoff.ft._outer_kernel import (
    AdamHyper,
    SgdHyper,
    native_takes,
    outer_hyper,
    outer_kernel,
)
from pipeoff.optim._full_offload._host_kernel import default_threads
from pipeoff.optim._update import ELEMENTWISE

__all__ = ["HOST_OUTER_OPTIMIZERS", "HostOuterOptimizer", "WaitingState", "check_outer",
           "host_outers", "own_read"]


_OWN = threading.local()
_F = TypeVar("_F", bound=Callable[..., Any])


def own_read() -> bool:
    """Whether this thread is in pipeoff's own reads of the user's outer state (not the
    loop's: :class:`WaitingState`'s ``before`` may tell them apart)."""
    return bool(getattr(_OWN, "on", False))


def _own_reads(fn: _F) -> _F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = own_read()
        _OWN.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _OWN.on = before

    return wrapper  # type: ignore[return-value]


HOST_OUTER_OPTIMIZERS: tuple[type[optim.Optimizer], ...] = tuple(
    cls for cls in ELEMENTWISE if cls in (optim.SGD, optim.Adam, optim.AdamW))
"""The outer optimizers DiLoCo steps on the host: those of
:data:`pipeoff.optim.ELEMENTWISE` (a step of some parameters equals the same
parameters' part of a step of all) that DiLoCo's outer step accepts."""


def check_outer(opt: Any, name: str = "outer_optimizer") -> None:
    """Refuse an outer optimizer the host cannot step exactly as the device would.

    Raises:
        ConfigError: not a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (subclasses
            are refused: their ``step`` may differ), or a group asks for
            ``capturable`` or ``differentiable`` (CUDA-graph and autograd modes that
            have no host counterpart).
    """
    if type(opt) not in HOST_OUTER_OPTIMIZERS:
        raise ConfigError(
            f"{name} must be a torch.optim.SGD, Adam or AdamW to be stepped in host memory "
            f"(offload_to_cpu=True), got {type(opt).__name__}: its step is not known to be "
            "element-wise. Use offload_to_cpu=False for other outer optimizers.")
    for gi, group in enumerate(opt.param_groups):
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ConfigError(
                    f"{name}.param_groups[{gi}] has {flag}=True, which has no host "
                    "counterpart; set it to False with offload_to_cpu=True")


class HostOuterOptimizer:
    """One user outer optimizer, mirrored on the host backups of its parameters.

    The user's optimizer keeps its ``param_groups`` and, per parameter, the *same*
    state dict object as the host optimizer's (aliased): so
    ``outer_optimizer.state_dict()`` gives the host state, in torch's format.
    State that arrives in the user's optimizer otherwise (its
    ``load_state_dict()`` before or after DiLoCo was built, which puts the
    tensors on the parameters' device) is adopted by :meth:`sync_from_user`: moved
    to the host, and the device copy dropped. State removed from the user's
    optimizer (a reset: ``state.clear()``, ``del state[p]``) is dropped from the
    host's there too, so the next step starts it afresh, as torch's would.

    Args:
        user: the user's outer optimizer (its ``param_groups`` hold the device
            parameters).
        host_of: per device parameter (by ``id``), its host backup tensor.
        name: the user's name for the optimizer, for errors.

    Raises:
        ConfigError: a parameter of ``user`` has no backup in ``host_of``.
    """

    def __init__(self, user: optim.Optimizer, host_of: Mapping[int, torch.Tensor],
                 name: str = "outer_optimizer") -> None:
        self.user = user
        self.name = name
        groups = []
        for gi, group in enumerate(user.param_groups):
            params = []
            for p in group["params"]:
                h = host_of.get(id(p))
                if h is None:
                    raise ConfigError(
                        f"{name}.param_groups[{gi}] holds a parameter (shape "
                        f"{tuple(p.shape)}) that is in none of the model fragments it steps; "
                        "with offload_to_cpu=True every outer parameter must belong to its "
                        "fragment (one outer optimizer per fragment, or one for all)")
                params.append(h)
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": params})
        self.host: optim.Optimizer = type(user)(groups)  # type: ignore[call-arg]
        self._layout = self._ids()
        self._by_host = {id(h): h for g in self.host.param_groups for h in g["params"]}
        self._group_of = {id(h): gi for gi, g in enumerate(self.host.param_groups)
                          for h in g["params"]}
        self._shown: dict[int, dict[str, Any]] = {}
        """Per backup (``id``), the host state dict last put in the user's optimizer: an
        entry the user's then lacks was removed by the user, not yet shown to it."""
        self._state_obj: Any = None
        """The user's ``state`` object at the last :meth:`alias` (or :meth:`note_state`):
        another one there since was put by the loop (``outer.state = defaultdict(dict)``,
        a reset), which removes every entry it lacks, shown yet or not."""
        self.sync_from_user()

    def _ids(self) -> list[list[int]]:
        return [[id(p) for p in g["params"]] for g in self.user.param_groups]

    def _pairs(self) -> Any:
        for ug, hg in zip(self.user.param_groups, self.host.param_groups):
            yield from zip(ug["params"], hg["params"])

    def check_layout(self) -> None:
        """Refuse ``param_groups`` whose parameters changed since construction.

        Raises:
            ConfigError: groups or parameters were added, removed or reordered.
        """
        if self._ids() != self._layout:
            raise ConfigError(
                f"{self.name}.param_groups changed (groups or parameters added, removed or "
                "reordered) after DiLoCo was built; build a new DiLoCo")

    @_own_reads
    def sync_from_user(self) -> None:
        """Copy the user's current hyperparameters (an edited ``lr``) into the host
        optimizer's groups, and adopt state loaded into the user's optimizer.

        Raises:
            ConfigError: the user's ``param_groups`` changed their parameters.
        """
        self.check_layout()
        for a, b in zip(self.user.param_groups, self.host.param_groups):
            for k, v in a.items():
                if k != "params":
                    b[k] = v
        user_state, host_state = self.user.state, self.host.state
        if any(user_state.get(p) and user_state.get(p) is not host_state.get(h)
               for p, h in self._pairs()):
            # The user's optimizer got state of its own: take it (torch's loader
            # casts it to the host parameters' device), then drop the device copy.
            self.host.load_state_dict(self.user.state_dict())
        for h in self._removed():
            # Hazard: stepping on with the state the user removed (a momentum reset by
            # outer.state.clear(), del, or loading a state dict without it), where
            # torchft's next step starts it afresh.
            del host_state[h]
        self.alias(adopted=True)

    def _removed(self) -> list[torch.Tensor]:
        """The backups whose host state the user's optimizer showed and no longer holds
        (``state.clear()``, ``del state[p]``, ``state[p] = {}``, a loaded state dict
        without it)."""
        user_state, host_state = self.user.state, self.host.state
        return [h for p, h in self._pairs() if (st := host_state.get(h))
                and not user_state.get(p) and self._shown.get(id(h)) is st]

    @_own_reads
    def alias(self, adopted: bool = False) -> None:
        """Give the user's optimizer, per parameter, the host optimizer's state dict
        object (steps fill it in place); call after a step that may have created
        state (on the caller's thread, once the step is done).

        Args:
            adopted: the host state was just loaded from the user's or a checkpoint's,
                so every entry of the user's is replaced. Otherwise an entry of the
                user's that is not the host's (state loaded into the user's optimizer
                while a sync's tail ran), or that the user removed since it was shown,
                is left for the next :meth:`sync_from_user`.
        """
        user_state, host_state = self.user.state, self.host.state
        replaced = not adopted and user_state is not self._state_obj
        for p, h in self._pairs():
            st = host_state.get(h)  # (get: no empty entry is created)
            mine = user_state.get(p)
            if replaced and st and not mine:
                self._shown[id(h)] = st  # (removed by the reset: sync_from_user drops it)
            if not adopted and mine is not st and (
                    mine or (st and self._shown.get(id(h)) is st)):
                # Hazard: overwriting state the loop loaded after the decision (a
                # resume, a surgery) with the host's, or putting back state it removed
                # (a reset), which would silently undo it.
                continue
            if st:
                user_state[p] = self._shown[id(h)] = st
            else:
                user_state.pop(p, None)
                self._shown.pop(id(h), None)
        self._state_obj = user_state

    def note_state(self) -> None:
        """The user's ``state`` object was replaced by DiLoCo itself (its waiting view),
        not by the loop."""
        self._state_obj = self.user.state

    def step(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Step the host parameters of ``pairs`` (``(backup, pseudo-gradient)``), and
        only them: torch's optimizers skip a parameter without ``.grad``.

        An SGD, Adam or AdamW whose groups the native kernels take
        (:func:`~pipeoff.ft._outer_kernel.outer_hyper`) steps in one pass per
        parameter (SGD) or two around torch's square root (Adam) over the rank's
        cores, bitwise torch's step; any other runs torch's ``step()`` on the host
        tensors."""
        mine = self.held(pairs)
        if not mine:
            return
        plan = self.native_plan(mine)
        kernel = outer_kernel() if plan is not None else None
        if plan is not None and kernel is not None:
            threads = default_threads()
            for (h, g), hyper in zip(mine, plan, strict=True):
                kernel.step(h, g, self.native_state(h, hyper), hyper, threads=threads)
            return
        try:
            for h, g in mine:
                h.grad = g
            self.host.step()
        finally:
            for h, _ in mine:
                h.grad = None

    def held(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The pairs whose backup this optimizer steps (a fragment parameter left out
        of the user's outer optimizer, a frozen one, is not stepped: its backup stays,
        as torchft's does)."""
        return [(h, g) for h, g in pairs if id(h) in self._by_host]

    def state_versions(self, backups: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        """The identities and version counters of ``backups``' state tensors: an in-place
        edit of the state (a loop decaying the momentum through
        ``outer_optimizer.state``) bumps a version, a tensor put in its place is another
        object; the native kernels write through raw pointers and bump none."""
        state = self.host.state
        return [(id(v), v._version) for h in backups for v in (state.get(h) or {}).values()
                if isinstance(v, torch.Tensor)]

    def native_plan(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
                    ) -> list[SgdHyper | AdamHyper] | None:
        """Per pair, the hyperparameters the native kernel steps it with, if it takes
        every pair (:func:`~pipeoff.ft._outer_kernel.outer_hyper`, ``native_takes``);
        else ``None``. Reads ``param_groups`` and the state: on the caller's thread,
        or on a lane that the caller ordered after its edits."""
        groups = self.host.param_groups
        hypers = [outer_hyper(type(self.host), groups[self._group_of[id(h)]])
                  for h, _ in pairs]
        if all(x is not None and native_takes(h, g, self.host.state.get(h))
               for (h, g), x in zip(pairs, hypers, strict=True)):
            return hypers  # type: ignore[return-value]
        return None

    def native_state(self, h: torch.Tensor, hyper: SgdHyper | AdamHyper) -> Any:
        """The state dict the native step of ``h`` fills: its own, or for SGD without
        momentum a throwaway one (torch keeps no state there; an entry would show in
        ``state_dict()``)."""
        if isinstance(hyper, SgdHyper) and hyper.momentum == 0:
            return {}
        return self.host.state[h]

    @_own_reads
    def user_changed(self) -> bool:
        """Whether the user's optimizer differs from the host's since the last
        :meth:`sync_from_user`: an edited hyperparameter, state loaded into it, or state
        removed from it."""
        for a, b in zip(self.user.param_groups, self.host.param_groups):
            for k, v in a.items():
                if k != "params" and (k not in b or b[k] is not v and not _same(b[k], v)):
                    return True
        user_state, host_state = self.user.state, self.host.state
        return any(user_state.get(p) and user_state.get(p) is not host_state.get(h)
                   for p, h in self._pairs()) or bool(self._removed())

    def state_dict(self) -> dict[str, Any]:
        """The host optimizer's state dict: the format of the user's optimizer's, with
        the state in host memory."""
        self.sync_from_user()
        return self.host.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state dict (torchft's or this class's) as torchft's checkpoint loader
        loads the user's optimizer: the state (into host memory) and the
        hyperparameters, which the user's ``param_groups`` take too."""
        self.check_layout()
        self.host.load_state_dict(state)
        for a, b in zip(self.user.param_groups, self.host.param_groups):
            for k, v in b.items():
                if k != "params":
                    a[k] = v
        self.alias(adopted=True)


def _same(a: Any, b: Any) -> bool:
    """Whether two hyperparameter values are equal (tensors bit for bit; values that do
    not compare, such as a tensor of several elements against a number, are not)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype
                and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


class WaitingState(defaultdict):  # type: ignore[type-arg]
    """The user's outer optimizer's ``state`` while a pipelined DiLoCo is entered: every
    access calls ``before`` first, which waits for a sync's outer step still writing the
    state it holds (run under the next forward: torchft's had run before ``step()``
    returned, so the loop may read or edit the state right after it).

    A ``defaultdict(dict)`` as torch's; a copy or a pickle of it is a plain one.

    Args:
        before: called on every access, from any thread.
        data: the entries.
    """

    def __init__(self, before: Callable[[], None], data: Mapping[Any, Any]) -> None:
        super().__init__(dict, data)
        self._before = before

    def __reduce__(self) -> Any:
        self._before()
        return (defaultdict, (dict,), None, None, iter(dict.items(self)))

    def __repr__(self) -> str:
        self._before()
        return repr(defaultdict(dict, dict.items(self)))

    def clear(self) -> None:
        self._before()
        super().clear()

    def popitem(self) -> Any:
        self._before()
        return super().popitem()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._before()
        super().update(*args, **kwargs)

    def copy(self) -> Any:
        self._before()
        return defaultdict(dict, dict.items(self))

    def __getitem__(self, key: Any) -> Any:
        self._before()
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._before()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._before()
        super().__delitem__(key)

    def __contains__(self, key: object) -> bool:
        self._before()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        self._before()
        return super().__iter__()

    def __len__(self) -> int:
        self._before()
        return super().__len__()

    def get(self, key: Any, default: Any = None) -> Any:
        self._before()
        return super().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._before()
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._before()
        return super().setdefault(key, default)

    def keys(self) -> Any:
        self._before()
        return super().keys()

    def values(self) -> Any:
        self._before()
        return super().values()

    def items(self) -> Any:
        self._before()
        return super().items()


def host_outers(fragments: Sequence[Any]) -> list[HostOuterOptimizer]:
    """Per fragment, the host mirror of its outer optimizer, on that fragment's backups.

    One outer optimizer per fragment: each fragment's own backups (a parameter
    tied across fragments has a backup in each, and each fragment's sync steps
    its own, as torchft's does). One optimizer shared by the fragments: one
    mirror over all their backups.

    Raises:
        ConfigError: a shared outer optimizer over a parameter that two fragments
            hold (torchft would step it with two backups), or an outer parameter in
            no fragment.
    """
    by_opt: dict[int, list[Any]] = {}
    for f in fragments:
        by_opt.setdefault(id(f._outer_optimizer), []).append(f)
    mirrors: dict[int, HostOuterOptimizer] = {}
    for key, frags in by_opt.items():
        host_of: dict[int, torch.Tensor] = {}
        for f in frags:
            for name, p in f._model_fragment.named_parameters():
                if id(p) in host_of and len(frags) > 1:
                    raise ConfigError(
                        f"parameter {name!r} is in two model fragments that share one outer "
                        "optimizer; with offload_to_cpu=True give each fragment its own outer "
                        "optimizer")
                host_of[id(p)] = f.original_parameters[name]
        name = ("outer_optimizer" if len(by_opt) == 1 else
                f"outer_optimizer[{fragments.index(frags[0])}]")
        mirrors[key] = HostOuterOptimizer(frags[0]._outer_optimizer, host_of, name)
    return [mirrors[id(f._outer_optimizer)] for f in fragments]
