"""The process group of a state transfer, held so that pipeoff never keeps it alive.

[Note: holding process groups]
``torch.distributed.destroy_process_group()`` drops torch's own references to a
group; the group itself (a ``ProcessGroupGloo``, with its worker threads) is
destroyed, and those threads joined, when its last reference goes. A pipeoff
object that still held it (a ``StateTransfer``, the work of its last execution,
an idle lane's last items) kept gloo's threads running into interpreter
finalization. There a gloo thread that was still dropping its last finished
collective freed that collective's tensors, whose Python objects it then owned:
freeing one takes the GIL, CPython ends a thread that takes the GIL while it
finalizes with ``pthread_exit``, and that unwind through torch's ``noexcept``
destructor aborted the process ("terminate called without an active
exception", issue 37). Destroyed before finalization, the group joins its
threads while the interpreter is whole.

So a transfer holds the default group by name (looked up at each launch), a
group it was given by weak reference where the group allows one, and a launch
holds its group only until its last collective has run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from pipeoff._errors import ConfigError
from pipeoff._held_interrupt import HeldInterrupt

__all__ = ["GroupRef", "deferred_interrupt", "resolve_wire"]


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Ctrl-C (SIGINT) held back for the block, then delivered (:class:`HeldInterrupt`:
    on the main thread, with a Python handler installed).

    For a sequence of collectives that every rank must join once one of them has
    begun: a ``KeyboardInterrupt`` between them (CPython raises it at any bytecode)
    would leave the peers waiting in the next one until the group's timeout.
    """
    held = HeldInterrupt()
    try:
        with held.hold():
            yield
    finally:
        held.deliver("pipeoff: this Ctrl-C came while a transfer's collectives ran and was "
                     "held back until this rank had joined them all")


class GroupRef:
    """How a :class:`~pipeoff.transfer.StateTransfer` finds its process group.

    ``None`` at construction means the default group if ``torch.distributed`` is
    initialized then (found again at each use), else no group (one process).
    """

    __slots__ = ("_default", "_ref")

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        self._ref: Callable[[], Any] | None = None
        self._default = group is None and initialized
        if group is None:
            return
        if type(group).__module__.split(".")[0] == "torchft":
            # (Refused on every rank alike, before any collective: a check that
            # compared ranks would refuse on some only, the others waiting.)
            raise ConfigError(
                f"process_group is torchft's {type(group).__name__}, which torch.distributed "
                "does not know: StateTransfer's collectives run over a torch.distributed "
                "group (init_process_group, new_group, a DeviceMesh's). Across torchft "
                "replica groups a recovering replica heals through torchft's own checkpoint "
                "transport (the Manager's state_dict/load_state_dict)")
        if not initialized:
            raise ConfigError("process_group was given, but torch.distributed is not initialized")
        try:
            self._ref = weakref.ref(group)
        except TypeError:  # not weakly referable: held, as its owner holds it anyway
            self._ref = lambda: group

    def get(self) -> Any:
        """The group (``None``: this process alone).

        Raises:
            ConfigError: the group is gone (``destroy_process_group``) since.
        """
        if self._ref is None and not self._default:
            return None
        import torch.distributed as dist

        group = self._ref() if self._ref is not None else None
        if not dist.is_initialized() or (self._ref is not None and group is None):
            raise ConfigError(
                "the process group this StateTransfer was built with was destroyed since "
                "(destroy_process_group); build a new one after init_process_group")
        return dist.group.WORLD if group is None else group


def resolve_wire(wire: str, group: Any) -> str:
    """``"auto"``: device memory for NCCL, else host memory."""
    if wire != "auto":
        return wire
    if group is None:
        return "host"
    import torch.distributed as dist

    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - a process group torch does not know (torchft's)
        backend = type(group).__name__.lower()
    return "device" if "nccl" in backend else "host"
