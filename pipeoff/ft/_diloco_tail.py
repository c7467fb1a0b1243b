"""The part of an offloaded DiLoCo sync after its decision, run under the next forward.

Once the quorum has decided, a fragment sync has its host outer step and its
writes (the merge, or the restore) left to do, and on a real node they take
longer than everything before them: the outer step alone moves 20 bytes per
parameter (SGD with momentum) through the rank's share of the host's memory
bandwidth. torchft runs them before ``step()`` returns. pipeoff returns once the
decision is taken and lets them run under the next forward, the way the overlap
optimizer's step runs under it: each module of the fragment waits, before its
forward, only for the buckets that write the parameters it reads
(:class:`~pipeoff.optim._waits.ForwardWaits`: module hooks, FSDP2's units
waiting for their all-gathers' inputs, and the read guard for eager reads on
the training thread). Buckets are written in the fragment's parameter order,
which is the forward's for the models DiLoCo is used with, so the first module
waits for the first bucket only.

Everything else that reads or writes what the tail writes waits for all of it
(:meth:`SyncTail.wait`, called by :class:`~pipeoff.ft.DiLoCo`): the inner
optimizer's next step (its step pre-hook: it writes the parameters; the read
guard would catch its eager ops, compiled ones it would not), the next sync of
any fragment (a tied weight is in several), the checkpoint functions torchft
calls on its quorum thread (the backup and the outer state), DiLoCo's exit, and
the readers of the sync's figures.

A failure of the tail (the outer step or a write) reaches the first wait that
meets it, a forward hook or one of the above: it is reported to the Manager
(so that this replica group's next ``should_commit()`` is False and torchft
heals it) and raised there, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pipeoff import _faults
from pipeoff._contract import StepWrites
from pipeoff._errors import StepFailedError
from pipeoff._lowlevel import hook_wait_records
from pipeoff.ft._buckets import Bucket
from pipeoff.optim import _hooks
from pipeoff.optim._waits import ForwardWaits

if TYPE_CHECKING:
    from pipeoff.execution import Execution
    from pipeoff.trace import Trace

__all__ = ["Settled", "SyncTail", "failed_after_decision", "interrupted_note", "late_note",
           "write_task"]


def write_task(k: int) -> str:
    """The task that writes bucket ``k``'s parameters (``_diloco_graph.py`` names it)."""
    return f"write:b{k}"


def late_note(committed: bool) -> str:
    """The note on a failure after the decision: what it left, and how to go on."""
    return ("pipeoff: DiLoCo's sync failed after the quorum "
            + ("committed; the backup, the outer state and the parameters are partly "
               "updated." if committed else "rejected; the parameters are partly restored.")
            + " Restart this replica so that torchft heals it from a peer.")


def interrupted_note(where: str, counted: bool = False) -> str:
    """The note on a Ctrl-C that stopped a sync ``where`` ("before" its decision, or
    "in" torchft's ``should_commit()``; ``counted``: after torchft counted a commit):
    what the replica holds, and how to go on."""
    if where == "before":
        held = ("was stopped before its decision: every bucket's all-reduce ran as "
                "formed (the peers may commit their average); this replica did not "
                "commit, and its parameters hold its own inner steps")
    elif counted:
        held = ("was interrupted in should_commit() after torchft counted its commit "
                "(this replica's step moved on with its peers'), before the merge: its "
                "parameters are restored from the backup, as torchft's DiLoCo leaves "
                "them, so it is out of step with its peers and no quorum heals it")
    else:
        held = ("was interrupted in should_commit(), before torchft counted a commit: its "
                "parameters are restored from the backup (the global model)")
    return (f"pipeoff: DiLoCo's sync {held}. torchft's DiLoCo does not go on after a sync "
            "that raised (its next step() fails an assertion): restart this replica so "
            "that torchft heals it from a peer.")


def failed_after_decision(err: BaseException) -> StepFailedError:
    """The refusal of a sync after an earlier one failed after its decision (``err``):
    torchft's next quorum forgets the error reported then, so the replica would
    average and commit a partly written model, never healed."""
    return StepFailedError(
        f"an earlier DiLoCo sync of this replica failed after its decision ({err!r}) and "
        "left its parameters (and, after a commit, the backup and outer state) partly "
        "written; later syncs are refused: restart this replica so that torchft heals it "
        "from a peer")


@dataclasses.dataclass(frozen=True, slots=True)
class Settled:
    """What a tail that ended leaves: its execution's trace with the forward hooks'
    waits, how long they waited in all (``perf_counter_ns``), and which fragment's
    sync it was."""

    fragment: int
    trace: Trace
    waited_ns: int


