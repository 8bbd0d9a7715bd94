"""`command:` jobs with the safety net (meshrun.launcher.job, meshrun.launcher.batch.requeue), through the real CLI: the DDP example
is preempted on the real Slurm testbed, requeued, and ends where an uninterrupted run does; a program that
crashes at once ends after 2 attempts with exit 77 (gave up), on Slurm and on `local`."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

from meshrun.launcher.contract.exitcodes import EXIT_GAVE_UP
from tests.helpers.cli import meshrun, metrics, status, submitted, wait_for_state, wait_for_step
from tests.helpers.ranks import free_port
from tests.testbed import testbed as tb

STEPS = 60
DDP = ["examples/ddp.yaml", "-c", "testbed", "--set", "resources.nodes=2", "--set", "resources.tasks_per_node=1"]
# A program that prints what meshrun told it, then fails at once (no commas: --set splits lists on them);
# one rank, so that no peer's failure ends it before it prints.
ONE_RANK = ["--set", "resources.nodes=1", "--set", "resources.tasks_per_node=1"]
CRASH = (
    "command=python3,-c,import os; print({k: os.environ[k] for k in os.environ if k.startswith('MESHRUN_')}); "
    "raise SystemExit(3)"
)


def _ddp(steps: int = STEPS) -> list[str]:
    return [*DDP, "--set", f"command=python3,examples/ddp_train.py,--steps,{steps},--save-every,25,--sleep,0.1"]


def test_ddp_example_preempted_requeues_and_ends_with_the_loss_of_an_uninterrupted_run(
    testbed: dict, tmp_path: Path
) -> None:
    ref_id, ref_dir = submitted(meshrun(tmp_path, "submit", *_ddp(), check=True))
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *_ddp(), check=True))
    wait_for_step(run_dir, 8)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)  # what a preemption does
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, row
    wait_for_state(tmp_path, ref_id, {"COMPLETED"})
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert "ranks exited with status 75" in batch and "requeueing: restart 1 of at most 20" in batch, batch
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    stopped = int(rank0.split("stopping after step ")[1].split(":")[0])
    assert 8 <= stopped < STEPS and f"resuming from step {stopped}" in rank0 and "restart 1" in rank0
    pre, ref = metrics(run_dir), metrics(ref_dir)
    assert [r["step"] for r in pre] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in pre] == [r["loss"] for r in ref]  # bit-identical, the final one too
    assert f"final loss {ref[-1]['loss']:.6f} at step {STEPS}" in rank0


def test_a_command_that_crashes_at_once_gives_up_after_two_runs_on_slurm(testbed: dict, tmp_path: Path) -> None:
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *DDP, *ONE_RANK, "--set", CRASH, check=True))
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_GAVE_UP, row
    assert row["reason"].startswith("gave up (crash loop: 2 runs in a row failed without reporting a step"), row
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert batch.count("ranks exited with status 3") == 2 and "requeueing: restart 1 of at most 20" in batch
    assert "[meshrun] gave up (crash loop" in batch
    told = [
        ast.literal_eval(line) for line in (run_dir / "logs" / "rank-0.log").read_text().splitlines() if line[:1] == "{"
    ]
    assert [t["MESHRUN_RESTART_COUNT"] for t in told] == ["0", "1"]
    assert told[0]["MESHRUN_STOP_SIGNALS"] == "SIGUSR1,SIGTERM" and told[0]["MESHRUN_EXIT_REQUEUE"] == "75"
    assert told[0]["MESHRUN_RUN_DIR"] == str(run_dir) and told[0]["MESHRUN_CHECKPOINT_DIR"].startswith(
        f"{tb.TESTBED_DIR}/checkpoints/"
    )


def test_on_slurm_the_reason_names_the_rank_killed_first_and_how(testbed: dict, tmp_path: Path) -> None:
    """On Slurm: rank 1 killed with -9 while rank 0 waits; the reason led with nothing of it."""
    program = (
        'command=[python3, -c, \'import os, time; r = os.environ["RANK"]; time.sleep(2); '
        'os.kill(os.getpid(), 9) if r == "1" else time.sleep(120)\']'
    )
    args = [*DDP, "--set", program, "--set", "checkpoint.max_requeues=0"]
    job_id, _ = submitted(meshrun(tmp_path, "submit", *args, check=True))
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert row["state"] == "FAILED" and row["reason"].startswith("rank 1 (on n2) "), row
    assert "SIGKILL (kill -9, or the kernel's out-of-memory killer" in row["reason"], row


def test_a_command_that_crashes_at_once_gives_up_on_its_second_local_run(tmp_path: Path) -> None:
    args = ["examples/command.yaml", "-c", "local", *ONE_RANK, "--set", CRASH]
    out = meshrun(tmp_path, "submit", *args, "--wait")
    job_id, run_dir = submitted(out)
    assert out.returncode == 1 and status(tmp_path, job_id)["exit_code"] == 3, out.stdout
    out = meshrun(tmp_path, "resume", job_id, "--wait")
    new_id = out.stdout.split()[5]
    row = status(tmp_path, new_id)
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_GAVE_UP, row
    assert row["reason"].startswith("gave up (crash loop: 2 runs in a row"), row
    told = [
        ast.literal_eval(line) for line in (run_dir / "logs" / "rank-0.log").read_text().splitlines() if line[:1] == "{"
    ]
    assert [t["MESHRUN_RESTART_COUNT"] for t in told] == ["0", "1"]
    checkpoints = Path(told[0]["MESHRUN_CHECKPOINT_DIR"])
    assert checkpoints == run_dir / "checkpoints" and stat.S_IMODE(checkpoints.stat().st_mode) == 0o700


def test_a_programs_own_exit_2_is_its_failure_not_bad_input_on_local(tmp_path: Path) -> None:
    """A script's argparse error ended the job as meshrun's exit 2, 'bad input'."""
    usage = "command=[python3, -c, 'import argparse; argparse.ArgumentParser().parse_args([\"--nope\"])']"
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "local", *ONE_RANK, "--set", usage, "--wait")
    job_id, _ = submitted(out)
    row = status(tmp_path, job_id)
    assert out.returncode == 1 and row["state"] == "FAILED" and row["exit_code"] == 1, (out.stdout, row)
    assert "the program exited with code 2, its own (no bad input was reported)" in row["reason"], row
    assert "bad input" not in row["reason"].replace("no bad input was reported", ""), row


def test_a_command_job_saving_through_launcher_job_shows_its_checkpoint(tmp_path: Path) -> None:
    """CKPT showed '-' for command jobs that saved through meshrun.launcher.job."""
    script = "command=[python3, examples/ddp_train.py, --steps, '30', --save-every, '10']"
    out = meshrun(tmp_path, "submit", "examples/ddp.yaml", "-c", "local", "--set", script, "--wait", check=True)
    job_id, run_dir = submitted(out)
    row = status(tmp_path, job_id)
    assert row["state"] == "COMPLETED" and row["progress"].get("checkpoint_step") == 30, row
    listed = meshrun(tmp_path, "status", check=True).stdout.splitlines()
    header, line = listed[0].split(), next(l for l in listed if l.startswith(job_id)).split()
    assert "CKPT" in header and "30" in line, listed


AGREE = """
import os, signal, sys
from meshrun.launcher import job
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
before = job.should_stop()
if rank == 1:
    os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled
