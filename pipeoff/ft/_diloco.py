"""torchft's (streaming) DiLoCo with the outer state and the pseudo-gradients in host memory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn, optim
from torchft.local_sgd import DiLoCo as _TorchftDiLoCo
from torchft.local_sgd import _StreamingDiLoCoFragment

from pipeoff import _accel, _faults
from pipeoff._compat import local_tensor
from pipeoff._contract import AsyncStep, MasterCopy, steps_taken
from pipeoff._errors import ConfigError, PipeoffError
from pipeoff._lowlevel import SyncStats, train_span
from pipeoff.executor import execute
from pipeoff.ft._buckets import TensorInfo, plan_buckets
from pipeoff.ft._diloco_graph import DiLoCoWork, diloco_graph, diloco_schedule
from pipeoff.ft._diloco_work import SyncWork
from pipeoff.ft._options import StagingOptions, check_flag
from pipeoff.ft._outer import HostOuterOptimizer, check_outer
from pipeoff.optim._plan import whole_chunks
from pipeoff.staging import reserve_for
from pipeoff.trace import StepStats

if TYPE_CHECKING:
    from torchft.manager import Manager

    from pipeoff.execution import Execution
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
        ConfigError: an option is given without ``offload_to_cpu=True`` or is out
            of range; with ``offload_to_cpu=True``: ``should_quantize=True``
            (torchft's quantized all-reduce runs on the device), a
            ``backup_device`` other than the CPU, an outer optimizer that is not
            SGD/Adam/AdamW, or one with a parameter in no fragment.
        ValueError: torchft's own checks (``sync_every``, ``fragment_sync_delay``,
            ``fragment_update_alpha``, an async quorum).
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
        self.last_trace: Trace | None = None
        """The trace of the last offloaded fragment sync (``None`` without offload)."""
        self._stats = SyncStats()
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
        ``committed`` with ``offload_to_cpu``). Without offload only its time: torchft's
        copies and collectives are not traced."""
        return self._stats.last

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
        if isinstance(frag, _OffloadedFragment):
            return frag.outer.state_dict()
        return frag._outer_optimizer.state_dict()  # type: ignore[no-any-return]

    # -- torchft's extension points -------------------------------------------------
    def _register_state_dict_fn(self) -> None:
        # torchft's constructor calls this once its fragments exist and hold the
        # backup: the place to make them offloaded before anything is registered.
        if self._offload:
            self._fragments = [
                _OffloadedFragment.adopt(f, outer, self._options, self._on_trace)
                for f, outer in zip(self._fragments, _host_outers(self._fragments))]
        super()._register_state_dict_fn()

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> bool:
        for f in self._fragments:
            if isinstance(f, _OffloadedFragment):
                # Hazard: lanes left waiting forever for the decision of a sync
                # that was prepared but will never be performed.
                f.abandon(exc_value if isinstance(exc_value, BaseException) else
                          PipeoffError("DiLoCo exited with a fragment sync in flight"))
        return bool(super().__exit__(exc_type, exc_value, traceback))

    def _on_trace(self, trace: Trace) -> None:
        self.last_trace = trace

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
        if fragment is not None:
            offloaded = isinstance(fragment, _OffloadedFragment)
            self._stats.done(self.last_trace if offloaded else None, step=step,
                             exposed_ns=time.perf_counter_ns() - start,
                             committed=fragment.last_committed if offloaded else None)
        opt = self._local_optimizer
        if fragment is not None and isinstance(opt, MasterCopy):
            # Hazard: an optimizer whose masters are the truth
            # (pipeoff.optim.FullOffloadOptimizer) overwriting the synchronized
            # parameters with its own masters at the next step. A sync writes
            # the parameters whether it commits (the merge) or not (the restore):
            # the parameters of the fragment torchft synced, whose masters alone
            # it touched.
            opt.refresh_masters(list(fragment._model_fragment.parameters()))
        # Last: a hook that raises must not leave the masters unrefreshed.
        self._stats.emit()