class SyncTail:
    """The forward waits of every fragment of one DiLoCo, and the tail in flight.

    One tail is in flight at a time: the inner step that follows a sync waits for
    it, and the next sync comes after that step. Each fragment has its own
    hooks (its modules are its own tree) and waits for the parameters of its
    own that the tail writes, which with a weight tied across fragments are
    another fragment's too.

    Args:
        fragments: per fragment, its module and its parameters in its order (the
            order its buckets index).
        device: the parameters' device.
        manager: torchft's ``Manager``; a failure of a tail is reported to it.
    """

    def __init__(self, fragments: Sequence[tuple[torch.nn.Module, Sequence[torch.Tensor]]],
                 device: torch.device, manager: Any) -> None:
        self.fragments = [(m, tuple(ps)) for m, ps in fragments]
        self.device = device
        self.manager = manager
        self.waits = [ForwardWaits(self._failed, waited_for="DiLoCo's sync in flight (its "
                                   "outer step and writes)", wait_call="diloco.wait_for_sync()")
                      for _ in self.fragments]
        self._handles: list[Any] = []
        self._ex: Execution | None = None
        self._writer = 0
        self._committed = False
        self._on_end: Callable[[Execution], None] | None = None
        self._hook_waits: list[list[tuple[str, int, int]]] = []
        self.settled: Settled | None = None
        self.failed: BaseException | None = None
        """A tail's failure after its decision, once raised: the replica is partly
        written, and DiLoCo refuses its later syncs (``failed_after_decision``)."""
        """The last tail that ended, until :meth:`take_settled`."""

    # -- the hooks ---------------------------------------------------------------------
    def install(self) -> None:
        """Install every fragment's forward waits (once; DiLoCo's ``__enter__``).

        Every handle is installed or none is."""
        if self._handles:
            return
        handles: list[Any] = []
        try:
            for waits, (module, params) in zip(self.waits, self.fragments, strict=True):
                # (The tail writes weights, never reads gradients: no wait before backward.)
                handles += _hooks.install(waits, module, params, reads_grads=False)
        except BaseException:
            for h in handles:
                h.remove()
            raise
        self._handles = handles

    def remove(self) -> None:
        """Remove them (DiLoCo's ``__exit__``, once no tail is in flight)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- a tail's life -----------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """Whether a tail is in flight (begun and not yet waited for)."""
        return self._ex is not None

    def begin(self, ex: Execution, writer: int, buckets: Sequence[Bucket], *, committed: bool,
              on_end: Callable[[Execution], None]) -> None:
        """Fragment ``writer``'s sync ``ex`` has its decision (``committed``): its writes
        run on, and the parameters of its bucket ``k`` are pending until
        ``write:b{k}`` is done. ``on_end(ex)`` runs once it is waited for (the
        fragment's bookkeeping), before a failure is raised.

        Raises:
            RuntimeError: a tail is in flight already.
        """
        if self._ex is not None:
            raise RuntimeError("a DiLoCo sync's tail is already in flight")
        wparams = self.fragments[writer][1]
        buckets_of: dict[int, list[int]] = {}
        for k, b in enumerate(buckets):
            for pc in b.pieces:
                buckets_of.setdefault(id(wparams[pc.param]), []).append(k)
        self._ex, self._writer, self._committed, self._on_end = ex, writer, committed, on_end
        self._hook_waits = []
        if _faults.disabled("diloco_forward_wait"):
            return
        tasks = tuple(write_task(k) for k in range(len(buckets)))
        for waits, (_, params) in zip(self.waits, self.fragments, strict=True):
            # a weight tied across fragments: the other fragments' modules read it too
            chunks = tuple(tuple(buckets_of.get(id(p), ())) for p in params)
            written = tuple(i for i, c in enumerate(chunks) if c)
            if not written:
                self._hook_waits.append([])
                continue
            self._hook_waits.append(waits.begin(StepWrites(
                execution=ex, write_tasks=tasks, params=params, chunks_of=chunks,
                device=self.device, written=written,
                grad_of=lambda i: None)))  # the sync reads no gradient

    def wait(self) -> bool:
        """Block until the tail in flight (if any) is done; whether there was one.

        On the training thread (the one that called ``perform_sync``). A failure
        of the tail is reported to the Manager and raised, once.
        """
        ex = self._ex
        if ex is None:
            return False
        self._ex = None
        if _faults.disabled("diloco_tail_wait"):
            self._end_waits()
            return False
        try:
            # Hazard: the caller (the inner step, the next sync, an exit, a reader of
            # the figures) reading or writing parameters, backups or outer state
            # that the tail is still writing.
            ex.wait()
        except BaseException as err:
            self._end(ex)  # (after a Ctrl-C too: it waits for the tail to end)
            failure = err if isinstance(err, Exception) else ex.exception
            if failure is not None:  # (Ctrl-C: the tail may have failed meanwhile)
                # Reported (this replica group's next should_commit() is False), raised
                # once, here, and every later sync refused (failed_after_decision).
                self.manager.report_error(failure)
                failure.add_note(late_note(self._committed))
                self.failed = failure
                if failure is not err:
                    err.add_note(f"pipeoff: the sync's tail failed meanwhile ({failure!r}); "
                                 "later syncs of this replica are refused")
            raise
        self._end(ex)
        return True

    def wait_done(self) -> None:
        """Block until the tail in flight is done, from any thread, changing nothing
        (torchft's checkpoint functions, on its quorum thread).

        Raises:
            BaseException: the tail's failure (nothing may read what it left).
        """
        ex = self._ex
        if ex is not None:
            # Hazard: a healing peer sent (or this replica loading over) a backup and
            # outer state that the outer step is still writing.
            ex.wait()

    def _end_waits(self) -> None:
        for waits in self.waits:
            waits.end()

    def _end(self, ex: Execution) -> None:
        self._end_waits()
        trace = ex.trace
        records = hook_wait_records([w for ws in self._hook_waits for w in ws], ex.origin_ns,
                                    trace.metadata.get("rank", 0))
        self._hook_waits = []
        self.settled = Settled(
            fragment=self._writer,
            trace=dataclasses.replace(trace, tasks=trace.tasks + records) if records else trace,
            waited_ns=sum(r.duration_ns for r in records))
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(ex)

    def take_settled(self) -> Settled | None:
        """The last tail that ended, once."""
        out, self.settled = self.settled, None
        return out

    def _failed(self) -> None:
        """A forward wait met a failed write (``ForwardWaits``' ``on_failure``): wait for
        the rest of the tail and raise its failure."""
        self.wait()
