"""The fused host step (issue 22): the native kernels bitwise against torch at every
dispatch level this machine reaches, the fold, the thread budget, and the fallbacks
(no compiler, a failed self-test, ``PIPEOFF_NATIVE=0``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeoff import _native
from pipeoff.optim import FullOffloadOptimizer
from pipeoff.optim._full_offload import _host_kernel
from pipeoff.optim._full_offload._host_kernel import AdamHyper
from tests.optim.full_reference import Reference
from tests.optim.test_full_offload import (
    assert_bitwise,
    batches,
    make_model,
    same_bits,
    train,
    train_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")

ROOT = Path(__file__).resolve().parents[2]


def kernel() -> _host_kernel.HostKernel:
    k = _host_kernel.host_kernel()
    if k is None:
        pytest.skip(f"no native kernel here: {_host_kernel.unavailable_reason()}")
    return k


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The native library and the kernel decision forgotten (and forgotten again
    after the test), with a private build cache."""
    monkeypatch.setenv("PIPEOFF_CACHE_DIR", str(tmp_path / "cache"))
    from pipeoff.optim._full_offload import _fold_norm

    _native._reset_for_tests()
    _host_kernel._reset_for_tests()
    _fold_norm.reset_for_tests()
    yield
    _native._reset_for_tests()
    _host_kernel._reset_for_tests()
    _fold_norm.reset_for_tests()


# -- the step kernel against torch._fused_adamw_ --------------------------------------

HYPERS = list(_host_kernel._HYPER)
"""The self-test's hyperparameter sets (both lerp branches and beta1 = 0, Adam's L2
term and AdamW's decay, with and without weight decay, maximize)."""


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, None],
                         ids=["bf16", "fp32", "no_cast"])
@pytest.mark.parametrize("clip", [None, 0.37], ids=["no_clip", "clip"])
@pytest.mark.parametrize("h", HYPERS, ids=["adamw", "adam_l2_beta1_0.3", "maximize_beta1_0.5",
                                           "adam_no_wd", "beta1_0"])
def test_step_is_torch_fused_adam_bit_for_bit(h: AdamHyper, clip: float | None,
                                             out_dtype: torch.dtype | None,
                                             threads: int) -> None:
    k = kernel()
    gen = torch.Generator().manual_seed(7)
    fused = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    for n in [1, 7, 8, 15, 16, 17, 31, 33, 200_003]:  # every tail length, and a threaded body
        base = _host_kernel._values(n, gen)
        ref = [t.clone() for t in base]
        mine = [t.clone() for t in base]
        out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
        for step in range(1, 6):
            grad = ref[1].clone()
            if clip is not None:
                grad.mul_(torch.tensor(clip))  # what the three passes do to the sum
            fused([ref[0]], [grad], [ref[2]], [ref[3]], [], [torch.tensor(float(step))],
                  lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps,
                  amsgrad=False, maximize=h.maximize)
            before = mine[1].clone()
            k.adam_step(mine[0], mine[1], mine[2], mine[3], out, h, step=float(step),
                        scale=clip, threads=threads)
            assert same_bits(mine[1], before)  # the gradient sum is not written
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ref[::2] + ref[3:],
                                  mine[::2] + mine[3:]):
                assert _host_kernel._same(a, b), f"{name}, n={n}, step {step}"
            if out is not None:
                assert _host_kernel._same(ref[0].to(out.dtype), out), f"cast, n={n}"


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("with_sum", [True, False], ids=["sum_and_last", "last_alone"])
@pytest.mark.parametrize("level", sorted(_host_kernel.CONTRACTIONS))
def test_the_fold_inside_the_step_is_the_fold_then_the_step(level: str, with_sum: bool,
                                                           threads: int) -> None:
    """``adam_step(last_grad=...)`` (one pass: fold the last BF16 gradient, step, cast)
    gives the bits of ``fold`` followed by ``adam_step`` at each dispatch level's
    rounding, over the value classes, every tail length, with and without a clip
    scale; at this machine's level, those of torch's add and fused AdamW too."""
    mine = _host_kernel.HostKernel(kernel().lib, level)
    here = level == kernel().level
    gen = torch.Generator().manual_seed(13)
    for h in HYPERS:
        for n in [1, 7, 8, 9, 17, 33, 200_003]:
            base = _host_kernel._values(n, gen)
            last = _host_kernel._values(n, gen)[1].to(torch.bfloat16)
            one, two = [t.clone() for t in base], [t.clone() for t in base]
            out1 = torch.empty(n, dtype=torch.bfloat16)
            out2 = torch.empty(n, dtype=torch.bfloat16)
            for step, clip in ((1, None), (2, 0.37), (3, None)):
                summed = one[1].clone()
                mine.adam_step(one[0], one[1] if with_sum else None, one[2], one[3], out1, h,
                               step=float(step), scale=clip, threads=threads, last_grad=last)
                assert same_bits(one[1], summed) and same_bits(last, last.clone())
                acc = two[1].clone()
                assert _host_kernel.fold(acc, last, first=not with_sum, threads=threads)
                mine.adam_step(two[0], acc, two[2], two[3], out2, h, step=float(step),
                               scale=clip, threads=threads)
                for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), one[::2] + one[3:],
                                      two[::2] + two[3:]):
                    assert _host_kernel._same(a, b), f"{name}, n={n}, step {step}"
                assert _host_kernel._same(out1, out2), f"cast, n={n}, step {step}"
            if here:  # and torch's own bits, from the same start
                ref = [t.clone() for t in base]
                fused = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
                for step, clip in ((1, None), (2, 0.37), (3, None)):
                    grad = ref[1] + last if with_sum else last.float()
                    if clip is not None:
                        grad.mul_(torch.tensor(clip))
                    fused([ref[0]], [grad], [ref[2]], [ref[3]], [], [torch.tensor(float(step))],
                          lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay,
                          eps=h.eps, amsgrad=False, maximize=h.maximize)
                assert all(_host_kernel._same(a, b) for a, b in zip(ref[::2] + ref[3:],
                                                                    one[::2] + one[3:]))


