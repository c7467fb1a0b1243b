"""Full offload's masters, weights and checkpoints: the part of
:class:`~pipeoff.optim.FullOffloadOptimizer`'s surface that reads and writes the host
state as a whole (``refresh_masters``, ``refresh_device_weights``, ``state``,
``state_dict``, ``load_state_dict``), over the registry and the lifecycle.

A mixin, as ``Offloaded`` is: it holds no state of its own; the optimizer sets the
parts it names below.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from pipeoff._errors import ConfigError, GradientError
from pipeoff._held_interrupt import held_through
from pipeoff.optim._full_offload import _checkpoint
from pipeoff.optim._full_offload._common import Phase
from pipeoff.optim._full_offload._state_view import StateView
from pipeoff.optim._offloaded import fires_load_state_dict_hooks, fires_state_dict_hooks
from pipeoff.optim._tensors import NEVER

if TYPE_CHECKING:
    from pipeoff._contract import Health
    from pipeoff.optim._full_offload._config import FullOffloadConfig
    from pipeoff.optim._full_offload._fraction import FractionLifecycle
    from pipeoff.optim._full_offload._intake import GradientIntake
    from pipeoff.optim._full_offload._model_sync import ModelSync
    from pipeoff.optim._full_offload._param import ParamRegistry
    from pipeoff.optim._readers import Readers

__all__ = ["MastersAndCheckpoints"]


class MastersAndCheckpoints:
    """The masters, the device weights and checkpoints of a full-offload optimizer."""

    _registry: ParamRegistry
    _lifecycle: FractionLifecycle
    _model_sync: ModelSync
    _intake: GradientIntake
    _readers: Readers
    _health: Health
    last_trace: Any
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    _config: FullOffloadConfig

    def wait_for_step(self) -> None:
        raise NotImplementedError

    # -- the masters and the weights -----------------------------------------------------------
    def _quiesce(self) -> None:
        """Wait for every write to masters and weights: the step in flight, and under
        ``overlap="backward"`` the chunks a final backward started before ``step()``."""
        self.wait_for_step()
        failed = self._lifecycle.settle_final_backward()
        if failed is not None:
            self.last_trace = failed.trace

    def _quiesce_keeping_failures(self) -> None:
        """:meth:`_quiesce`, without raising a failed step's error (its state, torn, stale
        or dirty, is recorded and said by the next step); an interrupt is raised."""
        try:
            self.wait_for_step()
        except BaseException as err:
            if self._lifecycle.inflight is not None or isinstance(err, KeyboardInterrupt):
                # The wait was interrupted (the step still in flight), or a Ctrl-C came
                # once none was (a tester's find: load_state_dict() swallowed it).
                raise
            # The step failed: wait_for_step() classified it.
        self._quiesce()

    def refresh_device_weights(self) -> None:
        """Write every device weight from its master (the truth), e.g. after a failed copy.

        Raises:
            StepFailedError: the state is torn; also when weights were written from
                outside while stale (their write and the step they missed conflict).
        """
        self._quiesce_keeping_failures()
        self._model_sync.written_while_stale()
        self._health.check("refresh_device_weights()", stale=False)
        self._weights_from_masters()

    def _weights_from_masters(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Every weight written from its master; those in ``keep`` are left as they are,
        and taken as written from outside (the next adoption compares)."""
        for i, rec in enumerate(self._registry):
            if i in keep:
                rec.version = NEVER  # (no version_of is this: adopted, or found the cast)
                continue
            rec.weight_from_master()
        self._lifecycle.part.weights_from_masters()
        self._health.stale = None

    def refresh_masters(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Make the masters of weights written from outside the (widened) device weights,
        after something other than this optimizer wrote them through ``.data`` (which
        bumps no version counter): a committed LocalSGD average or a DiLoCo merge
        (``pipeoff.ft.LocalSGD`` and ``DiLoCo`` call this themselves, for what their
        sync wrote). Other writes (``model.load_state_dict``) are noticed at the next
        step without it.

        A weight that holds exactly its master's cast (nothing wrote it) keeps its
        FP32 master bit for bit; a written one's master is the widened weight (the
        master's bits below the compute dtype's precision are lost, as for any write).
        Without it the next step would overwrite those weights with the old masters.

        Args:
            params: the parameters whose weights were written (default: all; tensors
                this optimizer does not step are passed over).

        Raises:
            StepFailedError: the last step failed after stepping some masters, or a
                failed copy left the device weights stale (``refresh_device_weights()``).
        """
        params = None if params is None else list(params)
        positions = (range(len(self._registry)) if params is None else
                     [i for i in map(self._registry.position, params) if i is not None])
        recs = [self._registry[i] for i in positions]
        self._readers.wait()
        self._quiesce()
        # Hazard: adopting weights a failed copy left behind their stepped masters: the
        # step's work would be lost, silently (a tester's find: 1.2e-2 off after a
        # refresh_device_weights() that then wrote the stale weights back).
        self._health.check("refresh_masters()")
        # Hazard: reading weights that device work still writes (a merge on the
        # compute stream, a copy on another).
        self._model_sync.accel_sync()
        self._registry.adopt(recs, outside=False)
        self._lifecycle.part.adopt(params, only_written=False)

    def adopt_outside_writes(self) -> None:
        """Adopt now, as the next step would, the weights written from outside since the
        last step that their version counters show (``model.load_state_dict``, a clamp,
        torchft's healing load): their masters become the (widened) weights. For what
        reads the masters before that step: ``state_dict()``, a DiLoCo sync on the
        masters.

        Raises:
            ConfigError: under ``overlap="backward"``, a weight written after the final
                backward began (as ``step()`` raises).
            StepFailedError: the state is torn; also when weights were written while a
                failed copy left the device weights stale.
        """
        if self._model_sync.sync():
            self._intake.ensure_hooks()
        self._health.check("adopt_outside_writes()", stale=False)
        self._lifecycle.part.adopt()

    def host_master(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s FP32 master: the host tensor itself, shaped and strided as its
        local shard (pinned where an accelerator holds the weights). A step in flight
        writes it (``wait_for_step()`` first); a DiLoCo sync reads and writes it
        directly (``docs/diloco.md``, "Under FullOffloadOptimizer").

        Raises:
            ConfigError: ``param`` is not one of this optimizer's parameters, or is in
                the device part (``offload_fraction < 1``: its master is in device memory).
        """
        if self._lifecycle.part.owns(param) is not None:
            raise ConfigError(
                f"offload_fraction={self._lifecycle.part.fraction}: this parameter is in the "
                "device part, whose FP32 master is in device memory, not a host tensor (the "
                "DiLoCo masters contract needs offload_fraction=1.0)")
        return self._registry.host_tensor(param, "master")

    # -- checkpoints -----------------------------------------------------------------------
    @property  # type: ignore[override]
    def state(self) -> Any:
        """Per parameter with a step, torch's state (host FP32 tensors) plus ``"master"``."""
        if getattr(self, "_building", True):
            return self.__dict__.setdefault("_base_state", {})
        self._quiesce()
        return StateView({**_checkpoint.entries(self._registry),
                          **self._lifecycle.part.entries()}, self._write_state,
                         self._read_state)

    @state.setter
    def state(self, value: Any) -> None:
        if not getattr(self, "_building", True):
            # (It was kept aside and ignored: a rollback or reset that silently did nothing.)
            raise ConfigError(
                "FullOffloadOptimizer.state cannot be assigned: it is a view of the host "
                "state (masters, moments) built at each read. Replace the state with "
                "load_state_dict()")
        self.__dict__["_base_state"] = value

    def _read_state(self, param: torch.Tensor) -> dict[str, Any]:
        """``param``'s entry now (``{}``: none), for a write through a kept view."""
        self._quiesce()
        dev = self._lifecycle.part.owns(param)
        if dev is not None:
            return self._lifecycle.part.entries().get(param, {})
        i = self._registry.position(param)
        return {} if i is None else _checkpoint.entry_of(self._registry[i])

    def _write_state(self, param: torch.Tensor, entry: dict[str, Any]) -> None:
        """``opt.state[param] = entry`` (``{}``: reset), from the view (``_state_view.py``).

        Raises:
            ConfigError: ``param`` is not one of this optimizer's parameters; under
                ``overlap="backward"`` after the final backward (its chunks stepped from
                the state already); a value the state cannot hold (see ``write_entry``).
        """
        # Hazard: writing state that the step in flight (or the final backward's chunks)
        # still reads and writes.
        self._quiesce()
        life = self._lifecycle
        if (life.config.overlap == "backward" and life.acc is not None
                and life.acc.final is not None):
            raise ConfigError(
                "opt.state was written after the final backward under overlap='backward', "
                "whose chunks stepped from the state during that backward: write it before "
                "the backward, or use overlap='forward'")
        dev = life.part.owns(param)
        if dev is not None:
            life.part.write_entry(dev, entry)
            return
        i = self._registry.position(param)
        if i is None:
            raise ConfigError("opt.state was written for a tensor that is not one of this "
                              "FullOffloadOptimizer's parameters")
        _checkpoint.write_entry(self._registry, i, entry,
                                self.param_groups[self._registry[i].group])

    @fires_state_dict_hooks
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (host tensors), each entry with its FP32 ``"master"``.

        Raises:
            StepFailedError: the last step failed after stepping some masters, or a
                failed copy left the device weights stale (``refresh_device_weights()``).
            GradientError: under ``overlap="backward"``, between the final backward
                (which stepped the host part) and ``step()``: the state is a step ahead
                of the loop's (a resume would apply that batch twice), or, with a device
                part, half a step.
        """
        self._quiesce()
        # Hazard: a checkpoint pairing stepped masters with the model's stale weights (an
        # emergency save after a failed copy): a load keeps a weight its master does not
        # cast to, so the resume trained from the stale weights (a tester's find).
        self._health.check("state_dict()")
        acc = self._lifecycle.acc
        if (acc is not None and acc.final is not None
                and self._lifecycle.config.overlap == "backward"):
            half = ("; with a device part (offload_fraction < 1) step() steps that part, so "
                    "the state is half a step" if self._lifecycle.part.params else "")
            raise GradientError(
                "state_dict() between the final backward and step() under "
                "overlap='backward': that backward stepped the optimizer, so a checkpoint "
                "taken now is a step ahead of the loop's (a resume would apply this batch "
                f"twice){half}; call step() first (from a hook: a step post-hook, not a "
                "pre-hook)")
        # Hazard: saving masters older than the weights the loop wrote since the last
        # step (a clamp, a load): a resume writes every weight from its master, and
        # would silently drop the write.
        self.adopt_outside_writes()
        return _checkpoint.pack(self._registry, self.param_groups,
                                self._lifecycle.part.entries())

    @fires_load_state_dict_hooks
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (with or without ``"master"`` entries); then every device
        weight is written from its master. Either all is loaded or nothing. A master
        that is not FP32 was kept, unstepped, by another optimizer the state dict went
        through: the weight is taken as that master instead (``RuntimeWarning``).

        Clears a failed or torn step. Creating state never steps the optimizer.

        Raises:
            ConfigError: not an optimizer state dict, groups of other sizes, a
                state tensor of another size than its parameter, or state torch's step
                could not take (a meta or sparse tensor, a ``step`` that is not a
                number, a key its optimizer steps with missing); called between a
                backward and ``step()`` (see :func:`_refuse_mid_accumulation`).
        """
        self._readers.wait()
        self._quiesce_keeping_failures()
        self._lifecycle.settle_deferred()
        _refuse_mid_accumulation(self._lifecycle, self._health)
        if self._lifecycle.phase is Phase.IDLE:
            if self._model_sync.follow_param_groups():
                self._intake.ensure_hooks()
        others: dict[int, Any] = {}  # the device part's entries
        plan = _checkpoint.plan_load(self._registry, self.param_groups, state_dict, others,
                                     self.defaults)
        # Checked: now write. Gradients accumulated so far belong to the state
        # being replaced. Hazard: a Ctrl-C between two parameters' state, or between
        # the masters and the weights written from them: the old state and the new,
        # mixed (a tester's find). Held back until the load is whole, then passed on.
        with held_through("load_state_dict() wrote the optimizer's state and weights"):
            self._lifecycle.discard("discarded", classify_final=False)
            self._model_sync.accel_sync()
            foreign, undecided = _checkpoint.load(self._registry, self.param_groups,
                                                  state_dict["param_groups"], plan)
            _checkpoint.as_torch_loads(self._config.optimizer_class, self.defaults,
                                       self.param_groups)
            foreign += self._lifecycle.part.load(others, self.param_groups)
            self._health.torn = None
            self._health.dirty = None
            self._quiesce_keeping_failures()
            self._weights_from_masters(keep=undecided)  # (the rest: the loaded masters')
        if foreign:
            warnings.warn(_checkpoint.foreign_masters_message(foreign), RuntimeWarning,
                          stacklevel=3)


def _refuse_mid_accumulation(life: FractionLifecycle, health: Health) -> None:
    """Refuse a load while gradients of this step are accumulated (and nothing failed):
    torch's ``load_state_dict()`` keeps ``.grad`` and the next ``step()`` steps on it;
    dropping the host sums instead gave a silently different step (a tester's find).

    Raises:
        ConfigError: saying to load after ``step()``, or after ``zero_grad()``.
    """
    acc = life.acc
    if health.dirty is not None or health.torn is not None or (
            acc is not None and acc.failed()):
        return  # a failed accumulation: the load clears it
    if life.phase is Phase.IDLE and not life.part.with_sums():
        return
    if life.config.overlap == "backward" and acc is not None and acc.final is not None:
        # (A rollback of the step that backward took dropped its gradients: step() then
        # stepped nothing, where torch steps on them after the load; a tester's find.)
        raise ConfigError(
            "load_state_dict() between the final backward and step() under "
            "overlap='backward': that backward stepped the optimizer already, and torch "
            "steps on the gradients it keeps after a load, which this optimizer cannot "
            "do; call load_state_dict() after step(), or drop that step first with "
            "opt.zero_grad() (which keeps it, with a warning: the load then replaces it)")
    raise ConfigError(
        "load_state_dict() between a backward and step(): torch keeps the gradients "
        "accumulated since the last step in .grad and steps on them after a load, but "
        "FullOffloadOptimizer cannot carry its host gradient sums across one; call "
        "load_state_dict() after step(), or drop those gradients first with "
        "opt.zero_grad(). (torchft's Manager with use_async_quorum=True loads a healing "
        "replica's state after its backward: use use_async_quorum=False.)")
