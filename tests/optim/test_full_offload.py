"""FullOffloadOptimizer (issue 13): bitwise against the plain reference, lanes delayed,
waits removed, failures, checkpoints, refusals."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pipeoff
from pipeoff import ConfigError, GradientError, StepFailedError, StepTimeoutError, testing
from pipeoff.optim import FullOffloadOptimizer, HostGrad
from pipeoff.optim._full_offload import _accumulate, _intake
from pipeoff.optim._full_offload._lifecycle import Lifecycle
from pipeoff.staging import pools_for
from tests.optim.full_reference import Reference

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

LANES = ("d2h", "accumulate", "host_step", "h2d")


class Toy(torch.nn.Module):
    """Tied embedding and head, a branch some micro-steps skip, an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.l1 = torch.nn.Linear(8, 24)
        self.l2 = torch.nn.Linear(24, 8)
        self.side = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, idx: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = self.emb(idx)
        h = self.l2(torch.relu(self.l1(h)))
        if use_side:
            h = h + self.side(h)
        return self.head(h) + self.empty.sum()


def make_model(seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    return Toy().to(torch.bfloat16)


def batches(steps: int, micro: int, side: str = "all", seed: int = 1) -> list[list[Any]]:
    """Per step, per micro-step ``(idx, target, use_side)``. ``side``: ``"all"``,
    ``"not_final"`` (no gradient for ``side`` in the final micro-step) or ``"never"``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for m in range(micro):
            use = side == "all" or (side == "not_final" and m < micro - 1)
            step.append((torch.randint(0, 11, (3, 5), generator=gen),
                         torch.randint(0, 11, (3, 5), generator=gen), use))
        out.append(step)
    return out


def loss_fn(model: torch.nn.Module, b: Any, scale: float = 1.0) -> torch.Tensor:
    idx, tgt, use = b
    logits = model(idx, use)
    return F.cross_entropy(logits.float().reshape(-1, 11), tgt.reshape(-1)) * scale


def train(opt: FullOffloadOptimizer, model: torch.nn.Module, data: list[list[Any]], *,
          scale: float = 1.0, scheduler: Any = None) -> None:
    for step in data:
        for m, b in enumerate(step):
            ctx = opt.no_sync() if m < len(step) - 1 else contextlib.nullcontext()
            with ctx:
                loss_fn(model, b, scale).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    opt.wait_for_step()


def train_reference(ref: Reference, data: list[list[Any]], *, scale: float = 1.0,
                    scheduler: Any = None) -> None:
    for step in data:
        for b in step:
            ref.micro_step(lambda m, b=b: loss_fn(m, b, scale))
        ref.step()
        if scheduler is not None:
            scheduler.step()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


def assert_bitwise(model: torch.nn.Module, ref: Reference) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters()):
        assert same_bits(p, q), (
            f"{name}: max diff {(p.detach().float() - q.detach().float()).abs().max()}")


def differs(model: torch.nn.Module, ref: Reference) -> bool:
    return any(not same_bits(p, q) for p, q in zip(model.parameters(), ref.model.parameters()))


def build(model: torch.nn.Module, **kw: Any) -> FullOffloadOptimizer:
    defaults = {"lr": 1e-2, "weight_decay": 0.1}
    defaults.update(kw)
    return FullOffloadOptimizer(model, torch.optim.AdamW, **defaults)


def reference(model: torch.nn.Module, **kw: Any) -> Reference:
    defaults: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    defaults.update(kw)
    return Reference(model, torch.optim.AdamW, **defaults)


# -- exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("micro", [1, 2, 3, 5])
@pytest.mark.parametrize("overlap", ["none", "backward", "forward"])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_bitwise_equal_to_the_reference(accumulate: str, overlap: str, micro: int) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, accumulate=accumulate, overlap=overlap)
    data = batches(3, micro)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert opt._registry.outside_writes == 0  # its own writes are never taken for outside ones
    # The host state is the reference optimizer's, bit for bit.
    sd = opt.state_dict()["state"]
    ref_params = [ref.masters[id(p)] for p in ref.params]
    for k, m in enumerate(ref_params):
        if m not in ref.opt.state:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(sd[k][key], ref.opt.state[m][key]), key
        assert same_bits(sd[k]["master"], m)
        assert float(sd[k]["step"]) == float(ref.opt.state[m]["step"])


@pytest.mark.parametrize("side", ["not_final", "never"])
@pytest.mark.parametrize("overlap", ["none", "backward", "forward"])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_parameters_without_a_gradient_in_some_micro_steps(accumulate: str, overlap: str,
                                                           side: str) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, accumulate=accumulate, overlap=overlap)
    data = batches(3, 3, side=side)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    if side == "never":  # never stepped, as torch skips a parameter without a gradient
        assert same_bits(model.side.weight, make_model().side.weight)


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    first = [model.emb.weight, model.l1.weight, model.l1.bias]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": first}, {"params": rest, "lr": 3e-3, "weight_decay": 0.0}]


@pytest.mark.parametrize("overlap", ["none", "backward", "forward"])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_two_groups_a_scheduler_amsgrad_and_a_loss_scale(accumulate: str, overlap: str) -> None:
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, groups=_groups, lr=1e-2, weight_decay=0.1,
                    amsgrad=True)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, params=_groups(model),
                               accumulate=accumulate, overlap=overlap, lr=1e-2,
                               weight_decay=0.1, amsgrad=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=1, gamma=0.5)
    data = batches(4, 3)
    train(opt, model, data, scale=1 / 3, scheduler=sched)
    train_reference(ref, data, scale=1 / 3, scheduler=ref_sched)
    assert_bitwise(model, ref)
    assert opt.param_groups[1]["lr"] == ref.opt.param_groups[1]["lr"] == 3e-3 / 16


@pytest.mark.parametrize("optimizer", ["fused_adamw", "sgd_momentum"])
def test_other_kernels(optimizer: str) -> None:
    cls, kw = ((torch.optim.AdamW, {"lr": 1e-2, "fused": True}) if optimizer == "fused_adamw"
               else (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}))
    model = make_model()
    ref = Reference(model, cls, **kw)
    opt = FullOffloadOptimizer(model, cls, overlap="backward", **kw)
    data = batches(3, 2)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_clipping_matches_clip_grad_norm(accumulate: str, overlap: str) -> None:
    model = make_model()
    ref = reference(model, max_norm=0.05)
    opt = build(model, accumulate=accumulate, overlap=overlap, max_norm=0.05)
    data = batches(3, 3, side="not_final")
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    assert opt.grad_norm is not None and float(opt.grad_norm) > 0.05  # it did clip


def test_clipping_is_refused_with_backward_overlap_and_says_why() -> None:
    with pytest.raises(ConfigError,
                       match=r"max_norm needs overlap='forward' \(the default\) or 'none'.*global"):
        build(make_model(), overlap="backward", max_norm=1.0)


def test_step_returns_after_the_clipping_norms_all_reduce(
        fake_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard: step() returning while the lane's all-reduce of the clipping norm is still
    to be issued: the caller's next collective on that group (FSDP2's all-gathers, a
    loss all-reduce) would come first, from another thread, in an order that may
    differ between ranks. A late lane must not change the order."""
    import torch.distributed as dist

    issued: list[str] = []
    real = dist.all_reduce
    caller = threading.current_thread()

    def all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        issued.append("caller" if threading.current_thread() is caller else "norm")
        return real(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    model = make_model()
    opt = build(model, overlap="forward", max_norm=0.05, process_group=fake_group)
    with testing.delay_task("norm_allreduce", 0.2):
        for step in batches(2, 1):
            loss_fn(model, step[0]).backward()
            opt.step()
            dist.all_reduce(torch.zeros(()))  # the caller's next collective
            opt.zero_grad()
    opt.wait_for_step()
    assert issued == ["norm", "caller"] * 2


@pytest.mark.parametrize("which", ["FullOffloadOptimizer", "OffloadOptimizer"])
def test_a_process_group_that_is_not_one_is_refused_naming_it(fake_group: Any,
                                                               which: str) -> None:
    """(A new user's find: process_group="x" was accepted, to fail at the first norm.)"""
    from pipeoff.optim import OffloadOptimizer

    model = make_model()
    with pytest.raises(ConfigError, match="process_group must be a "
                                          "torch.distributed.ProcessGroup .*got 'x'"):
        if which == "OffloadOptimizer":
            OffloadOptimizer(model.parameters(), torch.optim.AdamW, process_group="x")
        else:
            build(model, process_group="x")
    build(model, process_group=fake_group)  # a group passes


class _Special(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))


def test_signed_zeros_subnormals_and_infinities_keep_their_bits() -> None:
    tiny = torch.finfo(torch.bfloat16).tiny / 4  # a BF16 subnormal
    micro = [
        torch.tensor([-0.0, tiny, -tiny, 1.0, float("inf"), 0.0, -0.0, 2.0]),
        torch.tensor([-0.0, tiny, tiny, -1.0, 1.0, -0.0, 0.0, float("-inf")]),
    ]
    for accumulate in ("cpu", "gpu"):
        model = _Special()
        ref = Reference(model, torch.optim.SGD, lr=1.0)
        opt = FullOffloadOptimizer(model, torch.optim.SGD, lr=1.0, accumulate=accumulate,
                                   overlap="none")
        for k, c in enumerate(micro):
            ctx = opt.no_sync() if k == 0 else contextlib.nullcontext()
            with ctx:
                (model.w * c.to(torch.bfloat16)).sum().backward()
            ref.micro_step(lambda m, c=c: (m.w * c.to(torch.bfloat16)).sum())
        ref_acc = dict(ref.acc)
        opt.step()
        ref.step()
        assert same_bits(opt._registry[0].acc, ref_acc[id(ref.params[0])]), accumulate
        assert same_bits(model.w, ref.model.w)
    # The first contribution is copied: -0.0 stays -0.0 (0.0 + -0.0 would be +0.0).
    acc = torch.empty(2)
    _accumulate.fold(acc, torch.tensor([-0.0, tiny], dtype=torch.bfloat16), first=True)
    assert torch.signbit(acc[0]) and acc[1].item() == pytest.approx(tiny)


def test_flush_to_zero_is_refused() -> None:
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        with pytest.raises(ConfigError, match="flush-to-zero"):
            build(make_model())
    finally:
        torch.set_flush_denormal(False)


# -- waits: delayed lanes change no bit; removed waits do --------------------------------

@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("overlap", ["backward", "forward", "backward_attached"])
def test_delayed_lanes_change_no_bit(lane: str, overlap: str) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap=overlap.removesuffix("_attached"), chunk_numel=200)
    if overlap.endswith("_attached"):
        opt.attach()  # step() returns at once; forwards wait per module
    data = batches(3, 3)
    with testing.delay_lane(lane, 0.01):
        train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