def _host_outers(fragments: Sequence[_StreamingDiLoCoFragment]) -> list[HostOuterOptimizer]:
    """Per fragment, the host mirror of its outer optimizer, on that fragment's backups.

    One outer optimizer per fragment: each fragment's own backups (a parameter
    tied across fragments has a backup in each, and each fragment's sync steps
    its own, as torchft's does). One optimizer shared by the fragments: one
    mirror over all their backups.

    Raises:
        ConfigError: a shared outer optimizer over a parameter that two fragments
            hold (torchft would step it with two backups), or an outer parameter in
            no fragment.
    """
    by_opt: dict[int, list[_StreamingDiLoCoFragment]] = {}
    for f in fragments:
        by_opt.setdefault(id(f._outer_optimizer), []).append(f)
    mirrors: dict[int, HostOuterOptimizer] = {}
    for key, frags in by_opt.items():
        host_of: dict[int, torch.Tensor] = {}
        for f in frags:
            for name, p in f._model_fragment.named_parameters():
                if id(p) in host_of and len(frags) > 1:
                    raise ConfigError(
                        f"parameter {name!r} is in two model fragments that share one outer "
                        "optimizer; with offload_to_cpu=True give each fragment its own outer "
                        "optimizer")
                host_of[id(p)] = f.original_parameters[name]
        name = ("outer_optimizer" if len(by_opt) == 1 else
                f"outer_optimizer[{fragments.index(frags[0])}]")
        mirrors[key] = HostOuterOptimizer(frags[0]._outer_optimizer, host_of, name)
    return [mirrors[id(f._outer_optimizer)] for f in fragments]


