"""The batch script's reading of Slurm once the ranks have ended (templates/slurm.sbatch.j2), run for real
under bash with stub `srun`, `squeue` and `scontrol` on PATH.

Found by a 2-worker run of the suite, on a loaded 2-core machine: at a preemption's grace time's
end Slurm signals the batch shell and requeues the job, but counts the restart a moment after the shell
first asked squeue, which then showed the job preempted and no longer RUNNING. The shell took that for a
scancel, ended the job as cancelled and removed its `env:` secrets; Slurm's requeued run found them gone and
failed with exit 2. The shell now asks again (up to 5 s) before it takes a preempted job for a cancelled one.

The stub srun plays ranks that exit 75 (saved, as on the grace time's SIGTERM) and a sidecar that ends at
once, and runs the requeue policy itself (`python -m meshrun.launcher.batch.requeue`, the real one); the stub squeue gives
Slurm's answers in turn, the last one for good.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.secrets import secrets_dir_for
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.core.status import parse_metrics_tail
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers import backend
from meshrun.submit.schedulers import render as render_module
from meshrun.submit.schedulers.render import render

REPO = Path(__file__).resolve().parents[2]
PREEMPTED_AT = "2026-12-03T09:03:05"

SRUN_STEPS = """#!/bin/bash
# The job's steps: the requeue policy runs for real; n1 passes its health check (the real gate reads its
# answer); the sidecar ends. What follows this part plays the ranks.
for word in "$@"; do
  case "$word" in
    meshrun.launcher.batch.requeue) while [ "$1" != python ] && [ "${1##*/}" != python ]; do shift; done; exec "$@" ;;
    meshrun.launcher.probes.health)
      mkdir -p "$MESHRUN_RUN_DIR/health" && echo '{"node": "n1", "checks": []}' > "$MESHRUN_RUN_DIR/health/n1.json"
      exit 0 ;;
    meshrun.launcher.sidecar) exit 0 ;;
  esac
done
"""
SRUN = (
    SRUN_STEPS
    + """# The ranks "saved" (exit 75).
# RANKS_WAIT: the ranks run until the test says go, writing down each SIGUSR1 the batch shell passes on.
if [ -n "${RANKS_WAIT:-}" ]; then
  trap 'echo USR1 >> "$ANSWERS.usr1"' USR1
  touch "$ANSWERS.ranks"
  for i in $(seq 100); do [ -e "$ANSWERS.go" ] && break; sleep 0.1; done
fi
exit "${RANKS_EXIT:-75}"
"""
)

SQUEUE = """#!/bin/bash
# The job's submit time (asked once, at the start); then Slurm's answers in turn (one a line, the last for
# good): PreemptTime RestartCnt State.
case "$*" in *SubmitTime*) echo "2026-12-03T09:02:50"; exit 0 ;; esac
n=$(cat "$ANSWERS.n" 2>/dev/null || echo 0)
total=$(wc -l < "$ANSWERS")
line=$(( n < total ? n + 1 : total ))
echo $((n + 1)) > "$ANSWERS.n"
sed -n "${line}p" "$ANSWERS"
"""

SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$ANSWERS.scontrol"
"""


def _script(run_dir: Path, lead: int = 0) -> str:
    """The testbed profile's script for examples/command.yaml, as `meshrun submit` renders it (with the time
    limit's warning `lead` s ahead, if given)."""
    profile = load_profile("testbed")
    if lead:
        profile = dataclasses.replace(profile, defaults=dataclasses.replace(profile.defaults, signal_seconds=lead))
    # The work dir (and so the ledger of suspect nodes in it) is the test's own: a node these stubs blame must
    # not land in the real testbed's ledger, where the spare-node tests would avoid it.
    profile = dataclasses.replace(profile, paths=dataclasses.replace(profile.paths, work_dir=str(run_dir.parent)))
    scheduler = backend(profile.scheduler)
    plan = plan_file(
        REPO / "examples" / "command.yaml",
        profile,
        home=str(run_dir.parent),
        run_dir=str(run_dir),
        scheduler_check=scheduler.check,
    )
    return render(plan, scheduler)


def stub_job(tmp_path: Path, srun: str, answers: list[str], **extra_env: str) -> tuple[Path, Path, dict[str, str]]:
    """The testbed profile's batch script beside stub Slurm commands (`srun` as given): (the script, its run dir,
    the environment the batch shell runs in)."""
    run_dir = tmp_path / "runs" / "job"
    (run_dir / "logs").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": srun, "squeue": SQUEUE, "scontrol": SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "answers").write_text("".join(line + "\n" for line in answers))
    script = tmp_path / "job.sbatch"
    script.write_text(_script(run_dir, int(extra_env.pop("LEAD", "0"))))
    env = {
        "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ANSWERS": str(tmp_path / "answers"),
        "MESHRUN_TESTBED_VENV": sys.prefix,
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n1",
        **extra_env,
    }
    return script, run_dir, env


