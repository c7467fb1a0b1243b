"""The one-pass final micro-step of FullOffloadOptimizer (``_one_pass.py``, issue 35):
the final backward's BF16 gradients held in host memory and folded inside the native
step, bitwise the fold then the step; the fallback chosen and reported; the held
buffer's two waits, each shown by a test that fails with it switched off; failures."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pipeoff import StepFailedError, testing
from pipeoff.execution import Execution
from pipeoff.optim import FullOffloadOptimizer, host_step_status
from pipeoff.optim._full_offload import _host_kernel
from tests.optim.full_reference import Reference
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    differs,
    loss_fn,
    make_model,
    same_bits,
    train,
    train_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

KW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}


@pytest.fixture(autouse=True)
def _native() -> None:
    if _host_kernel.host_kernel() is None:
        pytest.skip(f"no native kernel here: {_host_kernel.unavailable_reason()}")


@pytest.fixture
def folded_in_pass(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the native steps that folded a held gradient inside their pass."""
    calls = [0]
    real = _host_kernel.HostKernel.adam_step

    def counted(self: Any, *args: Any, **kw: Any) -> float | None:
        calls[0] += kw.get("last_grad") is not None
        return real(self, *args, **kw)

    monkeypatch.setattr(_host_kernel.HostKernel, "adam_step", counted)
    yield calls


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups (Adam's L2 term in one, the other ``maximize``, as the host kernel's
    tests do), so that every group of hyperparameters reaches the pass."""
    first = [model.emb.weight, model.l1.weight, model.l1.bias]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": first, "betas": (0.3, 0.99)},
            {"params": rest, "lr": 3e-3, "weight_decay": 0.0, "maximize": True}]


# -- exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no_clip", "clip"])
@pytest.mark.parametrize("overlap", ["none", "forward"])
@pytest.mark.parametrize("micro", [1, 2, 3, 5])
def test_every_micro_step_count_is_bitwise_the_fold_then_the_step(
        micro: int, overlap: str, clip: float | None, optimizer: type,
        folded_in_pass: list[int]) -> None:
    """The side branch has no gradient in the final micro-step (its earlier sum steps
    alone), the empty parameter none at all; states too."""
    model = make_model()
    ref = Reference(model, optimizer, groups=_groups, max_norm=clip, **KW)
    opt = FullOffloadOptimizer(model, optimizer, params=_groups(model), overlap=overlap,
                               max_norm=clip, **KW)
    data = batches(3, micro, side="not_final")
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    sd = opt.state_dict()["state"]
    for k, m in enumerate(m for g in ref.groups for m in g["params"]):
        if m in ref.opt.state:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert same_bits(sd[k][key], ref.opt.state[m][key]), key
    one_pass = micro > 1 and clip is None
    assert (folded_in_pass[0] > 0) == one_pass
    path = opt.host_step_path
    assert path is not None and path.one_pass == one_pass
    # Marked and clipped: the final fold takes torch's norm in its pass (40 B); unmarked,
    # step() takes it apart (44 B).
    assert path.bytes_per_param == (32 if one_pass else 40 if micro > 1 else 44)


class _Mixed(nn.Module):
    """BF16 layers and an FP32 scale (an FP32 gradient: not held)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32).to(torch.bfloat16)
        self.b = nn.Linear(32, 16).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).float() * self.scale


