"""CLI start-up against `python -c pass`, measured in the same run.

    .venv/bin/python bench/cli_startup.py [--runs N] [--quick]

Prints milliseconds (median of N) and the ratio to the bare interpreter, and
checks that neither verb imported torch. --quick runs each case twice (CI's check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def median_ms(argv: list[str], runs: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def imports_torch(argv: list[str], env: dict[str, str]) -> bool:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *argv[1:]], capture_output=True, text=True, env=env, cwd=REPO
    )
    return any(line.rstrip().endswith(("| torch", "| numpy")) for line in out.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="2 runs per case (CI's check that the bench runs)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 2
    with tempfile.TemporaryDirectory() as state:
        # As an installed meshrun starts: from compiled bytecode (pip compiles at install). Where the environment
        # sets PYTHONDONTWRITEBYTECODE (CI's does), every call would compile meshrun's modules from source again
        # (~60 ms of render's time here); the first, untimed call of each case writes the bytecode.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["XDG_STATE_HOME"] = state
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "meshrun --help": [sys.executable, "-m", "meshrun.submit.cli.main", "--help"],
            # A Slurm profile without `ssh:`: render then touches no network (over SSH it asks for ~).
            "meshrun render": [
                sys.executable,
                "-m",
                "meshrun.submit.cli.main",
                "render",
                "examples/two-node.yaml",
                "-c",
                "testbed",
            ],
        }
        for argv in cases.values():
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
        base = median_ms(cases["python -c pass"], args.runs, env)
        print(f"{'case':<18} {'median ms':>10} {'x python':>9}  torch imported")
        timed = {}
        for name, argv in cases.items():
            ms = timed[name] = base if name == "python -c pass" else median_ms(argv, args.runs, env)
            torch = "-" if name == "python -c pass" else ("YES" if imports_torch(argv, env) else "no")
            print(f"{name:<18} {ms:>10.1f} {ms / base:>9.2f}  {torch}")
        print_floor(cases["meshrun render"], base, timed["meshrun render"], args.runs, env)


DATACLASS_CLOCK = """
import dataclasses, runpy, sys, time
made, spent, process = [0], [0.0], dataclasses._process_class
def timed(*args, **kwargs):
    start = time.perf_counter()
    try:
        return process(*args, **kwargs)
    finally:
        made[0] += 1
        spent[0] += time.perf_counter() - start
dataclasses._process_class = timed
sys.argv = ["meshrun", *sys.argv[1:]]
try:
    runpy.run_module("meshrun.submit.cli.main", run_name="__main__")
except SystemExit:
    pass
print(f"{made[0]} {spent[0] * 1000:.2f}", file=sys.stderr)
"""
"""Render with every dataclass's creation timed (stdlib's _process_class wrapped: a bench's probe, not product code)."""


RENDER_BUT_JINJA = "import meshrun.submit.cli.main, meshrun.submit.api, meshrun.submit.planning.plan, meshrun.submit.transport.snapshot, yaml"
"""What render imports, less the renderer: Jinja2's own share is what importing it adds to these."""


def print_floor(render: list[str], base: float, render_ms: float, runs: int, env: dict[str, str]) -> None:
    """What render pays before any of meshrun's own logic: the interpreter, PyYAML (specs and job.yaml are YAML)
    and creating the frozen dataclasses DESIGN.md's conventions ask for (Python 3.11 compiles each generated
    method on its own); then what Jinja2 (templates/) adds, and the rest."""
    yaml_ms = median_ms([sys.executable, "-c", "import yaml"], runs, env) - base
    without = median_ms([sys.executable, "-c", RENDER_BUT_JINJA], runs, env)
    jinja_ms = median_ms([sys.executable, "-c", RENDER_BUT_JINJA + ", jinja2"], runs, env) - without
    clocked, count = [], "?"
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", DATACLASS_CLOCK, *render[3:]], capture_output=True, text=True, env=env, cwd=REPO
        )
        count, ms = done.stderr.split()[-2:]
        clocked.append(float(ms))
    dataclass_ms = statistics.median(clocked)
    floor = base + yaml_ms + dataclass_ms
    print(
        f"render's floor: python {base:.1f} ms + PyYAML {yaml_ms:.1f} + creating {count} dataclasses "
        f"{dataclass_ms:.1f} = {floor:.1f} ms ({floor / base:.2f}x python); Jinja2 adds {jinja_ms:.1f}; "
        f"the rest of render {render_ms - floor - jinja_ms:.1f} ms"
    )


if __name__ == "__main__":
    main()
