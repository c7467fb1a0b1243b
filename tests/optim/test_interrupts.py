"""Ctrl-C reaches the caller from every wait of the optimizers (a real SIGINT, delivered
while the main thread blocks in that very wait), and the optimizer goes on afterwards
as if the interrupted call had not been made."""

from __future__ import annotations

import contextlib
import copy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pipeoff import ConfigError, GradientError, StepFailedError
from pipeoff import testing as pt
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer
from pipeoff.optim._full_offload import _intake
from pipeoff.optim._full_offload._lifecycle import Lifecycle
from pipeoff.transfer import LiveTensor, StateTransfer
from tests._interrupts import no_collection
from tests._stacks import install, release_when_waiting, stack_of, waiting_in

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")


@contextlib.contextmanager
def sigint_inside(*where: str, release: threading.Event | None = None) -> Iterator[None]:
    """Deliver a real SIGINT to the main thread once it blocks in an execution's wait
    called from ``where`` (function names, outermost first). Ordered by what the
    main thread is doing, not by time: the watcher reads its stack.

    ``release``: set it once the main thread, interrupted, blocks in such a wait again
    from other lines of ``where`` (a step that finishes before passing the interrupt
    on).
    """
    assert threading.current_thread() is threading.main_thread()
    main = threading.main_thread().ident
    assert main is not None
    stop = threading.Event()
    sent = threading.Event()

    def watch() -> None:
        line = None
        while not stop.is_set():
            at = waiting_in(stack_of(main), where)
            if at is not None and line is None:
                line = at
                signal.pthread_kill(main, signal.SIGINT)
                sent.set()
                if release is None:
                    return
            elif at is not None and release is not None and at != line:
                release.set()
                return
            time.sleep(0.001)

    install()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        with no_collection():
            yield
    finally:
        stop.set()
        t.join()
        signal.signal(signal.SIGINT, old)
    assert sent.is_set(), f"the main thread never waited inside {where}"


def interrupted(call: Callable[[], Any], *where: str) -> KeyboardInterrupt:
    """Run ``call`` with a SIGINT delivered inside the wait ``where``; the interrupt it raised."""
    with sigint_inside(*where), pytest.raises(KeyboardInterrupt) as info:
        call()
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert where[-1] in names, names  # raised out of that very wait
    return info.value


# -- a small model and its training ---------------------------------------------------------

def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).to(torch.bfloat16)


def batch(k: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)


def backward(model: torch.nn.Module, k: int) -> None:
    x = batch(k).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()


def train(opt: FullOffloadOptimizer, model: torch.nn.Module, steps: range) -> None:
    for k in steps:
        with opt.no_sync():
            backward(model, 2 * k)
        backward(model, 2 * k + 1)
        opt.step()
        opt.zero_grad()
    opt.wait_for_step()


def build(model: torch.nn.Module, **kw: Any) -> FullOffloadOptimizer:
    return FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **kw)


def twins(**kw: Any) -> tuple[torch.nn.Module, FullOffloadOptimizer,
                              torch.nn.Module, FullOffloadOptimizer]:
    """A model and optimizer to interrupt, and an identical pair that is not interrupted."""
    a = make_model()
    b = copy.deepcopy(a)
    return a, build(a, **kw), b, build(b, **kw)


def replay(opt: FullOffloadOptimizer, model: torch.nn.Module, *, final: bool,
           step: bool) -> None:
    """What the uninterrupted twin does with batch 0: one backward (final, or under
    ``no_sync()``), ``step()`` or not, ``zero_grad()``."""
    with contextlib.nullcontext() if final else opt.no_sync():
        backward(model, 0)
    if step:
        opt.step()
    opt.zero_grad()


def goes_on_alike(opt: FullOffloadOptimizer, model: torch.nn.Module,
                  ref: FullOffloadOptimizer, ref_model: torch.nn.Module) -> None:
    """Two more steps of both: the interrupted optimizer trains as its twin does."""
    train(opt, model, range(1, 3))
    train(ref, ref_model, range(1, 3))
    assert_same(model, ref_model)


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), name


# -- FullOffloadOptimizer ------------------------------------------------------------------

