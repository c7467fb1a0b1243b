"""Model shapes and shape-only graphs of pipeoff's features, for simulation.

The graphs mirror what the features build at run time (the same tasks,
buffers and dependencies), with ``work=None`` so they cost no memory: a 70B
model is a list of shapes here, not tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeoff._errors import ConfigError
from pipeoff.graph import TaskGraph, TaskKind

__all__ = ["MODEL_PRESETS", "ModelShape", "local_sgd_graph", "model_shape", "optimizer_graph"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Decoder:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int
    tied: bool = False

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("embed", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "q", (h, h)), (p + "k", (kv, h)), (p + "v", (kv, h)),
                (p + "o", (h, h)), (p + "gate", (self.intermediate, h)),
                (p + "up", (self.intermediate, h)), (p + "down", (h, self.intermediate)),
                (p + "norm1", (h,)), (p + "norm2", (h,)),
            ]
        out.append(("norm", (h,)))
        if not self.tied:
            out.append(("lm_head", (self.vocab, h)))
        return out


MODEL_PRESETS: dict[str, _Decoder] = {
    # Qwen3-0.6B-like: 28 layers, hidden 1024, tied embeddings.
    "0.6b": _Decoder(hidden=1024, layers=28, intermediate=3072, vocab=151936, kv_heads=8,
                     head_dim=128, tied=True),
    # Llama-3-8B-like.
    "8b": _Decoder(hidden=4096, layers=32, intermediate=14336, vocab=128256, kv_heads=8,
                   head_dim=128),
    # Llama-3-70B-like.
    "70b": _Decoder(hidden=8192, layers=80, intermediate=28672, vocab=128256, kv_heads=8,
                    head_dim=128),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The local (per-rank) parameter shapes of a model under FSDP sharding."""

    name: str
    global_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Parameter names and full shapes."""
    fsdp: int
    """Ranks the parameters are sharded over (``Shard(0)``)."""

    @property
    def local_numels(self) -> tuple[tuple[str, int], ...]:
        """Elements of each parameter's largest local shard (ceil on dim 0)."""
        out = []
        for name, shape in self.global_shapes:
            rows = math.ceil(shape[0] / self.fsdp)
            out.append((name, rows * math.prod(shape[1:])))
        return tuple(out)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for _, s in self.global_shapes)


def model_shape(spec: str, *, fsdp: int = 1) -> ModelShape:
    """A preset name (``0.6b``, ``8b``, ``70b``) or a JSON file of ``{name: shape}``.

    Raises:
        ConfigError: unknown preset, unreadable file, or malformed shapes.
    """
    if isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1:
        raise ConfigError(f"fsdp must be an int >= 1, got {fsdp!r}")
    key = spec.lower()
    if key in MODEL_PRESETS:
        return ModelShape(name=key, global_shapes=tuple(MODEL_PRESETS[key].shapes()), fsdp=fsdp)
    path = Path(spec)
    if not path.suffix == ".json":
        raise ConfigError(
            f"model must be one of {sorted(MODEL_PRESETS)} or a .json file of "
            f"{{name: shape}}, got {spec!r}"
        )
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"shape file {spec!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"shape file {spec!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"shape file {spec!r} must hold a non-empty object {{name: shape}}")
    shapes = []
    for name, shape in data.items():
        if (not isinstance(shape, list) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                           for d in shape)):
            raise ConfigError(
                f"shape file {spec!r}: parameter {name!r} has shape {shape!r}; "
                "expected a non-empty list of positive ints"
            )
        shapes.append((str(name), tuple(shape)))
    return ModelShape(name=path.stem, global_shapes=tuple(shapes), fsdp=fsdp)


def _chunks(numels: tuple[tuple[str, int], ...], chunk_elems: int) -> list[int]:
    """Pack parameters, in order, into chunks of at most ``chunk_elems``, splitting big ones."""
    chunks: list[int] = []
    cur = 0
    for _, n in numels:
        while n:
            take = min(n, chunk_elems - cur)
            cur += take
            n -= take
            if cur == chunk_elems:
                chunks.append(cur)
                cur = 0
    if cur:
        chunks.append(cur)
    return chunks


