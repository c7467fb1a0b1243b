"""pipeoff.ft.DiLoCo against torchft's DiLoCo: two replicas behind a real Lighthouse,
real Managers over gloo, bitwise replica by replica, in every mode."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import warnings
from typing import Any
from unittest.mock import create_autospec

import pytest
import torch
from torch import nn, optim
from torchft.manager import Manager

import pipeoff
import pipeoff.ft
import pipeoff.testing
from pipeoff import ConfigError
from tests.ft._diloco_replicas import (
    DiLoCoRun,
    Setup,
    assert_bitwise,
    make_model,
    run_diloco,
    sgd_nesterov,
)

OFFLOADED: dict[str, dict[str, Any]] = {
    "synchronous": {"offload_to_cpu": True, "schedule": "synchronous"},
    # 64-byte buckets: parameters split across buckets; two buckets of budget.
    "pipelined": {"offload_to_cpu": True, "bucket_bytes": 64, "device_budget_bytes": 128},
    "per_parameter": {"offload_to_cpu": True, "bucket_bytes": "per_parameter"},
}
MODES: dict[str, dict[str, Any]] = {"original": {}, **OFFLOADED}

_references: dict[Any, list[DiLoCoRun]] = {}


def _key(v: Any) -> Any:
    """A configuration value's cache key: a function by its qualified name (an ``id``,
    which a ``repr`` shows, is reused once an object is freed), a ``Setup`` by its
    fields."""
    if isinstance(v, Setup):
        return tuple(_key(getattr(v, f.name)) for f in dataclasses.fields(v))
    if callable(v):
        name = f"{v.__module__}.{v.__qualname__}"
        assert "<lambda>" not in name, f"name the function for the reference cache: {name}"
        return name
    return repr(v)


def reference(**cfg: Any) -> list[DiLoCoRun]:
    """torchft's DiLoCo on the same replicas (cached per configuration)."""
    key = tuple(sorted((k, _key(v)) for k, v in cfg.items()))
    if key not in _references:
        kwargs = {k: v for k, v in cfg.items() if k in _TORCHFT_KWARGS}
        extra = {k: v for k, v in cfg.items() if k not in _TORCHFT_KWARGS}
        _references[key] = run_diloco(kwargs, torchft=True, **extra)
    return _references[key]


_TORCHFT_KWARGS = {"sync_every", "fragment_sync_delay", "fragment_update_alpha"}


def run(mode: str, **cfg: Any) -> list[DiLoCoRun]:
    kwargs = {k: v for k, v in cfg.items() if k in _TORCHFT_KWARGS}
    extra = {k: v for k, v in cfg.items() if k not in _TORCHFT_KWARGS}
    return run_diloco({**kwargs, **MODES[mode]}, **extra)


def _assert_budget(runs: list[DiLoCoRun], mode: str) -> None:
    budget = MODES[mode].get("device_budget_bytes")
    traces = [t for r in runs for t in r.traces if t is not None]
    if mode == "original":
        assert not traces
        return
    assert traces
    for t in traces:
        assert t.summary().failed == 0
        if budget is not None and mode == "pipelined":
            assert t.summary().peak_device_staging_bytes <= budget


def _assert_pools_idle() -> None:
    pools = pipeoff.pools_for("cpu")
    assert pools.device.stats().live_bytes == 0
    assert pools.host.stats().live_bytes == 0


def _outer_adam(ps: Any) -> optim.Optimizer:
    return optim.Adam(ps, lr=0.1, betas=(0.5, 0.9))


def _outer_adamw(ps: Any) -> optim.Optimizer:
    return optim.AdamW(ps, lr=0.1, weight_decay=0.2)


def _outer_sgd(ps: Any) -> optim.Optimizer:
    return optim.SGD(ps, lr=0.5)


def _outer_adam_lr01(ps: Any) -> optim.Optimizer:
    return optim.Adam(ps, lr=0.1)


def _tied_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    return [model.a, model.b]  # type: ignore[list-item]


# -- bitwise against torchft ------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("n_fragments", "delay", "alpha"),
                         [(1, 0, 0.0), (2, 1, 0.5), (2, 0, 1.0), (1, 1, 0.3)],
                         ids=["1frag", "2frag-delay-alpha.5", "2frag-alpha1", "1frag-delay"])
def test_bitwise_torchft(mode: str, n_fragments: int, delay: int, alpha: float) -> None:
    cfg = {"sync_every": 4, "fragment_sync_delay": delay, "fragment_update_alpha": alpha,
           "n_fragments": n_fragments}
    runs = run(mode, **cfg)
    assert [r.steps for r in runs] == [r.steps for r in reference(**cfg)]
    assert runs[0].steps > 0
    assert_bitwise(runs, reference(**cfg))
    assert not any(r.errors_reported for r in runs)
    _assert_budget(runs, mode)
    _assert_pools_idle()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(OFFLOADED))
@pytest.mark.parametrize("outer", ["adam", "adamw", "sgd", "shared"])
def test_outer_optimizers(mode: str, outer: str) -> None:
    makers: dict[str, Any] = {"adam": _outer_adam, "adamw": _outer_adamw, "sgd": _outer_sgd,
                              "shared": sgd_nesterov}
    # One outer optimizer over a one-fragment model ("shared"): over several
    # fragments, torchft's step of one fragment also steps the others' parameters
    # with their inner gradients (SGD steps every parameter with a .grad); pipeoff
    # steps the fragment's own only (docs/diloco.md).
    cfg = {"sync_every": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.25,
           "outer": makers[outer], "shared_outer": outer == "shared",
           "n_fragments": 1 if outer == "shared" else 2}
    assert_bitwise(run(mode, **cfg), reference(**cfg))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(OFFLOADED))