class _OffloadedFragment(_StreamingDiLoCoFragment):  # type: ignore[misc]
    """A torchft fragment whose sync is a pipeoff execution (see :class:`DiLoCo`)."""

    outer: HostOuterOptimizer
    _ex: Execution | None
    _abandoned: PipeoffError | None
    last_committed: bool = False
    """Whether the last sync committed."""

    @classmethod
    def adopt(cls, frag: _StreamingDiLoCoFragment, outer: HostOuterOptimizer,
              options: StagingOptions, on_trace: Callable[[Trace], None]) -> _OffloadedFragment:
        """This class over ``frag``'s own fields (its backup, hooks and settings),
        with the offloaded sync's: the bucket plan, host pseudo-gradients, and the
        host outer optimizer; and its staging reserved."""
        self = cls.__new__(cls)
        self.__dict__.update(frag.__dict__)
        self.outer = outer
        self._options = options
        self._on_trace = on_trace
        self._ex = None
        self._abandoned = None
        named = list(self._model_fragment.named_parameters())
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        locals_ = [local_tensor(p, data=True) for p in self._params]
        self._device = locals_[0].device if locals_ else torch.device("cpu")
        self._cuda = _accel.current().is_device(self._device)
        self._backups = [self.original_parameters[name] for name in self._names]
        # The averaged pseudo-gradients, staged in host memory until the commit
        # (pinned, so that the device-to-host copies are asynchronous).
        self._host_grads = [_accel.current().host_empty(b.shape, b.dtype, pinned=self._cuda)
                            for b in self._backups]
        infos = [TensorInfo(name=name, numel=t.numel(), dtype=t.dtype,
                            contiguous=t.is_contiguous()) for name, t in zip(self._names, locals_)]
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
        self._chunks = whole_chunks([t.numel() * t.element_size() for t in locals_],
                                    options.bucket_bytes)
        # Take the staging a sync holds now, not inside it (pinned allocation
        # stalls the device and, under NCCL, can deadlock against peers).
        self._form_first = (options.schedule == "pipelined"
                            and int(self._fragment_sync_delay) > 0)
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
            for name, param in state_dict["original_parameters"].items():
                if name in self.original_parameters:
                    self.original_parameters[name].copy_(param)
            self.outer.load_state_dict(state_dict["outer_optimizer"])

        def save_fn() -> dict[str, Any]:
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
        self._failed: BaseException | None = None
        self._ex = execute(diloco_graph(self._buckets, self._chunks, self._device,
                                        self._work(), form_first=self._form_first),
                           self._schedule())
        if self._options.schedule == "synchronous":
            self._settle("staged")
        elif self._form_first and not _faults.disabled("diloco_formed_wait"):
            # Hazard: the pseudo-gradients formed from parameters that the caller
            # writes once step() returns (a clamp, a load_state_dict, an inner
            # optimizer writing weights during the next backward): they are read
            # before step() returns (on CUDA the caller's stream waits; every later
            # write on it, and the inner optimizer's copies that follow the next
            # backward's gradients, come after).
            self.wait_formed()

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

    def wait_formed(self) -> None:
        """Before an inner step: wait until no task of the sync in flight reads the
        parameters (on CUDA, the caller's stream waits; the host does not)."""
        ex = self._ex
        if ex is None or self._failed is not None:
            return
        names = [f"pseudograd:b{k}" for k in range(len(self._buckets))]
        for c in ex.events_for(names):
            c.wait()
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
        if ex is None and self._abandoned is not None:
            # The sync was abandoned (DiLoCo's context exited with it in flight) and
            # the loop went on: this replica rejects it, as torchft's failure path
            # does, and the next round starts clean.
            err, self._abandoned = self._abandoned, None
            manager.report_error(err)
            manager.should_commit()
            self.restore_parameters()
            return False
        if ex is None:
            raise RuntimeError("perform_sync() without prepare_sync()")
        opened = False
        try:
            if self._failed is None:
                self._settle("staged")
            if self._failed is not None:
                # torchft's error path: after report_error this replica group's
                # should_commit() is False. It is still called once, as in every
                # sync: the replica group's other ranks wait on it.
                manager.report_error(self._failed)
                manager.should_commit()
                self.restore_parameters()  # torchft's own, synchronous
                return False
            try:
                # Read on this thread before any outer task runs (they wait for the
                # gate): a learning-rate schedule edits the user's groups, a
                # checkpoint loads the user's optimizer.
                self.outer.sync_from_user()
            except Exception as err:
                # Found before the decision: this replica rejects, as after any
                # failure of its own, and the caller sees why.
                stop = PipeoffError(f"the sync was rejected before its decision: {err}")
                ex.gate("commit").fail(stop)
                opened = True
                self._stop(stop)
                manager.report_error(err)
                manager.should_commit()
                self.restore_parameters()
                raise
            committed = bool(manager.should_commit())
            self.last_committed = committed
            ex.gate("commit").open(committed)
            opened = True
            try:
                ex.wait()
                self.outer.alias()  # state the step created, shown in the user's optimizer
            except Exception as err:
                # A host step or a write failed after the decision: the parameters
                # (and, after a commit, the backup and outer state) are partly
                # written. Tell torchft, so that this replica group's next
                # should_commit() is False, and raise.
                manager.report_error(err)
                err.add_note(
                    "pipeoff: DiLoCo's sync failed after the quorum "
                    + ("committed; the backup, the outer state and the parameters are partly "
                       "updated." if committed else "rejected; the parameters are partly restored.")
                    + " Restart this replica so that torchft heals it from a peer.")
                raise
            return committed
        except BaseException as err:
            if not opened and ex.gate("commit").state == "pending":
                # Ctrl-C (or a failing should_commit) before the decision: stop the
                # lanes that wait for it, so that nothing of this sync runs on.
                ex.gate("commit").fail(err)
            raise
        finally:
            self._ex = None
            self._outer_optimizer.zero_grad()  # as torchft: the parameters' .grad is None after
            if ex.done():
                self._on_trace(ex.trace)

    def abandon(self, why: BaseException) -> None:
        """Stop the sync in flight, if any, without a decision: its all-reduces still
        run (peers wait for them), nothing is written, and no outer step runs."""
        ex = self._ex
        if ex is None:
            return
        self._ex = None
        self._abandoned = PipeoffError(
            "this DiLoCo fragment sync was abandoned: the DiLoCo context exited while it "
            f"was in flight ({type(why).__name__}: {why})")
        if ex.gate("commit").state == "pending":
            ex.gate("commit").fail(why)
        try:
            ex.wait()
        except BaseException:  # noqa: BLE001 - the failure given, or one before it
            pass

    def _work(self) -> DiLoCoWork:
        """The lane work of one sync, over this fragment's tensors."""
        return SyncWork(
            params=self._params, backups=self._backups, grads=self._host_grads,
            outer=self.outer, manager=self._manager, device=self._device, cuda=self._cuda,
            alpha=self._fragment_update_alpha,
            synchronous=self._options.schedule == "synchronous",
            form_first=self._form_first).work()


# -- tensor helpers -------------------------------------------------------------------
def _step_number(opt: Any, manager: Any) -> int:
    """The step a sync follows: a pipeoff optimizer's own count (the step just taken),
    else torchft's step."""
    n = steps_taken(opt)
    return n - 1 if n else int(manager.current_step())