def optimizer_graph(shape: ModelShape, *, chunk_bytes: int | None,
                    state_bytes_per_elem: int = 8) -> TaskGraph:
    """The offload optimizer's step: per chunk H2D of state, update, D2H of state.

    ``chunk_bytes=None`` is ``single_pass``: one chunk holding all the state.
    """
    elems = sum(n for _, n in shape.local_numels)
    per_chunk = elems if chunk_bytes is None else max(1, chunk_bytes // state_bytes_per_elem)
    g = TaskGraph()
    for k, n in enumerate(_chunks(shape.local_numels, per_chunk)):
        b = g.add_buffer(f"state{k}", n * state_bytes_per_elem, where="device")
        g.add_task(f"h2d:{k}", TaskKind.H2D, buffers=[b], nbytes=n * state_bytes_per_elem)
        g.add_task(f"step:{k}", TaskKind.OPTIMIZER_CHUNK, deps=[f"h2d:{k}"], buffers=[b],
                   nbytes=n * 4)
        g.add_task(f"d2h:{k}", TaskKind.D2H, deps=[f"step:{k}"], buffers=[b],
                   nbytes=n * state_bytes_per_elem)
    return g


Variant = Literal["original", "rfc", "pipelined"]


def local_sgd_graph(shape: ModelShape, *, variant: Variant, bucket_bytes: int = 256 << 20,
                    bytes_per_elem: int = 4) -> TaskGraph:
    """One LocalSGD sync that commits.

    - ``original``: torchft's path: every parameter cloned on the device and
      all-reduced at once, then copied back (no host staging).
    - ``rfc``: RFC 0003: per parameter clone, all-reduce, copy to host, free;
      then write back (run it with ``Schedule.synchronous()``).
    - ``pipelined``: buckets of ``bucket_bytes``: all-reduce, D2H into pinned
      host buffers, then a commit and H2D write-back per bucket.
    """
    g = TaskGraph()
    numels = shape.local_numels
    if variant == "original":
        for name, n in numels:
            b = g.add_buffer(f"avg:{name}", n * bytes_per_elem, where="device")
            g.add_task(f"allreduce:{name}", TaskKind.ALLREDUCE, buffers=[b],
                       nbytes=n * bytes_per_elem)
        g.add_task("commit", TaskKind.HOST, deps=[f"allreduce:{n}" for n, _ in numels])
        for name, _ in numels:
            g.add_task(f"writeback:{name}", TaskKind.OPTIMIZER_CHUNK, deps=["commit"],
                       buffers=[f"avg:{name}"], nbytes=0)
        return g
    if variant == "rfc":
        units = [(name, n) for name, n in numels]
    elif variant == "pipelined":
        per = max(1, bucket_bytes // bytes_per_elem)
        units = [(f"bucket{k}", n) for k, n in enumerate(_chunks(numels, per))]
    else:
        raise ConfigError(f"variant must be 'original', 'rfc' or 'pipelined', got {variant!r}")
    for name, n in units:
        nb = n * bytes_per_elem
        dev = g.add_buffer(f"dev:{name}", nb, where="device")
        host = g.add_buffer(f"host:{name}", nb, where="host")
        g.add_task(f"allreduce:{name}", TaskKind.ALLREDUCE, buffers=[dev], nbytes=nb)
        g.add_task(f"d2h:{name}", TaskKind.D2H, deps=[f"allreduce:{name}"],
                   buffers=[dev, host], nbytes=nb)
    g.add_task("commit", TaskKind.HOST, deps=[f"d2h:{name}" for name, _ in units])
    for name, n in units:
        g.add_task(f"h2d:{name}", TaskKind.H2D, deps=["commit"], buffers=[f"host:{name}"],
                   nbytes=n * bytes_per_elem)
    return g