def test_zero_grad_waiting_for_a_discarded_micro_step() -> None:
    model, opt, ref_model, ref = twins(overlap="none")
    with pt.hold_task("acc:.*") as release:
        with opt.no_sync():
            backward(model, 0)
        err = interrupted(opt.zero_grad, "zero_grad")
        release.set()
    assert isinstance(err, KeyboardInterrupt)
    opt.zero_grad()  # the interrupted call, again: it completes
    replay(ref, ref_model, final=False, step=False)
    goes_on_alike(opt, model, ref, ref_model)


def test_step_waiting_for_a_micro_step_whose_backward_never_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, ref_model, ref = twins(overlap="none")
    # As if autograd never called the end-of-backward callback.
    monkeypatch.setattr(Lifecycle, "end_backward", lambda self, ms, **kw: None)
    with pt.hold_task("acc:.*") as release:
        backward(model, 0)
        interrupted(opt.step, "step")
        release.set()
    monkeypatch.undo()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()  # the abandoned micro-step failed this step: refused until zero_grad()
    opt.zero_grad()
    replay(ref, ref_model, final=True, step=False)
    goes_on_alike(opt, model, ref, ref_model)


def test_step_settling_the_executions_of_a_failed_accumulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (The hook below injects a refused gradient in the second backward: not refused.)
    monkeypatch.setattr(_intake, "hook_refusal", lambda *a: None)
    model = make_model()
    ref_model = copy.deepcopy(model)
    w = model[0].weight
    w.grad_dtype = None  # torch would refuse the float gradient below otherwise
    wrong = threading.Event()
    w.register_post_accumulate_grad_hook(  # before the optimizer's own hook
        lambda p: setattr(p, "grad", p.grad.float()) if wrong.is_set() else None)
    opt, ref = build(model, overlap="none"), build(ref_model, overlap="none")
    with pt.hold_task("acc:.*") as release:
        with opt.no_sync():
            backward(model, 0)
        wrong.set()  # the final backward hands over a gradient it refuses: the step failed
        with pytest.raises(GradientError):
            backward(model, 1)
        wrong.clear()
        interrupted(opt.step, "step")
        release.set()
    with pytest.raises(StepFailedError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    replay(ref, ref_model, final=False, step=False)
    goes_on_alike(opt, model, ref, ref_model)


@pytest.mark.parametrize("call", ["state_dict", "refresh_masters", "refresh_device_weights",
                                  "load_state_dict"])
def test_waiting_for_the_chunks_a_final_backward_started(call: str) -> None:
    model, opt, ref_model, ref = twins(overlap="backward")
    saved = opt.state_dict()
    with pt.hold_task("h2d:.*") as release:
        backward(model, 0)  # final: the chunks step during it; their copies are held
        method = getattr(opt, call)
        interrupted((lambda: method(saved)) if call == "load_state_dict" else method, call)
        release.set()
    opt.step()  # the step the backward ran is still this one's
    opt.zero_grad()
    replay(ref, ref_model, final=True, step=True)
    goes_on_alike(opt, model, ref, ref_model)


@pytest.mark.parametrize("call", ["refresh_device_weights", "load_state_dict", "state_dict"])
def test_waiting_for_a_step_in_flight(call: str) -> None:
    model, opt, ref_model, ref = twins(overlap="forward")
    saved = opt.state_dict()
    with pt.hold_task("step:.*") as release:
        backward(model, 0)
        opt.step()  # returns at once; its chunks are held
        method = getattr(opt, call)
        interrupted((lambda: method(saved)) if call == "load_state_dict" else method, call)
        release.set()
    opt.wait_for_step()
    opt.zero_grad()
    replay(ref, ref_model, final=True, step=True)
    goes_on_alike(opt, model, ref, ref_model)


def test_load_state_dict_mid_accumulation_is_refused_and_changes_nothing() -> None:
    """torch's ``load_state_dict()`` keeps ``.grad`` and steps on it; full offload cannot
    carry its host sums across a load, and discarded them silently (a tester's find):
    now refused, the accumulation kept (its folds still held), and ``zero_grad()`` then
    the load go on as torch's would after the same."""
    model, opt, ref_model, ref = twins(overlap="none")
    saved = opt.state_dict()
    with pt.hold_task("acc:.*") as release:
        with opt.no_sync():
            backward(model, 0)
        with pytest.raises(ConfigError, match="between a backward and step"):
            opt.load_state_dict(saved)
        release.set()
    opt.zero_grad()
    opt.load_state_dict(saved)
    ref.load_state_dict(saved)
    goes_on_alike(opt, model, ref, ref_model)


def test_a_synchronous_step_completes_before_the_interrupt_is_passed_on() -> None:
    model, opt, ref_model, ref = twins(overlap="none")
    with pt.hold_task("step:.*") as release:
        backward(model, 0)
        # Interrupted while the chunks are held; they are let go once step() waits again.
        with sigint_inside("step", "_wait_synchronously", "wait_for_step", release=release), \
                pytest.raises(KeyboardInterrupt) as info:
            opt.step()
    assert any("the step completed" in n for n in info.value.__notes__)
    opt.zero_grad()
    replay(ref, ref_model, final=True, step=True)
    assert_same(model, ref_model)  # stepped once, fully
    goes_on_alike(opt, model, ref, ref_model)


# -- OffloadOptimizer's forward waits ---------------------------------------------------------

@pytest.mark.parametrize("attach", [True, False], ids=["hook", "read_guard"])
def test_a_forward_waiting_for_the_step_in_flight(attach: bool) -> None:
    """Ctrl-C while a forward waits for a chunk (a hook's wait, or the read guard's): the
    step goes on, and the interrupt says so (it carried no note: a tester's find)."""
    model = make_model().float()
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    if attach:
        opt.attach(model)
    with pt.hold_task("opt.*") as release:
        backward(model, 0)
        opt.step()  # returns at once; its chunks are held
        opt.zero_grad()
        err = interrupted(lambda: model(batch(1).float()), "wait_for", "wait")
        release.set()
    assert any("must not be repeated" in n for n in getattr(err, "__notes__", ())), err
    opt.wait_for_step()
    ref_model = make_model().float()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    backward(ref_model, 0)
    ref.step()
    assert_same(model, ref_model)  # stepped once


def test_a_step_interrupted_waiting_for_the_step_before_it_can_be_taken_again() -> None:
    """Ctrl-C while ``step()`` waits for the step before it (overlap): that step goes on,
    and the interrupted one had not begun. The note says to call ``step()`` again (it
    said "must not be repeated" alone, and a loop that followed it dropped the step: a
    tester's find); doing so trains as torch does."""
    model = make_model().float()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="overlap",
                           chunk_bytes=256)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)

    def set_grads(m: torch.nn.Module, k: int) -> None:
        g = torch.Generator().manual_seed(k)
        for p in m.parameters():  # (no forward: it would wait for the held chunks)
            p.grad = torch.randn(p.shape, generator=g)

    with pt.hold_task("opt.*") as release:
        set_grads(model, 0)
        opt.step()  # returns at once; its chunks are held
        set_grads(model, 1)
        err = interrupted(opt.step, "_step", "_wait_before_step")
        release.set()
    assert any("call step() again" in n for n in getattr(err, "__notes__", ())), err
    opt.step()  # as the note says
    opt.wait_for_step()
    for k in range(2):
        set_grads(ref_model, k)
        ref.step()
    assert_same(model, ref_model)  # both steps, once each


