"""The ``pipeoff`` command: ``pipeoff demo`` and ``pipeoff trace summary``."""

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


def _cmd_trace_summary(args: argparse.Namespace) -> int:
    from pipeoff.trace import Trace

    summary = Trace.load(args.file).summary()
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(summary.format())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pipeoff._demo import run_demo

    return run_demo(out=Path(args.out), quick=args.quick)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeoff", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the CPU demo, write a trace and print its summary")
    demo.add_argument("--out", default="pipeoff-demo", help="output folder (default: %(default)s)")
    demo.add_argument("--quick", action="store_true", help="a shorter run (used by the tests)")
    demo.set_defaults(fn=_cmd_demo)

    trace = sub.add_parser("trace", help="inspect traces")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    summ = tsub.add_parser("summary", help="makespan, critical path, lane busy, staging peaks")
    summ.add_argument("file", help="a trace JSON written by pipeoff")
    summ.add_argument("--json", action="store_true", help="print JSON instead of a table")
    summ.set_defaults(fn=_cmd_trace_summary)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeoff`` console script. Bad input exits with code 2."""
    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (PipeoffError, FileNotFoundError, _UsageError) as err:
        print(f"pipeoff: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
