"""The ``pipeoff`` console script, run as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def pipeoff_cmd() -> list[str]:
    exe = shutil.which("pipeoff", path=str(Path(sys.executable).parent))
    assert exe, "the pipeoff console script is not installed in this environment"
    return [exe]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*pipeoff_cmd(), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


# About 10 s (it runs `pipeoff demo`): every test that uses it is marked slow.
@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    res = run("demo", "--quick", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "makespan" in res.stdout and "efficiency" in res.stdout
    return out / "trace.json"


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_summary(demo_trace: Path) -> None:
    res = run("trace", "summary", str(demo_trace))
    assert res.returncode == 0, res.stderr
    assert "critical path" in res.stdout and "lane busy" in res.stdout
    res = run("trace", "summary", str(demo_trace), "--json")
    data = json.loads(res.stdout)
    assert data["tasks"] > 0 and 0 < data["efficiency"] <= 1.0


@pytest.mark.slow  # runs a Python interpreter (subprocess)
@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), ("{oops", "not valid JSON"),
     ('{"traceEvents": []}', "not one pipeoff wrote")],
)
def test_bad_trace_files_exit_2_without_traceback(tmp_path: Path, content: str | None,
                                                  message: str) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    res = run("trace", "summary", str(path))
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_module_entry_point() -> None:
    res = subprocess.run([sys.executable, "-m", "pipeoff.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "demo" in res.stdout


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_diff(demo_trace: Path) -> None:
    res = run("trace", "diff", str(demo_trace), str(demo_trace))
    assert res.returncode == 0, res.stderr
    assert "makespan ms" in res.stdout and "1.00x" in res.stdout
    data = json.loads(run("trace", "diff", str(demo_trace), str(demo_trace), "--json").stdout)
    assert data["ratio_b_over_a"]["makespan ms"] == 1.0


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_plot(demo_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "gantt.png"
    res = run("trace", "plot", str(demo_trace), "-o", str(out), "--arrows", "--width", "10")
    assert res.returncode == 0, res.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width == 1000 and 200 < height < 1000  # 10 inches at 100 dpi


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_trace_plot_bad_input(tmp_path: Path) -> None:
    res = run("trace", "plot", str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # runs a Python interpreter (subprocess)
def test_demo_without_torchft_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torchft'] = None\n"  # makes `import torchft` fail
        "from pipeoff.cli import main\n"
        f"sys.exit(main(['demo', '--quick', '--out', {str(tmp_path)!r}]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert "pip install 'pipeoff[ft]'" in res.stderr
    assert "Traceback" not in res.stderr


_TASK = {"ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0, "name": "t",
         "args": {"pipeoff.task": "t", "kind": "h2d", "lane": "h2d", "t_ns": [0, 0, 1000],
                  "bytes": 8, "deps": [], "buffers": [], "status": "ok"}}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"traceEvents": [1], "pipeoff": {}}, "not a well-formed pipeoff trace"),
        ({"traceEvents": [_TASK], "pipeoff": {"metadata": [1, 2]}}, "not a well-formed"),
        ({"traceEvents": [_TASK], "pipeoff": {"buffers": [
            {"name": "b", "nbytes": 8, "where": "moon"}]}}, "expected 'device' or 'host'"),
        ({"traceEvents": [_TASK], "pipeoff": {"device_budget_bytes": "lots"}},
         "device_budget_bytes must be a byte count"),
        ({"traceEvents": [{"ph": "X", "name": "pipeoff::h2d", "ts": 1, "dur": 1}]},
         "not a well-formed"),
        ({"traceEvents": [{"ph": "X", "name": "pipeoff::h2d::x", "ts": "abc", "dur": 1}]},
         "not a well-formed"),
    ],
    ids=["event_not_object", "metadata_list", "buffer_where", "budget_text",
         "profiler_name", "profiler_ts"],
)
def test_malformed_traces_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: object, message: str
) -> None:
    from pipeoff.cli import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    for cmd in (["trace", "summary", str(path)], ["trace", "diff", str(path), str(path)],
                ["trace", "plot", str(path), "-o", str(tmp_path / "p.png")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert message in err and "t.json" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "summary", "."], "is a directory"),
        (["simulate", "--schedules", ","], "no schedule given"),
        (["simulate", "--chunk-bytes", "1e400"], "byte size too large"),
        (["simulate", "--lookahead", "0"], "prefetch must be an int >= 1"),
        (["simulate", "--prefetch", "0"], "prefetch must be an int >= 1"),
        (["simulate", "--feature", "local-sgd", "--bucket-bytes", "1"],
         "bucket_bytes=1 cuts 8b into"),
        (["simulate", "--preset", "cpu_here", "--replicas", "8"], "--replicas applies"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from pipeoff.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # reads demo_trace, made by running `pipeoff demo` (subprocess)
def test_plot_output_path(tmp_path: Path, demo_trace: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoff.cli import main

    assert main(["trace", "plot", str(demo_trace), "-o", str(tmp_path / "gantt")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'gantt.png'}"
    assert (tmp_path / "gantt.png").stat().st_size > 0
    assert main(["trace", "plot", str(demo_trace), "-o", str(tmp_path / "g.txt")]) == 2
    assert "--output must end in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["trace", "plot", str(demo_trace), "--width", "nan"])
    assert info.value.code == 2
