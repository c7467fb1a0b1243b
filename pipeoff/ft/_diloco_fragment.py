"""One offloaded DiLoCo fragment: its sync as a pipeoff execution, from ``prepare_sync``
to the quorum's decision (and on, with a tail, under the next forward).

:class:`OffloadedFragment` is torchft's fragment with the offloaded sync's
fields: the bucket plan, the host pseudo-gradients and the host outer
optimizer. It owns its sync in flight (``_ex``) and whether the last one
committed; :class:`~pipeoff.ft.DiLoCo` (``_diloco.py``) orchestrates the
fragments as torchft's DiLoCo does, the lane work is ``_diloco_work.py``, the
graph ``_diloco_graph.py``, and the part after the decision that runs under the
next forward ``_diloco_tail.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torchft.local_sgd import _StreamingDiLoCoFragment

from pipeoff import _accel, _faults
from pipeoff._compat import local_tensor
from pipeoff._contract import StepWrites
from pipeoff._errors import ConfigError, PipeoffError
from pipeoff._held_interrupt import held_through
from pipeoff._lowlevel import is_failure_of
from pipeoff.executor import execute
from pipeoff.ft._buckets import TensorInfo, plan_buckets
from pipeoff.ft._collective import Link, reportable, vote
from pipeoff.ft._diloco_graph import DiLoCoWork, diloco_graph, diloco_schedule
from pipeoff.ft._diloco_tail import SyncTail, interrupted_note, late_note
from pipeoff.ft._diloco_work import SyncWork
from pipeoff.ft._options import StagingOptions
from pipeoff.ft._outer import HostOuterOptimizer
from pipeoff.ft._outer_spec import SpeculativeStep
from pipeoff.optim._plan import whole_chunks
from pipeoff.optim._waits import ForwardWaits
from pipeoff.staging import reserve_for

if TYPE_CHECKING:
    from pipeoff.execution import Execution
    from pipeoff.trace import Trace

__all__ = ["OffloadedFragment", "master_backups"]


class OffloadedFragment(_StreamingDiLoCoFragment):  # type: ignore[misc]
    """A torchft fragment whose sync is a pipeoff execution (see :class:`DiLoCo`)."""

    outer: HostOuterOptimizer
    _ex: Execution | None
    _speculative: bool
    _spec_stale: bool
    _abandoned: PipeoffError | None
    last_committed: bool = False
    """Whether the last sync committed."""

    @classmethod
    def adopt(cls, frag: _StreamingDiLoCoFragment, outer: HostOuterOptimizer,
              options: StagingOptions, on_trace: Callable[[Trace], None],
              tail: SyncTail | None, guard_formation: bool,
              masters: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> OffloadedFragment:
        """This class over ``frag``'s own fields (its backup, hooks and settings),
        with the offloaded sync's: the bucket plan, host pseudo-gradients, and the
        host outer optimizer; and its staging reserved. With ``tail``, a committed
        or rejected sync's outer step and writes run on after ``perform_sync``
        (``tail`` makes their readers wait). ``guard_formation``: with
        ``fragment_sync_delay`` > 0 the preparing ``step()`` returns before the
        pseudo-gradients are formed, the writes of the parameters they read
        waiting for them instead (for an inner optimizer that writes them only in
        its ``step()``). ``masters``: the inner optimizer's FP32 host master of a
        parameter (``FullOffloadOptimizer.host_master``): the sync forms its
        pseudo-gradients from the masters and merges into them (the backups are
        FP32 then: :func:`master_backups`)."""
        self = cls.__new__(cls)
        self.__dict__.update(frag.__dict__)
        self.outer = outer
        self._options = options
        self._on_trace = on_trace
        self._tail = tail
        self._ex = None
        self._abandoned = None
        named = list(self._model_fragment.named_parameters())
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        locals_ = [local_tensor(p, data=True) for p in self._params]
        self._device = locals_[0].device if locals_ else torch.device("cpu")
        self._cuda = _accel.current().is_device(self._device)
        self._masters = None if masters is None else [masters(p) for p in self._params]
        self._backups = [self.original_parameters[name] for name in self._names]
        # The averaged pseudo-gradients, staged in host memory until the commit
        # (pinned, so that the device-to-host copies are asynchronous).
        self._host_grads = [_accel.current().host_empty(b.shape, b.dtype, pinned=self._cuda)
                            for b in self._backups]
        # On the masters the pseudo-gradients are the backups' dtype (FP32): averaged in
        # FP32, twice a BF16 model's bytes over the wire, none of their bits lost.
        infos = [TensorInfo(name=name, numel=t.numel(), dtype=b.dtype,
                            contiguous=t.is_contiguous())
                 for name, t, b in zip(self._names, locals_, self._backups, strict=True)]
        for info in infos:
            if not (info.dtype.is_floating_point or info.dtype.is_complex):
                raise ConfigError(f"parameter {info.name!r} is {info.dtype}; DiLoCo "
                                  "synchronizes floating-point and complex parameters only")
        limit, limit_name = options.bucket_bytes, options.bucket_name
        if limit is None:
            limit, limit_name = options.device_budget_bytes, "device_budget_bytes"
        self._buckets = plan_buckets(infos, limit=limit, per_parameter=options.per_parameter,
                                     limit_name=limit_name)
        # The outer step's chunks: whole parameters under bucket_bytes (empty ones are
        # stepped too: the optimizer keeps state for them, as torchft's does).
        self._chunks = whole_chunks([b.numel() * b.element_size() for b in self._backups],
                                    options.bucket_bytes)
        # Take the staging a sync holds now, not inside it (pinned allocation
        # stalls the device and, under NCCL, can deadlock against peers).
        self._form_first = (options.schedule == "pipelined"
                            and int(self._fragment_sync_delay) > 0)
        self._formation = ForwardWaits(
            self._formation_failed, writes_only=True, wait_call="diloco.wait_for_sync()",
            waited_for="DiLoCo's sync in flight (its pseudo-gradients' formation)")
        self._spec = SpeculativeStep(outer, self._backups) if self._form_first else None
        """The outer step before the decision, under the inner steps (``form_first``)."""
        self._speculative = False
        self._spec_stale = False
        self._guard_formation = guard_formation
        """Eager writes of the parameters on the training thread wait until the
        pseudo-gradients that read them are formed (``form_first``)."""
        """The decision comes later than the preparing step: the formation goes first and
        ``prepare_sync`` waits for it (nothing may write the parameters while it reads
        them), the all-reduces run under the next inner steps."""
        reserve_for(diloco_graph(self._buckets, self._chunks, self._device,
                                 form_first=self._form_first), self._schedule())
        return self

    def _schedule(self) -> Any:
        return diloco_schedule(self._buckets, pipelined=self._options.schedule == "pipelined",
                               device_budget_bytes=self._options.device_budget_bytes)

    # -- healing ---------------------------------------------------------------------
    def register_state_dict_fn(self) -> None:
        # torchft's key and format: {"original_parameters", "outer_optimizer"}, with
        # the outer state from (and into) the host optimizer.
        def load_fn(state_dict: dict[str, dict[str, torch.Tensor]]) -> None:
            if self._tail is not None:
                self._tail.wait_done()
            ex = self._ex
            if ex is not None and self._speculative:
                # Hazard: overwriting backups and state that the speculative step
                # still reads; its result is then another state's: taken again after
                # the decision (perform_sync).
                try:
                    ex.wait("stepped")
                except Exception:  # noqa: BLE001 - the sync's own failure, kept for it
                    pass
                self._spec_stale = True
            for name, param in state_dict["original_parameters"].items():
                if name in self.original_parameters:
                    self.original_parameters[name].copy_(param)
            self.outer.load_state_dict(state_dict["outer_optimizer"])

        def save_fn() -> dict[str, Any]:
            if self._tail is not None:
                self._tail.wait_done()
            return {"outer_optimizer": self.outer.state_dict(),
                    "original_parameters": {name: t.clone() for name, t
                                            in self.original_parameters.items()}}

        self._manager.register_state_dict_fn(f"StreamingDiLoCoFragment_{self._fragment_id}",
                                             load_fn, save_fn)

    # -- the sync ----------------------------------------------------------------------
    def prepare_sync(self) -> None:
        """Launch the sync: pseudo-gradients formed, averaged and staged on the host
        under the next inner steps (``"synchronous"``: before returning)."""
        if self._ex is not None:
            raise RuntimeError("a DiLoCo fragment sync is already in flight")
        if self._tail is not None:
            # Hazard: forming pseudo-gradients from parameters and backups that the
            # last sync's outer step and writes still write (DiLoCo's own loop has
            # waited already, before the inner step; a caller driving the fragments
            # directly has not).
            self._tail.wait()
        self._failed: BaseException | None = None
        # An error reported before the first all-reduce (a failed heal in the quorum):
        # torchft's would skip them all, so this replica's values are not its to give.
        self._errored_at_start = self._manager.errored() is not None
        self._voted = False
        # (This sync's collectives, one for one with the peers'.)
        self._link = Link(len(self._buckets))
        self._speculative = self._spec_stale = False
        if self._spec is not None:
            try:
                # The hyperparameters the speculative step takes (perform_sync checks
                # that they are still the user's).
                self.outer.sync_from_user()
            except Exception:  # noqa: BLE001 - raised by perform_sync, before its decision
                pass
            else:
                self._speculative = self._spec.begin(list(zip(self._backups, self._host_grads,
                                                              strict=True)))
        self._ex = ex = execute(diloco_graph(self._buckets, self._chunks, self._device,
                                             self._work(), form_first=self._form_first,
                                             speculative=self._speculative),
                                self._schedule())
        if self._options.schedule == "synchronous":
            self._settle("staged")
        elif self._form_first and not self._guard_formation:
            # Hazard: an inner optimizer that writes the parameters before its next
            # step() (FullOffloadOptimizer(overlap="backward"): its chunks, on its
            # lanes, during the next backward) writing what the pseudo-gradient tasks
            # have not read: they are read before step() returns (on CUDA the
            # caller's stream waits; the host does not).
            self.wait_formed()
        elif self._form_first and not _faults.disabled("diloco_formation_guard"):
            # Hazard: the pseudo-gradients formed from parameters that the caller
            # writes once step() returns (a clamp, a load_state_dict). The formation
            # runs under the next forward, which only reads them; an eager write on
            # this thread waits for it first (the write guard), and the inner
            # optimizer's next step waits in DiLoCo's pre-step hook (wait_formed).
            chunks: list[list[int]] = [[] for _ in self._params]
            for k, b in enumerate(self._buckets):
                for pc in b.pieces:
                    chunks[pc.param].append(k)
            self._formation.begin(StepWrites(
                execution=ex, params=tuple(self._params), device=self._device,
                write_tasks=tuple(f"pseudograd:b{k}" for k in range(len(self._buckets))),
                chunks_of=tuple(tuple(c) for c in chunks),
                written=tuple(i for i, c in enumerate(chunks) if c),
                grad_of=lambda i: None))

    def _formation_failed(self) -> None:
        """The write guard met a failed formation: stop the sync (its failure is kept
        for ``perform_sync``, which reports it and rejects) and let the write go on."""
        ex = self._ex
        self._formation.end()
        if ex is not None and ex.exception is not None:
            self._stop(ex.exception)

    def _settle(self, task: str) -> None:
        """Wait for ``task``; a failure is kept for ``perform_sync`` (which reports
        it and rejects), after the whole execution has stopped."""
        ex = self._ex
        assert ex is not None
        try:
            ex.wait(task)
        except Exception as err:  # noqa: BLE001 - reported to the manager at perform_sync
            self._stop(err)

    def _stop(self, err: BaseException) -> None:
        ex = self._ex
        assert ex is not None
        if self._failed is None:
            self._failed = err
        # Hazard: restoring (or the next inner step writing) parameters that a
        # task of the failed execution still reads. Every task that started
        # finishes, the all-reduces too (must_run: peers wait for them); the
        # others never run.
        try:
            ex.wait()
        except Exception:  # noqa: BLE001 - the same failure, kept above
            pass

    @property
    def speculates(self) -> bool:
        """Whether its syncs may take the outer step before the decision."""
        return self._spec is not None

    def note_state_access(self) -> None:
        """The loop accessed the user's outer state (any thread)."""
        if self._spec is not None:
            self._spec.note_access()

    def wait_formed(self) -> None:
        """Before an inner step: wait until no task of the sync in flight reads the
        parameters (on CUDA, the caller's stream waits; the host does not)."""
        ex = self._ex
        if ex is None or self._failed is not None:
            self._formation.end()
            return
        if not _faults.disabled("diloco_formed_wait"):
            # Hazard: the inner step writing parameters that the pseudo-gradient tasks
            # have not read yet (a compiled step, or one whose writes the write guard
            # does not see, as FullOffloadOptimizer's copies on its lanes).
            names = [f"pseudograd:b{k}" for k in range(len(self._buckets))]
            for c in ex.events_for(names):
                c.wait()
        self._formation.end()
        if ex.exception is not None:
            self._stop(ex.exception)

    def wait(self) -> None:
        """Wait until every average of the sync in flight is on the host."""
        if self._ex is not None and self._failed is None:
            self._settle("staged")

    def perform_sync(self) -> bool:
        """Decide, then step, merge and write (or restore); returns whether committed."""
        ex = self._ex
        manager = self._manager
        self.last_committed = False
        self._formation.end()  # (formed: the inner step before this waited for it)
        if ex is None and self._abandoned is not None:
            # The sync was abandoned (DiLoCo's context exited with it in flight) and
            # the loop went on: this replica rejects it, as torchft's failure path
            # does, and the next round starts clean.
            err, self._abandoned = self._abandoned, None
            manager.report_error(err)
            self._vote()  # (joined by abandon() already)
            manager.should_commit()
            self.restore_parameters()
            return False
        if ex is None:
            raise RuntimeError("perform_sync() without prepare_sync()")
        opened = deciding = False
        asked_at = -1
        try:
            if self._failed is None:
                self._settle("staged")
            if self._failed is not None:
                # torchft's error path: after report_error this replica group's
                # should_commit() is False. It is still called once, as in every
                # sync: the replica group's other ranks wait on it.
                manager.report_error(self._failed)
                self._vote()  # (_stop() waited for its all-reduces)
                manager.should_commit()
                self.restore_parameters()  # torchft's own, synchronous
                return False
            try:
                # Read on this thread before any outer task runs (they wait for the
                # gate): a learning-rate schedule edits the user's groups, a
                # checkpoint loads the user's optimizer.
                spec = self._spec
                if self._speculative and spec is not None and (
                        self._spec_stale or self.outer.user_changed()
                        or spec.state_edited()):
                    # Hazard: keeping a step taken with other hyperparameters or state
                    # than the decision's (an lr schedule's edit, a healing load, the
                    # state edited in place): it is taken again after the decision, in
                    # place (the lane that keeps the spares runs after the gate opens).
                    spec.take_in_place()
                self.outer.sync_from_user()
            except Exception as err:
                # Found before the decision: this replica rejects, as after any
                # failure of its own, and the caller sees why.
                stop = PipeoffError(f"the sync was rejected before its decision: {err}")
                ex.gate("commit").fail(stop)
                opened = True
                self._stop(stop)
                manager.report_error(err)
                self._vote()
                manager.should_commit()
                self.restore_parameters()
                raise
            self._vote()  # (all staged)
            asked_at = manager.current_step()
            deciding = True
            committed = bool(manager.should_commit())
            deciding = False  # (a failure from here on is after the decision)
            self.last_committed = committed
            ex.gate("commit").open(committed)
            opened = True
            if self._tail is not None:
                # The outer step and the writes run on under the next forward, whose
                # modules wait for the buckets they read (_diloco_tail.py).
                self._tail.begin(ex, self._fragment_id, self._buckets, committed=committed,
                                 on_end=lambda _ex: self.outer.alias())
                return committed
            try:
                ex.wait()
                self.outer.alias()  # state the step created, shown in the user's optimizer
            except Exception as err:
                # A host step or a write failed after the decision: the parameters
                # (and, after a commit, the backup and outer state) are partly
                # written. Tell torchft, so that this replica group's next
                # should_commit() is False, and raise.
                manager.report_error(err)
                err.add_note(late_note(committed))
                raise
            return committed
        except BaseException as err:
            if not opened and ex.gate("commit").state == "pending":
                # Ctrl-C (or a failing should_commit) before the decision: stop the
                # lanes that wait for it, so that nothing of this sync runs on. (Not
                # with err itself, which the caller gets: no note of pipeoff's on it.)
                # The buckets not yet formed or staged go in as formed first, as in
                # abandon() (a tester's find: they went in as zeros, the peer
                # committed them).
                self._join_all_reduces(ex)
                ex.gate("commit").fail(PipeoffError(
                    f"the sync was stopped before its decision ({type(err).__name__})"))
            with contextlib.suppress(BaseException):  # (a second Ctrl-C skips it)
                try:
                    ex.wait()  # (its all-reduces first: the vote follows them on the group)
                except BaseException as failure:
                    # Its own failure (the gate failed above fails the tasks
                    # that waited for it): every task has ended, so vote. Anything else
                    # interrupted this wait: a second Ctrl-C, which skips the vote.
                    if not is_failure_of(failure, ex):
                        raise
                self._vote()
            if deciding:
                # should_commit() raised (or a Ctrl-C in it): torchft restored the
                # backup before asking, so its parameters are the global ones; so are
                # these (every task has ended: nothing of the sync writes them now).
                # Hazard: a loop that catches the error training on local values where
                # torchft's trains on the backup.
                with held_through("restoring the fragment's parameters from its backup"):
                    self.restore_parameters()
                if not isinstance(err, Exception):
                    # Hazard: a replica that missed a commit torchft counted, said
                    # nothing of (a tester's find: 2.6e-2 from its peer, never healed).
                    err.add_note(interrupted_note("in", manager.current_step() > asked_at))
            elif not opened and not isinstance(err, Exception):
                err.add_note(interrupted_note("before"))
            elif opened and self._tail is None and not isinstance(err, Exception):
                self._interrupted_after_decision(err, ex)
            raise
        finally:
            self._ex = None
            self._outer_optimizer.zero_grad()  # as torchft: the parameters' .grad is None after
            if ex.done() and not (self._tail is not None and self._tail.in_flight):
                self._on_trace(ex.trace)

    def abandon(self, why: BaseException) -> bool:
        """Stop the sync in flight, if any, without a decision: its all-reduces still
        run (peers wait for them), nothing is written, and no outer step runs. Returns
        whether there was one."""
        ex = self._ex
        self._formation.end()
        if ex is None:
            return False
        self._ex = None
        self._abandoned = PipeoffError(
            "this DiLoCo fragment sync was abandoned: the DiLoCo context exited while it "
            f"was in flight ({type(why).__name__}: {why})")
        # Hazard: a peer committing an average in which this replica's buckets not yet
        # formed count as zero, where torchft's prepare_sync formed them all and issued
        # their all-reduces (a tester's find). They run to the end first, as if the sync
        # went on: the parameters still hold what the formation reads (the next inner
        # step and eager writes wait for it); failing the decision's gate now would skip
        # the formation still to come.
        if not _faults.disabled("diloco_abandon_forms"):
            self._join_all_reduces(ex)
        if ex.gate("commit").state == "pending":
            ex.gate("commit").fail(self._abandoned)  # (not why: the loop's own error)
        try:
            ex.wait()
        except BaseException:  # noqa: BLE001 - the failure given, or one before it
            pass
        # Hazard: a peer waiting in this sync's vote until the group's timeout, and
        # rejecting, where torchft's peer commits (this replica may never come back
        # to perform_sync: the loop raised, and that exception goes on).
        with contextlib.suppress(BaseException):
            self._vote()
        return True

    def _join_all_reduces(self, ex: Execution) -> None:
        """Wait for the sync's all-reduces, each with its bucket as formed (a failure of
        the sync ends the wait). A second Ctrl-C ends it too, and breaks the link: the
        collectives not yet joined and the vote are skipped, the peers time out and
        reject. Hazard: the buckets not yet formed joined as zeros, and voted for (a
        tester's find: the peer committed that average)."""
        try:
            for c in ex.events_for([f"allreduce:b{k}" for k in range(len(self._buckets))]):
                c.wait()
        except BaseException as err:  # noqa: BLE001 - the sync's failure, or a Ctrl-C
            if not is_failure_of(err, ex):
                self._link.broken = True

    def _interrupted_after_decision(self, err: BaseException, ex: Execution) -> None:
        """A Ctrl-C in the wait for the writes (synchronous schedule), after the decision,
        and after the execution was waited for again: say what the sync left, on
        ``err``. A task that failed meanwhile (the Ctrl-C does not stop the lanes) is
        reported to torchft, and named on ``err``.

        Hazard: a replica partly written, or whole but said nothing of (a tester's
        find: the committed merge was restored away, with no word)."""
        committed = self.last_committed
        if not ex.done():
            return  # (a second Ctrl-C: the writes go on)
        failure = ex.exception
        if failure is not None:
            self._manager.report_error(reportable(failure, "DiLoCo's sync after its decision"))
            err.add_note(f"pipeoff: {ex.failed_task!r} failed meanwhile: {failure!r}")
            err.add_note(late_note(committed))
            return
        self.outer.alias()  # (as a sync that returned)
        err.add_note("pipeoff: DiLoCo's sync ran to its end before the Ctrl-C was passed on: "
                     + ("committed; the parameters hold the merge" if committed else
                        "rejected; the parameters are restored from the backup"))

    def _vote(self) -> None:
        """This sync's vote (``pipeoff/ft/_collective.py``), once, after its all-reduces:
        every path that ends the sync joins it, as the peers do."""
        if not self._voted:
            self._voted = True
            vote(self._manager, self._errored_at_start, self._device, self._link)

    def _work(self) -> DiLoCoWork:
        """The lane work of one sync, over this fragment's tensors."""
        return SyncWork(
            params=self._params, backups=self._backups, grads=self._host_grads,
            outer=self.outer, manager=self._manager, device=self._device, cuda=self._cuda,
            alpha=self._fragment_update_alpha,
            synchronous=self._options.schedule == "synchronous",
            form_first=self._form_first, masters=self._masters,
            spec=self._spec if self._speculative else None, link=self._link).work()

    @property
    def on_masters(self) -> bool:
        """Whether the sync reads and writes the inner optimizer's FP32 masters."""
        return self._masters is not None

    def restore_parameters(self) -> None:
        """torchft's restore (a sync that failed or was abandoned before its decision):
        the parameters from the backup; on the masters, the masters and the weights
        their cast."""
        if self._masters is None:
            super().restore_parameters()
            return
        with torch.no_grad():
            for name, p, m in zip(self._names, self._params, self._masters, strict=True):
                m.copy_(self.original_parameters[name].view(m.shape))
                local_tensor(p, data=True).copy_(m)


def master_backups(frag: _StreamingDiLoCoFragment,
                   masters: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make ``frag``'s backups (torchft's ``original_parameters``) FP32 copies of the
    masters: the global model in the masters' precision. Before anything holds them
    (the host outer optimizer steps these very tensors)."""
    device = next((local_tensor(p, data=True).device
                   for p in frag._model_fragment.parameters()), torch.device("cpu"))
    cuda = _accel.current().is_device(device)
    for name, p in frag._model_fragment.named_parameters():
        m = masters(p)
        b = _accel.current().host_empty(m.shape, torch.float32, pinned=cuda)
        b.copy_(m)
        frag.original_parameters[name] = b