def test_outer_lr_edited_in_place_between_syncs(mode: str) -> None:
    """A schedule on the outer optimizer's param_groups, as torchtitan's would run."""

    def schedule(replica: int, step: int, diloco: Any) -> None:
        for f in diloco._fragments:
            for g in f._outer_optimizer.param_groups:
                g["lr"] = 0.7 / (1 + step)
                g["momentum"] = 0.8

    cfg = {"sync_every": 2, "n_fragments": 1, "on_step": schedule}
    assert_bitwise(run(mode, **cfg), reference(**cfg))


# -- concurrency: delayed lanes, and the wait that matters ------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pattern", ["pseudograd:.*", "allreduce:.*", "d2h:.*", "outer:.*",
                                     "write:.*"])
def test_delayed_tasks_change_no_bit(pattern: str) -> None:
    cfg = {"sync_every": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    with pipeoff.testing.delay_task(pattern, 0.01):
        runs = run("pipelined", **cfg)
    assert_bitwise(runs, reference(**cfg))
    _assert_pools_idle()


def _release_on_second_step(release: Any) -> Any:
    """An inner optimizer whose post-step hook (registered before DiLoCo's, so it runs
    first) releases ``release`` after the second inner step has written the parameters."""
    steps = [0]

    def make(model: nn.Module) -> optim.Optimizer:
        opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

        def hook(*_: Any) -> None:
            steps[0] += 1
            if steps[0] >= 4:  # both replicas' second steps (one shared counter)
                release.set()

        opt.register_step_post_hook(hook)
        return opt

    return make


@pytest.mark.timeout(120)
def test_a_removed_formed_wait_changes_the_result() -> None:
    """Hazard: with fragment_sync_delay > 0, the next inner step writing parameters that
    the sync's pseudo-gradient tasks have not read yet. Held until both replicas' next
    inner step has run, a pseudo-gradient task reads the stepped parameters unless the
    inner step waited for it."""
    cfg = {"sync_every": 2, "fragment_sync_delay": 1, "n_fragments": 1, "steps": 4}
    want = reference(**cfg)
    with pipeoff.testing.disable("diloco_formed_wait"), \
            pipeoff.testing.hold_task("pseudograd:b0") as release:
        runs = run("pipelined", **cfg, inner=_release_on_second_step(release))
    with pytest.raises(AssertionError):
        assert_bitwise(runs, want)


# -- failures -------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(OFFLOADED))
@pytest.mark.parametrize("how", ["fail_task", "fail_work"])
def test_failure_before_the_commit_restores_and_the_next_sync_works(mode: str,
                                                                    how: str) -> None:
    """Both replicas fail their second sync (the hook is process-wide, installed once
    both have finished the first): each reports it, rejects, restores the parameters
    from the backup (torchft's reject), keeps backup and outer state, and the next
    sync commits."""
    seen: dict[int, list[Any]] = {0: [], 1: []}
    inject = getattr(pipeoff.testing, how)
    with contextlib.ExitStack() as stack:
        fault = contextlib.ExitStack()
        stack.enter_context(fault)
        both_past_first_sync = threading.Barrier(2, action=lambda: fault.enter_context(
            inject("pseudograd:b0", lambda: RuntimeError("injected"))))
        both_past_second_sync = threading.Barrier(2, action=fault.close)

        def record(replica: int, step: int, diloco: Any) -> None:
            if step == 2:
                both_past_first_sync.wait(timeout=60)
            if step == 4:
                both_past_second_sync.wait(timeout=60)
            f = diloco._fragments[0]
            seen[replica].append(({k: v.clone() for k, v in f.original_parameters.items()},
                                  copy.deepcopy(diloco.outer_state_dict(0))))

        runs = run_diloco({"sync_every": 2, **MODES[mode]}, n_fragments=1, steps=6,
                          on_step=record)
    for r, got in enumerate(runs):
        assert len(got.errors_reported) == 1
        assert "injected" in str(got.errors_reported[0])
        backup_before, state_before = seen[r][3]  # before the step that syncs again
        assert state_before["state"], "the first sync stepped the outer optimizer"
        # torchft's reject: the parameters are the backup, which is unchanged, and
        # so is the outer state.
        for (name, b), p in zip(backup_before.items(), got.params[3]):
            assert torch.equal(b, p), name
        backup_after, state_after = seen[r][5]  # before the third sync
        for name, b in backup_before.items():
            assert torch.equal(backup_after[name], b)
        for idx, st in state_before["state"].items():
            assert torch.equal(state_after["state"][idx]["momentum_buffer"],
                               st["momentum_buffer"])
        # The third sync commits: the backup and the outer state move on.
        assert any(not torch.equal(got.backups[f"0.{name}"], b)
                   for name, b in backup_before.items())
        assert any(not torch.equal(got.outer_states[0]["state"][idx]["momentum_buffer"],
                                   st["momentum_buffer"])
                   for idx, st in state_before["state"].items())
    _assert_pools_idle()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["synchronous", "pipelined"])
