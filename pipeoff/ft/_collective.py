"""One bucket's all-reduce on a torchft manager, with the failure protocol of a replica
that must never leave its peers waiting.

Shared by :class:`~pipeoff.ft.LocalSGD` and :class:`~pipeoff.ft.DiLoCo`: both fill
a device staging bucket (the parameters, or their pseudo-gradients) and average
it across replica groups with ``manager.allreduce``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeoff import _compat
from pipeoff.graph import TaskContext

__all__ = ["allreduce_bucket"]


def allreduce_bucket(manager: Any, ctx: TaskContext, dev: str, flat: torch.Tensor,
                     fill: Callable[[torch.Tensor], None]) -> None:
    """Fill ``flat`` (the staging buffer ``dev``) with ``fill`` and average it over
    the replica groups in place.

    The task that calls this is ``must_run``: it runs after a failed task too.
    After any failure of this replica (``fill`` raising, an earlier task that
    failed, an error already reported to the manager) it still joins the
    collective with whatever ``flat`` holds and discards the result, then
    re-raises ``fill``'s error if there was one.
    """
    local_failure: BaseException | None = None
    try:
        fill(flat)
    except Exception as err:  # noqa: BLE001 - raised once the collective is joined
        local_failure = err
    if local_failure is not None or ctx.failed is not None or manager.errored() is not None:
        # This replica has failed this sync (it will not commit), and torchft's
        # allreduce is a no-op after an error. Hazard: peer replicas waiting out
        # the process group's timeout for the collectives this replica would
        # skip. Join them with the local values, as torchft's own path (which
        # issues every all-reduce before waiting) does; the result is discarded.
        if not _compat.allreduce_discarded(manager, flat):
            ctx.retire_buffer(dev)
        if local_failure is not None:
            raise local_failure
        return
    # AVG: torchft divides by the participant count inside wait(), so the bucket
    # holds the mean only once wait() has returned.
    if not manager.allreduce(flat).wait():
        # wait() reported the failure to the manager (so this replica will not
        # commit) and returned False. Hazard: the staging block going back to the
        # pool while the failed collective may still write it.
        ctx.retire_buffer(dev)
