"""pipeoff's optimizers inside PyTorch Lightning, the Trainer itself (CPU, one process).

Lightning's automatic optimization passes a closure to ``optimizer.step`` (the
last batch of an accumulation window runs its ``training_step`` and backward
inside it), clips with ``gradient_clip_val`` inside that closure through torch's
``clip_grad_norm_``, and logs norms with ``lightning.pytorch.utilities.grad_norm``;
manual optimization calls ``self.clip_gradients`` itself. The right value is the
same run with ``torch.optim.AdamW`` on the same FP32 model: weights bitwise, and
the norms it logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeoff.optim import FullOffloadOptimizer, OffloadOptimizer

pl = pytest.importorskip("lightning.pytorch")
grad_norm = pytest.importorskip("lightning.pytorch.utilities").grad_norm

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:pipeoff. pinned host memory")]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 16, generator=g) * 3
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=6)


class Module(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, net: torch.nn.Module, kind: str, manual: bool = False,
                 clip: float | None = None) -> None:
        super().__init__()
        self.net = net
        self.kind = kind
        self.automatic_optimization = not manual
        self.clip = clip
        self.norms: list[dict[str, float]] = []

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        loss = self.net(batch[0]).pow(2).mean() * 10
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=self.clip,
                                gradient_clip_algorithm="norm")
            opt.step()
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append({k: float(v) for k, v in grad_norm(self.net, norm_type=2).items()})

    def configure_optimizers(self) -> Any:
        if self.kind == "full":
            return FullOffloadOptimizer(self, torch.optim.AdamW, lr=1e-2)
        if self.kind == "offload":
            return OffloadOptimizer(self.parameters(), torch.optim.AdamW, lr=1e-2,
                                    mode="overlap")
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(kind: str, tmp: Path, **kw: Any) -> Module:
    manual = kw.pop("manual", False)
    clip = kw.pop("clip", None)
    module = Module(_net(), kind, manual=manual, clip=clip)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp), **kw)
    trainer.fit(module, _data())
    opt = trainer.optimizers[0]
    getattr(opt, "wait_for_step", lambda: None)()
    return module


def _same(a: Module, b: Module) -> None:
    for (name, p), q in zip(a.net.named_parameters(), b.net.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert a.norms == b.norms and a.norms
    assert all(n for n in a.norms)  # grad_norm() saw the gradients


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "offload"])
def test_automatic_optimization_with_accumulation_and_gradient_clip_val(
        kind: str, tmp_path: Path) -> None:
    kw = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    want = _fit("plain", tmp_path / "plain", **kw)
    got = _fit(kind, tmp_path / kind, **kw)
    _same(got, want)
    assert all(n["grad_2.0_norm_total"] > 0.5 for n in want.norms)  # it clipped


@pytest.mark.slow
def test_manual_optimization_with_clip_gradients(tmp_path: Path) -> None:
    want = _fit("plain", tmp_path / "plain", manual=True, clip=0.5)
    got = _fit("full", tmp_path / "full", manual=True, clip=0.5)
    for (name, p), q in zip(got.net.named_parameters(), want.net.parameters(), strict=True):
        assert torch.equal(p, q), name


def _resumed(kind: str, tmp: Path) -> Module:
    """Two optimizer steps, Lightning's checkpoint, then a new module and Trainer resumed
    from it for two more."""
    kw: dict[str, Any] = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5,
                          "accelerator": "cpu", "devices": 1, "logger": False,
                          "enable_checkpointing": False, "enable_progress_bar": False,
                          "enable_model_summary": False, "default_root_dir": str(tmp)}
    first = Module(_net(), kind)
    trainer = pl.Trainer(max_steps=2, **kw)
    trainer.fit(first, _data())
    ckpt = tmp / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    second = Module(_net(), kind)
    trainer = pl.Trainer(max_steps=4, **kw)
    trainer.fit(second, _data(), ckpt_path=str(ckpt))
    getattr(trainer.optimizers[0], "wait_for_step", lambda: None)()
    return second


@pytest.mark.slow
def test_resuming_from_lightnings_checkpoint(tmp_path: Path) -> None:
    want = _resumed("plain", tmp_path / "plain")
    got = _resumed("full", tmp_path / "full")
    for (name, p), q in zip(got.net.named_parameters(), want.net.parameters(), strict=True):
        assert torch.equal(p, q), name