def test_the_fold_inside_the_step_refuses_what_it_does_not_take() -> None:
    k = kernel()
    h = HYPERS[0]
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match="needs grad, last_grad or both"):
        k.adam_step(p, None, m, v, None, h, step=1.0, scale=None, threads=1)
    with pytest.raises(ValueError, match="last_grad must be a contiguous BF16"):
        k.adam_step(p, g, m, v, None, h, step=1.0, scale=None, threads=1, last_grad=g)


def test_a_call_returns_only_when_every_chunk_is_done() -> None:
    """The native region's wait: more threads than cores, so that helpers are
    descheduled mid-chunk; the result is read the moment the call returns."""
    k = kernel()
    gen = torch.Generator().manual_seed(11)
    h = HYPERS[0]
    n = 1 << 21
    base = [t.abs() if i == 3 else t
            for i, t in enumerate(_host_kernel._values(n, gen))]
    want = [t.clone() for t in base]
    k.adam_step(want[0], want[1], want[2], want[3], None, h, step=1.0, scale=None, threads=1)
    for _ in range(10):
        got = [t.clone() for t in base]
        out = torch.empty(n, dtype=torch.bfloat16)
        k.adam_step(got[0], got[1], got[2], got[3], out, h, step=1.0, scale=None, threads=16)
        assert _host_kernel._same(got[0], want[0]) and _host_kernel._same(got[3], want[3])
        assert _host_kernel._same(out, want[0].to(torch.bfloat16))


WAKEUP_TIMEOUT_S = 20.0
"""How long the region may take to return once its window was held open (it takes
milliseconds; only a lost wake-up, which never returns, gets there)."""


