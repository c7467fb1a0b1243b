"""The body of the two-process state-transfer tests: every case, in each of two gloo ranks.

Each case returns plain data (booleans, error types and messages) that the test
compares across ranks; one spawn runs them all (a process start costs seconds).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

SHAPES = [(3, 1000), (5, 7), (1,), (0, 4), (4, 3, 2)]
SENTINEL = -7.0


def _full(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _shard0(full: torch.Tensor, rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """torch's chunking of dim 0 (uneven shards are smaller at the end)."""
    n = full.shape[0]
    c = -(-n // world)
    lo = min(rank * c, n)
    hi = min(lo + c, n)
    return (lo,) + (0,) * (full.dim() - 1), (hi - lo,) + tuple(full.shape[1:])


def _padded_source(full: torch.Tensor, rank: int, world: int) -> Any:
    """This rank's Shard(0) piece in storage padded to the largest shard, padding NaN."""
    from pipeoff.transfer import LiveTensor

    off, size = _shard0(full, rank, world)
    c = -(-full.shape[0] // world)
    storage = torch.full((c,) + tuple(full.shape[1:]), float("nan")).to(full.dtype)
    storage[:size[0]] = full[off[0]:off[0] + size[0]]
    return LiveTensor(storage, box=(off, size), global_shape=tuple(full.shape))


def _padded_target(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """A replicated target in storage one larger per dimension, filled with the sentinel."""
    from pipeoff.transfer import LiveTensor

    storage = torch.full(tuple(s + 1 for s in shape), SENTINEL).to(dtype)
    return storage, LiveTensor(storage, box=((0,) * len(shape), shape), global_shape=shape)


def corner(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(0, s) for s in shape)]


def padding_kept(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    mask = torch.ones(t.shape, dtype=torch.bool)
    mask[tuple(slice(0, s) for s in shape)] = False
    return bool((t[mask].float() == SENTINEL).all())


def case_replicated(rank: int, world: int, src_dtype: torch.dtype, dst_dtype: torch.dtype,
                    cast: bool, budget: int) -> dict[str, Any]:
    from pipeoff.transfer import StateTransfer

    fulls = {f"t{k}": _full(s, src_dtype, seed=k) for k, s in enumerate(SHAPES)}
    src = {k: _padded_source(f, rank, world) for k, f in fulls.items()}
    tg = {k: _padded_target(tuple(f.shape), dst_dtype) for k, f in fulls.items()}
    t = StateTransfer(src, {k: lt for k, (_, lt) in tg.items()}, host_budget_bytes=budget,
                      device_budget_bytes=budget, cast={"*": dst_dtype} if cast else None)
    t.run()
    summary = t.last_trace.summary()  # type: ignore[union-attr]
    assert t.last_plan is not None
    return {
        "bitwise": {k: torch.equal(corner(tg[k][0], tuple(f.shape)), f.to(dst_dtype))
                    for k, f in fulls.items()},
        "padding": {k: padding_kept(tg[k][0], tuple(f.shape)) for k, f in fulls.items()},
        "rounds": len(t.last_plan.rounds),
        "peak": (summary.peak_host_staging_bytes, summary.peak_device_staging_bytes),
        "signature": t.last_plan.signature(),
    }


def case_reshard(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeoff import _compat
    from pipeoff.transfer import LiveTensor, StateTransfer

    out: dict[str, Any] = {}
    full = _full((5, 7), torch.float32, seed=3)
    d0 = distribute_tensor(full, mesh, [Shard(0)])
    # Shard(0) -> Shard(1), against DTensor's redistribute.
    ref = d0.redistribute(mesh, [Shard(1)])
    tgt = torch.full_like(ref.to_local(), SENTINEL)
    StateTransfer({"w": LiveTensor.from_dtensor(d0)},
                  {"w": LiveTensor(tgt, box=_compat.dtensor_box(ref), global_shape=(5, 7))},
                  host_budget_bytes=256).run()
    out["shard0_to_shard1"] = torch.equal(tgt, ref.to_local())
    # 2 ranks -> 1: the whole tensor on rank 0 only, against full_tensor().
    whole = d0.full_tensor()
    tgts = {"w": LiveTensor(torch.full((5, 7), SENTINEL))} if rank == 0 else {}
    StateTransfer({"w": LiveTensor.from_dtensor(d0)}, tgts, host_budget_bytes=256).run()
    out["two_to_one"] = rank != 0 or torch.equal(tgts["w"].tensor, whole)
    # 1 -> 2: rank 0 holds the whole tensor, both ranks get their Shard(0) piece.
    srcs = {"w": LiveTensor(full)} if rank == 0 else {}
    mine = torch.full_like(d0.to_local(), SENTINEL)
    StateTransfer(srcs, {"w": LiveTensor(mine, box=_compat.dtensor_box(d0),
                                         global_shape=(5, 7))},
                  host_budget_bytes=256).run()
    out["one_to_two"] = torch.equal(mine, d0.to_local())
    return out


def _refusal(rank: int, world: int, make: Callable[[int], tuple[dict[str, Any], dict[str, Any],
                                                               dict[str, Any]]]
             ) -> dict[str, Any]:
    from pipeoff.transfer import LiveTensor, StateTransfer, TransferRefusedError

    src, dst, kw = make(rank)
    kept = [lt.tensor for lt in dst.values() if isinstance(lt, LiveTensor)]
    try:
        StateTransfer(src, dst, **{"host_budget_bytes": 256, **kw}).run()
    except TransferRefusedError as err:
        return {"error": str(err), "problems": err.problems,
                "sentinel": all(bool((t.float() == SENTINEL).all()) for t in kept)}
    return {"error": None}


def case_refusals(rank: int, world: int) -> dict[str, Any]:
    from pipeoff import TaskGraph, TaskKind, execute
    from pipeoff.transfer import LiveTensor

    full = _full((5, 7), torch.float32)

    def target(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        return {"w": LiveTensor(torch.full((5, 7), SENTINEL).to(dtype))}

    def unavailable(r: int) -> Any:
        src = _padded_source(full, r, world)
        if r == 1:
            src.tensor.untyped_storage().resize_(0)  # freed, as FSDP2 frees storage
        return {"w": src}, target(), {}

    def dtype_mismatch(r: int) -> Any:
        return {"w": _padded_source(full, r, world)}, target(torch.bfloat16), {}

    def gap_and_overlap(r: int) -> Any:
        # Rows 0-2 on rank 0, rows 2-3 on rank 1: row 2 twice, row 4 never; 3 + 2 = 5
        # rows, so a count of elements would pass.
        lo, n = (0, 3) if r == 0 else (2, 2)
        return ({"w": LiveTensor(full[lo:lo + n].clone(), box=((lo, 0), (n, 7)),
                                 global_shape=(5, 7))}, target(), {})

    def not_pinned(r: int) -> Any:
        src = _padded_source(full, r, world)
        if r == 0:
            src = LiveTensor(src.tensor, box=src.box, global_shape=src.global_shape,
                             residency="pinned")
        return {"w": src}, target(), {}

    def budget_too_small(r: int) -> Any:
        return {"w": _padded_source(full, r, world)}, target(), {"host_budget_bytes": 8}

    def extra_key(r: int) -> Any:
        dst = target()
        if r == 1:
            dst["extra"] = LiveTensor(torch.full((2,), SENTINEL))
        return {"w": _padded_source(full, r, world)}, dst, {}

    def failed_readiness(r: int) -> Any:
        src = _padded_source(full, r, world)
        if r == 1:
            g = TaskGraph()

            def boom(ctx: Any) -> None:
                raise RuntimeError("the step that writes this state failed")

            g.add_task("opt0", TaskKind.HOST, boom)
            ex = execute(g)
            src = LiveTensor(src.tensor, box=src.box, global_shape=src.global_shape,
                             ready=ex.events_for("opt0")[0])
        return {"w": src}, target(), {}

    cases = {f.__name__: f for f in (unavailable, dtype_mismatch, gap_and_overlap, not_pinned,
                                     budget_too_small, extra_key, failed_readiness)}
    return {name: _refusal(rank, world, make) for name, make in cases.items()}


def case_torn(rank: int, world: int, faulty: int = 1) -> dict[str, Any]:
    import pipeoff.testing as pt
    from pipeoff.transfer import StateTransfer, TransferTornError

    full = _full((6, 40), torch.float32)
    storage, dst = _padded_target((6, 40), torch.float32)
    t = StateTransfer({"w": _padded_source(full, rank, world)}, {"w": dst},
                      host_budget_bytes=256, device_budget_bytes=256)
    out: dict[str, Any] = {}
    start = time.monotonic()
    try:
        with pt.fail_work(r"unpack\d+:.*" if rank == faulty else "no such task", after_ops=0):
            t.run()
        out["error"] = None
    except TransferTornError as err:
        out.update(error=type(err).__name__, written=err.written, partial=err.partial,
                   faults=err.faults, keys=err.keys, message=str(err),
                   cause=type(err.__cause__).__name__)
    out["seconds"] = time.monotonic() - start
    t.run()  # the same transfer again succeeds: staging was released, no rank is stuck
    out["second"] = torch.equal(corner(storage, (6, 40)), full)
    return out


def case_torn_before_joining(rank: int, world: int, how: str,
                             schedule: str = "pipelined") -> dict[str, Any]:
    """Rank 1 fails where its exchange had not joined the round's collectives yet: an
    out-of-memory allocating a round's wire buffer ("staging"; the exchange was
    cancelled), or its work raising before the fault flag ("setup", at its first
    torch call or at its third). Its peer waited in the collective until the group's
    timeout (30 s), and the group was unusable after."""
    import pipeoff.staging as st
    import pipeoff.testing as pt
    from pipeoff.transfer import StateTransfer, TransferTornError

    full = _full((6, 40), torch.float32)
    storage, dst = _padded_target((6, 40), torch.float32)
    t = StateTransfer({"w": _padded_source(full, rank, world)}, {"w": dst},
                      host_budget_bytes=256, device_budget_bytes=256, schedule=schedule)
    orig, calls = st.StagingPool.acquire, [0]

    def acquire(pool: Any, nbytes: int) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("injected: out of memory allocating staging")
        return orig(pool, nbytes)

    fault: Any = contextlib.nullcontext()
    if rank == 1 and how == "staging":
        fault = mock.patch.object(st.StagingPool, "acquire", acquire)
    elif rank == 1:
        fault = pt.fail_work(r"exchange3", after_ops=0 if how == "setup0" else 2)
    out: dict[str, Any] = {}
    start = time.monotonic()
    try:
        with fault:
            t.run()
        out["error"] = None
    except TransferTornError as err:
        out.update(error=type(err).__name__, written=err.written, faults=err.faults)
    out["seconds"] = time.monotonic() - start
    t.run()  # the group is usable, staging released
    out["second"] = torch.equal(corner(storage, (6, 40)), full)
    return out


def case_misc(rank: int, world: int) -> dict[str, Any]:
    from pipeoff import ConfigError
    from pipeoff.transfer import LiveTensor, StateTransfer, TransferRefusedError

    out: dict[str, Any] = {}
    full = torch.arange(32, dtype=torch.float32).view(8, 4)
    # A second launch on the same group while one runs: refused locally, before any
    # collective (a second collective would interleave with the first's).
    src = {"w": LiveTensor(full[rank * 4:rank * 4 + 4].clone(), box=((rank * 4, 0), (4, 4)),
                           global_shape=(8, 4))}
    dst = torch.zeros(8, 4)
    t = StateTransfer(src, {"w": LiveTensor(dst)}, host_budget_bytes=64)
    ex = t.launch()
    try:
        t.launch()
        out["second_launch"] = None
    except ConfigError as err:
        out["second_launch"] = "still running" in str(err)
    ex.wait()
    out["first_done"] = torch.equal(dst, full)
    # An in-place reshard (each rank's buffer receives the other half) would read bytes
    # a round already overwrote: refused.
    buf = full[rank * 4:rank * 4 + 4].clone()
    other = 1 - rank
    try:
        StateTransfer({"w": LiveTensor(buf, box=((rank * 4, 0), (4, 4)), global_shape=(8, 4))},
                      {"w": LiveTensor(buf, box=((other * 4, 0), (4, 4)),
                                       global_shape=(8, 4))}, host_budget_bytes=64).run()
        out["inplace_reshard"] = None
    except TransferRefusedError as err:
        out["inplace_reshard"] = (err.rank, "overlaps the source" in str(err))
    # An in-place all-gather (the source is the target's own view of its box) is fine.
    whole = torch.zeros(8, 4)
    whole[rank * 4:rank * 4 + 4] = full[rank * 4:rank * 4 + 4]
    StateTransfer({"w": LiveTensor(whole[rank * 4:rank * 4 + 4], box=((rank * 4, 0), (4, 4)),
                                   global_shape=(8, 4))},
                  {"w": LiveTensor(whole)}, host_budget_bytes=64).run()
    out["inplace_gather"] = torch.equal(whole, full)
    # Parameters as targets (a rollout model's weights) and as sources.
    p = torch.nn.Parameter(torch.zeros(8, 4))
    q = torch.nn.Parameter(full[rank * 4:rank * 4 + 4].clone())
    StateTransfer({"w": LiveTensor(q, box=((rank * 4, 0), (4, 4)), global_shape=(8, 4))},
                  {"w": LiveTensor(p)}, host_budget_bytes=64).run()
    out["parameters"] = torch.equal(p.detach(), full) and p.grad_fn is None
    # Staging reserved ahead (collectively): the transfer then allocates nothing.
    from pipeoff.staging import host_pool

    t = StateTransfer(src, {"w": LiveTensor(torch.zeros(8, 4))}, host_budget_bytes=96)
    reserved = t.reserve()
    before = host_pool().stats().allocations
    t.run()
    t.run()
    out["reserved"] = (reserved["host"] > 0, host_pool().stats().allocations == before)
    # Errors name global ranks: rank 1 alone in a group of its own is group rank 0.
    solo = dist.new_group([1])
    if rank == 1:
        try:
            StateTransfer({"w": LiveTensor(torch.zeros(3))},
                          {"w": LiveTensor(torch.zeros(3, dtype=torch.float64))},
                          process_group=solo).run()
        except TransferRefusedError as err:
            out["global_rank"] = err.rank
    return out


def case_delays(rank: int, world: int) -> dict[str, Any]:
    import pipeoff.testing as pt

    out = {}
    for lane in ("host", "comm", "h2d", "d2h"):
        with pt.delay_lane(lane, 0.002 if lane == "comm" else 0.005):
            res = case_replicated(rank, world, torch.float32, torch.bfloat16, True, 4096)
        out[lane] = all(res["bitwise"].values()) and all(res["padding"].values())
    return out


def case_full_offload_broadcast(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """FSDP2-sharded FP32 masters of a FullOffloadOptimizer into BF16 replicated targets
    (an RL trainer's weight broadcast), started right after step() returns."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import pipeoff.testing as pt
    from pipeoff.optim import FullOffloadOptimizer
    from pipeoff.transfer import LiveTensor, StateTransfer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 5)).to(torch.bfloat16)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="forward")
    g = torch.Generator().manual_seed(1 + rank)
    rollout = {n: torch.full(tuple(p.shape), SENTINEL, dtype=torch.bfloat16)
               for n, p in model.named_parameters()}
    with pt.delay_lane("host_step", 0.02):
        for _ in range(2):
            model(torch.randn(4, 16, generator=g).to(torch.bfloat16)).float().square().mean(
            ).backward()
            opt.step()
            opt.zero_grad()
        # Right after step() returns: readiness, not wait_for_step().
        src = {n: LiveTensor.from_optimizer(opt, p, "master")
               for n, p in model.named_parameters()}
        dst = {n: LiveTensor(t) for n, t in rollout.items()}
        StateTransfer(src, dst, host_budget_bytes=512, cast={"*": torch.bfloat16}).run()
    opt.wait_for_step()
    ok = {}
    for n, p in model.named_parameters():
        master = opt.state[p]["master"]
        ok[n] = torch.equal(rollout[n], master.full_tensor().to(torch.bfloat16))
    return ok


def _sim_transfer(rank: int, world: int, wire: str, src_res: str, dst_res: str,
                  mutation: str | None) -> Any:
    """One transfer on the simulated CUDA device: True if bitwise, ``"race"`` if the
    device saw a race, else the error."""
    import pipeoff.testing as pt
    from pipeoff.testing import DataRaceError
    from pipeoff.transfer import LiveTensor, StateTransfer, TransferTornError

    full = _full((7, 33), torch.float32, seed=5)
    off, size = _shard0(full, rank, world)
    try:
        with pt.simulated_cuda() as sim:
            def mem(res: str, t: torch.Tensor) -> torch.Tensor:
                if res == "device":
                    return t.clone()
                h = sim.host_empty(t.shape, t.dtype, pinned=res == "pinned")
                h.copy_(t)
                return h

            src = mem(src_res, full[off[0]:off[0] + size[0]])
            dst = mem(dst_res, torch.full((7, 33), SENTINEL))
            t = StateTransfer({"w": LiveTensor(src, box=(off, size), global_shape=(7, 33))},
                              {"w": LiveTensor(dst)}, host_budget_bytes=512,
                              device_budget_bytes=512, wire=wire)  # type: ignore[arg-type]
            with pt.disable(mutation) if mutation else contextlib.nullcontext():
                with pt.delay_lane("d2h", 0.002), pt.delay_lane("h2d", 0.002):
                    t.run()
            sim.synchronize()
            return torch.equal(dst.clone(), full)
    except TransferTornError as err:
        return "race" if isinstance(err.__cause__, DataRaceError) else repr(err)
    except DataRaceError:
        return "race"
    except Exception as err:  # noqa: BLE001 - a peer's race: the group timed out
        return repr(err)


def case_simulated_cuda(rank: int, world: int) -> dict[str, Any]:
    """Both wires on the simulated CUDA device, sources and targets in each memory."""
    out = {}
    for wire in ("host", "device"):
        for src_res, dst_res in (("device", "pinned"), ("pinned", "device"),
                                 ("pageable", "pageable"), ("device", "device")):
            out[f"{wire}:{src_res}->{dst_res}"] = _sim_transfer(rank, world, wire, src_res,
                                                                dst_res, None)
    return out


def mutation_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """One transfer with a wait removed (``MUTATION`` in the environment): a rank that
    sees the race may leave its peer in a collective until the group's timeout, so each
    mutation runs in a process pair of its own, last."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=5))
    wire, src_res, dst_res, mutation = os.environ["PIPEOFF_TEST_MUTATION"].split(",")
    queue.put((rank, _sim_transfer(rank, world, wire, src_res, dst_res, mutation)))
    os._exit(0)  # no destroy: the group may be broken by the race


def worker(rank: int, world: int, port: int, queue: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    try:
        out["fp32"] = case_replicated(rank, world, torch.float32, torch.float32, False, 4096)
        out["bf16"] = case_replicated(rank, world, torch.bfloat16, torch.bfloat16, False, 4096)
        out["cast"] = case_replicated(rank, world, torch.float32, torch.bfloat16, True, 4096)
        out["tiny"] = case_replicated(rank, world, torch.float32, torch.float32, False, 128)
        out["reshard"] = case_reshard(rank, world, mesh)
        out["refusals"] = case_refusals(rank, world)
        out["torn"] = case_torn(rank, world)
        out["torn_rank0"] = case_torn(rank, world, faulty=0)
        for how in ("staging", "setup0", "setup2"):
            out[f"torn_{how}"] = case_torn_before_joining(rank, world, how)
        out["torn_setup0_sync"] = case_torn_before_joining(rank, world, "setup0",
                                                           "synchronous")
        out["misc"] = case_misc(rank, world)
        out["delays"] = case_delays(rank, world)
        out["full_offload"] = case_full_offload_broadcast(rank, world, mesh)
        out["simulated_cuda"] = case_simulated_cuda(rank, world)
    except BaseException:
        out["crash"] = traceback.format_exc()
    queue.put((rank, out))
    dist.destroy_process_group()


def case_mixed_dtypes(rank: int) -> bool:
    """Rank 0's FP32 tensor to a BF16 target (cast) on rank 1 and an FP32 one on rank 2:
    the same region, packed once per dtype."""
    from pipeoff.transfer import LiveTensor, StateTransfer

    full = _full((6, 9), torch.float32, seed=7)
    src = {"w": LiveTensor(full)} if rank == 0 else {}
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    dst = torch.zeros(6, 9, dtype=dtype)
    tgt = {"w": LiveTensor(dst)} if rank else {}
    StateTransfer(src, tgt, host_budget_bytes=1024,
                  cast={"w": torch.bfloat16} if rank == 1 else None).run()
    return rank == 0 or torch.equal(dst, full.to(dtype))


def three_rank_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """Replicated targets over three ranks: each source region goes to two peers and is
    packed once (the second copy made on the wire's side), on both wires."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    out: dict[str, Any] = {}
    try:
        out["host"] = case_replicated(rank, world, torch.float32, torch.bfloat16, True, 512)
        for wire in ("host", "device"):
            out[f"sim-{wire}"] = _sim_transfer(rank, world, wire, "pinned", "device", None)
        out["mixed"] = case_mixed_dtypes(rank)
    except BaseException:
        out["crash"] = traceback.format_exc()
    queue.put((rank, out))
    dist.destroy_process_group()
