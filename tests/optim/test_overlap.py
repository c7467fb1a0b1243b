"""Overlap mode under provoked races: forward waits, captured grads and hyperparameters."""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import pytest
import torch

import pipeoff
import pipeoff.testing
from pipeoff.optim import OffloadOptimizer
from tests.optim.test_offload import batches, make_net

DELAY = 0.02  # per chunk on the compute lane: every chunk finishes well after step() returns


def reference(steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    outs = []
    for x in batches(steps):
        y = net(x, 1)
        outs.append(y.detach().clone())
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return outs, [p.detach().clone() for p in net.parameters()]


def overlapped(steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], OffloadOptimizer]:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1),
                           mode="overlap", chunk_bytes=256)
    opt.attach(net)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    outs = []
    last = f"opt{len(opt.plan.chunks) - 1}"
    with pipeoff.testing.delay_lane("compute", DELAY):
        for x in batches(steps):
            y = net(x, 1)
            outs.append(y.detach().clone())
            y.pow(2).mean().backward()
            with pipeoff.testing.hold_task(last) as release:
                opt.step()
                assert not opt.last_execution.done()  # type: ignore[union-attr]
                # While the chunks are pending: none of this may change the step's math.
                opt.zero_grad()
                sched.step()
                release.set()
        opt.wait_for_step()
    return outs, [p.detach().clone() for p in net.parameters()], opt


def test_overlap_forward_waits_make_it_exact() -> None:
    ref_out, ref_params = reference(4)
    out, params, _ = overlapped(4)
    for a, b in zip(ref_out, out):
        assert torch.equal(a, b)
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)


def test_without_forward_waits_the_forward_reads_stale_params() -> None:
    """The control: the same race without attach() and without the read guard
    gives different numbers."""
    ref_out, _ = reference(2)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1),
                           mode="overlap", chunk_bytes=256)
    x0, x1 = batches(2)
    with pipeoff.testing.delay_lane("compute", DELAY), pipeoff.testing.disable("read_guard"):
        net(x0, 1).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            stale = net(x1, 1)
        opt.wait_for_step()
    assert not torch.equal(stale, ref_out[1])
    with torch.no_grad():
        assert torch.equal(net(x1, 1), ref_out[1])  # after the wait it is right


def test_a_module_waits_only_for_its_own_chunks() -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=256)
    opt.attach(net)
    x = batches(1)[0]
    net(x, 1).sum().backward()
    ex = None
    last = f"opt{len(opt.plan.chunks) - 1}"
    with pipeoff.testing.delay_lane("compute", DELAY), \
            pipeoff.testing.hold_task(last) as release:
        opt.step()
        ex = opt.last_execution
        assert ex is not None
        with torch.no_grad():
            net.a(x)  # waits for net.a's chunks, which come first
        assert not ex.done()  # the last chunk (net.side's) is held
        release.set()
        opt.wait_for_step()
    assert ex.done()


def test_state_dict_and_next_step_wait_for_the_step_in_flight() -> None:
    net = make_net()
    ref = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=256)
    ref_opt = torch.optim.AdamW(ref.parameters())
    x = batches(1)[0]
    with pipeoff.testing.delay_lane("compute", DELAY):
        for m, o in ((net, opt), (ref, ref_opt)):
            m(x, 1).sum().backward()
            o.step()
        sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    for k, st in ref_sd["state"].items():
        for key, v in st.items():
            assert torch.equal(v, sd["state"][k][key])


def test_chunk_failure_surfaces_in_forward_hook_and_nothing_hangs() -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=256)
    opt.attach(net)
    x = batches(1)[0]
    net(x, 1).sum().backward()
    with pipeoff.testing.fail_task("opt3", RuntimeError("boom in chunk")):
        opt.step()
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="boom in chunk") as info:
            net(x, 1)
    text = "".join(traceback.format_exception(info.value))
    assert "opt3" in text
    # The chunks that wrote their parameters are named; opt3 failed before writing.
    assert "chunk(s) 0-2 of" in text
    # The grads of parameters whose chunks did not run are given back.
    assert net.b.weight.grad is not None
    assert pipeoff.pools_for("cpu").device.stats().live_bytes == 0
    opt.wait_for_step()  # the failure was reported once; nothing is left in flight
    net(x, 1)  # the hooks no longer wait or raise
    with pytest.raises(pipeoff.StepFailedError, match="opt3.*chunk"):
        opt.step()


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_chunk_failure_surfaces_at_wait_or_step(mode: str) -> None:
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode=mode, chunk_bytes=256)
    x = batches(1)[0]
    net(x, 1).sum().backward()
    with pipeoff.testing.fail_task("d2h2", ValueError("lost the link")):
        if mode == "chunked":
            with pytest.raises(ValueError, match="lost the link"):
                opt.step()
        else:
            opt.step()
            with pytest.raises(ValueError, match="lost the link"):
                opt.step()  # the next step reports the previous one's failure
    assert all(p.grad is not None for p in net.parameters())
    assert pipeoff.pools_for("cpu").device.stats().live_bytes == 0
    # Chunks 0-2 updated their parameters before d2h2 failed: refuse to compound it.
    with pytest.raises(pipeoff.StepFailedError):
        opt.step()
    with pytest.raises(pipeoff.StepFailedError):
        opt.state_dict()


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        net(x, 1).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
def test_a_failure_before_any_update_can_be_retried_bitwise(mode: str) -> None:
    xs = batches(3)
    ref = make_net()
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), xs)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), mode=mode,
                           chunk_bytes=256)
    opt.attach(net)
    _train(net, opt, xs[:1])
    net(xs[1], 1).pow(2).mean().backward()
    # h2d0 stages chunk 0's state: the failure comes before any chunk's update.
    with pipeoff.testing.fail_task("h2d0", OSError("flaky copy")):
        with pytest.raises(OSError, match="flaky copy") as info:
            opt.step()
            opt.wait_for_step()
    assert "no parameter was written" in "".join(traceback.format_exception(info.value))
    opt.step()  # the same grads, the same step
    opt.zero_grad()
    _train(net, opt, xs[2:])
    opt.wait_for_step()
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)