def test_the_last_chunks_wake_up_reaches_a_caller_about_to_wait(tmp_path: Path) -> None:
    """The region's end (hoststep.c ``region_work``): the helper that finishes the last
    chunk broadcasts ``all_done`` holding the region's mutex, so the wake-up cannot fall
    between the caller's ``done < chunks`` check and its ``pthread_cond_wait``: there it
    would be lost and the kernel call would never return.

    tests/optim/region_wakeup.c compiles hoststep.c as it is, with three pthread calls
    wrapped, and holds that window open by order (the caller, about to wait, waits until
    the last chunk's helper has broadcast or is taking the mutex), so a broadcast outside
    the mutex is lost every time, not once in a while."""
    cc = _native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "region_wakeup"
    build = subprocess.run(
        [*cc, "-O0", "-std=gnu99", "-pthread", f"-I{_native.SOURCE.parent}", "-o", str(exe),
         str(Path(__file__).with_name("region_wakeup.c")), "-lm"],
        capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    try:
        run = subprocess.run([str(exe)], capture_output=True, text=True,
                             timeout=WAKEUP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the region never returned: the last chunk's wake-up was lost (its "
                    "broadcast made without the region's mutex, between the caller's "
                    "check and its wait)")
    assert run.returncode == 0 and run.stdout.strip() == "returned", (run.stdout, run.stderr)


def test_the_region_returns_after_its_last_chunk(tmp_path: Path) -> None:
    """The region's return (hoststep.c ``parallel``): the caller waits until every chunk
    is done. tests/optim/region_returns.c compiles hoststep.c as it is, with
    ``pthread_cond_wait`` wrapped, and holds a helper's chunk open until the caller is
    about to wait for the region: a region that returns without that wait returns
    with the chunk open, every time (the timed test above only when a helper is
    descheduled mid-chunk)."""
    cc = _native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "region_returns"
    build = subprocess.run(
        [*cc, "-O0", "-std=gnu99", "-pthread", f"-I{_native.SOURCE.parent}", "-o", str(exe),
         str(Path(__file__).with_name("region_returns.c")), "-lm"],
        capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True,
                         timeout=WAKEUP_TIMEOUT_S, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "returned", (run.stdout, run.stderr)


def test_the_scalars_round_as_torch_rounds_them() -> None:
    """Hyperparameters whose float rounding matters (1 - beta1 not exact, lr * wd tiny)."""
    k = kernel()
    gen = torch.Generator().manual_seed(3)
    h = AdamHyper(lr=7.77e-5, beta1=0.8999999, beta2=0.99951, eps=3.3e-7, weight_decay=1e-5,
                  decoupled=True, maximize=False)
    base = _host_kernel._values(1003, gen)
    ref, mine = [t.clone() for t in base], [t.clone() for t in base]
    for step in (1, 2, 1000, 123456):
        torch._fused_adamw_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [],
                            [torch.tensor(float(step))], lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                            weight_decay=h.weight_decay, eps=h.eps, amsgrad=False,
                            maximize=False)
        k.adam_step(mine[0], mine[1], mine[2], mine[3], None, h, step=float(step), scale=None,
                    threads=1)
        assert all(_host_kernel._same(a, b) for a, b in zip(ref, mine))


def test_bad_tensors_are_refused_by_name() -> None:
    k = kernel()
    h = HYPERS[0]
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match="grad must be a contiguous FP32"):
        k.adam_step(p, g.double(), m, v, None, h, step=1.0, scale=None, threads=1)
    with pytest.raises(ValueError, match="exp_avg_sq must be"):
        k.adam_step(p, g, m, torch.zeros(16)[::2], None, h, step=1.0, scale=None, threads=1)
    with pytest.raises(ValueError, match="out must be a contiguous BF16 or FP32"):
        k.adam_step(p, g, m, v, torch.zeros(8, dtype=torch.float16), h, step=1.0, scale=None,
                    threads=1)


@pytest.mark.parametrize("level", ["default", "avx2"])
def test_other_dispatch_levels_pass_the_self_test(level: str) -> None:
    """torch's bits change with ATEN_CPU_CAPABILITY; the kernel follows each level this
    machine can run (the machine's own is every other test here)."""
    if level == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    code = ("import torch, warnings; warnings.simplefilter('error')\n"
            "from pipeoff.optim._full_offload import _host_kernel as hk\n"
            "k = hk.host_kernel()\n"
            "print(torch.backends.cpu.get_cpu_capability(), k is not None, "
            "hk.unavailable_reason())\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    cap, ok, why = proc.stdout.split(maxsplit=2)
    assert cap == level.upper() and ok == "True", proc.stdout


def test_an_unknown_rounding_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                       fresh_kernels: None) -> None:
    """A self-test that fails (here: the tail's contractions taken away) turns the
    kernel off, and says so."""
    level = torch.backends.cpu.get_cpu_capability()
    body, _, vec, nan = _host_kernel.CONTRACTIONS[level]
    if body == 0:
        pytest.skip("torch fuses nothing at this dispatch level")
    monkeypatch.setitem(_host_kernel.CONTRACTIONS, level, (body, 0, vec, nan))  # type: ignore[index]
    with pytest.warns(RuntimeWarning, match="self-test against torch.s fused AdamW failed"):
        assert _host_kernel.host_kernel() is None
    assert "differs in" in (_host_kernel.unavailable_reason() or "")