def test_a_step_that_does_not_wait_for_accumulation_is_wrong() -> None:
    """Wrong either way: the weights differ, or (when a chunk writes a weight before the
    backward has used it) autograd refuses the backward."""
    model = make_model()
    ref = reference(model)
    with testing.disable("accumulate_dep"):
        opt = build(model, overlap="backward", chunk_numel=200)
        data = batches(2, 2)
        try:
            with testing.delay_lane("accumulate", 0.01):
                train(opt, model, data)
        except RuntimeError as err:
            assert "modified by an inplace operation" in str(err)
            with contextlib.suppress(Exception):
                opt.zero_grad()
            return
    train_reference(ref, data)
    assert differs(model, ref)


@pytest.mark.parametrize("mutated", [False, True])
def test_micro_steps_that_do_not_wait_for_each_other_are_wrong(mutated: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)
    ref = Reference(model, torch.optim.SGD, lr=0.1)
    # 128 pieces to fold per micro-step: the first micro-step's fold is still going
    # (its count not yet raised) when the others start, so without the order they
    # all take the first contribution's copy (a fast one-piece fold could finish
    # before the next thread wakes, and hide the hazard).
    opt = FullOffloadOptimizer(model, torch.optim.SGD, lr=0.1, overlap="none",
                               slot_bytes=1 << 14)
    xs = [torch.randn(4, 1024).to(torch.bfloat16) for _ in range(3)]
    off = testing.disable("micro_step_order") if mutated else contextlib.nullcontext()
    with off, testing.hold_task("acc:.*") as release:
        # Every micro-step's additions are held back, then released at once.
        for k, x in enumerate(xs):
            with opt.no_sync() if k < 2 else contextlib.nullcontext():
                model(x).float().square().mean().backward()
        release.set()
        opt.step()
    opt.zero_grad()
    for x in xs:
        ref.micro_step(lambda m, x=x: m(x).float().square().mean())
    ref.step()
    assert (not same_bits(model.weight, ref.model.weight)) == mutated


# -- memory ------------------------------------------------------------------------------

def test_the_slot_ring_stays_within_its_budget_and_allocates_nothing_after_the_first_step(
) -> None:
    model = make_model()
    opt = build(model, overlap="backward", slot_bytes=256, slots=2, chunk_numel=200)
    assert opt.host_budget_bytes < 2 * 4 * sum(p.numel() for p in model.parameters())
    pool = pools_for(torch.device("cpu")).host
    data = batches(3, 2)
    train(opt, model, data[:1])
    after_first = pool.stats().allocations
    peaks = []
    for step in data[1:]:
        train(opt, model, [step])
        peaks.append(opt.last_trace.summary().peak_host_staging_bytes)
    assert pool.stats().allocations == after_first
    assert 0 < max(peaks) <= opt.host_budget_bytes


def test_no_gradient_stays_on_the_parameters() -> None:
    model = make_model()
    opt = build(model, overlap="backward")
    with opt.no_sync():
        loss_fn(model, batches(1, 1)[0][0]).backward()
    # No gradient stays on the device: .grad is None, or a storage-less HostGrad
    # standing for the host sum.
    assert all(p.grad is None or isinstance(p.grad, HostGrad) for p in model.parameters())
    opt.zero_grad()


# -- checkpoints -------------------------------------------------------------------------

@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(accumulate: str,
                                                         tmp_path: Path) -> None:
    data = batches(4, 2)
    whole = make_model()
    opt = build(whole, accumulate=accumulate, params=_groups(whole))
    train(opt, whole, data)

    first = make_model()
    opt1 = build(first, accumulate=accumulate, params=_groups(first))
    train(opt1, first, data[:2])
    opt1.param_groups[1]["lr"] = 3e-3  # unchanged value, but a group setting to restore
    opt1.param_groups[0]["betas"] = (0.9, 0.999)
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ck.pt")

    second = make_model(seed=5)  # other weights: the checkpoint must bring them back
    opt2 = build(second, accumulate=accumulate, params=_groups(second), lr=0.5)
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    second.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[1]["lr"] == 3e-3
    assert float(opt2.state_dict()["state"][0]["step"]) == 2.0  # loading never steps
    train(opt2, second, data[2:])
    for p, q in zip(whole.parameters(), second.parameters()):
        assert same_bits(p, q)


def _clamp(model: torch.nn.Module) -> None:
    with torch.no_grad():  # (weight clipping after each step, as WGAN's loop does)
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("fraction", [1.0, 0.3])
@pytest.mark.parametrize("overlap", ["forward", "none", "backward"])
def test_a_checkpoint_after_the_loop_wrote_the_weights_holds_the_write(
        overlap: str, fraction: float) -> None:
    """Weights the loop wrote after a step (a clamp) become the masters the next step
    starts from; a checkpoint taken before that step holds them too. It held the old
    masters, and a resume (which writes every weight from its master) silently dropped
    the write: 8e-3 off two steps later."""
    data = batches(4, 2)
    whole = make_model()
    opt = build(whole, overlap=overlap, offload_fraction=fraction)
    saved: dict[str, Any] = {}
    for k, step in enumerate(data):
        train(opt, whole, [step])
        _clamp(whole)
        if k == 1:
            opt.wait_for_step()
            saved = copy.deepcopy({"model": whole.state_dict(), "opt": opt.state_dict()})
    opt.wait_for_step()

    second = make_model(seed=5)
    second.load_state_dict(saved["model"])
    opt2 = build(second, overlap=overlap, offload_fraction=fraction)
    opt2.load_state_dict(saved["opt"])
    assert all(same_bits(a, b) for a, b in zip(second.state_dict().values(),
                                               saved["model"].values()))
    for step in data[2:]:
        train(opt2, second, [step])
        _clamp(second)
    opt2.wait_for_step()
    for p, q in zip(whole.parameters(), second.parameters()):
        assert same_bits(p, q)


