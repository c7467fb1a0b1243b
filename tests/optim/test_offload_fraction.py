"""OffloadOptimizer(offload_fraction=f): a device part stepped by torch's own kernel on the
caller's stream, a host part in pipelined chunks, bitwise torch at every fraction, in every
mode, across checkpoints saved at one fraction and loaded at another."""

from __future__ import annotations

import copy
import math
import threading
from typing import Any

import pytest
import torch
from torch import nn

import pipeoff
import pipeoff.testing
from pipeoff import ConfigError, PipeoffError, StepFailedError
from pipeoff._lowlevel import settle
from pipeoff.optim import OffloadOptimizer
from pipeoff.optim._offload._device_part import split_params
from tests._stacks import release_when_waiting
from tests.gpu_device import Gpu
from tests.optim.test_offload import OPTIMS, Net, assert_same, batches, make_net, train

MODES = ["single_pass", "chunked", "overlap"]
# Net's parameters: a.weight 320, a.bias 40, b.weight 160, b.bias 4, side.weight 32,
# side.bias 4 elements. At 0.3 the device part (first fit, in order, within 70% of the
# state) is a.weight, a.bias, b.bias, side.bias; b.weight and side.weight are the host
# part (side's get no grad on even steps).
DEVICE_AT_03 = {0, 1, 3, 5}


def _opt(net: Net, optim: str, mode: str, f: float, **kw: Any) -> OffloadOptimizer:
    opt = OffloadOptimizer(OPTIMS[optim](net), mode=mode, chunk_bytes=600,  # type: ignore[arg-type]
                           offload_fraction=f, **kw)
    opt.attach(net)
    return opt


def _sched(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


@pytest.mark.parametrize("optim", ["adamw", "adamw_fused", "adamw_amsgrad_foreach",
                                   "sgd_momentum"])
@pytest.mark.parametrize(("saved_at", "loaded_at"), [(0.0, 0.3), (0.3, 1.0), (1.0, 0.0)])
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_at_every_fraction_across_a_resume_at_another(
        mode: str, saved_at: float, loaded_at: float, optim: str) -> None:
    """3 steps at one fraction, a checkpoint, 2 more at another (a resumed job whose
    fraction changed): bitwise the wrapped optimizer's 5 steps, parameters and state."""
    xs = batches(5)
    ref_net = make_net()
    ref_opt = OPTIMS[optim](ref_net)
    ref_sched = _sched(ref_opt)
    ref_out = train(ref_net, ref_opt, ref_sched, xs)

    net = make_net()
    opt = _opt(net, optim, mode, saved_at)
    sched = _sched(opt)
    out = train(net, opt, sched, xs[:3])
    sd = copy.deepcopy(opt.state_dict())
    net2 = make_net()
    net2.load_state_dict(net.state_dict())
    opt2 = _opt(net2, optim, mode, loaded_at)
    opt2.load_state_dict(sd)
    sched2 = _sched(opt2)
    sched2.load_state_dict(sched.state_dict())
    out += train(net2, opt2, sched2, xs[3:], first=3)
    for a, b in zip(ref_out, out):
        assert torch.equal(a, b)
    assert_same(ref_net, ref_opt, net2, opt2)


def test_the_state_dict_does_not_depend_on_the_fraction_and_loads_into_torch() -> None:
    """The same training at 0, 0.3 and 1 gives the same state dict (keys, groups, values);
    one saved at 0.3 loads into plain torch AdamW, which goes on bitwise."""
    xs = batches(5)
    sds = []
    for f in (0.0, 0.3, 1.0):
        net = make_net()
        opt = _opt(net, "adamw", "overlap", f)
        sched = _sched(opt)
        train(net, opt, sched, xs[:3])
        sds.append((opt.state_dict(), net.state_dict(), sched.state_dict()))
    (a, _, _), *others = sds
    for b, _, _ in others:
        assert a["param_groups"] == b["param_groups"]
        assert list(a["state"]) == list(b["state"])  # in torch's order (a tester's find)
        for pid, st in a["state"].items():
            assert st.keys() == b["state"][pid].keys()
            for k, v in st.items():
                assert torch.equal(v, b["state"][pid][k]), (pid, k)
    ref_net = make_net()
    ref_opt = OPTIMS["adamw"](ref_net)
    ref_sched = _sched(ref_opt)
    train(ref_net, ref_opt, ref_sched, xs)
    sd, model_sd, sched_sd = sds[1]
    net = make_net()
    net.load_state_dict(model_sd)
    plain = OPTIMS["adamw"](net)
    plain.load_state_dict(copy.deepcopy(sd))
    sched = _sched(plain)
    sched.load_state_dict(sched_sd)
    assert list(sd["state"]) == list(ref_opt.state_dict()["state"])
    train(net, plain, sched, xs[3:], first=3)
    assert_same(ref_net, ref_opt, net, plain)


def test_the_split_takes_parameters_in_order_within_the_device_share() -> None:
    weights = [320, 40, 160, 4, 32, 4]
    assert split_params(weights, 1.0).on_device == frozenset()
    assert split_params(weights, 0.0).on_device == frozenset(range(6))
    s = split_params(weights, 0.3)
    assert s.on_device == DEVICE_AT_03
    assert s.device_weight <= 0.7 * sum(weights)
    for f in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):  # the device part never exceeds 1 - f
        assert split_params(weights, f).device_weight <= (1 - f) * sum(weights)
    assert split_params([0, 8, 0], 0.99).on_device == {0, 2}  # zero bytes fit anywhere...
    assert split_params([0, 8, 0], 1.0).on_device == frozenset()  # ...but not at 1.0
    net = make_net()
    opt = _opt(net, "adamw", "chunked", 0.3)
    assert {s.param for c in opt.plan.chunks for s in c.segments} == {2, 4}


