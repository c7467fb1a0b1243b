"""The body of the FSDP2 tests, run in each of two gloo processes (see test_fsdp2.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def make_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    # Linear(32, 3) and Linear(3, 5) shard unevenly over 2 ranks.
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def shard(m: nn.Sequential, mesh: Any, prefetch: bool | str) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    if prefetch == "plain_root":
        # Only the first two Linears are sharded; the root and Linear(3, 5) stay
        # plain modules: parameters no FSDP module manages.
        for i in (0, 2):
            fully_shard(m[i], mesh=mesh)
        return m
    # Without prefetch, Linear(3, 5) is left to the root: the root owns parameters too.
    for i in (0, 2, 3) if prefetch else (0, 2):
        fully_shard(m[i], mesh=mesh)
    fully_shard(m, mesh=mesh)
    if prefetch:
        m[0].set_modules_to_forward_prefetch([m[2]])  # type: ignore[operator]
        m[2].set_modules_to_forward_prefetch([m[3]])  # type: ignore[operator]
    return m


def local(t: Any) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def own_chunks_only(opt: Any, model: nn.Module) -> None:
    """A deliberately wrong attach(): each FSDP module waits only for its own chunks."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            st = m._get_fsdp_state()
            own = [fp.sharded_param for g in st._fsdp_param_groups for fp in g.fsdp_params]

            def hook(mod: Any, args: Any, kwargs: Any, own: list[Any] = own) -> None:
                opt._waits.on_module(mod, own, "own_only")

            m.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


def run_case(rank: int, world: int, mesh: Any, prefetch: bool | str, attach: bool | str
             ) -> dict[str, Any]:
    import pipeoff.testing
    from pipeoff.optim import OffloadOptimizer

    ref = shard(make_model(), mesh, prefetch)
    mine = shard(make_model(), mesh, prefetch)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1),
                           mode="overlap", chunk_bytes=256)
    if attach == "own_only":
        own_chunks_only(opt, mine)
    elif attach:
        opt.attach(mine)
    g = torch.Generator().manual_seed(1)
    ref_losses, losses = [], []
    # Slow chunks: a forward that does not wait reads stale shards.
    # The controls (no attach, own chunks only) run without the read guard: they
    # show what the hooks alone must do.
    control = attach is False or attach == "own_only"
    with pipeoff.testing.delay_lane("compute", 0.01), \
            pipeoff.testing.disable("read_guard") if control else contextlib.nullcontext():
        for _ in range(3):
            x = torch.randn(8, 16, generator=g).chunk(world)[rank]
            loss = ref(x).pow(2).mean()
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())
            loss = mine(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.wait_for_step()
    params_equal = all(torch.equal(local(a), local(b))
                       for a, b in zip(ref.parameters(), mine.parameters()))
    state_equal = all(
        torch.equal(local(v), local(opt.state[b][k]))
        for a, b in zip(ref.parameters(), mine.parameters()) for k, v in ref_opt.state[a].items()
    )
    return {
        "losses_equal": ref_losses == losses,
        "params_equal": params_equal,
        "state_equal": state_equal,
        "signature": opt.plan.signature(),
        "local_numels": [local(p).numel() for p in mine.parameters()],
    }


def checkpoint_case(rank: int, world: int, mesh: Any, mode: str) -> dict[str, Any]:
    """torch.save of the optimizer state, and a load_state_dict on rank 1 only (as
    torchft's healing does), against FSDP2 with plain AdamW doing the same."""
    import copy
    import io

    from pipeoff.optim import OffloadOptimizer

    ref = shard(make_model(), mesh, True)
    mine = shard(make_model(), mesh, True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2, weight_decay=0.1),
                           mode=mode, chunk_bytes=256)  # type: ignore[arg-type]
    opt.attach(mine)
    g = torch.Generator().manual_seed(2)
    ref_losses, losses = [], []
    saved = loaded_equal = False
    for step in range(4):
        x = torch.randn(8, 16, generator=g).chunk(world)[rank]
        for m, o, out in ((ref, ref_opt, ref_losses), (mine, opt, losses)):
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
        if step == 1:
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)  # every checkpoint path pickles
            saved = True
            buf.seek(0)
            back = torch.load(buf, weights_only=False)
            now = opt.state_dict()
            loaded_equal = all(
                torch.equal(local(v), local(back["state"][k][key]))
                for k, st in now["state"].items() for key, v in st.items())
            if rank == 1:  # a rank-local load: no collective may follow from it
                ref_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
                opt.load_state_dict(back)
    opt.wait_for_step()
    return {
        "saved": saved,
        "loaded_equal": loaded_equal,
        "losses_equal": ref_losses == losses,
        "params_equal": all(torch.equal(local(a), local(b))
                            for a, b in zip(ref.parameters(), mine.parameters())),
    }


def worker(rank: int, world: int, port: int, queue: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        out = {
            (prefetch, attach): run_case(rank, world, mesh, prefetch, attach)
            for prefetch, attach in ((False, True), (True, True), (True, False),
                                     (True, "own_only"), ("plain_root", True))
        }
        for mode in ("chunked", "overlap"):
            out[("checkpoint", mode)] = checkpoint_case(rank, world, mesh, mode)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()
