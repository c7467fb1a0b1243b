"""The ``pipeoff`` command: run the demo, simulate schedules at scale, inspect traces."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeoff._errors import PipeoffError

__all__ = ["main"]


class _UsageError(Exception):
    pass


_PLOT_SUFFIXES = (".png", ".svg", ".pdf")


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
    from pipeoff.trace import Trace
    from pipeoff.trace._trace import fmt_bytes

    a = Trace.load(args.a).summary()
    b = Trace.load(args.b).summary()
    rows = [
        ("makespan ms", a.makespan_us / 1e3, b.makespan_us / 1e3, "time"),
        ("critical path ms", a.critical_path_us / 1e3, b.critical_path_us / 1e3, "time"),
        ("efficiency", a.efficiency, b.efficiency, "num"),
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

    print(f"{'metric':<22} {'A':>14} {'B':>14} {'B/A':>8}")
    print(f"{'':<22} {Path(args.a).name[:14]:>14} {Path(args.b).name[:14]:>14}")
    for name, va, vb, kind in rows:
        ratio = f"{vb / va:.2f}x" if va and vb is not None and va is not None else "n/a"
        print(f"{name:<22} {show(va, kind):>14} {show(vb, kind):>14} {ratio:>8}")
    return 0


def _cmd_trace_plot(args: argparse.Namespace) -> int:
    from pipeoff.trace import Trace
    from pipeoff.trace._plot import plot

    out = Path(args.output)
    if not out.suffix:
        out = out.with_suffix(".png")
    if out.suffix.lower() not in _PLOT_SUFFIXES:
        raise _UsageError(f"--output must end in {', '.join(_PLOT_SUFFIXES)}; got {str(out)!r}")
    out = plot(Trace.load(args.file), out, arrows=args.arrows, width=args.width)
    print(f"wrote {out}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pipeoff.sim import CostModel
    from pipeoff.sim._compare import FEATURE_SCHEDULES, compare, parse_bytes
    from pipeoff.sim._workloads import model_shape
    from pipeoff.trace._trace import fmt_bytes

    shape = model_shape(args.model, fsdp=args.fsdp)
    schedules = tuple(s.strip() for s in (args.schedules or ",".join(
        FEATURE_SCHEDULES.get(args.feature, ()))).split(",") if s.strip())
    if args.replicas is not None and args.preset == "cpu_here":
        raise _UsageError("--replicas applies to modelled presets; cpu_here is measured on "
                          "this machine, with one participant")
    if args.replicas is not None and args.replicas < 1:
        raise _UsageError(f"--replicas must be at least 1, got {args.replicas}")
    replicas = 2 if args.replicas is None else args.replicas
    cost = CostModel.preset(args.preset, participants=replicas)
    preds = compare(
        shape, args.feature, schedules, cost,
        chunk_bytes=parse_bytes(args.chunk_bytes), prefetch=args.prefetch,
        bucket_bytes=parse_bytes(args.bucket_bytes),
        device_budget_bytes=parse_bytes(args.device_budget) if args.device_budget else None,
    )
    if args.trace_dir:
        for p in preds:
            p.trace.save(Path(args.trace_dir) / f"{args.feature}-{p.schedule}.json")
    if args.json:
        print(json.dumps([{
            "schedule": p.schedule, "time_ms": p.time_ms, "peak_device_bytes": p.peak_device_bytes,
            "peak_host_bytes": p.peak_host_bytes, "efficiency": p.efficiency, "bound": p.bound,
        } for p in preds], indent=2))
        return 0
    print(f"PREDICTED by the {cost.name} cost model (not measured): {args.feature}, "
          f"{shape.name} ({shape.params / 1e9:.2f}B params) sharded over {shape.fsdp} ranks")
    base = preds[0].time_ms
    print(f"{'schedule':<13} {'time ms':>10} {'vs first':>9} {'peak device':>12} "
          f"{'peak host':>11} {'efficiency':>10}  bound")
    for p in preds:
        print(f"{p.schedule:<13} {p.time_ms:>10.2f} {p.time_ms / base:>8.2f}x "
              f"{fmt_bytes(p.peak_device_bytes):>12} {fmt_bytes(p.peak_host_bytes):>11} "
              f"{p.efficiency:>10.2f}  {p.bound}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pipeoff._demo import run_demo

    return run_demo(out=Path(args.out), quick=args.quick)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeoff",
        description="pipeoff: pipelined CPU offload for PyTorch training. "
                    "Run the demo, simulate schedules at scale, inspect traces.")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the CPU demo, write a trace and print its summary")
    demo.add_argument("--out", default="pipeoff-demo", help="output folder (default: %(default)s)")
    demo.add_argument("--quick", action="store_true", help="a shorter run (used by the tests)")
    demo.set_defaults(fn=_cmd_demo)

    sim = sub.add_parser("simulate", help="predict schedules at model scale with a cost model")
    sim.add_argument("--model", default="8b",
                     help="0.6b, 8b, 70b, or a .json of {name: shape} (default: %(default)s)")
    sim.add_argument("--fsdp", type=int, default=8, help="FSDP ranks (default: %(default)s)")
    sim.add_argument("--feature", choices=["optimizer", "local-sgd", "full-offload", "transfer",
                                              "diloco"],
                     default="optimizer")
    sim.add_argument("--schedules", help="comma-separated; default: all for the feature")
    sim.add_argument("--preset", default="h200_pcie5", help="h200_pcie5 or cpu_here")
    sim.add_argument("--replicas", type=int,
                     help="all-reduce participants (default: 2; not with cpu_here)")
    sim.add_argument("--chunk-bytes", default="1GiB", help="optimizer chunk (%(default)s)")
    sim.add_argument("--prefetch", "--lookahead", dest="prefetch", type=int, default=2,
                     help="optimizer chunks staged ahead (--lookahead: its old name)")
    sim.add_argument("--bucket-bytes", default="256MiB",
                     help="LocalSGD/DiLoCo bucket (%(default)s)")
    sim.add_argument("--device-budget", help="device staging budget (default: from the above; "
                     "for transfer, the bucket size)")
    sim.add_argument("--trace-dir", help="also save each predicted trace here")
    sim.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sim.set_defaults(fn=_cmd_simulate)

    trace = sub.add_parser("trace", help="inspect traces")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
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
    plot.add_argument("-o", "--output", default="trace.png",
                      help="image path: .png, .svg or .pdf (%(default)s)")
    plot.add_argument("--arrows", action="store_true", help="draw cross-lane dependencies")
    plot.add_argument("--width", type=_width, default=12.0, help="inches (%(default)s)")
    plot.set_defaults(fn=_cmd_trace_plot)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeoff`` console script. Bad input exits with code 2."""
    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (PipeoffError, OSError, _UsageError) as err:  # OSError: a path that is not usable
        print(f"pipeoff: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
