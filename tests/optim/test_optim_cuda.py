"""The optimizer's CUDA path (streams, events, pinned host state, forward waits), on the
simulated CUDA device, and on a real GPU where there is one."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import pipeoff
import pipeoff.testing
from pipeoff.optim import OffloadOptimizer
from tests.gpu_device import Gpu


def make_net(gpu: Gpu) -> nn.Module:
    torch.manual_seed(0)
    return gpu.module(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64),
                                    nn.GELU(), nn.Linear(64, 8)))


def offload(net: nn.Module, mode: Any, **kw: Any) -> OffloadOptimizer:
    """The optimizer these tests step: AdamW (lr 1e-3) in ``mode``, 4 KiB chunks."""
    return OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), mode=mode,
                            chunk_bytes=4096, **kw)


def batches(gpu: Gpu, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [gpu.tensor(torch.randn(16, 32, generator=g)) for _ in range(n)]


def train(net: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]
          ) -> list[torch.Tensor]:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    outs = []
    for x in xs:
        y = net(x)
        outs.append(y.detach().clone())
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return outs


def _run(gpu: Gpu, mode: str, impl: str) -> tuple[list[Any], nn.Module, Any, nn.Module, Any]:
    kw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True, impl: True}
    xs = batches(gpu, 4)
    ref = make_net(gpu)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    ref_out = train(ref, ref_opt, xs)
    net = make_net(gpu)
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), **kw), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=4096)
    opt.attach(net)
    # Slow the optimizer lane: a missing wait shows as a race (and as wrong numbers).
    with pipeoff.testing.delay_lane("compute", 0.005):
        out = train(net, opt, xs)
        opt.wait_for_step()
    return [ref_out, out], ref, ref_opt, net, opt


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_bitwise_equal(gpu: Gpu, mode: str, impl: str) -> None:
    (ref_out, out), ref, ref_opt, net, opt = _run(gpu, mode, impl)
    gpu.synchronize()
    for a, b in zip(ref_out, out):
        assert torch.equal(gpu.read(a), gpu.read(b))
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))
        for k, v in ref_opt.state[p].items():
            w = opt.state[q][k]
            if k != "step":
                assert not gpu.accel.on_device(w) and gpu.accel.is_pinned(w), k
            assert torch.equal(gpu.read(v), gpu.read(w)), k


@pytest.mark.parametrize("mode", ["single_pass", "chunked", "overlap"])
def test_a_0_dim_parameter_steps_as_torch(gpu: Gpu, mode: str) -> None:
    """The simulated device took ``single_pass``'s device copies of state for host
    memory, and so a 0-dim one for a scalar argument: its update went into a copy of
    it (a tester's find: 1.2574 where torch gives 1.2006)."""

    def run(wrap: bool) -> list[torch.Tensor]:
        scale = nn.Parameter(gpu.tensor(torch.tensor(1.5)))
        vec = nn.Parameter(gpu.tensor(torch.linspace(-1, 1, 40)))
        opt: Any = torch.optim.AdamW([scale, vec], lr=0.1)
        if wrap:
            opt = OffloadOptimizer(opt, mode=mode)  # type: ignore[arg-type]
        for k in range(3):
            ((scale * vec).pow(2).sum() * (k + 1)).backward()
            opt.step()
            opt.zero_grad()
        if wrap:
            opt.wait_for_step()
        gpu.synchronize()
        return [gpu.read(scale), gpu.read(vec), *map(gpu.read, opt.state[scale].values())]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_the_grad_a_lane_reads_is_fenced_for_the_allocator(gpu: Gpu) -> None:
    """A grad the user drops while an overlap chunk still reads it: record_stream keeps
    its memory from the next allocation on the stream that made it. (A chunked step
    is waited for before step() returns, so there the fence is not needed, and the
    simulated device agrees.)"""
    mode = "overlap"
    if not gpu.simulated:
        pytest.skip("only the simulated device sees an allocator reuse that did not happen")
    _run(gpu, mode, "foreach")
    with pipeoff.testing.disable("record_stream"), \
            pytest.raises(pipeoff.testing.DataRaceError, match="record_stream"):
        _run(gpu, mode, "foreach")
        gpu.synchronize()


def test_forward_waits_make_streams_wait(gpu: Gpu) -> None:
    """Overlap mode on CUDA: the forward's stream waits for each chunk (no host block)."""
    _run(gpu, "overlap", "foreach")
    if not gpu.simulated:
        return
    with pipeoff.testing.disable("hook_stream_wait"), \
            pytest.raises(pipeoff.testing.DataRaceError, match="device tensor"):
        _run(gpu, "overlap", "foreach")
        gpu.synchronize()


def test_peak_state_memory_is_bounded(gpu: Gpu) -> None:
    net = make_net(gpu)
    chunk = 4096
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), foreach=True), mode="chunked",
                           chunk_bytes=chunk, prefetch=2)
    for x in batches(gpu, 2):
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
    summary = opt.last_trace.summary()  # type: ignore[union-attr]
    assert summary.peak_device_staging_bytes <= 3 * chunk
    assert all(c.nbytes <= chunk for c in opt.plan.chunks)
    # No optimizer state tensor stays in device memory.
    assert all(not gpu.accel.on_device(v) for st in opt.state.values()
               for k, v in st.items() if k != "step")


