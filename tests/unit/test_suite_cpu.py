"""scripts/suite_cpu.py: each test is charged with the CPU of the processes it started, forked ranks included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def suite_cpu() -> ModuleType:
    return load_script("scripts/suite_cpu.py")


def process(pid: int, ppid: int, cpu: float, children: float, test: str | None, argv0: str = "x") -> dict:
    return {
        "kind": "process",
        "argv": [argv0],
        "pid": pid,
        "ppid": ppid,
        "cpu": cpu,
        "children": children,
        "test": test,
    }


def test_a_controller_is_charged_with_its_forked_ranks_but_not_twice_with_a_rank_that_logged_itself() -> None:
    records = [
        {"kind": "worker", "test": "tests/a.py::test_one", "cpu": 0.5},
        process(10, 1, 0.2, 0.0, "tests/a.py::test_one (call)"),  # a meshrun call
        # the controller forked 2 ranks (5 s between them); one ran atexit hooks and logged its own 2 s
        process(20, 1, 3.0, 5.0, "tests/a.py::test_one (call)", "/repo/launcher/local/controller.py"),
        process(21, 20, 2.0, 0.0, "tests/a.py::test_one (call)"),
        process(30, 1, 1.0, 9.0, "tests/b.py::test_two (setup)"),  # children that are not forks are not added
        process(40, 1, 4.0, 0.0, None),  # the workers' own start-up
    ]
    per_test, unattributed = suite_cpu().attribute(records)
    assert per_test["tests/a.py::test_one"] == 0.5 + 0.2 + (3.0 + 5.0 - 2.0) + 2.0
    assert per_test["tests/b.py::test_two"] == 1.0
    assert unattributed == 4.0


def test_the_report_lists_the_costliest_files_and_tests_first() -> None:
    module = suite_cpu()
    per_test, unattributed = module.attribute(
        [
            {"kind": "worker", "test": "tests/a.py::test_cheap", "cpu": 1.0},
            {"kind": "worker", "test": "tests/b.py::test_dear", "cpu": 7.0},
            {"kind": "worker", "test": "tests/a.py::test_mid", "cpu": 2.0},
        ]
    )
    lines = module.report(per_test, unattributed, top=2).splitlines()
    assert lines[0].startswith("CPU started by tests: 10 s over 3 tests")
    assert lines[3:5] == ["     7.0  tests/b.py", "     3.0  tests/a.py"]
    assert lines[7:] == ["     7.0  tests/b.py::test_dear", "     2.0  tests/a.py::test_mid"]


def test_a_run_charges_the_meshrun_calls_a_test_makes_to_that_test(tmp_path: Path) -> None:
    test_file = tmp_path / "test_calls.py"
    test_file.write_text(
        "import subprocess, sys\n\n"
        "def test_calls_python():\n"
        "    burn = 'import time\\nwhile time.process_time() < 0.3: pass'\n"
        "    subprocess.run([sys.executable, '-c', burn], check=True)\n"
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "suite_cpu.py"), "-q", "-p", "no:cacheprovider", str(test_file)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.endswith("test_calls.py::test_calls_python")]
    assert float(line.split()[0]) >= 0.3  # the child's own CPU (it spins until 0.3 s), charged to the test