@pytest.mark.parametrize("f", [0.0, 0.3, 1.0])
def test_memory_stats_say_where_the_state_is(f: float) -> None:
    net = make_net()
    opt = _opt(net, "adamw", "overlap", f)
    elems = [p.numel() for p in net.parameters()]
    dev = set(range(6)) if f == 0.0 else DEVICE_AT_03 if f == 0.3 else set()
    host_bytes = sum(8 * n for i, n in enumerate(elems) if i not in dev)
    dev_bytes = sum(8 * n for i, n in enumerate(elems) if i in dev)
    before = opt.memory_stats()  # reserved host memory counts (no step has run)
    assert before["state_bytes_host"] == host_bytes and before["state_bytes_device"] == 0
    assert (before["params_host"], before["params_device"]) == (6 - len(dev), len(dev))
    train(net, opt, _sched(opt), batches(2))
    stats = opt.memory_stats()
    steps = 4 * len(elems)  # torch's CPU 'step' scalars: with their part on a CPU machine
    assert stats["state_bytes_host"] + stats["state_bytes_device"] == 8 * sum(elems) + steps
    assert stats["state_bytes_device"] == dev_bytes + 4 * len(dev)
    for i, p in enumerate(net.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][k].is_pinned() == (i not in dev and opt.pin_memory)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, True, False, "0.5", None,
                                 [0.5]])
def test_a_bad_fraction_names_offload_fraction_and_what_is_accepted(bad: Any) -> None:
    net = make_net()
    with pytest.raises(ConfigError, match=r"offload_fraction must be a number in \[0, 1\]"):
        OffloadOptimizer(torch.optim.AdamW(net.parameters()), offload_fraction=bad)


def test_a_fraction_is_a_config_error() -> None:
    assert issubclass(ConfigError, PipeoffError)
    opt = OffloadOptimizer(torch.optim.AdamW(make_net().parameters()), offload_fraction=0)
    assert opt.offload_fraction == 0.0 and "offload_fraction=0, " in repr(opt)
    assert opt.offload_choice is None


