"""The body of the FullOffloadOptimizer FSDP2 test, run in each of two gloo processes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def make_model(dtype: torch.dtype) -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    # Linear(32, 3) and Linear(3, 5) shard unevenly over 2 ranks.
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.to(dtype)


def shard(m: nn.Sequential, mesh: Any) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for i in (0, 2):
        fully_shard(m[i], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def local(t: Any) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def global_norm(masters: list[torch.Tensor]) -> torch.Tensor:
    """The global norm over the ranks' shards: the norm of each local sum, the local
    total, then one all-reduced square."""
    local_total = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(m.grad, 2.0) for m in masters if m.grad is not None]), 2.0)
    sq = local_total.double() ** 2
    dist.all_reduce(sq)
    return sq.sqrt().float()


def run_case(rank: int, mesh: Any, dtype: torch.dtype, accumulate: str, overlap: str,
             fsdp_flag: bool, max_norm: float | None = None,
             loop_clip: bool = False, fraction: float | str = 1.0,
             resume_at: float | None = None, drop_first: bool = False) -> dict[str, Any]:
    """``loop_clip``: the loop clips with torch's clip_grad_norm_ on the model's DTensor
    gradients (FullOffloadOptimizer's placeholders), the reference with the same call
    on DTensors of its FP32 sums; else the optimizer clips with ``max_norm``.
    ``fraction``: the ``offload_fraction``; ``resume_at``: after two steps the state
    dict goes into a new optimizer at this fraction, which takes the third step.
    ``drop_first``: after the micro-steps the loop sets the first weight's ``.grad`` to
    ``None`` (it does not step; the reference drops its sum)."""
    from torch.distributed.tensor import DTensor

    from pipeoff.optim import FullOffloadOptimizer

    ref = shard(make_model(dtype), mesh)
    mine = shard(make_model(dtype), mesh)
    params = list(ref.parameters())
    masters = [local(p).detach().float().clone() for p in params]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)

    def new_opt(f: float | str) -> FullOffloadOptimizer:
        # "auto": a budget per rank, rank 1's fits few of its shards (the ranks agree).
        budget = None if f != "auto" else AUTO_BUDGETS[rank]
        return FullOffloadOptimizer(mine, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                    accumulate=accumulate, overlap=overlap,
                                    max_norm=None if loop_clip else max_norm,
                                    offload_fraction=f, device_budget_bytes=budget,
                                    timeout=120.0)

    if fraction == "auto":
        from pipeoff.optim._full_offload import _auto
        from pipeoff.optim._offload._auto import Rates

        def gpu_like(*args: Any, **kwargs: Any) -> Rates:
            # A GPU's shape (a device step far faster than the host's), rank 0's a
            # little faster: alone, rank 0 would keep everything on its device.
            fast = 2.0 if rank == 0 else 1.0
            return Rates(h2d_bytes_per_s=fast * 1e9, d2h_bytes_per_s=fast * 1e9,
                         step_elements_per_s=fast * 1e12, host_step_elements_per_s=1e8)

        measure, _auto.measure_full_rates = _auto.measure_full_rates, gpu_like
        try:
            opt = new_opt(fraction)
        finally:
            _auto.measure_full_rates = measure
    else:
        opt = new_opt(fraction)
    stats = opt.memory_stats()
    device_part = stats.get("params_device", 0)
    peak = 0  # the device part's masters, state and sums, at their most (after a backward)
    choice = opt.offload_choice
    chosen = None if choice is None else (choice.fraction, choice.budget_bytes, next(
        c.device_bytes for c in choice.candidates if c.fraction == choice.fraction))
    norms: list[tuple[float, float]] = []
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(3):
        if step == 2 and resume_at is not None:
            opt.wait_for_step()
            saved = opt.state_dict()
            opt = new_opt(resume_at)
            opt.load_state_dict(saved)
        xs = [torch.randn(4, 16, generator=g).to(dtype) for _ in range(3)]
        acc: dict[int, torch.Tensor] = {}
        for k, x in enumerate(xs):
            last = k == len(xs) - 1
            # Reference: fold the local shards FSDP2 hands over in FP32 (each
            # micro-step, or with its flag off only the final sum FSDP2 kept).
            if fsdp_flag:
                ref.set_requires_gradient_sync(last)  # type: ignore[operator]
            ref(x).float().square().mean().backward()
            for j, p in enumerate(params):
                if p.grad is not None:
                    gl = local(p.grad).float()
                    acc[j] = acc[j] + gl if j in acc else gl.clone()
                    p.grad = None
            if fsdp_flag:
                # FSDP2's own flag: without gradient sync FSDP2 keeps the unsharded
                # sums itself and reduces them in the final backward.
                mine.set_requires_gradient_sync(last)  # type: ignore[operator]
                ctx: Any = contextlib.nullcontext()
            else:
                ctx = opt.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                mine(x).float().square().mean().backward()
            st = opt.memory_stats()
            peak = max(peak, sum(st.get(k, 0) for k in (
                "master_bytes_device", "state_bytes_device", "grad_sum_bytes_device")))
        if drop_first:
            acc.pop(0, None)
            next(iter(mine.parameters())).grad = None
        for j, m in enumerate(masters):
            m.grad = acc.get(j)
        if loop_clip:
            assert max_norm is not None
            boxed = []
            for p, m in zip(params, masters):
                d = DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape,
                                       stride=p.stride(), run_check=False)
                d.grad = DTensor.from_local(m.grad, p.device_mesh, p.placements,
                                            shape=p.shape, stride=p.stride(), run_check=False)
                boxed.append(d)
            want = torch.nn.utils.clip_grad_norm_(boxed, max_norm)
            for m, d in zip(masters, boxed):
                m.grad = local(d.grad)
            got = torch.nn.utils.clip_grad_norm_(mine.parameters(), max_norm)
            norms.append((float(local(got.full_tensor())), float(local(want.full_tensor()))))
        elif drop_first and max_norm is None:
            # The loop reads opt.grad_norm after the drop (the skip-on-non-finite
            # pattern): the norm of what steps. It was the final backward's, before it.
            got = opt.grad_norm
            assert got is not None
            norms.append((float(global_norm(masters)), float(got)))
        elif max_norm is not None:
            total = global_norm(masters)
            # The same norm in float64 from the elements, for scale. (torch's DTensor
            # get_total_norm, a functional collective, hung now and then on gloo
            # under load after a collective issued from another thread.)
            sq64 = sum((acc[j].double() ** 2).sum() for j in acc)
            assert isinstance(sq64, torch.Tensor)
            dist.all_reduce(sq64)
            full = sq64.sqrt()
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for m in masters:
                if m.grad is not None:
                    m.grad.mul_(coef)
            norms.append((float(total), float(full)))
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                local(p).copy_(m)
                m.grad = None
        opt.step()
        if max_norm is not None and not loop_clip:
            got = opt.grad_norm
            assert got is not None
            norms[-1] = (*norms[-1], float(got))  # type: ignore[assignment]
        opt.zero_grad()
    opt.wait_for_step()
    same = all(torch.equal(local(a).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           local(b).view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
               for a, b in zip(params, mine.parameters()))
    sizes = [local(p).numel() for p in mine.parameters()]
    return {"params_equal": same, "sizes": sizes, "norms": norms,
            "outside_writes": opt._registry.outside_writes, "device_part": device_part,
            "chosen": chosen, "device_peak": peak}


FRACTION_CASES = [
    (torch.float32, "cpu", "none", False, 0.05, False, 0.3),
    (torch.float32, "cpu", "forward", False, None, False, 0.3),
    (torch.float32, "gpu", "forward", True, 0.05, False, 0.3),
    (torch.bfloat16, "gpu", "forward", False, 0.05, True, 0.3),
    (torch.float32, "cpu", "forward", False, 0.05, False, 0.3, 1.0),
    (torch.float32, "cpu", "none", False, 0.05, False, 1.0, 0.3),
    (torch.float32, "cpu", "forward", False, 0.05, False, "auto"),
    (torch.bfloat16, "cpu", "backward", False, None, False, 0.3),
    (torch.float32, "cpu", "forward", False, None, False, 1.0, None, True),
    (torch.float32, "gpu", "none", False, None, False, 0.3, None, True),
]
"""With a device part (``offload_fraction=0.3``: every parameter but the first weight):
the optimizer's clip, none, FSDP2's own flag, the loop's clip on BF16, a resume
from 0.3 to 1.0 and back, "auto", overlap="backward" (BF16), and a host-part gradient
dropped by the loop after three micro-steps (it hung: the sums' edit waited for the
norm's all-reduce, whose gate only the caller opens)."""


AUTO_BUDGETS = {0: 1 << 30, 1: 3000}
"""``device_budget_bytes`` per rank of the ``"auto"`` case: rank 1's holds the masters,
state and sums (16 B an element) of under 190 of its ~330 elements."""


def refused_under_cpu_offload_policy(mesh: Any) -> str:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from pipeoff import ConfigError
    from pipeoff.optim import FullOffloadOptimizer

    m = make_model(torch.float32)
    fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    try:
        FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2)
    except ConfigError as err:
        return str(err)
    return "not refused"


def refused_at_differing_fractions(rank: int, mesh: Any) -> str:
    """Ranks passing different numeric fractions split differently and then hung in the
    norm's collectives: refused at construction, on both ranks; the group still works."""
    from torch.distributed.fsdp import fully_shard

    from pipeoff import PlanMismatchError
    from pipeoff.optim import FullOffloadOptimizer

    m = make_model(torch.float32)
    fully_shard(m, mesh=mesh)
    try:
        FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, offload_fraction=(0.3, 1.0)[rank])
        said = "not refused"
    except PlanMismatchError as err:
        said = str(err)
    FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, offload_fraction=0.3)  # agrees
    return said


