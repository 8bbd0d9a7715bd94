"""What the benches that drive meshrun's CLI share: a HOME of their own, and `meshrun ARGS` from this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def isolated_env(home: Path) -> dict[str, str]:
    """This environment with HOME and the XDG folders in `home`: the bench's calibration, registry and runs
    stay out of the user's."""
    return dict(
        os.environ,
        HOME=str(home),
        XDG_STATE_HOME=str(home / "state"),
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_CACHE_HOME=str(home / "cache"),
    )


def meshrun(env: dict[str, str], *args: str, timeout: float = 900, echo: bool = False) -> str:
    """meshrun ARGS from this checkout (its stdout); `echo` prints each command and its output. A failure prints
    the output and ends the bench with its last line (bench/gpu.sh shows that line in its FAILED row)."""
    done = subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if echo or done.returncode != 0:
        print(f"$ meshrun {' '.join(args)}  (exit {done.returncode})\n{done.stdout}{done.stderr}", flush=True)
    if done.returncode != 0:
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"meshrun {args[0]} failed (exit {done.returncode}): {last[0]}")
    return done.stdout