def test_loading_state_from_a_plain_optimizer_takes_masters_from_the_weights() -> None:
    model = make_model()
    plain = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2)
    opt = build(model)
    opt.load_state_dict(plain.state_dict())  # no state yet: nothing to load, nothing stepped
    assert opt.state_dict()["state"] == {}



def test_a_state_dict_of_another_optimizer_class_is_refused() -> None:
    """An SGD checkpoint loaded into FullOffloadOptimizer(AdamW): torch's AdamW loads it
    and fails at the next step (KeyError 'betas'); this one stepped on with its own
    betas and the checkpoint's lr (a tester's find). Refused, naming what is missing;
    an older checkpoint without a flag torch fills in (foreach, fused...) still loads."""
    model = make_model()
    opt = build(model)
    before = copy.deepcopy(opt.state_dict())
    sgd = torch.optim.SGD(list(model.parameters()), lr=0.1, momentum=0.9)
    with pytest.raises(ConfigError, match="param group 0 of the state dict has no 'betas', "
                                          "'eps'.*nothing was loaded"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["lr"] == before["param_groups"][0]["lr"]
    assert "momentum" not in opt.param_groups[0]
    old = torch.optim.AdamW(list(model.parameters()), lr=1e-2).state_dict()
    for group in old["param_groups"]:
        del group["foreach"], group["fused"], group["decoupled_weight_decay"]
    opt.load_state_dict(old)




@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_an_adam_checkpoint_loads_into_adamw_as_torchs_does(fraction: float) -> None:
    """torch's AdamW forces decoupled_weight_decay=True over an Adam checkpoint's False
    when it loads it (its __setstate__); kept, the step decayed as Adam's L2 term, 2.5e-2
    off torch (a tester's find). The loaded groups are torch's, and so are the steps."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(8, 4)
    adam = torch.optim.Adam(src.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        src(x).pow(2).mean().backward()
        adam.step()
        adam.zero_grad()
    runs = []
    for ours in (False, True):
        m = copy.deepcopy(src)
        opt: Any = (FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-3, offload_fraction=fraction)
                    if ours else torch.optim.AdamW(m.parameters(), lr=1e-3))
        opt.load_state_dict(copy.deepcopy(adam.state_dict()))
        assert opt.param_groups[0]["decoupled_weight_decay"] is True
        for _ in range(2):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if ours:
            opt.wait_for_step()
        runs.append(list(m.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_a_round_trip_through_bf16_between_steps_is_a_write_to_the_weights(
        overlap: str) -> None:
    """``model.to(bfloat16)`` for an evaluation, then back to FP32: the weights are the
    rounded values now, as under torch (whose AdamW steps them). ``param.data = t``
    bumps no version counter, and the allocator may hand the first cast's freed block
    back to the second: the optimizer stepped its unrounded masters, 1e-3 off torch
    (a tester's find). The round trip is now a write, adopted at the next step."""
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 8))

    model, ref = make(), make()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(16, 64, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
            m.to(torch.bfloat16)
            with torch.no_grad():
                m(x.bfloat16())
            m.to(torch.float32)
    opt.wait_for_step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


# -- failures ----------------------------------------------------------------------------

def _micro_steps(opt: FullOffloadOptimizer, model: torch.nn.Module, step: Sequence[Any]) -> None:
    for m, b in enumerate(step):
        ctx = opt.no_sync() if m < len(step) - 1 else contextlib.nullcontext()
        with ctx:
            loss_fn(model, b).backward()


def _fail_last_copy(opt: FullOffloadOptimizer, model: torch.nn.Module,
                    step: Sequence[Any]) -> None:
    """A step whose last chunk's weight copy fails: every master stepped, the weights
    stale."""
    last = len(opt._registry.plan.chunks) - 1
    with testing.fail_task(f"h2d:{last}", RuntimeError("h2d failed")):
        _micro_steps(opt, model, step)
        with pytest.raises(RuntimeError, match="h2d failed"):
            opt.step()


@pytest.mark.parametrize("task", ["acc:.*", "d2h:.*"])
def test_a_failed_copy_or_add_makes_the_step_dirty_until_zero_grad(task: str) -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap="none")
    data = batches(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with testing.fail_work(task, RuntimeError("copy failed")):
        _micro_steps(opt, model, data[0])
        with pytest.raises(BaseException, match="copy failed|refuses until"):
            opt.step()
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), before))  # nothing written
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    train(opt, model, data[1:])
    train_reference(ref, data[1:])
    assert_bitwise(model, ref)


@pytest.mark.parametrize("earlier", ["ended", "running"])
@pytest.mark.parametrize("task", ["acc:.*", "d2h:.*"])
def test_a_failed_earlier_micro_step_under_overlap_backward_steps_nothing(
        task: str, earlier: str) -> None:
    """Under overlap="backward" the final backward steps the chunks: after a failed copy
    in the first of three micro-steps, it stepped them on the later two micro-steps'
    gradients alone, a torn step no zero_grad() clears (a tester's find): that
    micro-step had ended when the next one launched (``ended``), which then ran free.
    Now a micro-step launched after an earlier one of its step failed fails at once;
    one launched while it runs (``running``: its failing task held back by a delay)
    fails with it, as before. Dirty, nothing written, zero_grad() goes on."""
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap="backward")
    data = batches(3, 3)
    train(opt, model, data[:1])
    masters = [opt.host_master(p).clone() for p in model.parameters()]
    delay = testing.delay_task(task, 0.5) if earlier == "running" else contextlib.nullcontext()
    with opt.no_sync(), testing.fail_task(task, RuntimeError("copy failed")), delay:
        loss_fn(model, data[1][0]).backward()
    if earlier == "ended":
        acc = opt._lifecycle.acc
        assert acc is not None and acc.micro[0].execution is not None
        with contextlib.suppress(RuntimeError):
            acc.micro[0].execution.wait()
    with opt.no_sync():
        loss_fn(model, data[1][1]).backward()
    loss_fn(model, data[1][2]).backward()  # the final: its chunks step during it
    acc = opt._lifecycle.acc
    assert acc is not None and acc.final is not None and acc.final.execution is not None
    with contextlib.suppress(Exception):
        acc.final.execution.wait()  # (its chunks have stepped, or refused, before step())
    with pytest.raises(BaseException, match="copy failed|refuses until"):
        opt.step()
    assert all(torch.equal(m, opt.host_master(p))
               for m, p in zip(masters, model.parameters(), strict=True))
    assert opt.health.torn is None
    opt.zero_grad()
    train(opt, model, data[2:])
    train_reference(ref, [data[0], data[2]])
    assert_bitwise(model, ref)


def test_a_failed_chunk_after_others_stepped_is_a_torn_step() -> None:
    model = make_model()
    opt = build(model, overlap="none", chunk_numel=200)
    assert len(opt._registry.plan.chunks) > 2
    data = batches(2, 1)
    saved = (copy.deepcopy(model.state_dict()), opt.state_dict())
    with testing.fail_work("step:1", RuntimeError("chunk failed")):
        _micro_steps(opt, model, data[0])
        with pytest.raises(RuntimeError, match="chunk failed") as info:
            opt.step()
    # Chunk 1 too: the failure was injected after its work had stepped its masters.
    assert any("chunk(s) [0, 1]" in n for n in info.value.__notes__)
    opt.zero_grad()
    with pytest.raises(StepFailedError, match="checkpoint"):
        _micro_steps(opt, model, data[1])
        opt.step()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    opt.zero_grad()
    train(opt, model, data[1:])


def _weights_behind_masters(opt: FullOffloadOptimizer) -> bool:
    """Whether some device weight is not its master's cast (a failed copy's drift)."""
    return any(not same_bits(p.detach(), opt.host_master(p).to(p.dtype))
               for p in (rec.param for rec in opt._registry))


