"""StateTransfer in one process: layouts, residencies, refusals, faults, the optimizers."""

from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import pytest
import torch

import pipeoff
import pipeoff.testing as pt
from pipeoff import ConfigError, TaskGraph, TaskKind, execute
from pipeoff.transfer import LiveTensor, StateTransfer, TransferRefusedError, TransferTornError
from tests._stacks import release_when_waiting
from tests.transfer.transfer_worker import SENTINEL, corner, padding_kept

SHAPES = [(3, 1000), (5, 7), (1,), (0, 4), (4, 3, 2), ()]


def padded(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
           residency: str | None = None) -> tuple[torch.Tensor, LiveTensor]:
    storage = torch.full(tuple(s + 1 for s in shape), SENTINEL).to(dtype)
    return storage, LiveTensor(storage, box=((0,) * len(shape), shape), global_shape=shape,
                               residency=residency)


def fulls(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{k}": torch.randn(s, generator=g).to(dtype) for k, s in enumerate(SHAPES)}


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("budget", [128, 1 << 16])
def test_every_shape_is_copied_bitwise_and_padding_is_kept(
        src_dtype: torch.dtype, dst_dtype: torch.dtype, budget: int) -> None:
    src = fulls(src_dtype)
    tg = {k: padded(tuple(v.shape), dst_dtype, "device") for k, v in src.items()}
    t = StateTransfer({k: LiveTensor(v) for k, v in src.items()},
                      {k: lt for k, (_, lt) in tg.items()}, host_budget_bytes=budget,
                      device_budget_bytes=budget,
                      cast={"*": dst_dtype} if dst_dtype != src_dtype else None)
    t.run()
    for k, v in src.items():
        assert torch.equal(corner(tg[k][0], tuple(v.shape)), v.to(dst_dtype)), k
        assert padding_kept(tg[k][0], tuple(v.shape)), k
    summary = t.last_trace.summary()  # type: ignore[union-attr]
    assert summary.peak_host_staging_bytes <= budget
    assert summary.peak_device_staging_bytes <= budget
    assert t.last_plan is not None and (budget > 128 or len(t.last_plan.rounds) > 40)


PAIRS = [("pageable", "pageable", "host"), ("pageable", "device", "h2d"),
         ("device", "pageable", "d2h"), ("device", "device", "d2d")]


@pytest.mark.parametrize(("src_res", "dst_res", "lane"), PAIRS)
def test_every_residency_pair_on_the_cpu_stand_in(src_res: str, dst_res: str, lane: str) -> None:
    full = torch.randn(9, 13)
    storage, dst = padded((9, 13), residency=dst_res)
    t = StateTransfer({"w": LiveTensor(full, residency=src_res)}, {"w": dst},
                      host_budget_bytes=256, device_budget_bytes=256)
    t.run()
    assert torch.equal(corner(storage, (9, 13)), full)
    lanes = {r.lane for r in t.last_trace.tasks if r.name.startswith("copy")}  # type: ignore[union-attr]
    assert lanes == {lane}


@pytest.mark.parametrize("lane", ["host", "h2d", "d2h", "d2d"])
def test_delayed_lanes_do_not_change_a_bit(lane: str) -> None:
    src = fulls()
    for res in ("device", "pageable"):
        tg = {k: padded(tuple(v.shape), residency=res) for k, v in src.items()}
        with pt.delay_lane(lane, 0.002):
            StateTransfer({k: LiveTensor(v, residency="device" if res == "pageable" else None)
                           for k, v in src.items()}, {k: lt for k, (_, lt) in tg.items()},
                          host_budget_bytes=512).run()
        for k, v in src.items():
            assert torch.equal(corner(tg[k][0], tuple(v.shape)), v), (lane, res, k)


def test_the_synchronous_schedule_is_the_degenerate_case() -> None:
    src = fulls()
    out = {}
    for schedule in ("synchronous", "pipelined"):
        tg = {k: padded(tuple(v.shape)) for k, v in src.items()}
        t = StateTransfer({k: LiveTensor(v) for k, v in src.items()},
                          {k: lt for k, (_, lt) in tg.items()}, host_budget_bytes=256,
                          schedule=schedule)  # type: ignore[arg-type]
        t.run()
        out[schedule] = {k: s.clone() for k, (s, _) in tg.items()}
        assert t.last_execution is not None
        assert t.last_execution.plan.schedule.kind == schedule
    assert all(torch.equal(out["synchronous"][k], out["pipelined"][k]) for k in src)


# -- refusals ---------------------------------------------------------------------------
def failed_completion() -> Any:
    g = TaskGraph()

    def boom(ctx: Any) -> None:
        raise RuntimeError("the step failed")

    g.add_task("opt0", TaskKind.HOST, boom)
    return execute(g).events_for("opt0")[0]


def meta() -> LiveTensor:
    return LiveTensor(torch.empty(5, 7, device="meta"))


REFUSED = {
    "none": (lambda: LiveTensor(None, global_shape=(5, 7), dtype=torch.float32), {},
             "unavailable"),
    "meta": (meta, {}, "meta tensor"),
    "freed": (lambda: LiveTensor(_freed()), {}, "unavailable"),
    "pinned": (lambda: LiveTensor(torch.randn(5, 7), residency="pinned"), {},
               "declared pinned"),
    "box": (lambda: LiveTensor(torch.randn(5, 7), box=((1, 0), (5, 7))), {},
            "outside the global shape"),
    "storage": (lambda: LiveTensor(torch.randn(4, 7), box=((0, 0), (5, 7)),
                                   global_shape=(5, 7)), {}, "cannot hold"),
    "readiness": (lambda: LiveTensor(torch.randn(5, 7), ready=failed_completion()), {},
                  "readiness completion (task 'opt0' of another execution) failed"),
    "budget": (lambda: LiveTensor(torch.randn(5, 7)), {"host_budget_bytes": 15},
               "less than one"),
    "dtype": (lambda: LiveTensor(torch.randn(5, 7).double()), {}, "no cast is declared"),
}


def _freed() -> torch.Tensor:
    t = torch.randn(5, 7)
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_name_the_key_and_write_nothing(name: str) -> None:
    make, kw, words = REFUSED[name]
    target = torch.full((5, 7), SENTINEL)
    t = StateTransfer({"w": make()}, {"w": LiveTensor(target)}, **kw)  # type: ignore[arg-type]
    with pytest.raises(TransferRefusedError) as info:
        t.run()
    assert info.value.rank == 0 and info.value.key == "w"
    assert words in str(info.value), str(info.value)
    assert bool((target == SENTINEL).all())


@pytest.mark.parametrize(("src_res", "dst_res", "lane"), PAIRS)
def test_a_slow_preflight_that_refuses_leaves_the_target_unwritten(
        src_res: str, dst_res: str, lane: str) -> None:
    """Hazard: a local copy that does not wait for the preflight would read a source
    whose readiness failed (its data was never written) into the target, which the
    refusal promises is untouched."""
    storage, dst = padded((5, 7), residency=dst_res)
    src = LiveTensor(torch.randn(5, 7), residency=src_res, ready=failed_completion())
    with pt.delay_task("preflight", 0.1), pytest.raises(TransferRefusedError, match="readiness"):
        StateTransfer({"w": src}, {"w": dst}).run()
    assert bool((storage == SENTINEL).all())


def test_an_extra_key_is_refused() -> None:
    with pytest.raises(TransferRefusedError, match="'extra': a target with no source"):
        StateTransfer({"w": LiveTensor(torch.ones(3))},
                      {"w": LiveTensor(torch.zeros(3)),
                       "extra": LiveTensor(torch.zeros(3))}).run()


def test_single_process_transfers_may_run_at_once() -> None:
    # No collectives, so nothing to interleave: a second launch is not refused.
    src, dst, dst2 = torch.randn(64), torch.zeros(64), torch.zeros(64)
    t = StateTransfer({"w": LiveTensor(src)}, {"w": LiveTensor(dst)}, host_budget_bytes=64)
    t2 = StateTransfer({"w": LiveTensor(src)}, {"w": LiveTensor(dst2)}, host_budget_bytes=64)
    with pt.hold_task("verdict") as release:
        ex = t.launch()
        ex2 = t2.launch()
        release.set()
        ex.wait()
        ex2.wait()
    assert torch.equal(src, dst) and torch.equal(src, dst2)


@pytest.mark.parametrize(("make", "words"), [
    (lambda b: ({"w": LiveTensor(b[:8])}, {"w": LiveTensor(b[8:16])}), None),
    (lambda b: ({"w": LiveTensor(b[:16])}, {"w": LiveTensor(b[8:24])}),
     "overlaps the source of key 'w'"),
    (lambda b: ({"a": LiveTensor(b[:8]), "b": LiveTensor(b[8:16])},
                {"a": LiveTensor(b[16:24]), "b": LiveTensor(b[20:28])}),
     "overlaps the target of key"),
    # Another key's source inside a target, as an in-place gather's would be: what it
    # read depended on the keys' names (a, before w: the old values; z, after: w's).
    (lambda b: ({"a": LiveTensor(b[0:4]), "w": LiveTensor(b[16:24])},
                {"a": LiveTensor(b[24:28]), "w": LiveTensor(b[0:8])}),
     "'w': its target memory overlaps the source of key 'a'"),
    # Tied targets: the last key's values, whatever the other key's source held.
    (lambda b: ({"emb": LiveTensor(b[0:4]), "head": LiveTensor(b[4:8])},
                {"emb": LiveTensor(b[16:20]), "head": LiveTensor(b[16:20])}),
     "two keys cannot write the same memory"),
    (lambda b: ({"w": LiveTensor(b[:1])}, {"w": LiveTensor(b[1:2].expand(4), box=((0,), (1,)),
                                                           global_shape=(1,))}), None),
    (lambda b: ({"w": LiveTensor(b[:4])}, {"w": LiveTensor(b[8:9].expand(4))}),
     "stride of 0"),
])
def test_targets_that_alias_memory_are_refused(make: Any, words: str | None) -> None:
    buf = torch.arange(32, dtype=torch.float32)
    src, dst = make(buf)
    t = StateTransfer(src, dst, host_budget_bytes=32)
    if words is None:
        t.run()
        return
    before = buf.clone()
    with pytest.raises(TransferRefusedError, match=words):
        t.run()
    assert torch.equal(buf, before)


@pytest.mark.parametrize(("make", "words"), [
    (lambda m: ({"k": LiveTensor(m(0, 8))}, {"k": LiveTensor(m(4, 8))}),
     "overlaps the source of key 'k'"),
    (lambda m: ({"a": LiveTensor(torch.ones(8)), "b": LiveTensor(torch.full((8,), 2.0))},
                {"a": LiveTensor(m(0, 8)), "b": LiveTensor(m(4, 8))}),
     "overlaps the target of key"),
    (lambda m: ({"k": LiveTensor(m(0, 8))}, {"k": LiveTensor(m(8, 8))}), None),
], ids=["source", "target", "apart"])
def test_memory_shared_by_two_storages_is_compared_by_address(make: Any,
                                                              words: str | None) -> None:
    """Two storages over one buffer (``torch.frombuffer``, ``torch.from_numpy`` of
    overlapping slices): the overlap check compared offsets within one storage only,
    and such a transfer wrote wrong values silently (a tester's find)."""
    buf = bytearray(64)

    def mem(lo: int, n: int) -> torch.Tensor:
        return torch.frombuffer(buf, dtype=torch.float32, offset=4 * lo, count=n)

    mem(0, 16).copy_(torch.arange(16.0))
    src, dst = make(mem)
    t = StateTransfer(src, dst, host_budget_bytes=16)
    if words is None:
        t.run()
        assert torch.equal(mem(8, 8), torch.arange(8.0))
        return
    before = bytes(buf)
    with pytest.raises(TransferRefusedError, match=words):
        t.run()
    assert bytes(buf) == before


def test_parameters_as_sources_and_targets_record_no_autograd_history() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    q = torch.nn.Parameter(torch.zeros(4, 4))
    plain = torch.zeros(4, 4)
    StateTransfer({"p": LiveTensor(p), "q": LiveTensor(p.detach())},
                  {"p": LiveTensor(q), "q": LiveTensor(plain)}).run()
    assert torch.equal(q.detach(), p.detach()) and torch.equal(plain, p.detach())
    assert q.grad_fn is None and not plain.requires_grad


# -- faults -----------------------------------------------------------------------------
@pytest.mark.parametrize("after_ops", [0, None])
def test_a_failed_copy_is_torn_and_a_second_transfer_succeeds(after_ops: int | None) -> None:
    src = torch.randn(40, 8)
    dst = torch.full((40, 8), SENTINEL)
    t = StateTransfer({"w": LiveTensor(src)}, {"w": LiveTensor(dst, residency="device")},
                      host_budget_bytes=256, schedule="synchronous")
    with pt.fail_work("copy3:.*", after_ops=after_ops), pytest.raises(TransferTornError) as info:
        t.run()
    err = info.value
    assert isinstance(err.__cause__, RuntimeError) and "injected" in str(err.__cause__)
    assert list(err.faults) == [0] and err.faults[0].startswith("copy3:h2d")
    assert err.written[0] == ((0, 1, 2, 3) if after_ops is None else (0, 1, 2))
    assert err.partial.get(0, ()) == (() if after_ops is None else (3,))
    assert err.keys == ("w",) and "There is no rollback" in str(err)
    # Rounds after the fault were not written.
    rows = len(t.last_plan.rounds[0][0].lo) and t.last_plan  # type: ignore[union-attr]
    assert rows is not None and bool((dst[-1] == SENTINEL).all())
    t.run()
    assert torch.equal(dst, src)


def test_launch_then_wait_raises_the_same_errors() -> None:
    t = StateTransfer({"w": LiveTensor(torch.randn(8))}, {"w": LiveTensor(torch.zeros(8))})
    with pt.fail_work("copy0:.*"):
        ex = t.launch()
        with pytest.raises(TransferTornError):
            ex.wait()


# -- arguments -------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "words"), [
    ({"host_budget_bytes": 0}, "host_budget_bytes must be a positive int"),
    ({"device_budget_bytes": 1.5}, "device_budget_bytes must be a positive int"),
    ({"cast": {"*": "bf16"}}, "cast must be a dict of pattern"),
    ({"wire": "nvlink"}, "wire must be"),
    ({"schedule": "eager"}, "schedule must be"),
    ({"process_group": object()}, "torch.distributed is not initialized"),
    # (a tester's find: refused on one replica only, or a torch error, or a KeyError)
    ({"process_group": "torchft"}, r"torchft's ProcessGroupGloo, which torch.distributed "
                                   "does not know"),
])
def test_bad_arguments_are_named(kw: dict[str, Any], words: str) -> None:
    if kw.get("process_group") == "torchft":
        from torchft.process_group import ProcessGroupGloo

        kw = {"process_group": ProcessGroupGloo()}
    with pytest.raises(ConfigError, match=words):
        StateTransfer({}, {}, **kw)


