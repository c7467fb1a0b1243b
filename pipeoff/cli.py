"""The ``pipeoff`` command: run the demo, simulate schedules at scale, inspect traces."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeoff._errors import PipeoffError

__all__ = ["main"]


class _UsageError(Exception):
    pass


_PLOT_SUFFIXES = (".png", ".svg", ".pdf")
_SIZE_OPTIONS = {"chunk_bytes": "--chunk-bytes", "bucket_bytes": "--bucket-bytes",
                 "device_budget_bytes": "--device-budget"}
"""How errors about sizes name them: by the option a user typed."""
_FEATURE_DEFAULTS = {"chunk_bytes": "1GiB", "prefetch": 2, "bucket_bytes": "256MiB",
                     "fragment_sync_delay": 0, "seq_len": 8192, "micro_batch": 1}
"""The defaults of ``simulate``'s options that only some features read."""
_FEATURE_READS = {
    "optimizer": {"chunk_bytes", "prefetch"},
    "local-sgd": {"bucket_bytes"},
    "diloco": {"bucket_bytes", "fragment_sync_delay", "seq_len", "micro_batch"},
    "transfer": {"bucket_bytes"},
    "full-offload": set(),
    "train-step": {"seq_len", "micro_batch", "fragment_sync_delay"},
}
"""Which of them each feature reads (``train-step`` refuses ``--fragment-sync-delay``
itself, with its own message)."""
_COMPUTE = ("seq_len", "micro_batch")
"""The options of the training compute around a DiLoCo sync (modelled presets only)."""


def _check_feature_options(args: argparse.Namespace) -> None:
    """Refuse an option given a value the feature never reads: silently ignored, it
    would print figures for another configuration than the one asked for."""
    from pipeoff._errors import ConfigError
    from pipeoff._validate import parse_bytes

    def same(dest: str, value: Any, default: Any) -> bool:
        if dest not in _SIZE_OPTIONS:
            return bool(value == default)
        try:  # (a size by its bytes: 1024MiB is 1GiB)
            return parse_bytes(value) == parse_bytes(default)
        except ConfigError:
            return False

    reads = _FEATURE_READS[args.feature]
    for dest, default in _FEATURE_DEFAULTS.items():
        if dest not in reads and not same(dest, getattr(args, dest), default):
            option = "--" + dest.replace("_", "-")
            users = sorted(f for f, r in _FEATURE_READS.items() if dest in r
                           and not (f == "train-step" and dest == "fragment_sync_delay"))
            raise _UsageError(f"{option} does not apply to --feature {args.feature} (it is "
                              f"read by: {', '.join(users)}); leave it out")
        if (args.preset == "cpu_here" and args.feature == "diloco" and dest in _COMPUTE
                and not same(dest, getattr(args, dest), default)):
            # (cpu_here models no training compute: the tokens around a sync go unread)
            raise _UsageError(f"--{dest.replace('_', '-')} does not apply to --preset "
                              "cpu_here, which models no training compute; leave it out")


def _version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version("pipeoff")
    except metadata.PackageNotFoundError:
        import pipeoff

        return str(getattr(pipeoff, "__version__", "unknown"))


def _group_help(parser: argparse.ArgumentParser, hint: str) -> int:
    """A command group run without a command: its commands' help, and what to run."""
    parser.print_help()
    sys.stdout.flush()  # (the help first, then the line saying what to run)
    print(f"\n{parser.prog}: choose a command; {hint}", file=sys.stderr)
    return 2


