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
from pipeoff._errors import PeerSyncFailedError, StepFailedError
from pipeoff.graph import TaskContext

__all__ = ["Link", "allreduce_bucket", "reportable", "vote"]


class Link:
    """This replica's collectives of one sync, matched one for one with its peers'.

    Until one of them could not be issued (the process group raised issuing a failed
    replica's collective, or an error was raised out of torchft's ``allreduce``):
    then ``broken``, and the sync's later collectives, its vote included, are
    skipped, as torchft skips every all-reduce after an error. Hazard: joining them
    one behind the peers', a bucket's all-reduce meeting another bucket's (gloo
    aborts the process on the size mismatch; with equal sizes the vote was summed
    into a parameter). The replica has reported the error, so it rejects the sync;
    its peers time out once and reject, as under torchft.
    """

    __slots__ = ("broken", "buckets", "entered", "unfilled")

    def __init__(self, buckets: int) -> None:
        self.buckets = buckets
        """How many all-reduces the sync has (each peer's as many)."""
        self.broken = False
        self.unfilled = False
        """A bucket's ``fill`` raised (a Ctrl-C too): joined with what its buffer held."""
        self.entered = 0
        """How many buckets, in order, have reached :func:`allreduce_bucket`."""


class _Progress:
    """How far one bucket's collective got: ``issued`` (joined: the peers' matching
    collective has this replica's), then ``ended`` (nothing writes the buffer now)."""

    __slots__ = ("ended", "issued")

    def __init__(self) -> None:
        self.issued = self.ended = False


def allreduce_bucket(manager: Any, ctx: TaskContext, dev: str, flat: torch.Tensor,
                     fill: Callable[[torch.Tensor], None], link: Link, index: int) -> None:
    """Fill ``flat`` (the staging buffer ``dev``) with ``fill`` and average it over
    the replica groups in place.

    The task that calls this is ``must_run``: it runs after a failed task too.
    After any failure of this replica (``fill`` raising, an earlier task that
    failed, an error already reported to the manager) it still joins the
    collective with whatever ``flat`` holds and discards the result, then
    re-raises ``fill``'s error if there was one. Once ``link`` is broken it joins
    nothing (see :class:`Link`). A Ctrl-C (the synchronous schedule runs this on the
    caller's thread) in ``fill`` is raised once the collective is joined; anywhere
    after, before the collective is issued, it breaks the link; before this call (in
    the task, on its way here: ``index``, the bucket's place in the sync, says so at
    the next bucket), too.
    """
    if index != link.entered:
        # Hazard: an earlier bucket's task interrupted (a Ctrl-C) or failed before it
        # reached this function: that collective was never joined, and this one would
        # be one behind the peers' (gloo aborted the process: a tester's find).
        link.broken = True
    local_failure: BaseException | None = None
    try:
        link.entered = index + 1
        fill(flat)
    except BaseException as err:  # noqa: BLE001 - raised once the collective is joined
        local_failure = err
        link.unfilled = True
    if link.broken:
        if local_failure is not None:
            raise local_failure
        return
    progress = _Progress()
    try:
        if local_failure is not None or ctx.failed is not None or not _average_on_manager(
                manager, ctx, dev, flat, progress):
            _join_failed(manager, ctx, dev, flat, link, progress)
    except BaseException:
        # Raised out of torchft's allreduce (a Ctrl-C in its wait for the quorum), or
        # a Ctrl-C anywhere here (two testers' finds).
        if not progress.issued:
            # Hazard: the later collectives joined one behind the peers' (gloo aborted
            # the process: no handler, no checkpoint). They are skipped, as torchft's
            # propagating error skips them; the peers time out and reject.
            link.broken = True
        elif not progress.ended:
            # Hazard: the staging block going back to the pool while the collective
            # may still write it.
            ctx.retire_buffer(dev)
        raise
    if local_failure is not None:
        raise local_failure


def _average_on_manager(manager: Any, ctx: TaskContext, dev: str, flat: torch.Tensor,
                        progress: _Progress) -> bool:
    """torchft's allreduce of the bucket, waited for; ``False`` if this replica has
    failed the sync (it joins as a failed one)."""
    if manager.errored() is not None:
        return False
    # AVG: torchft divides by the participant count inside wait(), so the bucket
    # holds the mean only once wait() has returned.
    work = manager.allreduce(flat)
    if _compat.skipped_by_torchft(work) and manager.errored() is not None:
        # torchft returned without joining (a mock's dummy is no error): an error was
        # reported after the check above (by the training loop, on its own thread:
        # torchft's allreduce is a no-op from then on), or issuing it raised inside
        # torchft. Either way this replica joins the collective as a failed one.
        return False
    progress.issued = True
    if not work.wait():
        # wait() reported the failure to the manager (so this replica will not
        # commit) and returned False. Hazard: the staging block going back to the
        # pool while the failed collective may still write it. (It was issued: the
        # later ones are still joined, as torchft issues them all before waiting.)
        ctx.retire_buffer(dev)
    progress.ended = True
    return True


