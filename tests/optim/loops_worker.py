"""The two-process bodies of tests/optim/test_full_offload_ranks.py (issue 20): DDP, HSDP
clipping, and torch DCP resumes across world sizes, each against plain torch."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoff import GradientError, testing


def make_model(seed: int = 0) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _named(kind: str, case: Any, rank: int) -> Any:
    """``case(rank, kind)``, a failure naming the case."""
    try:
        return case(rank, kind)
    except BaseException as err:
        if kind == "mutation" and isinstance(err, GradientError):
            # Caught loudly: the reducer wrote into the gradient placeholder the
            # mutated callback had already put in .grad.
            return {"same": False, "raised": str(err)}
        err.add_note(f"in case {kind!r}")
        raise


def pack(obj: Any) -> bytes:
    """``obj`` (tensors too) as bytes: tensors put on a queue as they are would be shared
    through file descriptors that die with the process."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)))


# -- 1. DDP ---------------------------------------------------------------------------------

def ddp_case(rank: int, kind: str) -> dict[str, Any]:
    """Three steps of 3 micro-steps (1 for ``plain``), FullOffloadOptimizer over a DDP
    model against DDP with plain AdamW (FP32: the masters are the weights)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipeoff.optim import FullOffloadOptimizer

    max_norm = 0.05 if kind == "clip" else None
    ref = DDP(make_model(), gradient_as_bucket_view=kind == "bucket_view")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    inner = make_model()
    if kind == "wrapped_after":  # as accelerate.prepare does: optimizer first, DDP after
        opt = FullOffloadOptimizer(inner, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        mine = DDP(inner)
    else:
        mine = DDP(inner, gradient_as_bucket_view=kind == "bucket_view")
        overlap = "backward" if kind in ("backward", "mutation") else "forward"
        opt = FullOffloadOptimizer(mine, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                   max_norm=max_norm, overlap=overlap)
    micro = 1 if kind in ("plain", "mutation", "wrapped_after") else 3
    g = torch.Generator().manual_seed(1 + rank)
    norms = []
    mutate = testing.disable("ddp_reduced") if kind == "mutation" else contextlib.nullcontext()
    with mutate:
        for _ in range(3):
            xs = [torch.randn(4, 16, generator=g) for _ in range(micro)]
            for k, x in enumerate(xs):
                last = k == len(xs) - 1
                use_no_sync = kind in ("no_sync", "backward", "clip", "loop_clip") and not last
                for model in (ref, mine):
                    with model.no_sync() if use_no_sync else contextlib.nullcontext():
                        model(x).square().mean().backward()
            if max_norm is not None:
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm,
                                                          foreach=False)
                norms.append((float(opt.grad_norm), float(ref_norm)))  # type: ignore[arg-type]
            elif kind == "loop_clip":  # the loop's own clip call, on the DDP module
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                my_norm = torch.nn.utils.clip_grad_norm_(mine.parameters(), 0.05)
                norms.append((float(my_norm), float(ref_norm)))
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
    left = [n for n, p in mine.named_parameters() if p.grad is not None]
    same = all(_bits(p, q) for p, q in zip(mine.parameters(), ref.parameters()))
    import hashlib

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in mine.parameters()))
    # (A digest, not the tensors: the queue is a pipe the parent reads after join.)
    return {"same": same, "grads_left": left, "norms": norms, "weights": digest.hexdigest()}


def ddp_one_pass_case(rank: int, kind: str) -> dict[str, Any]:
    """A BF16 model under DDP, fused AdamW, 3 steps of 3 micro-steps marked with DDP's
    no_sync(): the one-pass final micro-step (the reduced BF16 gradients held) against
    the same run made to fold first (``grad_norm`` read before each ``step()``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipeoff.optim import FullOffloadOptimizer

    runs = {}
    paths = {}
    for read_first in (False, True):
        model = DDP(make_model().to(torch.bfloat16))
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                   fused=True)
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            xs = [torch.randn(4, 16, generator=g).to(torch.bfloat16) for _ in range(3)]
            for k, x in enumerate(xs):
                with model.no_sync() if k < 2 else contextlib.nullcontext():
                    model(x).float().square().mean().backward()
            if read_first:
                assert opt.grad_norm is not None
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        runs[read_first] = [p.detach().clone() for p in model.parameters()]
        paths[read_first] = opt.host_step_path
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(runs[False], runs[True]))
    import hashlib

    digest = hashlib.sha256(b"".join(p.view(torch.int16).numpy().tobytes() for p in runs[False]))
    return {"same": same, "one_pass": bool(paths[False] and paths[False].one_pass),
            "folded": bool(paths[True] and not paths[True].one_pass),
            "weights": digest.hexdigest()}


