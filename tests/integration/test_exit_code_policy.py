"""The requeue policy by exit code, run for real: the rendered batch script on the Slurm testbed, one
`command:` job per code, all submitted at once (the test costs one requeue's time, not one per code).

Each program exits with its code on its first run only (MESHRUN_RESTART_COUNT 0, Slurm's restart count)
and 0 after, so a requeued code shows restart 1 and ends COMPLETED; a code that is not requeued ends with
one accounting record. The policy is launcher/batch/requeue.py's.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from meshrun.launcher.sidecar.keeper import DEAF_ENV
from meshrun.submit.schedulers import slurm_cli as slurm
from tests.helpers.cli import meshrun, submitted, wait_for_state
from tests.integration.test_real_preemption import command_spec


@dataclass(frozen=True)
class Case:
    """One program and what the batch script must make of it."""

    name: str
    """The job's name (and spec file's)."""
    script: str
    """The program (bash)."""
    records: tuple[str, ...]
    """Slurm's accounting records of the job, oldest first (sacct -D): one per run."""
    exit_code: str
    """The final record's ExitCode (sacct: CODE:SIGNAL)."""
    decisions: tuple[str, ...]
    """A phrase of each run's decision line in the batch log (the line after "ranks exited with status")."""
    env: tuple[tuple[str, str], ...] = ()
    """The job's `env:`."""


def _first_run_exits(code: int) -> str:
    return f'echo "restart $MESHRUN_RESTART_COUNT"; if [ "$MESHRUN_RESTART_COUNT" = 0 ]; then exit {code}; fi; exit 0'


REQUEUED = ("REQUEUED", "COMPLETED")
AGAIN = "requeueing: restart 1"
DONE = "finished (exit 0): not requeueing"
CASES = (
    # Its sidecar takes no notice of a USR2 (the ranks have ended) in its first 5 s, as when srun drops one that
    # comes while it is still launching the sidecars' step; the program ends after 3 s (its sidecar is up by
    # then). The batch script's next USR2 after those 5 s stops it; a single one would have left it to hold
    # the allocation for sidecar.final_copy_s, here past the time limit.
    Case(
        "exit-0",
        'echo "restart $MESHRUN_RESTART_COUNT"; sleep 3; exit 0',
        ("COMPLETED",),
        "0:0",
        (DONE,),
        env=((DEAF_ENV, "5"),),
    ),
    Case("exit-1", _first_run_exits(1), REQUEUED, "0:0", (AGAIN, DONE)),
    # A program's own 2 (argparse's usage error) is a failure like any other; meshrun's
    # bad-input verdict is a 2 that comes with a rank error line (meshrun.launcher.job's checks write one).
    Case(
        "exit-2",
        _first_run_exits(2),
        REQUEUED,
        "0:0",
        ("the program exited with code 2, its own (no bad input was reported): requeueing: restart 1", DONE),
    ),
    Case(
        "exit-2-said",
        'echo "restart $MESHRUN_RESTART_COUNT"; '
        'echo "rank 0: data.path: /x: no token file there" > "$MESHRUN_RUN_DIR/rank-error.txt"; exit 2',
        ("FAILED",),
        "2:0",
        ("bad input (exit 2): not requeueing",),
    ),
    Case("exit-75", _first_run_exits(75), REQUEUED, "0:0", (AGAIN, DONE)),
    Case("exit-76", _first_run_exits(76), REQUEUED, "0:0", (AGAIN, DONE)),
    Case("exit-77", _first_run_exits(77), ("FAILED",), "77:0", ("gave up (crash loop) (exit 77): not requeueing",)),
    Case(
        "exit-78", _first_run_exits(78), ("FAILED",), "78:0", ("diverged (non-finite loss) (exit 78): not requeueing",)
    ),
    # A command job's second failure in a row without a new reported step: the crash-loop guard ends it
    # with 77 instead of a third run.
    Case(
        "exit-1-always",
        'echo "restart $MESHRUN_RESTART_COUNT"; exit 1',
        ("REQUEUED", "FAILED"),
        "77:0",
        (AGAIN, "gave up (crash loop: 2 runs in a row failed"),
    ),
)