def _width(text: str) -> float:
    """argparse type of ``--width``: inches, a finite number in [1, 200]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= v <= 200:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be between 1 and 200 inches, got {text!r}")
    return v


def _cmd_trace_summary(args: argparse.Namespace) -> int:
    from pipeoff.trace import Trace

    summary = Trace.load(args.file).summary()
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(summary.format())
    return 0


def _cmd_trace_diff(args: argparse.Namespace) -> int:
    from pipeoff.trace import Trace, TraceSummary
    from pipeoff.trace._format import fmt_bytes, predicted_line

    a = Trace.load(args.a).summary()
    b = Trace.load(args.b).summary()
    rows = [
        ("makespan ms", a.makespan_us / 1e3, b.makespan_us / 1e3, "time"),
        ("critical path ms", a.critical_path_us / 1e3, b.critical_path_us / 1e3, "time"),
        ("efficiency", a.efficiency, b.efficiency, "num"),
        ("lanes busy %", a.busy_pct, b.busy_pct, "num"),
        ("comm overlap %", a.comm_overlap_pct, b.comm_overlap_pct, "num"),
        ("comm hidden %", a.comm_hidden_pct, b.comm_hidden_pct, "num"),
        ("copy overlap %", a.copy_overlap_pct, b.copy_overlap_pct, "num"),
        ("peak device staging", a.peak_device_staging_bytes, b.peak_device_staging_bytes, "bytes"),
        ("peak host staging", a.peak_host_staging_bytes, b.peak_host_staging_bytes, "bytes"),
        ("hook wait total ms", a.hook_wait_total_us / 1e3, b.hook_wait_total_us / 1e3, "time"),
        ("tasks", a.tasks, b.tasks, "num"),
    ]
    if args.json:
        print(json.dumps({"a": a.to_dict(), "b": b.to_dict(), "ratio_b_over_a": {
            name: (vb / va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va
                   else None) for name, va, vb, _ in rows}}, indent=2))
        return 0

    def show(v: float | int | None, kind: str) -> str:
        if v is None:
            return "n/a"
        if kind == "bytes":
            return fmt_bytes(int(v))
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    def head(path: str, summary: TraceSummary) -> str:
        return Path(path).name + (" (predicted)" if summary.predicted_by is not None else "")

    shown_as = {"efficiency": "efficiency (path/makespan)"}  # (JSON keeps the short names)
    table = [(shown_as.get(name, name), show(va, kind), show(vb, kind),
              f"{vb / va:.2f}x" if va and vb is not None and va is not None else "n/a")
             for name, va, vb, kind in rows]
    heads = ("A: " + head(args.a, a), "B: " + head(args.b, b))
    # Columns as wide as their content: file names are never cut.
    w0 = max(len("metric"), *(len(r[0]) for r in table))
    w1 = max(len(heads[0]), *(len(r[1]) for r in table))
    w2 = max(len(heads[1]), *(len(r[2]) for r in table))
    for summary in (a, b):
        if summary.predicted_by is not None:
            print(f"{'A' if summary is a else 'B'}: {predicted_line(summary.predicted_by)}")
    print(f"{'metric':<{w0}} {heads[0]:>{w1}} {heads[1]:>{w2}} {'B/A':>8}")
    for name, sa, sb, ratio in table:
        print(f"{name:<{w0}} {sa:>{w1}} {sb:>{w2}} {ratio:>8}")
    return 0


def _cmd_trace_plot(args: argparse.Namespace) -> int:
    from pipeoff.trace import Trace
    from pipeoff.trace._plot import plot

    out = Path(args.output) if args.output is not None else Path(Path(args.file).stem + ".png")
    if not out.suffix:
        out = out.with_suffix(".png")
    if out.suffix.lower() not in _PLOT_SUFFIXES:
        raise _UsageError(f"--output must end in {', '.join(_PLOT_SUFFIXES)}; got {str(out)!r}")
    trace = Trace.load(args.file)
    if args.output is None:
        # Nothing lands in the current folder unless asked: a fresh temporary folder.
        out = Path(tempfile.mkdtemp(prefix="pipeoff-plot-")) / out.name
    out = plot(trace, out, arrows=args.arrows, width=args.width)
    print(f"wrote {out}" + (" (no -o given: a temporary folder)" if args.output is None
                            else ""))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pipeoff._validate import parse_bytes
    from pipeoff.sim import model_shape
    from pipeoff.sim._compare import FEATURE_SCHEDULES, SCHEDULE_NOTES, compare
    from pipeoff.trace._format import fmt_bytes

    _check_feature_options(args)
    if args.feature == "train-step":
        return _cmd_train_step(args)
    if args.offload_fraction is not None or args.mfu is not None:
        given = "--offload-fraction" if args.offload_fraction is not None else "--mfu"
        raise _UsageError(f"{given} applies only with --feature train-step")
    shape = model_shape(args.model, fsdp=args.fsdp)
    schedules = tuple(s.strip() for s in (",".join(FEATURE_SCHEDULES.get(args.feature, ()))
                                          if args.schedules is None else args.schedules
                                          ).split(",") if s.strip())
    if not schedules:
        raise _UsageError(f"no schedule given in --schedules ({args.schedules!r}); leave it "
                          "out for all of the feature's")
    cost, host = _simulate_cost(args)
    preds = compare(
        shape, args.feature, schedules, cost,
        chunk_bytes=parse_bytes(args.chunk_bytes, name="--chunk-bytes"),
        prefetch=args.prefetch,
        bucket_bytes=parse_bytes(args.bucket_bytes, name="--bucket-bytes"),
        device_budget_bytes=(parse_bytes(args.device_budget, name="--device-budget")
                             if args.device_budget else None),
        names=_SIZE_OPTIONS,
        tokens=args.seq_len * args.micro_batch if args.feature == "diloco" else None,
        seq_len=args.seq_len,
        fragment_sync_delay=args.fragment_sync_delay,
    )
    if args.trace_dir:
        for p in preds:
            path = Path(args.trace_dir) / f"{args.feature}-{p.schedule}.json"
            try:
                p.trace.save(path)
            except OSError as err:
                raise _UsageError(f"--trace-dir: cannot write {path} "
                                  f"({err.strerror or err})") from err
    if args.json:
        print(json.dumps([{
            "schedule": p.schedule, "time_ms": p.time_ms, "peak_device_bytes": p.peak_device_bytes,
            "peak_host_bytes": p.peak_host_bytes, "host_state_bytes": p.host_state_bytes,
            "host_state": p.host_state, "peak_host_staging_bytes": p.peak_host_staging_bytes,
            "efficiency": p.efficiency, "bound": p.bound, "predicted": True,
            "cost_model": cost.name, "exposed_ms": p.exposed_ms,
        } for p in preds], indent=2))
        return 0
    print(f"PREDICTED by the {cost.name} cost model (not measured): {args.feature}, "
          f"{shape.name} ({shape.params / 1e9:.2f}B params) sharded over {shape.fsdp} ranks")
    if cost.host is not None:
        n = cost.host.node
        per = ", ".join(f"{lane} {b:g} B" for lane, b in cost.host.bytes_per_elem.items())
        print(f"  host: {n.ranks} ranks sharing {n.dram_gbps:.1f} GB/s of DRAM and {n.cores} "
              f"cores ({'NUMA-bound' if n.numa_bound else 'no NUMA binding'}): "
              f"{n.rank_gbps:.1f} GB/s and {n.threads_per_rank} threads per rank; bytes per "
              f"element: {per} (--host flat: the old flat rate)")
    base = preds[0].time_ms
    exposed = any(p.exposed_ms is not None for p in preds)
    ebase = preds[0].exposed_ms or 1.0
    print(f"{'schedule':<13} {'time ms':>10} {'vs first':>9} "
          + (f"{'exposed ms':>11} {'vs first':>9} " if exposed else "")
          + f"{'peak device':>12} {'peak host*':>11} {'efficiency':>10}  bound")
    for p in preds:
        e = (f"{p.exposed_ms:>11.2f} {p.exposed_ms / ebase:>8.2f}x "
             if exposed and p.exposed_ms is not None else (" " * 22 if exposed else ""))
        print(f"{p.schedule:<13} {p.time_ms:>10.2f} {p.time_ms / base:>8.2f}x {e}"
              f"{fmt_bytes(p.peak_device_bytes):>12} {fmt_bytes(p.peak_host_bytes):>11} "
              f"{p.efficiency:>10.2f}  {p.bound}")
    # What the memory columns count, per schedule where it differs.
    states: dict[tuple[int, str], list[str]] = {}
    for p in preds:
        states.setdefault((p.host_state_bytes, p.host_state), []).append(p.schedule)
    for (nbytes, what), names in states.items():
        who = f" ({', '.join(names)})" if len(states) > 1 else ""
        print(f"* peak host{who}: " + (f"{what}, {fmt_bytes(nbytes)} per rank, + peak host "
                                       "staging" if nbytes else
                                       f"peak host staging only ({what})"))
    print("  peak device: device staging only (not the weights, gradients or activations "
          "training holds anyway)")
    if exposed:
        c = cost.compute
        print(f"  exposed: how much later the training loop's compute ends with the sync "
              f"than without it ({args.micro_batch} x {args.seq_len} tokens per rank per "
              f"step, fragment_sync_delay {args.fragment_sync_delay}, compute at "
              f"{c.name if c is not None else 'n/a'}); vs first: over the first row's "
              "exposed time" + ("; time ms: from the sync's preparation to its last "
                                "write" if args.fragment_sync_delay else ""))
    note = SCHEDULE_NOTES.get(args.feature)
    if note:
        print(f"  schedules: {note}; vs first: time over the first row's")
    return 0


def _simulate_cost(args: argparse.Namespace) -> tuple[Any, str]:
    """The cost model ``pipeoff simulate`` prices with, and the host design's name."""
    from pipeoff.sim import CostModel, HostCosts, HostNode

    if args.replicas is not None and args.preset == "cpu_here":
        raise _UsageError("--replicas applies to modelled presets; cpu_here is measured on "
                          "this machine, with one participant")
    if args.replicas is not None and args.replicas < 1:
        raise _UsageError(f"--replicas must be at least 1, got {args.replicas}")
    replicas = 2 if args.replicas is None else args.replicas
    cost = CostModel.preset(args.preset, participants=replicas)
    host = args.host or ("flat" if args.preset == "cpu_here" else "native")
    if host != "flat" and args.preset == "cpu_here":
        raise _UsageError(f"--host {host} models an H200 node's host; cpu_here measures this "
                          "machine's host rate (flat): leave --host out, or use --preset "
                          "h200_pcie5")
    if args.no_numa_binding and host == "flat":
        raise _UsageError("--no-numa-binding applies to the host-node model (--host native, "
                          "native-fold or torch), not to --host flat")
    if host != "flat":
        node = HostNode.h200_node(numa_bound=not args.no_numa_binding)
        cost = dataclasses.replace(cost, name=f"{cost.name} + {node.name} ({host} host kernels)",
                                   host=HostCosts(node=node, design=host))
    return cost, host


