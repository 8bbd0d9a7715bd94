"""Where the test suite's CPU goes, test by test: `pytest --durations` says where the wall clock went, but on
CI's 2 cores the suite is CPU-bound (measured 2026-12-04: the cores ~93% busy for the whole run, ~95% of it
in Python processes), so what a test costs every other test is its CPU, most of it in processes it starts.

    .venv/bin/python scripts/suite_cpu.py [--top N] [--log FILE] [PYTEST ARGS...]    # e.g. -n 3 tests/integration

Runs pytest with PYTEST ARGS and two hooks on PYTHONPATH: a sitecustomize that makes every Python process
(the `meshrun` calls, supervisors, ranks, sidecars, probes, on local and on the Slurm testbed alike) append its
CPU and the test that started it (PYTEST_CURRENT_TEST, inherited) to a log as it exits, and a plugin that
measures each test's CPU inside its pytest worker. A process that forks its ranks without exec (the local
controller, tests/helpers/zygote.py) is charged with its children's CPU too, less those that logged their own.
A process ended by a signal it does not handle (a kill -9, a cancel's TERM) runs no exit hook and logs nothing:
the table is a lower bound (the full suite on 2026-12-04: 966 s charged to tests, 70 s to none). Nor does it see
processes started with a PYTHONPATH of their own: the benches' quick runs (tests/integration/test_bench_quick.py,
~110 s of the machine's CPU by /proc/stat on 2026-12-05) are mostly missing from it.
Prints the costliest tests and files, and the share of the run's CPU that no test started (the workers'
collection, the testbeds' daemons are not Python and are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

REPO = Path(__file__).resolve().parents[1]
LOG_ENV = "MESHRUN_SUITE_CPU_LOG"

SITECUSTOMIZE = f'''
import atexit, os, sys


def _record():
    try:
        import json, resource
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        line = json.dumps({{
            "kind": "process", "argv": sys.argv[:4], "pid": os.getpid(), "ppid": os.getppid(),
            "cpu": me.ru_utime + me.ru_stime, "children": kids.ru_utime + kids.ru_stime,
            "test": os.environ.get("PYTEST_CURRENT_TEST"),
        }})
        fd = os.open(os.environ["{LOG_ENV}"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.write(fd, (line + "\\n").encode())  # one write: lines of processes ending together do not interleave
        os.close(fd)
    except Exception:
        pass


if os.environ.get("{LOG_ENV}"):
    atexit.register(_record)
'''

PLUGIN = f'''
import json, os, resource

import pytest


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    begin = _cpu()
    yield
    line = json.dumps({{"kind": "worker", "test": item.nodeid, "cpu": _cpu() - begin}})
    fd = os.open(os.environ["{LOG_ENV}"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)
'''

FORKS_RANKS = ("launcher/local/controller.py", "tests/helpers/zygote.py")
"""Processes whose ranks are forks that end without running atexit hooks in their own name."""


def test_of(current: str) -> str:
    """PYTEST_CURRENT_TEST ("tests/x.py::test_y (call)") as the test's node id."""
    return re.sub(r" \((setup|call|teardown)\)$", "", current)


def attribute(records: Iterable[Mapping[str, Any]]) -> tuple[Counter[str], float]:
    """(CPU seconds per test id, CPU of the processes no test started) from the log's records."""
    records = list(records)
    logged_children: defaultdict[int, float] = defaultdict(float)
    for record in records:
        if record["kind"] == "process":
            logged_children[record["ppid"]] += record["cpu"] + record["children"]
    per_test: Counter[str] = Counter()
    unattributed = 0.0
    for record in records:
        cpu = float(record["cpu"])
        if record["kind"] == "process" and any(str(record["argv"][0]).endswith(name) for name in FORKS_RANKS):
            cpu += max(0.0, record["children"] - logged_children[record["pid"]])
        if record.get("test"):
            per_test[test_of(record["test"])] += cpu
        else:
            unattributed += cpu
    return per_test, unattributed


def report(per_test: Counter[str], unattributed: float, top: int) -> str:
    attributed = sum(per_test.values())
    files: Counter[str] = Counter()
    for test, cpu in per_test.items():
        files[test.split("::")[0]] += cpu
    lines = [
        f"CPU started by tests: {attributed:,.0f} s over {len(per_test)} tests; "
        f"by no test (workers' start-up and collection, the hooks' own parent): {unattributed:,.0f} s",
        "",
        f"{'CPU s':>8}  file",
        *(f"{cpu:8.1f}  {name}" for name, cpu in files.most_common(top)),
        "",
        f"{'CPU s':>8}  test",
        *(f"{cpu:8.1f}  {name}" for name, cpu in per_test.most_common(top)),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="how many tests and files to list (30)")
    parser.add_argument("--log", type=Path, help="keep the processes' records (JSON lines) in this file")
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        hooks = Path(tmp)
        (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (hooks / "suite_cpu_plugin.py").write_text(PLUGIN)
        log = args.log.resolve() if args.log else hooks / "cpu.jsonl"
        log.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])))
        env[LOG_ENV] = str(log)
        command = [str(REPO / ".venv" / "bin" / "python"), "-m", "pytest", "-p", "suite_cpu_plugin", *pytest_args]
        code = subprocess.call(command, cwd=REPO, env=env)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    per_test, unattributed = attribute(records)
    print(report(per_test, unattributed, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