def test_budgets_take_size_strings_as_every_bytes_argument_does() -> None:
    t = StateTransfer({}, {}, host_budget_bytes="64KiB", device_budget_bytes="1MB")
    assert (t.host_budget_bytes, t.device_budget_bytes) == (65536, 10**6)


def test_bad_tensors_are_named() -> None:
    with pytest.raises(ConfigError, match=r"sources\['w'\] must be a pipeoff.transfer"):
        StateTransfer({"w": torch.zeros(3)}, {})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="box offsets must be a sequence"):
        LiveTensor(torch.zeros(3), box=(0, 3))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="one offset and one size per dimension"):
        LiveTensor(torch.zeros(3), box=((0, 0), (3, 1)))
    with pytest.raises(ConfigError, match="residency must be one of"):
        LiveTensor(torch.zeros(3), residency="swap")
    with pytest.raises(ConfigError, match="ready must be"):
        LiveTensor(torch.zeros(3), ready=object())
    with pytest.raises(ConfigError, match="needs global_shape"):
        LiveTensor(None)
    with pytest.raises(ConfigError, match="from_optimizer"):
        LiveTensor.from_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1),
                                  torch.zeros(1), "exp_avg")


def test_errors_are_pipeoff_errors() -> None:
    assert issubclass(pipeoff.TransferRefusedError, pipeoff.PipeoffError)
    assert issubclass(pipeoff.TransferTornError, RuntimeError)


