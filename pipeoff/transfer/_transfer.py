"""``StateTransfer``: live, bounded, preflighted movement of tensors across ranks."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pipeoff import _lowlevel
from pipeoff._errors import ConfigError, TransferRefusedError, TransferTornError
from pipeoff._validate import parse_bytes
from pipeoff.execution import Execution
from pipeoff.executor import execute
from pipeoff.graph import TaskContext
from pipeoff.schedule import Schedule
from pipeoff.staging import reserve_for
from pipeoff.trace import Trace
from pipeoff.transfer._graph import transfer_graph
from pipeoff.transfer._group import GroupRef, deferred_interrupt, resolve_wire
from pipeoff.transfer._live import LiveTensor, alias_problems, readiness_problem
from pipeoff.transfer._plan import ALIGN, Piece, PlanRefusal, Run, TransferPlan, plan_transfer

__all__ = ["StateTransfer"]

_running_groups: set[int] = set()
"""The process groups (by ``id``) with a transfer running."""
_running_lock = threading.Lock()

_HOST = ("pinned", "pageable")


@dataclass(eq=False)
class _State:
    """What the tasks of one launched transfer share (on this rank)."""

    writers: dict[int, set[str]]
    """Per round, the tasks that write targets on this rank."""
    fault: tuple[str, BaseException] | None = None
    """The first failure of a task on this rank."""
    aborted: bool = False
    """A rank failed (an exchange's flag said so): write nothing more."""
    refused: bool = False
    started: dict[int, set[str]] = field(default_factory=dict)
    finished: dict[int, set[str]] = field(default_factory=dict)
    torn: TransferTornError | None = None
    group: Any = None
    """The launch's process group, until its last collective ran (the verdict): held
    no longer, so that ``destroy_process_group`` can destroy it (see [Note: holding
    process groups] in ``_group.py``)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, task: str, err: BaseException) -> None:
        with self.lock:
            if self.fault is None:
                self.fault = (task, err)


def _where(residency: str) -> str:
    return "host" if residency in _HOST else "device"


def _check_tensors(name: str, value: Any) -> dict[str, LiveTensor]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict of key -> LiveTensor, got "
                          f"{type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise ConfigError(f"{name}: keys must be non-empty strings, got {k!r}")
        if not isinstance(v, LiveTensor):
            raise ConfigError(f"{name}[{k!r}] must be a pipeoff.transfer.LiveTensor, got "
                              f"{type(v).__name__} (wrap a tensor with LiveTensor(t) or "
                              "LiveTensor.from_dtensor(dt))")
    return dict(value)


class StateTransfer:
    """Copy tensors held by some ranks into targets of any layout on others, in bounded
    rounds, after a collective preflight (DeepSpeed proposal #8899).

    Every rank builds one with its own ``sources`` and ``targets`` (keys name the
    logical tensors; a rank may have either, both or none) and calls :meth:`run`
    (or :meth:`launch`) collectively. Then:

    1. **Preflight.** Each rank describes its pieces (geometry, dtype, residency)
       and its problems; one ``all_gather_object`` shares them, and every rank
       plans the same rounds from the same data, or raises the same
       :class:`~pipeoff.TransferRefusedError` naming the rank, the key and the
       reason (coverage is checked by interval arithmetic: a gap or an overlap is
       found, not counted). The graph's ``preflight`` task then waits for every
       piece's readiness and combines, in one more collective, the readiness
       failures and the plan's signature: every rank proceeds, or every rank
       raises the same refusal. Nothing is written or staged before that.
    2. **Rounds**, a pipeoff graph under ``Schedule.pipelined`` with both budgets:
       pack (with the cast), exchange (a fault flag, then ``all_to_all_single``;
       the collectives chained in one order), unpack. Local runs are copied
       directly. Staging comes from pipeoff's pools (pinned host memory where
       there is an accelerator), reused across rounds and transfers: per rank and
       round at most ``budget // 2`` bytes of wire staging (send plus receive),
       so two rounds overlap within the budget. The wire is host memory for gloo
       (then no device staging at all) and device memory for NCCL.
    3. **Faults after the preflight** (a failed copy, an out-of-memory) do not
       hang the peers: the failing rank stops writing, keeps joining the
       exchanges with its fault flag set, and every rank raises the same
       :class:`~pipeoff.TransferTornError` listing the rounds each rank wrote.
       There is no rollback: to keep targets whole, transfer into scratch
       tensors and swap them in on success. A crashed process surfaces as the
       process group's timeout on the others.

    Memory: staging stays within ``host_budget_bytes`` and
    ``device_budget_bytes`` whatever the model size; nothing is gathered whole.

    While a launched transfer runs, do not issue other collectives on its process
    group from another thread (they would interleave with its own); give it a
    group of its own (``dist.new_group``) to overlap it with training.

    Args:
        sources: key -> :class:`LiveTensor` this rank holds.
        targets: key -> :class:`LiveTensor` this rank wants written.
        process_group: the group of the ranks taking part; ``None``: the default
            group if ``torch.distributed`` is initialized, else this process alone.
            The transfer never keeps a group alive (a given one is held by weak
            reference, the default one looked up at each launch), so that
            ``destroy_process_group()`` destroys it; launching afterwards raises
            ``ConfigError``.
        host_budget_bytes: most bytes of host staging live at once (default 64 MiB; an
            int or a size string such as ``"256MiB"``).
        device_budget_bytes: most bytes of device staging live at once (the same).
        cast: ``{pattern: dtype}``: targets of keys matching ``pattern``
            (``fnmatch``, or the key's exact name; the first match wins) may have
            that dtype, converted from the source's when packing (round to nearest
            even, as ``copy_``).
        wire: ``"host"`` or ``"device"``, the memory that crosses ranks;
            ``"auto"``: device for NCCL, else host.
        schedule: ``"pipelined"`` (the default) or ``"synchronous"`` (the
            degenerate schedule: one task at a time, on the calling thread).

    Raises:
        ConfigError: an argument of the wrong type or out of range (locally, at
            construction; problems of the data are the preflight's).
    """

    def __init__(self, sources: Mapping[str, LiveTensor], targets: Mapping[str, LiveTensor], *,
                 process_group: Any = None, host_budget_bytes: int | str = 64 << 20,
                 device_budget_bytes: int | str = 64 << 20,
                 cast: Mapping[str, torch.dtype] | None = None,
                 wire: Literal["auto", "host", "device"] = "auto",
                 schedule: Literal["pipelined", "synchronous"] = "pipelined") -> None:
        self.sources = _check_tensors("sources", sources)
        self.targets = _check_tensors("targets", targets)
        for key, lt in self.targets.items():
            if lt.optimizer is not None:
                raise ConfigError(
                    f"targets[{key!r}] is an optimizer's state (LiveTensor.from_optimizer): "
                    "the optimizer would not know its state changed. Transfer into plain "
                    "tensors and load them with opt.load_state_dict(...)")
        self.host_budget_bytes = parse_bytes(host_budget_bytes, name="host_budget_bytes")
        self.device_budget_bytes = parse_bytes(device_budget_bytes, name="device_budget_bytes")
        if cast is None:
            cast = {}
        if not isinstance(cast, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.dtype) for k, v in cast.items()):
            raise ConfigError(f"cast must be a dict of pattern (str) -> torch.dtype, got {cast!r}")
        self.cast = dict(cast)
        if wire not in ("auto", "host", "device"):
            raise ConfigError(f"wire must be 'auto', 'host' or 'device', got {wire!r}")
        if schedule not in ("pipelined", "synchronous"):
            raise ConfigError(f"schedule must be 'pipelined' or 'synchronous', got {schedule!r}")
        self.schedule = schedule
        # Never the group itself: see [Note: holding process groups] in _group.py.
        self._group = GroupRef(process_group)
        self.wire = resolve_wire(wire, self.group)
        self.last_plan: TransferPlan | None = None
        """The plan of the latest launch (identical on every rank)."""
        self.last_execution: Execution | None = None

    # -- the collective helpers ------------------------------------------------------
    @property
    def group(self) -> Any:
        """The process group (``None``: this process alone), looked up at each use.

        Raises:
            ConfigError: the group was destroyed since this transfer was built.
        """
        return self._group.get()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else int(torch.distributed.get_rank(self.group))

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else int(torch.distributed.get_world_size(self.group))

    @staticmethod
    def _global(r: int, group: Any) -> int:
        """The global rank of ``group``'s rank ``r`` (errors name global ranks)."""
        if group is None:
            return r
        return int(torch.distributed.get_global_rank(group, r))

    @staticmethod
    def _gather(obj: Any, group: Any) -> list[Any]:
        if group is None:
            return [obj]
        out: list[Any] = [None] * int(torch.distributed.get_world_size(group))
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    @property
    def _device(self) -> torch.device:
        for lt in (*self.sources.values(), *self.targets.values()):
            t = lt.tensor
            if t is not None and t.device.type not in ("cpu", "meta"):
                return t.device
        from pipeoff import _accel

        accel = _accel.current()
        if self.wire == "device" and accel.available():
            # cuda:<current>, or the simulated device's "cpu"
            return accel.normalize(torch.device(accel.device_type))
        return torch.device("cpu")

    # -- the preflight ---------------------------------------------------------------
    def _describe(self) -> dict[str, Any]:
        """This rank's pieces and problems, for the first collective."""
        import pipeoff

        problems: list[tuple[str, str]] = []
        src: list[Piece] = []
        dst: list[Piece] = []
        for out, pieces in ((src, self.sources), (dst, self.targets)):
            for key, lt in pieces.items():
                why = lt.problem()
                if why is not None:
                    problems.append((key, why))
                assert lt.global_shape is not None and lt.box is not None and lt.dtype
                out.append(Piece(key=key, global_shape=lt.global_shape, offsets=lt.box[0],
                                 sizes=lt.box[1], dtype=lt.dtype, replica=lt.replica))
        for key, lt in self.targets.items():
            why = lt.target_problem()
            if why is not None and lt.problem() is None:
                problems.append((key, why))
        problems += alias_problems(self.sources, self.targets)
        budget = self.host_budget_bytes if self.wire == "host" else self.device_budget_bytes
        # Half the budget per round: two rounds' staging fits, so they overlap.
        capacity = budget // 2 if budget // 2 >= ALIGN else budget
        return {"version": pipeoff.__version__, "wire": self.wire, "capacity": capacity,
                "local_capacity": budget,
                "casts": tuple(self.cast.items()), "src": src, "dst": dst,
                "problems": problems}

    def _plan(self) -> TransferPlan:
        try:
            mine = self._describe()
        except Exception as err:  # noqa: BLE001 - told to every rank, not raised alone
            import pipeoff

            # Raising here alone would leave the peers waiting in the collective.
            mine = {"version": pipeoff.__version__, "wire": self.wire, "capacity": ALIGN,
                    "local_capacity": ALIGN, "casts": (), "src": [], "dst": [],
                    "problems": [("*", f"describing its pieces raised "
                                       f"{type(err).__name__}: {err}")]}
        # (self.group, never a local: the refusal's traceback keeps this frame.)
        everyone = self._gather(mine, self.group)
        problems = [(r, k, why) for r, d in enumerate(everyone) for k, why in d["problems"]]
        for r, d in enumerate(everyone):
            for name in ("version", "wire"):
                if d[name] != everyone[0][name]:
                    problems.append((r, "*", f"{name} {d[name]!r} differs from rank 0's "
                                              f"{everyone[0][name]!r}"))
        if not problems:
            try:
                return plan_transfer([d["src"] for d in everyone], [d["dst"] for d in everyone],
                                     capacity=[d["capacity"] for d in everyone],
                                     casts=[d["casts"] for d in everyone],
                                     local_capacity=[d["local_capacity"] for d in everyone])
            except PlanRefusal as err:
                problems = err.problems
            except Exception as err:  # noqa: BLE001 - the same on every rank: refused
                problems = [(0, "*", f"planning raised {type(err).__name__}: {err}")]
        raise TransferRefusedError(tuple(sorted(((self._global(r, self.group), k, why)
                                                 for r, k, why in problems),
                                                key=lambda p: p[0])))

    def _preflight(self, plan: TransferPlan, state: _State) -> Any:
        def work(ctx: TaskContext) -> None:
            problems: list[tuple[str, str]] = []
            interrupted: KeyboardInterrupt | None = None
            try:
                for pieces in (self.sources, self.targets):
                    for key, lt in pieces.items():
                        why = readiness_problem(lt.ready) or lt.problem()
                        if why is not None:
                            problems.append((key, why))
                sig = plan.signature()
            except KeyboardInterrupt as err:  # the peers refuse; this rank raises it, below
                problems.append(("*", "interrupted (KeyboardInterrupt) in the preflight"))
                interrupted, sig = err, ""
            except BaseException as err:  # noqa: BLE001 - told to every rank, then raised
                problems.append(("*", f"the preflight raised {type(err).__name__}: {err}"))
                sig = ""
            # (state.group, never a local: a traceback keeps its frames' locals, and
            # a refusal is kept by the execution.)
            try:
                everyone = self._gather((problems, sig), state.group)
            except BaseException:
                state.refused = True  # no more collectives on a group that failed one
                raise
            found = [(r, k, why) for r, (ps, _) in enumerate(everyone) for k, why in ps]
            for r, (_, s) in enumerate(everyone):
                if s != everyone[0][1] and s:
                    found.append((r, "*", f"plan signature {s} differs from rank 0's "
                                          f"{everyone[0][1]}"))
            if found:
                state.refused = True
                refusal = TransferRefusedError(tuple((self._global(r, state.group), k, why)
                                                     for r, k, why in found))
                if interrupted is not None:
                    interrupted.add_note(f"pipeoff: {refusal}")
                    raise interrupted
                raise refusal
        return work

    # -- the rounds ------------------------------------------------------------------
    def _copy(self, state: _State, plan: TransferPlan) -> Any:
        rank = self.rank
        world = self.world_size

        def make(phase: str, r: int, runs: Sequence[Run], buffer: str | None) -> Any:
            seg = plan.segments[r]
            if phase == "pack":
                base = [sum(seg[rank][:d]) for d in range(world)]
            else:
                base = [sum(seg[s][rank] for s in range(p)) for p, _ in enumerate(seg)]
            writes = phase != "pack"

            def work(ctx: TaskContext) -> None:
                name = ctx.task.name
                if state.aborted or state.fault is not None:
                    return  # a rank failed: write nothing more
                if writes:
                    with state.lock:
                        state.started.setdefault(r, set()).add(name)
                try:
                    wire = ctx.buffer(buffer) if buffer is not None else None
                    # Lanes have their own grad mode: a parameter as a source or target
                    # must not record autograd history (or refuse an in-place write).
                    with torch.no_grad():
                        self._copy_runs(phase, runs, wire, base)
                except BaseException as err:
                    state.record(name, err)
                    raise
                if writes:
                    with state.lock:
                        state.finished.setdefault(r, set()).add(name)
            return work
        return make

    def _copy_runs(self, phase: str, runs: Sequence[Run], wire: torch.Tensor | None,
                   base: list[int]) -> None:
        packed: dict[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
        for u in runs:
            if phase == "copy":
                dst = self.targets[u.key].region(u.lo, u.size)
                src = self.sources[u.key].region(u.lo, u.size)
            else:
                peer = u.dst if phase == "pack" else u.src
                assert wire is not None
                at = base[peer] + u.offset
                view = wire[at:at + u.nbytes].view(u.dtype).view(u.size)
                if phase == "pack":
                    # The same region for several ranks (replicated targets) crosses
                    # from its source once; the other copies are made on the wire's
                    # side (in order on this task's stream).
                    dst = view
                    src = packed.setdefault((u.key, u.lo, u.size, u.dtype), view)
                    if src is view:
                        src = self.sources[u.key].region(u.lo, u.size)
                else:
                    dst, src = self.targets[u.key].region(u.lo, u.size), view
            # Asynchronous when one side is pinned host memory: the lane's
            # stream orders it before the tasks that follow (an exchange
            # synchronizes its start; Execution.wait() synchronizes all).
            dst.copy_(src, non_blocking=True)

    def _exchange(self, state: _State, plan: TransferPlan) -> Any:
        import torch.distributed as dist

        rank, world = self.rank, self.world_size
        dev = self._device if self.wire == "device" else torch.device("cpu")

        def make(r: int) -> Any:
            seg = plan.segments[r]
            out_splits = [seg[rank][d] for d in range(world)]
            in_splits = [seg[s][rank] for s in range(world)]

            def work(ctx: TaskContext) -> None:
                if state.refused:
                    return  # every rank refused at the preflight: no rank joins
                bad = state.fault is not None or ctx.failed is not None or state.aborted
                late: BaseException | None = None
                try:
                    # Everything the all-to-all needs, before the flag: a failure here
                    # (a Ctrl-C landing on this thread) is this rank's flag.
                    flag = torch.tensor([int(bad)], dtype=torch.int32, device=dev)
                    if not bad:
                        empty = torch.empty(0, dtype=torch.uint8, device=dev)
                        send = (ctx.buffer(f"send{r}")[:sum(out_splits)] if any(out_splits)
                                else empty)
                        recv = (ctx.buffer(f"recv{r}")[:sum(in_splits)] if any(in_splits)
                                else empty)
                except BaseException as err:  # noqa: BLE001 - raised once the peers know
                    state.record(ctx.task.name, err)
                    late = err
                    flag = torch.ones(1, dtype=torch.int32, device=dev)
                # Hazard: a peer left waiting in this round's collectives until the
                # group's timeout, by a Ctrl-C between them on this rank (it comes after).
                with deferred_interrupt():
                    # Every rank joins, a failed one too, so that no peer waits in vain.
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=state.group)
                    # A host read of the flag (on a device wire, it synchronizes the
                    # comm stream): every rank takes the same branch before the all-to-all.
                    if int(flag.item()):
                        state.aborted = True
                    else:
                        try:
                            dist.all_to_all_single(recv, send, in_splits, out_splits,
                                                   group=state.group)
                        except BaseException as err:
                            state.record(ctx.task.name, err)
                            raise
                if late is not None:
                    raise late
            return work
        return make

    def _verdict(self, state: _State, plan: TransferPlan) -> Any:
        rank, world = self.rank, self.world_size

        def work(ctx: TaskContext) -> None:
            try:
                judge(ctx)
            finally:
                # The launch's last collective has run (every other task comes before
                # this one): let go of the group, so that the execution, kept as
                # last_execution, does not keep it alive.
                state.group = None

        def judge(ctx: TaskContext) -> None:
            # (state.group, never a local: the torn error's traceback keeps this frame.)
            if state.refused:
                return
            fault = state.fault
            if fault is None and ctx.failed is not None:
                fault = (ctx.failed_task or "?", ctx.failed)
            written = sorted(r for r, names in state.writers.items()
                             if names and state.finished.get(r, set()) >= names)
            partial = sorted(r for r in state.started if r not in written)
            mine = (None if fault is None else f"{fault[0]}: {type(fault[1]).__name__}: "
                    f"{fault[1]}", tuple(written), tuple(partial))
            note = ""
            try:
                everyone = self._gather(mine, state.group)
            except BaseException as err:  # noqa: BLE001 - reported in the torn error
                everyone = [(None, (), ())] * world
                everyone[rank] = mine
                note = (f"the ranks could not compare what they wrote ({type(err).__name__}: "
                        f"{err}); other ranks' rounds are unknown")
            faults = {r: f for r, (f, _, _) in enumerate(everyone) if f}
            if not faults and not note:
                return
            done = {r: w for r, (_, w, _) in enumerate(everyone)}
            part = {r: p for r, (_, _, p) in enumerate(everyone) if p}
            keys = sorted({u.key for r in range(len(everyone))
                           for k in (*done.get(r, ()), *part.get(r, ()))
                           for u in plan.rounds[k] if u.dst == r})
            g = {r: self._global(r, state.group) for r in range(len(everyone))}
            state.torn = TransferTornError({g[r]: w for r, w in done.items()},
                                           {g[r]: p for r, p in part.items()},
                                           {g[r]: f for r, f in faults.items()}, tuple(keys),
                                           note)
            raise state.torn
        return work

    # -- running ---------------------------------------------------------------------
    def launch(self) -> Execution:
        """Start the transfer (collectively); returns its :class:`~pipeoff.Execution`.

        The first preflight collective (pieces and plan) runs here; the rest runs on
        pipeoff's lanes. ``wait()`` on the execution raises what :meth:`run` raises.

        Raises:
            TransferRefusedError: the pieces cannot be transferred (on every rank).
            ConfigError: a transfer on the same process group is still running
                (raised locally, before any collective).
        """
        if self.group is None:
            return self._launch()  # no collectives: transfers of one process never clash
        key = id(self.group)
        with _running_lock:
            if key in _running_groups:
                # Checked before any collective: a second one on the group would
                # interleave with the running transfer's own.
                raise ConfigError(
                    "a state transfer on this process group is still running; wait for its "
                    "Execution first (or give concurrent transfers groups of their own)")
            _running_groups.add(key)
        try:
            ex = self._launch()
        except BaseException:
            with _running_lock:
                _running_groups.discard(key)
            raise
        _lowlevel.on_complete(ex, lambda: _running_groups.discard(key))
        return ex

    def reserve(self) -> dict[str, int]:
        """Allocate, collectively and ahead of time, the staging blocks a launch of this
        transfer will use, so that running it allocates nothing (pinned allocation
        stalls the device, and under NCCL can deadlock against peers in a collective).
        Later transfers with the same plan reuse them.

        Returns:
            Bytes reserved, by ``"device"`` and ``"host"``.

        Raises:
            TransferRefusedError: the pieces cannot be transferred (on every rank).
        """
        plan = self._plan()
        graph = transfer_graph(plan, self.rank, src_where=self._memory_of(self.sources),
                               dst_where=self._memory_of(self.targets), wire=self.wire,
                               device=self._device)
        return reserve_for(graph, self._schedule())

    @staticmethod
    def _memory_of(pieces: Mapping[str, LiveTensor]) -> dict[str, str]:
        return {k: _where(lt.resolved_residency()) for k, lt in pieces.items()}

    def _schedule(self) -> Schedule:
        if self.schedule == "synchronous":
            return Schedule.synchronous()
        return Schedule.pipelined(device_budget_bytes=self.device_budget_bytes,
                                  host_budget_bytes=self.host_budget_bytes)

    def _launch(self) -> Execution:
        plan = self._plan()
        self.last_plan = plan
        rank = self.rank
        src_where = self._memory_of(self.sources)
        dst_where = self._memory_of(self.targets)
        state = _State(writers={}, group=self.group)
        graph = transfer_graph(
            plan, rank, src_where=src_where, dst_where=dst_where, wire=self.wire,
            device=self._device, preflight=self._preflight(plan, state),
            exchange=self._exchange(state, plan), verdict=self._verdict(state, plan),
            copy=self._copy(state, plan))
        for name in graph.tasks:
            m = re.match(r"(?:unpack|copy)(\d+):", name)
            if m:
                state.writers.setdefault(int(m.group(1)), set()).add(name)
        ex = execute(graph, self._schedule(), backend="auto")
        for opt in {id(lt.optimizer): lt.optimizer for lt in self.sources.values()
                    if lt.optimizer is not None}.values():
            opt.add_reader(ex)  # its next step waits for this transfer

        def translate(err: BaseException) -> BaseException:
            # A rank's own failure is reported as the torn transfer it caused (the
            # same error on every rank), with the failure as its cause; but Ctrl-C
            # (in a task on the caller's thread) reaches its caller as itself.
            if isinstance(err, KeyboardInterrupt) and state.torn is not None:
                err.add_note(f"pipeoff: {state.torn}")
                return err
            return state.torn if state.torn is not None else err

        _lowlevel.translate_failures(ex, translate)
        # The verdict lets go of the group; this, should the verdict not run at all.
        _lowlevel.on_complete(ex, lambda: setattr(state, "group", None))
        self.last_execution = ex
        return ex

    def run(self) -> None:
        """Run the transfer (collectively) and wait for it.

        Raises:
            TransferRefusedError: the preflight refused: nothing was written.
            TransferTornError: a rank failed after the preflight; targets are
                partly written (every rank raises it, with the same content).
        """
        self.launch().wait()

    @property
    def last_trace(self) -> Trace | None:
        """The trace of the latest launch (waits for it)."""
        ex = self.last_execution
        return None if ex is None else ex.trace