def test_the_device_part_steps_while_the_host_part_is_held() -> None:
    """A chunked step at 0.3: the device part is stepped on the caller's thread while the
    host part's first chunk is held, and step() returns once both parts have run."""
    xs = batches(2)
    ref_net = make_net()
    ref_opt = OPTIMS["adamw"](ref_net)
    train(ref_net, ref_opt, _sched(ref_opt), xs)
    net = make_net()
    opt = _opt(net, "adamw", "chunked", 0.3)
    train(net, opt, _sched(opt), xs[:1])
    ps = list(net.parameters())
    seen: dict[int, torch.Tensor] = {}
    with pipeoff.testing.hold_task("opt0") as release:
        net(xs[1], 1).pow(2).mean().backward()
        gate = threading.Event()
        watcher = release_when_waiting(gate, "_step", "wait_for_step")

        def snapshot() -> None:  # when step() waits for the host part, before its chunks
            gate.wait()
            seen.update({i: ps[i].detach().clone() for i in range(6)})
            release.set()

        snap = threading.Thread(target=snapshot, daemon=True)
        snap.start()
        opt.step()
        watcher.join()
        snap.join()
    refs = list(ref_net.parameters())
    for i in range(6):
        assert torch.equal(ps[i], refs[i]), i  # both parts, once step() returned
        # While the host part was held, the device part had already stepped.
        assert torch.equal(seen[i], refs[i]) == (i in DEVICE_AT_03), i


@pytest.mark.parametrize("mutated", [False, True])
def test_a_device_part_failure_is_reported_after_the_host_part(mutated: bool) -> None:
    """The device part fails (before writing) while the host part's chunk is held: the
    step waits for the host part, whose chunks then write, so the step is torn, and says
    so. Without the join it would call the step retryable while chunks still write."""
    net = make_net()
    opt = _opt(net, "adamw", "chunked", 0.3)
    x = batches(1)[0]
    net(x, 1).pow(2).mean().backward()
    switch = (pipeoff.testing.disable("host_part_join") if mutated
              else pipeoff.testing.fail_task("no such task"))
    with switch, pipeoff.testing.hold_task("opt0") as release, \
            pipeoff.testing.fail_task("device_part", RuntimeError("device part down")):
        watcher = release_when_waiting(release, "_step", "device_failed")
        with pytest.raises(RuntimeError, match="device part down") as info:
            opt.step()
        release.set()
        watcher.join()
    note = "\n".join(getattr(info.value, "__notes__", []))
    if mutated:  # reported while the host part was held: "retry" (a double step)
        assert "can be retried" in note
        assert opt.last_execution is not None
        settle(opt.last_execution)  # (its chunks fail: the step had dropped their grads)
        return
    assert "'device_part' after chunk(s) 0-" in note and "Load a checkpoint" in note, note
    with pytest.raises(StepFailedError, match="device_part"):
        opt.step()


def test_a_device_part_failing_before_it_wrote_with_no_host_part_can_be_retried() -> None:
    xs = batches(1)
    ref_net = make_net()
    ref_opt = OPTIMS["adamw"](ref_net)
    ref_net(xs[0], 0).pow(2).mean().backward()
    ref_opt.step()
    net = make_net()
    opt = _opt(net, "adamw", "overlap", 0.0)
    net(xs[0], 0).pow(2).mean().backward()
    with pipeoff.testing.fail_task("device_part"), pytest.raises(RuntimeError) as info:
        opt.step()
    assert "can be retried" in "\n".join(info.value.__notes__)
    opt.step()
    opt.zero_grad()
    assert_same(ref_net, ref_opt, net, opt)


@pytest.mark.parametrize("where", ["device_part", "h2d0"])
def test_a_failure_after_the_device_part_wrote_is_torn(where: str) -> None:
    """The device part wrote its parameters: a failure inside it (after its kernels), or
    in the host part before any chunk wrote, leaves the step torn."""
    net = make_net()
    opt = _opt(net, "adamw", "chunked", 0.3)
    net(batches(1)[0], 1).pow(2).mean().backward()
    fail = (pipeoff.testing.fail_work if where == "device_part" else pipeoff.testing.fail_task)
    with fail(where), pytest.raises(RuntimeError) as info:
        opt.step()
    assert "the device part (stepped on the caller's stream)" in "\n".join(info.value.__notes__)
    with pytest.raises(StepFailedError):
        opt.state_dict()


