"""Overlap mode with gradients kept as views of a bucket (DDP's ``gradient_as_bucket_view``).

With ``gradient_as_bucket_view=True`` DDP keeps each ``param.grad`` as a view of
its bucket and writes the bucket in the next backward: the new gradients of the
parameters that run, and zeros over those of the parameters that do not
(``find_unused_parameters=True``). The forward waits cover the modules that run;
a module that does not run has nobody waiting for its chunks, whose step read
the zeros (a tester's find: 1e-2 off plain AdamW under the same DDP). The next
backward now waits first for the chunks that read gradients in a bucket.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeoff import testing
from pipeoff.optim import OffloadOptimizer
from tests._stacks import release_when_waiting
from tests.gpu_device import Gpu


class _Net(nn.Module):
    """``a`` runs every step; ``side`` on the steps asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.side = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.a(x)
        if use_side:
            h = h + self.side(torch.ones(1, 32, device=x.device)).mean()
        return h


class _Buckets:
    """DDP's bucket views in small, for a device DDP does not run on (the simulated
    one): each gradient is copied into its view of one flat buffer and becomes that
    view; at a backward's first gradient the views of the parameters that do not run
    are zeroed, as DDP marks them ready."""

    def __init__(self, model: _Net) -> None:
        self.params = list(model.parameters())
        p0 = self.params[0]
        flat = torch.zeros(sum(p.numel() for p in self.params), device=p0.device)
        self.views = list(torch.split(flat, [p.numel() for p in self.params]))
        self.views = [v.view_as(p) for v, p in zip(self.views, self.params, strict=True)]
        self.unused: list[int] = []
        self.first = True
        for k, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, k=k: self._ready(k, p))

    def forward(self, model: _Net, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        side = {id(p) for p in model.side.parameters()}
        self.unused = [k for k, p in enumerate(self.params) if not use_side and id(p) in side]
        self.first = True
        return model(x, use_side)

    def _ready(self, k: int, p: torch.Tensor) -> None:
        if self.first:
            self.first = False
            for u in self.unused:
                self.views[u].zero_()
                self.params[u].grad = self.views[u]
        assert p.grad is not None
        if p.grad is not self.views[k]:
            self.views[k].copy_(p.grad)
            p.grad = self.views[k]


_Wrap = Callable[[nn.Module], tuple[Callable[..., torch.Tensor], nn.Module]]
"""A model to (its forward, the module ``attach()`` takes)."""


def _train(wrap: _Wrap, to_device: Any, model: nn.Module, opt: Any, hold: str | None,
           attach: bool) -> None:
    """Three steps; ``side`` runs on the first two. With ``hold``, the chunks of
    ``side`` stepped after the second are held until the main thread waits in the
    third's backward (or until that backward is over)."""
    forward, root = wrap(model)
    if attach:
        opt.attach(root)
    g = torch.Generator().manual_seed(0)
    for k in range(3):
        x = to_device(torch.randn(4, 16, generator=g))
        if hold is not None and k == 1:
            with testing.hold_task(hold) as release:
                watcher = release_when_waiting(release, "before_backward")
                forward(x, True).square().mean().backward()
                opt.step()
                opt.zero_grad()
                # Without the wait, this backward zeroes side's gradients in the
                # bucket while its chunks (held) have yet to read them.
                y = forward(to_device(torch.randn(4, 16, generator=g)), False)
                y.square().mean().backward()
                release.set()
            watcher.join()
            opt.step()
            opt.zero_grad()
            break
        forward(x, k < 2).square().mean().backward()
        opt.step()
        opt.zero_grad()
    getattr(opt, "wait_for_step", lambda: None)()


def _check(wrap: _Wrap, to_device: Any,
           module: Callable[[nn.Module], nn.Module], attach: bool, read_guard: bool,
           fraction: float) -> None:
    torch.manual_seed(0)
    ref_model = module(_Net())
    model = copy.deepcopy(ref_model)
    _train(wrap, to_device, ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2),
           None, False)
    opt = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), overlap="forward",
                           chunk_bytes=1024, offload_fraction=fraction, read_guard=read_guard)
    side = {id(p) for p in model.side.parameters()}
    params = list(model.parameters())
    # (The chunks of side's parameters alone: the forward of ``a`` waits for its own.)
    chunks = [c.index for c in opt.plan.chunks
              if all(id(params[s.param]) in side for s in c.segments)]
    assert chunks
    _train(wrap, to_device, model, opt, "opt(" + "|".join(map(str, chunks)) + ")", attach)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_WAYS = pytest.mark.parametrize(("attach", "read_guard"),
                                [(False, True), (True, True), (True, False)])


@_WAYS
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_an_unused_modules_gradients_in_ddps_buckets_are_read_before_the_next_backward(
        one_rank: None, attach: bool, read_guard: bool, fraction: float) -> None:
    def wrap(model: nn.Module) -> Any:
        ddp = DDP(model, gradient_as_bucket_view=True, find_unused_parameters=True)
        return ddp, ddp

    _check(wrap, lambda t: t, lambda m: m, attach, read_guard, fraction)


@_WAYS
def test_gradients_in_a_bucket_on_a_cuda_device(gpu: Gpu, attach: bool,
                                                read_guard: bool) -> None:
    """The same on CUDA streams (the simulated device, where DDP does not run: its
    bucket views in small): the backward's stream waits for the chunks' events."""
    def wrap(model: nn.Module) -> Any:
        buckets = _Buckets(model)  # type: ignore[arg-type]

        def forward(x: torch.Tensor, use_side: bool) -> torch.Tensor:
            return buckets.forward(model, x, use_side)  # type: ignore[arg-type]

        return forward, model

    _check(wrap, gpu.tensor, gpu.module, attach, read_guard, 1.0)