def _start(tmp_path: Path, answers: list[str], **extra_env: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """The batch script under bash, started: (the shell, the job's secrets folder, scontrol's record)."""
    script, run_dir, env = stub_job(tmp_path, SRUN, answers, **extra_env)
    secrets = Path(secrets_dir_for(str(run_dir)))
    secrets.mkdir(mode=0o700)
    (secrets / "TOKEN").write_text("t0ken")
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return shell, secrets, tmp_path / "answers.scontrol"


def _run(tmp_path: Path, answers: list[str], **extra_env: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    shell, secrets, scontrol = _start(tmp_path, answers, **extra_env)
    out, err = shell.communicate(timeout=60)
    return subprocess.CompletedProcess(shell.args, shell.returncode, out, err), secrets, scontrol


def test_a_preemption_whose_requeue_slurm_counts_late_keeps_the_secrets_and_is_not_requeued_twice(
    tmp_path: Path,
) -> None:
    done, secrets, scontrol = _run(
        tmp_path, [f"{PREEMPTED_AT} 0 COMPLETING", f"{PREEMPTED_AT} 0 COMPLETING", "N/A 1 PENDING"]
    )
    said = done.stdout + done.stderr
    assert "Slurm has requeued the job itself" in said, said
    assert "scancel" not in said and "not requeueing (status" not in said, said
    assert secrets.exists() and (secrets / "TOKEN").read_text() == "t0ken"  # the requeued run needs it
    assert not scontrol.exists(), scontrol.read_text()  # Slurm requeues it: not a second time from here
    assert done.returncode == 75, said
    metrics = (tmp_path / "runs" / "job" / "metrics.jsonl").read_text()
    assert parse_metrics_tail(metrics, "4242")["stopped"] == (
        "stopped by preemption past its grace time (Slurm requeued it itself)"
    )


def test_a_preemption_while_squeue_answers_nothing_is_asked_again(tmp_path: Path) -> None:
    """The full suite's run found the next order: squeue printed nothing while Slurm requeued the job (the
    shell's own SIGTERM then read as a scancel's, and the secrets went); an empty answer is asked again."""
    done, secrets, scontrol = _run(tmp_path, ["", "", "N/A 1 PENDING"])
    said = done.stdout + done.stderr
    assert "Slurm has requeued the job itself" in said and secrets.exists() and not scontrol.exists(), said


@pytest.mark.parametrize("state", ["COMPLETING", "CANCELLED"])
def test_a_preempted_job_slurm_ends_without_a_requeue_ends_as_cancelled(tmp_path: Path, state: str) -> None:
    """A scancel in the grace time (Slurm never counts a restart): after the wait, ended; its secrets go."""
    done, secrets, scontrol = _run(tmp_path, [f"{PREEMPTED_AT} 0 {state}"])
    said = done.stdout + done.stderr
    assert "SIGTERM (scancel, or Slurm ended the job): not requeueing (status 75)" in said, said
    assert not secrets.exists()
    assert not scontrol.exists()


def test_a_preempted_framework_that_exits_0_is_requeued_not_finished(tmp_path: Path) -> None:
    """Lightning leaves its loop on the preemption's SIGTERM and exits 0 within the grace time; the
    job was taken for finished and ended COMPLETED with its work lost."""
    done, secrets, scontrol = _run(tmp_path, [f"{PREEMPTED_AT} 0 RUNNING"], RANKS_EXIT="0")
    said = done.stdout + done.stderr
    assert "preempted by Slurm at " in said and "ranks exited with status 0" in said, said
    assert "stopped by preemption (no step reported): the program exited 0 after the stop signal" in said, said
    assert "requeueing: restart 1 of at most" in said and "finished (exit 0)" not in said, said
    assert scontrol.read_text() == "scontrol requeue 4242\n"  # requeued once, by meshrun
    assert secrets.exists()  # the requeued run needs them


def test_a_preempted_framework_killed_by_the_signal_says_what_stopped_it(tmp_path: Path) -> None:
    """A new user's trial: Hugging Face's Trainer installs no SIGTERM handler, so a preempted rank dies of the
    signal (143); the job was requeued, but while it waited `status` said only Slurm's `Resources`."""
    done, _secrets, scontrol = _run(tmp_path, [f"{PREEMPTED_AT} 0 RUNNING"], RANKS_EXIT="143")
    said = done.stdout + done.stderr
    assert "stopped by preemption (no step reported)" in said and "requeueing: restart 1 of at most" in said, said
    assert scontrol.read_text() == "scontrol requeue 4242\n"
    metrics = (tmp_path / "runs" / "job" / "metrics.jsonl").read_text()
    assert parse_metrics_tail(metrics, "4242")["stopped"] == "stopped by preemption (no step reported)"


def test_the_ranks_hear_the_stop_once_per_start(tmp_path: Path) -> None:
    """After the time limit's SIGUSR1, Lightning saved a checkpoint and asked for a requeue; the TERM
    of that requeue reached the batch shell, which passed the stop on again: a second save and requeue."""
    shell, _secrets, scontrol = _start(tmp_path, ["N/A 1 PENDING"], RANKS_WAIT="1", RANKS_EXIT="0")
    answers = tmp_path / "answers"
    deadline = time.monotonic() + 30
    while not Path(f"{answers}.ranks").exists():
        assert time.monotonic() < deadline and shell.poll() is None, "the ranks never started"
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)  # the time limit's warning
    time.sleep(0.5)
    shell.send_signal(signal.SIGTERM)  # the requeue the program asked for ends the shell
    time.sleep(0.5)
    Path(f"{answers}.go").touch()
    out, err = shell.communicate(timeout=60)
    said = out + err
    assert Path(f"{answers}.usr1").read_text() == "USR1\n", said  # once, not twice
    assert "SIGUSR1: passing it to the ranks" in said and "SIGTERM: Slurm signals the ranks itself" in said
    assert "requeued after the time limit's warning (by the program's own `scontrol requeue`" in said, said
    assert not scontrol.exists(), scontrol.read_text()  # the program's requeue, not a second one
    # What status says while the job waits (a new user's trial saw only Slurm's 'BeginTime').
    metrics = (tmp_path / "runs" / "job" / "metrics.jsonl").read_text()
    assert parse_metrics_tail(metrics, "4242")["stopped"] == (
        "stopped at the time limit's warning (the program asked Slurm for the requeue itself)"
    )


def test_a_cancel_of_a_command_job_passes_no_usr1_on(tmp_path: Path) -> None:
    """A new user's trial: `meshrun cancel` of a Lightning job on Slurm ended in a requeue and COMPLETED. scancel's
    TERM reached the batch shell, which passed USR1 on; Lightning takes USR1 for "save and requeue me" and ran
    `scontrol requeue`. A `command:` job's program hears Slurm's own TERM alone (Slurm signals every step)."""
    shell, secrets, scontrol = _start(tmp_path, ["N/A 0 CANCELLED"], RANKS_WAIT="1", RANKS_EXIT="0")
    answers = tmp_path / "answers"
    deadline = time.monotonic() + 30
    while not Path(f"{answers}.ranks").exists():
        assert time.monotonic() < deadline and shell.poll() is None, "the ranks never started"
        time.sleep(0.05)
    shell.send_signal(signal.SIGTERM)  # scancel
    time.sleep(0.5)
    Path(f"{answers}.go").touch()
    out, err = shell.communicate(timeout=60)
    said = out + err
    assert not Path(f"{answers}.usr1").exists(), said  # nothing that would make Lightning requeue itself
    assert "SIGTERM: Slurm signals the ranks itself" in said, said
    assert "not requeueing" in said and not scontrol.exists(), said
    assert not secrets.exists()  # ended: the secrets go


def test_ranks_that_neither_stop_nor_requeue_after_the_time_limits_warning_are_requeued_before_the_limit(
    tmp_path: Path,
) -> None:
    """A new user's trial: Lightning's handler saved hpc_ckpt_1.ckpt on the time limit's USR1, then hung in its
    barrier; its own `scontrol requeue` never ran, and the job ended TIMEOUT, which Slurm never requeues (one
    requeue, never none). The batch shell's backstop requeues it shortly before the limit."""
    lead = 6  # the profile's warning lead: the backstop comes time_limit_backstop_s(6) = 3 s after the warning
    shell, _secrets, scontrol = _start(tmp_path, ["N/A 1 PENDING"], RANKS_WAIT="1", RANKS_EXIT="0", LEAD=str(lead))
    answers = tmp_path / "answers"
    deadline = time.monotonic() + 30
    while not Path(f"{answers}.ranks").exists():
        assert time.monotonic() < deadline and shell.poll() is None, "the ranks never started"
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)  # the time limit's warning; the ranks go on (hung)
    while not scontrol.exists():
        assert time.monotonic() < deadline + 10 and shell.poll() is None, "no backstop requeue"
        time.sleep(0.1)
    shell.send_signal(signal.SIGTERM)  # the requeue ends the shell, as Slurm's does
    Path(f"{answers}.go").touch()
    out, err = shell.communicate(timeout=60)
    said = out + err
    assert "the ranks have not stopped 3 s after the time limit's warning: requeueing the job from here" in said, said
    assert scontrol.read_text() == "scontrol requeue 4242\n", said  # once
    assert "the job was requeued by the time limit's backstop above: not requeueing it again" in said, said
    metrics = (tmp_path / "runs" / "job" / "metrics.jsonl").read_text()
    assert parse_metrics_tail(metrics, "4242")["stopped"] == (
        "stopped at the time limit's warning (the ranks had not stopped: requeued before the limit)"
    )
    assert render_module.time_limit_backstop_s(120) == 100 and render_module.time_limit_backstop_s(2) == 1