def _offload_fraction(text: str | None) -> tuple[float | None, bool]:
    """``--offload-fraction``: a number in [0, 1], or ``auto``."""
    if text is None:
        return None, False
    if text.strip().lower() == "auto":
        return None, True
    try:
        f = float(text)
    except ValueError:
        f = float("nan")
    if not 0 <= f <= 1:
        raise _UsageError(f"--offload-fraction must be a number in [0, 1] (the share of the "
                          f"optimizer state kept on the host) or auto, got {text!r}")
    return f, False


def _cmd_train_step(args: argparse.Namespace) -> int:
    from pipeoff._validate import parse_bytes
    from pipeoff.sim import DeviceCompute, model_shape
    from pipeoff.sim._compute import MFU_DENSE, MFU_MOE
    from pipeoff.sim._train_step import TrainStep, train_step
    from pipeoff.trace._format import fmt_bytes

    for given, option in ((args.schedules, "--schedules"),
                          (args.fragment_sync_delay, "--fragment-sync-delay")):
        if given:
            raise _UsageError(f"{option} does not apply to --feature train-step (its rows: "
                              "no-offload, the full-offload designs, --offload-fraction's)")
    fraction, auto = _offload_fraction(args.offload_fraction)
    budget = (parse_bytes(args.device_budget, name="--device-budget")
              if args.device_budget else None)
    if budget is not None and not auto:
        raise _UsageError("--device-budget applies to train-step with --offload-fraction auto "
                          "(the budget the chosen fraction must fit)")
    if args.preset == "cpu_here":
        raise _UsageError("--feature train-step models a device's compute: use --preset "
                          "h200_pcie5")
    shape = model_shape(args.model, fsdp=args.fsdp)
    moe = shape.active is not None
    mfu = args.mfu if args.mfu is not None else (MFU_MOE if moe else MFU_DENSE)
    if not 1e-3 <= mfu <= 1:  # (below, step times overflow the trace's ns: a tester's find)
        raise _UsageError(f"--mfu must be in [0.001, 1], got {mfu}")
    cost, host = _simulate_cost(args)
    cost = dataclasses.replace(cost, compute=DeviceCompute.h200(mfu=mfu))
    step = TrainStep(seq_len=args.seq_len, micro_batch=args.micro_batch,
                     offload_fraction=fraction, auto=auto, device_budget_bytes=budget)
    rows = train_step(shape, step, cost, names=_SIZE_OPTIONS)
    if args.trace_dir:
        for r in rows:
            if r.trace is not None:
                r.trace.save(Path(args.trace_dir) / f"train-step-{r.schedule}.json")
    if args.json:
        print(json.dumps({
            "feature": "train-step", "model": shape.name, "fsdp": shape.fsdp,
            "params": shape.params, "active_params": shape.active_params,
            "local_params": shape.local_params, "seq_len": step.seq_len,
            "micro_batch": step.micro_batch, "mfu": mfu, "host": host,
            "cost_model": cost.name, "predicted": True,
            "device_budget_bytes": budget if budget is not None else (
                cost.compute.memory_bytes if auto else None),
            "schedule": [{
                "schedule": r.schedule, "time_ms": r.time_ms, "compute_ms": r.compute_ms,
                "exposed_ms": r.exposed_ms, "vs_no_offload": r.vs_no_offload,
                "peak_device_bytes": r.peak_device_bytes,
                "offload_fraction": r.offload_fraction,
                "host_bytes_per_param": (None if r.host_bytes_per_param != r.host_bytes_per_param
                                         else r.host_bytes_per_param),
                "note": r.note,
            } for r in rows]}, indent=2))
        return 0
    print(f"PREDICTED by the {cost.name} cost model (not measured): one training step, "
          f"{shape.name} ({shape.params / 1e9:.2f}B params"
          + (f", {shape.active_params / 1e9:.2f}B active" if moe else "")
          + f") sharded over {shape.fsdp} ranks, {step.micro_batch} x {step.seq_len} tokens "
          f"per rank, compute at {cost.compute.name}{' (a MoE preset)' if moe else ''}")
    w = max(len(r.schedule) for r in rows)
    print(f"{'schedule':<{w}} {'time ms':>10} {'vs no-off':>9} {'exposed ms':>11} "
          f"{'peak device':>12} {'offloaded':>9} {'host B/p':>8}")
    for r in rows:
        hb = "-" if r.host_bytes_per_param != r.host_bytes_per_param else \
            f"{r.host_bytes_per_param:g}"
        print(f"{r.schedule:<{w}} {r.time_ms:>10.1f} {r.vs_no_offload:>8.3f}x "
              f"{r.exposed_ms:>11.1f} {fmt_bytes(r.peak_device_bytes):>12} "
              f"{r.offload_fraction:>9.0%} {hb:>8}")
    print(f"  compute (forward + backward alone): {rows[0].compute_ms:.1f} ms; exposed: what "
          "the optimizer adds to it")
    print("  peak device: weights, gradients and optimizer state (16 B per local parameter "
          "kept, 4 offloaded) + device staging; activations not counted")
    for r in rows:
        print(f"  {r.schedule}: {r.note}")
    by = {r.schedule: r for r in rows}
    fwd, bwd = by.get("full-offload-forward"), by.get("full-offload-backward-attach")
    if fwd is not None and bwd is not None and bwd.time_ms < fwd.time_ms:
        print("  (FullOffloadOptimizer's default is overlap='forward': it allows clipping, "
              "max_norm= or the loop's clip_grad_norm_. Without clipping, overlap='backward' "
              "with attach() hides more of the host step here, under the backward.)")
    return 0


