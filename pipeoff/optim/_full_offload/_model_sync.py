"""Full offload's model sync: the live ``param_groups`` followed, and writes to the
weights made from outside adopted as masters, at a step's first gradient and at
``step()``.

:class:`ModelSync` is a sibling of the gradient intake (which calls it at a step's
first gradient) and of the optimizer (which calls it at ``step()``); it reads and
writes the registry and reads the lifecycle. It says whether it indexed new
parameters (:meth:`reindex` does; :meth:`sync` and :meth:`follow_param_groups`
return it): its caller hooks them (``GradientIntake.ensure_hooks``), so the
intake calls down to it and nothing here calls back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pipeoff import _accel, _faults
from pipeoff._errors import ConfigError
from pipeoff.optim._full_offload._config import FullOffloadConfig
from pipeoff.optim._full_offload._fraction import FractionLifecycle
from pipeoff.optim._full_offload._param import OffloadedParam, ParamRegistry
from pipeoff.optim._tensors import casts_to, flat
from pipeoff.staging import reserve_for

if TYPE_CHECKING:
    from pipeoff.optim._readers import Readers

__all__ = ["ModelSync", "late_write_message"]


def late_write_message(names: list[str]) -> str:
    """Why weights written after the final backward began are refused
    (``overlap="backward"``)."""
    return (f"the weights of {names[:4]} were written after the final backward began: "
            "under overlap='backward' its chunks step the masters and write the weights "
            "during that backward, so either this step's update or the write is lost (the "
            "weights and the masters agree). Write weights after step(), or use "
            "overlap='forward'")


class ModelSync:
    """Follows ``param_groups`` and adopts outside writes to the weights.

    Args:
        registry: the parameters and their host state.
        lifecycle: the accumulation (read: its phase, what its copy wrote).
        config: the optimizer's configuration.
        readers: transfers reading the host state (an adoption waits for them).
        param_groups: the optimizer's live ``param_groups``.
    """

    def __init__(self, registry: ParamRegistry, lifecycle: FractionLifecycle,
                 config: FullOffloadConfig, readers: Readers,
                 param_groups: Callable[[], list[dict[str, Any]]]) -> None:
        self.registry = registry
        self.lifecycle = lifecycle
        self.config = config
        self.readers = readers
        self.param_groups = param_groups
        self.state_dict_taken = False
        """The model's ``state_dict()`` handed out tensors of DTensor parameters since
        the last step, through which a write bumps no version counter: the next step
        finds written weights by content (:meth:`adopt_outside_writes`)."""

    def reindex(self) -> None:
        """Host state for the parameters of ``param_groups`` (new ones only), and the
        staging a micro-step holds, reserved now rather than in a hook. The caller
        hooks the new parameters (``GradientIntake.ensure_hooks``)."""
        self.registry.index(self.param_groups())
        reserve_for(*self.lifecycle.launcher.graph(final=True))

    def sync(self) -> bool:
        """At the first gradient of a step and at ``step()``: follow in-place edits of
        ``param_groups``, then adopt outside writes to the weights (of parameters back
        in the groups too; a write between micro-steps, or after the last backward,
        before the step's chunks begin).

        Raises:
            ConfigError: a weight written after the final backward began under
                ``overlap="backward"`` (its chunks stepped from the masters already);
                ``param_groups`` edited mid-accumulation.
        """
        reindexed = self.follow_param_groups()
        self.adopt_outside_writes()
        return reindexed

    def adopt_outside_writes(self) -> None:
        """Adopt weights written from outside as masters (:meth:`sync`'s second half;
        also, under ``overlap="backward"``, at the first gradient of each later backward
        of a step: a write between micro-steps is then the master the final backward's
        chunks step from, as under the other overlaps, where ``step()`` adopts it).

        Raises:
            ConfigError: a weight written after the final backward began under
                ``overlap="backward"``.
        """
        acc = self.lifecycle.acc
        late = self.config.overlap == "backward" and acc is not None and acc.final is not None
        by_content = self.state_dict_taken
        if not by_content and not self._written_from_outside(late):
            return
        # Our own writes first: the step in flight, waited for through the lifecycle
        # (the optimizer takes the ended step's traces and figures from it later).
        names = self.lifecycle.wait_step()
        if names:
            raise ConfigError(late_write_message(names))
        # Hazard: adopting the written weights as masters while a transfer
        # launched after the last step still reads that step's masters.
        if not _faults.disabled("adopt_waits_readers"):
            self.readers.wait()
        self.accel_sync()
        if by_content:  # every weight checked against its master's cast (a host copy)
            self.state_dict_taken = False
            self.lifecycle.part.adopt(None, only_written=False)  # (it steps at step())
            recs = self.registry.params
            if late and acc is not None:
                # The final backward's chunks write weights: only a weight whose copy
                # has landed can tell an outside write (one before its copy is lost).
                copied = acc.weights_copied()
                recs = [rec for rec in recs if id(rec.param) in copied]
            changed = [rec for rec in recs
                       if not casts_to(rec.flat_master, flat(rec.local, rec.order))]
            if not self.written_while_stale(changed):
                self.registry.adopt(changed)
            if late and changed:
                raise ConfigError(late_write_message([rec.name for rec in changed]))
            return
        # Asked again now that the step's copies are done: one that wrote a weight
        # but had not yet noted its version was no outside write.
        changed = self._written_from_outside(late)
        if not self.written_while_stale(changed):
            self.registry.adopt(changed)
        if late and changed:
            raise ConfigError(late_write_message([rec.name for rec in changed]))

    def note_state_dict(self) -> None:
        """The model's ``state_dict()`` was called: if a parameter is a DTensor, the
        next step looks for weights written through its tensors by content."""
        if not any(hasattr(p, "placements") for p in self.lifecycle.all_tensors()):
            return
        self.state_dict_taken = True

    def written_while_stale(self, changed: Sequence[OffloadedParam] | None = None) -> bool:
        """Whether weights were written from outside (``changed``; default: by their
        version counters) while a failed copy left the device weights stale: then the
        state is torn (nothing adopted, nothing overwritten).

        Hazard: a master taken from a stale weight misses the step the failed copy
        was to bring, and ``refresh_device_weights()`` undoes the write (a tester's
        find: a loop that clamped its weights, then followed the advice, trained
        2.5e-2 off)."""
        health = self.lifecycle.health
        if health.stale is None:
            return False
        changed = self.registry.written_from_outside() if changed is None else changed
        if not changed:
            return False
        if health.torn is None:
            names = ", ".join(rec.name for rec in changed[:3]) + (
                ", ..." if len(changed) > 3 else "")
            health.torn_cause = health.stale
            health.torn = (f"weights ({names}) were written from outside while the device "
                           "weights were stale (behind their masters after a failed copy): "
                           "neither the write nor the step it missed can be kept")
        return True

    def _written_from_outside(self, late: bool) -> list[OffloadedParam]:
        changed = self.registry.written_from_outside()
        acc = self.lifecycle.acc
        if late and changed and acc is not None:
            # The chunks stepping during that backward write the weights too: a
            # weight whose copy has not finished is not (yet) an outside write; the
            # copy itself notices one that came before it (LaneResults.overwritten).
            copied = acc.weights_copied()
            changed = [rec for rec in changed if id(rec.param) in copied]
        return changed

    def follow_param_groups(self) -> bool:
        """The live ``param_groups`` are the truth: parameters removed from, added to or
        moved between groups in place are picked up (between steps). Returns whether
        they were.

        Raises:
            ConfigError: they changed mid-accumulation.
        """
        groups = self.param_groups()
        if not self.registry.changed(groups):
            return False
        if self.lifecycle.acc is not None:
            raise ConfigError(
                "param_groups' parameters changed in the middle of gradient accumulation "
                "(between a backward and step()); change them after step() and zero_grad()")
        self.registry.check_groups(groups)
        self.reindex()
        return True

    def accel_sync(self) -> None:
        """Wait for the device work that writes the weights (before reading them)."""
        device = self.registry.device
        if _accel.current().is_device(device):
            _accel.current().synchronize(device)