# -- state transfers reading an optimizer's state --------------------------------------------

@pytest.mark.parametrize("kind", ["full", "offload"])
def test_waiting_for_a_transfer_reading_the_state(kind: str) -> None:
    model = make_model().float() if kind == "offload" else make_model()
    if kind == "full":
        opt: Any = build(model, overlap="none")
        key, call = "master", "load_state_dict"
    else:
        opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), mode="chunked")
        key, call = "exp_avg", "step"
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    saved = opt.state_dict()
    p = model[0].weight
    target = torch.empty(p.shape, dtype=torch.float32)
    with pt.hold_task("verdict") as release:
        ex = StateTransfer({"s": LiveTensor.from_optimizer(opt, p, key)},
                           {"s": LiveTensor(target)}).launch()
        if call == "step":
            backward(model, 1)
        interrupted((lambda: opt.load_state_dict(saved)) if call == "load_state_dict"
                    else opt.step, call, "wait")
        assert not ex.done()
        release.set()
    ex.wait()
    # The reader stays registered until it is done: the call, again, waits for it.
    (opt.load_state_dict(saved) if call == "load_state_dict" else opt.step())


# -- the clipping norm's all-reduce (two processes) ------------------------------------------

def _norm_worker(rank: int, world: int, port: int, queue: Any) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out: dict[str, Any] = {}
        # Each rank's parameters are its own shard here: the norm is summed over
        # the group given.
        model, opt, ref_model, ref = twins(overlap="forward", max_norm=0.05,
                                           process_group=dist.group.WORLD)
        # Rank 0's all-reduce of the norm is held: its step() waits for it there.
        late = pt.hold_task("norm_allreduce") if rank == 0 else contextlib.nullcontext()
        with late as release:
            backward(model, 10 * rank)
            if rank == 0:
                err = interrupted(opt.step, "step", "settle")
                out["note"] = any("the step goes on" in n for n in err.__notes__)
                release.set()
            else:
                opt.step()
        opt.wait_for_step()
        opt.zero_grad()
        backward(ref_model, 10 * rank)
        ref.step()
        ref.zero_grad()
        ref.wait_for_step()
        out["norms"] = (float(opt.grad_norm), float(ref.grad_norm))  # type: ignore[arg-type]
        out["same"] = all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                            ref_model.parameters()))
        queue.put((rank, out))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        queue.put((rank, {"error": repr(err)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_step_waiting_for_the_clipping_norms_all_reduce() -> None:
    from tests._two_ranks import run_two_ranks

    res = run_two_ranks(_norm_worker)
    for rank in (0, 1):
        assert "error" not in res[rank], res[rank]
        assert res[rank]["same"], rank
        mine, ref = res[rank]["norms"]
        assert mine == ref
    assert res[0]["note"]
    assert res[0]["norms"] == res[1]["norms"]  # one global norm


# -- a final micro-step waiting for a transfer reading the state ------------------------------

def _transfer_reading(opt: FullOffloadOptimizer, model: torch.nn.Module) -> Any:
    p = model[0].weight
    return StateTransfer({"s": LiveTensor.from_optimizer(opt, p, "master")},
                         {"s": LiveTensor(torch.empty(p.shape, dtype=torch.float32))})


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_a_final_backward_waiting_for_a_transfer(overlap: str) -> None:
    """Ctrl-C in the first gradient hook of a final backward, waiting for a transfer: the
    backward raises it, and zero_grad() leaves the optimizer as if it never began."""
    model, opt, ref_model, ref = twins(overlap=overlap)
    train(opt, model, range(1))
    train(ref, ref_model, range(1))
    if overlap == "forward":
        with opt.no_sync():  # the protocol: the unmarked backward below is the final one
            backward(model, 6)
    with pt.hold_task("verdict") as release:
        ex = _transfer_reading(opt, model).launch()
        interrupted(lambda: backward(model, 7), "on_grad", "_before_final", "wait")
        release.set()
    ex.wait()
    opt.zero_grad()
    goes_on_alike(opt, model, ref, ref_model)


@pytest.mark.parametrize("overlap", ["none", "forward", "backward"])
def test_step_launching_the_final_micro_step_waiting_for_a_transfer(overlap: str) -> None:
    """Ctrl-C while step() (every backward under no_sync()) waits for a transfer before it
    launches the final micro-step: step() again then steps, once."""
    model, opt, ref_model, ref = twins(overlap=overlap)
    with pt.hold_task("verdict") as release:
        ex = _transfer_reading(opt, model).launch()
        with opt.no_sync():
            backward(model, 0)
        interrupted(opt.step, "step", "_before_final", "wait")
        release.set()
    ex.wait()
    opt.step()
    opt.zero_grad()
    with ref.no_sync():
        replay(ref, ref_model, final=True, step=True)
    goes_on_alike(opt, model, ref, ref_model)


# -- Ctrl-C inside a device part (offload_fraction < 1) ------------------------------------

class _SigintAt:
    """A torch function mode that raises a real SIGINT at the ``n``-th torch call on the
    main thread (the device part's step runs there; the host lanes do not)."""

    def __init__(self, n: int) -> None:
        from torch.overrides import TorchFunctionMode

        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if threading.current_thread() is threading.main_thread():
                    outer.calls += 1
                    if outer.calls == outer.n:
                        signal.raise_signal(signal.SIGINT)
                return out

        self.n, self.calls, self.mode = n, 0, Mode()


@pytest.mark.parametrize("which", ["offload-chunked", "offload-overlap", "full-none",
                                   "full-forward"])
def test_a_ctrl_c_inside_the_device_part_is_passed_on_after_it(
        which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT between two parameters' updates of the device part (torch's for-loop SGD
    on the caller's thread) tore the step: some parameters stepped, the rest not, and
    every later step refused until a checkpoint was loaded (a tester's find). It is
    held back until the device part has stepped, then passed on with a note: the step
    is whole, and training goes on bitwise torch's."""
    from pipeoff import _compat

    torch.manual_seed(0)
    full = which.startswith("full")
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    if full:
        model = model.to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    kw: dict[str, Any] = {"lr": 0.1, "momentum": 0.9, "foreach": False}
    if full:
        opt: Any = FullOffloadOptimizer(model, torch.optim.SGD, overlap=which[5:],
                                        offload_fraction=0.5, **kw)
        ref: Any = FullOffloadOptimizer(ref_model, torch.optim.SGD, overlap="none",
                                        offload_fraction=0.5, **kw)
    else:
        opt = OffloadOptimizer(torch.optim.SGD(model.parameters(), **kw),
                               mode=which[8:], offload_fraction=0.5, chunk_bytes=512)
        ref = torch.optim.SGD(ref_model.parameters(), **kw)
    x = torch.randn(4, 8).to(next(model.parameters()).dtype)
    real = _compat.step_body
    armed: list[_SigintAt] = []

    def step_body(cls: type) -> Any:
        body = real(cls)

        def interrupted(shadow: Any) -> Any:
            if not armed or threading.current_thread() is not threading.main_thread():
                return body(shadow)
            with armed.pop().mode:
                return body(shadow)
        return interrupted

    monkeypatch.setattr(_compat, "step_body", step_body)
    for k in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).float().pow(2).mean().backward()
            if o is opt and k == 1:
                armed.append(_SigintAt(2))  # after the first parameter's update
                with pytest.raises(KeyboardInterrupt) as info:
                    o.step()
                assert any("held back" in n for n in getattr(info.value, "__notes__", []))
            else:
                o.step()
            o.zero_grad()
        getattr(opt, "wait_for_step", lambda: None)()
        getattr(ref, "wait_for_step", lambda: None)()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


def _second_step_interrupted(models: tuple[torch.nn.Module, torch.nn.Module],
                             opts: tuple[Any, Any], x: torch.Tensor, armed: list[bool],
                             check: Callable[[Any, KeyboardInterrupt], None],
                             around: Callable[[], Any] = contextlib.nullcontext) -> None:
    """Three steps of ``opts[0]`` on ``models[0]`` beside ``opts[1]`` on ``models[1]`` (a
    copy), the second ``step()`` of the first with ``armed`` set (the test's SIGINT raised
    inside it) and the interrupt handed to ``check``; the run ends bitwise the second's."""
    opt = opts[0]
    for k in range(3):
        for m, o in zip(models, opts, strict=True):
            m(x).float().pow(2).mean().backward()
            if o is opt and k == 1:
                armed[:] = [True]
                with around(), pytest.raises(KeyboardInterrupt) as info:
                    o.step()
                assert not armed  # (it came inside the step)
                check(o, info.value)
            else:
                o.step()
            o.zero_grad()
    for o in opts:
        getattr(o, "wait_for_step", lambda: None)()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)


def _interrupted_at_the_second_step(fraction: float, overlap: str, armed: list[bool],
                                    note: str, around: Callable[[], Any] = contextlib.nullcontext
                                    ) -> None:
    """A full-offload SGD interrupted at its second step (:func:`_second_step_interrupted`),
    passed on with ``note``; bitwise the same optimizer's uninterrupted run at fraction 1."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]).to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    kw: dict[str, Any] = {"lr": 0.1, "momentum": 0.9, "foreach": False}
    opt = FullOffloadOptimizer(model, torch.optim.SGD, overlap=overlap,
                               offload_fraction=fraction, **kw)
    ref = FullOffloadOptimizer(ref_model, torch.optim.SGD, overlap="none", **kw)

    def check(o: Any, interrupt: KeyboardInterrupt) -> None:
        assert any(note in n for n in interrupt.__notes__)

    _second_step_interrupted((model, ref_model), (opt, ref),
                             torch.randn(4, 8).to(torch.bfloat16), armed, check, around)


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_ctrl_c_once_the_step_ended_whole_does_not_tear_it(
        fraction: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT right after a synchronous step ended (with a device part) was taken for a
    failure of the host part after the device part had stepped: torn, every later step
    refused until a checkpoint was loaded, where the step was whole (a tester's find)."""
    real = Lifecycle._end_step
    armed = [False]

    def end_step(self: Any, acc: Any) -> None:
        real(self, acc)
        if armed and armed.pop():
            signal.raise_signal(signal.SIGINT)  # delivered at the next bytecode

    monkeypatch.setattr(Lifecycle, "_end_step", end_step)
    _interrupted_at_the_second_step(fraction, "none", armed, "completed")


@pytest.mark.parametrize("overlap", ["none", "forward"])
def test_a_ctrl_c_while_step_takes_the_placeholders_out_is_held_back(overlap: str) -> None:
    """A SIGINT between two placeholders taken out of ``.grad`` at ``step()``: the call
    raised with no note (call it again), and the retry took the placeholders already gone
    for gradients the loop dropped: a step without them, silently (a tester's find). The
    interrupt is held until the step is launched, then passed on: the step is taken, once."""
    import inspect
    import sys

    from pipeoff.optim._full_offload import _grads

    lines, first = inspect.getsourcelines(_grads.LoopGrads.withdraw)
    target = first + next(k for k, line in enumerate(lines) if "slot.incoming = None" in line)
    armed = [False]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is _grads.LoopGrads.withdraw.__code__:
            if event == "line" and frame.f_lineno == target and armed and armed.pop():
                signal.raise_signal(signal.SIGINT)  # one placeholder out, the rest in
            return trace
        return None

    @contextlib.contextmanager
    def traced() -> Iterator[None]:
        sys.settrace(trace)
        try:
            yield
        finally:
            sys.settrace(None)

    _interrupted_at_the_second_step(0.0 if overlap == "none" else 0.5, overlap, armed,
                                    "held back", traced)


def _offload_adamw_interrupted_at_the_second_step(
        armed: list[bool], check: Callable[[OffloadOptimizer, KeyboardInterrupt], None],
        **kw: Any) -> None:
    """An ``OffloadOptimizer`` over AdamW (``kw`` its arguments) interrupted at its second
    step (:func:`_second_step_interrupted`); bitwise torch's AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), chunk_bytes=300,
                           **kw)
    if kw.get("mode") == "overlap":
        opt.attach(model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.1)
    _second_step_interrupted((model, ref_model), (opt, ref), torch.randn(4, 8), armed, check)


@pytest.mark.parametrize("mode", ["chunked", "overlap"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("where", ["submit", "forward_waits"])
def test_a_ctrl_c_between_two_lanes_submissions_is_held_back(
        mode: str, fraction: float, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT while ``OffloadOptimizer.step()`` launched its execution, between two
    lanes' submissions, left it half-launched with no note: the retried ``step()``
    launched another over it (a tester's sweep: a SIGINT at every line of ``step()``).
    It is held back until the step is launched and in flight, then passed on with the
    note not to repeat it: training goes on bitwise torch's. (``forward_waits``: once
    the device part has stepped, while the next forward's waits begin.)"""
    from pipeoff.executor import threads
    from pipeoff.optim._waits import ForwardWaits

    if where == "forward_waits" and mode == "chunked":
        pytest.skip("a chunked step begins no forward waits")

    cls, name = ((threads._LaneWorker, "submit") if where == "submit"
                 else (ForwardWaits, "begin"))
    real = getattr(cls, name)
    armed: list[bool] = []

    def interrupted(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        if armed and threading.current_thread() is threading.main_thread():
            armed.clear()
            signal.raise_signal(signal.SIGINT)  # after the first lane's submission
        return out

    def check(opt: OffloadOptimizer, interrupt: KeyboardInterrupt) -> None:
        assert any("must not be repeated" in n for n in getattr(interrupt, "__notes__", []))

    monkeypatch.setattr(cls, name, interrupted)
    _offload_adamw_interrupted_at_the_second_step(armed, check, mode=mode,
                                                  offload_fraction=fraction)


@pytest.mark.parametrize("when", ["before_the_launch", "once_in_flight"])
def test_a_ctrl_c_outside_the_holds_says_whether_the_step_was_launched(
        when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT out of ``step()`` where no hold or wait notes it (before its launch, or
    once it is in flight, on the way out) came with no note (a tester's sweep): it says
    now whether to call ``step()`` again, and following it is bitwise torch's."""
    from pipeoff.optim import _offloaded

    real = _offloaded.with_step_hooks
    armed: list[bool] = []

    def with_step_hooks(inner: Any, closure: Any, step: Any, wait: Any) -> Any:
        if armed and when == "before_the_launch":
            armed.clear()
            signal.raise_signal(signal.SIGINT)
        out = real(inner, closure, step, wait)
        if armed:
            armed.clear()
            signal.raise_signal(signal.SIGINT)
        return out

    def check(opt: OffloadOptimizer, interrupt: KeyboardInterrupt) -> None:
        notes = " ".join(getattr(interrupt, "__notes__", []))
        if when == "before_the_launch":
            assert "call step() again" in notes
            opt.step()
        else:
            assert "must not be repeated" in notes

    monkeypatch.setattr(_offloaded, "with_step_hooks", with_step_hooks)
    _offload_adamw_interrupted_at_the_second_step(armed, check, mode="overlap")


def test_a_ctrl_c_as_step_begins_the_forward_waits_is_held_until_they_have() -> None:
    """A SIGINT landing in step() after the hand-over (the chunks launched) and before
    the next forward's waits began: it came out of step() with no note, and the next
    forward read the weights the step was still writing (a tester's find). It is held
    and passed on after, with the note; the forward waits. A real signal, raised at the
    first line of ForwardWaits.begin (its handler runs at the next bytecode)."""
    from pipeoff.optim import _waits

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="forward")
    x = torch.randn(8, 64)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    opt.wait_for_step()
    fired: list[int] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is _waits.ForwardWaits.begin.__code__ and not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        return None

    model(x).pow(2).mean().backward()
    with pt.hold_task(r"h2d.*") as release:  # the weights' copies wait for the forward
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                opt.step()
        finally:
            sys.settrace(None)
        assert fired
        assert "must not be repeated" in "".join(getattr(info.value, "__notes__", []))
        opt.zero_grad()
        watcher = release_when_waiting(release, "wait_for")
        with torch.no_grad():
            during = model(x)  # waits for the step's weights
        watcher.join()
    opt.wait_for_step()
    with torch.no_grad():
        assert torch.equal(during, model(x))


@pytest.mark.parametrize(("fraction", "at"), [
    (1.0, "move"), (0.5, "move"), (0.5, "device_step")],
    ids=["host-only-at-the-move", "device-part-at-the-move", "device-part-at-its-step"])
def test_a_ctrl_c_inside_the_hand_over_once_the_chunks_may_go_is_held(
        fraction: float, at: str) -> None:
    """A SIGINT inside step()'s hand-over after the step gate opened (the chunks may go)
    and before the step in flight is recorded, or before the device part's own hold.
    Before: it came out bare (no note); with a device part its step was skipped and
    the weights ended 1.4e-2 off torch with no error (at the move), or the step was
    reported torn and every later step refused (at the device part's step). Held and
    passed on with the note; the step whole, the next steps bitwise the reference's.
    A real signal, raised at the first line of the function named (its handler runs at
    the next bytecode)."""
    from pipeoff.optim._full_offload._common import Accumulation, Phase
    from pipeoff.optim._full_offload._device_part import FullDevicePart

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    ref = copy.deepcopy(model)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, overlap="forward",
                               offload_fraction=fraction)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    fired: list[int] = []
    code = FullDevicePart.step.__code__ if at == "device_step" else Accumulation.move.__code__

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if (event == "call" and frame.f_code is code and not fired
                and (at != "move" or frame.f_locals.get("to") is Phase.STEPPING)):
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        return None

    for step in range(3):
        model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        if step == 1:
            sys.settrace(tracer)
            try:
                with pytest.raises(KeyboardInterrupt) as info:
                    opt.step()
            finally:
                sys.settrace(None)
            assert fired
            assert "must not be repeated" in "".join(getattr(info.value, "__notes__", []))
        else:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.wait_for_step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