def test_a_failed_outer_step_after_commit_raises_with_a_note(
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A failure after the commit is raised with a note and reported to torchft (so that
    the replica group's next should_commit() is False and a peer heals it): by
    ``perform_sync`` (synchronous), or by the first reader of the parameters after it
    (pipelined: the outer step runs under the next forward)."""
    reported: list[BaseException] = []
    report = Manager.report_error

    def spy(self: Manager, e: Exception) -> None:
        reported.append(e)
        report(self, e)

    monkeypatch.setattr(Manager, "report_error", spy)
    with pipeoff.testing.fail_work("outer:c0", lambda: RuntimeError("outer broke")), \
            pytest.raises(RuntimeError, match="outer broke") as info:
        run_diloco({"sync_every": 2, **MODES[mode]}, n_fragments=1, steps=2)
    assert any("partly updated" in n for n in getattr(info.value, "__notes__", []))
    assert any("outer broke" in str(e) for e in reported), reported
    _assert_pools_idle()


# -- inner optimizers pipeoff offers -----------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["original", "pipelined"])
def test_full_offload_inner_optimizer_follows_the_sync(mode: str) -> None:
    """FullOffloadOptimizer's masters are the truth: after every sync (commit or not)
    they are refreshed from the parameters, so the run is bitwise torchft's with plain
    AdamW."""
    from pipeoff.optim import FullOffloadOptimizer

    def inner(model: nn.Module) -> optim.Optimizer:
        return FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)

    cfg = {"sync_every": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    assert_bitwise(run(mode, **cfg, inner=inner), reference(**cfg))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["original", "pipelined"])
def test_overlap_offload_inner_optimizer(mode: str) -> None:
    from pipeoff.optim import OffloadOptimizer

    def inner(model: nn.Module) -> optim.Optimizer:
        opt = OffloadOptimizer(optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                               mode="overlap", chunk_bytes=512)
        opt.attach(model)
        return opt

    cfg = {"sync_every": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    assert_bitwise(run(mode, **cfg, inner=inner), reference(**cfg))


# -- arguments ------------------------------------------------------------------------
def _manager() -> Any:
    manager = create_autospec(Manager)
    manager._use_async_quorum = False
    manager.current_step.return_value = 0
    manager.errored.return_value = None
    return manager


_NONE = object()  # (an outer optimizer of None, where None means the default)


def _build(**kwargs: Any) -> pipeoff.ft.DiLoCo:
    model = make_model(0)
    outer = kwargs.pop("outer", None)
    manager = kwargs.pop("manager", _manager())
    fragments = model if kwargs.pop("fragments", None) == "module" else [model]
    return pipeoff.ft.DiLoCo(
        manager, fragments, optim.AdamW(model.parameters()),
        None if outer is _NONE else outer if outer is not None else optim.SGD(
            model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
        kwargs.pop("sync_every", 2), **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"offload_to_cpu": 1}, "offload_to_cpu must be True or False, got 1"),
    ({"schedule": "pipelined"}, "applies only with offload_to_cpu=True"),
    ({"bucket_bytes": 64}, "applies only with offload_to_cpu=True"),
    ({"offload_to_cpu": True, "schedule": "eager"}, "schedule must be 'pipelined' or"),
    ({"offload_to_cpu": True, "bucket_bytes": 0}, "bucket_bytes must be a positive int"),
    ({"offload_to_cpu": True, "bucket_cap_mb": -1}, "bucket_cap_mb must be a positive number"),
    ({"schedule": "pipelined", "bucket_bytes": 64},
     "schedule, bucket_bytes apply only with offload_to_cpu=True"),
    ({"offload_to_cpu": True, "bucket_bytes": 64, "device_budget_bytes": 32},
     "device_budget_bytes=32 is smaller than one bucket"),
    ({"offload_to_cpu": True, "should_quantize": True}, "should_quantize=True cannot"),
    ({"offload_to_cpu": True, "backup_device": torch.device("meta")},
     "backup_device must be None or 'cpu'"),
    ({"offload_to_cpu": True, "outer": "rmsprop"}, "must be a torch.optim.SGD, Adam or AdamW"),
    ({"offload_to_cpu": True, "outer": "foreign"}, "in none of the model fragments"),
    ({"offload_to_cpu": True, "outer": "differentiable"}, "differentiable=True"),
    # torchft's own arguments, checked in every mode (a new user's finds):
    ({"bucket_cap_mb": "x"}, "bucket_cap_mb must be a positive number of MiB or None"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a positive number"),
    ({"use_bucketization": "yes"}, "use_bucketization must be True or False"),
    ({"pin_memory": "yes"}, "pin_memory must be True or False"),
    ({"backup_device": "nope"}, "backup_device must be a torch.device"),
    ({"outer": "none"}, "outer_optimizer must be a torch.optim.Optimizer, got None"),
    ({"outer": "class"}, "outer_optimizer must be an optimizer instance, got the class SGD"),
    ({"fragments": "module"}, r"model_fragments must be a list .*Sequential module \(one "
                              r"fragment: \[model\]\)"),
    ({"manager": None}, "manager must be a torchft.Manager, got None"),
])
def test_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    outer = kwargs.pop("outer", None)
    if outer == "rmsprop":
        kwargs["outer"] = optim.RMSprop([nn.Parameter(torch.zeros(2))])
    elif outer == "foreign":
        kwargs["outer"] = optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    elif outer == "differentiable":
        kwargs["outer"] = optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, differentiable=True)
    elif outer == "class":
        kwargs["outer"] = optim.SGD
    elif outer == "none":
        kwargs["outer"] = _NONE
    with pytest.raises(ConfigError, match=match):
        _build(**kwargs)


@pytest.mark.parametrize("offload", [False, True])
def test_no_model_fragments_is_refused_naming_the_argument(offload: bool) -> None:
    model = make_model(0)
    with pytest.raises(ConfigError, match="model_fragments must hold at least one module"):
        pipeoff.ft.DiLoCo(_manager(), [], optim.AdamW(model.parameters()),
                          optim.SGD(model.parameters(), lr=0.7), 2, offload_to_cpu=offload)


@pytest.mark.parametrize("fragments", [1, 2])
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sync_every": 0}, r"sync_every must be an int of at least 1, got 0"),
    ({"sync_every": 4.0}, r"sync_every must be an int of at least 1, got 4.0"),
    ({"sync_every": True}, r"sync_every must be an int of at least 1, got True"),
    ({"fragment_sync_delay": -1}, r"fragment_sync_delay must be an int of at least 0"),
    ({"fragment_sync_delay": 2}, r"fragment_sync_delay must be less than sync_every"),
    ({"fragment_update_alpha": -0.1}, r"fragment_update_alpha must be a number in \[0, 1\]"),
    ({"fragment_update_alpha": float("nan")}, r"fragment_update_alpha must be a number"),
    ({"fragment_update_alpha": "0.5"}, r"fragment_update_alpha must be a number"),
])
@pytest.mark.parametrize("offload", [False, True])
def test_the_schedule_is_checked_naming_the_argument(kwargs: dict[str, Any], match: str,
                                                     fragments: int, offload: bool) -> None:
    """torchft's own checks are bare asserts (``sync_every=0``, alpha NaN), messages that
    name no argument, or none at all (a negative delay failed at the first sync); both
    paths raise ``ConfigError`` naming it, before torchft's hooks go on the optimizer
    (a fresh tester's find)."""
    model = make_model(0)
    inner = optim.AdamW(model.parameters())
    frags = list(model) if fragments == 2 else [model]
    args = {"sync_every": 2 * fragments, **kwargs}
    with pytest.raises(ConfigError, match=match):
        pipeoff.ft.DiLoCo(_manager(), frags, inner, optim.SGD(model.parameters(), lr=0.7),
                          offload_to_cpu=offload, **args)
    assert not inner._optimizer_step_post_hooks


@pytest.mark.parametrize("offload", [False, True])
def test_numpy_scalars_from_a_config_are_taken_as_torchft_takes_them(offload: bool) -> None:
    """A config read with numpy (``np.int64``, ``np.float32``) passes torchft's own checks;
    pipeoff's (above) took them too, as Python numbers (a fresh tester's find)."""
    np = pytest.importorskip("numpy")
    model = make_model(0)
    inner = optim.AdamW(model.parameters())
    d = pipeoff.ft.DiLoCo(_manager(), list(model), inner, optim.SGD(model.parameters(), lr=0.7),
                          np.int64(4), fragment_sync_delay=np.int64(1),
                          fragment_update_alpha=np.float32(0.5), offload_to_cpu=offload)
    assert [type(v) for v in (d._sync_every, d._fragment_sync_delay)] == [int, int]
    assert all(type(f._fragment_update_alpha) is float and f._fragment_update_alpha == 0.5
               for f in d._fragments)
    local = pipeoff.ft.LocalSGD(_manager(), model, optim.AdamW(model.parameters()), np.int32(3))
    assert type(local._sync_every) is int and local._sync_every == 3


def test_fragment_counts_are_checked_naming_the_argument() -> None:
    model = make_model(0)
    frags = list(model)
    inner = optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="sync_every must be a multiple of the number of model"):
        pipeoff.ft.DiLoCo(_manager(), frags, inner, optim.SGD(model.parameters(), lr=0.7), 3)
    with pytest.raises(ConfigError, match="outer_optimizer is a list of 1; give one per model"):
        pipeoff.ft.DiLoCo(_manager(), frags, inner, [optim.SGD(model.parameters(), lr=0.7)], 2)
    with pytest.raises(ConfigError, match="sync_every must be an int of at least 1"):
        pipeoff.ft.LocalSGD(_manager(), model, inner, 0)
    assert not inner._optimizer_step_post_hooks


def test_torchft_checks_still_apply() -> None:
    with pytest.raises(ValueError, match="fragment_update_alpha"):
        _build(offload_to_cpu=True, fragment_update_alpha=2.0)


def test_properties_and_defaults() -> None:
    d = _build(offload_to_cpu=True)
    assert (d.offload_to_cpu, d.schedule, d.bucket_bytes, d.device_budget_bytes) == (
        True, "pipelined", pipeoff.ft.DEFAULT_BUCKET_BYTES, 2 * pipeoff.ft.DEFAULT_BUCKET_BYTES)
    d = _build(offload_to_cpu=True, device_budget_bytes=1000)
    assert (d.bucket_bytes, d.device_budget_bytes) == (500, 1000)
    assert _build().offload_to_cpu is False
    assert "DiLoCo" in dir(pipeoff.ft) or "DiLoCo" in pipeoff.ft.__all__


def test_exiting_with_a_sync_in_flight_stops_it() -> None:
    """Hazard: lanes waiting forever for the decision of a sync that was prepared (with
    fragment_sync_delay > 0) but is never performed: the context's exit abandons it."""
    model = make_model(0)
    manager = _manager()
    manager.allreduce.side_effect = lambda t, should_quantize=False: _Done()
    inner = optim.AdamW(model.parameters())
    with pipeoff.ft.DiLoCo(manager, [model], inner, optim.SGD(model.parameters(), lr=0.7),
                           2, fragment_sync_delay=1, offload_to_cpu=True) as d:
        model(torch.randn(2, 12)).sum().backward()
        inner.step()  # prepares the sync
        frag = d._fragments[0]
        assert frag._ex is not None
        ex = frag._ex
    assert frag._ex is None and ex.done()
    _assert_pools_idle()


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


# -- what a review found (each bitwise against torchft, or torchft's semantics) -----------
class _Tied(nn.Module):
    """Two fragments that share one weight (tied embeddings, as language models do)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        shared = nn.Linear(12, 12)
        self.a = nn.Sequential(shared, nn.Linear(12, 12))
        self.b = nn.Sequential(nn.Linear(12, 12), shared)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(OFFLOADED))
def test_a_weight_tied_across_fragments_is_stepped_by_each(mode: str) -> None:
    setup = Setup(model=_Tied, fragments=_tied_fragments)
    cfg = {"sync_every": 4, "setup": setup}
    runs, want = run(mode, **cfg), reference(**cfg)
    assert_bitwise(runs, want)
    assert sorted(runs[0].outer_states[0]["state"]) == [0, 1, 2, 3]


def test_a_shared_outer_optimizer_over_a_tied_weight_is_refused() -> None:
    model = _Tied(0)
    with pytest.raises(ConfigError, match="in two model fragments that share one outer"):
        pipeoff.ft.DiLoCo(_manager(), [model.a, model.b], optim.SGD(model.parameters()),
                          optim.SGD(model.parameters(), lr=0.7), 2, offload_to_cpu=True)


def _resume_momentum(replica: int, model: nn.Module, outers: Any) -> None:
    for o in outers:
        params = [p for g in o.param_groups for p in g["params"]]
        o.load_state_dict({
            "state": {i: {"momentum_buffer": torch.full_like(p, 0.05)}
                      for i, p in enumerate(params)},
            "param_groups": o.state_dict()["param_groups"]})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(OFFLOADED))
def test_outer_state_loaded_before_diloco_is_adopted(mode: str) -> None:
    """A resumed job loads its outer optimizer's checkpoint before it builds DiLoCo:
    the host optimizer steps with that momentum, and the device copy is dropped."""
    cfg = {"sync_every": 4, "fragment_sync_delay": 1, "setup": Setup(pre_build=_resume_momentum)}
    assert_bitwise(run(mode, **cfg), reference(**cfg))


_surgery: dict[int, list[Any]] = {}


def _keep_outers(_replica: int, model: nn.Module, outers: Any) -> None:
    _surgery[id(model)] = [outers, 0]


def _halve_momentum_after_the_first_sync(model: nn.Module) -> None:
    entry = _surgery[id(model)]
    entry[1] += 1
    if entry[1] == 4:  # step() of the first sync (sync_every 4) has just returned
        for o in entry[0]:
            sd = copy.deepcopy(o.state_dict())
            for st in sd["state"].values():
                st["momentum_buffer"].mul_(0.5)
            o.load_state_dict(sd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("mode", list(OFFLOADED))
def test_outer_state_loaded_right_after_a_sync_is_adopted(mode: str, delay: int) -> None:
    """State loaded into the outer optimizer just after a sync returned (its tail may
    still run under the pipelined schedule) is stepped with at the next sync, as
    torchft does; the tail's end used to put the host state back over it (a fresh
    tester's find: silently the same as no load)."""
    cfg = {"sync_every": 4, "fragment_sync_delay": delay, "steps": 10,
           "setup": Setup(pre_build=_keep_outers,
                          post_step=_halve_momentum_after_the_first_sync)}
    assert_bitwise(run(mode, **cfg), reference(**cfg))


def test_the_users_outer_optimizer_shows_the_host_state() -> None:
    """``outer_optimizer.state_dict()`` (what a user's own checkpoint saves) is the host
    state; a ``load_state_dict()`` into it after construction is adopted at the next
    sync."""
    model = make_model(0)
    inner, outer = optim.SGD(model.parameters(), lr=0.1), optim.SGD(
        model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = _committing_manager()
    with pipeoff.ft.DiLoCo(manager, [model], inner, outer, 2, offload_to_cpu=True) as d:
        for _ in range(2):
            _inner_step(model, inner)
        state = outer.state_dict()["state"]
        host = d.outer_state_dict()["state"]
        assert sorted(state) == sorted(host) == list(range(6))
        for i in state:
            assert state[i]["momentum_buffer"] is host[i]["momentum_buffer"]
        loaded = {"state": {i: {"momentum_buffer": torch.full_like(v["momentum_buffer"], 0.5)}
                            for i, v in state.items()},
                  "param_groups": outer.state_dict()["param_groups"]}
        outer.load_state_dict(loaded)
        d._fragments[0].outer.sync_from_user()  # (the next sync does it)
        after = d.outer_state_dict()["state"]
        assert all(torch.equal(after[i]["momentum_buffer"], loaded["state"][i]["momentum_buffer"])
                   for i in after)
        assert outer.state_dict()["state"][0]["momentum_buffer"] is after[0]["momentum_buffer"]


def test_healing_loads_the_peers_outer_hyperparameters() -> None:
    """torchft's checkpoint loader loads the outer optimizer's param_groups (a scheduled
    lr); so does pipeoff's, into the user's groups, where the next sync reads them."""
    saved: dict[str, Any] = {}

    def build(lr: float) -> tuple[Any, Any, Any]:
        model = make_model(0)
        outer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        manager = _committing_manager()
        manager.register_state_dict_fn.side_effect = (
            lambda key, load, save: saved.__setitem__(key, (load, save)))
        d = pipeoff.ft.DiLoCo(manager, [model], optim.SGD(model.parameters(), lr=0.1), outer,
                              2, offload_to_cpu=True)
        return d, outer, manager

    _, _, _ = build(0.1)
    peer = saved["StreamingDiLoCoFragment_0"][1]()
    assert peer["outer_optimizer"]["param_groups"][0]["lr"] == 0.1
    _, outer, _ = build(0.7)
    saved["StreamingDiLoCoFragment_0"][0](peer)
    assert outer.param_groups[0]["lr"] == 0.1
    assert saved["StreamingDiLoCoFragment_0"][1]()["outer_optimizer"]["param_groups"][0][
        "lr"] == 0.1


def test_reentering_after_an_abandoned_sync_rejects_it_and_goes_on() -> None:
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    manager = _committing_manager()
    d = pipeoff.ft.DiLoCo(manager, [model], inner, optim.SGD(model.parameters(), lr=0.7), 2,
                          fragment_sync_delay=1, offload_to_cpu=True)
    backup = {k: v.clone() for k, v in d._fragments[0].original_parameters.items()}
    with pytest.raises(ValueError, match="hiccup"), d:
        _inner_step(model, inner)  # prepares the sync
        raise ValueError("dataloader hiccup")
    with d:
        _inner_step(model, inner)  # performs it: rejected (abandoned), restored
        assert manager.report_error.call_count == 1
        assert "abandoned" in str(manager.report_error.call_args[0][0])
        assert all(torch.equal(p, backup[n]) for n, p in model.named_parameters())
        for _ in range(2):
            _inner_step(model, inner)  # the next sync runs
    assert d.last_trace is not None and d.last_trace.summary().failed == 0
    _assert_pools_idle()


def test_a_block_that_ends_cleanly_with_a_sync_in_flight_says_it_is_abandoned() -> None:
    """torchft's DiLoCo performs a prepared sync at the first step after the block is
    entered again; pipeoff's abandons it (its lanes must not wait for a block that may
    never come back): every replica rejects it. A clean exit said nothing (a tester's
    find: 0.07 off torchft after re-entering, silently); now it warns."""
    model = make_model(0)
    inner = optim.SGD(model.parameters(), lr=0.1)
    d = pipeoff.ft.DiLoCo(_committing_manager(), [model], inner,
                          optim.SGD(model.parameters(), lr=0.7), 2, fragment_sync_delay=1,
                          offload_to_cpu=True)
    with pytest.warns(RuntimeWarning, match="fragment sync prepared and in flight"), d:
        _inner_step(model, inner)  # prepares the sync
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with d:
            for _ in range(3):  # performs it (rejected), prepares and performs the next
                _inner_step(model, inner)
            d.wait_for_sync()  # (the block ends after a sync: nothing in flight)
    _assert_pools_idle()


def test_reordered_outer_param_groups_are_refused_before_the_decision() -> None:
    model = make_model(0)
    params = list(model.parameters())
    inner = optim.SGD(params, lr=0.1)
    outer = optim.SGD(params[:2], lr=0.7)
    outer.add_param_group({"params": params[2:], "lr": 0.1})
    manager = _committing_manager()
    d = pipeoff.ft.DiLoCo(manager, [model], inner, outer, 2, offload_to_cpu=True)
    with d:
        for _ in range(2):
            _inner_step(model, inner)
        outer.param_groups.reverse()
        d.wait_for_sync()  # the first sync's outer step writes the backups under it
        backup = {k: v.clone() for k, v in d._fragments[0].original_parameters.items()}
        _inner_step(model, inner)
        _inner_step(model, inner, step=False)
        with pytest.raises(ConfigError, match="param_groups changed"):
            inner.step()
    # This replica rejected (its peers were not left waiting for its vote), restored.
    assert manager.report_error.call_count == 1 and manager.should_commit.call_count == 2
    assert all(torch.equal(p, backup[n]) for n, p in model.named_parameters())
    _assert_pools_idle()


class _WithEmpty(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = make_model(seed)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.empty.sum()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(OFFLOADED))
def test_empty_parameters_keep_their_outer_state_entry(mode: str) -> None:
    cfg = {"sync_every": 2, "n_fragments": 1, "outer": _outer_adam_lr01,
           "setup": Setup(model=_WithEmpty)}
    assert_bitwise(run(mode, **cfg), reference(**cfg))


def test_torchfts_bucket_cap_mb_sets_the_bucket_size() -> None:
    d = _build(offload_to_cpu=True, bucket_cap_mb=1)
    assert (d.bucket_bytes, d.device_budget_bytes) == (1 << 20, 2 << 20)
    d = _build(offload_to_cpu=True, bucket_cap_mb=1, bucket_bytes=4096)
    assert d.bucket_bytes == 4096


class _Unreadable:
    """A parameter whose value cannot be read: its pseudo-gradient's work fails half-way
    (its backup already copied into the bucket's staging)."""

    @property
    def data(self) -> Any:
        raise RuntimeError("replica 0 alone: injected inside the work")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["before_the_work", "inside_the_work"])
@pytest.mark.parametrize("mode", ["synchronous", "per_parameter"])
def test_a_replica_that_fails_alone_contributes_a_zero_pseudo_gradient(
        mode: str, where: str) -> None:
    """Hazard: a replica whose pseudo-gradient task failed joining the all-reduce with what
    its staging held, so that its healthy peer commits garbage; or skipping the
    all-reduces after the failure, so that its peer waits out the timeout. It joins
    every one, with a zero pseudo-gradient for each bucket it did not form: the peer
    commits the average of its own and zero, and reports no error."""
    fail_param = 2  # per-parameter buckets: bucket k is parameter k
    local: dict[int, list[torch.Tensor]] = {}
    before: dict[int, list[torch.Tensor]] = {}

    replica_of: dict[int, int] = {}

    def inject(replica: int, step: int, diloco: Any) -> None:
        f = diloco._fragments[0]
        replica_of[id(diloco._local_optimizer)] = replica
        if step == 3:
            before[replica] = [b.clone() for b in f._backups]
        if step == 3 and replica == 0:
            make = f._work

            def failing() -> Any:
                work = make()
                f._work = make  # this sync only

                def pseudograd(k: int, b: Any, dev: str) -> Any:
                    good = work.pseudograd(k, b, dev)
                    if where == "inside_the_work" and k == fail_param:
                        # The same work (its results record too) over a parameter
                        # that fails to be read once the backup is staged.
                        sync = work.pseudograd.__self__  # the SyncWork
                        params = list(sync.params)
                        params[fail_param] = _Unreadable()
                        return dataclasses.replace(sync, params=params).pseudograd(k, b, dev)

                    def run_(ctx: Any) -> None:
                        if k == fail_param:
                            raise RuntimeError("replica 0 alone: injected")
                        good(ctx)
                    return run_
                return dataclasses.replace(work, pseudograd=pseudograd)

            f._work = failing

    def inner(model: nn.Module) -> optim.Optimizer:
        opt = optim.AdamW(model.parameters(), lr=1e-2)
        # Registered before DiLoCo's hook: the local parameters a sync starts from.
        opt.register_step_post_hook(lambda o, *_: local.__setitem__(
            id(o), [p.detach().clone() for p in model.parameters()]))
        return opt

    runs = run_diloco({"sync_every": 2, **MODES[mode], "bucket_bytes": "per_parameter"}
                      if mode == "synchronous" else {"sync_every": 2, **MODES[mode]},
                      n_fragments=1, steps=4, on_step=inject,
                      outer=lambda ps: optim.SGD(ps, lr=1.0), inner=inner)
    assert len(runs[0].errors_reported) == 1 and not runs[1].errors_reported
    # The pseudo-gradients of the sync: each replica's backup minus its local values.
    pg = {replica_of[k]: [b - p for b, p in zip(before[replica_of[k]], loc)]
          for k, loc in local.items()}
    healthy = runs[1]
    for i, name in enumerate(healthy.backups):
        # SGD with lr 1: new = old - average. A bucket replica 0 formed before its
        # failure averages both pseudo-gradients; the failed one (and, one task at a
        # time, every later one) replica 1's own and a zero.
        both = before[1][i] - (pg[1][i] + pg[0][i]) / 2
        alone = before[1][i] - (pg[1][i] + 0) / 2
        got = healthy.backups[name]
        if i < fail_param:
            assert torch.equal(got, both), name
        elif i == fail_param or mode == "synchronous":
            assert torch.equal(got, alone), name
        else:  # pipelined: a later bucket may have been formed before the failure
            assert torch.equal(got, both) or torch.equal(got, alone), name
    b0 = before[0]
    # The failed replica rejected and restored its backup.
    assert all(torch.equal(p, b) for p, b in zip(runs[0].params[-1], b0))
    _assert_pools_idle()


def _committing_manager() -> Any:
    manager = _manager()
    step = [0]

    def should_commit(*_: Any, **__: Any) -> bool:
        step[0] += 1
        return manager.report_error.call_count == 0 or step[0] > 1_000_000

    manager.current_step.side_effect = lambda: step[0]
    manager.should_commit.side_effect = should_commit
    manager.allreduce.side_effect = lambda t, should_quantize=False: _Done()
    return manager


def _inner_step(model: nn.Module, inner: optim.Optimizer, *, step: bool = True) -> None:
    inner.zero_grad()
    model(torch.ones(2, 12)).sum().backward()
    if step:
        inner.step()


def _bf16_model(seed: int) -> nn.Module:
    model = make_model(seed).to(torch.bfloat16)
    model.register_forward_pre_hook(lambda m, args: (args[0].to(torch.bfloat16),))
    return model


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["original"])
def test_a_fragment_sync_keeps_the_other_fragments_fp32_masters(mode: str) -> None:
    """BF16 weights, FP32 masters under FullOffloadOptimizer, two streaming fragments,
    torchft's sync (offloaded syncs work on the masters themselves:
    tests/ft/test_diloco_masters.py): each sync refreshes the masters of the fragment
    it wrote, and the other fragment's masters keep every bit (a sync writes only its
    fragment's parameters)."""
    from pipeoff.optim import FullOffloadOptimizer

    seen: list[tuple[bool, bool]] = []

    def inner(model: nn.Module) -> optim.Optimizer:
        opt = FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)
        refresh = opt.refresh_masters
        blocks = [list(b.parameters()) for b in model]  # type: ignore[union-attr]

        def spy(params: Any = None) -> None:
            synced = {id(p) for p in params}
            other = next(b for b in blocks if id(b[0]) not in synced)
            masters = lambda: [opt._host_tensor(p, "master").clone() for p in other]  # noqa: E731
            before = masters()
            refresh(params)
            kept = all(torch.equal(a, b) for a, b in zip(before, masters()))
            low_bits = any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in before)
            seen.append((kept, low_bits))

        opt.refresh_masters = spy  # type: ignore[method-assign]
        return opt

    cfg = {"sync_every": 4, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0,
           "steps": 12}
    run(mode, **cfg, inner=inner, setup=Setup(model=_bf16_model))
    assert len(seen) == 2 * 6  # two replicas, a fragment sync every 2 of 12 steps
    assert all(kept for kept, _ in seen)
    assert any(low for _, low in seen)  # the masters held bits below BF16's