def test_a_failed_h2d_leaves_the_masters_as_the_truth() -> None:
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap="none", chunk_numel=200)
    data = batches(2, 1)
    last = len(opt._registry.plan.chunks) - 1  # every chunk has stepped its masters by then
    # The copy fails before it runs (fail_work's default raises after it ran: no drift).
    with testing.fail_task(f"h2d:{last}", RuntimeError("h2d failed")):
        _micro_steps(opt, model, data[0])
        with pytest.raises(RuntimeError, match="h2d failed") as info:
            opt.step()
    assert any("refresh_device_weights" in n for n in info.value.__notes__)
    assert _weights_behind_masters(opt)  # the drift is real
    opt.zero_grad()
    with pytest.raises(StepFailedError, match="refresh_device_weights"):
        opt.step()
    # Adopting the stale weights as masters would lose the step (a tester's find).
    with pytest.raises(StepFailedError, match=r"refresh_masters\(\) refused.*stale"):
        opt.refresh_masters()
    opt.refresh_device_weights()
    assert not _weights_behind_masters(opt)
    train_reference(ref, data[:1])
    assert_bitwise(model, ref)
    train(opt, model, data[1:])
    train_reference(ref, data[1:])
    assert_bitwise(model, ref)


@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_backward_on_stale_weights_steps_nothing(overlap: str) -> None:
    """The loop goes on after a failed copy without refresh_device_weights(): under
    overlap="backward" the next final backward stepped the masters with gradients of
    the stale weights, and step() refused only after (a tester's find: 1.7e-2 off once
    the loop followed each error's advice). Those gradients are dropped, under every
    overlap: step() refuses (stale, then dirty until zero_grad())."""
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap=overlap, chunk_numel=200)
    data = batches(4, 2)
    _fail_last_copy(opt, model, data[0])
    opt.zero_grad()
    masters = [opt.host_master(p).clone() for p in model.parameters()]
    _micro_steps(opt, model, data[1])  # on the stale weights
    assert all(torch.equal(m, opt.host_master(p))
               for m, p in zip(masters, model.parameters(), strict=True))
    with pytest.raises(StepFailedError, match="stale"):
        opt.step()
    opt.refresh_device_weights()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()  # (its gradients came from the stale weights)
    opt.zero_grad()
    train_reference(ref, data[:1])  # (the failed step had stepped every master)
    train(opt, model, data[2:])
    train_reference(ref, data[2:])
    assert_bitwise(model, ref)


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("then", ["backward", "refresh_device_weights", "adopt_outside_writes"])
def test_weights_written_while_stale_are_neither_adopted_nor_overwritten(
        overlap: str, then: str) -> None:
    """After a failed copy the loop clamps its weights (as after every step): the next
    backward adopted the clamped stale weights as masters (the step they missed lost),
    or refresh_device_weights() undid the clamp, and the loop trained on 2.5e-2 off (a
    tester's find). Neither write nor step can be kept: the state is torn (nothing
    adopted, nothing overwritten), and a checkpoint's load goes on bitwise."""
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap=overlap, chunk_numel=200)
    data = batches(4, 2)
    train(opt, model, data[:1])
    opt.wait_for_step()
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _fail_last_copy(opt, model, data[1])
    opt.zero_grad()
    masters = [opt.host_master(p).clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.1, 0.1)
    if then == "backward":
        _micro_steps(opt, model, data[2])  # (the first gradient adopts outside writes)
    refused = opt.step if then == "backward" else getattr(opt, then)
    with pytest.raises(StepFailedError, match="written from outside while the device weights "
                                              "were stale"):
        refused()
    assert all(torch.equal(m, opt.host_master(p))
               for m, p in zip(masters, model.parameters(), strict=True))
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    opt.zero_grad()
    train(opt, model, data[2:])
    train_reference(ref, [data[0], *data[2:]])
    assert_bitwise(model, ref)


@pytest.mark.parametrize("order", ["optimizer_first", "model_first"])
@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_checkpoint_loaded_after_a_clamp_resumes_bitwise_in_either_order(
        overlap: str, order: str) -> None:
    """The loop clamped its weights after a step, then resumes a checkpoint optimizer
    first (set_state_dict's order): the optimizer's load took the clamped weight as the
    master ("written since": a model loaded first looks the same), and the model's
    checkpoint weights, adopted at the next step, lost the masters' FP32 bits (a
    tester's find, 7.8e-3 off with BF16 weights). The weight is now left for the next
    adoption to decide: the saved master keeps its bits once the weight is its cast."""
    model = make_model().to(torch.bfloat16)
    ref = reference(model)
    opt = build(model, overlap=overlap)
    data = batches(4, 2)
    train(opt, model, data[:1])
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(opt, model, data[1:2])
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.1, 0.1)
    if order == "optimizer_first":
        opt.load_state_dict(saved[1])
        model.load_state_dict(saved[0])
    else:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    train(opt, model, data[2:])
    train_reference(ref, [data[0], *data[2:]])
    assert_bitwise(model, ref)


def test_a_checkpoint_with_stale_weights_is_refused_until_they_are_refreshed() -> None:
    """An emergency checkpoint in the handler of a failed copy paired the stepped
    masters with the model's stale weights, and a load keeps a weight its master does
    not cast to: the resume trained from the stale ones, 1e-2 off (a tester's find).
    state_dict() refuses until refresh_device_weights(); the checkpoint taken after it
    resumes bitwise."""
    model = make_model()
    ref = reference(model)
    opt = build(model, overlap="none", chunk_numel=200)
    data = batches(3, 1)
    _fail_last_copy(opt, model, data[0])
    assert _weights_behind_masters(opt)
    with pytest.raises(StepFailedError, match=r"state_dict\(\) refused.*stale.*refresh_device_"
                                              r"weights\(\) \(before a checkpoint"):
        opt.state_dict()
    opt.refresh_device_weights()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    resumed = build(fresh, overlap="none", chunk_numel=200)
    fresh.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    train_reference(ref, data)
    train(resumed, fresh, data[1:])
    assert_bitwise(fresh, ref)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    until: Callable[[], bool] | None = None
    """Raise only once this holds (ordered by the event, not a sleep)."""

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        import time

        deadline = time.monotonic() + 120
        while _Boom.until is not None and not _Boom.until():
            assert time.monotonic() < deadline, "the awaited chunk never stepped"
            time.sleep(0.001)
        raise RuntimeError("backward failed")


def _raise_after_a_chunk_stepped(opt: FullOffloadOptimizer, a: torch.nn.Module,
                                 b: torch.nn.Module, x: torch.Tensor) -> None:
    """A final backward under overlap="backward": b's chunks step as its gradients land;
    the backward raises, before a's gradients, once one of them has stepped."""

    def stepped() -> bool:
        acc = opt._lifecycle.acc
        return acc is not None and bool(acc.results.stepped_chunks)

    _Boom.until = stepped
    try:
        with pytest.raises(RuntimeError, match="backward failed"):
            b(_Boom.apply(a(x))).float().sum().backward()
    finally:
        _Boom.until = None