# -- the optimizers ----------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("readiness", [True, False])
def test_a_transfer_started_right_after_an_overlap_step_reads_the_stepped_state(
        readiness: bool) -> None:
    from pipeoff.optim import OffloadOptimizer

    m = _model()
    opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1), mode="overlap",
                           chunk_bytes=256)
    names = dict(m.named_parameters())
    for step in range(2):
        m(torch.randn(3, 8)).sum().backward()
        # With readiness the transfer waits for the (late) step; without, the step is
        # held until the transfer is done, so it reads the state from before it.
        late = (pt.delay_lane("compute", 0.03) if readiness
                else pt.hold_task("(opt|d2h)\\d+"))
        with late as release, pt.delay_lane("d2h", 0.03):
            opt.step()
            src = {}
            for n, p in names.items():
                for k in ("exp_avg", "exp_avg_sq"):
                    lt = LiveTensor.from_optimizer(opt, p, k)
                    src[f"{n}/{k}"] = lt if readiness else LiveTensor(lt.tensor)
            tg = {k: torch.full_like(v.tensor, float("nan")) for k, v in src.items()}
            StateTransfer(src, {k: LiveTensor(t) for k, t in tg.items()},
                          host_budget_bytes=256).run()
            if not readiness:
                release.set()
        opt.wait_for_step()
        same = all(torch.equal(tg[f"{n}/{k}"], opt.state[p][k]) for n, p in names.items()
                   for k in ("exp_avg", "exp_avg_sq"))
        # Without the readiness the transfer reads state the step has not written yet
        # (on the first step, not even allocated: NaN-free garbage or zeros).
        assert same is readiness, step
        opt.zero_grad()


