"""Model shapes and shape-only graphs of pipeoff's features, for simulation.

The optimizer's and LocalSGD's graphs come from the features' own builders
(:mod:`pipeoff.optim._offload._graph_shape`, :mod:`pipeoff.ft._sync_graph`), run
shape-only (``work=None``) so they cost no memory: a 70B model is a list of
shapes here, not tensors. A test checks that a real run's trace has the same
tasks, kinds, bytes and dependencies as the simulated one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeoff._errors import ConfigError
from pipeoff._validate import check_int
from pipeoff.graph import TaskGraph, TaskKind
from pipeoff.schedule import Schedule
from pipeoff.sim._compute import FORWARD_LANE

if TYPE_CHECKING:
    from pipeoff.optim._full_offload._graph import MicroStepPlan

__all__ = ["EXPERTS", "MODEL_PRESETS", "ModelShape", "diloco_graph_shape", "local_sgd_buckets",
           "local_sgd_graph",
           "local_sgd_sync_graph", "model_shape", "optimizer_graph", "optimizer_schedule",
           "transfer_graph_shape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Decoder:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    heads: int = 0
    """Query heads (0: ``hidden // head_dim``, a square query projection)."""
    experts: int = 0
    """Routed experts per layer (0: a dense MLP of ``intermediate``)."""
    experts_active: int = 0
    """Experts each token passes through (of ``experts``)."""

    @property
    def attn_width(self) -> int:
        """Width of the attention (query heads x head dim): its FLOPs' ``d``."""
        return self.heads * self.head_dim if self.heads else self.hidden

    @property
    def expert_share(self) -> float:
        """The share of an expert tensor's parameters a token passes through."""
        return self.experts_active / self.experts if self.experts else 1.0

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        h, kv, q = self.hidden, self.kv_heads * self.head_dim, self.attn_width
        out: list[tuple[str, tuple[int, ...]]] = [("embed", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "q", (q, h)), (p + "k", (kv, h)), (p + "v", (kv, h)),
                    (p + "o", (h, q))]
            if self.experts:
                # Each layer's experts as grouped tensors (expert first: FSDP's Shard(0)
                # splits them by expert), the router beside them.
                e, m = self.experts, self.intermediate
                out += [(p + "router", (e, h)), (p + EXPERTS + "gate_up", (e, 2 * m, h)),
                        (p + EXPERTS + "down", (e, h, m))]
            else:
                out += [(p + "gate", (self.intermediate, h)),
                        (p + "up", (self.intermediate, h)),
                        (p + "down", (h, self.intermediate))]
            out += [(p + "norm1", (h,)), (p + "norm2", (h,))]
        out.append(("norm", (h,)))
        if not self.tied:
            out.append(("lm_head", (self.vocab, h)))
        return out


EXPERTS = "experts."
"""The part of a parameter's name that marks a mixture of experts' routed experts."""

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
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 query
    # and 4 KV heads of 128, 128 experts with 8 active of intermediate 768, vocab
    # 151936, untied): 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": _Decoder(hidden=2048, layers=48, intermediate=768, vocab=151936,
                              kv_heads=4, head_dim=128, heads=32, experts=128,
                              experts_active=8),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The local (per-rank) parameter shapes of a model under FSDP sharding."""

    name: str
    global_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Parameter names and full shapes."""
    fsdp: int
    """Ranks the parameters are sharded over (``Shard(0)``)."""
    layers: int = 0
    """Transformer layers (the attention term of the compute; 0: unknown)."""
    hidden: int = 0
    """Width of the attention, query heads x head dim (the attention term of the compute;
    the model width where they are equal; 0: unknown)."""
    active: int | None = None
    """Parameters a token passes through (a mixture of experts' active ones); ``None``:
    all of them."""
    expert_share: float = 1.0
    """Share of each routed-expert parameter (a name with ``experts.``) a token passes
    through: active experts over experts (1.0: a dense model)."""

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

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: :attr:`active`, else all of them."""
        return self.params if self.active is None else self.active

    @property
    def local_params(self) -> int:
        """Elements of one rank's shards (its optimizer state's and masters' count)."""
        return sum(n for _, n in self.local_numels)

    def forward_flops(self, tokens: int, seq_len: int) -> float:
        """FLOPs of one rank's forward over ``tokens`` tokens in contexts of ``seq_len``
        (:func:`~pipeoff.sim.forward_flops`; every rank of an FSDP group computes the
        whole model on its own micro-batch)."""
        from pipeoff.sim._compute import forward_flops

        return forward_flops(self.active_params, tokens, layers=self.layers,
                             hidden=self.hidden, seq_len=seq_len)