# -- the fold ------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fold_is_torch_add_bit_for_bit(dtype: torch.dtype, threads: int) -> None:
    if _native.library() is None:
        pytest.skip(f"no native kernels: {_native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(5)
    for n in [1, 13, 64, 65, 300_001]:
        g1, g2 = (_host_kernel._values(n, gen)[0].to(dtype) for _ in range(2))
        acc = torch.full((n,), 7.0)
        assert _host_kernel.fold(acc, g1, first=True, threads=threads)
        assert same_bits(acc, g1.float())
        assert _host_kernel.fold(acc, g2, first=False, threads=threads)
        assert _host_kernel._same(acc, g1.float() + g2)


def test_fold_declines_what_it_does_not_take() -> None:
    acc = torch.zeros(8)
    assert not _host_kernel.fold(acc, torch.zeros(8, dtype=torch.float16), first=True, threads=1)
    assert not _host_kernel.fold(acc, torch.zeros(16)[::2], first=True, threads=1)
    assert not _host_kernel.fold(acc.double(), torch.zeros(8), first=True, threads=1)


def test_default_threads_is_this_ranks_share(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _host_kernel.default_threads() == cpus
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus * 4))
    assert _host_kernel.default_threads() == 1
    before = torch.get_num_threads()
    kernel().adam_step(*(torch.zeros(1 << 18) for _ in range(4)), None, HYPERS[0], step=1.0,
                       scale=None, threads=2)
    assert torch.get_num_threads() == before  # the caller's torch threads untouched


# -- in the optimizer ----------------------------------------------------------------

def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    first = [model.emb.weight, model.l1.weight, model.l1.bias]
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": first, "betas": (0.3, 0.99)},
            {"params": rest, "lr": 3e-3, "weight_decay": 0.0, "maximize": True}]


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The step through the native kernel, or forced onto torch's path; counts the
    native calls either way."""
    calls = [0]
    real = _host_kernel.HostKernel.adam_step

    def counted(self: Any, *args: Any, **kw: Any) -> float | None:
        calls[0] += 1
        return real(self, *args, **kw)

    monkeypatch.setattr(_host_kernel.HostKernel, "adam_step", counted)
    if request.param == "torch":
        monkeypatch.setattr(_host_kernel, "host_kernel", lambda **kw: None)
    elif _host_kernel.host_kernel() is None:
        pytest.skip(f"no native kernel here: {_host_kernel.unavailable_reason()}")
    yield request.param
    assert (calls[0] > 0) == (request.param == "native")


# (Clipping needs the whole norm before any step: refused with overlap="backward".)
@pytest.mark.parametrize(("overlap", "clip"), [("none", None), ("none", 0.05),
                                               ("forward", None), ("forward", 0.05),
                                               ("backward", None)])
@pytest.mark.parametrize("accumulate", ["cpu", "gpu"], ids=lambda v: f"accumulate={v}")
def test_full_offload_with_fused_adamw_is_bitwise(accumulate: str, overlap: str,
                                                  clip: float | None, path: str) -> None:
    model = make_model()
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    ref = Reference(model, torch.optim.AdamW, groups=_groups, max_norm=clip, **kw)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, params=_groups(model),
                               accumulate=accumulate, overlap=overlap, max_norm=clip, **kw)
    data = batches(3, 2, side="not_final")
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)
    sd = opt.state_dict()["state"]
    for k, m in enumerate(m for g in ref.groups for m in g["params"]):  # param_groups order
        if m in ref.opt.state:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert same_bits(sd[k][key], ref.opt.state[m][key]), key
            assert sd[k]["step"].dtype == ref.opt.state[m]["step"].dtype


def test_adam_and_a_resumed_checkpoint_are_bitwise(path: str, tmp_path: Path) -> None:
    """Adam's L2 term; model and optimizer saved, loaded into a fresh model and
    optimizer, trained on: the same bits as training straight through."""
    kw = {"lr": 1e-2, "weight_decay": 0.05, "fused": True}
    data = batches(4, 2)
    whole = make_model()
    ref = Reference(whole, torch.optim.Adam, **kw)
    train_reference(ref, data)
    first = make_model()
    opt1 = FullOffloadOptimizer(first, torch.optim.Adam, **kw)
    train(opt1, first, data[:2])
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, tmp_path / "ck.pt")
    second = make_model(seed=5)
    opt2 = FullOffloadOptimizer(second, torch.optim.Adam, **kw)
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    second.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    train(opt2, second, data[2:])
    assert_bitwise(second, ref)


def test_a_native_step_that_does_not_wait_for_accumulation_is_wrong() -> None:
    """The proof that the step's dependency on the last fold matters for the native
    path too: without it, a delayed fold lands after the step read the sum."""
    if _host_kernel.host_kernel() is None:
        pytest.skip(f"no native kernel here: {_host_kernel.unavailable_reason()}")
    from pipeoff import testing
    from tests.optim.test_full_offload import differs

    model = make_model()
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    ref = Reference(model, torch.optim.AdamW, **kw)
    with testing.disable("accumulate_dep"):
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="backward",
                                   chunk_numel=200, **kw)
        data = batches(2, 2)
        with testing.delay_lane("accumulate", 0.01):
            train(opt, model, data)
    train_reference(ref, data)
    assert differs(model, ref)


def test_for_loop_adamw_keeps_torchs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without fused=True the kernel cannot give the same bits (eager CPU sqrt is not
    correctly rounded), so it is not used."""
    monkeypatch.setattr(_host_kernel.HostKernel, "adam_step",
                        lambda *a, **k: pytest.fail("the native step ran"))
    model = make_model()
    ref = Reference(model, torch.optim.AdamW, lr=1e-2)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    data = batches(2, 2)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


