"""LocalSGD whose parameter averaging is staged through host memory as a pipeoff task graph."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor
from torchft.local_sgd import LocalSGD as _TorchftLocalSGD

from pipeoff import _accel
from pipeoff._compat import local_tensor
from pipeoff._contract import AsyncStep, MasterCopy, steps_taken
from pipeoff._errors import ConfigError
from pipeoff._lowlevel import SyncStats, is_failure_of, settle, train_span
from pipeoff.executor import execute
from pipeoff.ft._args import check_manager, check_module, check_optimizer
from pipeoff.ft._buckets import DEFAULT_BUCKET_BYTES, Bucket, TensorInfo, plan_buckets
from pipeoff.ft._collective import Link, allreduce_bucket, reportable, vote
from pipeoff.ft._options import StagingOptions, check_sync_schedule, offload_flag
from pipeoff.ft._sync_graph import SyncWork, sync_graph, sync_schedule
from pipeoff.graph import TaskContext, TaskGraph
from pipeoff.staging import reserve_for
from pipeoff.trace import StepStats

if TYPE_CHECKING:
    from torchft.manager import Manager

    from pipeoff.trace import Trace

__all__ = ["DEFAULT_BUCKET_BYTES", "LocalSGD"]


class LocalSGD(_TorchftLocalSGD):  # type: ignore[misc]  # torchft ships no type hints
    """torchft's LocalSGD with RFC 0003 CPU staging, sequential or pipelined.

    A drop-in for :class:`torchft.local_sgd.LocalSGD`: the optimizer hooks,
    ``_local_step``, :meth:`sync`, one ``start_quorum()`` and one
    ``should_commit()`` per sync are torchft's. Only the averaging in
    ``_perform_sync`` changes, and only when
    ``offload_to_cpu=True``:

    * ``schedule="synchronous"`` is RFC 0003 exactly, run as a pipeoff graph under
      :meth:`pipeoff.Schedule.synchronous`: for each parameter in turn, copy
      its local tensor to device staging, all-reduce and wait, copy it to host
      staging and free the device copy. If quorum commits, each averaged
      tensor is written back synchronously (a DTensor is rebuilt with its
      mesh, placements, shape and stride); if not, nothing is written.
    * ``schedule="pipelined"`` packs the local tensors densely into flat
      buckets of at most ``bucket_bytes`` (one dtype each; a parameter that
      does not fit the open bucket is split across buckets) and runs each
      bucket through device staging -> all-reduce -> pinned host staging,
      keeping at most ``device_budget_bytes`` of device staging live, so
      that the all-reduce of bucket k+1 overlaps the device-to-host copy of bucket k. A commit
      writes back with pipelined host-to-device copies; a reject writes
      nothing.

    Memory and traffic per sync (S = local parameter bytes, M = the largest
    local parameter, B = ``bucket_bytes``, D = ``device_budget_bytes``):

    ========================  =====================  ===========  ================
    mode                      extra device memory    host memory  host link
    ========================  =====================  ===========  ================
    original (flag off)       S                      0            0
    ``"synchronous"`` (RFC)   M                      S            2S (S if reject)
    ``"pipelined"``           D (>= B)               S            2S (S if reject)
    ========================  =====================  ===========  ================

    When not to use it: if the S bytes of extra device memory fit, the
    original path moves nothing over the host link and is the fastest on a
    fast interconnect. The pipelined schedule issues ``ceil(S / B)``
    collectives instead of one per parameter; with many tiny buckets the
    per-collective latency dominates.

    An optimizer that steps asynchronously and offers ``wait_for_step()``
    (``pipeoff.optim.OffloadOptimizer(mode="overlap")``) is waited on before
    every sync starts its quorum, in every mode: a recovering peer fetches
    this replica's checkpoint during that quorum.

    A failure while averaging (an all-reduce that errors, a task that
    raises) goes to ``manager.report_error``, so this replica group's
    ``should_commit()`` returns False and its model keeps its local values;
    staging is released either way. **Peers never wait on a local failure:**
    after one (a collective whose ``wait()`` fails, a copy that raises), this
    replica still joins every remaining all-reduce of the sync, with its local
    values, and discards the results, as torchft's own path does (it issues
    every all-reduce before waiting). Its peers complete the sync and commit;
    only this replica rejects. (A replica that dies mid-sync still costs its
    peers the process group's timeout, as under torchft.) An error raised by
    ``should_commit()`` itself propagates to the caller. A write-back that
    fails after a commit (a device gone bad) leaves the parameters partly
    averaged: it is reported to the manager and propagates, with a note
    saying so.

    Args:
        manager: the torchft manager.
        model: the model whose parameters are averaged.
        optimizer: the inner optimizer; its step hooks drive :meth:`sync`.
        sync_every: local steps between syncs.
        offload_to_cpu: stage averaged parameters in host memory until commit
            (RFC 0003's ``offload_averaged_parameters_to_cpu``, at its position;
            DiLoCo's name). ``False`` is torchft's original path, byte for byte.
        offload_averaged_parameters_to_cpu: the old name of ``offload_to_cpu``,
            still accepted (as a keyword) with a ``FutureWarning``.
        schedule: ``"pipelined"`` (the default) or ``"synchronous"`` (RFC 0003's
            sequential path, like :meth:`pipeoff.Schedule.synchronous`; ``"sync"``
            is its old name, accepted with a ``FutureWarning``); only with the
            offload flag on.
        bucket_bytes: bucket size of the pipelined schedule (default
            :data:`DEFAULT_BUCKET_BYTES`), or ``"per_parameter"`` for one
            bucket per parameter (split only where a parameter exceeds
            ``device_budget_bytes``). With only ``device_budget_bytes`` given,
            the default is half of it (at most :data:`DEFAULT_BUCKET_BYTES`).
            Checked but unused under ``"synchronous"``, which stages one whole
            parameter at a time.
        device_budget_bytes: most device staging bytes live at once
            (default: two buckets, so one all-reduce overlaps one copy; with
            ``"per_parameter"``, the largest parameter, M, as in the RFC).
            Checked but unused under ``"synchronous"`` (its staging is M).

    Raises:
        ConfigError: an argument is out of range, or ``schedule``,
            ``bucket_bytes`` or ``device_budget_bytes`` is given without the
            offload flag.
    """

    last_trace: Trace | None
    """The trace of the last offloaded sync (``None`` on the original path)."""

    def __init__(
        self,
        manager: Manager,
        model: nn.Module,
        optimizer: optim.Optimizer,
        sync_every: int,
        offload_to_cpu: bool | None = None,
        *,
        offload_averaged_parameters_to_cpu: bool | None = None,
        schedule: Literal["pipelined", "synchronous", "sync"] | None = None,
        bucket_bytes: int | Literal["per_parameter"] | None = None,
        device_budget_bytes: int | None = None,
    ) -> None:
        sync_every = check_sync_schedule(sync_every)[0]  # (before torchft's hooks go on)
        check_manager(manager)
        check_module("model", model)
        check_optimizer("optimizer", optimizer)
        super().__init__(manager, model, optimizer, sync_every)
        self._offload = offload_flag(offload_to_cpu, offload_averaged_parameters_to_cpu)
        opts = StagingOptions.resolve(flag="offload_to_cpu",
                                      offload=self._offload, schedule=schedule,
                                      bucket_bytes=bucket_bytes,
                                      device_budget_bytes=device_budget_bytes)
        sched, bucket, budget = opts.schedule, opts.bucket_bytes, opts.device_budget_bytes
        self._schedule_name = sched
        self._per_parameter = opts.per_parameter or sched == "synchronous"
        self._bucket_name = opts.bucket_name
        if sched == "synchronous":
            # RFC 0003 stages one whole parameter at a time: the bucket options
            # are checked above (so that switching schedules keeps them valid)
            # but do not apply.
            bucket = budget = None
        self._bucket_bytes = bucket
        self._device_budget_bytes = budget
        self.last_trace = None
        self._stats = SyncStats()
        self._in_sync = False
        self._reserved_for: tuple[Bucket, ...] | None = None
        if self._offload:
            # Refuse sizes no bucket can hold now, not at the first sync; and take
            # the staging a sync holds now, not inside it (pinned allocation stalls
            # the device, and under NCCL can deadlock against peers in a collective).
            self.reserve()

    def reserve(self) -> int:
        """Reserve the staging blocks (device and pinned host) that a sync holds at
        once, in the process's staging pools; the constructor calls it. Call it
        again after the model's parameters change. Returns the bytes reserved (0
        if already done for this bucket plan, or without the offload flag)."""
        if not self._offload:
            return 0
        buckets = self._plan()
        if buckets == self._reserved_for:
            return 0
        params = list(self._model.parameters())
        device = local_tensor(params[0], data=True).device if params else torch.device("cpu")
        reserved = reserve_for(
            sync_graph(buckets, device),
            sync_schedule(buckets, pipelined=self._schedule_name == "pipelined",
                          device_budget_bytes=self._device_budget_bytes))
        self._reserved_for = buckets
        return sum(reserved.values())

    # -- configuration, read-only ------------------------------------------------
    @property
    def schedule(self) -> str:
        """``"pipelined"`` or ``"synchronous"`` (meaningful with the offload flag on)."""
        return self._schedule_name

    @property
    def bucket_bytes(self) -> int | None:
        """The bucket limit, or ``None`` for one bucket per parameter."""
        return self._bucket_bytes

    @property
    def device_budget_bytes(self) -> int | None:
        """The cap on live device staging, or ``None`` (the RFC's M)."""
        return self._device_budget_bytes

    # -- the sync ------------------------------------------------------------------
    def _wait_for_optimizer(self) -> None:
        opt = self._local_optimizer
        if isinstance(opt, AsyncStep):
            opt.wait_for_step()

    def sync(self) -> None:
        # Hazard: a recovering peer reading parameters that an asynchronous
        # optimizer step (pipeoff.optim.OffloadOptimizer(mode="overlap")) is
        # still writing. torchft's post-step hook allows state-dict reads as
        # soon as step() returns, and the quorum started here is when a peer
        # fetches this replica's checkpoint; so wait before it starts.
        self._wait_for_optimizer()
        self._in_sync = True
        try:
            super().sync()
        finally:
            self._in_sync = False
        # After torchft reset its step counter: a hook that raises cannot skip it.
        self._stats.emit()

    # -- per-sync figures ----------------------------------------------------------
    @property
    def last_sync_stats(self) -> StepStats | None:
        """The :class:`pipeoff.trace.StepStats` of the last sync (``what="sync"``, with
        ``committed``); on torchft's own path only its time and decision."""
        return self._stats.last

    def register_sync_stats_hook(self, hook: Callable[[StepStats], None]) -> Any:
        """Call ``hook(stats)`` after every sync; returns a handle with ``remove()``.

        Raises:
            ConfigError: ``hook`` is not callable.
        """
        return self._stats.hooks.add(hook)

    def _perform_sync(self) -> None:
        opt = self._local_optimizer
        n = steps_taken(opt)
        step = n - 1 if n else int(self._manager.current_step())
        start = time.perf_counter_ns()
        # The training thread's "sync N" span on a recorded trace.
        with train_span("sync", step):
            committed = self._sync_body()
        self._stats.done(self.last_trace if self._offload else None, step=step,
                         exposed_ns=time.perf_counter_ns() - start, committed=committed)
        if not self._in_sync:  # called directly, not through sync()
            self._stats.emit()

    def _sync_body(self) -> bool:
        # Hazard: averaging parameters that an asynchronous optimizer step is
        # still writing (for callers of _perform_sync that bypass sync()).
        self._wait_for_optimizer()
        if not self._offload:
            committed = self._original_sync()
        else:
            with torch.profiler.record_function("pipeoff::ft::local_sgd::perform_sync"):
                committed = self._offloaded_sync()
        if committed:
            self._adopt_average()
        return committed

    def _adopt_average(self) -> None:
        """After a committed sync wrote the average into the weights: an optimizer whose
        masters are the truth (``FullOffloadOptimizer``) takes them as its masters.

        Hazard: its next step overwriting the averaged weights with its own,
        un-averaged masters (also after a Ctrl-C the sync ran to its end before
        passing on: a tester's find, the loop that caught it trained 1e-2 off)."""
        opt = self._local_optimizer
        if isinstance(opt, MasterCopy):
            opt.refresh_masters()

    def _original_sync(self) -> bool:
        """torchft's own averaging; whether the quorum committed."""
        manager = self._manager
        seen: dict[str, bool] = {}
        real = manager.should_commit

        def should_commit(*args: Any, **kwargs: Any) -> bool:
            seen["commit"] = bool(real(*args, **kwargs))
            return seen["commit"]

        missing = object()
        before = manager.__dict__.get("should_commit", missing)
        manager.__dict__["should_commit"] = should_commit
        try:
            super()._perform_sync()
        finally:
            if before is missing:
                manager.__dict__.pop("should_commit", None)
            else:
                manager.__dict__["should_commit"] = before
        return seen.get("commit", False)

    def _plan(self) -> tuple[Bucket, ...]:
        infos = []
        for name, p in self._model.named_parameters():
            local = local_tensor(p, data=True)
            if not local.is_floating_point():
                # torchft's Manager.allreduce averages floating-point tensors
                # only; caught here, not as a fault at every sync.
                raise ConfigError(
                    f"parameter {name!r} is {local.dtype}; LocalSGD averages floating-point "
                    "parameters only (torchft's allreduce refuses others)"
                )
            infos.append(TensorInfo(name=name, numel=local.numel(), dtype=local.dtype,
                                    contiguous=local.is_contiguous()))
        limit: int | None = self._bucket_bytes
        limit_name = self._bucket_name
        if limit is None:
            limit, limit_name = self._device_budget_bytes, "device_budget_bytes"
        return plan_buckets(infos, limit=limit, per_parameter=self._per_parameter,
                            limit_name=limit_name)

    def _offloaded_sync(self) -> bool:
        params = list(self._model.parameters())
        buckets = self._plan()
        device = local_tensor(params[0], data=True).device if params else torch.device("cpu")
        # (An error reported before the first all-reduce: torchft's would skip them all.)
        commit: dict[str, bool] = {"errored_at_start": self._manager.errored() is not None}
        link = Link(len(buckets))  # (this sync's collectives, one for one with the peers')
        self.last_trace = None
        pipelined = self._schedule_name == "pipelined"
        graph = self._build_graph(params, buckets, device, commit, link)
        schedule = sync_schedule(buckets, pipelined=pipelined,
                                 device_budget_bytes=self._device_budget_bytes)
        ex = None
        try:
            ex = execute(graph, schedule)
            ex.wait()
        except KeyboardInterrupt as err:
            if ex is not None and not is_failure_of(err, ex):
                # (Ctrl-C in this thread's own wait: the execution runs on, and votes.)
                failure = _sync_ends_first(ex)
                if failure is not None:  # (what a failed sync owes torchft, then the Ctrl-C)
                    with contextlib.suppress(Exception):
                        self._after_failure(failure, ex, buckets, device, link, commit)
                elif commit.get("decided"):
                    try:
                        self._adopt_average()  # (as a sync that returned would)
                    except Exception as refused:  # (the Ctrl-C stays what is raised)
                        err.add_note("pipeoff: the optimizer did not take the averaged "
                                     f"weights as its masters: {refused!r}")
                err.add_note(_ended_note(failure, commit))
            elif ex is not None and commit.get("decided") and is_failure_of(err, ex):
                # Ctrl-C in a write-back after the commit (the synchronous schedule writes
                # on this thread). Hazard: a partly averaged replica that torchft takes
                # for a whole one (a tester's find: nothing said so). As a failed
                # write-back: reported, noted, raised.
                self._after_failure(err, ex, buckets, device, link, commit)
            elif ex is not None and "voted" not in commit and is_failure_of(err, ex):
                # Ctrl-C in a task (an all-reduce's wait; the synchronous schedule runs
                # its tasks on this thread): every task has ended, the must_run
                # all-reduces included, and no decision came. The peers still wait for
                # this replica's vote, which the decide task would have given; a second
                # Ctrl-C skips it. Hazard: a bucket the Ctrl-C left half-filled (it is
                # joined all the same) averaged into the peers' commit: it says failed.
                with contextlib.suppress(BaseException):
                    vote(self._manager, commit["errored_at_start"] or link.unfilled, device,
                         link)
            raise
        except Exception as err:
            self._after_failure(err, ex, buckets, device, link, commit)
        finally:
            if ex is not None and ex.done():  # (not after a second Ctrl-C: it goes on)
                self.last_trace = ex.trace
        return bool(commit.get("decided"))

    def _after_failure(self, err: BaseException, ex: Any, buckets: tuple[Bucket, ...],
                       device: torch.device, link: Link, commit: dict[str, bool]) -> None:
        """What a failed sync owes torchft and its peers; raises ``err`` unless torchft's
        error path took it (reported: this replica group rejects the sync)."""
        if commit.get("decided"):
            # A write-back failed after the commit (in practice a device
            # that has gone bad): buckets written so far hold the
            # average, the rest the local values. Nothing can undo
            # that; tell torchft, so that this replica group's next
            # should_commit() is False, and raise.
            self._manager.report_error(reportable(
                err, "the write-back after the quorum committed"))
            err.add_note(
                "pipeoff: a write-back failed after the quorum committed; this "
                "replica's parameters are partly averaged. Restart it so that "
                "torchft heals it from a peer."
            )
            raise err
        if "called" in commit:
            raise err  # should_commit itself failed
        # torchft's error path: after report_error this replica group's
        # should_commit() is False, so nothing is written back. It is
        # still called once, as in every sync: the replica group's other ranks wait on it.
        self._manager.report_error(err)
        if ex is not None and "voted" not in commit:  # (its all-reduces ran: ex.wait())
            vote(self._manager, commit["errored_at_start"] or link.unfilled, device, link)
        self._manager.should_commit()

    def _build_graph(
        self,
        params: list[nn.Parameter],
        buckets: tuple[Bucket, ...],
        device: torch.device,
        commit: dict[str, bool],
        link: Link,
    ) -> TaskGraph:
        manager = self._manager
        cuda = _accel.current().is_device(device)
        sync = self._schedule_name == "synchronous"
        errored_at_start = commit["errored_at_start"]

        def allreduce_work(k: int, b: Bucket, dev: str) -> Any:
            def fill(flat: torch.Tensor) -> None:
                for pc in b.pieces:
                    src = _memory_order(local_tensor(params[pc.param], data=True)).reshape(-1)
                    flat[pc.offset:pc.offset + pc.numel].copy_(src[pc.start:pc.start + pc.numel])

            def allreduce(ctx: TaskContext) -> None:
                allreduce_bucket(manager, ctx, dev, ctx.buffer(dev, b.dtype), fill, link, k)

            return allreduce

        def d2h_work(k: int, b: Bucket, dev: str, host: str) -> Any:
            def d2h(ctx: TaskContext) -> None:
                # non_blocking (pipelined only; the RFC path copies synchronously):
                # the host buffer is pinned and read only by this bucket's
                # write-back, which the executor orders after this copy with an
                # event wait, and ex.wait() host-syncs before the sync returns.
                ctx.buffer(host, b.dtype).copy_(ctx.buffer(dev, b.dtype),
                                                non_blocking=cuda and not sync)

            return d2h

        def decide(ctx: TaskContext) -> bool:
            # Runs once every bucket is in host staging, so the vote covers
            # every all-reduce's outcome (torchft reports failed waits itself).
            commit["voted"] = True
            vote(manager, errored_at_start, device, link)
            commit["called"] = True
            decided = bool(manager.should_commit())
            commit["decided"] = decided
            return decided

        def h2d_work(k: int, b: Bucket, host: str) -> Any:
            def h2d(ctx: TaskContext) -> None:
                if not ctx.results["should_commit"]:
                    return  # quorum rejected: the model keeps its local values
                flat = ctx.buffer(host, b.dtype)
                for pc in b.pieces:
                    src = flat[pc.offset:pc.offset + pc.numel]
                    if sync:
                        _write_back_rfc(params[pc.param], src)
                    else:
                        _write_back_slice(params[pc.param], src, pc.start, pc.whole, cuda)

            return h2d

        return sync_graph(buckets, device, SyncWork(allreduce=allreduce_work, d2h=d2h_work,
                                                    decide=decide, h2d=h2d_work))


# -- tensor helpers -------------------------------------------------------------------
def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` whose elements, in order, are ``t``'s in memory (``t`` itself if
    contiguous, or if not dense: then its logical order, as its ``clone()``'s).

    torchft all-reduces ``clone()`` of each parameter, which keeps a transposed
    weight's strides, and with three or more replicas the sum of an element depends
    on its position in the buffer: a buffer in logical order is not bitwise torchft's.
    """
    if t.is_contiguous() or t.dim() < 2:
        return t
    sizes, strides = t.shape, t.stride()
    perm = sorted(range(t.dim()), key=lambda d: -strides[d] if sizes[d] > 1 else 0)
    view = t.permute(perm)
    return view if view.is_contiguous() else t


def _write_back_rfc(param: nn.Parameter, flat: torch.Tensor) -> None:
    """RFC 0003's synchronous write-back of one whole averaged parameter."""
    local = local_tensor(param, data=True)
    if _memory_order(local) is local:
        avg = flat.view(local.shape).to(local.device)  # synchronous: RFC non_blocking=False
    else:  # (the buffer was filled in memory order: local's strides)
        avg = torch.empty_like(local)
        _memory_order(avg).copy_(flat.view(_memory_order(local).shape))
    if isinstance(param, DTensor):
        param.data.copy_(DTensor.from_local(avg, param.device_mesh, param.placements,
                                            shape=param.shape, stride=param.stride()))
    else:
        param.data.copy_(avg)


def _write_back_slice(
    param: nn.Parameter, src: torch.Tensor, start: int, whole: bool, cuda: bool
) -> None:
    """Copy ``src`` into elements ``start:`` of ``param``'s local tensor, in place.

    Writing the local tensor keeps the DTensor itself (mesh, placements,
    global shape and stride) as it is.
    """
    local = local_tensor(param, data=True)
    if whole:
        dst = _memory_order(local)  # (the order the buffer was filled in)
        src = src.view(dst.shape)
    else:
        dst = local.view(-1)[start:start + src.numel()]
    # non_blocking: src is pinned host staging that stays allocated until this
    # task's end event has fired (the pool waits on it before reuse).
    dst.copy_(src, non_blocking=cuda)


def _sync_ends_first(ex: Any) -> BaseException | None:
    """A Ctrl-C in the caller's wait for a sync: the sync runs on (its decide task votes,
    its write-back writes the parameters) to its end before the interrupt is passed on;
    returns its failure, if any.

    Hazard: the caller handling the interrupt (saving a checkpoint) while the write-back
    still writes the parameters: a partly averaged model.

    Raises:
        KeyboardInterrupt: a second Ctrl-C while waiting (noted: the sync goes on).
    """
    try:
        return settle(ex)
    except KeyboardInterrupt as again:
        again.add_note("pipeoff: interrupted again while the sync ran to its end: it goes "
                       "on in the background, and may still be writing the parameters")
        raise


def _ended_note(failure: BaseException | None, commit: dict[str, bool]) -> str:
    """The note on a Ctrl-C passed on once its sync ended: how it ended."""
    if failure is None:
        what = ("committed: the parameters hold the average" if commit.get("decided") else
                "did not commit: the parameters are this replica's own")
    elif commit.get("decided"):
        what = (f"committed, then a write-back failed ({type(failure).__name__}: {failure}): "
                "the parameters are partly averaged; restart this replica so that torchft "
                "heals it from a peer")
    else:
        what = (f"failed ({type(failure).__name__}: {failure}) and did not commit: the "
                "parameters are this replica's own")
    return ("pipeoff: the sync in progress ran to its end before this interrupt was passed "
            f"on; it {what}")
