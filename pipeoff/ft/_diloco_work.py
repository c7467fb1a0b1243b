"""The lane work of one offloaded DiLoCo sync: each task's callable, over one
fragment's parameters, backups and host pseudo-gradients.

:class:`SyncWork` is bound to one sync. Its tasks read and write the tensors it
was given and record what they found in its results record (:class:`SyncResults`:
which buckets were formed whole). What they write is the sync's own: the
fragment's backups and host pseudo-gradients, the host outer optimizer's state
(its ``.grad`` set for the step and cleared after), never the fragment's
parameters before the commit, nor the caller's records. The graph
(``_diloco_graph.py``) orders them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeoff._compat import local_tensor
from pipeoff.ft._buckets import Bucket, Piece
from pipeoff.ft._collective import Link, allreduce_bucket
from pipeoff.ft._diloco_graph import DiLoCoWork
from pipeoff.ft._outer import HostOuterOptimizer
from pipeoff.ft._outer_spec import SpeculativeStep
from pipeoff.graph import TaskContext

__all__ = ["SyncResults", "SyncWork"]

Run = Callable[[TaskContext], None]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed flat (host tensors pipeoff or torchft allocated: contiguous)."""
    return t.view(-1)


def _region(loc: torch.Tensor, pc: Piece) -> torch.Tensor:
    """The part of ``loc`` that piece ``pc`` covers: the tensor itself when whole
    (a non-contiguous one is never split), else a flat slice."""
    if pc.whole:
        return loc
    return loc.view(-1)[pc.start:pc.start + pc.numel]


@dataclasses.dataclass(eq=False)
class SyncResults:
    """What one sync's tasks found, written on its lanes only."""

    formed: set[int] = dataclasses.field(default_factory=set)
    """Buckets whose pseudo-gradients are formed whole in the staging their all-reduce
    reads (added by their pseudograd task, or with ``form_first`` their upload; read
    by their all-reduce, which runs after it: the graph orders them)."""