@pytest.mark.parametrize("readiness", [True, False])
def test_full_offload_masters_to_bf16_targets_right_after_step(readiness: bool) -> None:
    from pipeoff.optim import FullOffloadOptimizer

    m = _model().to(torch.bfloat16)
    opt = FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, overlap="forward")
    names = dict(m.named_parameters())
    rollout = {n: torch.full(tuple(p.shape), SENTINEL, dtype=torch.bfloat16)
               for n, p in names.items()}
    # With readiness the transfer waits for the (late) step; without, the step is held
    # until the transfer is done, so it reads the masters from before it. (The final
    # backward launches the step's execution, which takes the hooks installed then.)
    late = (pt.delay_lane("host_step", 0.05) if readiness
            else pt.hold_task("step:\\d+"))
    with late as release:
        m(torch.randn(3, 8).to(torch.bfloat16)).float().sum().backward()
        opt.step()
        src = {n: LiveTensor.from_optimizer(opt, p, "master") for n, p in names.items()}
        if not readiness:
            src = {n: LiveTensor(lt.tensor) for n, lt in src.items()}
        StateTransfer(src, {n: LiveTensor(t) for n, t in rollout.items()},
                      host_budget_bytes=512, cast={"*": torch.bfloat16}).run()
        if not readiness:
            release.set()
    opt.wait_for_step()
    same = all(torch.equal(rollout[n], opt.state[p]["master"].to(torch.bfloat16))
               for n, p in names.items())
    assert same is readiness
    if readiness:
        # The moments too, FP32 to FP32.
        p = names["0.weight"]
        assert LiveTensor.from_optimizer(opt, p, "exp_avg").tensor is not None
        with pytest.raises(ConfigError, match="no state 'nope'"):
            LiveTensor.from_optimizer(opt, p, "nope")