# -- no compiler, or turned off ------------------------------------------------------

def test_no_compiler_falls_back_cleanly(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture,
                                        fresh_kernels: None) -> None:
    """Without a compiler the fallback is expected, nothing to act on: it says so on
    the ``pipeoff`` logger (INFO), not as a warning."""
    monkeypatch.setenv("CC", str(Path("/nonexistent/cc")))
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="pipeoff"):
        warnings.simplefilter("error")
        assert _host_kernel.host_kernel() is None
    assert any(re.search("fused host step is off.*nonexistent", r.getMessage())
               for r in caplog.records), caplog.records
    assert _native.library() is None
    assert not _host_kernel.fold(torch.zeros(4), torch.zeros(4), first=True, threads=1)
    model = make_model()
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    ref = Reference(model, torch.optim.AdamW, **kw)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **kw)
    data = batches(2, 3)
    train(opt, model, data)
    train_reference(ref, data)
    assert_bitwise(model, ref)


def test_no_compiler_on_the_path_in_a_fresh_process(tmp_path: Path) -> None:
    """As on a machine without one: PATH has no cc, gcc or clang, and CC is unset."""
    code = ("import logging, warnings, torch\n"
            "from pipeoff import _native\n"
            "from pipeoff.optim._full_offload import _host_kernel as hk\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('error')  # nothing to act on: no warning\n"
            "    assert hk.host_kernel() is None\n"
            "print(_native.unavailable_reason())\n")
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(tmp_path), PIPEOFF_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "no C compiler found" in proc.stdout
    assert "INFO:pipeoff:pipeoff: the fused host step is off" in proc.stderr