def test_without_forward_waits_the_forward_reads_stale_params(gpu: Gpu) -> None:
    """The control on the device: no attach(), no read guard: a race (and stale numbers)."""
    if not gpu.simulated:
        pytest.skip("a real GPU shows it only by timing luck")
    net = make_net(gpu)
    opt = offload(net, "overlap")
    xs = batches(gpu, 2)
    with pipeoff.testing.delay_lane("compute", 0.01), pipeoff.testing.disable("read_guard"), \
            pytest.raises(pipeoff.testing.DataRaceError):
        net(xs[0]).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            net(xs[1])
        opt.wait_for_step()


def test_zero_grad_in_place_waits_for_the_chunks_that_read_the_grads(gpu: Gpu) -> None:
    """Hazard: ``zero_grad(set_to_none=False)`` zeroing the grads that the overlap step's
    chunks still read. Without the read guard only zero_grad's own wait orders the two."""
    x = batches(gpu, 1)[0]
    ref = make_net(gpu)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    net = make_net(gpu)
    opt = offload(net, "overlap", read_guard=False)
    with pipeoff.testing.delay_lane("compute", 0.01):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.wait_for_step()
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))
        assert q.grad is not None and not gpu.read(q.grad).any()


@pytest.mark.parametrize("how", ["grad.zero_()", "model.zero_grad(False)"])
def test_grads_zeroed_in_place_wait_with_a_device_part(gpu: Gpu, how: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard: the read guard knowing a gradient only while its chunk's host side had not
    finished: at offload_fraction < 1 the device part steps before the forward waits
    begin, so a chunk issued meanwhile (its kernels still queued on the compute stream)
    had its gradient unguarded, and zeroing it in place raced them (a tester's find).
    Forced: the device part steps only once the first chunk has been issued."""
    x = batches(gpu, 1)[0]
    ref = make_net(gpu)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    net = make_net(gpu)
    opt = offload(net, "overlap", offload_fraction=0.3)
    opt.attach(net)
    real = type(opt._device).step

    def after_the_first_chunk(*args: Any) -> Any:
        st = opt._inflight
        assert st is not None and st.updated
        first, deadline = min(st.updated), time.monotonic() + 120
        while first in st.restore:  # its chunk's host side has not finished yet
            assert time.monotonic() < deadline
            time.sleep(0.001)
        return real(*args)

    monkeypatch.setattr(type(opt._device), "step", after_the_first_chunk)
    with pipeoff.testing.delay_lane("compute", 0.01):
        net(x).pow(2).mean().backward()
        opt.step()
        if how == "grad.zero_()":
            for p in net.parameters():
                p.grad.zero_()  # type: ignore[union-attr]
        else:
            net.zero_grad(set_to_none=False)
        opt.wait_for_step()
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_a_reader_off_the_callers_stream_after_load_state_dict_waits(gpu: Gpu,
                                                                     mode: str) -> None:
    """At offload_fraction=0 load_state_dict() copies the state into device memory on the
    caller's stream; after wait_for_step() a stream of its own reads it. Nothing ordered
    the read after the copies (a tester's find)."""
    if not gpu.simulated:
        pytest.skip("a real GPU shows the race only by timing luck")
    import copy

    net = make_net(gpu)
    opt = offload(net, mode, offload_fraction=0.0)
    net(batches(gpu, 1)[0]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.wait_for_step()
    p = next(iter(net.parameters()))
    side = gpu.accel.new_stream(gpu.device, name="reader")
    got: list[torch.Tensor] = []
    gpu.accel.launch(side, lambda: got.append(opt.state[p]["exp_avg"].clone()))
    gpu.synchronize()
    assert torch.equal(got[0], opt.state[p]["exp_avg"])


def _fsdp_stub(gpu: Gpu, model: nn.Sequential, *, one_rank: bool = False,
               post_optim: bool = False) -> tuple[list[Any], Any]:
    """Make each Linear of ``model`` look like an FSDP2 unit with all-gather streams.

    Like FSDP2, a unit's forward reads an *unsharded* copy of its parameters that
    an all-gather stream makes from the sharded ones, in a pre-forward hook that
    runs after pipeoff's (``prepend=True``), and the compute stream then waits
    for that stream. Like FSDP2's root pre-forward, the all-gather stream waits
    for the compute stream once, when the forward starts, and never again: only
    pipeoff's hook can order it after the chunk that writes a unit's shards.

    With ``one_rank``, like FSDP2 on a shard group of one rank
    (``FSDPParamGroup.wait_for_unshard``): no all-gather; the pre-forward copies
    the shards into the unsharded parameters on the current stream.

    With ``post_optim``, the root has FSDP2's ``set_post_optim_event``: its
    pre-forward makes the all-gather stream wait for that event instead of the
    current stream (``FSDPState._root_pre_forward``).
    """
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule

    accel = gpu.accel
    copy_in = accel.new_stream(gpu.device, name="all_gather_copy_in")
    gather = accel.new_stream(gpu.device, name="all_gather")

    class _Gathered(torch.autograd.Function):
        """The unsharded copy in the forward; the gradient goes to the shard."""

        @staticmethod
        def forward(ctx: Any, param: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
            return gathered.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad, None

    post_optim_event: list[Any] = []

    def root_pre_forward(mod: nn.Module, args: Any) -> None:
        if post_optim_event:
            gather.wait_event(post_optim_event.pop())
        else:
            gather.wait_stream(accel.current_stream())

    model.register_forward_pre_hook(root_pre_forward)
    if post_optim:
        model.set_post_optim_event = post_optim_event.append  # type: ignore[assignment]
    units = []
    for m in model:
        if not isinstance(m, nn.Linear):
            continue
        params = list(m.parameters(recurse=False))
        state = SimpleNamespace(
            _fsdp_param_groups=[SimpleNamespace(
                fsdp_params=[SimpleNamespace(sharded_param=p) for p in params])],
            _states_to_forward_prefetch=[],
            _comm_ctx=SimpleNamespace(all_gather_copy_in_stream=copy_in,
                                      all_gather_stream=gather),
            _state_ctx=SimpleNamespace(post_optim_event=None),
        )
        cls = type(f"FSDP{type(m).__name__}", (FSDPModule, type(m)),
                   {"_get_fsdp_state": lambda self, state=state: state})
        m.__class__ = cls
        unsharded = [torch.empty_like(p) for p in params]

        def unshard(mod: nn.Module, args: Any, params: list[Any] = params,
                    unsharded: list[Any] = unsharded) -> None:
            def gather_work() -> None:
                for src, dst in zip(params, unsharded):
                    dst.copy_(src)  # reads the shards on the all-gather stream

            if one_rank:
                with torch.no_grad():
                    for src, dst in zip(params, unsharded):
                        dst.copy_(src)  # reads the shards on the current stream
                return
            accel.launch(gather, gather_work)
            done = accel.new_event()
            done.record(gather)
            done.wait(accel.current_stream())  # compute waits for the all-gather

        def forward(x: torch.Tensor, params: list[Any] = params,
                    unsharded: list[Any] = unsharded) -> torch.Tensor:
            w, b = (_Gathered.apply(p, u) for p, u in zip(params, unsharded))
            return torch.nn.functional.linear(x, w, b)

        m.register_forward_pre_hook(unshard)
        m.forward = forward  # type: ignore[method-assign]
        units.append(m)
    return units, gather


@pytest.mark.parametrize("mutation", [None, "fsdp_gather_wait", "hook_stream_wait"])
def test_fsdp_units_make_their_all_gather_streams_wait(gpu: Gpu, mutation: str | None) -> None:
    if not gpu.simulated:
        pytest.skip("the FSDP2 stub runs on the simulated device")
    import contextlib

    results = []
    for mode in ("chunked", "overlap"):
        net = make_net(gpu)
        _fsdp_stub(gpu, net)  # type: ignore[arg-type]
        opt = offload(net, mode, read_guard=False)
        opt.attach(net)
        mutated = pipeoff.testing.disable(mutation) if mutation and mode == "overlap" else (
            contextlib.nullcontext())
        raises = (pytest.raises(pipeoff.testing.DataRaceError, match="all_gather")
                  if mutation and mode == "overlap" else contextlib.nullcontext())
        with mutated, raises, pipeoff.testing.delay_lane("compute", 0.005):
            outs = train(net, opt, batches(gpu, 3))
            opt.wait_for_step()
            gpu.synchronize()
        results.append(outs)
    if mutation is None:
        assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_one_rank_fsdp_unit_copies_its_shards_on_the_compute_stream(gpu: Gpu) -> None:
    """Hazard: on a shard group of one rank FSDP2 skips the all-gather and copies the
    shards on the *current* stream in its pre-forward: an FSDP unit's hook must make
    the current stream wait too, not only FSDP's all-gather streams."""
    if not gpu.simulated:
        pytest.skip("the FSDP2 stub runs on the simulated device")
    results = []
    for mode in ("chunked", "overlap"):
        net = make_net(gpu)
        _fsdp_stub(gpu, net, one_rank=True)  # type: ignore[arg-type]
        opt = offload(net, mode, read_guard=False)
        opt.attach(net)
        with pipeoff.testing.delay_lane("compute", 0.005):
            outs = train(net, opt, batches(gpu, 3))
            opt.wait_for_step()
        results.append([gpu.read(o) for o in outs])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_forward_waits_never_block_the_host(gpu: Gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a forward hook only makes streams wait: the forward is issued while the
    chunks still run (the dispatch of a chunk never waits on the device).

    The simulated device runs the host's own operations on the default stream
    synchronously (it cannot defer a torch op), so there the test checks the
    mechanism instead: the forward calls no host-blocking synchronization, only
    ``wait_event`` on the current stream. On a GPU it checks the timing.
    """
    net = make_net(gpu)
    opt = offload(net, "overlap")
    opt.attach(net)
    xs = batches(gpu, 2)
    host_syncs: list[str] = []
    stream_waits: list[str] = []
    if gpu.simulated:
        from pipeoff.testing._simcuda import SimEvent, SimStream

        real_wait = SimStream.wait_event
        monkeypatch.setattr(SimEvent, "synchronize",
                            lambda self: host_syncs.append("event.synchronize"))
        monkeypatch.setattr(SimStream, "synchronize",
                            lambda self: host_syncs.append("stream.synchronize"))
        monkeypatch.setattr(type(gpu.accel), "synchronize",
                            lambda self, device=None: host_syncs.append("synchronize"))

        def wait_event(self: Any, event: Any) -> None:
            if self is gpu.sim.default:
                stream_waits.append("wait_event")
            real_wait(self, event)

        monkeypatch.setattr(SimStream, "wait_event", wait_event)
    with pipeoff.testing.delay_lane("compute", 0.05):
        net(xs[0]).pow(2).mean().backward()
        opt.step()
        host_syncs.clear()
        stream_waits.clear()
        t0 = time.perf_counter()
        net(xs[1])  # every chunk is 50 ms late on its stream
        issued_in = time.perf_counter() - t0
        forward_syncs, forward_waits = list(host_syncs), list(stream_waits)
        if not gpu.simulated:
            assert opt.last_execution is not None and not opt.last_execution.done()
        monkeypatch.undo()
        opt.wait_for_step()
    chunks = len(opt.plan.chunks)
    assert chunks >= 3
    if gpu.simulated:
        assert forward_syncs == [] and forward_waits, (forward_syncs, forward_waits)
    else:
        assert issued_in < 0.05 * chunks / 2, (issued_in, chunks)


def test_a_reserved_optimizer_allocates_no_host_memory_after_construction(
        gpu: Gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    net = make_net(gpu)
    opt = offload(net, "overlap")
    allocations: list[Any] = []
    real = gpu.accel.host_empty
    monkeypatch.setattr(gpu.accel, "host_empty",
                        lambda *a, **k: allocations.append(a) or real(*a, **k))
    for x in batches(gpu, 3):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()
    assert allocations == []  # the first step included
    sd = copy.deepcopy(opt.state_dict())
    before = {k: gpu.accel.on_device(v) or v.untyped_storage().data_ptr()
              for st in opt.state.values() for k, v in st.items() if k != "step"}
    opt.load_state_dict(sd)  # into the host state that is there: no second copy
    assert allocations == []
    after = {k: gpu.accel.on_device(v) or v.untyped_storage().data_ptr()
             for st in opt.state.values() for k, v in st.items() if k != "step"}
    assert before == after


def test_capturing_a_forward_that_must_wait_is_refused(gpu: Gpu) -> None:
    if not gpu.simulated:
        pytest.skip("capturing a real CUDA graph is exercised by the GPU suite")
    net = make_net(gpu)
    opt = offload(net, "overlap")
    opt.attach(net)
    xs = batches(gpu, 2)
    with pipeoff.testing.delay_lane("compute", 0.02):
        net(xs[0]).pow(2).mean().backward()
        opt.step()
        gpu.sim.capturing = True
        try:
            with pytest.raises(pipeoff.ConfigError, match="CUDA graph"):
                net(xs[1])
        finally:
            gpu.sim.capturing = False
        opt.wait_for_step()
