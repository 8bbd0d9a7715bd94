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
            "meshrun --help": [sys.executable, "-m", "submit.cli.main", "--help"],
            # A Slurm profile without `ssh:`: render then touches no network (over SSH it asks for ~).
            "meshrun render": [
                sys.executable,
                "-m",
                "submit.cli.main",
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
        for name, argv in cases.items():
            ms = base if name == "python -c pass" else median_ms(argv, args.runs, env)
            torch = "-" if name == "python -c pass" else ("YES" if imports_torch(argv, env) else "no")
            print(f"{name:<18} {ms:>10.1f} {ms / base:>9.2f}  {torch}")


if __name__ == "__main__":
    main()
