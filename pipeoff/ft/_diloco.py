"""torchft's (streaming) DiLoCo with the outer state and the pseudo-gradients in host memory."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn, optim
from torchft.local_sgd import DiLoCo as _TorchftDiLoCo
from torchft.local_sgd import _StreamingDiLoCoFragment

from pipeoff import _faults
from pipeoff._compat import local_tensor
from pipeoff._contract import AsyncStep, MasterCopy, steps_taken
from pipeoff._errors import ConfigError, PipeoffError
from pipeoff._lowlevel import SyncStats, train_span
from pipeoff.ft._args import check_diloco_knobs, check_manager
from pipeoff.ft._diloco_fragment import OffloadedFragment, master_backups
from pipeoff.ft._diloco_tail import SyncTail, failed_after_decision
from pipeoff.ft._options import StagingOptions, check_flag, check_sync_schedule
from pipeoff.ft._outer import WaitingState, check_outer, host_outers, own_read
from pipeoff.trace import StepStats

if TYPE_CHECKING:
    from torchft.manager import Manager

    from pipeoff.trace import Trace

__all__ = ["DiLoCo"]


class DiLoCo(_TorchftDiLoCo):  # type: ignore[misc]  # torchft ships no type hints
    """torchft's (streaming) DiLoCo, with its outer state and pseudo-gradients in host memory.

    A drop-in for :class:`torchft.local_sgd.DiLoCo`: the same constructor, the
    same optimizer hooks, fragment schedule, quorum and ``should_commit()`` per
    sync, the same checkpoint keys (``StreamingDiLoCoFragment_{i}``) for
    healing. With ``offload_to_cpu=False`` (the default) it is torchft's DiLoCo
    bit for bit, plus two things every mode does: an inner optimizer that steps
    asynchronously (``pipeoff.optim.OffloadOptimizer(mode="overlap")``) is
    waited for before a sync reads the parameters, and one whose FP32 masters
    are the truth (``pipeoff.optim.FullOffloadOptimizer``) refreshes them after
    every sync (a sync writes the parameters whether it commits or not).

    With ``offload_to_cpu=True`` each fragment's sync is one pipeoff execution,
    from ``prepare_sync`` to the end of ``perform_sync``:

    * per bucket of at most ``bucket_bytes``, in device staging: the backup's
      slice is copied in and the local parameters subtracted (the
      pseudo-gradient, ``original - local`` as torchft forms it), the bucket
      is averaged over the replica groups, and the average is staged in host
      memory until ``should_commit()``;
    * on commit, per chunk of whole parameters: the outer optimizer steps *in
      host memory*, on the backup itself (which becomes the new global
      parameters) with its state (momentum, moments) in host memory; then per
      bucket, the new global parameters are copied into device staging,
      merged with the local ones (``lerp`` by ``fragment_update_alpha``, the
      op torchft's merge runs) and written into the parameters. No snapshot
      of the local parameters is taken: they are read in place;
    * on a reject (or a failure before the commit), the parameters are
      restored from the backup, as torchft does, and the backup and the outer
      state are untouched.

    Device memory (S_f = bytes of one fragment's local parameters):

    =====================  =========================  ==========================
    mode                   persistent                 during a sync
    =====================  =========================  ==========================
    torchft                outer state (SGD with       pseudo-gradients S_f, local
                           momentum: S)                snapshot S_f
    ``offload_to_cpu``     none                        ``device_budget_bytes``
    =====================  =========================  ==========================

    Host memory: the backup (S, as torchft) and the host pseudo-gradients
    (S) and outer state (SGD momentum: S; Adam: 2S).

    ``schedule="pipelined"`` overlaps the copies, the all-reduces and the host
    steps within ``device_budget_bytes``; ``"synchronous"`` runs one task at a
    time and ``prepare_sync`` returns only once every average is on the host.
    With ``fragment_sync_delay`` > 0 the all-reduces run under the next inner
    steps: the preparing ``step()`` returns once the pseudo-gradients are formed
    (its ``prepare_sync`` waits for them: nothing the caller does next may write
    the parameters they read), and the averaging goes on in the background.

    The outer optimizer must be a ``torch.optim.SGD``, ``Adam`` or ``AdamW``
    (element-wise: stepped per chunk). Its ``param_groups`` stay the user's
    (edit ``lr`` there; it is read at every sync); its state lives in the host
    copy, which the checkpoint functions save and load. On a CPU device the
    results are bitwise torchft's; on CUDA the outer step runs torch's CPU
    kernel for the optimizer instead of the CUDA one (the same formula, rounded
    by another implementation).

    Args:
        manager, model_fragments, inner_optimizer, outer_optimizer, sync_every,
        backup_device, pin_memory, use_bucketization, bucket_cap_mb,
        should_quantize, fragment_sync_delay, fragment_update_alpha: torchft's.
        offload_to_cpu: keep the outer state and the pseudo-gradients in host
            memory, and bound the device memory of a sync.
        schedule: ``"pipelined"`` (the default) or ``"synchronous"``; only with
            ``offload_to_cpu=True``.
        bucket_bytes: most bytes of one bucket (default 16 MiB, or half of
            ``device_budget_bytes`` when only it is given), or
            ``"per_parameter"``; also the size of the outer step's chunks.
        device_budget_bytes: most device staging bytes live at once (default:
            two buckets).

    Raises:
        ConfigError: ``sync_every`` (an int, at least and a multiple of the
            fragments), ``fragment_sync_delay`` (an int in ``[0, sync_every //
            fragments)``), ``fragment_update_alpha`` (in ``[0, 1]``) or a list of
            outer optimizers (one per fragment) out of range; an option is given
            without ``offload_to_cpu=True`` or is out of range; with
            ``offload_to_cpu=True``: ``should_quantize=True`` (torchft's quantized
            all-reduce runs on the device), a
            ``backup_device`` other than the CPU, an outer optimizer that is not
            SGD/Adam/AdamW, or one with a parameter in no fragment.
        ValueError: torchft's own check of an async quorum.
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments: list[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | list[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        *,
        offload_to_cpu: bool = False,
        schedule: Literal["pipelined", "synchronous"] | None = None,
        bucket_bytes: int | Literal["per_parameter"] | None = None,
        device_budget_bytes: int | None = None,
    ) -> None:
        offload = check_flag("offload_to_cpu", offload_to_cpu)
        check_manager(manager)
        check_diloco_knobs(model_fragments, inner_optimizer, outer_optimizer,
                           backup_device=backup_device, pin_memory=pin_memory,
                           use_bucketization=use_bucketization, bucket_cap_mb=bucket_cap_mb,
                           should_quantize=should_quantize)
        sync_every, fragment_sync_delay, fragment_update_alpha = check_sync_schedule(
            sync_every, len(model_fragments), fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            outer_optimizers=len(outer_optimizer) if isinstance(outer_optimizer, list) else None)
        if offload and bucket_bytes is None and bucket_cap_mb is not None:
            # torchft's bucket size (its MiB, as torchft converts them) is the
            # offloaded sync's unless bucket_bytes is given.
            bucket_bytes = int(bucket_cap_mb * 1024 * 1024)
        opts = StagingOptions.resolve(flag="offload_to_cpu", offload=offload,
                                      schedule=schedule, bucket_bytes=bucket_bytes,
                                      device_budget_bytes=device_budget_bytes)
        if offload:
            if should_quantize:
                raise ConfigError(
                    "should_quantize=True cannot be combined with offload_to_cpu=True: "
                    "torchft's quantized all-reduce runs on the device's own buffers")
            if backup_device is not None and torch.device(backup_device).type != "cpu":
                raise ConfigError(
                    f"offload_to_cpu=True keeps the backup in host memory; backup_device "
                    f"must be None or 'cpu', got {backup_device!r}")
            outers = outer_optimizer if isinstance(outer_optimizer, list) else [outer_optimizer]
            for j, opt in enumerate(outers):
                check_outer(opt, f"outer_optimizer[{j}]" if isinstance(outer_optimizer, list)
                            else "outer_optimizer")
        # Read by _register_state_dict_fn, which torchft's constructor calls.
        self._offload = offload
        self._options = opts
        self._last_trace: Trace | None = None
        self._stats = SyncStats()
        self._tail: SyncTail | None = None
        self._outer_hooks: list[Any] = []
        self._in_alias = threading.local()
        """The forward waits for a sync's outer step and writes (pipelined, offloaded)."""
        self._exposed: dict[int, tuple[int, int]] = {}
        """Per fragment whose sync's tail is in flight: ``(step, ns step() took)``."""
        self._chosen: int | None = None
        """The fragment torchft last chose to prepare or sync (its _current_fragment)."""
        self._fragments: list[_StreamingDiLoCoFragment]
        super().__init__(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every,
                         backup_device, pin_memory, use_bucketization, bucket_cap_mb,
                         should_quantize, fragment_sync_delay, fragment_update_alpha)

    # -- configuration, read-only ------------------------------------------------
    @property
    def offload_to_cpu(self) -> bool:
        """Whether the outer state and the pseudo-gradients live in host memory."""
        return self._offload

    @property
    def schedule(self) -> str:
        """``"pipelined"`` or ``"synchronous"`` (meaningful with ``offload_to_cpu``)."""
        return self._options.schedule

    @property
    def bucket_bytes(self) -> int | None:
        """The bucket limit, or ``None`` for one bucket per parameter."""
        return self._options.bucket_bytes

    @property
    def device_budget_bytes(self) -> int | None:
        """The cap on live device staging of a pipelined sync."""
        return self._options.device_budget_bytes

    @property
    def last_sync_stats(self) -> StepStats | None:
        """The :class:`pipeoff.trace.StepStats` of the last fragment sync (``what="sync"``;
        ``committed`` with ``offload_to_cpu``; ``exposed_ms`` counts the next forward's
        waits for it). Without offload only its time: torchft's copies and collectives
        are not traced. Waits for a sync whose outer step and writes are in flight."""
        self.wait_for_sync()
        return self._stats.last

    @property
    def last_trace(self) -> Trace | None:
        """The trace of the last offloaded fragment sync, with the forward hooks' waits
        for it (``None`` without offload). Waits for a sync in flight, as
        :attr:`last_sync_stats` does."""
        self.wait_for_sync()
        return self._last_trace

    def wait_for_sync(self) -> None:
        """Block until the last fragment sync has written everything: its outer step
        (the backup and the outer state) and its writes of the parameters.

        With ``offload_to_cpu=True`` and the pipelined schedule, ``step()`` returns
        once a sync's quorum has decided, and the outer step and the writes run
        under the next forward, whose modules each wait for the parameters they
        read. DiLoCo itself waits before the next inner step, the next sync, its
        exit and its checkpoint functions. Call this for any other reader of the
        parameters or the outer state: another thread, a checkpoint of the model
        taken outside ``state_dict()``, ``torch.compile``'d code that reads a
        parameter outside its module.

        Raises:
            Exception: the sync's outer step or write failed (reported to the
                Manager; raised once, by the first wait that meets it).
        """
        tail = self._tail
        if tail is None:
            return
        try:
            tail.wait()
        finally:
            self._settled()

    def _settled(self) -> None:
        """Record the figures of a tail that ended (wherever it was waited for)."""
        settled = self._tail.take_settled() if self._tail is not None else None
        if settled is None:
            return
        self._last_trace = settled.trace
        pending = self._exposed.pop(settled.fragment, None)
        if pending is None:
            return
        step, exposed = pending
        frag = self._fragments[settled.fragment]
        self._stats.done(settled.trace, step=step, exposed_ns=exposed + settled.waited_ns,
                         committed=getattr(frag, "last_committed", None))
        self._stats.emit()

    def register_sync_stats_hook(self, hook: Callable[[StepStats], None]) -> Any:
        """Call ``hook(stats)`` after every fragment sync; returns a handle with
        ``remove()``.

        Raises:
            ConfigError: ``hook`` is not callable.
        """
        return self._stats.hooks.add(hook)

    def outer_state_dict(self, fragment: int = 0) -> dict[str, Any]:
        """The outer optimizer's state dict of ``fragment`` (host tensors under
        ``offload_to_cpu``; the user's optimizer's otherwise)."""
        frag = self._fragments[fragment]
        if isinstance(frag, OffloadedFragment):
            self.wait_for_sync()  # (the outer step writes it)
            return frag.outer.state_dict()
        return frag._outer_optimizer.state_dict()  # type: ignore[no-any-return]

    # -- torchft's extension points -------------------------------------------------
    def _register_state_dict_fn(self) -> None:
        # torchft's constructor calls this once its fragments exist and hold the
        # backup: the place to make them offloaded before anything is registered.
        if self._offload:
            frags = self._fragments
            # The outer step and the writes under the next forward: pipelined, and not
            # over an optimizer whose masters are the truth (FullOffloadOptimizer
            # adopts the synced weights right after the sync, which must be written).
            if (self._options.schedule == "pipelined"
                    and not isinstance(self._local_optimizer, MasterCopy) and frags):
                self._tail = SyncTail(
                    [(f._model_fragment, list(f._model_fragment.parameters())) for f in frags],
                    _device_of(frags), self._manager)
            # Formed under the next forward, its writers waiting for it, unless the inner
            # optimizer writes the parameters before its next step() (pipeoff's own,
            # on their lanes, where no guard sees it).
            guard = not isinstance(self._local_optimizer, (AsyncStep, MasterCopy))
            masters = self._masters_of(frags)
            if masters is not None:
                for f in frags:
                    master_backups(f, masters)
            self._fragments = [
                OffloadedFragment.adopt(f, outer, self._options, self._on_trace, self._tail,
                                        guard, masters)
                for f, outer in zip(frags, host_outers(frags))]
        super()._register_state_dict_fn()

    def _masters_of(self, frags: Sequence[_StreamingDiLoCoFragment]
                    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The inner optimizer's FP32 host masters, if its masters are the truth and it
        holds every fragment parameter: the sync then works on them directly."""
        opt = self._local_optimizer
        if not isinstance(opt, MasterCopy):
            return None
        self._wait_for_optimizer()  # (a step in flight writes them)
        try:
            for f in frags:
                for p in f._model_fragment.parameters():
                    opt.host_master(p)
        except PipeoffError:
            return None  # a parameter it does not step: the weights' path, as torchft's
        return opt.host_master

    def __enter__(self) -> DiLoCo:
        try:
            if self._tail is not None:
                self._tail.install()
            if self._watches_outer_state():
                self._outer_hooks = [o.register_state_dict_pre_hook(self._before_outer_read)
                                     for o in self._user_outers()]
                self._wrap_outer_states()
            return super().__enter__()  # type: ignore[no-any-return]
        except BaseException:
            # Hazard: a failed ``with`` leaving forward waits on the model, and the
            # outer optimizers' state wrapped, for a DiLoCo that will never sync.
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        """Undo what ``__enter__`` installed (each part only if it was installed)."""
        if self._tail is not None:
            self._tail.remove()
        for h in self._outer_hooks:
            h.remove()
        self._outer_hooks = []
        for o in self._user_outers():
            if isinstance(o.state, WaitingState):
                o.state = defaultdict(dict, dict.items(o.state))
        super().__exit__(None, None, None)  # torchft's: its step hooks off

    def _watches_outer_state(self) -> bool:
        """Whether the user's outer optimizers' ``state`` is shown as a
        :class:`WaitingState`: a sync's tail writes it under the next forward, or a
        speculative outer step must see the loop's accesses (with any inner optimizer,
        FullOffloadOptimizer's too, which has no tail)."""
        return self._tail is not None or any(
            isinstance(f, OffloadedFragment) and f.speculates for f in self._fragments)

    def _user_outers(self) -> list[optim.Optimizer]:
        return list({id(f._outer_optimizer): f._outer_optimizer
                     for f in self._fragments}.values())

    def _wrap_outer_states(self) -> None:
        """The user's outer optimizers' ``state`` as :class:`WaitingState` (again after a
        ``load_state_dict()`` replaced it)."""
        for o in self._user_outers():
            if not isinstance(o.state, WaitingState):
                o.state = WaitingState(functools.partial(self._before_outer_state, o),
                                       o.state)
        for f in self._fragments:
            if isinstance(f, OffloadedFragment):
                f.outer.note_state()

    def _before_outer_read(self, optimizer: optim.Optimizer) -> None:
        """A user's outer optimizer's ``state_dict()`` is about to read the host state it
        shows (from any thread: a checkpoint writer's too)."""
        self._before_outer_state(optimizer)

    def _before_outer_state(self, optimizer: optim.Optimizer) -> None:
        """The user's outer optimizer ``optimizer``'s state is accessed (``state_dict()``,
        or its ``state`` read or edited in place: a momentum decay right after
        ``step()``)."""
        if not own_read():
            for f in self._fragments:
                if isinstance(f, OffloadedFragment) and f._outer_optimizer is optimizer:
                    # Hazard: keeping a speculative outer step taken from state the
                    # loop then edited where no version counter shows it (torch's
                    # in-place foreach ops under a TorchDispatchMode bump none).
                    f.note_state_access()
        tail = self._tail
        if tail is None or not tail.in_flight or getattr(self._in_alias, "on", False) \
                or _faults.disabled("outer_state_waits"):
            return
        self._in_alias.on = True  # (alias() below reads the state too)
        try:
            # Hazard: reading outer state the outer step is still writing, or editing it
            # before the step that torchft would have taken before step() returned
            # (the edit then lost, or stepped over); a checkpoint missing the state its
            # first step creates (shown once it is done).
            tail.wait_done()
            for f in self._fragments:
                if isinstance(f, OffloadedFragment):
                    f.outer.alias()  # (the training thread's settle does the same again)
        finally:
            self._in_alias.on = False

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> bool:
        try:
            # Hazard: leaving the block (and the model to its readers) while the last
            # sync's outer step and writes still run.
            self.wait_for_sync()
        finally:
            self._uninstall()
            # Hazard: lanes left waiting forever for the decision of a sync that was
            # prepared but will never be performed.
            dropped = [f for f in self._fragments if isinstance(f, OffloadedFragment)
                       and f.abandon(exc_value if isinstance(exc_value, BaseException) else
                                     PipeoffError("DiLoCo exited with a fragment sync in "
                                                  "flight"))]
            if dropped and exc_value is None:  # (a tester's find: it was silent)
                warnings.warn(
                    "DiLoCo: the `with` block ended with a fragment sync prepared and in "
                    f"flight (fragment_sync_delay={self._fragment_sync_delay}): it is "
                    "abandoned and every replica rejects it, where torchft's DiLoCo "
                    "performs it at the first step after the block is entered again; end "
                    "the block right after a sync, or enter it once for the whole run",
                    RuntimeWarning, stacklevel=2)
        return bool(super().__exit__(exc_type, exc_value, traceback))

    def _on_trace(self, trace: Trace) -> None:
        self._last_trace = trace

    def _step_pre_hook(self, _optim: optim.Optimizer, _args: tuple[Any, ...],
                       _kwargs: dict[str, Any]) -> None:
        # Hazard: the inner step writing parameters that the last sync's merge is
        # still writing (the read guard sees its eager ops; compiled ones it does not).
        self.wait_for_sync()
        for f in self._fragments:
            if isinstance(f, OffloadedFragment):
                f.wait_formed()  # (a sync in flight may still read the parameters)
        super()._step_pre_hook(_optim, _args, _kwargs)

    def _refuse_after_a_late_failure(self) -> None:
        """Raises ``StepFailedError`` before a sync (no quorum or collective begun) once
        an earlier sync failed after its decision: the report of that failure is gone
        at torchft's next quorum, which would commit a partly written model."""
        failed = self._tail.failed if self._tail is not None else None
        if failed is not None:  # (the synchronous schedule raises from perform_sync,
            # after which torchft's own counter refuses every step)
            raise failed_after_decision(failed) from failed

    def _wait_for_optimizer(self) -> None:
        opt = self._local_optimizer
        if isinstance(opt, AsyncStep):
            opt.wait_for_step()

    def _current_fragment(self) -> int:
        """torchft's own choice of the fragment to prepare or sync, recorded as it makes it.

        torchft calls this after ``start_quorum()`` (which moves a healing
        replica's step to its peers'), right before it prepares or performs that
        fragment's sync: pipeoff follows this choice rather than predicting it.
        """
        chosen = int(super()._current_fragment())
        self._chosen = chosen
        # Hazard: forming pseudo-gradients from (or restoring over) parameters that
        # an asynchronous inner step is still writing. torchft reads or writes the
        # fragment's parameters right after this call.
        self._wait_for_optimizer()
        fragment = self._fragments[chosen]
        opt = self._local_optimizer
        if getattr(fragment, "on_masters", False) and isinstance(opt, MasterCopy):
            # Hazard: forming pseudo-gradients from masters older than the weights a
            # healing load (start_quorum, just before) wrote: the peers would average
            # this replica's pre-heal model.
            opt.adopt_outside_writes()
        return chosen

    def _step_post_hook(self, _optim: optim.Optimizer, _args: tuple[Any, ...],
                        _kwargs: dict[str, Any]) -> None:
        # The span's name only ("sync N", or "prepare N" when the sync's decision
        # comes fragment_sync_delay steps later) is read ahead from torchft's
        # schedule; what was synced is what torchft chose (_current_fragment).
        nxt = self._local_step + 1
        syncing = nxt == self._sync_every
        preparing = nxt == self._sync_every - self._fragment_sync_delay
        step = _step_number(_optim, self._manager) if syncing or preparing else 0
        if syncing or preparing:
            self._refuse_after_a_late_failure()
        self._chosen = None
        start = time.perf_counter_ns()
        try:
            with (train_span("sync" if syncing else "prepare", step)
                  if syncing or preparing else contextlib.nullcontext()):
                super()._step_post_hook(_optim, _args, _kwargs)
        except BaseException:
            chosen = self._chosen
            opt = self._local_optimizer
            if chosen is not None and isinstance(opt, MasterCopy):
                # Hazard: a sync that raised after restoring the fragment's
                # parameters (through .data, which no version counter sees), its
                # masters then copied back over them at the next step. Adopts only
                # weights that differ from their master's cast.
                opt.refresh_masters(list(self._fragments[chosen]._model_fragment.parameters()))
            raise
        # torchft resets its counter after, and only after, a fragment sync.
        chosen = self._chosen
        fragment = self._fragments[chosen] if self._local_step == 0 and chosen is not None \
            else None
        if chosen is not None and self._watches_outer_state():
            # (A load_state_dict() replaced one: after a sync, and after a preparation,
            # whose speculative step must see the loop's accesses until the decision.)
            self._wrap_outer_states()
        if fragment is not None:
            offloaded = isinstance(fragment, OffloadedFragment)
            exposed = time.perf_counter_ns() - start
            if self._tail is not None and self._tail.in_flight:
                # Its figures once its tail is done (the next forward's waits count).
                self._exposed[chosen] = (step, exposed)  # type: ignore[index]
            else:
                self._stats.done(self._last_trace if offloaded else None, step=step,
                                 exposed_ns=exposed,
                                 committed=fragment.last_committed if offloaded else None)
        opt = self._local_optimizer
        if fragment is not None and isinstance(opt, MasterCopy) \
                and not getattr(fragment, "on_masters", False):
            # Hazard: an optimizer whose masters are the truth
            # (pipeoff.optim.FullOffloadOptimizer) overwriting the synchronized
            # parameters with its own masters at the next step. A sync writes
            # the parameters whether it commits (the merge) or not (the restore):
            # the parameters of the fragment torchft synced, whose masters alone
            # it touched.
            opt.refresh_masters(list(fragment._model_fragment.parameters()))
        # Last: a hook that raises must not leave the masters unrefreshed.
        self._stats.emit()


# -- tensor helpers -------------------------------------------------------------------
def _device_of(fragments: Sequence[_StreamingDiLoCoFragment]) -> torch.device:
    """The device of the fragments' parameters (their local shards)."""
    for f in fragments:
        for p in f._model_fragment.parameters():
            return local_tensor(p, data=True).device  # type: ignore[no-any-return]
    return torch.device("cpu")


def _step_number(opt: Any, manager: Any) -> int:
    """The step a sync follows: a pipeoff optimizer's own count (the step just taken),
    else torchft's step."""
    n = steps_taken(opt)
    return n - 1 if n else int(manager.current_step())