print(rank, before, job.should_stop(), flush=True)
dist.destroy_process_group()
"""


def test_should_stop_agrees_across_ranks_when_one_rank_is_signalled(tmp_path: Path) -> None:
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    base["MESHRUN_STOP_SIGNALS"] = "SIGUSR1,SIGTERM"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGREE], env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, text=True, cwd=tmp_path
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [["0", "False", "True"], ["1", "False", "True"]]


def test_a_job_whose_ranks_never_start_says_why_in_status_and_logs_and_is_not_requeued(
    testbed: dict, tmp_path: Path
) -> None:
    """A new user's trial: a profile's Pyxis container on a cluster without Pyxis queued, then failed in 0 s with
    `srun: unrecognized option '--container-image=...'` 8 times; status said FAILED with no reason, `logs` said
    "no log yet" (exit 0), and the batch log advised a `meshrun resume` that would fail the same way."""
    import yaml

    profile = yaml.safe_load(tb.profile_file().read_text())  # this worker's testbed
    profile["container"] = {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.01-py3"}
    clusters = tmp_path / "config" / "meshrun" / "clusters"
    clusters.mkdir(parents=True)
    (clusters / "nopyxis.yaml").write_text(yaml.safe_dump(profile))
    args = ["examples/command.yaml", "-c", "nopyxis", *ONE_RANK]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "FAILED" and row["restarts"] == 0 and row["exit_code"] == 2, (row, batch)
    assert row["reason"] == (
        "the ranks never started: srun: unrecognized option '--container-image=nvcr.io#nvidia/pytorch:24.01-py3'"
    ), (row, batch)
    assert "bad input (exit 2): not requeueing" in batch and "meshrun resume" not in batch, batch
    logs = meshrun(tmp_path, "logs", job_id)
    assert logs.returncode == 1 and "has no rank log: the ranks never started: srun: unrecognized option" in logs.stderr


# A framework's habit at a stop signal (Lightning's SIGUSR1/SIGTERM handlers): leave the loop and exit 0. With
# `finished`, the program says it finished first (meshrun.launcher.job.finished), as one whose last step came with it.
AT_THE_LIMIT = """
import signal, sys, time
stop = []
# "term-only": a program that knows only SIGTERM's stop (Lightning outside Slurm installs no USR1 handler).
signal.signal(signal.SIGTERM if sys.argv[1] == "term-only" else signal.SIGUSR1, lambda *_: stop.append(1))
print("handler set", flush=True)
while not stop:
    time.sleep(0.05)