# -- nothing the caller writes is read in the background -----------------------------------
def _clamp_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.25, 0.25)  # a weight clip after step(), as loops do


def _full_offload_backward(model: nn.Module) -> optim.Optimizer:
    from pipeoff.optim import FullOffloadOptimizer

    # Its chunks write the weights during the next backward, before step() is called.
    return FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1,
                                overlap="backward")


def _plain_adamw(model: nn.Module) -> optim.Optimizer:
    return optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(OFFLOADED))
@pytest.mark.parametrize("writer", ["clamp", "full_offload_backward"])
def test_writes_after_the_preparing_step_do_not_reach_the_pseudo_gradients(
        mode: str, writer: str) -> None:
    """fragment_sync_delay=1: the pseudo-gradients are formed before the preparing
    step() returns, so a weight clip after it, or an inner optimizer writing weights
    during the next backward, leaves them (and the backup and outer momentum) as
    torchft's. The formation of each bucket is delayed, so that without the wait the
    writes would come first."""
    cfg: dict[str, Any] = {"sync_every": 4, "fragment_sync_delay": 1,
                           "fragment_update_alpha": 0.5}
    if writer == "clamp":
        cfg["setup"] = Setup(post_step=_clamp_weights)
        ref_cfg = dict(cfg)
    else:
        cfg["inner"] = _full_offload_backward
        ref_cfg = {**cfg, "inner": _plain_adamw}
    with pipeoff.testing.delay_task(r"pseudograd:b\d+", 0.02):
        runs = run(mode, **cfg)
    assert_bitwise(runs, reference(**ref_cfg))