def test_after_a_partial_step_loading_a_checkpoint_resumes_bitwise() -> None:
    import copy

    xs = batches(3)
    ref = make_net()
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), xs)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    opt.attach(net)
    _train(net, opt, xs[:1])
    ckpt = copy.deepcopy((net.state_dict(), opt.state_dict()))
    net(xs[1], 1).pow(2).mean().backward()
    with pipeoff.testing.fail_task("opt2", RuntimeError("boom")):
        opt.step()
        with pytest.raises(RuntimeError, match="boom"):
            opt.wait_for_step()
    assert not all(torch.equal(a, b) for a, b in zip(ckpt[0].values(), net.state_dict().values()))
    with pytest.raises(pipeoff.StepFailedError):
        opt.step()
    net.load_state_dict(ckpt[0])
    opt.load_state_dict(ckpt[1])
    opt.zero_grad()
    _train(net, opt, xs[1:])
    opt.wait_for_step()
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a, b)


def test_zero_grad_in_place_waits_for_the_chunks_that_read_the_grads() -> None:
    ref_out, ref_params = reference(1)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1),
                           mode="overlap", chunk_bytes=256)
    x = batches(1)[0]
    with pipeoff.testing.delay_lane("compute", DELAY):
        net(x, 1).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # zeroes in place: must wait first
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in net.parameters())
    for a, b in zip(ref_params, net.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow  # about 9 s
def test_parameters_read_without_calling_their_module_are_waited_for() -> None:
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj."""

    def run(overlap: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        inner = torch.optim.AdamW(attn.parameters(), lr=1e-2)
        opt = OffloadOptimizer(inner, mode="overlap", chunk_bytes=64) if overlap else inner
        if overlap:
            opt.attach(attn)  # type: ignore[union-attr]
        outs = []
        gen = torch.Generator().manual_seed(1)
        with pipeoff.testing.delay_lane("compute", DELAY if overlap else 0.0):
            for _ in range(3):
                x = torch.randn(2, 5, 16, generator=gen)
                y, _ = attn(x, x, x)
                outs.append(y.detach().clone())
                y.pow(2).mean().backward()  # autograd also checks nothing changed underneath
                opt.step()
                opt.zero_grad()
            if overlap:
                opt.wait_for_step()  # type: ignore[union-attr]
        return outs, [p.detach().clone() for p in attn.parameters()]

    ref_out, ref_params = run(False)
    out, params = run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))


def test_a_slow_caller_still_waits_for_every_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks run (and drop their grads) while step() is still registering what
    the forward must wait for: what it registers is fixed at launch, not read from
    state the lanes change (this raised "dictionary changed size during iteration"
    in benchmarks/bench_read_guard.py)."""
    import time

    from pipeoff.optim import _waits

    seen: list[int] = []
    real = _waits.ForwardWaits.begin

    def slow_begin(self: _waits.ForwardWaits, writes: Any) -> Any:
        def slowly() -> object:
            for i in writes.written:
                time.sleep(0.01)  # the chunks finish meanwhile
                seen.append(i)
                yield i

        return real(self, dataclasses.replace(writes, written=slowly()))

    monkeypatch.setattr(_waits.ForwardWaits, "begin", slow_begin)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=256)
    for x in batches(2):
        net(x, 1).pow(2).mean().backward()
        opt.step()
    opt.wait_for_step()
    assert len(seen) == 2 * len(list(net.parameters()))