def model_shape(spec: str, *, fsdp: int = 1) -> ModelShape:
    """A preset name (``0.6b``, ``8b``, ``70b``, ``qwen3-30b-a3b``) or a JSON file of
    ``{name: shape}``. For a mixture of experts the shape's :attr:`ModelShape.active`
    counts the experts a token passes through (the FLOPs), its shapes all of them (the
    memory and the optimizer's bytes).

    Raises:
        ConfigError: unknown preset, unreadable file, or malformed shapes.
    """
    check_int("fsdp", fsdp, as_bound=True)
    key = spec.lower()
    if key in MODEL_PRESETS:
        d = MODEL_PRESETS[key]
        shapes = tuple(d.shapes())
        active = None
        if d.experts:
            active = round(sum(math.prod(s) * (d.expert_share if EXPERTS in n else 1.0)
                               for n, s in shapes))
        return ModelShape(name=key, global_shapes=shapes, fsdp=fsdp, layers=d.layers,
                          hidden=d.attn_width, active=active, expert_share=d.expert_share)
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
    parsed: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in data.items():
        if (not isinstance(shape, list) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                           for d in shape)):
            raise ConfigError(
                f"shape file {spec!r}: parameter {name!r} has shape {shape!r}; "
                "expected a non-empty list of positive ints"
            )
        parsed.append((str(name), tuple(shape)))
    return ModelShape(name=path.stem, global_shapes=tuple(parsed), fsdp=fsdp)


def _optimizer_step(shape: ModelShape, *, chunk_bytes: int | None, prefetch: int,
                    state_bytes_per_elem: int) -> tuple[TaskGraph, Schedule]:
    from pipeoff.optim._offload._graph_shape import offload_step
    from pipeoff.optim._plan import ParamMeta, plan_chunks

    if state_bytes_per_elem % 4:
        raise ConfigError(f"state_bytes_per_elem must be a multiple of 4 (fp32 state tensors), "
                          f"got {state_bytes_per_elem!r}")
    numels = [n for _, n in shape.local_numels]
    nkeys = state_bytes_per_elem // 4
    plan = plan_chunks([ParamMeta(numel=n, itemsize=4, nkeys=nkeys, group=0) for n in numels],
                       chunk_bytes)
    count = len(numels)
    return offload_step(None, plan, itemsize=[4] * count, nkeys=[nkeys] * count,
                        local_numel=numels, present=[nkeys] * count, updated=range(count),
                        prefetch=prefetch)


def optimizer_graph(shape: ModelShape, *, chunk_bytes: int | None,
                    state_bytes_per_elem: int = 8) -> TaskGraph:
    """The offload optimizer's steady-state step (every parameter has a gradient and
    its state), built by the optimizer's own graph builder, shape only.

    fp32 parameters whose per-element state is ``state_bytes_per_elem`` bytes
    (AdamW: 8, two fp32 tensors). ``chunk_bytes=None`` is one chunk holding all
    the state (``single_pass``'s memory, the chunked path's tasks).
    """
    return _optimizer_step(shape, chunk_bytes=chunk_bytes, prefetch=1,
                           state_bytes_per_elem=state_bytes_per_elem)[0]


def optimizer_schedule(shape: ModelShape, *, chunk_bytes: int | None, prefetch: int = 1,
                       state_bytes_per_elem: int = 8) -> Schedule:
    """The schedule the optimizer would run :func:`optimizer_graph` with."""
    return _optimizer_step(shape, chunk_bytes=chunk_bytes, prefetch=prefetch,
                           state_bytes_per_elem=state_bytes_per_elem)[1]


def _full_offload_plan(shape: ModelShape, *, chunk_numel: int, slot_bytes: int, slots: int,
                       compute_itemsize: int, forward_order: bool = False) -> MicroStepPlan:
    from pipeoff.optim._full_offload._graph import MicroStepPlan, ParamSizes

    params = [ParamSizes(name=name, numel=n, grad_itemsize=compute_itemsize,
                         weight_itemsize=compute_itemsize) for name, n in shape.local_numels]
    return MicroStepPlan.build(params, chunk_numel=chunk_numel, slot_bytes=slot_bytes,
                               slots=slots, forward_order=forward_order)


