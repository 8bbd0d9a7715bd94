"""A start immune to a step cancel meant for an earlier one: after a requeue, slurmd logged `STEP 700010.2 ON n1
CANCELLED` 4 s into the new start with no scancel; the ranks saved, exited 75, and the job was requeued again.
Slurm names a step by job id and step number, and the numbers start again at 0 at each start, so a signal meant
for the previous start's step (slurmctld retries one to a node it had lost touch with) reaches this start's.

The batch script (templates/slurm.sbatch.j2) runs for real under bash with stub `srun`, `squeue` and `scontrol`,
as in tests/unit/test_batch_preemption_race.py: the stub ranks exit with the codes RANKS_EXITS gives in turn, the
requeue policy (`python -m meshrun.launcher.batch.requeue`) is the real one, and squeue says the job is running, unpreempted:
nothing of this start asked for a stop.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.unit.test_batch_preemption_race import SRUN_STEPS, stub_job

SRUN = (
    SRUN_STEPS
    + """# The ranks: the Nth run ends as RANKS_EXITS' Nth word says (the last one for good): CODE, or CODE:aborted (Slurm
# cancelled the step from outside: srun's own line, as the testbed's srun says it for `scancel JOB.STEP`), or
# CODE:stepd (the same cancel as slurmstepd says it, which srun passes on in its stead now and then), or
# CODE:killed (a rank killed, srun ends the others: --kill-on-bad-exit).
echo run >> "$ANSWERS.runs"
n=$(wc -l < "$ANSWERS.runs")
set -- $RANKS_EXITS
[ "$n" -le "$#" ] || n=$#
end=${!n}
case $end in
  *:aborted) echo "srun: Job step aborted: Waiting up to 17 seconds for job step to finish." >&2
             echo "srun: error: n1: task 0: Killed" >&2 ;;
  *:stepd) echo "slurmstepd-n1: error: *** STEP 4242.2 ON n1 CANCELLED AT 2026-12-07T21:42:28 ***" >&2
           echo "srun: error: n1: task 0: Killed" >&2 ;;
  *:killed) echo "srun: error: n1: task 0: Killed" >&2
            echo "srun: launch/slurm: _step_signal: Terminating StepId=4242.2" >&2 ;;
esac
exit "${end%%:*}"
"""
)


def _run(tmp_path: Path, ranks_exits: str, answers: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    script, run_dir, env = stub_job(tmp_path, SRUN, answers, RANKS_EXITS=ranks_exits)
    # The batch log, as Slurm writes it (#SBATCH --output): the shell's and srun's lines, which the policy reads.
    log = run_dir / "logs" / "slurm-4242.out"
    with open(log, "a") as out:
        done = subprocess.run(["bash", str(script)], env=env, stdout=out, stderr=out, text=True, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, log.read_text(), ""), tmp_path / "answers.scontrol"


def _runs(tmp_path: Path) -> int:
    return len((tmp_path / "answers.runs").read_text().splitlines())


def test_a_step_cancel_nobody_of_this_start_sent_restarts_the_ranks_in_place_without_a_requeue(tmp_path: Path) -> None:
    done, scontrol = _run(tmp_path, "137:aborted 0", ["N/A 0 RUNNING"])
    said = done.stdout + done.stderr
    assert "the ranks' step was cancelled (exit 137) though nobody of this start asked" in said, said
    assert "[meshrun] job 4242 restart 0 in-job 1 on n1 at " in said, said  # the ranks' second run, same start
    assert _runs(tmp_path) == 2 and done.returncode == 0, said
    assert not scontrol.exists(), scontrol.read_text()  # no `scontrol requeue`: no restart counted
    assert "leaves out" not in said, said  # no node blamed for a cancel


def test_cancels_that_keep_coming_are_requeued_after_two_restarts_in_place(tmp_path: Path) -> None:
    done, scontrol = _run(tmp_path, "75:aborted", ["N/A 0 RUNNING"])
    said = done.stdout + done.stderr
    assert said.count("though nobody of this start asked") == 2, said
    assert _runs(tmp_path) == 3 and "requeueing: restart 1 of at most" in said, said
    assert scontrol.read_text() == "scontrol requeue 4242\n"


def test_a_rank_killed_or_a_programs_own_75_is_no_unasked_stop(tmp_path: Path) -> None:
    """The CI run of the first version: a rank's kill -9 (srun then ends the others: exit 143) and a program's own
    exit 75 were taken for stray cancels and restarted in place; only srun's 'step aborted' says Slurm cancelled."""
    for ends in ("143:killed 0", "75 0"):
        case = tmp_path / ends.split()[0].replace(":", "-")
        case.mkdir()
        done, scontrol = _run(case, ends, ["N/A 0 RUNNING"])
        said = done.stdout + done.stderr
        assert "nobody of this start" not in said and _runs(case) == 1, (ends, said)
        assert "scontrol requeue 4242\n" in scontrol.read_text(), (ends, said)


def test_a_preemption_is_no_unasked_stop(tmp_path: Path) -> None:
    """Slurm's PreemptTime says it asked: requeued as before, not restarted in place."""
    done, scontrol = _run(tmp_path, "75:aborted 0", ["2026-12-03T09:03:05 0 RUNNING"])
    said = done.stdout + done.stderr
    assert "preempted by Slurm at " in said and "nobody of this start" not in said, said
    assert _runs(tmp_path) == 1 and scontrol.read_text().startswith("scontrol requeue 4242\n"), said


def test_slurmstepds_word_for_the_cancel_counts_too_and_srun_saying_0_is_no_finish(tmp_path: Path) -> None:
    """The CI run: the testbed's batch log had slurmstepd's `*** STEP J.2 ON n1 CANCELLED AT ... ***` and not srun's
    'aborted' line, and srun's status was 0 though the rank was killed: the job was taken for finished."""
    done, scontrol = _run(tmp_path, "0:stepd 0", ["N/A 0 RUNNING"])
    said = done.stdout + done.stderr
    assert "the ranks' step was cancelled (exit 0) though nobody of this start asked" in said, said
    assert _runs(tmp_path) == 2 and not scontrol.exists(), said