def _clip_after_a_held_formation(*switches: str) -> list[Any]:
    """fragment_sync_delay=1 and a weight clip after every step(): the pseudo-gradients
    are held until a replica blocks in a wait for them (the write guard before the
    clip, or the pre-step wait before the next inner step)."""
    from tests._stacks import release_when_any_waiting

    cfg: dict[str, Any] = {"sync_every": 4, "fragment_sync_delay": 1,
                           "fragment_update_alpha": 0.5, "setup": Setup(post_step=_clamp_weights)}
    with contextlib.ExitStack() as stack:
        for s in switches:
            stack.enter_context(pipeoff.testing.disable(s))
        release = stack.enter_context(pipeoff.testing.hold_task(r"pseudograd:b\d+"))
        watcher = release_when_any_waiting(release, ("on_read", "wait_for"), ("wait_formed",))
        try:
            return run("pipelined", **cfg)
        finally:
            release.set()
            watcher.join()


@pytest.mark.timeout(180)
def test_a_weight_clip_after_the_preparing_step_waits_for_the_formation() -> None:
    """The preparing step() returns before the pseudo-gradients are formed (the
    formation runs under the next forward); the clip's in-place write waits for them
    (the write guard), and the run is torchft's."""
    cfg: dict[str, Any] = {"sync_every": 4, "fragment_sync_delay": 1,
                           "fragment_update_alpha": 0.5, "setup": Setup(post_step=_clamp_weights)}
    assert_bitwise(_clip_after_a_held_formation(), reference(**cfg))