def full_offload_graph(shape: ModelShape, *, chunk_numel: int = 16 << 20,
                       slot_bytes: int = 64 << 20, clip: bool = False,
                       compute_itemsize: int = 2, one_pass: bool = False) -> TaskGraph:
    """The final micro-step of a ``FullOffloadOptimizer`` step, built by its own graph
    builder, shape only: every gradient (BF16 by default) to the host, its last
    add, the chunk steps and the weights back. The simulator opens every gate
    at launch, so this is the host step once the backward has produced the
    last gradient: the drain ``overlap="backward"`` hides behind the backward
    and ``overlap="forward"`` behind the next forward.

    ``one_pass``: the final micro-step in one pass (docs/host_step.md): every
    gradient held (its ``acc`` task folds nothing) and folded inside its chunk's
    ``step`` (price it with a one-pass design, :data:`~pipeoff.sim.ONE_PASS_DESIGNS`);
    not with ``clip`` (a step that clips folds first)."""
    if one_pass and clip:
        raise ConfigError("one_pass and clip do not go together: a step that clips folds "
                          "the final gradients first (docs/host_step.md)")
    plan = _full_offload_plan(shape, chunk_numel=chunk_numel, slot_bytes=slot_bytes, slots=4,
                              compute_itemsize=compute_itemsize)
    if one_pass:
        return plan.graph(None, final=True, norm_first=True,
                          held=frozenset(range(len(plan.params))))
    return plan.graph(None, final=True, norm_first=clip)


def full_offload_schedule(shape: ModelShape, *, pipelined: bool, chunk_numel: int = 16 << 20,
                          slot_bytes: int = 64 << 20, slots: int = 4,
                          compute_itemsize: int = 2) -> Schedule:
    """The schedule ``FullOffloadOptimizer`` runs :func:`full_offload_graph` with."""
    plan = _full_offload_plan(shape, chunk_numel=chunk_numel, slot_bytes=slot_bytes,
                              slots=slots, compute_itemsize=compute_itemsize)
    return plan.schedule("forward" if pipelined else "none")


Variant = Literal["original", "rfc", "pipelined"]


def local_sgd_graph(shape: ModelShape, *, variant: Variant, bucket_bytes: int = 256 << 20,
                    bytes_per_elem: int = 4) -> TaskGraph:
    """One LocalSGD sync that commits.

    - ``original``: torchft's own path, the baseline: every parameter cloned on
      the device and all-reduced at once, then copied back (no host staging).
    - ``rfc``: RFC 0003 (``LocalSGD(schedule="synchronous")``): one bucket per
      parameter (run it with ``Schedule.synchronous()``).
    - ``pipelined``: buckets of ``bucket_bytes``.

    ``rfc`` and ``pipelined`` are built by LocalSGD's own graph builder (shape
    only), on parameters of ``bytes_per_elem`` bytes (4: fp32).
    """
    if variant == "original":
        g = TaskGraph()
        numels = shape.local_numels
        for name, n in numels:
            b = g.add_buffer(f"avg:{name}", n * bytes_per_elem, where="device")
            g.add_task(f"allreduce:{name}", TaskKind.ALLREDUCE, buffers=[b],
                       nbytes=n * bytes_per_elem)
        g.add_task("commit", TaskKind.HOST, deps=[f"allreduce:{n}" for n, _ in numels])
        for name, _ in numels:
            g.add_task(f"writeback:{name}", TaskKind.OPTIMIZER_CHUNK, deps=["commit"],
                       buffers=[f"avg:{name}"], nbytes=0)
        return g
    if variant not in ("rfc", "pipelined"):
        raise ConfigError(f"variant must be 'original', 'rfc' or 'pipelined', got {variant!r}")
    return local_sgd_sync_graph(shape, per_parameter=variant == "rfc",
                                bucket_bytes=None if variant == "rfc" else bucket_bytes,
                                bytes_per_elem=bytes_per_elem)


