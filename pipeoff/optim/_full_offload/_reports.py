"""What a :class:`~pipeoff.optim.FullOffloadOptimizer` holds and how it steps: its
memory by place and role (:meth:`HostReports.memory_stats`) and the path its last
step's host step took (:attr:`HostReports.host_step_path`).

A mixin, as ``MastersAndCheckpoints`` is: it holds no state of its own, and reads the
parts the optimizer sets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._lifecycle import Lifecycle
    from pipeoff.optim._full_offload._one_pass import HostStepPath
    from pipeoff.optim._full_offload._param import ParamRegistry

__all__ = ["HostReports"]


class HostReports:
    """The memory and host-step reports of a full-offload optimizer."""

    _registry: ParamRegistry
    _lifecycle: Lifecycle

    def wait_for_step(self) -> None:
        raise NotImplementedError

    def memory_stats(self) -> dict[str, int]:
        """The bytes this optimizer holds, by place and role, after the step in flight
        (a first step allocates the optimizer state it lacks): the same keys as
        ``OffloadOptimizer.memory_stats()``, and its own:

        * ``state_bytes_host``: the optimizer's per-element state (AdamW: ``exp_avg``,
          ``exp_avg_sq``, 8 bytes per parameter); ``state_bytes_device``: 0;
        * ``master_bytes_host``: the FP32 masters (4);
        * ``grad_sum_bytes_host``: the FP32 gradient sums (4);
        * ``held_grad_bytes_host``: the buffer that holds a final backward's gradients
          for a one-pass step (2 per BF16 parameter, each parameter's slice aligned to
          64 bytes; allocated at the first step that holds gradients, then kept);
        * ``grad_sum_bytes_device``: ``accumulate="gpu"``'s device sums of the
          accumulation in progress (freed after each step).

        Parameters removed from ``param_groups`` keep their host state (as torch keeps
        ``opt.state[p]``) and are counted. The slot ring and the weight buffers are
        the staging pool's (``host_budget_bytes`` bounds them).

        Raises:
            BaseException: the step in flight's failure (see ``wait_for_step()``).
        """
        self.wait_for_step()
        stats = self._registry.host_bytes()
        acc = self._lifecycle.acc
        return {**stats, "state_bytes_device": 0,
                "held_grad_bytes_host": self._lifecycle.launcher.held.nbytes,
                "grad_sum_bytes_device": 0 if acc is None else sum(
                    t.numel() * t.element_size() for t in acc.device_sums.values())}

    @property
    def host_step_path(self) -> HostStepPath | None:
        """How the last ``step()``'s final micro-step reached the host step, and why
        (``None`` before the first): one pass (32 bytes per parameter: the final
        gradients held, and folded inside the native step), or the fold then the step
        (44), with the reason. ``str()`` of it reads, for example, ``"one pass (32 B):
        final backward marked, no clipping, nothing read the gradients before step()"``;
        :func:`pipeoff.optim.host_step_status` with the optimizer says it too."""
        return self._lifecycle.last_path