def _decisions(batch: str) -> list[str]:
    lines = batch.splitlines()
    return [lines[i + 1] for i, line in enumerate(lines[:-1]) if "ranks exited with status" in line]


# A sweep (job array) of two tasks: the one whose SLURM_JOB_ID is the array's own id asks for a requeue.
# `scontrol requeue ARRAY_ID` would requeue every task of the array; only the asking one may come back.
ARRAY_ASKER = (
    'echo "restart $MESHRUN_RESTART_COUNT"; '
    'if [ "$SLURM_JOB_ID" = "$SLURM_ARRAY_JOB_ID" ] && [ "$MESHRUN_RESTART_COUNT" = 0 ]; then exit 75; fi; exit 0'
)


def _records(job_id: str) -> tuple[str, ...]:
    out = subprocess.run(
        ["sacct", "-X", "-D", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, check=True
    )
    return tuple(line.split()[0] for line in out.stdout.splitlines() if line.strip())


def test_each_exit_code_is_requeued_or_not_as_the_policy_says(testbed: dict[str, object], tmp_path: Path) -> None:
    jobs = {}
    for case in CASES:
        spec = command_spec(tmp_path, case.name, case.script, **({"env": dict(case.env)} if case.env else {}))
        jobs[case.name] = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "testbed", check=True))
    sweep = command_spec(tmp_path, "array-asker", ARRAY_ASKER)
    out = meshrun(tmp_path, "submit", str(sweep), "-c", "testbed", "--sweep", "env.K=a,b", check=True)
    tasks = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    sweep_dir = Path(next(line.split(": ", 1)[1] for line in out.stdout.splitlines() if line.startswith("run dir: ")))
    assert len(tasks) == 2, out.stdout
    finals = {}
    for case in CASES:
        job_id, _ = jobs[case.name]
        finals[case.name] = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})["state"]
    acct = subprocess.run(slurm.sacct_argv([j for j, _ in jobs.values()]), capture_output=True, text=True, check=True)
    states = slurm.parse_sacct(acct.stdout)
    for case in CASES:
        job_id, run_dir = jobs[case.name]
        batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
        rank = (run_dir / "logs" / "rank-0.log").read_text()
        seen = (case.name, batch, rank)
        assert finals[case.name] == case.records[-1] == states[job_id].state, seen
        assert states[job_id].exit_code == case.exit_code, (states[job_id], *seen)
        assert _records(job_id) == case.records, (_records(job_id), *seen)
        decisions = _decisions(batch)
        assert len(decisions) == len(case.decisions), seen
        assert all(want in got for want, got in zip(case.decisions, decisions)), seen
        restarts = len(case.records) - 1
        # The program saw Slurm's restart count: 0, then 1 for a requeued run; never a third run.
        assert [line for line in rank.splitlines() if line.startswith("restart ")] == [
            f"restart {n}" for n in range(restarts + 1)
        ], seen
        assert f"[meshrun] job {job_id} restart {restarts} on" in batch and f"restart {restarts + 1} on" not in batch
        if dict(case.env).get(DEAF_ENV):  # the sidecar ran, and stopped when told (not at the time limit)
            sidecar = "".join(log.read_text() for log in (run_dir / "logs").glob("sidecar-*.log"))
            assert "stopping: stop requested" in sidecar, (sidecar, *seen)
    _check_the_array(tmp_path, tasks, sweep_dir)


def _check_the_array(home: Path, tasks: list[str], sweep_dir: Path) -> None:
    logs = {}
    for n, task in enumerate(tasks):
        assert wait_for_state(home, task, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})["state"] == "COMPLETED"
        logs[task] = (sweep_dir / "tasks" / str(n) / "logs" / "rank-0.log").read_text()
    asked = [t for t in tasks if "restart 1" in logs[t]]
    assert len(asked) == 1, logs  # exactly one task held the array's id and asked
    (other,) = set(tasks) - set(asked)
    assert _records(asked[0]) == ("REQUEUED", "COMPLETED"), _records(asked[0])
    assert _records(other) == ("COMPLETED",) and "restart 1" not in logs[other], (_records(other), logs)