def test_an_fp32_parameter_beside_bf16_ones_folds_as_before(folded_in_pass: list[int]) -> None:
    """Only BF16 gradients are held; an FP32 parameter's sum is folded at arrival and
    stepped from it in the same step, and the norm counts both."""
    torch.manual_seed(0)
    model = _Mixed()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    gen = torch.Generator().manual_seed(3)
    data = [[torch.randn(4, 16, generator=gen).to(torch.bfloat16) for _ in range(3)]
            for _ in range(2)]
    norms = []
    for step in data:
        for k, x in enumerate(step):
            with opt.no_sync() if k < len(step) - 1 else contextlib.nullcontext():
                model(x).pow(2).mean().backward()
            ref.micro_step(lambda m, x=x: m(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        norms.append(ref.step(lambda ms: torch.nn.utils.clip_grad_norm_(
            ms, float("inf"), foreach=False)))
    opt.wait_for_step()
    assert_bitwise(model, ref)
    assert folded_in_pass[0] == 2 * 4 and opt.host_step_path.one_pass  # type: ignore[union-attr]
    torch.testing.assert_close(opt.grad_norm, norms[-1], rtol=1e-5, atol=0)


def _norm_of_reference(model: nn.Module, step: list[Any]) -> torch.Tensor:
    ref = Reference(model, torch.optim.AdamW, **KW)
    for b in step:
        ref.micro_step(lambda m, b=b: loss_fn(m, b))
    return ref.step(lambda ms: torch.nn.utils.clip_grad_norm_(ms, float("inf"),
                                                              foreach=False))


def test_the_norm_a_one_pass_step_reports_is_taken_in_the_pass() -> None:
    """Not torch's bits (summed in double inside the pass): torch's FP32 sum of squares
    rounds at about 1e-7 per element, so they agree to 1e-5 on this model."""
    model = make_model()
    want = _norm_of_reference(model, batches(1, 3)[0])
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    train(opt, model, batches(1, 3))
    assert opt.host_step_path is not None and opt.host_step_path.one_pass
    got = opt.grad_norm
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def _read_norm(opt: FullOffloadOptimizer, model: nn.Module) -> None:
    assert opt.grad_norm is not None


def _loop_clip(opt: FullOffloadOptimizer, model: nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _log_a_norm(opt: FullOffloadOptimizer, model: nn.Module) -> None:
    assert model.l1.weight.grad is not None
    model.l1.weight.grad.norm()


def _set_by_hand(opt: FullOffloadOptimizer, model: nn.Module) -> None:
    model.side.weight.grad = torch.full_like(model.side.weight, 0.25)


@pytest.mark.parametrize(("read", "why"), [
    (_read_norm, "grad_norm was read before step()"),
    (_loop_clip, "the norm of param.grad before step()"),
    (_log_a_norm, "the norm of param.grad before step()"),
    (_set_by_hand, "a gradient was set by hand or dropped before step()"),
], ids=["grad_norm", "loop_clip", "log_a_norm", "set_by_hand"])
def test_a_read_of_the_sums_before_step_folds_first(
        read: Callable[[FullOffloadOptimizer, nn.Module], None], why: str,
        folded_in_pass: list[int]) -> None:
    """The path is chosen at the first read: the norm task folds the held gradients,
    and the step is the fold then the step (bitwise the reference making the same
    call on its FP32 sums); the next step, untouched, is one pass again."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    data = batches(2, 2)
    for k, step in enumerate(data):
        with opt.no_sync():
            loss_fn(model, step[0]).backward()
        loss_fn(model, step[1]).backward()
        for b in step:
            ref.micro_step(lambda m, b=b: loss_fn(m, b))
        if k == 0:
            read(opt, model)
            edit = _reference_edit(read, ref)
        else:
            edit = None
        opt.step()
        opt.zero_grad()
        ref.step(edit)
        opt.wait_for_step()
        path = opt.host_step_path
        assert path is not None
        if k == 0:
            assert not path.one_pass and path.why == why, str(path)
            assert folded_in_pass[0] == 0
        else:
            assert path.one_pass and folded_in_pass[0] > 0
    assert_bitwise(model, ref)


def _reference_edit(read: Callable[..., None],
                    ref: Reference) -> Callable[[list[torch.Tensor]], Any] | None:
    """What the reference does to its FP32 sums where the loop did ``read``."""
    if read is _loop_clip:
        return lambda ms: torch.nn.utils.clip_grad_norm_(ms, 0.05)
    if read is _set_by_hand:
        master = ref.masters[id(ref.model.side.weight)]

        def hand(ms: list[torch.Tensor]) -> None:
            master.grad = torch.full_like(master, 0.25)
        return hand
    return None


# -- what it costs and says -------------------------------------------------------------

def test_the_held_buffer_is_allocated_once_and_reported() -> None:
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    before = opt.memory_stats()
    assert set(before) >= {"state_bytes_host", "state_bytes_device", "master_bytes_host",
                           "grad_sum_bytes_host", "held_grad_bytes_host"}
    assert before["held_grad_bytes_host"] == 0  # no step has held gradients yet
    n = sum(p.numel() for p in model.parameters())
    assert before["master_bytes_host"] == before["grad_sum_bytes_host"] == 4 * n
    assert before["state_bytes_host"] == 8 * n and before["state_bytes_device"] == 0
    train(opt, model, batches(1, 2))
    held = opt._lifecycle.launcher.held.buffer
    assert held is not None
    stats = opt.memory_stats()
    # 2 bytes per held parameter element, each parameter's slice 64-byte aligned.
    held_numel = sum(p.numel() for p in model.parameters() if p.numel())
    assert 2 * held_numel <= stats["held_grad_bytes_host"] <= 2 * held_numel + 64 * 7
    ptr = held.data_ptr()
    train(opt, model, batches(3, 2, seed=4))
    assert opt._lifecycle.launcher.held.buffer is held and held.data_ptr() == ptr
    assert opt.memory_stats() == stats


def test_host_step_status_says_which_path_and_why() -> None:
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    assert host_step_status(opt).endswith("no step yet")
    train(opt, model, batches(1, 1))
    assert "fold then step (44 B): final backward not marked" in host_step_status(opt)
    train(opt, model, batches(1, 2))
    status = host_step_status(opt)
    assert status.startswith(host_step_status()), status  # the kernel's, then the path
    assert "one pass (32 B): final backward marked, no clipping" in status
    clipped = FullOffloadOptimizer(make_model(), torch.optim.AdamW, max_norm=1.0, **KW)
    train(clipped, clipped.model, batches(1, 2))  # type: ignore[arg-type]
    assert "fold then step (40 B): clipping (max_norm)" in host_step_status(clipped)


# -- the two waits -------------------------------------------------------------------------

def _release_once_the_rest_ran(release: threading.Event, ex: Execution,
                               blocked: Callable[[int], bool]) -> threading.Thread:
    """A thread that sets ``release`` once every task of ``ex`` that comes after no
    ``blocked`` task (by a dependency, or its lane's order) has finished: the held
    tasks then run after everything that could run without them, and a wait they
    lack shows as a wrong number, not as luck."""
    plan = ex.plan
    after: set[int] = set()
    last_on: dict[str, int] = {}
    for k, lane in enumerate(plan.lanes):
        prev = last_on.get(lane)
        if blocked(k) or any(j in after for j in plan.waits[k]) or (
                prev is not None and prev in after):
            after.add(k)
        last_on[lane] = k
    free = [plan.order[k] for k in range(len(plan.order)) if k not in after]

    def watch() -> None:
        for name in free:
            ex.events_for(name)[0].synchronize()
        release.set()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _net() -> nn.Module:
    """Every parameter's gradient held (BF16, not empty): no copy of a gradient that is
    not held queues behind the held ones on the copy lane."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(torch.bfloat16)


def _xs(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, generator=gen).to(torch.bfloat16) for _ in range(n)]


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean()


@pytest.mark.parametrize("mutated", [False, True])
def test_a_held_gradient_is_stepped_only_after_its_copy_landed(mutated: bool) -> None:
    """The final backward's copies into the held buffer are held back until every task
    that does not wait for them has run: with the dependency, the held gradients' acc
    tasks (and the chunks after them) are among those that wait. Without it the
    chunks fold the buffer's previous contents (the last step's gradients) inside
    their pass."""
    model = _net()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="forward", **KW)
    xs = _xs(4)
    for k, x in enumerate(xs[:3]):
        with opt.no_sync() if k % 2 == 0 else contextlib.nullcontext():
            _loss(model, x).backward()
        if k == 1:
            opt.step()
            opt.zero_grad()
    switch = testing.disable("held_copy_dep") if mutated else contextlib.nullcontext()
    with switch, testing.hold_task(r"d2h:.*") as release:
        _loss(model, xs[3]).backward()  # the final backward: its copies are held
        ex = opt._lifecycle.acc.execution  # type: ignore[union-attr]
        copies = {k for k, n in enumerate(ex.plan.order) if n.startswith("d2h:")}
        watcher = _release_once_the_rest_ran(release, ex, copies.__contains__)
        try:
            opt.step()
            opt.wait_for_step()
        finally:
            release.set()
            watcher.join()
    opt.zero_grad()
    for pair in (xs[:2], xs[2:]):
        for x in pair:
            ref.micro_step(lambda m, x=x: _loss(m, x))
        ref.step()
    assert opt.host_step_path is not None and opt.host_step_path.one_pass
    assert differs(model, ref) == mutated


@pytest.mark.parametrize("mutated", [False, True])
def test_a_final_backward_copies_into_the_held_buffer_after_the_step_that_read_it(
        mutated: bool) -> None:
    """Step 1 is in flight, its chunk held; the next step's micro-steps run backwards
    of forwards taken before step() (their inputs need no gradient, so they read no
    weight: nothing waits for the step's weights). With the ``held`` gate the final
    one's copies wait for step 1; without it they overwrite the gradients step 1 has
    not read yet."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="forward", **KW)
    xs = [torch.randn(8, 64).to(torch.bfloat16) for _ in range(4)]

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().pow(2).mean()

    switch = testing.disable("held_release") if mutated else contextlib.nullcontext()
    with switch, testing.hold_task(r"step:.*") as release:
        with opt.no_sync():
            loss(model, xs[0]).backward()
        loss(model, xs[1]).backward()
        later = [loss(model, xs[2]), loss(model, xs[3])]  # forwards before step()
        opt.step()  # step 1 in flight, its chunk held
        opt.zero_grad()
        with opt.no_sync():
            later[0].backward()
        later[1].backward()  # the final backward of step 2: its copies into the buffer
        # Step 1's chunk goes once every task of step 2's final micro-step that does
        # not wait for step 1 (through a gate's event: ``held``, ``prev``) has run.
        ex = opt._lifecycle.acc.execution  # type: ignore[union-attr]
        run = ex._run
        watcher = _release_once_the_rest_ran(release, ex, lambda k: any(
            run.gates.event[g] is not None for g in run.task_gates[k]))
        try:
            opt.step()  # waits for step 1 first
        finally:
            release.set()
            watcher.join()
    opt.zero_grad()
    opt.wait_for_step()
    # The reference: step 2's gradients are of the weights before step 1 (its forwards
    # ran before step 1), as the optimizer's were.
    grads = []
    for x in xs:
        ref.model.zero_grad()
        loss(ref.model, x).backward()
        grads.append(ref.model.weight.grad.float())
    ref.model.zero_grad()
    for pair in (grads[:2], grads[2:]):
        ref.acc = {id(ref.model.weight): pair[0].clone() + pair[1]}
        ref.step()
    assert (not same_bits(model.weight, ref.model.weight)) == mutated


# -- failures ------------------------------------------------------------------------------

def test_a_failed_one_pass_step_reraises_and_the_next_steps_go_on() -> None:
    """A chunk that fails before its pass: the error reaches the caller, nothing was
    stepped (dirty: zero_grad() clears it), and the next steps hold their gradients in
    the same buffer again, bitwise a run without the failed step."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="none", **KW)
    data = batches(3, 2)
    train(opt, model, data[:1])
    with testing.fail_task(r"step:0", RuntimeError("chunk failed")):
        with opt.no_sync():
            loss_fn(model, data[1][0]).backward()
        loss_fn(model, data[1][1]).backward()
        with pytest.raises(RuntimeError, match="chunk failed"):
            opt.step()
    with pytest.raises(StepFailedError):
        opt.step()
    opt.zero_grad()
    train(opt, model, data[2:])
    assert opt.host_step_path is not None and opt.host_step_path.one_pass
    train_reference(ref, [data[0], data[2]])
    assert_bitwise(model, ref)


def test_a_failure_inside_the_pass_is_torn_when_it_wrote() -> None:
    """The native pass fails after it ran (its masters written): torn, as a failed
    native step is (``test_host_kernel``), and reported to the caller."""
    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="none", **KW)
    data = batches(2, 2)
    train(opt, model, data[:1])
    with testing.fail_work(r"step:0", RuntimeError("inside the pass")):
        with opt.no_sync():
            loss_fn(model, data[1][0]).backward()
        loss_fn(model, data[1][1]).backward()
        with pytest.raises(RuntimeError, match="inside the pass"):
            opt.step()
    with pytest.raises(StepFailedError, match="stepped"):
        opt.step()


def test_zero_grad_after_a_held_final_backward_discards_it() -> None:
    """The path was never chosen (no step(), no read): the discard fails its gate and
    the next steps are bitwise a run without the discarded one."""
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, **KW)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **KW)
    data = batches(3, 2)
    with opt.no_sync():
        loss_fn(model, data[0][0]).backward()
    loss_fn(model, data[0][1]).backward()
    opt.zero_grad()
    train(opt, model, data[1:])
    train_reference(ref, data[1:])
    assert_bitwise(model, ref)
