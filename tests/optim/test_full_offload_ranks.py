"""FullOffloadOptimizer under data-parallel wrappers in two gloo processes (issue 20):
DDP (torch's), HSDP clipping, torch DCP resumes across world sizes. The right values
are plain torch's with the same wrapper."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._two_ranks import run_two_ranks
from tests.optim import loops_worker

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")]


def _run(worker: Any, world: int = 2) -> dict[int, Any]:
    return {r: loops_worker.unpack(v) for r, v in run_two_ranks(worker, world=world).items()}


@pytest.fixture(scope="module")
def ddp() -> dict[int, Any]:
    res = _run(loops_worker.ddp_worker)
    for rank in (0, 1):
        assert "error" not in res[rank], res[rank]["error"]
    return res


@pytest.mark.parametrize("kind", ["plain", "no_sync", "accumulate", "backward", "bucket_view",
                                  "wrapped_after", "clip", "loop_clip"])
def test_under_ddp_the_reduced_gradient_is_stepped(ddp: dict[int, Any], kind: str) -> None:
    """Bitwise DDP with plain AdamW on every rank; no gradient is left on the device;
    the ranks agree."""
    for rank in (0, 1):
        case = ddp[rank][kind]
        assert case["same"], (rank, kind)
        assert case["grads_left"] == [], (rank, kind)
    assert ddp[0][kind]["weights"] == ddp[1][kind]["weights"]


def test_under_ddp_the_final_micro_step_in_one_pass_is_bitwise_the_fold_then_the_step(
        ddp: dict[int, Any]) -> None:
    """DDP's no_sync() marks the micro-steps: the final backward's reduced BF16 gradients
    are held and folded inside the step, bitwise the same run that folds first; the
    ranks agree."""
    for rank in (0, 1):
        case = ddp[rank]["one_pass"]
        assert case["one_pass"] and case["folded"] and case["same"], (rank, case)
    assert ddp[0]["one_pass"]["weights"] == ddp[1]["one_pass"]["weights"]


def test_under_ddp_the_norm_is_not_summed_over_replicas(ddp: dict[int, Any]) -> None:
    for rank in (0, 1):
        for mine, ref in ddp[rank]["clip"]["norms"]:
            assert mine == pytest.approx(ref, rel=1e-6), rank


def test_under_ddp_the_loops_clip_call_sees_the_reduced_norm(ddp: dict[int, Any]) -> None:
    """torch's clip_grad_norm_ on the DDP module's parameters, called by the loop between
    the last backward and step(): the norm of the reduced gradient, to the bit."""
    for rank in (0, 1):
        norms = ddp[rank]["loop_clip"]["norms"]
        assert len(norms) == 3 and all(mine == ref for mine, ref in norms), (rank, norms)


def test_under_ddp_taking_the_gradient_before_the_reducer_wrote_it_diverges(
        ddp: dict[int, Any]) -> None:
    """Under overlap="backward" every backward is final and takes param.grad in its
    end-of-backward callback; the mutation "ddp_reduced" takes it there, before DDP's
    finalize callback wrote the reduced gradient: each rank steps its own."""
    assert not ddp[0]["mutation"]["same"] or not ddp[1]["mutation"]["same"]


def test_hsdp_clipping_uses_the_true_norm() -> None:
    res = _run(loops_worker.hsdp_worker)
    for rank in (0, 1):
        assert "error" not in res[rank], res[rank]["error"]
        for mine, ref in res[rank]["norms"]:
            assert mine == pytest.approx(ref, rel=1e-5), (rank, mine, ref)  # not sqrt(2) x
        assert res[rank]["close"], rank


def _dcp(tmp_path: Path, optimizer: str, save_world: int, load_world: int) -> tuple[Any, Any]:
    path = str(tmp_path / f"ckpt-{optimizer}-{save_world}-{load_world}")
    saved = _run(functools.partial(loops_worker.dcp_worker, phase="save", path=path,
                                            optimizer=optimizer), save_world)
    loaded = _run(functools.partial(loops_worker.dcp_worker, phase="load", path=path,
                                             optimizer=optimizer), load_world)
    for res in (saved, loaded):
        for r in res.values():
            assert "error" not in r, r["error"]
    return (torch.load(f"{path}.save.pt", weights_only=False),
            torch.load(f"{path}.load.pt", weights_only=False))


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 1), (1, 2)])
def test_torch_dcp_resume_across_world_sizes_loads_the_state(tmp_path: Path, save_world: int,
                                                            load_world: int) -> None:
    saved, loaded = _dcp(tmp_path, "full_offload", save_world, load_world)
    assert saved and set(saved) == set(loaded)
    for fqn, entry in saved.items():
        for key, val in entry.items():
            got = loaded[fqn][key]
            if isinstance(val, torch.Tensor):
                assert torch.equal(val, got), (fqn, key)
            else:
                assert val == got, (fqn, key)
        assert float(entry["step"]) == 2.0  # the saved state, not the template's


@pytest.mark.parametrize("route", ["host", "device"])
def test_a_rank_without_gradients_of_a_group_still_joins_its_norm_all_reduce(
        route: str) -> None:
    """Expert parallelism: rank 1 routes no token to its expert, so it holds no gradient
    of the expert group's parameters; it joins that group's all-reduce with zero
    (skipping it would leave rank 0 waiting, and rank 1 clip by its own norm).

    ``device``: the mesh's group taken for an NCCL-only one (FSDP2's usual set-up on
    GPUs), which refuses host tensors: the squared norms cross as copies in the
    parameters' device memory and the sums come back to the host (a sum left on the
    copy would clip by the rank's own norm)."""
    res = _run(functools.partial(loops_worker.expert_norm_worker,
                                 device_route=route == "device"))
    for rank in (0, 1):
        assert "error" not in res[rank], res[rank]["error"]
        for mine, ref in res[rank]["norms"]:
            assert mine == pytest.approx(ref, rel=1e-5), (rank, mine, ref)
        assert (res[rank]["routed"] > 0) == (route == "device"), res[rank]["routed"]


def test_the_norms_all_reduce_waits_for_the_callers_collectives_before_step() -> None:
    """A final backward's clipping norm is ready before step(); its all-reduce (on the
    lane, on the group the parameters are sharded over) still waits for step()'s
    ``reduce`` gate, so a collective the caller issues in between on that group (a loss
    all-reduce) pairs with the peer's own, on every rank, whatever order the lanes
    would have taken (the worker forces the two ranks into opposite ones)."""
    res = _run(loops_worker.reduce_gate_worker)
    for rank in (0, 1):
        assert "error" not in res[rank], res[rank]["error"]
        assert res[rank]["sum"] == 3000.0, (rank, res[rank]["sum"])
