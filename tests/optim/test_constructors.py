"""Both optimizers in torchao's form, ``(params, optimizer_class, **optimizer_kwargs)``,
beside their own: the same bits, and the knobs other tools use named for what they are."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pipeoff import ConfigError
from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _groups(m: torch.nn.Module) -> list[dict[str, Any]]:
    return [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")],
             "weight_decay": 0.1},
            {"params": [p for n, p in m.named_parameters() if n.endswith("bias")],
             "weight_decay": 0.0}]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(2):
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    getattr(opt, "wait_for_step", lambda: None)()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("form", ["positional", "keyword", "model"])
def test_full_offload_from_param_groups_is_the_grouped_adamw_run(form: str) -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    if form == "positional":
        opt = FullOffloadOptimizer(_groups(model), torch.optim.AdamW, lr=1e-2)
    elif form == "keyword":
        opt = FullOffloadOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=1e-2)
    else:
        opt = FullOffloadOptimizer(model, torch.optim.AdamW, params=_groups(model), lr=1e-2)
    _train(ref, ref_opt)
    _train(model, opt)
    assert _same(ref, model)
    assert opt.model is model  # found at the first forward (or given)
    assert [n for n, _ in model.named_parameters()] == [
        r.name for r in sorted(opt._registry, key=lambda r: [id(p) for p in model.parameters()
                                                              ].index(id(r.param)))]


def test_full_offload_defaults_to_adamw_as_torchao() -> None:
    model = _model()
    assert FullOffloadOptimizer(model.parameters(), lr=1e-3).optimizer_class is torch.optim.AdamW


@pytest.mark.parametrize("form", ["instance", "torchao", "keyword"])
def test_offload_optimizer_forms_are_the_same_run(form: str) -> None:
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    if form == "instance":
        opt = OffloadOptimizer(torch.optim.AdamW(_groups(model), lr=1e-2), mode="overlap")
    elif form == "torchao":
        opt = OffloadOptimizer(_groups(model), torch.optim.AdamW, lr=1e-2, mode="overlap")
    else:
        opt = OffloadOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=1e-2,
                               mode="overlap")
    _train(ref, ref_opt)
    _train(model, opt)
    assert _same(ref, model)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(("make", "match"), [
    (lambda m: OffloadOptimizer(torch.optim.AdamW(m.parameters()), torch.optim.AdamW),
     "either an optimizer instance"),
    (lambda m: OffloadOptimizer(torch.optim.AdamW(m.parameters()), lr=1e-3),
     r"with an instance, \['lr'\]"),
    (lambda m: OffloadOptimizer(m.parameters(), dict), "optimizer_class must be"),
    (lambda m: OffloadOptimizer(m.parameters(), torch.optim.AdamW, betas=1),
     "AdamW refused"),
    (lambda m: OffloadOptimizer(m.parameters(), offload_gradients=True),
     "use FullOffloadOptimizer"),
    (lambda m: OffloadOptimizer(m.parameters(), minimal_size=4096), "minimal_size"),
    (lambda m: OffloadOptimizer(m.parameters(), device="cuda"), "device"),
    (lambda m: OffloadOptimizer(), "needs an optimizer"),
    (lambda m: OffloadOptimizer(m), "got a module"),
    (lambda m: FullOffloadOptimizer(m.parameters(), offload_gradients=False),
     "always takes the gradients to the host"),
    (lambda m: FullOffloadOptimizer(m.parameters(), pin_memory="yes"), "pin_memory must be"),
    (lambda m: FullOffloadOptimizer(m.parameters(), ratio=0.5),
     r"does not take ratio=: use offload_fraction="),
    (lambda m: OffloadOptimizer(m.parameters(), ratio=0.5), "use offload_fraction="),
    (lambda m: OffloadOptimizer(m.parameters(), nvme_path="/nvme"), "NVMe"),
    (lambda m: OffloadOptimizer(m.parameters(), buffer_count=4), "prefetch="),
    (lambda m: FullOffloadOptimizer(m.parameters(), optimizer_offload_fraction=0.5),
     r"does not take optimizer_offload_fraction=: use offload_fraction="),
    # A new user's finds: other tools' names, and arguments blamed on the wrong one.
    (lambda m: FullOffloadOptimizer(m, max_grad_norm=1.0), "use max_norm="),
    (lambda m: OffloadOptimizer(m.parameters(), max_grad_norm=1.0), "clip in the loop"),
    (lambda m: FullOffloadOptimizer(m, grad_acc_on_gpu=True), "accumulate='gpu'"),
    (lambda m: FullOffloadOptimizer(m, use_precision_aware_optimizer=True), "FP32 masters"),
    # (new users' finds: the instance's whole repr; a typo blamed on AdamW)
    (lambda m: FullOffloadOptimizer(m, torch.optim.AdamW(m.parameters())),
     r"got an instance of AdamW: pass the class \(the optimizer takes the model"),
    (lambda m: OffloadOptimizer(m.parameters(), torch.optim.AdamW(m.parameters())),
     "got an instance of AdamW: pass the class"),
    (lambda m: FullOffloadOptimizer(m, torch.optim.AdamW, lrr=1e-3),
     "lrr= is neither a FullOffloadOptimizer argument nor a hyperparameter of AdamW"),
    (lambda m: FullOffloadOptimizer(m, offload_gradients="x"),
     r"offload_gradients=...\) must be True or False"),
    (lambda m: OffloadOptimizer([], torch.optim.AdamW, lr=1e-3), "params is empty"),
    (lambda m: OffloadOptimizer(5, torch.optim.AdamW), "params must be an iterable"),
    (lambda m: OffloadOptimizer(m.parameters(), foo=1, lr=1e-3),
     "foo= is neither an OffloadOptimizer argument nor a hyperparameter of AdamW"),
    (lambda m: FullOffloadOptimizer(m, timeout=float("nan")),
     "timeout must be a positive, finite number"),
    (lambda m: FullOffloadOptimizer(m, timeout=float("inf")), "timeout must be"),
    (lambda m: FullOffloadOptimizer(m, device_budget_bytes=-1),
     "device_budget_bytes must be a positive int"),
    (lambda m: FullOffloadOptimizer(m, process_group="x"),
     "process_group was given, but torch.distributed is not initialized"),
    (lambda m: OffloadOptimizer(m.parameters(), process_group=1),
     "process_group was given, but torch.distributed is not initialized"),
    (lambda m: OffloadOptimizer(m.parameters(), overlap_cpu_optimizer_d2h_h2d=True),
     "always overlaps"),
    (lambda m: FullOffloadOptimizer(m.parameters(), offload_policy=None), "fully_shard"),
    (lambda m: OffloadOptimizer(m.parameters(), overlap="backward"), "FullOffloadOptimizer's"),
    (lambda m: OffloadOptimizer(m.parameters(), overlap="forward", mode="chunked"), "not both"),
    (lambda m: OffloadOptimizer(m.parameters(), chunk_bytes="1XB"), "chunk_bytes: unknown unit"),
    (lambda m: FullOffloadOptimizer(m, gradient_clipping=1.0), "use max_norm="),
    (lambda m: OffloadOptimizer(m.parameters(), max_norm=1.0), "clip them in the loop"),
    (lambda m: OffloadOptimizer(m.parameters(), slots=4), "staging depth is prefetch="),
    (lambda m: FullOffloadOptimizer(m, prefetch=2), "FullOffloadOptimizer's is slots="),
    (lambda m: FullOffloadOptimizer(m, mode="overlap"), "takes overlap="),
    (lambda m: FullOffloadOptimizer(m, offload_optimizer={"device": "cpu"}), "pin_memory="),
    (lambda m: FullOffloadOptimizer(torch.optim.AdamW(m.parameters())), "not a AdamW instance"),
    (lambda m: FullOffloadOptimizer(OffloadOptimizer(torch.optim.AdamW(m.parameters()))),
     r"torch\.optim\.AdamW, lr=\.\.\.\), not a OffloadOptimizer instance"),
    (lambda m: FullOffloadOptimizer(m.parameters(), slot_bytes="big"),
     "slot_bytes must be a positive int"),
    (lambda m: FullOffloadOptimizer(m, params=m.parameters(), minimal_size=1), "minimal_size"),
    (lambda m: FullOffloadOptimizer(m.parameters(), params=m.parameters()), "not both"),
    (lambda m: FullOffloadOptimizer(next(m.parameters())), "a single tensor"),
    (lambda m: FullOffloadOptimizer(3), "must be a torch.nn.Module"),
    (lambda m: OffloadOptimizer(torch.optim.AdamW(m.parameters()), pin_memory="no"),
     "pin_memory must be True or False, got 'no'"),
    (lambda m: FullOffloadOptimizer(m, pin_memory="no"),
     "pin_memory must be True or False, got 'no'"),
])
def test_mixed_forms_and_other_tools_knobs_are_refused_by_name(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make(_model())


def test_offload_gradients_false_is_what_offload_optimizer_does() -> None:
    model = _model()
    OffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=False, lr=1e-3)
    FullOffloadOptimizer(model, offload_gradients=True, lr=1e-3)  # what it does


def test_one_convention_for_the_shared_knobs() -> None:
    # overlap=, pin_memory= and byte sizes as strings mean the same in both optimizers.
    model = _model()
    opt = OffloadOptimizer(model.parameters(), overlap="forward", chunk_bytes="1KiB",
                           device_budget_bytes="3KiB", lr=1e-3)
    assert (opt.mode, opt.chunk_bytes, opt.device_budget_bytes) == ("overlap", 1024, 3072)
    assert OffloadOptimizer(model.parameters(), overlap="none").mode == "chunked"
    full = FullOffloadOptimizer(model, chunk_bytes="4KiB", slot_bytes="1MB",
                                pin_memory=False, lr=1e-3)
    assert (full.chunk_numel, full.slot_bytes) == (1024, 10**6)
    assert full._registry.pin is False


def test_a_model_found_late_keeps_the_names_and_its_wrapper_probe() -> None:
    """Built from parameters; the model's first forward gives it the model (names for
    errors and gates), and no global hook stays."""
    model = _model()
    opt = FullOffloadOptimizer(list(model.parameters()), lr=1e-2)
    assert opt.model is None
    with pytest.raises(ConfigError, match="attach\\(\\) needs the model"):
        opt.attach()
    before = len(torch.nn.modules.module._global_forward_pre_hooks)  # (the finder's)
    model(torch.randn(2, 8)).sum().backward()
    assert opt.model is model
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == before - 1  # gone
    opt.step()
    opt.attach()  # now it knows the model
    opt.wait_for_step()


def test_optimizer_class_by_name_as_config_files_give_it() -> None:
    model = _model()
    assert FullOffloadOptimizer(model, "AdamW", lr=1e-3).optimizer_class is torch.optim.AdamW
    assert isinstance(OffloadOptimizer(model.parameters(), "sgd", lr=0.1).inner,
                      torch.optim.SGD)
    with pytest.raises(ConfigError, match="names no torch.optim optimizer"):
        OffloadOptimizer(model.parameters(), "adamw_torch_fused")


def test_errors_do_not_dump_whole_param_groups() -> None:
    model = torch.nn.Linear(256, 256)
    groups = [{"params": list(model.parameters())}]
    for make in (lambda: OffloadOptimizer(optimizer=groups),  # type: ignore[arg-type]
                 lambda: FullOffloadOptimizer(groups[0]["params"][0])):
        with pytest.raises(ConfigError) as err:
            make()
        assert len(str(err.value)) < 400, str(err.value)


def test_a_parameter_frozen_when_the_model_form_was_built_warns_once_unfrozen() -> None:
    """The model form takes the parameters that require grad (as the HF Trainer's groups);
    one unfrozen after a warm-up is in no group, where torch's AdamW(model.parameters())
    steps it: its first gradient warns (a tester's find: silently never stepped)."""
    model = _model()
    model[2].weight.requires_grad_(False)
    opt = FullOffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    model[2].weight.requires_grad_(True)
    with pytest.warns(RuntimeWarning, match=r"'2\.weight' was frozen when the optimizer"):
        model(torch.ones(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    model[2].weight.grad = None
    opt.add_param_group({"params": [model[2].weight]})  # (what the warning says)
    model(torch.ones(4, 8)).sum().backward()
    w = model[2].weight.detach().clone()
    opt.step()
    opt.wait_for_step()
    assert not torch.equal(model[2].weight, w)


@pytest.mark.parametrize("how", ["params", "model_params", "add_param_group"])
def test_a_set_of_parameters_is_refused_as_torch_refuses_it(how: str) -> None:
    model = _model()
    with pytest.raises(ConfigError, match="is a set, whose order changes between runs"):
        if how == "params":
            FullOffloadOptimizer(set(model.parameters()), torch.optim.AdamW)
        elif how == "model_params":
            FullOffloadOptimizer(model, torch.optim.AdamW, params=set(model.parameters()))
        else:
            opt = FullOffloadOptimizer(model, torch.optim.AdamW, params=[model[0].weight])
            opt.add_param_group({"params": {model[0].bias}})
