"""Running the real `meshrun` command in a private home, as a user would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def meshrun(home: Path, *args: str, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    """`meshrun ARGS` with HOME and the XDG dirs inside `home` (its own registry and run dirs)."""
    env = dict(os.environ, HOME=str(home), XDG_STATE_HOME=str(home / "state"),
               XDG_CONFIG_HOME=str(home / "config"), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-m", "submit.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)
    if check:
        assert done.returncode == 0, f"meshrun {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def submitted(out: subprocess.CompletedProcess) -> tuple[str, Path]:
    """(job id, run dir) from `meshrun submit` output."""
    lines = out.stdout.splitlines()
    job_id = next(l.split()[2] for l in lines if l.startswith("submitted job "))
    run_dir = Path(next(l.split(": ", 1)[1] for l in lines if l.startswith("run dir: ")))
    return job_id, run_dir


def status(home: Path, job_id: str) -> dict[str, Any]:
    out = meshrun(home, "status", job_id, "--json", check=True)
    (row,) = json.loads(out.stdout)
    return row


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