def refused_at_auto_on_one_rank(rank: int, mesh: Any) -> str:
    """"auto" on rank 0 and a number on rank 1: rank 0 agreed on what "auto" chooses
    from while rank 1 checked its fraction, two collectives that met and hung. Refused
    at construction, on both ranks; the group still works."""
    from torch.distributed.fsdp import fully_shard

    from pipeoff import ConfigError
    from pipeoff.optim import FullOffloadOptimizer

    m = make_model(torch.float32)
    fully_shard(m, mesh=mesh)
    try:
        FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, offload_fraction=("auto", 0.5)[rank],
                             device_budget_bytes=(1 << 30, None)[rank])
        said = "not refused"
    except ConfigError as err:
        said = str(err)
    FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, offload_fraction=0.3)  # agrees
    return said


def foreach_weight_write(mesh: Any, refresh: bool) -> bool:
    """Whether weights halved by ``torch._foreach_mul_`` between two steps (lr 0) stay
    halved. torch 2.13's in-place foreach ops on DTensors bump no version counter,
    so only ``refresh_masters()`` tells the optimizer (docs/full_offload.md)."""
    from pipeoff.optim import FullOffloadOptimizer

    m = make_model(torch.bfloat16)
    shard(m, mesh)
    opt = FullOffloadOptimizer(m, torch.optim.SGD, lr=0.0)

    def step() -> None:
        m(torch.ones(2, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    before = [local(p).clone() for p in m.parameters()]
    with torch.no_grad():
        torch._foreach_mul_(list(m.parameters()), 0.5)
    if refresh:
        opt.refresh_masters()
    step()
    return all(torch.equal(local(p), b * 0.5) for p, b in zip(m.parameters(), before))


def _shared_dir() -> str:
    import tempfile

    d = [tempfile.mkdtemp(prefix="pipeoff_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(d)
    return str(d[0])


def state_dict_write(mesh: Any, how: str, fraction: float) -> bool:
    """Whether weights written through the tensors of ``model.state_dict()`` between
    two steps (lr 0) stay written: under FSDP2 those share no version counter with the
    parameters (a tester's find: DCP loading in place was undone by the next step)."""
    import torch.distributed.checkpoint as dcp

    from pipeoff.optim import FullOffloadOptimizer

    source = shard(make_model(torch.bfloat16), mesh)
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(-0.5)
    path = _shared_dir()
    dcp.save(source.state_dict(), checkpoint_id=path)
    m = shard(make_model(torch.bfloat16), mesh)
    opt = FullOffloadOptimizer(m, torch.optim.SGD, lr=0.0, offload_fraction=fraction)

    def step() -> None:
        m(torch.ones(2, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    if how == "dcp_in_place":
        dcp.load(m.state_dict(), checkpoint_id=path)
        want = [local(p).clone() for p in source.parameters()]
    else:
        for v in m.state_dict().values():
            local(v).fill_(0.25)
        want = [torch.full_like(local(p), 0.25) for p in m.parameters()]
    step()
    opt.wait_for_step()
    return all(torch.equal(local(p), w) for p, w in zip(m.parameters(), want))


def state_dict_write_more(mesh: Any, case: str) -> bool:
    """Writes through ``model.state_dict()`` a first fix missed (a tester's finds): an
    optimizer built from parameters (at fraction 0 it never found its model; at 1,
    a write before its first forward), and one after the final backward under
    ``overlap="backward"`` at fraction 0 (the device part steps at ``step()``)."""
    from pipeoff.optim import FullOffloadOptimizer

    m = shard(make_model(torch.bfloat16), mesh)
    fraction = 1.0 if case == "params_before_forward" else 0.0
    overlap = "backward" if case == "late_device_part" else "none"
    opt = FullOffloadOptimizer(m if case == "late_device_part" else list(m.parameters()),
                               torch.optim.SGD, lr=0.0, offload_fraction=fraction,
                               overlap=overlap)

    def write() -> None:
        for v in m.state_dict().values():
            local(v).fill_(0.25)

    def step(write_after_backward: bool = False) -> None:
        m(torch.ones(2, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        if write_after_backward:
            write()
        opt.step()
        opt.zero_grad()

    if case == "params_before_forward":
        write()
    else:
        step()
        if case == "params_fraction_0":
            write()
    step(write_after_backward=case == "late_device_part")
    opt.wait_for_step()
    return all(torch.equal(local(p), torch.full_like(local(p), 0.25)) for p in m.parameters())


def plain_checkpoint_resumed(mesh: Any, fraction: float) -> bool:
    """Whether a plain AdamW run's DCP checkpoint, loaded partially (no masters in it)
    into a fresh model and FullOffloadOptimizer, resumes it bitwise (FP32 weights):
    the loaded weights, not the fresh optimizer's masters (a tester's find)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from pipeoff.optim import FullOffloadOptimizer

    def loop(model: nn.Module, opt: Any, steps: range) -> None:
        for s in steps:
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(s))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    src = shard(make_model(torch.float32), mesh)
    src_opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    loop(src, src_opt, range(2))
    ms, osd = get_state_dict(src, src_opt)
    path = _shared_dir()
    dcp.save({"model": ms, "optim": osd}, checkpoint_id=path)
    m = make_model(torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)  # another init
    shard(m, mesh)
    opt = FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, offload_fraction=fraction)
    ms, osd = get_state_dict(m, opt)
    sd = {"model": ms, "optim": osd}
    dcp.load(sd, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loop(m, opt, range(2, 4))
    loop(src, src_opt, range(2, 4))
    opt.wait_for_step()
    return all(torch.equal(local(p), local(q)) for p, q in zip(m.parameters(), src.parameters()))


def worker(rank: int, world: int, port: int, queue: Any) -> None:
    import faulthandler
    import os

    from torch.distributed.device_mesh import init_device_mesh

    if os.environ.get("PIPEOFF_DUMP_AFTER"):
        faulthandler.dump_traceback_later(float(os.environ["PIPEOFF_DUMP_AFTER"]), exit=True)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        out: dict[Any, Any] = {}
        for case in [(torch.float32, "cpu", "backward", False),
                     (torch.float32, "gpu", "forward", False),
                     (torch.float32, "cpu", "none", True),
                     (torch.bfloat16, "cpu", "backward", False),
                     (torch.float32, "cpu", "none", False, 0.05),
                     (torch.float32, "gpu", "forward", False, 0.05),
                     (torch.float32, "cpu", "forward", False, 0.05, True),
                     (torch.bfloat16, "gpu", "none", False, 0.05, True),
                     *FRACTION_CASES]:
            try:
                out[case] = run_case(rank, mesh, *case)
            except Exception as err:  # reported to the test, named
                out[case] = {"error": f"{type(err).__name__}: {err}"}
        out["cpu_offload_policy"] = refused_under_cpu_offload_policy(mesh)
        out["fraction_mismatch"] = refused_at_differing_fractions(rank, mesh)
        out["auto_mismatch"] = refused_at_auto_on_one_rank(rank, mesh)
        out["foreach_write"] = {refresh: foreach_weight_write(mesh, refresh)
                                for refresh in (False, True)}
        out["state_dict_write"] = {(how, f): state_dict_write(mesh, how, f)
                                   for how in ("dcp_in_place", "to_local") for f in (1.0, 0.5)}
        out["plain_checkpoint"] = {f: plain_checkpoint_resumed(mesh, f) for f in (1.0, 0.5)}
        out["state_dict_write_more"] = {
            c: state_dict_write_more(mesh, c)
            for c in ("params_fraction_0", "params_before_forward", "late_device_part")}
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()