def local_sgd_buckets(shape: ModelShape, *, per_parameter: bool, bucket_bytes: int | None,
                      bytes_per_elem: int = 4) -> tuple[Any, ...]:
    """The buckets LocalSGD would plan for these shapes (its own planner)."""
    import torch

    from pipeoff.ft._buckets import TensorInfo, plan_buckets

    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(bytes_per_elem)
    if dtype is None:
        raise ConfigError(f"bytes_per_elem must be 2, 4 or 8, got {bytes_per_elem!r}")
    infos = [TensorInfo(name=name, numel=n, dtype=dtype, contiguous=True)
             for name, n in shape.local_numels]
    return plan_buckets(infos, limit=bucket_bytes, per_parameter=per_parameter)


def local_sgd_sync_graph(shape: ModelShape, *, per_parameter: bool, bucket_bytes: int | None,
                         bytes_per_elem: int = 4) -> TaskGraph:
    """LocalSGD's offloaded sync for these shapes, from its own builder (shape only)."""
    from pipeoff.ft._sync_graph import sync_graph

    return sync_graph(local_sgd_buckets(shape, per_parameter=per_parameter,
                                        bucket_bytes=bucket_bytes,
                                        bytes_per_elem=bytes_per_elem), None)


DiLoCoVariant = Literal["original", "synchronous", "pipelined"]


def diloco_graph_shape(shape: ModelShape, *, variant: DiLoCoVariant,
                       bucket_bytes: int = 256 << 20, bytes_per_elem: int = 4,
                       next_forward_flops: float | None = None,
                       fragment_sync_delay: int = 0) -> TaskGraph:
    """One DiLoCo sync that commits (one fragment: the whole local model), and with
    ``next_forward_flops`` (one forward's FLOPs) the training around it on
    :data:`~pipeoff.sim.FORWARD_LANE`: the ``fragment_sync_delay`` inner steps
    between the sync's preparation and its decision (a forward and a backward,
    3 forwards' FLOPs, each), and the forward after it.

    - ``original``: torchft's ``DiLoCo``, the baseline: per parameter, the backup
      copied to the device and the pseudo-gradient formed there (S on the
      device), every all-reduce issued at once; after the commit the restore
      (host to device), the outer step on the device (its state is the
      persistent device memory torchft keeps, not staging), the new backup
      (device to host) and the merge with a snapshot of the local parameters
      (another S on the device).
    - ``synchronous`` / ``pipelined``: ``pipeoff.ft.DiLoCo(offload_to_cpu=True)``,
      built by its own graph builder (shape only), buckets and outer-step
      chunks of ``bucket_bytes``.

    The inner steps start when the preparing ``step()`` returns: at once (torchft's
    all-reduces run on a side stream; pipeoff's formation runs under the next
    forward, which only reads the parameters, and the next inner step's pre-hook
    waits for it, long done by then). The next forward starts
    when the syncing ``step()`` returns: after every task of torchft's sync; after
    the decision for pipeoff's, each bucket's share of it (its share of the
    parameters) waiting for that bucket's write, as the forward hooks make it
    (``docs/diloco.md``, "After the decision").
    """
    check_int("fragment_sync_delay", fragment_sync_delay, minimum=0)
    delay = fragment_sync_delay if next_forward_flops is not None else 0
    inner = ["inner_steps"] if delay else []
    from pipeoff.ft._diloco_graph import diloco_graph
    from pipeoff.optim._plan import whole_chunks

    numels = shape.local_numels
    if variant == "original":
        g = TaskGraph()
        for name, n in numels:
            nb = n * bytes_per_elem
            pg = g.add_buffer(f"pg:{name}", nb, where="device")
            snap = g.add_buffer(f"snapshot:{name}", nb, where="device")
            g.add_task(f"pseudograd:{name}", TaskKind.H2D, buffers=[pg], nbytes=nb)
            g.add_task(f"allreduce:{name}", TaskKind.ALLREDUCE, deps=[f"pseudograd:{name}"],
                       buffers=[pg], nbytes=nb)
            g.add_task(f"snapshot:{name}", TaskKind.OPTIMIZER_CHUNK, buffers=[snap],
                       deps=[f"allreduce:{name}"], nbytes=nb)
        g.add_task("commit", TaskKind.HOST, deps=[f"snapshot:{n}" for n, _ in numels] + inner)
        for name, n in numels:
            nb = n * bytes_per_elem
            g.add_task(f"restore:{name}", TaskKind.H2D, deps=["commit"], nbytes=nb)
            g.add_task(f"outer:{name}", TaskKind.OPTIMIZER_CHUNK, deps=[f"restore:{name}"],
                       buffers=[f"pg:{name}"], nbytes=3 * nb)
            g.add_task(f"save:{name}", TaskKind.D2H, deps=[f"outer:{name}"], nbytes=nb)
            g.add_task(f"merge:{name}", TaskKind.OPTIMIZER_CHUNK, deps=[f"save:{name}"],
                       buffers=[f"snapshot:{name}"], nbytes=nb)
        if delay:
            g.add_task("inner_steps", TaskKind.HOST, lane=FORWARD_LANE,
                       nbytes=int(3 * delay * next_forward_flops))  # type: ignore[operator]
        if next_forward_flops is not None:
            g.add_task("forward", TaskKind.HOST, lane=FORWARD_LANE,
                       deps=[f"merge:{n}" for n, _ in numels], nbytes=int(next_forward_flops))
        return g
    if variant not in ("synchronous", "pipelined"):
        raise ConfigError(
            f"variant must be 'original', 'synchronous' or 'pipelined', got {variant!r}")
    buckets = local_sgd_buckets(shape, per_parameter=False, bucket_bytes=bucket_bytes,
                                bytes_per_elem=bytes_per_elem)
    chunks = whole_chunks([n * bytes_per_elem for _, n in numels], bucket_bytes)
    # As the real sync chooses: with a delay the formation goes first, and the outer
    # step is taken before the decision (speculatively, native kernels assumed; its
    # spare copies, 16 B more per parameter off the critical path, are not priced).
    form_first = variant == "pipelined" and delay > 0
    g = diloco_graph(buckets, chunks, None, form_first=form_first, decided_after=inner,
                     speculative=form_first)
    if delay:
        g.add_task("inner_steps", TaskKind.HOST, lane=FORWARD_LANE,
                   nbytes=int(3 * delay * next_forward_flops))  # type: ignore[operator]
    if next_forward_flops is not None:
        total = sum(b.numel for b in buckets) or 1
        for k, b in enumerate(buckets):
            g.add_task(f"forward:b{k}", TaskKind.HOST, lane=FORWARD_LANE,
                       deps=["staged", *inner, f"write:b{k}"],
                       nbytes=int(next_forward_flops * b.numel / total))
    return g