def ddp_worker(rank: int, world: int, port: int, queue: Any) -> None:
    init(rank, world, port)
    try:
        out = {kind: _named(kind, ddp_case, rank) for kind in (
            "plain", "no_sync", "accumulate", "backward", "bucket_view", "wrapped_after",
            "clip", "loop_clip", "mutation")}
        out["one_pass"] = _named("one_pass", ddp_one_pass_case, rank)
        queue.put((rank, pack(out)))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        import traceback

        queue.put((rank, pack({"error": traceback.format_exc() or repr(err)})))
    finally:
        dist.destroy_process_group()


# -- 2. HSDP clipping -----------------------------------------------------------------------

def hsdp_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """FSDP2 on a 2-D mesh, 2 replicas x 1 shard: the norm is the true one (each replica
    holds the whole parameter), and training is bitwise the plain reference clipped by
    torch's clip_grad_norm_ over the full gradients."""
    init(rank, world, port)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from pipeoff.optim import FullOffloadOptimizer

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        mine = make_model()
        for m in (mine[0], mine[2], mine):
            fully_shard(m, mesh=mesh)
        ref = make_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        opt = FullOffloadOptimizer(mine, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                   max_norm=0.05)
        norms = []
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            x = torch.randn(4, 16, generator=g)
            xs = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(xs, x)
            mine(x).square().mean().backward()
            # The reference: HSDP averages the replicas' gradients.
            ref_loss = sum(ref(xi).square().mean() for xi in xs) / 2
            ref_loss.backward()  # type: ignore[union-attr]
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=False)
            norms.append((float(opt.grad_norm), float(ref_norm)))  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.wait_for_step()
        close = all(torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
                    for p, q in zip(mine.parameters(), ref.parameters()))
        queue.put((rank, pack({"norms": norms, "close": close})))
    except BaseException:  # noqa: BLE001 - reported to the test
        import traceback

        queue.put((rank, pack({"error": traceback.format_exc()})))
    finally:
        dist.destroy_process_group()


# -- 4. torch DCP across world sizes -----------------------------------------------------------

def _fsdp(model: nn.Sequential, world: int) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    return model


def _train(model: nn.Module, opt: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    getattr(opt, "wait_for_step", lambda: None)()


def _full_state(model: nn.Module, opt: Any) -> Any:
    """The optimizer state with full (unsharded) tensors, by FQN."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    return copy.deepcopy(sd.get("state", {}))  # (rank 0 only: a full state dict)


def dcp_worker(rank: int, world: int, port: int, queue: Any, *, phase: str, path: str,
               optimizer: str) -> None:
    """``save``: train 2 steps on ``world`` ranks, save with DCP and report the full state.
    ``load``: a fresh model and optimizer on ``world`` ranks, the template from
    get_optimizer_state_dict, dcp.load, set_optimizer_state_dict; report the full
    state loaded."""
    init(rank, world, port)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from pipeoff.optim import FullOffloadOptimizer

        model = _fsdp(make_model(), world)
        opt: Any = (FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
                    if optimizer == "full_offload" else
                    torch.optim.AdamW(model.parameters(), lr=1e-2))
        if phase == "save":
            _train(model, opt, 2, seed=1 + rank)
            dcp.save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        else:
            sd = {"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=path)
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"])
        state = _full_state(model, opt)  # (a collective: every rank)
        if rank == 0:  # a file, not the queue: a pipe the parent reads only after join
            torch.save(state, f"{path}.{phase}.pt")
        queue.put((rank, pack({})))
    except BaseException:  # noqa: BLE001 - reported to the test
        import traceback

        queue.put((rank, pack({"error": traceback.format_exc()})))
    finally:
        dist.destroy_process_group()


class _Experts(nn.Module):
    """A replicated layer and an expert-parallel one: its weight a DTensor sharded by
    rows over the ranks, each rank's forward using its own rows (to_local(), no
    collective). A rank whose batch routes no token to its expert skips it."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        g = torch.Generator().manual_seed(3)
        self.shared = nn.Linear(8, 8)
        with torch.no_grad():
            self.shared.weight.copy_(torch.randn(8, 8, generator=g))
        self.expert = nn.Parameter(distribute_tensor(torch.randn(16, 8, generator=g), mesh,
                                                     [Shard(0)]))

    def forward(self, x: torch.Tensor, routed: bool) -> torch.Tensor:
        h = self.shared(x)
        if routed:
            h = h + nn.functional.linear(h, self.expert.to_local())
        return h