def test_pipeoff_native_0_turns_it_off_silently(monkeypatch: pytest.MonkeyPatch,
                                                fresh_kernels: None) -> None:
    monkeypatch.setenv("PIPEOFF_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _host_kernel.host_kernel() is None
    assert "PIPEOFF_NATIVE=0" in (_native.unavailable_reason() or "")


def test_a_build_is_cached_and_reused(fresh_kernels: None) -> None:
    if _native._compiler() is None:
        pytest.skip("no C compiler here")
    assert _native.library() is not None
    built = list(Path(os.environ["PIPEOFF_CACHE_DIR"]).glob("hoststep-*.so"))
    assert len(built) == 1
    # Readable by other users (a cache warmed by another user, or as root).
    assert built[0].stat().st_mode & 0o777 == 0o755
    assert built[0].with_suffix(".sha256").stat().st_mode & 0o777 == 0o644
    mtime = built[0].stat().st_mtime_ns
    _native._reset_for_tests()
    assert _native.library() is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


@pytest.mark.slow
def test_the_full_offload_suite_passes_with_the_native_kernels_off(tmp_path: Path) -> None:
    """The quick full-offload suite, in a fresh process with ``PIPEOFF_NATIVE=0``:
    every path the kernels replace still runs, and gives the reference's bits."""
    env = {**os.environ, "PIPEOFF_NATIVE": "0", "PIPEOFF_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         "tests/optim/test_full_offload.py", "tests/optim/test_full_offload_cuda.py",
         "tests/optim/test_host_kernel.py", "-k", "not test_host_kernel or torch"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout.strip().splitlines()[-1:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in tail[0], tail


@pytest.mark.parametrize("after_ops", [0, 3, 10, 25, 40, 60, 90, 140])
def test_a_chunk_that_fails_part_way_is_torn_when_it_wrote(path: str, after_ops: int) -> None:
    """A failure inside the step chunk: if any master was written it is reported torn
    (load a checkpoint), never dirty (zero_grad() and train on): fused and native
    kernels leave no trace in the version counters by themselves."""
    from pipeoff import StepFailedError, testing
    from tests.optim.test_full_offload import loss_fn

    model = make_model()
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, overlap="none")
    data = batches(2, 1)
    loss_fn(model, data[0][0]).backward()
    opt.step()
    opt.zero_grad()
    before = [rec.master.clone() for rec in opt._registry]
    loss_fn(model, data[1][0]).backward()
    with testing.fail_work("step:0", RuntimeError("chunk failed"), after_ops=after_ops), \
            contextlib.suppress(RuntimeError):
        opt.step()
    wrote = any(not same_bits(rec.master, b) for rec, b in zip(opt._registry, before))
    with pytest.raises(StepFailedError) as info:
        opt.step()
    dirty = "before any master was stepped" in str(info.value)
    assert not (wrote and dirty), str(info.value)  # never "dirty" after a write



def test_beta1_zero_keeps_the_sign_of_zeros_in_the_tail(path: str) -> None:
    """beta1 = 0: torch's vector body and its scalar tail (the last n % 8 elements)
    compute the moment as g + (w - 1)(g - m) and g - (g - m)(1 - w), which differ in
    the sign of a zero; a -0.0 parameter with -0.0 gradients shows it."""
    model = nn.Linear(15, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(-0.0)
    kw = {"lr": 1e-2, "betas": (0.0, 0.99), "fused": True}
    ref = Reference(model, torch.optim.AdamW, **kw)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="none", **kw)
    for m in (model, ref.model):
        m.weight.grad = None
    for _ in range(2):
        model.weight.grad = torch.full_like(model.weight, -0.0)
        opt.step()
        opt.zero_grad()
        ref.acc = {id(ref.params[0]): torch.full((1, 15), -0.0)}
        ref.step()
    opt.wait_for_step()
    assert same_bits(model.weight, ref.model.weight)
    m = opt.state_dict()["state"][0]["exp_avg"]
    assert same_bits(m, ref.opt.state[ref.masters[id(ref.params[0])]]["exp_avg"])


def test_a_float64_default_dtype_changes_nothing(path: str) -> None:
    model = make_model()
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
    ref = Reference(model, torch.optim.AdamW, **kw)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, **kw)
    data = batches(2, 2)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _host_kernel._reset_for_tests()  # the self-test runs under float64 too
        if path == "torch":
            _host_kernel._decided = True  # (the fixture keeps torch's path)
        train(opt, model, data)
    finally:
        torch.set_default_dtype(before)
    train_reference(ref, data)
    assert_bitwise(model, ref)


def test_warnings_as_errors_fail_the_constructor_not_a_step(monkeypatch: pytest.MonkeyPatch,
                                                           fresh_kernels: None) -> None:
    """The fallback's warning is raised on the caller's thread, when the optimizer is
    built: under ``-W error`` that fails there, never inside a lane (which would
    lose the step's gradients)."""
    monkeypatch.setattr(_host_kernel, "_self_test_apart", lambda kernel: "1 bit apart")
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match="fused host step is off.*1 bit apart"):
            FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)  # warned once
        train(opt, model, batches(2, 2))


