"""The typed contract between pipeoff's optimizers and what reads them.

Four readers depend on an optimizer without knowing which one it is:

* the forward waits (``pipeoff.optim._waits.ForwardWaits``) read a
  :class:`StepWrites`: which tasks of a step in flight write which parameters;
* :class:`pipeoff.transfer.StateTransfer` (``LiveTensor.from_optimizer``) reads
  :class:`HostState`: a parameter's host state and when it is ready, and
  registers itself as a reader that the next write waits for;
* ``pipeoff.ft.LocalSGD`` waits for an :class:`AsyncStep` before it averages,
  and has a :class:`MasterCopy` adopt the averaged weights;
* everyone reads :class:`Health`: what a failed step left.

Both :class:`~pipeoff.optim.OffloadOptimizer` and
:class:`~pipeoff.optim.FullOffloadOptimizer` implement
:class:`OffloadedOptimizer` (``tests/optim/test_contract.py`` and mypy check it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from pipeoff._errors import StepFailedError

if TYPE_CHECKING:
    from pipeoff.execution import Completion, Execution

__all__ = ["AsyncStep", "Attachable", "Health", "HostState", "MasterCopy",
           "OffloadedOptimizer", "StepCount", "StepWrites", "steps_taken"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepWrites:
    """What a step in flight writes: all that the forward waits read of it.

    Indices are positions in ``params``.
    """

    execution: Execution
    """The step's execution."""
    write_tasks: tuple[str, ...]
    """Per chunk ``k``, the task after which chunk ``k``'s parameters are written."""
    params: tuple[torch.Tensor, ...]
    """The optimizer's parameters, in its order."""
    chunks_of: tuple[tuple[int, ...], ...]
    """Per parameter, the chunks that write it."""
    device: torch.device
    """The device of the parameters (their local shards)."""
    written: tuple[int, ...]
    """The parameters the step writes."""
    grad_of: Callable[[int], torch.Tensor | None]
    """Per written parameter, the gradient its chunks still read (a writer of it waits
    too), or ``None``. Called once per parameter when the waits begin; it holds no
    reference of its own, so a gradient the user drops is freed as its chunk ends."""


class Health:
    """What a failed step left, which later calls refuse until it is cleared.

    Written by the optimizer on the caller's thread (``dirty`` also from a
    gradient hook, on autograd's thread, while the caller is in ``backward()``);
    each field is one reference, read and written whole.
    """

    __slots__ = ("dirty", "stale", "torn", "torn_cause")

    def __init__(self) -> None:
        self.torn: str | None = None
        """Why the parameters (or masters) and state are partly stepped; cleared by
        ``load_state_dict``."""
        self.torn_cause: BaseException | None = None
        """The failure that tore them, chained to each refusal."""
        self.dirty: BaseException | None = None
        """A failure of the accumulated gradients (nothing was stepped); cleared by
        ``zero_grad()``."""
        self.stale: BaseException | None = None
        """A failed copy left device weights behind their stepped masters; cleared by
        ``refresh_device_weights()``."""

    def check_dirty(self, what: str) -> None:
        """Refuse ``what`` while a failure that stepped nothing is not cleared.

        Raises:
            StepFailedError: chained to that failure.
        """
        if self.dirty is not None:
            raise StepFailedError(
                f"{what} refused: this step failed before any master was stepped "
                f"({self.dirty}); it refuses until opt.zero_grad() clears the "
                "accumulated gradients") from self.dirty

    def check(self, what: str, *, stale: bool = True) -> None:
        """Refuse ``what`` if the state is torn (or, with ``stale``, the weights stale).

        Raises:
            StepFailedError: naming ``what``, what failed and how to go on.
        """
        if self.torn is not None:
            raise StepFailedError(
                f"{what} refused: {self.torn}, so the parameters and optimizer state are "
                "not those of a whole step the loop asked for (partly stepped, or stepped "
                "by a backward that then raised). Load a checkpoint (the model's and this "
                "optimizer's load_state_dict) to go on; with torch.distributed.checkpoint, "
                "take the template for dcp.load from a freshly built model and optimizer "
                "(set_state_dict() loads into these without calling state_dict()).") \
                from self.torn_cause
        if stale and self.stale is not None:
            raise StepFailedError(
                f"{what} refused: the device weights are stale (a host-to-device copy "
                "failed after the masters were stepped); call "
                "opt.refresh_device_weights() (before a checkpoint: then the model's weights "
                "are the masters' too)") from self.stale

    def __repr__(self) -> str:
        return f"Health(torn={self.torn!r}, dirty={self.dirty!r}, stale={self.stale!r})"


@runtime_checkable
class StepCount(Protocol):
    """An optimizer that counts its ``step()`` calls (pipeoff's): the number its spans,
    per-step figures and the syncs that follow a step carry."""

    @property
    def steps_taken(self) -> int:
        """``step()`` calls so far."""


def steps_taken(opt: Any) -> int | None:
    """``opt``'s :attr:`StepCount.steps_taken`, or ``None`` for an optimizer that does
    not count (torch's)."""
    return opt.steps_taken if isinstance(opt, StepCount) else None


@runtime_checkable
class AsyncStep(Protocol):
    """An optimizer whose ``step()`` may return while its writes are still landing."""

    def wait_for_step(self) -> None:
        """Block until the step in flight (if any) has written everything."""


@runtime_checkable
class HostState(AsyncStep, Protocol):
    """An optimizer whose state lives in host memory, readable while a step runs."""

    @property
    def health(self) -> Health:
        """What a failed step left."""

    def completion_for(self, param: torch.Tensor) -> tuple[Completion, ...]:
        """The completions of the tasks of the step in flight that write ``param``'s
        state (empty if none does)."""

    def live_state(self, param: torch.Tensor,
                   key: str) -> tuple[torch.Tensor, tuple[Completion, ...]]:
        """``param``'s host tensor of state ``key`` and its :meth:`completion_for`."""

    def add_reader(self, execution: Execution) -> None:
        """Make the next write of the host state wait for ``execution`` (a transfer)."""


@runtime_checkable
class Attachable(Protocol):
    """An optimizer whose forward hooks make a model wait, per module, for its step."""

    def attach(self, model: torch.nn.Module) -> None:
        """Install the forward waits on ``model``."""

    def detach(self) -> None:
        """Remove them."""


@runtime_checkable
class MasterCopy(Protocol):
    """An optimizer whose FP32 masters are the truth: weights written from outside
    through ``.data`` (a committed average) must be adopted before its next step."""

    def refresh_masters(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Make the masters of the weights written from outside (of ``params``, default
        all) the (widened) device weights; the others keep theirs."""

    def adopt_outside_writes(self) -> None:
        """Adopt now the weights written from outside since the last step that their
        version counters show (a healing ``model.load_state_dict``)."""

    def host_master(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s FP32 master in host memory, shaped and strided as its local
        shard (the tensor itself: a step in flight writes it)."""


@runtime_checkable
class OffloadedOptimizer(HostState, Attachable, Protocol):
    """What both pipeoff optimizers offer besides ``torch.optim.Optimizer``."""
