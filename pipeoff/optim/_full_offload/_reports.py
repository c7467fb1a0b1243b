"""What a :class:`~pipeoff.optim.FullOffloadOptimizer` holds and how it steps: its
memory by place and role (:meth:`HostReports.memory_stats`) and the path its last
step's host step took (:attr:`HostReports.host_step_path`).

A mixin, as ``MastersAndCheckpoints`` is: it holds no state of its own, and reads the
parts the optimizer sets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeoff.optim._full_offload._fraction import FractionLifecycle
    from pipeoff.optim._full_offload._one_pass import HostStepPath
    from pipeoff.optim._full_offload._param import ParamRegistry

__all__ = ["HostReports"]


class HostReports:
    """The memory and host-step reports of a full-offload optimizer."""

    _registry: ParamRegistry
    _lifecycle: FractionLifecycle

    def wait_for_step(self) -> None:
        raise NotImplementedError

    def memory_stats(self) -> dict[str, int]:
        """The bytes this optimizer holds, by place and role, after the step in flight
        (a first step allocates the optimizer state it lacks): the same keys as
        ``OffloadOptimizer.memory_stats()``, and its own:

        * ``state_bytes_host``: the host part's per-element optimizer state (AdamW:
          ``exp_avg``, ``exp_avg_sq``, 8 bytes per parameter); ``state_bytes_device``:
          the device part's (``offload_fraction < 1``; a ``step`` counts only where it
          is in an accelerator's memory, as a fused optimizer's is);
        * ``master_bytes_host``, ``master_bytes_device``: the FP32 masters (4) of each part;
        * ``grad_sum_bytes_host``: the host part's FP32 gradient sums (4);
          ``grad_sum_bytes_device``: the device part's FP32 sums of the accumulation in
          progress, plus ``accumulate="gpu"``'s device sums of host-part parameters
          (both freed after each step);
        * ``held_grad_bytes_host``: the buffer that holds a final backward's gradients
          for a one-pass step (2 per BF16 parameter, each parameter's slice aligned to
          64 bytes; allocated at the first step that holds gradients, then kept);
        * ``params_host``, ``params_device``: the parameters of each part.

        Parameters removed from ``param_groups`` keep their host state (as torch keeps
        ``opt.state[p]``) and are counted. The slot ring and the weight buffers are
        the staging pool's (``host_budget_bytes`` bounds them).

        Raises:
            BaseException: the step in flight's failure (see ``wait_for_step()``).
        """
        self.wait_for_step()
        stats = self._registry.host_bytes()
        acc = self._lifecycle.acc
        device = self._lifecycle.part.memory()
        device["grad_sum_bytes_device"] += 0 if acc is None else sum(
            t.numel() * t.element_size() for t in acc.device_sums.values())
        return {**stats, **device, "params_host": len(self._registry),
                "held_grad_bytes_host": self._lifecycle.launcher.held.nbytes}

    def _params_repr(self) -> str:
        """``params=N`` (both parts) for the optimizer's repr, after ``offload_fraction=f``
        below 1."""
        life = getattr(self, "_lifecycle", None)
        if life is None:
            return "params=0"
        f = life.part.fraction
        n = len(life.registry) + len(life.part.params)
        auto = getattr(self, "offload_choice", None) is not None
        steps = getattr(getattr(self, "_config", None), "gradient_accumulation_steps", None)
        return ("" if f == 1.0 and not auto else
                f"offload_fraction={f:.4g} (auto), " if auto else f"offload_fraction={f}, "
                ) + ("" if steps is None else f"gradient_accumulation_steps={steps}, "
                     ) + f"params={n}"

    @property
    def host_budget_bytes(self) -> int:
        """Most bytes of host staging live at once: the slot ring and two chunks' weights."""
        return self._registry.plan.host_budget_bytes

    @property
    def device(self) -> torch.device:
        """The device of the parameters (their local shards)."""
        return self._registry.device

    @property
    def offload_fraction(self) -> float:
        """About this share of the masters, optimizer state and gradient sums is in host
        memory (by bytes; the split is by whole parameters, the first ones in
        param-group order in the device part)."""
        return self._lifecycle.part.fraction

    @property
    def host_step_path(self) -> HostStepPath | None:
        """How the last ``step()``'s final micro-step reached the host step, and why
        (``None`` before the first): one pass (32 bytes per parameter: the final
        gradients held, and folded inside the native step), or the fold then the step
        (44), with the reason. ``str()`` of it reads, for example, ``"one pass (32 B):
        final backward marked, no clipping, nothing read the gradients before step()"``;
        :func:`pipeoff.optim.host_step_status` with the optimizer says it too."""
        return self._lifecycle.last_path