def test_detach_waits_for_the_step_in_flight() -> None:
    """Once attach()'s hooks are gone, compiled code (which the read guard does not see)
    has nothing that waits for a step in flight: detach() lets it finish first."""
    from tests._stacks import release_when_waiting

    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters()), mode="overlap", chunk_bytes=256)
    opt.attach(net)
    with pipeoff.testing.hold_task("opt.*") as release:
        net(batches(1)[0], 1).pow(2).mean().backward()
        opt.step()  # returns at once; its chunks are held
        watcher = release_when_waiting(release, "detach")  # let go once detach() waits
        opt.detach()
        assert opt.last_execution is not None and opt.last_execution.done()
    watcher.join()


@pytest.mark.slow  # compiles a (tiny) transformers model twice: about 10 s
@pytest.mark.xfail(raises=TypeError, strict=False, reason=(
    "known gap: Dynamo compiles the read guard's eager call from a frame it fell back on "
    "(inputs_embeds.device comes back a torch.Size); skipping the guard's frame "
    "(torch._dynamo.eval_frame.skip_code) fixed it but also took compiled code of an "
    "unattached model off its whole-step wait path, so it was withdrawn; read_guard=False "
    "is the workaround"))
def test_a_compiled_llama_with_the_read_guard() -> None:
    """A frame ``torch.compile`` runs eagerly (Dynamo gave up on the resume function after
    a hook's graph break inside the decoder loop) called the read guard eagerly, and
    Dynamo compiled that call as a frame of its own (a tester's find): ``is_compiling()``
    was true there, so the guard did not wait, and its cached result for
    ``inputs_embeds.shape`` came back for ``inputs_embeds.device`` (a TypeError in
    ``torch.arange``). The guard's frame is now skipped by Dynamo."""
    transformers = pytest.importorskip("transformers")
    import torch._dynamo

    def run(read_guard: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
        opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="overlap",
                               chunk_bytes=2048, read_guard=read_guard)
        opt.attach(model)
        compiled = torch.compile(model, backend="aot_eager")
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            compiled(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_step()
        return [p.detach().clone() for p in model.parameters()]

    try:
        guarded = run(True)  # raised TypeError at the second forward
        unguarded = run(False)
    finally:
        torch._dynamo.reset()
    # (Not bitwise: where the guard leaves the stack changes how Dynamo splits graphs.)
    for a, b in zip(guarded, unguarded):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("assigned", ["reset", "snapshot"])
def test_assigning_state_waits_for_the_step_in_flight(assigned: str) -> None:
    """``opt.state = ...`` right after ``step()`` (a reset, or a rollback to a deep copy
    taken earlier) waits for the step in flight: otherwise that step's chunks wrote their
    step counts into the dicts assigned (the bias correction then off, or a KeyError
    later: a tester's find)."""
    import collections
    import copy

    from tests._stacks import release_when_waiting

    def run(opt: Any, net: torch.nn.Module, held: bool) -> list[torch.Tensor]:
        saved = None
        for k, x in enumerate(batches(4)):
            net(x, 1).pow(2).mean().backward()
            if k == 1:
                saved = copy.deepcopy(opt.state)
            if k == 2 and held:
                with pipeoff.testing.hold_task("opt.*") as release:
                    opt.step()  # returns at once; its chunks are held
                    watcher = release_when_waiting(release, "state")
                    opt.state = (collections.defaultdict(dict) if assigned == "reset"
                                 else saved)
                watcher.join()
            else:
                opt.step()
                if k == 2:
                    opt.state = collections.defaultdict(dict) if assigned == "reset" else saved
            opt.zero_grad()
        if held:
            opt.wait_for_step()
        return [p.detach().clone() for p in net.parameters()]

    ref_net = make_net()
    want = run(torch.optim.AdamW(ref_net.parameters(), lr=1e-2), ref_net, False)
    net = make_net()
    opt = OffloadOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    got = run(opt, net, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_dtype_cast_while_a_step_is_in_flight_leaves_its_state_whole() -> None:
    """``step()``, then ``model.to(bfloat16)`` for an evaluation and back: the cast
    waits for the chunks writing the weights, not for their state's copies to the
    host, which read the staging in the parameter's dtype *then* (BF16): the state
    took garbage (exp_avg_sq negative, 2.5e38), silently (a tester's find). The copies
    are held until the first cast has run."""
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 8))

    model, ref = make(), make()
    # (One chunk: with more, a later chunk's staging waits for an earlier held copy.)
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), overlap="forward",
                           chunk_bytes=1 << 20)
    opt.attach(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 64, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            with pipeoff.testing.hold_task(r"d2h\d+") as release:
                o.step()
                o.zero_grad()
                m.to(torch.bfloat16)  # a low-precision evaluation...
                release.set()
                if o is opt:
                    opt.wait_for_step()  # (the copies run while the weights are BF16)
                with torch.no_grad():
                    m(x.bfloat16())
                m.to(torch.float32)  # ...and back to training
    opt.wait_for_step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    mine, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert all(torch.equal(mine[k][key], want[k][key])
               for k in want for key in ("exp_avg", "exp_avg_sq"))