def _release_when_waiting_for_readers(release: Any) -> Any:
    """Let the transfer go once an optimizer's write of its state waits for it."""
    return release_when_waiting(release, "wait", "settle")  # Readers.wait -> settle


@pytest.mark.parametrize("final_backward", [True, False])
def test_a_full_offload_step_waits_for_transfers_reading_its_masters(
        final_backward: bool) -> None:
    """The step after a transfer was launched waits for it before it steps the masters,
    whether its final micro-step is a backward or step() launches it (every backward
    under no_sync()): the transfer reads the masters from before the step."""
    from pipeoff.optim import FullOffloadOptimizer

    m = _model().to(torch.bfloat16)
    opt = FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, overlap="none")
    x = torch.randn(3, 8).to(torch.bfloat16)
    m(x).float().sum().backward()
    opt.step()
    opt.zero_grad()
    p = next(m.parameters())
    before = opt.state[p]["master"].clone()
    target = torch.full(tuple(p.shape), SENTINEL)
    with pt.hold_task("preflight") as release:  # the transfer has read nothing yet
        ex = StateTransfer({"m": LiveTensor.from_optimizer(opt, p, "master")},
                           {"m": LiveTensor(target)}).launch()
        watcher = _release_when_waiting_for_readers(release)
        if final_backward:
            m(x).float().sum().backward()  # the final backward waits (in its first hook)
        else:
            with opt.no_sync():
                m(x).float().sum().backward()
        opt.step()  # without a final backward, step() launches the final micro-step
        assert release.is_set()
    watcher.join()
    ex.wait()
    assert torch.equal(target, before)
    assert not torch.equal(opt.state[p]["master"], before)  # it did step


