"""`meshrun status JOB` and `meshrun logs JOB --diagnosis` show what the sidecars found, on the real local
cluster and on the real Slurm testbed reached only over the real sshd.

A tiny command job runs for real; its hang diagnosis, straggler report and a second node's environment
record are then written into its run dir as the sidecars would (the watchdog is tested on its own),
and the real `meshrun` reads them back as a user would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.helpers import cli, sshbed

PARAGRAPH = (
    "Hang at step 7 (phase step), found by n1 after 95 s without progress (timeout 60 s). Rank 1 on n2 "
    "stalled in all_reduce (called from train.py:88); rank 0 on n1 waits in barrier."
)


def _write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _sidecar_findings(run_dir: Path) -> None:
    """What the watchdog, the straggler report and two nodes' env records leave in a run dir."""
    now = time.time()
    beats = {"0": {"step": 7, "phase": "step", "pid": 11, "time": now}, "1": {"step": 6, "phase": "step", "pid": 12}}
    verdict = {"attempt": "x.0", "time": now, "step": 7, "phase": "step", "found_by": "n1", "silent_s": 95.0}
    _write(run_dir / "diagnosis" / "verdict.json", {**verdict, "timeout_s": 60.0, "verdict": PARAGRAPH, "ranks": []})
    _write(run_dir / "diagnosis" / "verdict.txt", PARAGRAPH + "\n")
    for node, rank in (("n1", 0), ("n2", 1)):
        folder = run_dir / "diagnosis" / node
        _write(
            folder / f"rank-{rank}.stack.txt",
            f'Thread 0x7f (most recent call first):\n  File "train.py", line {87 + rank}\n',
        )
        _write(folder / "heartbeats.json", {"node": node, "time": now, "beats": {str(rank): beats[str(rank)]}})
        _write(folder / "gpus.json", {"gpus": []})
    _write(
        run_dir / "stragglers.json",
        {"time": now, "factor": 1.5, "stragglers": [{"rank": 1, "node": "n2", "ratio": 1.8}]},
    )
    for node, driver in (("n1", "550.54"), ("n2", "535.104")):
        _write(run_dir / "env" / f"{node}.json", {"node": node, "run": "x.0", "time": now, "driver": driver})


def _check(home: Path, job_id: str, laptop: bool) -> None:
    run = sshbed.meshrun if laptop else cli.meshrun
    shown = run(home, "status", job_id, check=True).stdout
    assert "hang: " in shown and "  Hang at step 7 (phase step)" in shown, shown
    assert f"the diagnosis: meshrun logs {job_id} --diagnosis" in shown
    assert "stragglers: rank 1 (n2) 1.8x the median busy time" in shown
    assert "environment: driver differs between nodes: 535.104 on n2; 550.54 on n1" in shown
    (row,) = json.loads(run(home, "status", job_id, "--json", check=True).stdout)
    assert row["verdict"]["step"] == 7 and row["stragglers"][0]["rank"] == 1 and len(row["env_mismatches"]) == 1
    listed = run(home, "status", check=True).stdout  # the list view: a short note, no paragraph
    assert "hang at step 7, 1 straggler" in listed and "Hang at step 7" not in listed
    out = run(home, "logs", job_id, "--diagnosis", check=True).stdout
    lines = out.splitlines()
    assert lines[:2] == ["== verdict", PARAGRAPH], out
    assert "-- rank 1 stack (rank-1.stack.txt)" in lines and '  File "train.py", line 88' in lines
    assert "rank 1: step 6, phase step, pid 12" in lines and "-- also here: gpus.json (12 bytes)" in lines


def _no_diagnosis(home: Path, job_id: str, laptop: bool) -> None:
    run = sshbed.meshrun if laptop else cli.meshrun
    done = run(home, "logs", job_id, "--diagnosis", check=True)
    assert done.stdout == "" and f"no hang was diagnosed for {job_id}" in done.stderr
    assert "hang" not in run(home, "status", job_id, check=True).stdout


def test_local_status_and_logs_show_the_diagnosis(tmp_path: Path) -> None:
    root = sshbed.project(tmp_path, {"quick.yaml": sshbed.command_spec("quick", ["python", "-c", "pass"])})
    out = cli.meshrun(tmp_path, "submit", str(root / "quick.yaml"), "-c", "local", "--wait", check=True, timeout=120)
    job_id, run_dir = cli.submitted(out)
    _no_diagnosis(tmp_path, job_id, laptop=False)
    _sidecar_findings(run_dir)
    _check(tmp_path, job_id, laptop=False)


def test_slurm_status_and_logs_show_the_diagnosis_over_ssh(testbed: dict, tmp_path: Path) -> None:
    profile = sshbed.profile(tmp_path)
    root = sshbed.project(tmp_path, {"quick.yaml": sshbed.command_spec("quick", ["python", "-c", "pass"])})
    job_id, run_dir = cli.submitted(
        sshbed.meshrun(tmp_path, "submit", str(root / "quick.yaml"), "-c", str(profile), check=True)
    )
    sshbed.watch_until_done(tmp_path, job_id, timeout=180)
    _no_diagnosis(tmp_path, job_id, laptop=True)
    _sidecar_findings(run_dir)
    before = sshbed.logins()
    _check(tmp_path, job_id, laptop=True)
    assert sshbed.logins() - before == 4  # one connection per command (3 status, 1 logs), whatever it reads