@pytest.mark.slow  # three builds
def test_a_damaged_cached_library_is_rebuilt(fresh_kernels: None) -> None:
    if _native._compiler() is None:
        pytest.skip("no C compiler here")
    assert _native.library() is not None
    (built,) = Path(os.environ["PIPEOFF_CACHE_DIR"]).glob("hoststep-*.so")
    data = built.read_bytes()
    for damaged in (data[: len(data) // 3], b"not a shared object"):
        # (Replaced, not written in place: this process has the original mapped.)
        (built.parent / "tmp").write_bytes(damaged)
        os.replace(built.parent / "tmp", built)
        _native._reset_for_tests()
        assert _native.library() is not None, _native.unavailable_reason()
        assert built.read_bytes() == data or len(built.read_bytes()) > len(damaged)


def test_cc_with_arguments_is_split_as_a_shell_would(monkeypatch: pytest.MonkeyPatch,
                                                     fresh_kernels: None) -> None:
    cc = _native._compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("CC", f"{cc[0]} -g0")
    assert _native._compiler() == [cc[0], "-g0"]
    assert _native.library() is not None, _native.unavailable_reason()


@pytest.mark.parametrize("value", ["off", "false", "NO"])
def test_every_off_value_of_pipeoff_native_is_silent(value: str, monkeypatch: pytest.MonkeyPatch,
                                                     fresh_kernels: None) -> None:
    monkeypatch.setenv("PIPEOFF_NATIVE", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _host_kernel.host_kernel() is None
    assert f"PIPEOFF_NATIVE={value}" in (_native.unavailable_reason() or "")


def test_an_older_checkpoints_plain_number_step_loads_as_torch_loads_it(path: str) -> None:
    model = nn.Linear(8, 8).to(torch.bfloat16)
    plain = torch.optim.AdamW([p.detach().float().requires_grad_() for p in model.parameters()],
                              lr=1e-3, fused=True)
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    plain.step()
    sd = plain.state_dict()
    for st in sd["state"].values():
        st["step"] = int(st["step"])  # as an older checkpoint has it
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    opt.load_state_dict(sd)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.wait_for_step()
    plain.load_state_dict(sd)
    step = opt.state_dict()["state"][0]["step"]
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and float(step) == 2.0


def test_a_failed_step_is_advanced_exactly_when_it_may_have_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path's torn signal: a fused SGD (no version bump, no step count)
    that failed after its first group wrote is advanced; an Adam refused before its
    first write (a tensor lr with foreach) is not."""
    from pipeoff.optim import _update

    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9,
                          fused=True)
    hyper = {k: v for k, v in sgd.param_groups[0].items() if k != "params"}
    real, calls = torch._fused_sgd_, []

    def flaky(*args: Any, **kw: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second group's kernel failed")
        real(*args, **kw)

    monkeypatch.setattr(torch, "_fused_sgd_", flaky)
    p1, p2 = torch.zeros(4), torch.zeros(4)
    g1, g2 = _update.ChunkGroup(hyper), _update.ChunkGroup(dict(hyper, lr=0.2))
    g1.add(p1, torch.ones(4), {"momentum_buffer": torch.zeros(4)}, ("momentum_buffer",), {})
    g2.add(p2, torch.ones(4), {"momentum_buffer": torch.zeros(4)}, ("momentum_buffer",), {})
    with pytest.raises(RuntimeError, match="second group"):
        _update.step_chunk(_update.make_shadow(sgd), [g1, g2])
    assert float(p1[0]) != 0.0 and g1.advanced

    adam = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1, foreach=True)
    hyper = {k: v for k, v in adam.param_groups[0].items() if k != "params"}
    hyper["lr"] = torch.tensor(0.1)  # refused by torch before any write
    p = torch.zeros(4)
    g = _update.ChunkGroup(hyper)
    g.add(p, torch.ones(4), {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}, (), {})
    with pytest.raises(RuntimeError, match="lr as a Tensor"):
        _update.step_chunk(_update.make_shadow(adam), [g])
    assert not g.advanced and torch.equal(p, torch.zeros(4))


def test_a_beta_of_one_edited_into_the_groups_steps_as_torch_does(path: str) -> None:
    """betas=(1.0, ...) set after construction (torch checks betas only then): the
    bias correction divides by zero, which torch's C++ does in IEEE arithmetic
    (inf, NaN), and so does pipeoff, instead of raising in Python."""
    model = make_model()
    kw = {"lr": 1e-2, "fused": True}
    ref = Reference(model, torch.optim.AdamW, **kw)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, overlap="none", **kw)
    for groups in (opt.param_groups, ref.opt.param_groups):
        groups[0]["betas"] = (1.0, 0.999)
    data = batches(1, 1)
    train(opt, model, data)
    train_reference(ref, data)
    for p, q in zip(model.parameters(), ref.model.parameters()):
        assert _host_kernel._same(p.detach(), q.detach())
