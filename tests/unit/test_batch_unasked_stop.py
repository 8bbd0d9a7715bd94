"""A start immune to a stop meant for an earlier one (issue 44): after a requeue, slurmd logged `STEP 700010.2 ON
n1 CANCELLED` 4 s into the new start with no scancel; the ranks saved, exited 75, and the job was requeued again.
Slurm names a step by job id and step number, and the numbers start again at 0 at each start, so a signal meant
for the previous start's step (slurmctld retries one to a node it had lost touch with) reaches this start's.

The batch script (templates/slurm.sbatch.j2) runs for real under bash with stub `srun`, `squeue` and `scontrol`,
as in tests/unit/test_batch_preemption_race.py: the stub ranks exit with the codes RANKS_EXITS gives in turn, the
requeue policy (`python -m launcher.requeue`) is the real one, and squeue says the job is running, unpreempted:
nothing of this start asked for a stop.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_batch_preemption_race import SCONTROL, SQUEUE, _script

SRUN = """#!/bin/bash
for word in "$@"; do
  case "$word" in
    launcher.requeue) while [ "$1" != python ] && [ "${1##*/}" != python ]; do shift; done; exec "$@" ;;
    launcher.probes.health)
      mkdir -p "$MESHRUN_RUN_DIR/health" && echo '{"node": "n1", "checks": []}' > "$MESHRUN_RUN_DIR/health/n1.json"
      exit 0 ;;
    launcher.sidecar) exit 0 ;;
  esac
done
# The ranks: the Nth run exits with RANKS_EXITS' Nth code (the last one for good).
echo run >> "$ANSWERS.runs"
n=$(wc -l < "$ANSWERS.runs")
set -- $RANKS_EXITS
[ "$n" -le "$#" ] || n=$#
exit "${!n}"
"""


def _run(tmp_path: Path, ranks_exits: str, answers: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path / "runs" / "job"
    (run_dir / "logs").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": SRUN, "squeue": SQUEUE, "scontrol": SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "answers").write_text("".join(line + "\n" for line in answers))
    script = tmp_path / "job.sbatch"
    script.write_text(_script(run_dir))
    env = {
        "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ANSWERS": str(tmp_path / "answers"),
        "MESHRUN_TESTBED_VENV": sys.prefix,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n1",
        "RANKS_EXITS": ranks_exits,
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    return done, tmp_path / "answers.scontrol"


def _runs(tmp_path: Path) -> int:
    return len((tmp_path / "answers.runs").read_text().splitlines())


def test_a_stop_nobody_of_this_start_sent_restarts_the_ranks_in_place_without_a_requeue(tmp_path: Path) -> None:
    done, scontrol = _run(tmp_path, "75 0", ["N/A 0 RUNNING"])
    said = done.stdout + done.stderr
    assert "on a signal nobody of this start sent" in said and "not requeueing" in said, said
    assert "[meshrun] job 4242 restart 0 in-job 1 on n1 at " in said, said  # the ranks' second run, same start
    assert _runs(tmp_path) == 2 and done.returncode == 0, said
    assert not scontrol.exists(), scontrol.read_text()  # no `scontrol requeue`: no restart counted


def test_stops_that_keep_coming_are_requeued_after_two_restarts_in_place(tmp_path: Path) -> None:
    done, scontrol = _run(tmp_path, "75", ["N/A 0 RUNNING"])
    said = done.stdout + done.stderr
    assert said.count("on a signal nobody of this start sent") == 2, said
    assert _runs(tmp_path) == 3 and "requeueing: restart 1 of at most" in said, said
    assert scontrol.read_text() == "scontrol requeue 4242\n"


def test_a_preemption_is_no_unasked_stop(tmp_path: Path) -> None:
    """Slurm's PreemptTime says it asked: requeued as before, not restarted in place."""
    done, scontrol = _run(tmp_path, "75 0", ["2026-12-03T09:03:05 0 RUNNING"])
    said = done.stdout + done.stderr
    assert "preempted by Slurm at " in said and "nobody of this start" not in said, said
    assert _runs(tmp_path) == 1 and scontrol.read_text() == "scontrol requeue 4242\n", said