def expert_norm_worker(rank: int, world: int, port: int, queue: Any, *,
                       device_route: bool = False) -> None:
    """The clipping norm when rank 1 holds no gradient of its expert shard (no token
    routed to it): it still joins the expert group's all-reduce, with zero, so both
    ranks get sqrt(own replicated sq + the experts' sq summed over ranks).

    ``device_route``: the groups taken for NCCL-only ones, which refuse host tensors,
    so each squared norm crosses as a copy in the parameters' device memory."""
    init(rank, world, port)
    routed: list[Any] = []
    try:
        if device_route:
            from pipeoff import _dist

            def takes_host_tensors(group: Any) -> bool:
                routed.append(group)
                return False

            _dist.takes_host_tensors = takes_host_tensors  # type: ignore[assignment]
        from torch.distributed.device_mesh import init_device_mesh

        from pipeoff.optim import FullOffloadOptimizer

        mesh = init_device_mesh("cpu", (world,))
        model = _Experts(mesh)
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, max_norm=0.5,
                                   timeout=20.0)
        norms = []
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(2):
            model(torch.randn(4, 8, generator=g), routed=rank == 0).square().mean().backward()
            # The reference, from the gradients the backward left (before the norm's
            # own all-reduce, which must pair with the peer's).
            shared = sum(float(p.grad.float().square().sum())  # type: ignore[union-attr]
                         for p in model.shared.parameters())
            eg = model.expert.grad
            expert = torch.zeros((), dtype=torch.float64) if eg is None else (
                eg.to_local().double().square().sum())
            dist.all_reduce(expert)
            norms.append((float(opt.grad_norm),  # type: ignore[arg-type]
                          (shared + float(expert)) ** 0.5))
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        queue.put((rank, pack({"norms": norms, "routed": len(routed)})))
    except BaseException:  # noqa: BLE001 - reported to the test
        import traceback

        queue.put((rank, pack({"error": traceback.format_exc()})))
    finally:
        dist.destroy_process_group()


def reduce_gate_worker(rank: int, world: int, port: int, queue: Any) -> None:
    """The clipping norm's all-reduce (a lane's, on the process group the parameters are
    sharded over) waits for the caller's ``reduce`` gate, which ``step()`` opens: a
    collective the caller issues between the final backward and ``step()`` (a loss
    all-reduce for logging) is never interleaved with it.

    The orders are forced so that an ungated all-reduce would pair wrongly: rank 0 holds
    its ``norm`` task until its own collective is issued, and rank 1 issues its own
    only once its lane's all-reduce is either issued (ungated) or parked on the pending
    gate (gated). Ungated, rank 0 issues [caller's, lane's] and rank 1 [lane's,
    caller's]: the caller's float64 scalar is summed with the peer's squared norm."""
    import threading
    import time

    from pipeoff.executor._gates import PENDING
    from pipeoff.optim._full_offload._graph import REDUCE

    init(rank, world, port)
    real = dist.all_reduce
    issued = threading.Event()
    """A lane thread has issued a collective (the norm's)."""

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # The lane's collective, made observable once it is issued: async, then waited,
        # as a synchronous all_reduce is.
        if threading.current_thread() is threading.main_thread():
            return real(tensor, *args, **kwargs)
        asked = kwargs.pop("async_op", False)
        work = real(tensor, *args, async_op=True, **kwargs)
        issued.set()
        if asked:
            return work
        work.wait()
        return None

    dist.all_reduce = spy  # type: ignore[assignment]
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from pipeoff.optim import FullOffloadOptimizer

        mesh = init_device_mesh("cpu", (world,))
        group = mesh.get_group()  # the lane's all-reduce is on it
        model = _Experts(mesh)
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, max_norm=0.5,
                                   timeout=20.0)
        g = torch.Generator().manual_seed(10 + rank)
        with opt.no_sync():  # marked: the unmarked backward below is the final one
            model(torch.randn(4, 8, generator=g), routed=True).square().mean().backward()
        mine = torch.tensor(1000.0 * (rank + 1), dtype=torch.float64)
        if rank == 0:
            with testing.hold_task("norm") as release:
                model(torch.randn(4, 8, generator=g), routed=True).square().mean().backward()
                work = real(mine, group=group, async_op=True)  # issued before the lane's
                release.set()
                work.wait()
        else:
            model(torch.randn(4, 8, generator=g), routed=True).square().mean().backward()
            acc = opt._lifecycle.acc
            assert acc is not None and acc.final is not None and acc.final.execution
            gates = acc.final.execution._run.gates
            k = gates.index[REDUCE]
            deadline = time.monotonic() + 60.0
            while not (issued.is_set() or (gates.first_wait_ns[k] is not None
                                           and gates.state[k] == PENDING)):
                if time.monotonic() > deadline:
                    raise AssertionError("the norm's all-reduce neither issued nor parked "
                                         "on its gate within 60 s")
                issued.wait(0.001)
            real(mine, group=group)  # after the lane's, had it been let go
        opt.step()
        opt.wait_for_step()
        queue.put((rank, pack({"sum": float(mine)})))
    except BaseException:  # noqa: BLE001 - reported to the test
        import traceback

        queue.put((rank, pack({"error": traceback.format_exc()})))
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
        dist.destroy_process_group()