def test_overlap_forward_waits_only_for_the_host_part() -> None:
    """At 0.3 the next forward of a device-part module does not wait (torch's kernel ran
    on the caller's stream before step() returned), while a host-part parameter's read
    waits for its chunk: held here until then."""
    xs = batches(3)
    ref_net = make_net()
    ref_opt = OPTIMS["adamw"](ref_net)
    train(ref_net, ref_opt, _sched(ref_opt), xs[:2])
    net = make_net()
    opt = _opt(net, "adamw", "overlap", 0.3)
    train(net, opt, _sched(opt), xs[:1])
    opt.wait_for_step()
    net(xs[1], 1).pow(2).mean().backward()
    with pipeoff.testing.hold_task("opt0") as release:
        opt.step()
        watcher = release_when_waiting(release, "wait_for")
        h = net.a(xs[2])  # all of a is in the device part: no wait
        waited_for_a = release.is_set()
        y = net.b(torch.relu(h))  # b.weight is in the host part: waits for opt0
        watcher.join()
    assert not waited_for_a and release.is_set()
    assert torch.equal(y, ref_net.b(torch.relu(ref_net.a(xs[2]))))
    opt.wait_for_step()
    trace = opt.last_trace
    assert trace is not None
    waits = [t.name for t in trace.tasks if t.name.startswith("hook_wait")]
    assert waits and all(not w.endswith(":a") for w in waits), waits


def test_a_device_part_parameter_has_no_host_state_to_transfer() -> None:
    net = make_net()
    opt = _opt(net, "adamw", "chunked", 0.3)
    train(net, opt, _sched(opt), batches(1))
    with pytest.raises(ConfigError, match="is in the device part"):
        opt.live_state(net.a.weight, "exp_avg")
    host, _ = opt.live_state(net.b.weight, "exp_avg")
    assert torch.equal(host, opt.state[net.b.weight]["exp_avg"])


# -- on the simulated CUDA device (and a GPU) ---------------------------------------------
def _device_net(gpu: Gpu) -> nn.Module:
    torch.manual_seed(0)
    net = gpu.module(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64),
                                   nn.GELU(), nn.Linear(64, 8)))
    # The simulated device runs the in-place init (uniform_) later, on its stream:
    # let it draw its numbers before the next seed.
    gpu.synchronize()
    return net


def _device_train(gpu: Gpu, net: nn.Module, opt: torch.optim.Optimizer, n: int,
                  sched: Any = None, first: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [gpu.tensor(torch.randn(16, 32, generator=g)) for _ in range(first + n)][first:]
    if sched is None:
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


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("f", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_on_the_device_at_every_fraction(gpu: Gpu, mode: str, f: float,
                                                 impl: str) -> None:
    """On CUDA streams (the simulated device checks every access's order): bitwise torch,
    across a checkpoint loaded at another fraction (state moving between device and
    host memory); the device part's state in device memory, the host part's pinned."""
    kw: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1, "amsgrad": True, impl: True}
    ref = _device_net(gpu)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    ref_out = _device_train(gpu, ref, ref_opt, 4)
    net = _device_net(gpu)
    before = {0.0: 1.0, 0.3: 0.0, 1.0: 0.3}[f]  # the first two steps' fraction
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), **kw), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=4096, offload_fraction=before)
    opt.attach(net)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    out = _device_train(gpu, net, opt, 2, sched)
    sd = opt.state_dict()  # after the step in flight
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), **kw), mode=mode,  # type: ignore[arg-type]
                           chunk_bytes=4096, offload_fraction=f)
    opt.load_state_dict(sd)
    opt.attach(net)
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    sched2.load_state_dict(sched.state_dict())
    out += _device_train(gpu, net, opt, 2, sched2, first=2)
    opt.wait_for_step()
    gpu.synchronize()
    for a, b in zip(ref_out, out):
        assert torch.equal(gpu.read(a), gpu.read(b))
    dev = opt._host.layout.split.on_device
    assert (len(dev) == 0) == (f == 1.0) and (len(dev) == 6) == (f == 0.0)
    for i, (p, q) in enumerate(zip(ref.parameters(), net.parameters())):
        assert torch.equal(gpu.read(p), gpu.read(q))
        for k, v in ref_opt.state[p].items():
            w = opt.state[q][k]
            if k != "step":
                assert gpu.accel.on_device(w) == (i in dev), (i, k)
                assert gpu.accel.is_pinned(w) == (i not in dev), (i, k)
            assert torch.equal(gpu.read(v), gpu.read(w)), k
    stats = opt.memory_stats()
    elems = [p.numel() for p in net.parameters()]
    dev_bytes = sum(3 * 4 * elems[i] for i in dev)  # amsgrad: 3 fp32 tensors each
    steps = 4 * len(elems)  # 'step' scalars: in device memory on the simulated device
    assert dev_bytes <= stats["state_bytes_device"] <= dev_bytes + steps
    assert stats["state_bytes_host"] + stats["state_bytes_device"] == 3 * 4 * sum(elems) + steps