@pytest.mark.timeout(180)
def test_without_the_formation_wait_a_weight_clip_corrupts_the_sync() -> None:
    """Without the write guard the clip after the preparing step() runs before the held
    formation, and its result reaches the pseudo-gradients."""
    cfg: dict[str, Any] = {"sync_every": 4, "fragment_sync_delay": 1,
                           "fragment_update_alpha": 0.5, "setup": Setup(post_step=_clamp_weights)}
    runs = _clip_after_a_held_formation("diloco_formation_guard")
    with pytest.raises(AssertionError):
        assert_bitwise(runs, reference(**cfg))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offload_to_cpu", [True, False])
def test_the_masters_refreshed_are_those_of_the_fragment_torchft_synced(
        offload_to_cpu: bool) -> None:
    """A healing replica's start_quorum() moves its step to its peers' (torchft sets
    ``_step = max_step``), so torchft syncs another fragment than the step before the
    quorum names. The masters refreshed are those of the fragment torchft synced: after
    every sync each BF16 weight is its FP32 master's cast (a stale master would be
    copied back over the merged weight at the next step)."""
    from pipeoff.optim import FullOffloadOptimizer

    model = _bf16_model(0)
    inner = FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)
    manager = _committing_manager()
    jumps = [1]

    def start_quorum(*_: Any, **__: Any) -> None:
        # The first quorum heals this replica one step ahead, as a peer's step would.
        if jumps:
            for _ in range(jumps.pop()):
                manager.should_commit()

    manager.start_quorum.side_effect = start_quorum
    d = pipeoff.ft.DiLoCo(manager, [model[0], model[1]], inner,
                          [optim.SGD(model[0].parameters(), lr=0.7),
                           optim.SGD(model[1].parameters(), lr=0.7)],
                          4, fragment_sync_delay=0, offload_to_cpu=offload_to_cpu)
    synced = []
    with d:
        for k in range(8):
            _inner_step(model, inner)
            if k % 2 == 1:
                inner.wait_for_step()
                synced.append(d._chosen)
                for name, p in model.named_parameters():
                    master = inner._host_tensor(p, "master")
                    assert torch.equal(master.to(torch.bfloat16), p.detach()), (k, name)
    # The first sync was fragment 1 (step 1 after the quorum), not fragment 0.
    assert synced == [1, 0, 1, 0]