def test_a_backward_that_raises_leaves_nothing_hanging() -> None:
    model = make_model()
    opt = build(model, overlap="none", timeout=30)
    idx, _, _ = batches(1, 1)[0][0]
    h = _Boom.apply(model.l1(model.emb(idx)).float()).sum()
    loss = h + (model.side.weight.float() ** 2).sum()  # side's gradient lands first
    with pytest.raises(RuntimeError, match="backward failed"):
        loss.backward()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    train(opt, model, batches(1, 1))


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_a_backward_after_one_that_raised_is_refused_naming_it(overlap: str,
                                                               fraction: float) -> None:
    """The raised backward's gradients are partial: the next backward is refused, and the
    error names the unfinished backward (not a reentrant checkpoint, which was the
    message before). After zero_grad() training goes on, bitwise, where nothing stepped
    (under overlap="backward" the raised final backward may have stepped chunks: a torn
    step, tested above)."""
    model = make_model()
    ref = reference(make_model())
    opt = build(model, overlap=overlap, offload_fraction=fraction, timeout=30)
    idx, _, _ = batches(1, 1)[0][0]
    h = _Boom.apply(model.l1(model.emb(idx)).float()).sum()
    loss = h + (model.side.weight.float() ** 2).sum()  # side's gradient lands first
    with pytest.raises(RuntimeError, match="backward failed"):
        loss.backward()
    with pytest.raises(GradientError, match="previous backward never finished.*zero_grad"):
        loss_fn(model, batches(1, 1)[0][0]).backward()
    if overlap == "backward":
        with contextlib.suppress(StepFailedError):
            opt.zero_grad()
        return
    opt.zero_grad()
    data = batches(2, 2, seed=3)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_backwards_on_two_threads_at_once_are_not_taken_for_a_raised_one(
        overlap: str, fraction: float) -> None:
    """Thread A's backward has given l2's gradients and is blocked inside; thread B runs a
    whole backward over the disjoint ``side``. The check for a backward after one that
    raised took B for that (a tester's find): each thread's backward is its own."""
    import threading

    a_gave, b_done = threading.Event(), threading.Event()

    class Hold(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            a_gave.set()
            assert b_done.wait(60)
            return g

    def loss_a(m: torch.nn.Module, idx: torch.Tensor, hold: bool) -> torch.Tensor:
        h = m.l1(m.emb(idx).detach())
        return m.l2(torch.relu(Hold.apply(h) if hold else h)).float().pow(2).mean()

    def loss_b(m: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return m.side(m.emb(idx).detach()).float().pow(2).mean()

    model, ref = make_model(), reference(make_model())
    opt = build(model, overlap=overlap, offload_fraction=fraction, timeout=60)
    idx = batches(1, 1)[0][0][0]
    errors: list[BaseException] = []

    def thread_b() -> None:
        try:
            assert a_gave.wait(60)
            loss_b(model, idx).backward()
        except BaseException as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)
        finally:
            b_done.set()

    b = threading.Thread(target=thread_b)
    b.start()
    loss_a(model, idx, True).backward()
    b.join()
    assert not errors, errors
    opt.step()
    opt.zero_grad()
    opt.wait_for_step()
    ref.micro_step(lambda m: loss_a(m, idx, False) + loss_b(m, idx))  # disjoint: same sums
    ref.step()
    assert_bitwise(model, ref)


@pytest.mark.parametrize(("overlap", "accumulate", "marked"), [
    ("none", "cpu", False), ("forward", "cpu", False), ("backward", "cpu", False),
    ("forward", "gpu", True)])  # (a non-final micro-step summed on the device: no execution)
def test_a_raised_backwards_graph_is_freed_by_zero_grad(overlap: str, accumulate: str,
                                                       marked: bool) -> None:
    """The catch-an-OOM-and-retry pattern: after a backward that raised and zero_grad(),
    nothing of its graph stays alive (a tester's find: a micro-step kept the backward's
    frame, and with it the loss, the graph and its saved activations)."""
    import gc
    import weakref

    model = make_model()
    opt = build(model, overlap=overlap, accumulate=accumulate, timeout=30)
    idx, _, _ = batches(1, 1)[0][0]

    def raise_in_backward() -> Any:
        big = torch.randn(512, 512, requires_grad=True)
        h = model.l2(_Boom.apply(torch.relu(model.l1(model.emb(idx)))))
        loss = (h + big.sum().to(torch.bfloat16)).float().sum()
        with pytest.raises(RuntimeError, match="backward failed"), \
                opt.no_sync() if marked else contextlib.nullcontext():
            loss.backward()
        return weakref.ref(big)

    alive = raise_in_backward()
    with contextlib.suppress(StepFailedError):  # (overlap="backward": a torn step)
        opt.zero_grad()
    gc.collect()
    assert alive() is None


def test_a_gradient_that_never_comes_times_out_naming_the_parameter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    opt = build(model, overlap="none", timeout=0.5)
    # As if autograd never called the end-of-backward callback.
    monkeypatch.setattr(Lifecycle, "end_backward", lambda self, ms, **kw: None)
    loss_fn(model, batches(1, 1, side="never")[0][0]).backward()
    opt._lifecycle.micro = None
    with pytest.raises(StepTimeoutError) as info:
        opt.step()
    assert "grad:side.weight" in info.value.pending_gates
    monkeypatch.undo()
    opt._lifecycle.abandon(opt._lifecycle.inflight.final, "test over")  # type: ignore[union-attr, arg-type]
    with contextlib.suppress(BaseException):
        opt.wait_for_step()


def test_a_gradient_of_the_wrong_dtype_is_refused() -> None:
    model = make_model()
    model.l1.weight.grad_dtype = None  # torch would refuse the assignment below otherwise
    model.l1.weight.register_post_accumulate_grad_hook(
        lambda p: setattr(p, "grad", p.grad.float()))
    opt = build(model)
    with pytest.raises(GradientError, match="l1.weight.*torch.float32.*torch.bfloat16"):
        loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.zero_grad()


def test_a_second_gradient_in_one_backward_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # (The hook below injects a second gradient after the optimizer's: not refused.)
    monkeypatch.setattr(_intake, "hook_refusal", lambda *a: None)
    model = make_model()
    opt = build(model)

    def again(p: torch.Tensor) -> None:
        p.grad = torch.ones_like(p)
        opt._intake.on_grad(p)

    model.l2.bias.register_post_accumulate_grad_hook(again)
    with pytest.raises(GradientError, match="second gradient for 'l2.bias'"):
        loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.zero_grad()


def test_a_hook_outside_a_backward_is_refused() -> None:
    model = make_model()
    opt = build(model)
    model.l1.bias.grad = torch.ones_like(model.l1.bias)
    with pytest.raises(GradientError, match="outside a backward"):
        opt._intake.on_grad(model.l1.bias)


@pytest.mark.parametrize("overlap", ["backward", "none"])
def test_a_second_final_backward_before_step_is_refused(overlap: str) -> None:
    """Under overlap="backward" every unmarked backward is final; under the others it
    is once the micro-steps before it were marked (the no_sync() protocol)."""
    model = make_model()
    opt = build(model, overlap=overlap)
    b = batches(1, 1)[0][0]
    if overlap == "none":
        with opt.no_sync():
            loss_fn(model, b).backward()
    loss_fn(model, b).backward()
    with pytest.raises(GradientError, match="no_sync"):
        loss_fn(model, b).backward()
    if overlap == "backward":
        # The first final backward's chunks stepped: the zero_grad() that abandons the
        # step says it is torn, before the loop trains on.
        with pytest.raises(StepFailedError, match="checkpoint"):
            opt.zero_grad()
    else:
        opt.zero_grad()


def test_param_groups_edited_after_the_final_backward_began_are_refused_under_backward_overlap(
) -> None:
    model = make_model()
    opt = build(model, overlap="backward")
    loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(ConfigError, match="after the final backward began"):
        opt.step()


# -- refused configurations --------------------------------------------------------------

@pytest.mark.parametrize(("kw", "match"), [
    ({"accumulate": "disk"}, "accumulate must be 'cpu' or 'gpu'"),
    ({"overlap": "always"}, "overlap must be"),
    ({"max_norm": -1.0}, "max_norm must be a positive"),
    ({"slots": 0}, "slots must be an int >= 1"),
    ({"chunk_numel": 0}, "chunk_numel"),
    ({"timeout": 0}, "timeout"),
    ({"num_threads": 0}, "num_threads"),
    ({"lr": -1.0}, "refused the hyperparameters.*learning rate"),
])
def test_bad_arguments_are_refused_by_name(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build(make_model(), **kw)


def test_bad_parameters_are_refused_by_name() -> None:
    model = make_model()
    with pytest.raises(ConfigError, match="not in the model"):
        build(model, params=[torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match="'l1.weight' is listed twice"):
        build(model, params=[model.l1.weight, model.l1.weight])


def test_a_non_elementwise_optimizer_is_refused() -> None:
    with pytest.raises(pipeoff.UnsupportedOptimizerError, match="element-wise"):
        FullOffloadOptimizer(make_model(), torch.optim.LBFGS)


def test_compiled_autograd_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo import compiled_autograd

    monkeypatch.setattr(compiled_autograd, "compiled_autograd_enabled", True)
    with pytest.raises(ConfigError, match="compiled autograd"):
        build(make_model())


def test_compiled_autograd_turned_on_after_construction_is_refused_at_the_backward() -> None:
    """(A tester's find: the backward failed with torch's AssertionError from
    queue_callback, "only supported when Compiled Autograd is enabled with fullgraph".)"""
    import warnings

    from torch._dynamo import compiled_autograd

    model = make_model()
    opt = build(model, overlap="forward", timeout=30)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with compiled_autograd._enable(torch.compile(backend="eager")), \
                    pytest.raises(ConfigError, match="compiled autograd is on"):
                loss_fn(model, batches(1, 1)[0][0]).backward()
    finally:
        torch._dynamo.reset()
    opt.zero_grad()


def test_num_threads_applies_to_the_host_lanes_only() -> None:
    model = make_model()
    opt = build(model, num_threads=1)
    main = torch.get_num_threads()
    train(opt, model, batches(1, 2))
    assert torch.get_num_threads() == main


@contextlib.contextmanager
def _no_warnings() -> Iterator[None]:
    yield


@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_shipped_gradients_are_freed_once_copied(accumulate: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import weakref

    # (The hooks below only watch each backward's gradient: not refused here.)
    monkeypatch.setattr(_intake, "hook_refusal", lambda *a: None)
    model = make_model()
    refs: list[Any] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: refs.append(weakref.ref(p.grad)))
    opt = build(model, accumulate=accumulate, overlap="none")
    data = batches(1, 3)[0]
    for k, b in enumerate(data):
        with opt.no_sync() if k < 2 else contextlib.nullcontext():
            loss_fn(model, b).backward()
        for ms in opt._lifecycle.acc.micro:  # type: ignore[union-attr]
            if ms.execution is not None and not (ms.final and k == 2):
                ms.execution.wait()
        gc.collect()
        if k < 2:  # copied to the host (cpu), or summed on the device (gpu): gone
            assert refs and all(r() is None for r in refs), k
    opt.step()
    gc.collect()
    assert all(r() is None for r in refs)
    assert not opt._lifecycle.inflight


# -- found by a review that tried to break it (issue 13) ---------------------------------

def test_a_final_backward_that_raises_after_chunks_stepped_is_a_torn_step() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    model = torch.nn.Sequential(a, b).to(torch.bfloat16)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="backward", chunk_numel=1)
    x = torch.randn(3, 4).to(torch.bfloat16)
    _raise_after_a_chunk_stepped(opt, a, b, x)
    with pytest.raises(StepFailedError, match="checkpoint"):
        opt.step()
    opt.zero_grad()
    with pytest.raises(StepFailedError, match="checkpoint"):
        b(a(x)).float().sum().backward()
        opt.step()


def test_zero_grad_after_a_raised_final_backward_that_stepped_chunks_refuses() -> None:
    """A marked micro-step, then a final backward that raises after some chunks stepped,
    then the loop's ``zero_grad()``: it returned quietly and the loop ran one more
    forward and backward on partly stepped weights before ``step()`` refused, blaming a
    ``zero_grad()`` "inside its backward"."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    model = torch.nn.Sequential(a, b).to(torch.bfloat16)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="backward", chunk_numel=1)
    x = torch.randn(3, 4).to(torch.bfloat16)
    with opt.no_sync():
        b(a(x)).float().sum().backward()
    _raise_after_a_chunk_stepped(opt, a, b, x)
    with pytest.raises(StepFailedError, match="checkpoint") as info:
        opt.zero_grad()
    assert "before its backward finished" in str(info.value.__cause__)


def test_a_failed_chunk_under_backward_overlap_is_torn_not_dirty() -> None:
    model = make_model()
    opt = build(model, overlap="backward", chunk_numel=200)
    with testing.fail_work("step:2", RuntimeError("chunk failed")):
        _micro_steps(opt, model, batches(1, 1)[0])
        with pytest.raises(RuntimeError, match="chunk failed|checkpoint") as info:
            opt.step()
    assert "checkpoint" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
    opt.zero_grad()
    with pytest.raises(StepFailedError, match="checkpoint"):
        opt.step()


def test_param_groups_edited_in_place_are_followed() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="none", lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).pow(2).sum().backward()
        o.step()
        o.zero_grad()
        frozen = o.param_groups[0]["params"].pop(0)  # stop training layer 0's weight
        o.add_param_group({"params": [o.param_groups[0]["params"].pop()], "lr": 0.01})
        for _ in range(2):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
            frozen.grad = None
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert 0 not in opt.state_dict()["state"] or len(opt.state_dict()["state"]) == 3


def test_param_groups_changed_in_the_middle_of_accumulation_are_refused() -> None:
    model = make_model()
    opt = build(model, overlap="none")
    with opt.no_sync():
        loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.param_groups[0]["params"].pop()
    with pytest.raises(ConfigError, match="middle of gradient accumulation"):
        opt.step()


def test_a_reentrant_checkpoint_whose_recomputation_gives_the_first_gradient() -> None:
    from torch.utils.checkpoint import checkpoint

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.block = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, self.emb(x), use_reentrant=True)

    for overlap in ("none", "backward", "forward"):
        torch.manual_seed(0)
        model = M().to(torch.bfloat16)
        ref = reference(model)
        opt = build(model, overlap=overlap)
        for k in range(3):
            x = torch.tensor([[1, 2, 3]]) + k
            for _ in range(2):
                with opt.no_sync():
                    model(x).float().pow(2).sum().backward()
                ref.micro_step(lambda m, x=x: m(x).float().pow(2).sum())
            model(x).float().pow(2).sum().backward()
            ref.micro_step(lambda m, x=x: m(x).float().pow(2).sum())
            opt.step()
            opt.zero_grad()
            ref.step()
        opt.wait_for_step()
        assert_bitwise(model, ref)


def test_grad_norm_right_after_an_overlapped_step_is_that_steps() -> None:
    model = make_model()
    ref = reference(model, max_norm=1e9)
    opt = build(model, overlap="forward", max_norm=1e9)
    for step in batches(3, 1):
        with testing.delay_lane("host_step", 0.01):
            loss_fn(model, step[0]).backward()
            opt.step()
            norm = opt.grad_norm
            opt.zero_grad()
        ref.micro_step(lambda m, b=step[0]: loss_fn(m, b))
        ref_norm = torch.nn.utils.get_total_norm(list(ref.acc.values()), foreach=False)
        ref.step()
        assert norm is not None and same_bits(norm, ref_norm)


def test_capturable_differentiable_and_a_single_tensor_are_refused_frozen_is_not() -> None:
    model = make_model()
    with pytest.raises(ConfigError, match="capturable"):
        build(model, capturable=True)
    with pytest.raises(ConfigError, match="differentiable"):
        build(model, differentiable=True)
    with pytest.raises(ConfigError, match="single tensor"):
        build(model, params=model.l1.weight)
    model.side.requires_grad_(False)  # frozen parameters are accepted, as torch does
    opt = build(model, params=list(model.parameters()))
    train(opt, model, batches(1, 2))


def test_a_compile_session_is_held_off_from_the_first_chunk() -> None:
    from pipeoff import _compat

    build(make_model())
    assert _compat._session_patched  # before any chunk ran


def test_an_unattached_compiled_model_waits_for_the_whole_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    cm, cref = torch.compile(model, backend="eager"), torch.compile(ref, backend="eager")
    opt = FullOffloadOptimizer(cm, torch.optim.AdamW, overlap="forward", chunk_numel=40, lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="not attached"):
        for s in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
            with testing.delay_lane("h2d", 0.05):
                cm(x).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            cref(x).pow(2).sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


# -- found by a second review (issue 13) -------------------------------------------------

@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw_unused_branch"])
def test_resume_without_per_parameter_state_is_bitwise(optimizer: str, model_first: bool,
                                                       tmp_path: Path) -> None:
    cls, kw = ((torch.optim.SGD, {"lr": 0.1}) if optimizer == "sgd"
               else (torch.optim.AdamW, {"lr": 1e-2}))
    side = "all" if optimizer == "sgd" else "never"  # `side` never has a gradient first
    data = batches(2, 1, side=side) + batches(2, 1, side="all", seed=3)
    whole = make_model()
    opt = FullOffloadOptimizer(whole, cls, overlap="none", **kw)
    train(opt, whole, data)
    first = make_model()
    opt1 = FullOffloadOptimizer(first, cls, overlap="none", **kw)
    train(opt1, first, data[:2])
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ck.pt")
    second = make_model(seed=5)
    opt2 = FullOffloadOptimizer(second, cls, overlap="none", **kw)
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    if model_first:
        second.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
    else:
        opt2.load_state_dict(ck["opt"])
        second.load_state_dict(ck["model"])  # adopted at the next step
    train(opt2, second, data[2:])
    for p, q in zip(whole.parameters(), second.parameters()):
        assert same_bits(p, q)


def test_weights_written_outside_the_optimizer_become_the_masters() -> None:
    model = make_model()
    opt = build(model, overlap="forward")
    train(opt, model, batches(2, 1))
    before = {k: e["master"].clone() for k, e in opt.state_dict()["state"].items()}
    with torch.no_grad():
        model.l1.weight.fill_(0.5)  # re-initialized by the user between steps
    data = batches(1, 1, seed=9)
    train(opt, model, data)
    after = opt.state_dict()["state"]
    k = [id(p) for p in model.parameters()].index(id(model.l1.weight))
    # l1.weight stepped from 0.5, not from its old master ...
    assert (after[k]["master"] - 0.5).abs().max() < 0.05
    assert (before[k] - 0.5).abs().max() > 0.1
    # ... and a checkpoint of this very state, loaded into the model, changes nothing.
    ref_model = make_model()
    ref_opt = build(ref_model, overlap="forward")
    train(ref_opt, ref_model, batches(2, 1))
    sd = copy.deepcopy(ref_model.state_dict())
    ref_model.load_state_dict(sd)  # rewrites every weight with the same values
    train(ref_opt, ref_model, data)
    with torch.no_grad():
        model2 = make_model()
    opt2 = build(model2, overlap="forward")
    train(opt2, model2, batches(2, 1) + [data[0]])
    for p, q in zip(ref_model.parameters(), model2.parameters()):
        assert same_bits(p, q)


def test_a_step_the_model_sync_waits_for_keeps_its_trace_and_figures() -> None:
    # A weight written while the step is in flight (after the forward hooks waited
    # for that weight's chunk): the next backward's first gradient adopts it, and the
    # model sync waits for the step first, through the lifecycle. The optimizer still
    # keeps that step's trace and hands its figures to the hooks at the next step().
    model = make_model()
    opt = build(model, overlap="forward")
    got: list[int] = []
    opt.register_step_stats_hook(lambda s: got.append(s.step))
    train(opt, model, batches(1, 1))
    first = opt.last_trace
    with testing.delay_lane("h2d", 0.05):
        loss_fn(model, batches(1, 1, seed=3)[0][0]).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model.l1.weight.fill_(0.5)
        loss_fn(model, batches(1, 1, seed=4)[0][0]).backward()
    assert opt._lifecycle.inflight is None  # the model sync waited for it
    assert opt._registry.outside_writes == 1
    assert opt.last_trace is not first and opt.last_trace is not None
    assert got == [0]  # (no user hook runs inside a backward)
    opt.step()
    opt.wait_for_step()
    assert got == [0, 1, 2]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("call", ["state_dict", "load_state_dict"])
def test_checkpoints_between_the_final_backward_and_step_are_refused(call: str,
                                                                     fraction: float) -> None:
    """Under ``overlap="backward"`` the final backward steps. A checkpoint taken before
    ``step()`` was a step ahead of the loop's (a resume applied that batch twice: 6
    steps where torch takes 5), and a load there rolled that step back with its
    gradients (``step()`` then stepped nothing, where torch steps on them after the
    load): both silently (a tester's finds). Both are refused; nothing changes (the run
    goes on bitwise as one without the call); after ``zero_grad()`` (which keeps the
    step, warning) a load is the rollback it asks for."""
    data = batches(3, 1)
    ref_model = make_model()
    ref = build(ref_model, overlap="backward", chunk_numel=200, offload_fraction=fraction)
    train(ref, ref_model, data)
    ref.wait_for_step()
    model = make_model()
    opt = build(model, overlap="backward", chunk_numel=200, offload_fraction=fraction)
    train(opt, model, data[:1])
    # Deep copies: state dicts hold references to the live state, as torch's do.
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    with testing.delay_lane("host_step", 0.02):
        loss_fn(model, data[1][0]).backward()  # chunks step now
        if call == "state_dict":
            with pytest.raises(GradientError, match="a step ahead of the loop's.*call step"):
                opt.state_dict()
        else:
            with pytest.raises(ConfigError, match="overlap='backward'.*after step"):
                opt.load_state_dict(saved[1])
    opt.step()
    opt.zero_grad()
    train(opt, model, data[2:])
    opt.wait_for_step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert same_bits(p, q), name
    # zero_grad() without step(): the step stays (a warning); a load then rolls it back.
    loss_fn(model, data[0][0]).backward()
    with pytest.warns(RuntimeWarning):
        opt.zero_grad()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    assert {float(e["step"]) for e in opt.state_dict()["state"].values()} == {1.0}
    for (name, p), q in zip(model.named_parameters(), saved[0].values()):
        assert same_bits(p, q), name


def test_a_parameter_removed_and_put_back_keeps_its_state() -> None:
    model = make_model()
    opt = build(model, overlap="none")
    train(opt, model, batches(1, 1))
    w = opt.param_groups[0]["params"].pop(0)
    train(opt, model, batches(1, 1, seed=2))
    w.grad = None
    opt.param_groups[0]["params"].insert(0, w)
    train(opt, model, batches(1, 1, seed=3))
    assert float(opt.state_dict()["state"][0]["step"]) == 2.0  # as torch keeps opt.state[p]


# -- found by a review that tried to break the split (issue 19) ---------------------------

def test_readiness_of_a_parameter_added_while_a_step_is_in_flight() -> None:
    """The step in flight does not write a parameter added to param_groups since: its
    readiness is empty, not an error."""
    model = make_model()
    side = [model.side.weight, model.side.bias]
    opt = build(model, overlap="forward",
                params=[p for p in model.parameters() if all(p is not q for q in side)])
    train(opt, model, batches(1, 1))
    b = batches(1, 2, seed=2)[0]
    loss_fn(model, b[0]).backward()  # accumulates: step() makes it the step's gradient
    assert opt._lifecycle.launcher.prev is not None
    opt._lifecycle.launcher.prev.wait()  # its folds are done: only the step's "done" is held below
    with testing.hold_task("done") as release:
        opt.step()  # in flight: its last task is held
        opt.zero_grad()
        opt.param_groups[0]["params"].append(model.side.weight)
        with opt.no_sync():
            loss_fn(model, b[1]).backward()  # the registry follows the edit meanwhile
        assert not opt._lifecycle.inflight.execution.done()  # type: ignore[union-attr]
        assert opt.completion_for(model.side.weight) == ()
        assert opt.live_state(model.side.weight, "master")[1] == ()
        assert opt.completion_for(model.l1.weight)  # the step in flight writes it
        release.set()
    opt.wait_for_step()
    opt.zero_grad()


def test_zero_grad_after_a_final_backward_waits_for_the_step_before_it() -> None:
    """Under overlap="backward" with attach(), step k is in flight when the next final
    backward comes; a zero_grad() (skipping step k+1) waits for step k first: its late
    failure is raised and classified, not lost with the training silently stopped."""
    model = make_model()
    side = [model.side.weight, model.side.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in side)]
    # Chunks go last parameter first: side's come last on the host_step lane, alone
    # (the root's own parameter, `empty`, must not share their chunk).
    rest.append(rest.pop(0))
    opt = build(model, overlap="backward", chunk_numel=72, params=side + rest)
    last = len(opt._registry.plan.chunks) - 1
    assert {opt._registry[i].name for i in opt._registry.plan.chunks[last]} == {
        "side.weight", "side.bias"}
    opt.attach()
    train(opt, model, batches(1, 1))
    with testing.hold_task(f"step:{last}") as release, \
            testing.fail_task(f"step:{last}", RuntimeError("late chunk failure")):
        b = batches(1, 2, seed=2)[0]
        loss_fn(model, b[0]).backward()
        opt.step()  # returns at once (attached); side's chunk is held
        loss_fn(model, (b[1][0], b[1][1], False)).backward()  # reads every weight but side's
        release.set()  # side's chunk fails now, after the forward
        with pytest.warns(RuntimeWarning, match="has stepped already"), \
                pytest.raises(RuntimeError, match="late chunk failure"):
            opt.zero_grad()
    with pytest.raises(StepFailedError, match="checkpoint"):
        opt.step()  # a torn step is refused: no silent training on half-stepped masters


def _remove(params: list[torch.Tensor], p: torch.Tensor) -> None:
    params.pop(next(k for k, q in enumerate(params) if q is p))  # by identity


def test_state_dict_follows_param_groups_edited_in_place() -> None:
    model = make_model()
    opt = build(model, overlap="none", params=[p for p in model.parameters()
                                               if p is not model.side.bias])
    train(opt, model, batches(1, 1))
    _remove(opt.param_groups[0]["params"], model.l1.weight)
    saved = opt.state_dict()
    assert len(saved["param_groups"][0]["params"]) == len(opt.param_groups[0]["params"])
    opt.load_state_dict(saved)
    opt.param_groups[0]["params"].append(model.side.bias)
    assert len(opt.state_dict()["param_groups"][0]["params"]) == len(
        opt.param_groups[0]["params"])
    train(opt, model, batches(1, 1, seed=2))


def test_a_weight_written_while_its_parameter_was_out_of_the_groups_is_adopted() -> None:
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.SGD, lr=0.0, overlap="none")
    train(opt, model, batches(1, 1))
    w = model.l1.weight
    _remove(opt.param_groups[0]["params"], w)
    train(opt, model, batches(1, 1, seed=2))  # re-indexed without it
    w.grad = None
    with torch.no_grad():
        w.fill_(0.25)  # re-initialized while out of the optimizer
    opt.param_groups[0]["params"].insert(0, w)
    train(opt, model, batches(1, 1, seed=3))  # lr 0: the weight stays its master
    assert torch.equal(w, torch.full_like(w, 0.25))


def test_readiness_between_the_final_backward_and_step_under_backward_overlap() -> None:
    """The chunks of a final backward step the masters before step() is called: their
    readiness says so (a transfer launched then waits for them)."""
    model = make_model()
    opt = build(model, overlap="backward")
    train(opt, model, batches(1, 1))
    with testing.hold_task("step:.*") as release:
        loss_fn(model, batches(1, 1, seed=2)[0][0]).backward()  # final: chunks held
        ready = opt.completion_for(model.l1.weight)
        assert ready and not any(c.query() for c in ready)
        release.set()
    opt.step()
    assert all(c.query() for c in ready)


def test_a_transfer_between_the_final_backward_and_step_reads_the_masters_before_it() -> None:
    """Under overlap="forward" the final micro-step is launched by the backward and steps
    when step() opens its gate: step() first waits for transfers launched meanwhile."""
    from pipeoff.transfer import LiveTensor, StateTransfer

    model = make_model()
    opt = build(model, overlap="forward")
    train(opt, model, batches(1, 1))
    p = model.l1.weight
    before = opt.state[p]["master"].clone()
    target = torch.empty_like(before)
    from tests.transfer.test_transfer import _release_when_waiting_for_readers

    with opt.no_sync():  # a marked micro-step: the unmarked backward below is the final one
        loss_fn(model, batches(1, 1, seed=3)[0][0]).backward()
    with testing.hold_task("preflight") as release:  # the transfer reads nothing yet
        loss_fn(model, batches(1, 1, seed=2)[0][0]).backward()  # final: waits for step()
        assert opt._lifecycle.acc is not None and opt._lifecycle.acc.final is not None
        ex = StateTransfer({"m": LiveTensor.from_optimizer(opt, p, "master")},
                           {"m": LiveTensor(target)}).launch()
        watcher = _release_when_waiting_for_readers(release)
        opt.step()  # let go of the transfer only once step() waits for it
        opt.wait_for_step()
    watcher.join()
    ex.wait()
    assert torch.equal(target, before)
    assert not torch.equal(opt.state[p]["master"], before)


@pytest.mark.parametrize("where", ["after_the_step", "inside_the_step"])
def test_a_chunk_that_fails_after_writing_masters_is_never_taken_for_clean(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step chunk that raises once its masters are stepped (in the cast) leaves every
    master stepped: stale, fixed by refresh_device_weights(). One that raises inside the
    optimizer's step leaves some masters stepped: torn. Never dirty, which zero_grad()
    would clear and training would go on from half-stepped masters."""
    from pipeoff.optim import _update

    model = make_model()
    ref = reference(model)
    opt = build(model, overlap="none")  # one chunk
    data = batches(3, 1)
    train(opt, model, data[:1])
    train_reference(ref, data[:1])
    if where == "after_the_step":
        failing: Any = testing.fail_work("step:0", RuntimeError("chunk failed"))
    else:
        real = _update.step_chunk

        def half(shadow: Any, groups: Any) -> None:  # steps one slice, then raises
            g = groups[0]
            one = _update.ChunkGroup(g.hyper)
            one.add(g.params[0], g.grads[0], g.staged[0], g.present[0], g.scalars[0])
            real(shadow, [one])
            raise RuntimeError("chunk failed")

        monkeypatch.setattr(_update, "step_chunk", half)
        failing = contextlib.nullcontext()
    with failing:
        _micro_steps(opt, model, data[1])
        with pytest.raises(RuntimeError, match="chunk failed"):
            opt.step()
    monkeypatch.undo()
    if where == "after_the_step":
        assert opt.health.stale is not None and opt.health.torn is None
        opt.refresh_device_weights()
        opt.zero_grad()
        train_reference(ref, data[1:2])
        train(opt, model, data[2:])
        train_reference(ref, data[2:])
        assert_bitwise(model, ref)
    else:
        assert opt.health.torn is not None and "while chunk(s) [0]" in opt.health.torn
        opt.zero_grad()
        with pytest.raises(StepFailedError, match="checkpoint"):
            opt.step()


def test_a_step_whose_failure_surfaced_late_refuses_until_zero_grad() -> None:
    """The step fails after step() returned (its chunks run in flight) and before any
    master stepped: step() refuses until zero_grad(), also when it is called with no
    new gradient (it returned quietly, as if there were nothing to step)."""
    model = make_model()
    opt = build(model)  # overlap="forward": the step runs after step() returns
    loss_fn(model, batches(1, 1)[0][0]).backward()
    with testing.fail_task("step:.*", RuntimeError("chunk failure")):
        opt.step()
        with pytest.raises(RuntimeError, match="chunk failure"):
            opt.wait_for_step()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()  # still
    opt.zero_grad()
    loss_fn(model, batches(1, 1)[0][0]).backward()
    opt.step()
    opt.wait_for_step()


def test_last_step_stats_waits_for_the_step_it_describes() -> None:
    """Read while the step's chunks are held: the figures are that step's (its number,
    its chunks), read once it has finished, never the step before's."""
    from tests._stacks import release_when_waiting

    model = make_model()
    opt = build(model, overlap="forward")
    train(opt, model, batches(1, 2))  # two micro-steps: twice the gradient copies
    first = opt.last_step_stats
    data = batches(2, 1, seed=5)
    with testing.hold_task("step:0") as release:
        loss_fn(model, data[1][0]).backward()
        opt.step()  # chunk 0 held: the step is in flight
        watcher = release_when_waiting(release, "last_step_stats")
        stats = opt.last_step_stats
    watcher.join()
    assert first is not None and stats is not None
    assert (first.step, stats.step) == (0, 1)
    assert stats.chunks == first.chunks > 0
    # One micro-step's gradient copies, not the step before's two.
    assert 0 < stats.d2h_bytes < first.d2h_bytes