@pytest.mark.parametrize("mutated", [False, True])
def test_a_reader_off_the_callers_stream_waits_for_the_device_part(gpu: Gpu,
                                                                   mutated: bool) -> None:
    """After a chunked step at 0.3, a stream of its own reads a device-part parameter and
    its state: the step's join made the host wait for the device part's kernels on the
    caller's stream. Without that wait the read races them."""
    if not gpu.simulated:
        pytest.skip("a real GPU shows the race only by timing luck")
    net = _device_net(gpu)
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), mode="chunked",
                           chunk_bytes=4096, offload_fraction=0.3)
    _device_train(gpu, net, opt, 1)
    first = next(iter(net.parameters()))
    assert 0 in opt._host.layout.split.on_device
    side = gpu.accel.new_stream(gpu.device, name="reader")
    got: list[torch.Tensor] = []
    switch = (pipeoff.testing.disable("device_part_wait") if mutated
              else pipeoff.testing.fail_task("no such task"))
    g = torch.Generator().manual_seed(2)
    x = gpu.tensor(torch.randn(16, 32, generator=g))

    def read() -> None:
        got.extend([first.detach().clone(), opt.inner.state[first]["exp_avg"].clone()])

    with switch:
        net(x).pow(2).mean().backward()
        opt.step()  # chunked: returns after the join
        if mutated:
            with pytest.raises(pipeoff.testing.DataRaceError):
                gpu.accel.launch(side, read)
                gpu.synchronize()
            return
        gpu.accel.launch(side, read)
        gpu.synchronize()
    assert torch.equal(got[0], first.detach())


@pytest.mark.parametrize("f", [0.0, 0.3])
def test_fsdp_all_gathers_of_the_device_part_wait_for_it(gpu: Gpu, f: float) -> None:
    """FSDP2's root makes its all-gather streams wait only for the post-optimizer event an
    overlap step records: recorded after the device part's kernels, the all-gathers of
    its shards (no forward hook waits for them) read them stepped."""
    if not gpu.simulated:
        pytest.skip("the FSDP2 stub runs on the simulated device")
    from tests.optim.test_optim_cuda import _fsdp_stub, batches, make_net, train

    results = []
    for mode in ("chunked", "overlap"):
        net = make_net(gpu)
        _fsdp_stub(gpu, net, post_optim=True)  # type: ignore[arg-type]
        opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), mode=mode,  # type: ignore[arg-type]
                               chunk_bytes=4096, read_guard=False, offload_fraction=f)
        opt.attach(net)
        outs = train(net, opt, batches(gpu, 3))
        opt.wait_for_step()
        results.append([gpu.read(o) for o in outs])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("mode", MODES)
def test_the_split_follows_the_live_param_groups(gpu: Gpu, mode: str) -> None:
    """A group added mid-run grows the state: the next step re-splits, and the first
    layer's state, in host memory while it was most of the state, moves to the device
    (it now fits in the device part); bitwise torch throughout."""
    ref, net = _device_net(gpu), _device_net(gpu)
    ref_opt = torch.optim.AdamW(list(ref[0].parameters()), lr=1e-3)
    opt = OffloadOptimizer(torch.optim.AdamW(list(net[0].parameters()), lr=1e-3),  # type: ignore[arg-type]
                           mode=mode, chunk_bytes=4096, offload_fraction=0.3)
    opt.attach(net)
    g = torch.Generator().manual_seed(1)
    xs = [gpu.tensor(torch.randn(16, 32, generator=g)) for _ in range(4)]
    first = net[0].weight
    for t, x in enumerate(xs):
        if t == 2:
            for m, o in ((ref, ref_opt), (net, opt)):
                o.add_param_group({"params": [*m[2].parameters(), *m[4].parameters()]})
        for m, o in ((ref, ref_opt), (net, opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        if t in (1, 3):
            opt.wait_for_step()
            assert gpu.accel.on_device(opt.state[first]["exp_avg"]) == (t == 3)
    opt.wait_for_step()
    for p, q in zip(ref.parameters(), net.parameters()):
        assert torch.equal(gpu.read(p), gpu.read(q))