def test_single_pass_optimizer_state_is_a_source() -> None:
    """mode="single_pass" keeps no list of per-element keys: its state was refused as
    missing ("it has []") though opt.state held it."""
    from pipeoff.optim import OffloadOptimizer

    m = _model()
    opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1), mode="single_pass")
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    names = dict(m.named_parameters())
    src = {f"{n}/{k}": LiveTensor.from_optimizer(opt, p, k) for n, p in names.items()
           for k in ("exp_avg", "exp_avg_sq")}
    tg = {k: torch.full_like(v.tensor, float("nan")) for k, v in src.items()}
    StateTransfer(src, {k: LiveTensor(t) for k, t in tg.items()}).run()
    assert all(torch.equal(tg[f"{n}/{k}"], opt.state[p][k]) for n, p in names.items()
               for k in ("exp_avg", "exp_avg_sq"))
    with pytest.raises(ConfigError, match="scalar state such as 'step'"):
        LiveTensor.from_optimizer(opt, next(m.parameters()), "step")


def test_from_optimizer_refuses_scalar_state_and_strangers() -> None:
    from pipeoff.optim import OffloadOptimizer

    m = _model()
    opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1), mode="overlap")
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    p = next(m.parameters())
    with pytest.raises(ConfigError, match="scalar state such as 'step'"):
        LiveTensor.from_optimizer(opt, p, "step")
    with pytest.raises(ConfigError, match="not a parameter of this optimizer"):
        opt.completion_for(torch.zeros(3))
    opt.wait_for_step()
    assert opt.completion_for(p) == ()


@pytest.mark.parametrize("kind", ["offload", "full"])
def test_the_next_step_waits_for_a_transfer_still_reading_the_state(kind: str) -> None:
    import threading

    from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

    dtype = torch.bfloat16 if kind == "full" else torch.float32
    m = _model().to(dtype)
    names = dict(m.named_parameters())
    opt: Any
    if kind == "full":
        opt, key = FullOffloadOptimizer(m, torch.optim.AdamW, lr=1e-2, overlap="forward"), "master"
    else:
        opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1), mode="overlap")
        key = "exp_avg"
    m(torch.randn(3, 8).to(dtype)).float().sum().backward()
    opt.step()
    src = {n: LiveTensor.from_optimizer(opt, p, key) for n, p in names.items()}
    tg = {n: torch.full(tuple(v.tensor.shape), float("nan")) for n, v in src.items()}
    with pt.hold_task(r"copy\d+:.*") as release:
        ex = StateTransfer(src, {n: LiveTensor(t) for n, t in tg.items()}).launch()
        opt.wait_for_step()
        ref = {n: opt.state[p][key].clone() for n, p in names.items()}
        opt.zero_grad()
        # The transfer is held: the next step (for full offload: its final backward,
        # which launches the step) must wait for it rather than overwrite its sources.
        timer = threading.Timer(0.3, release.set)
        timer.start()
        m(torch.randn(3, 8).to(dtype)).float().sum().backward()
        opt.step()
        assert ex.done()
        opt.wait_for_step()
        timer.join()
    ex.wait()
    assert all(torch.equal(tg[n], ref[n]) for n in names)
    assert not all(torch.equal(tg[n], opt.state[p][key]) for n, p in names.items())