@dataclasses.dataclass(frozen=True, eq=False)
class SyncWork:
    """The callables of one sync's tasks.

    Attributes:
        params: the fragment's parameters (their local shards are read and written).
        backups: torchft's backups of them (pinned host tensors, the global model).
        grads: the host pseudo-gradients (pinned host tensors, one per parameter).
        outer: the host outer optimizer (steps the backups).
        manager: torchft's ``Manager`` (the all-reduces).
        device: the device of the parameters.
        cuda: the device is an accelerator (copies are issued ``non_blocking``).
        alpha: torchft's ``fragment_update_alpha``.
        synchronous: the synchronous schedule.
        form_first: the formation goes first (pipelined, ``fragment_sync_delay > 0``):
            each formed bucket is staged to the host and uploaded again for its
            all-reduce.
        spec: the speculative outer step of this sync (``_outer_spec.py``), or ``None``.
        link: this sync's collectives (``_collective.Link``; its vote reads it too).
        masters: under an inner optimizer whose FP32 host masters are the truth
            (``FullOffloadOptimizer``), each parameter's master: the pseudo-gradient
            is formed from it on the host (``backup - master``), the merge is
            computed on it in FP32 on the host and the weight written from it (its
            cast), so the parameters are read only by the pieces' shapes.
    """

    params: Sequence[torch.Tensor]
    backups: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    outer: HostOuterOptimizer
    manager: Any
    device: torch.device
    cuda: bool
    alpha: float
    synchronous: bool
    form_first: bool
    link: Link
    masters: Sequence[torch.Tensor] | None = None
    spec: SpeculativeStep | None = None
    results: SyncResults = dataclasses.field(default_factory=SyncResults)

    def work(self) -> DiLoCoWork:
        """The task factories the graph builder takes."""
        return DiLoCoWork(pseudograd=self.pseudograd, allreduce=self.allreduce, d2h=self.d2h,
                          outer=self.outer_step, write=self.write, stage=self.stage,
                          upload=self.upload, keep=self.keep)

    def pseudograd(self, k: int, b: Bucket, dev: str) -> Run:
        if self.masters is not None:
            return self._pseudograd_of_masters(k, b, dev)

        def run(ctx: TaskContext) -> None:
            flat = ctx.buffer(dev, b.dtype)
            for pc in b.pieces:
                part = flat[pc.offset:pc.offset + pc.numel]
                # non_blocking: the backup is pinned host memory that nothing
                # writes until this sync's outer step, after its commit.
                part.copy_(_flat(self.backups[pc.param])[pc.start:pc.start + pc.numel],
                           non_blocking=self.cuda)
                # torchft: original.to(device) - local.
                part.sub_(_region(local_tensor(self.params[pc.param], data=True), pc).reshape(-1))
            if not self.form_first:
                self.results.formed.add(k)

        return run

    def _pseudograd_of_masters(self, k: int, b: Bucket, dev: str) -> Run:
        masters = self.masters
        assert masters is not None

        def run(ctx: TaskContext) -> None:
            flat = ctx.buffer(dev, b.dtype)
            for pc in b.pieces:
                hg = _flat(self.grads[pc.param])[pc.start:pc.start + pc.numel]
                # torchft's original - local, with the FP32 master for the local
                # parameter, on the host (both are host tensors).
                torch.sub(_flat(self.backups[pc.param])[pc.start:pc.start + pc.numel],
                          _region(masters[pc.param], pc).reshape(-1), out=hg)
                # non_blocking: the host pseudo-gradients are pinned; nothing writes
                # them again until this bucket's d2h, after its all-reduce.
                flat[pc.offset:pc.offset + pc.numel].copy_(hg, non_blocking=self.cuda)
            if not self.form_first:
                self.results.formed.add(k)

        return run

    def stage(self, k: int, b: Bucket, dev: str) -> Run:
        def run(ctx: TaskContext) -> None:
            flat = ctx.buffer(dev, b.dtype)
            for pc in b.pieces:
                # non_blocking: the host pseudo-gradients are pinned, read next by
                # this bucket's upload, which waits for this task.
                _flat(self.grads[pc.param])[pc.start:pc.start + pc.numel].copy_(
                    flat[pc.offset:pc.offset + pc.numel], non_blocking=self.cuda)

        return run

    def upload(self, k: int, b: Bucket, dev: str) -> Run:
        def run(ctx: TaskContext) -> None:
            flat = ctx.buffer(dev, b.dtype)
            for pc in b.pieces:
                # non_blocking: nothing writes the host pseudo-gradients until this
                # bucket's d2h, after its all-reduce.
                flat[pc.offset:pc.offset + pc.numel].copy_(
                    _flat(self.grads[pc.param])[pc.start:pc.start + pc.numel],
                    non_blocking=self.cuda)
            self.results.formed.add(k)

        return run

    def allreduce(self, k: int, b: Bucket, dev: str) -> Run:
        def run(ctx: TaskContext) -> None:
            # must_run: after a failure of this replica it still joins, so that
            # its peers are never left waiting. A bucket whose first task never
            # ran has no staging block: join from a temporary one.
            flat = (ctx.buffer(dev, b.dtype) if dev in ctx.buffers else
                    torch.zeros(b.numel, dtype=b.dtype, device=self.device))

            def fill(flat: torch.Tensor) -> None:
                if k not in self.results.formed:
                    # Hazard: a peer that commits averaging in what an unformed
                    # bucket holds (stale staging, a half-written subtraction).
                    # Contribute a zero pseudo-gradient instead: to the peers,
                    # this replica did not move in this bucket.
                    flat.zero_()

            allreduce_bucket(self.manager, ctx, dev, flat, fill, self.link, k)

        return run

    def d2h(self, k: int, b: Bucket, dev: str) -> Run:
        def run(ctx: TaskContext) -> None:
            flat = ctx.buffer(dev, b.dtype)
            for pc in b.pieces:
                # non_blocking (pipelined): the host pseudo-gradients are pinned
                # and read only by the outer step, which waits for this task.
                _flat(self.grads[pc.param])[pc.start:pc.start + pc.numel].copy_(
                    flat[pc.offset:pc.offset + pc.numel],
                    non_blocking=self.cuda and not self.synchronous)

        return run

    def outer_step(self, c: int, chunk: Sequence[int]) -> Run:
        spec = self.spec

        def run(ctx: TaskContext) -> None:
            pairs = [(self.backups[i], self.grads[i]) for i in chunk]
            if spec is not None:
                spec.step(pairs)  # into the spares, before the decision
            elif ctx.gate("commit"):
                self.outer.step(pairs)

        return run

    def keep(self) -> Run:
        spec = self.spec

        def run(ctx: TaskContext) -> None:
            if ctx.gate("commit") and spec is not None:
                spec.keep(list(zip(self.backups, self.grads, strict=True)))

        return run

    def write(self, k: int, b: Bucket, w: str) -> Run:
        if self.masters is not None:
            return self._write_masters(k, b)

        def run(ctx: TaskContext) -> None:
            committed = ctx.gate("commit")
            flat = ctx.buffer(w, b.dtype)
            for pc in b.pieces:
                loc = _region(local_tensor(self.params[pc.param], data=True), pc)
                src = _flat(self.backups[pc.param])[pc.start:pc.start + pc.numel]
                if not committed:
                    # torchft's restore_parameters: the backup, unchanged.
                    loc.copy_(src.view(loc.shape), non_blocking=self.cuda)
                    continue
                # torchft: p = new global (restore + outer step), then
                # p.lerp_(local snapshot, alpha): the same op, on the device.
                new = flat[pc.offset:pc.offset + pc.numel].view(loc.shape)
                new.copy_(src.view(loc.shape), non_blocking=self.cuda)
                new.lerp_(loc, self.alpha)
                loc.copy_(new)

        return run

    def _write_masters(self, k: int, b: Bucket) -> Run:
        masters = self.masters
        assert masters is not None

        def run(ctx: TaskContext) -> None:
            committed = ctx.gate("commit")
            for pc in b.pieces:
                m = _region(masters[pc.param], pc)
                src = _flat(self.backups[pc.param])[pc.start:pc.start + pc.numel].view(m.shape)
                if committed:
                    # torchft's merge (new global, lerp'd towards the local parameters
                    # by alpha), in FP32 on the host, into the master.
                    m.copy_(torch.lerp(src, m, self.alpha))
                else:
                    m.copy_(src)  # torchft's restore, into the master
                # The weight is the master's cast, as the optimizer writes it
                # (non_blocking: the master is pinned, and nothing writes it again
                # before the inner step, which waits for this sync).
                loc = _region(local_tensor(self.params[pc.param], data=True), pc)
                loc.copy_(m.view(loc.shape), non_blocking=self.cuda)

        return run
