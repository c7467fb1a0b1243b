"""DiLoCo's outer step taken before the quorum's decision, into spare tensors.

With ``fragment_sync_delay`` > 0, every average of a sync is in host memory long
before the decision, which comes that many inner steps later. torchft steps the
outer optimizer after the decision, and so did pipeoff's sync, under the next
forward. A speculative step takes it as soon as the averages have landed, under
the inner steps, into *spare* copies of the backups and the outer state:

* on a commit the spares are kept: each backup's storage is swapped with its
  spare's, so the tensors themselves (torchft's ``original_parameters``, the host
  optimizer's parameters) stay the same objects; the state tensors, which the
  loop reaches through ``outer_optimizer.state`` and may hold views of, are
  copied from their spares (S to 2 S bytes); what is left after the decision is
  that copy and the merge's copies;
* on a reject they are dropped: the backups and the state were never written.

Everything that reads the backups or the outer state before the decision (a
healing peer through torchft's checkpoint function, the user's
``outer_optimizer.state_dict()``) sees them as torchft's would: not yet stepped.

Exact when the step taken is the one the decision would have taken: the
hyperparameters and the state of ``prepare_sync``'s time. ``perform_sync``
checks: a hyperparameter edited since (an outer learning-rate schedule), state
loaded into the user's optimizer or edited in place (its version counters), or
a healing load of the backups and state, and the step is then taken after the
decision in place, as without speculation
(:meth:`SpeculativeStep.take_in_place`).

Only where the native kernels step every parameter (they step any host tensors);
torch's own step runs on the host optimizer's parameters, which are the backups.
Memory: a second copy of the backups and of the outer state in host memory (SGD
with momentum: 2 S; Adam, AdamW: 3 S, S the fragment's FP32 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeoff import _accel
from pipeoff.ft._outer import HostOuterOptimizer
from pipeoff.ft._outer_kernel import AdamHyper, SgdHyper, outer_kernel
from pipeoff.optim._full_offload._host_kernel import default_threads

__all__ = ["SpeculativeStep"]

Hyper = SgdHyper | AdamHyper


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the storages of ``a`` and ``b`` (same shape, dtype, contiguous), each
    tensor object keeping its identity."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    with torch.no_grad():
        a.set_(sb, 0, b.size(), b.stride())
        b.set_(sa, 0, a.size(), a.stride())


class SpeculativeStep:
    """One fragment's spares and the speculative step of its sync in flight.

    Args:
        outer: the host outer optimizer (its state is the real one).
        backups: the fragment's backups (its order).
    """

    def __init__(self, outer: HostOuterOptimizer, backups: Sequence[torch.Tensor]) -> None:
        self.outer = outer
        self.backups = list(backups)
        self._spare: dict[int, torch.Tensor] = {}
        self._spare_state: dict[int, dict[str, Any]] = {}
        self.plan: dict[int, Hyper] | None = None
        """Per backup (``id``), the hyperparameters of the sync in flight's step; ``None``:
        no speculative step for it."""
        self._versions: list[tuple[int, int]] = []
        self._accessed = False
        """The loop accessed the user's outer state since :meth:`begin`."""
        self.in_place = False
        """The step is taken after the decision, in place (the speculative one is
        dropped: its inputs changed before the decision)."""

    # -- the caller's thread -------------------------------------------------------------
    def begin(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """At ``prepare_sync``, with the user's hyperparameters just synced: whether the
        sync steps speculatively (the native kernels take every pair)."""
        self.in_place = False
        pairs = self.outer.held(pairs)
        hypers = self.outer.native_plan(pairs) if outer_kernel() is not None else None
        self.plan = (None if hypers is None else
                     {id(h): x for (h, _), x in zip(pairs, hypers, strict=True)})
        self._versions = self.outer.state_versions([h for h, _ in pairs])
        self._accessed = False
        return self.plan is not None

    def note_access(self) -> None:
        """The loop accessed the user's outer state (from any thread): it may have edited
        it where no version counter shows (torch's in-place foreach ops under a
        ``TorchDispatchMode``, or on DTensors, bump none)."""
        self._accessed = True

    def state_edited(self) -> bool:
        """Whether the outer state may have been edited in place since :meth:`begin` (the
        spares may hold a copy from before the edit; torchft's step would read it
        after): a version counter moved, a tensor was replaced, or the loop accessed the
        state at all."""
        assert self.plan is not None
        return self._accessed or self.outer.state_versions(
            [h for h in self.backups if id(h) in self.plan]) != self._versions

    def take_in_place(self) -> None:
        """Drop the speculative step: after the decision the step is taken in place,
        with the hyperparameters and state as they are then (set before the decision;
        the lane that keeps or steps waits for it)."""
        self.in_place = True

    # -- the outer lane --------------------------------------------------------------------
    def step(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The step of ``pairs`` (``(backup, averaged pseudo-gradient)``) into their
        spares, the backups and the state only read."""
        plan = self.plan
        assert plan is not None
        kernel = outer_kernel()
        assert kernel is not None
        threads = default_threads()
        for h, g in self.outer.held(pairs):
            hyper = plan[id(h)]
            spare = self._spare.get(id(h))
            if spare is None:
                spare = self._spare[id(h)] = _accel.current().host_empty(
                    h.shape, h.dtype, pinned=_accel.current().is_pinned(h))
            spare.copy_(h)
            state = self._spare_of_state(h, hyper)
            kernel.step(spare, g, state, hyper, threads=threads)

    def _spare_of_state(self, h: torch.Tensor, hyper: Hyper) -> dict[str, Any]:
        """A spare state dict for ``h``'s step, holding copies of its state (empty before
        its first step: the kernel creates it, as torch does)."""
        real = self.outer.native_state(h, hyper)
        spare = self._spare_state.setdefault(id(h), {})
        if not real:
            spare.clear()
            return spare
        for k, v in real.items():
            have = spare.get(k)
            if isinstance(v, torch.Tensor):
                if not isinstance(have, torch.Tensor) or have.shape != v.shape \
                        or have.dtype != v.dtype:
                    have = spare[k] = torch.empty_like(v)
                have.copy_(v)
            else:
                spare[k] = v
        return spare

    def keep(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After a commit: the spares become the backups and the state (storages
        swapped), or with :attr:`in_place` the step is taken in place now."""
        if self.in_place:
            self.outer.step(pairs)
            return
        plan = self.plan
        assert plan is not None
        host_state = self.outer.host.state
        for h, _ in self.outer.held(pairs):
            _swap(h, self._spare[id(h)])
            hyper = plan[id(h)]
            if isinstance(hyper, SgdHyper) and hyper.momentum == 0:
                continue  # (no state)
            spare = self._spare_state[id(h)]
            real = host_state.get(h)
            if not real:
                # The first step: the spare state becomes the state; a new spare
                # next time.
                host_state[h] = spare
                self._spare_state[id(h)] = {}
                continue
            for k, v in spare.items():
                if isinstance(v, torch.Tensor) and isinstance(real.get(k), torch.Tensor):
                    # Copied, not swapped: the loop may hold a view of a state tensor
                    # (state[p]["momentum_buffer"].view(-1), .data, .numpy()), which
                    # a swap of storages would leave on the old one.
                    real[k].copy_(v)
                else:
                    real[k] = v
