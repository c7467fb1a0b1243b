"""One command for a lent GPU: bandwidths, CUDA tests, GPU benchmarks, sim vs measured.

    python benchmarks/gpu_suite.py --out gpu-results [--quick]

Takes about 19 minutes on an H200 in full (more than one 10-minute call of a lent
machine: run ``--quick``, about 5, or the ``gpu_*.py`` scripts one by one) and writes,
under ``--out``:
``bandwidth.md``, ``gpu_checks.md`` (each promise of the simulated device,
checked, and one LocalSGD sync on NCCL), ``cuda_tests.txt`` and
``cuda_tests_sanitizer.txt`` (under ``TORCH_CUDA_SANITIZER=1``), ``optimizer.md`` (from
``gpu_optimizer.py``), ``full_offload.md`` (from ``gpu_full_offload.py``),
``transfer.md`` (from ``gpu_transfer.py``),
``local_sgd_staging.md``, ``sim_vs_measured.md``, the host node's DRAM bandwidth per
rank and DiLoCo's outer step (``host_node.py``, ``bench_outer_step.py``),
``offload_fraction="auto"``'s measured rates and choice against measured steps
(``bench_auto_fraction.py``, OffloadOptimizer's and FullOffloadOptimizer's),
the traces it measured (``traces/*.json``), and ``summary.md`` with all tables.
Without a GPU it says so and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[gpu_suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bandwidth(out: Path, nbytes: int) -> dict[str, float]:
    """Pinned-copy GB/s: H2D alone, D2H alone, and both at once on two streams."""
    dev = torch.device("cuda")
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            # Both streams must have finished before the end event.
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    def h2d() -> None:
        s1.wait_stream(torch.cuda.current_stream())  # hazard: start after the start event
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)  # pinned: truly asynchronous

    def d2h() -> None:
        s2.wait_stream(torch.cuda.current_stream())  # hazard: start after the start event
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)  # pinned: truly asynchronous

    def both() -> None:
        h2d()
        d2h()

    gb = nbytes / 1e9
    t_h2d, t_d2h, t_both = timed(h2d), timed(d2h), timed(both)
    res = {"h2d_gbps": gb / t_h2d, "d2h_gbps": gb / t_d2h, "bidir_total_gbps": 2 * gb / t_both}
    rows = [["H2D alone", f"{res['h2d_gbps']:.1f}"], ["D2H alone", f"{res['d2h_gbps']:.1f}"],
            ["H2D + D2H at once (sum)", f"{res['bidir_total_gbps']:.1f}"]]
    (out / "bandwidth.md").write_text(
        f"Pinned copies of {nbytes / 2**20:.0f} MiB, best of 5 (CUDA events)\n\n"
        + table(["copy", "GB/s"], rows) + "\n")
    return res


def _run(cmd: list[str], log: Path, timeout: int, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str] | str:
    """Run ``cmd``, logging its output; on a timeout, what it printed so far and a note."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=env)
    except subprocess.TimeoutExpired as err:
        # One slow part must not cost the tables of the others (summary.md).
        partial = "".join(x.decode() if isinstance(x, bytes) else (x or "")
                          for x in (err.stdout, err.stderr))
        log.write_text(partial + f"\nTIMED OUT after {timeout}s\n")
        return f"timed out after {timeout}s (partial output in {log.name})"
    log.write_text(res.stdout + res.stderr)
    return res


CUDA_TESTS = ["tests/test_cuda.py", "tests/test_accel.py", "tests/optim/test_optim_cuda.py",
              "tests/ft/test_local_sgd_cuda.py", "tests/ft/test_diloco_cuda.py"]


def run_cuda_tests(out: Path, timeout: int, sanitizer: bool = False) -> str:
    """The CUDA tests on the real device (their ``[cuda]`` cases and ``gpu``-marked
    tests; the ``[simulated]`` ones ran in CI), optionally under torch's CUDA
    sanitizer, which checks every kernel's accesses against stream ordering."""
    import os

    env = dict(os.environ, TORCH_CUDA_SANITIZER="1") if sanitizer else None
    name = "cuda_tests_sanitizer.txt" if sanitizer else "cuda_tests.txt"
    res = _run([sys.executable, "-m", "pytest", "-q", "-k", "not simulated", "-p",
                "no:cacheprovider", *(str(ROOT / t) for t in CUDA_TESTS)],
               out / name, timeout, env=env)
    if isinstance(res, str):
        return res
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "no output"