def test_optimizer_state_is_a_source_only_and_a_torn_optimizer_refuses_it() -> None:
    from pipeoff.optim import OffloadOptimizer

    m = _model()
    opt = OffloadOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1), mode="overlap",
                           chunk_bytes=256)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    p = next(m.parameters())
    lt = LiveTensor.from_optimizer(opt, p, "exp_avg")
    with pytest.raises(ConfigError, match="optimizer's state"):
        StateTransfer({"w": LiveTensor(torch.zeros_like(lt.tensor))}, {"w": lt})
    opt.wait_for_step()
    opt.zero_grad()
    m(torch.randn(3, 8)).sum().backward()
    with pt.fail_work(r"opt3"):
        opt.step()
        with pytest.raises(RuntimeError):
            opt.wait_for_step()
    with pytest.raises(pipeoff.StepFailedError):
        LiveTensor.from_optimizer(opt, p, "exp_avg")


def test_from_optimizer_maps_through_the_layout_of_the_step_in_flight() -> None:
    from pipeoff.optim import OffloadOptimizer

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4, 4))
    opt = OffloadOptimizer(torch.optim.AdamW([a, b], lr=0.1), mode="overlap", chunk_bytes=64)
    for step in range(2):
        (a.sum() + (b * 3).sum()).backward()
        with pt.delay_lane("compute", 0.03):
            opt.step()
            if step == 1:
                group = opt.param_groups[0]["params"]
                group[0], group[1] = group[1], group[0]  # edited in place
                assert opt.plan is not None  # re-plans without waiting
            src = {"a": LiveTensor.from_optimizer(opt, a, "exp_avg"),
                   "b": LiveTensor.from_optimizer(opt, b, "exp_avg")}
            tg = {k: torch.full((4, 4), float("nan")) for k in src}
            StateTransfer(src, {k: LiveTensor(t) for k, t in tg.items()}).run()
        opt.wait_for_step()
        assert torch.equal(tg["a"], opt.state[a]["exp_avg"]), step
        assert torch.equal(tg["b"], opt.state[b]["exp_avg"]), step
        opt.zero_grad()


def test_a_failure_describing_the_pieces_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Raised on one rank alone, it would leave the others in the preflight collective.
    def boom(self: LiveTensor) -> None:
        raise RuntimeError("an odd tensor")

    monkeypatch.setattr(LiveTensor, "target_problem", boom)
    with pytest.raises(TransferRefusedError, match="describing its pieces raised RuntimeError"):
        StateTransfer({"w": LiveTensor(torch.ones(2))}, {"w": LiveTensor(torch.zeros(2))}).run()


def test_ctrl_c_between_a_rounds_collectives_comes_after_them() -> None:
    """A SIGINT inside deferred_interrupt() (the exchange's flag all-reduce and its
    all-to-all, on the synchronous schedule's main thread) raises only at its end: a
    KeyboardInterrupt between the two would leave the peers waiting in the second
    until the group's timeout."""
    import signal

    from pipeoff.transfer._group import deferred_interrupt

    after = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            for _ in range(1000):  # (bytecodes, at which an interrupt would be raised)
                after.append(1)
    assert len(after) == 1000
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler



@pytest.mark.parametrize("schedule", ["synchronous", "pipelined"])
def test_ctrl_c_in_a_readiness_wait_reaches_the_caller_and_writes_nothing(
        schedule: str) -> None:
    """Ctrl-C while the preflight waits for a source's readiness: the peers are told
    (a refusal naming the interruption), and this rank's caller gets the
    ``KeyboardInterrupt`` itself, not a ``TransferRefusedError`` made of it."""
    target = torch.full((5, 7), SENTINEL)
    ready = failed_completion()
    with mock.patch.object(type(ready), "synchronize", side_effect=KeyboardInterrupt):
        t = StateTransfer({"w": LiveTensor(torch.randn(5, 7), ready=ready)},
                          {"w": LiveTensor(target)}, schedule=schedule)  # type: ignore[arg-type]
        with pytest.raises(KeyboardInterrupt) as info:
            t.run()
    assert any("interrupted (KeyboardInterrupt) in the preflight" in n
               for n in getattr(info.value, "__notes__", [])), info.value
    assert bool((target == SENTINEL).all())
    StateTransfer({"w": LiveTensor(torch.ones(5, 7))}, {"w": LiveTensor(target)}).run()
    assert bool((target == 1).all())  # nothing was left held