def _join_failed(manager: Any, ctx: TaskContext, dev: str, flat: torch.Tensor,
                 link: Link, progress: _Progress) -> None:
    """Join the bucket's all-reduce for a replica that has failed this sync (it will
    not commit), bypassing torchft's allreduce (a no-op after an error), and discard
    the result.

    Hazard: peer replicas waiting out the process group's timeout for the collectives
    this replica would skip, or (an error reported by the loop between the sync's
    all-reduces, a race the CI hit) rejecting a sync torchft's peers commit: torchft's
    own path issues every all-reduce before waiting. The values are this replica's
    (those that are not its to give are told to the peers by :func:`vote`).
    """
    try:
        # Hazard: issuing on the process group before the quorum has reconfigured it,
        # under torchft's asynchronous quorum (this collective on the old group, the
        # later ones one behind the peers' on the new: gloo aborted the process), and
        # reading is_participating() before the quorum has said (a tester's find).
        # torchft's allreduce waits for it first too.
        manager.wait_quorum()
        if manager.is_participating() is False:
            # Hazard: a healing replica's stale values summed into the peers' average,
            # which torchft divides by a participant count without it (torchft's
            # allreduce zeroes them).
            flat.zero_()
        work = _compat.issue_on_group(manager, flat)
    except Exception:  # noqa: BLE001 - this replica's sync has already failed
        # Not issued: the later collectives are skipped (see Link).
        link.broken = True
        return
    progress.issued = True
    if work is None or not _waited(work):
        # Hazard: the staging block going back to the pool while a failed collective
        # may still write it. (No process group: a test's mock, no peers.)
        ctx.retire_buffer(dev)
    progress.ended = True


def _waited(work: Any) -> bool:
    """Wait for ``work``: whether it completed (a failure swallowed: this replica's
    outcome is decided by then)."""
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - see above
        return False
    return True


def vote(manager: Any, failed: bool, device: torch.device, link: Link) -> None:
    """Before ``should_commit()``, once this sync's all-reduces are done on this
    replica: tell the peer replica groups whether this one ``failed`` (joined them
    with values that were not its to give), and learn whether any of them did; if
    one did and this one did not, report a :class:`~pipeoff.PeerSyncFailedError` to
    the manager, so that ``should_commit()`` is ``False`` here too.

    ``failed``: an error was reported to this replica's manager before the sync's
    first all-reduce (torchft's ``allreduce`` would have skipped every one), or a
    bucket could not be filled (the buffer held what it held). Not: a ``wait()``
    that failed after its collective (torchft had issued the rest already), nor a
    zero pseudo-gradient for a bucket DiLoCo did not form (this replica did not move
    there).

    Hazard: a peer committing an average that holds such values. torchft's failed
    replica skips its all-reduces, and its peers time out and reject; a pipeoff
    replica joins them (so that none waits) and so must say so.

    One SUM all-reduce of one element on the manager's process group, bypassing the
    manager (whose ``allreduce`` is a no-op once an error was reported); every replica
    group calls it once per sync, after its last bucket's all-reduce (nothing else
    is on the group then). A manager without a torch process group (a test's mock)
    has no peers to tell.
    """
    if link.broken or link.entered != link.buckets:
        # (This replica reported an error, or its last bucket never reached its
        # all-reduce: the vote would meet the peers' last bucket, a tester's find, gloo
        # aborted. It rejects; the peers time out.)
        return
    flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float32, device=device)
    joined: bool | None  # (None: no process group, so no peers)
    try:
        manager.wait_quorum()  # (the group the quorum configured: see _join_failed)
        work = _compat.issue_on_group(manager, flag)
    except Exception:  # noqa: BLE001 - not issued: told to the manager below
        joined = False
    else:
        joined = None if work is None else _waited(work)
    if failed or joined is None:
        return  # (this replica rejects the sync already; or it has no peers)
    if manager.errored() is not None:
        # (Rejected already, for the cause reported first: a peer's all-reduce that
        # failed, whose error a report of the vote's failure would replace; a
        # tester's find, a dead peer's "connection reset" was lost.)
        return
    if not joined:
        manager.report_error(PeerSyncFailedError(
            "pipeoff: the all-reduce of the replica groups' sync outcomes failed; this "
            "sync is rejected"))
    elif float(flag.item()) != 0.0:
        manager.report_error(PeerSyncFailedError(
            f"pipeoff: {int(flag.item())} peer replica group(s) failed this sync after "
            "joining its all-reduces (their values are not theirs to average); this "
            "replica group rejects it too, as under torchft"))


def reportable(err: BaseException, interrupted: str) -> Exception:
    """``err`` as torchft's ``report_error`` takes it: an ``Exception``; a Ctrl-C is
    reported as a ``StepFailedError`` saying it ``interrupted`` the sync there,
    chained to it."""
    if isinstance(err, Exception):
        return err
    reported = StepFailedError(f"{interrupted} was interrupted ({type(err).__name__})")
    reported.__cause__ = err
    return reported