if sys.argv[1] == "finished":
    from meshrun.launcher import job
    job.finished()
print("left the loop on the signal", flush=True)
"""


def test_a_local_job_that_exits_0_at_its_time_limit_ends_timeout_unless_it_said_it_finished(tmp_path: Path) -> None:
    """On `local`: the supervisor's time limit passes SIGUSR1 on; a program that leaves its loop on it
    and exits 0 has work left (TIMEOUT, and status says where it stopped and that resume continues it); one that
    said it finished is COMPLETED; one with no USR1 handler of its own gets SIGTERM instead (USR1 would kill it:
    Lightning on `local` died of it, exit 138, nothing saved). All through the real supervisor and its real time
    limit (12 s)."""
    script = tmp_path / "at_the_limit.py"
    script.write_text(AT_THE_LIMIT)
    jobs = {}
    for way in ("silent", "finished", "term-only"):
        args = ["examples/command.yaml", "-c", "local", *ONE_RANK, "--set", "resources.time=0:12"]
        jobs[way] = submitted(
            meshrun(tmp_path, "submit", *args, "--set", f"command=python3,{script},{way}", check=True)
        )
    rows = {
        way: wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
        for way, (job_id, _) in jobs.items()
    }
    for way, (_, run_dir) in jobs.items():
        assert "left the loop on the signal" in (run_dir / "logs" / "rank-0.log").read_text(), way
    assert rows["silent"]["state"] == "TIMEOUT", rows["silent"]
    assert rows["silent"]["reason"].startswith(
        "stopped at the time limit (no step reported): `meshrun resume` continues it"
    ), rows["silent"]
    assert rows["finished"]["state"] == "COMPLETED" and rows["finished"]["exit_code"] in (0, None), rows["finished"]
    assert rows["term-only"]["state"] == "TIMEOUT" and rows["term-only"]["exit_code"] != 138, rows["term-only"]
    assert rows["term-only"]["reason"].startswith("stopped at the time limit (no step reported)"), rows["term-only"]


def test_a_step_cancel_nobody_of_this_start_asked_for_restarts_the_ranks_in_place(
    testbed: dict, tmp_path: Path
) -> None:
    """A trial saw `STEP 700010.2 ON n1 CANCELLED` 4 s into a requeued start, no scancel: Slurm names a step by job
    id and number, and the numbers start again at each start, so a late cancel for an earlier start's step .2 hit
    this one's ranks (killed, their node blamed, the job requeued again). `scancel JOB.STEP` of the ranks' step does
    to a start what that late cancel did: the ranks start again inside the allocation, no requeue, no node blamed."""
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *DDP, *ONE_RANK, "--set", _ddp(120)[-1], check=True))
    wait_for_step(run_dir, 5)
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True)
    ranks_step = max(s for s in steps.stdout.split() if s.split(".")[-1].isdigit())  # after the gate's and sidecar's
    subprocess.run(["scancel", ranks_step], check=True)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 0, (row, batch)
    assert "though nobody of this start asked" in batch and "in-job 1 on " in batch, batch
    assert "leaves out" not in batch and "requeueing: restart" not in batch, batch
    assert [r["step"] for r in metrics(run_dir)][-1] == 120
