"""On a real GPU: check each promise the simulated CUDA device makes, and more.

    python benchmarks/gpu_checks.py [--out DIR]

The simulated device (``pipeoff/testing/_simcuda.py``) is what CI proves the
CUDA backend against. Its rules are only as good as their match with CUDA, so
this script checks each one on the real device, and the CUDA-only choices
pipeoff makes (its own streams, page-locked state). It also runs one LocalSGD
sync on a real NCCL process group under a real torchft Manager (one replica).

Prints one line per check (``PASS`` / ``FAIL`` / ``INFO``) and writes them to
``DIR/gpu_checks.md``; exits 1 if any check failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS: list[tuple[str, str, str]] = []
SLEEP_S = 0.05


def check(name: str) -> Callable[[Callable[[], str | None]], Callable[[], None]]:
    def wrap(fn: Callable[[], str | None]) -> Callable[[], None]:
        def run() -> None:
            try:
                note = fn() or ""
                RESULTS.append(("PASS", name, note))
            except AssertionError as err:
                RESULTS.append(("FAIL", name, str(err)))
            except Exception:  # noqa: BLE001 - reported, and the next check runs
                RESULTS.append(("FAIL", name, traceback.format_exc(limit=3).replace("\n", " | ")))
            print(f"{RESULTS[-1][0]:4} {name}: {RESULTS[-1][2]}", flush=True)

        run.__name__ = fn.__name__
        CHECKS.append(run)
        return run

    return wrap


CHECKS: list[Callable[[], None]] = []


def _sleep(stream: torch.cuda.Stream, seconds: float = SLEEP_S) -> None:
    from pipeoff import _accel

    _accel.current().sleep(stream, seconds)


@check("enqueuing stream work returns before it runs (sim: streams are asynchronous FIFOs)")
def streams_are_asynchronous() -> str:
    s = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        _sleep(s)
        x.add_(1)
    issued = time.perf_counter() - t0
    done_at_issue = s.query()
    s.synchronize()
    assert issued < SLEEP_S / 2 and not done_at_issue, (issued, done_at_issue)
    assert x[0].item() == 1.0
    return f"issued in {issued * 1e3:.2f} ms against a {SLEEP_S * 1e3:.0f} ms sleep"


@check("torch.cuda._sleep calibration (pipeoff.testing delays)")
def sleep_calibration() -> str:
    s = torch.cuda.Stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(s)
    _sleep(s, 0.02)
    b.record(s)
    b.synchronize()
    ms = a.elapsed_time(b)
    assert 5 < ms < 80, f"a 20 ms sleep took {ms:.1f} ms: fix _SLEEP_CYCLES_PER_S"
    return f"20 ms asked, {ms:.1f} ms slept"


@check("a non_blocking copy from pinned memory is stream work (host does not wait)")
def pinned_copy_is_async() -> str:
    s = torch.cuda.Stream()
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        _sleep(s)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        issued = time.perf_counter() - t0
    s.synchronize()
    assert issued < SLEEP_S / 2, issued
    return f"issued in {issued * 1e3:.2f} ms"


@check("a copy to pageable memory synchronizes the host with the stream")
def pageable_copy_blocks() -> str:
    s = torch.cuda.Stream()
    dev = torch.ones(1 << 20, device="cuda")
    host = torch.empty(1 << 20)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        _sleep(s)
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        waited = time.perf_counter() - t0
    assert waited > SLEEP_S / 2, waited
    assert host[0].item() == 1.0
    return f"host waited {waited * 1e3:.1f} ms"


@check("waiting on an event never recorded is a no-op (sim: the same)")
def unrecorded_event_wait() -> None:
    ev = torch.cuda.Event()
    torch.cuda.current_stream().wait_event(ev)
    torch.cuda.synchronize()


@check("an event's wait orders a stream after the recorded work only")
def event_ordering() -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        _sleep(s1)
        x.fill_(3.0)
    ev = torch.cuda.Event()
    ev.record(s1)
    s2.wait_event(ev)
    with torch.cuda.stream(s2):
        y = x.sum()
    s2.synchronize()
    assert y.item() == 3.0 * (1 << 20)


@check("the caching allocator reuses a block freed on a stream at once on that stream")
def allocator_reuse() -> str:
    torch.cuda.synchronize()
    a = torch.empty(1 << 20, device="cuda")
    ptr = a.data_ptr()
    del a
    b = torch.empty(1 << 20, device="cuda")
    assert b.data_ptr() == ptr, "no stream-ordered reuse: the sim's free check is stricter"
    return "same block handed out again"


@check("autograd version counters move at issue, not when the kernel runs")
def versions_at_issue() -> str:
    s = torch.cuda.Stream()
    p = torch.zeros(1 << 10, device="cuda")
    v0 = p._version
    with torch.cuda.stream(s):
        _sleep(s)
        p.add_(1)
    bumped = p._version - v0
    s.synchronize()
    assert bumped == 1, bumped
    return "the sim drains the host's stream on wait_event to match this"


@check("AdamW's step counter is a CPU tensor (the sim keeps it in device memory)")
def adamw_step_on_cpu() -> str:
    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    dev = opt.state[p]["step"].device
    return f"step on {dev}"


@check("pipeoff's lane streams are its own, non-blocking, and high priority for copies")
def dedicated_streams() -> str:
    from pipeoff import _accel

    accel = _accel.Cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    pooled |= {torch.cuda.Stream(priority=-1).cuda_stream for _ in range(64)}
    ours = [accel.new_stream(dev, priority=-1), accel.new_stream(dev, priority=0)]
    assert all(s.cuda_stream not in pooled for s in ours), "a lane shares a pooled stream"
    assert len({s.cuda_stream for s in ours}) == 2
    # Non-blocking: work on the legacy default stream does not order it.
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    null = torch.cuda.default_stream()
    with torch.cuda.stream(null):
        _sleep(null)
    with torch.cuda.stream(ours[0]):
        x.add_(1)
    t0 = time.perf_counter()
    ours[0].synchronize()
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert waited < SLEEP_S / 2, f"the lane waited {waited * 1e3:.1f} ms for stream 0"
    return f"priorities {[s.priority for s in ours]}"


@check("large pinned state is page-locked at its exact size and copies asynchronously")
def registered_host_memory() -> str:
    from pipeoff import _accel

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) \
        if hasattr(torch.cuda, "host_memory_stats") else None
    n = (_accel.REGISTER_MIN_BYTES + 12345) // 4
    t = _accel.Cuda().host_empty((n,), torch.float32, pinned=True)
    assert t.is_pinned(), "not page-locked"
    t.copy_(torch.arange(n, dtype=torch.float32))
    s = torch.cuda.Stream()
    dev = torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        _sleep(s)
        t0 = time.perf_counter()
        dev.copy_(t, non_blocking=True)
        issued = time.perf_counter() - t0
    s.synchronize()
    assert issued < SLEEP_S / 2, issued
    assert torch.equal(dev.cpu(), torch.arange(n, dtype=torch.float32))
    after = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) \
        if before is not None else None
    del t
    grew = None if before is None or after is None else after - before
    return f"{n * 4} bytes; the caching host allocator grew by {grew} bytes"


@check("Event(blocking=True).synchronize() does not spin a core")
def blocking_events_sleep() -> str:
    s = torch.cuda.Stream()
    ev = torch.cuda.Event(blocking=True)
    with torch.cuda.stream(s):
        _sleep(s, 0.2)
    ev.record(s)
    c0, t0 = time.process_time(), time.perf_counter()
    ev.synchronize()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    assert cpu < wall / 2, f"{cpu:.3f} s of CPU in {wall:.3f} s"
    return f"{cpu * 1e3:.0f} ms CPU over {wall * 1e3:.0f} ms"


@check("LocalSGD: one sync on a real NCCL process group under a torchft Manager")
def local_sgd_nccl() -> str:
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.coordination import LighthouseServer
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupNCCL

    import pipeoff.ft

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = Manager(pg=ProcessGroupNCCL(timeout=timedelta(seconds=30)), min_replica_size=1,
                      load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()},
                      replica_id="gpu_check", store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
                      timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=30))
    before: list[torch.Tensor] = []
    # Registered before LocalSGD's hook, so it runs first: what the sync starts from.
    opt.register_step_post_hook(lambda *_: before.__setitem__(
        slice(None), [p.detach().clone() for p in model.parameters()]))
    try:
        with pipeoff.ft.LocalSGD(manager, model, opt, 2, offload_to_cpu=True,
                                 bucket_bytes=1 << 18) as local_sgd:
            for _ in range(4):
                opt.zero_grad()
                model(torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
                opt.step()
            trace = local_sgd.last_trace
        after = list(model.parameters())
        # One replica: the average is the replica's own parameters, bitwise.
        assert before and all(torch.equal(a, b) for a, b in zip(before, after))
        assert trace is not None and trace.metadata.get("backend") == "cuda", trace
        return (f"makespan {trace.makespan_ns() / 1e6:.2f} ms, peak device staging "
                f"{trace.summary().peak_device_staging_bytes} B")
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-results", help="output folder (%(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device here", file=sys.stderr)
        return 2
    for run in CHECKS:
        run()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"- **{status}** {name}: {note}" for status, name, note in RESULTS]
    (out / "gpu_checks.md").write_text("\n".join(lines) + "\n")
    return 1 if any(r[0] == "FAIL" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