def transfer_graph_shape(shape: ModelShape, *, budget_bytes: int, wire: str = "device",
                         target_itemsize: int = 2, rank: int = 0) -> TaskGraph:
    """Rank ``rank``'s part of an RL weight broadcast, built by ``StateTransfer``'s own
    planner and graph builder, shape only: FP32 masters in pinned host memory, sharded
    ``Shard(0)`` over ``shape.fsdp`` ranks, into replicated targets (BF16 by default) on
    the device of every rank, with ``budget_bytes`` of staging on the wire's side."""
    import torch

    from pipeoff.transfer._graph import transfer_graph
    from pipeoff.transfer._plan import ALIGN, Piece, PlanRefusal, plan_transfer

    world = shape.fsdp
    dtype = {2: torch.bfloat16, 4: torch.float32}[target_itemsize]
    sources: list[list[Piece]] = [[] for _ in range(world)]
    for name, gshape in shape.global_shapes:
        rows = math.ceil(gshape[0] / world)
        for r in range(world):
            lo = min(r * rows, gshape[0])
            size = min(rows, gshape[0] - lo)
            sources[r].append(Piece(key=name, global_shape=gshape,
                                    offsets=(lo,) + (0,) * (len(gshape) - 1),
                                    sizes=(size,) + gshape[1:], dtype=torch.float32))
    targets = [[Piece(key=name, global_shape=g, offsets=(0,) * len(g), sizes=g, dtype=dtype)
                for name, g in shape.global_shapes] for _ in range(world)]
    capacity = budget_bytes // 2 if budget_bytes // 2 >= ALIGN else budget_bytes
    try:
        plan = plan_transfer(sources, targets, capacity=[capacity] * world,
                             casts=[[("*", dtype)]] * world,
                             local_capacity=[budget_bytes] * world)
    except PlanRefusal as err:  # the planner's own reason, for the first piece refused
        rank_, key, reason = err.problems[0]
        raise ConfigError(f"budget_bytes={budget_bytes} cannot transfer {shape.name}: "
                          f"rank {rank_}, {key!r}: {reason}") from None
    names = {name: "host" for name, _ in shape.global_shapes}
    return transfer_graph(plan, rank, src_where=names,
                          dst_where=dict.fromkeys(names, "device"), wire=wire, device=None)
