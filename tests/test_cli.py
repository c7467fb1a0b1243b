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


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    res = run("demo", "--quick", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "makespan" in res.stdout and "efficiency" in res.stdout
    return out / "trace.json"


def test_trace_summary(demo_trace: Path) -> None:
    res = run("trace", "summary", str(demo_trace))
    assert res.returncode == 0, res.stderr
    assert "critical path" in res.stdout and "lane busy" in res.stdout
    res = run("trace", "summary", str(demo_trace), "--json")
    data = json.loads(res.stdout)
    assert data["tasks"] > 0 and 0 < data["efficiency"] <= 1.0


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


def test_module_entry_point() -> None:
    res = subprocess.run([sys.executable, "-m", "pipeoff.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "demo" in res.stdout


def test_trace_diff(demo_trace: Path) -> None:
    res = run("trace", "diff", str(demo_trace), str(demo_trace))
    assert res.returncode == 0, res.stderr
    assert "makespan ms" in res.stdout and "1.00x" in res.stdout
    data = json.loads(run("trace", "diff", str(demo_trace), str(demo_trace), "--json").stdout)
    assert data["ratio_b_over_a"]["makespan ms"] == 1.0


def test_trace_plot(demo_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "gantt.png"
    res = run("trace", "plot", str(demo_trace), "-o", str(out), "--arrows", "--width", "10")
    assert res.returncode == 0, res.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width == 1000 and 200 < height < 1000  # 10 inches at 100 dpi


def test_trace_plot_bad_input(tmp_path: Path) -> None:
    res = run("trace", "plot", str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


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