@pytest.mark.timeout(120)
def test_a_sync_refused_before_its_decision_leaves_the_masters_of_the_restored_weights(
        ) -> None:
    """A sync that raises after torchft restored the fragment's parameters (outer
    param_groups reordered, refused before the decision) still refreshes that
    fragment's FP32 masters under FullOffloadOptimizer: the next step steps the
    restored weights, not the masters of before."""
    from pipeoff.optim import FullOffloadOptimizer

    model = _bf16_model(0)
    params = list(model.parameters())
    inner = FullOffloadOptimizer(model, optim.AdamW, lr=1e-2, weight_decay=0.1)
    outer = optim.SGD(params[:2], lr=0.7)
    outer.add_param_group({"params": params[2:], "lr": 0.1})
    manager = _committing_manager()
    d = pipeoff.ft.DiLoCo(manager, [model], inner, outer, 2, offload_to_cpu=True)
    with d:
        for _ in range(2):
            _inner_step(model, inner)
        outer.param_groups.reverse()
        _inner_step(model, inner)
        _inner_step(model, inner, step=False)
        with pytest.raises(ConfigError, match="param_groups changed"):
            inner.step()
        inner.wait_for_step()
        for name, p in model.named_parameters():
            master = inner._host_tensor(p, "master")
            assert torch.equal(master.to(torch.bfloat16), p.detach()), name