def _int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {v}")
        return v

    return parse


def _cmd_demo(args: argparse.Namespace) -> int:
    from pipeoff._demo import run_demo

    return run_demo(out=Path(args.out), quick=args.quick)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeoff",
        description="pipeoff: pipelined CPU offload for PyTorch training. "
                    "Run the demo, simulate schedules at scale, inspect traces.")
    p.add_argument("--version", action="version", version=f"pipeoff {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    p.set_defaults(group=(p, "e.g. `pipeoff demo`; `pipeoff COMMAND --help` for its options"))

    demo = sub.add_parser("demo", help="run the CPU demo, write a trace and print its summary")
    demo.add_argument("--out", default="pipeoff-demo", help="output folder (default: %(default)s)")
    demo.add_argument("--quick", action="store_true", help="a shorter run (used by the tests)")
    demo.set_defaults(fn=_cmd_demo)

    sim = sub.add_parser("simulate", help="predict schedules at model scale with a cost model",
                         epilog="Sizes: bytes (4096, 2e9) or with a unit; KB, MB, GB are "
                                "powers of 10 (1GB = 10^9 bytes), KiB, MiB, GiB powers of 2 "
                                "(1GiB = 2^30 bytes).")
    sim.add_argument("--model", default="8b",
                     help="0.6b, 8b, 70b, qwen3-30b-a3b (a mixture of experts), or a .json "
                          "of {name: shape} (default: %(default)s)")
    sim.add_argument("--fsdp", type=_int_at_least(1), default=8,
                     help="FSDP ranks (default: %(default)s)")
    sim.add_argument("--feature", choices=["optimizer", "local-sgd", "full-offload", "transfer",
                                              "diloco", "train-step"],
                     default="optimizer",
                     help="the pipeoff feature whose schedules to predict (default: "
                          "%(default)s)")
    sim.add_argument("--schedules", help="comma-separated; default: all for the feature")
    sim.add_argument("--preset", default="h200_pcie5", help="h200_pcie5 or cpu_here")
    sim.add_argument("--replicas", type=int,
                     help="all-reduce participants (default: 2; not with cpu_here)")
    sim.add_argument("--chunk-bytes", default=_FEATURE_DEFAULTS["chunk_bytes"],
                     help="optimizer chunk (%(default)s)")
    sim.add_argument("--prefetch", "--lookahead", dest="prefetch", type=int,
                     default=_FEATURE_DEFAULTS["prefetch"],
                     help="optimizer chunks staged ahead (--lookahead: its old name)")
    sim.add_argument("--bucket-bytes", default=_FEATURE_DEFAULTS["bucket_bytes"],
                     help="LocalSGD/DiLoCo bucket (%(default)s)")
    sim.add_argument("--device-budget", help="device staging budget (default: from the above; "
                     "for transfer, the bucket size)")
    sim.add_argument("--host", choices=["native", "native-fold", "torch", "flat"],
                     help="how host work is costed: native (default with h200_pcie5): an H200 "
                          "node's DRAM shared by its 8 ranks, at the bytes pipeoff's native "
                          "kernels move, the final micro-step in one pass (32 B); native-fold: "
                          "the same kernels, the final fold apart (10 + 30 B: clipping); "
                          "torch: the same node at torch's kernels' bytes; "
                          "flat: one host rate per rank, nothing shared (the old model; the "
                          "default with cpu_here)")
    sim.add_argument("--no-numa-binding", action="store_true",
                     help="with the host-node model: ranks not bound to a socket")
    sim.add_argument("--seq-len", type=_int_at_least(1),
                     default=_FEATURE_DEFAULTS["seq_len"],
                     help="tokens per sequence: the training compute of train-step and around "
                          "a DiLoCo sync (default: %(default)s)")
    sim.add_argument("--micro-batch", type=_int_at_least(1),
                     default=_FEATURE_DEFAULTS["micro_batch"],
                     help="sequences per rank per step (default: %(default)s)")
    sim.add_argument("--fragment-sync-delay", type=_int_at_least(0),
                     default=_FEATURE_DEFAULTS["fragment_sync_delay"],
                     help="DiLoCo: inner steps between a sync's preparation and its "
                          "decision (default: %(default)s)")
    sim.add_argument("--offload-fraction",
                     help="train-step: also predict this share (0 to 1) of the optimizer state "
                          "on the host, the rest stepped on the device; auto: the fastest "
                          "fraction whose device bytes fit --device-budget (default: the "
                          "device's memory)")
    sim.add_argument("--mfu", type=float,
                     help="train-step: model FLOPs utilization of the compute (default: 0.166 "
                          "for a mixture of experts, prime-rl's Qwen3-30B-A3B on 8xH200; 0.40 "
                          "for a dense model, Llama 3's)")
    sim.add_argument("--trace-dir", help="also save each predicted trace here")
    sim.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sim.set_defaults(fn=_cmd_simulate)

    trace = sub.add_parser("trace", help="inspect traces")
    tsub = trace.add_subparsers(dest="trace_command", metavar="COMMAND", title="commands")
    trace.set_defaults(group=(trace, "e.g. `pipeoff trace summary FILE`; "
                                     "`pipeoff trace COMMAND --help` for its options"))
    summ = tsub.add_parser("summary", help="makespan, critical path, lane busy, staging peaks")
    summ.add_argument("file", help="a trace JSON written by pipeoff")
    summ.add_argument("--json", action="store_true", help="print JSON instead of a table")
    summ.set_defaults(fn=_cmd_trace_summary)
    diff = tsub.add_parser("diff", help="two traces side by side, with the ratio per metric")
    diff.add_argument("a", help="the baseline trace")
    diff.add_argument("b", help="the trace to compare")
    diff.add_argument("--json", action="store_true", help="print JSON instead of a table")
    diff.set_defaults(fn=_cmd_trace_diff)
    plot = tsub.add_parser("plot", help="a Gantt chart PNG: one row per lane, staging below")
    plot.add_argument("file", help="a trace JSON written by pipeoff")
    plot.add_argument("-o", "--output",
                      help="image path: .png, .svg or .pdf (default: a new temporary folder, "
                           "whose path is printed)")
    plot.add_argument("--arrows", action="store_true", help="draw cross-lane dependencies")
    plot.add_argument("--width", type=_width, default=12.0, help="inches (%(default)s)")
    plot.set_defaults(fn=_cmd_trace_plot)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeoff`` console script. Bad input exits with code 2."""
    args = _parser().parse_args(argv)
    if getattr(args, "fn", None) is None:  # a command group without its command
        parser, hint = args.group
        return _group_help(parser, hint)
    try:
        return int(args.fn(args))
    except BrokenPipeError:
        # The reader went away (`... | head`): as a Unix tool, stop quietly. Python's
        # recipe: point stdout at devnull, so the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (PipeoffError, OSError, _UsageError) as err:  # OSError: a path that is not usable
        print(f"pipeoff: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