def run_script(name: str, out: Path, extra: list[str], timeout: int) -> str:
    script = ROOT / "benchmarks" / name
    if not script.exists():
        return f"{name}: not present"
    res = _run([sys.executable, str(script), *extra], out / f"{script.stem}.txt", timeout)
    if isinstance(res, str):
        return f"{name}: {res}"
    return res.stdout if res.returncode == 0 else f"{name} failed:\n{res.stderr[-2000:]}"


def local_sgd_staging(out: Path, numels: list[int], bucket_bytes: int,
                      device: str = "cuda") -> list[list[object]]:
    """Measured (CUDA backend) against predicted (h200_pcie5 and the measured bandwidths).

    One process, world size 1: the all-reduce is a local NCCL/gloo-free no-op
    replaced by an in-place scale, so what is measured is the staging path
    (device copy, D2H into pinned memory, H2D write-back) of LocalSGD.
    """
    import pipeoff
    from pipeoff import Schedule, TaskGraph
    from pipeoff.ft._sync_graph import SyncWork, sync_graph
    from pipeoff.sim import CostModel
    from pipeoff.sim._workloads import ModelShape, local_sgd_buckets, local_sgd_graph

    dev = torch.device(device)
    params = [torch.randn(n, device=dev) for n in numels]
    shape = ModelShape(name="bench", global_shapes=tuple((f"p{i}", (n,))
                                                         for i, n in enumerate(numels)), fsdp=1)

    def real_graph(variant: str) -> TaskGraph:
        """LocalSGD's own graph builder, with an all-reduce that stands in for one
        participant's average (a scale), so what is measured is the staging path."""
        buckets = local_sgd_buckets(shape, per_parameter=variant == "rfc",
                                    bucket_bytes=None if variant == "rfc" else bucket_bytes)

        def allreduce(k, b, dev_buf):  # type: ignore[no-untyped-def]
            def work(ctx):  # type: ignore[no-untyped-def]
                buf = ctx.buffer(dev_buf, torch.float32)
                for pc in b.pieces:
                    buf[pc.offset:pc.offset + pc.numel].copy_(
                        params[pc.param][pc.start:pc.start + pc.numel])
                buf.mul_(0.5)
            return work

        def d2h(k, b, dev_buf, host):  # type: ignore[no-untyped-def]
            return lambda ctx: ctx.buffer(host).copy_(ctx.buffer(dev_buf), non_blocking=True)

        def h2d(k, b, host):  # type: ignore[no-untyped-def]
            def work(ctx):  # type: ignore[no-untyped-def]
                flat = ctx.buffer(host, torch.float32)
                for pc in b.pieces:
                    params[pc.param][pc.start:pc.start + pc.numel].copy_(
                        flat[pc.offset:pc.offset + pc.numel], non_blocking=True)
            return work

        return sync_graph(buckets, dev, SyncWork(allreduce=allreduce, d2h=d2h,
                                                 decide=lambda ctx: True, h2d=h2d))

    schedules = {"rfc": Schedule.synchronous(),
                 "pipelined": Schedule.pipelined(device_budget_bytes=2 * bucket_bytes)}
    rows = []
    h200 = CostModel.h200_pcie5(participants=1)
    for variant, sched in schedules.items():
        g = real_graph(variant)
        pipeoff.execute(g, sched).wait()  # warm the pools
        ex = pipeoff.execute(g, sched)
        ex.wait()
        trace = ex.trace
        trace.save(out / "traces" / f"local_sgd_{variant}.json")
        measured = trace.makespan_ns() / 1e6
        sym = local_sgd_graph(shape, variant=variant, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]
        pred = pipeoff.execute(sym, sched, backend="sim", cost_model=h200).trace.makespan_ns() / 1e6
        rows.append([variant, f"{measured:.2f}", f"{pred:.2f}",
                     f"{100 * (pred - measured) / measured:+.0f}%",
                     trace.summary().peak_device_staging_bytes])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-results", help="output folder (%(default)s)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, about 3 minutes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    sections = [f"# pipeoff GPU suite on {torch.cuda.get_device_name()}\n",
                f"torch {torch.__version__}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"]

    log("1/7 pinned-copy bandwidth")
    bw = bandwidth(out, (256 if args.quick else 1024) << 20)
    sections.append("## Pinned-copy bandwidth\n\n" + (out / "bandwidth.md").read_text())

    log("2/7 the simulated device's promises, and NCCL LocalSGD (gpu_checks.py)")
    checks = run_script("gpu_checks.py", out, ["--out", str(out)], timeout=90)
    sections.append("## Promises of the simulated device, checked\n\n" + (
        (out / "gpu_checks.md").read_text() if (out / "gpu_checks.md").exists() else checks))

    log("3/7 CUDA tests")
    sections.append("## CUDA tests\n\n" + run_cuda_tests(out, timeout=120) + "\n")

    log("4/7 CUDA tests under TORCH_CUDA_SANITIZER=1")
    sections.append("## CUDA tests under the CUDA sanitizer\n\n"
                    + run_cuda_tests(out, timeout=140, sanitizer=True) + "\n")

    log("5/7 GPU optimizer benchmark")
    sections.append("## Optimizer\n\n" + run_script(
        "gpu_optimizer.py", out, ["--quick"] if args.quick else [], timeout=180))

    log("5b/7 GPU full-offload benchmark")
    sections.append("## Full offload\n\n" + run_script(
        "gpu_full_offload.py", out, ["--quick"] if args.quick else ["--micro", "1", "4", "8"],
        timeout=330))

    log("5c/7 GPU state-transfer benchmark")
    sections.append("## State transfer\n\n" + run_script(
        "gpu_transfer.py", out, ["--quick"] if args.quick else [], timeout=300))

    log("5d/7 GPU DiLoCo sync: torchft's against pipeoff's offloaded ones")
    sections.append("## DiLoCo sync\n\n" + run_script(
        "gpu_diloco.py", out, ["--quick"] if args.quick else [], timeout=240))

    log("5e/7 the host node: DRAM bandwidth per rank and DiLoCo's outer step on the host")
    sections.append("## The host node (for the simulator's host-node model)\n\n" + run_script(
        "host_node.py", out, ["--mib", "512" if args.quick else "2048", "--ranks", "1", "2",
                              "8", "--rounds", "3" if args.quick else "5"], timeout=120)
        + "\n" + run_script(
        "bench_outer_step.py", out, ["--numel", str(32 << 20), "--params", "2", "--rounds",
                                     "3" if args.quick else "7", "--threads", "1", "2",
                                     str(len(os.sched_getaffinity(0)))], timeout=120))

    log("5f/7 offload_fraction='auto': its measured rates and choice against measured steps")
    sections.append("## offload_fraction='auto'\n\n" + "\n".join(run_script(
        "bench_auto_fraction.py", out, [
            # (full: one model and optimizer per fraction, masters in pinned host memory)
            "--layers", "8" if args.quick or optimizer == "full" else "24", "--width", "8192",
            "--rounds", "3" if args.quick else "5", "--optimizer", optimizer], timeout=150)
        for optimizer in ("offload", "full")))

    log("6/7 LocalSGD staging, measured against predicted")
    numels = [1 << 22] * (16 if args.quick else 64)  # 16 MiB parameters
    rows = local_sgd_staging(out, numels, bucket_bytes=64 << 20)
    sections.append(
        "## LocalSGD staging path: measured vs h200_pcie5 prediction\n\n"
        + table(["schedule", "measured ms", "predicted ms", "error", "peak device staging B"],
                rows) + "\n")

    log("7/7 summary")
    sections.append(f"\nMeasured link: H2D {bw['h2d_gbps']:.1f} GB/s, D2H {bw['d2h_gbps']:.1f} "
                    f"GB/s, both at once {bw['bidir_total_gbps']:.1f} GB/s in total "
                    f"(h200_pcie5 assumes 55 / 55 / 87.2).\n")
    sections.append(f"\nTotal time {time.time() - t0:.0f} s\n")
    text = "\n".join(sections)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
