"""Restart inside the allocation on a spare node, on the real Slurm testbed: a 2-node job
with 1 spare (the testbed's `wide` partition has three nodes) whose rank on n2 is killed with -9 mid-run
restarts on n1 + n3 inside the same Slurm job (no requeue), resumes from its last complete checkpoint and
finishes every step, bit for bit as an uninterrupted run; the node it left is a suspect with srun's evidence,
and goodput counts both runs of the allocation. A hang on its node (launcher/testing/faults.py) restarts the
same way, a node failing the health gate is replaced first, and without a spare the job requeues without the
node; once the last spare is lost too, without every node it left, on fewer nodes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS
from meshrun.launcher.contract.records.rundir import RunDir, read_state
from meshrun.launcher.rank.hostlist import expand_hostlist
from tests.helpers.cli import (
    FAST_WATCH,
    SMALL_MODEL,
    TWO_NODES,
    meshrun,
    metrics,
    slurm_job_fields,
    submitted,
    wait_for_state,
    wait_for_step,
)
from tests.testbed import testbed as tb

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
STEPS = 40


def _rank_pids(run_dir: Path) -> list[int]:
    """The job's rank processes (`python -m meshrun.launcher RUN_DIR`, not its sidecar), on this one testbed machine."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd[-3:] == ["-m", "meshrun.launcher", str(run_dir)] and os.path.basename(cmd[0]).startswith(
            "python"
        ):  # not srun
            found.append(proc.pid)
    return found


WIDE = [*TWO_NODES, *SMALL_MODEL, "--set", f"resources.partition={tb.WIDE_PARTITION}"]
"""A 2-node job (a rank a node) in the testbed's `wide` partition (n1-n3): room for a spare."""


def _kill_rank_on(node: str, run_dir: Path, after_step: int) -> None:
    """kill -9 the job's rank on `node` once rank 0 has logged `after_step`."""
    wait_for_step(run_dir, after_step, timeout=180)
    (pid,) = [p for p in _rank_pids(run_dir) if psutil.Process(p).environ().get("SLURMD_NODENAME") == node]
    os.kill(pid, signal.SIGKILL)


def _sacct_states(testbed: dict, job_id: str) -> list[str]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-D", "-j", job_id, "-o", "State"],
        env={"SLURM_CONF": str(testbed["slurm_conf"]), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def test_a_rank_killed_on_its_node_restarts_on_the_spare_inside_the_same_allocation(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    args = [*WIDE, "--set", "resilience.spare_nodes=1", "--set", "resilience.avoid_suspects=false"]
    args += ["--set", f"data.path={corpus}", "--set", f"train.steps={STEPS}", "--set", "train.log_every=1"]
    args += ["--set", "checkpoint.every=5"]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    _kill_rank_on("n2", run_dir, after_step=12)
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=240)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 0, (row, batch)  # no requeue: one allocation
    assert "restarting inside the allocation without n2 (rank 1 " in batch and "restart 1 of at most 3" in batch, batch
    assert f"[meshrun] job {job_id} restart 0 in-job 1 on n1,n3 at " in batch, batch
    assert "REQUEUED" not in _sacct_states(testbed, job_id)  # sacct: one allocation
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    assert "resuming from step" in (run_dir / "logs" / "rank-0.log").read_text()
    moved = (run_dir / "logs" / "rank-1.log").read_text()  # rank 1 moved from n2 to the spare
    assert f"(n3) job {job_id} restart 0 in-job 1 master" in moved, moved
    why = "[meshrun] restarting inside the allocation without n2 (rank 1 "
    assert why in moved and why in (run_dir / "logs" / "rank-0.log").read_text()  # each rank's log says why
    # Goodput: the allocation's two runs, the second on the spare.
    runs = row["goodput"]["attempts"]
    assert [(a["restart"], a["in_job"], a["nodes"]) for a in runs] == [(0, 0, "n1,n2"), (0, 1, "n1,n3")], runs
    assert runs[0]["status"] not in (0, None) and runs[1]["status"] == 0, runs
    shown = " ".join(meshrun(tmp_path, "status", job_id, check=True).stdout.split())
    assert "1 restart(s) inside the allocation (n[1-2] -> n[1,3])" in shown and " 0+1 in job " in shown, shown
    assert row["restarts_in_job"] == 1, row
    (listed_row,) = [line for line in meshrun(tmp_path, "status", check=True).stdout.splitlines() if job_id in line]
    assert " 0+1 in job " in listed_row, listed_row  # the list of jobs counts it too
    # n2 is a suspect, with srun's word for the rank's end; n1, whose rank the kill took down with it, is not.
    listed = json.loads(meshrun(tmp_path, "nodes", "-c", "testbed", "--json", check=True).stdout)
    assert [s["node"] for s in listed] == ["n2"], listed
    assert listed[0]["evidence"].startswith("rank 1 ") and "SIGKILL" in listed[0]["evidence"], listed
    # The same job uninterrupted, without spares: each step's kept loss (its last line) is the same, bit for bit.
    at = args.index("resilience.spare_nodes=1")
    plain = args[: at - 1] + args[at + 1 :]  # without that --set and its value
    ref_id, ref_dir = submitted(meshrun(tmp_path, "submit", *plain, check=True))
    assert wait_for_state(tmp_path, ref_id, ENDED, timeout=240)["state"] == "COMPLETED"
    kept = {r["step"]: r["loss"] for r in metrics(run_dir)}  # a step trained again: its later line wins
    assert kept == {r["step"]: r["loss"] for r in metrics(ref_dir)}


def test_a_node_failing_its_health_check_is_replaced_by_the_spare_before_any_rank_starts(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    args = [*TWO_NODES, *SMALL_MODEL, "--set", "resources.nodes=1", "--set", "parallel.dp=1"]
    args += ["--set", "resilience.spare_nodes=1", "--set", "resilience.avoid_suspects=false"]
    args += ["--set", f"data.path={corpus}", "--set", "train.steps=4", "--set", "train.log_every=1"]
    out = meshrun(tmp_path, "submit", *args, env={"MESHRUN_TEST_HEALTH_FAIL": "n1"}, check=True)
    job_id, run_dir = submitted(out)
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=240)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 0, (row, batch)
    assert "health check failed on n1 (gpus: MESHRUN_TEST_HEALTH_FAIL" in batch, batch
    assert "the ranks start on n2 instead (spare nodes in its place)" in batch and "in-job" not in batch, batch
    assert [(a["rule"], a["node"]) for a in row["alerts"]] == [("node_unhealthy", "n1")], row[
        "alerts"
    ]  # status shows it
    runs = row["goodput"]["attempts"]
    assert [(a["in_job"], a["nodes"]) for a in runs] == [(0, "n2")], runs  # the end's record names the spare
    assert "(n2)" in (run_dir / "logs" / "rank-0.log").read_text()  # rank 0 ran on the spare
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


def test_a_hang_on_its_node_restarts_on_the_spare_inside_the_same_allocation(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    args = [*WIDE, *FAST_WATCH, "--set", "resilience.spare_nodes=1", "--set", "resilience.avoid_suspects=false"]
    args += ["--set", f"data.path={corpus}", "--set", "train.steps=30", "--set", "env.MESHRUN_TEST_HANG=1:25"]
    # Tiny steps take ~10 ms: 0.1 s more each lets the sidecar time them before the hang (its step timeout
    # then applies, not the setup's 20 minutes). Faults act on the allocation's first run only.
    args += ["--set", "env.MESHRUN_TEST_SLOW=1:0.1"]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=240)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 0, (row, batch)
    assert f"ranks exited with status {EXIT_NO_PROGRESS}" in batch, batch
    assert "restarting inside the allocation without n2 (hang verdict: " in batch, batch  # rank 1 hung on n2
    assert f"[meshrun] job {job_id} restart 0 in-job 1 on n1,n3 at " in batch, batch
    assert "REQUEUED" not in _sacct_states(testbed, job_id)
    assert "resuming from step 20" in (run_dir / "logs" / "rank-0.log").read_text()
    assert metrics(run_dir)[-1]["step"] == 30


def test_without_a_spare_the_job_requeues_without_the_node_and_new_submits_avoid_it_until_forgotten(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    args = [*WIDE, "--set", f"data.path={corpus}", "--set", "train.steps=24", "--set", "checkpoint.every=5"]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    _kill_rank_on("n2", run_dir, after_step=8)
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=300)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch)  # requeued once: no spare
    assert f"[meshrun] job {job_id} restart 1 on n[1,3] at " in batch, batch  # n2 left out of the requeued job
    assert "[meshrun] the requeued job leaves out n2 (rank 1 was killed by SIGKILL" in batch, batch
    assert "REQUEUED" in _sacct_states(testbed, job_id)
    assert metrics(run_dir)[-1]["step"] == 24
    # A new submit to the cluster leaves n2 out (the wide partition can spare it) until it is forgotten.
    rendered = meshrun(tmp_path, "render", *WIDE, check=True)
    assert "#SBATCH --exclude=n2" in rendered.stdout and "leaving out suspect node n2" in rendered.stderr
    forgetting = ["--set", "resilience.forget_after_h=0.0001"]  # 0.36 s
    assert "--exclude" not in meshrun(tmp_path, "render", *WIDE, *forgetting, check=True).stdout


def _kill_the_rank(run_dir: Path, saved_after: int, not_on: str = "") -> tuple[str, int]:
    """kill -9 the 1-rank job's rank once it runs on a node other than `not_on` and a checkpoint newer than step
    `saved_after` is complete (a save is asynchronous: a step logged is no checkpoint saved); (its node, that step)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        saved = read_state(RunDir(str(run_dir)).last_checkpoint).get("step")
        ranks = [(p, psutil.Process(p).environ().get("SLURMD_NODENAME", "")) for p in _rank_pids(run_dir)]
        running = [(p, node) for p, node in ranks if node != not_on]
        if isinstance(saved, int) and saved > saved_after and running:
            (pid, node), *_ = running
            os.kill(pid, signal.SIGKILL)
            return node, saved
        time.sleep(0.1)
    raise AssertionError(f"no rank of {run_dir} off {not_on or 'no node'} with a checkpoint after step {saved_after}")


def test_a_requeue_after_the_last_spare_leaves_out_both_nodes_and_asks_for_fewer(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    """1 node + 1 spare in `wide` (n1-n3). The rank's node is killed: the spare takes over; it is killed
    too: no spare left, the job requeues. It used to ask for 2 nodes again beside only the last one excluded, and
    could land on the node it had left first. The batch script's `scontrol update ExcNodeList= NumNodes=
    NumTasks=` makes the requeued job run on the third node alone, with one task, from its checkpoint."""
    args = [*TWO_NODES, *SMALL_MODEL, "--set", "resources.nodes=1", "--set", "parallel.dp=1"]
    args += ["--set", f"resources.partition={tb.WIDE_PARTITION}", "--set", "resilience.spare_nodes=1"]
    args += ["--set", "resilience.avoid_suspects=false", "--set", f"data.path={corpus}", "--set", "train.steps=40"]
    args += ["--set", "train.log_every=1", "--set", "checkpoint.every=5"]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    first, saved = _kill_the_rank(run_dir, saved_after=0)
    second, saved = _kill_the_rank(run_dir, saved_after=saved, not_on=first)  # the spare saved one of its own
    (third,) = {"n1", "n2", "n3"} - {first, second}
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=300)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch)  # the spare's restart, then a requeue
    assert f"[meshrun] job {job_id} restart 0 in-job 1 on {second} at " in batch, batch
    said = f"the requeued job leaves out {min(first, second)} ("
    assert said in batch and "it asks for 1 node instead of 2, its spares given up" in batch, batch
    assert f"{first} (left out of this allocation earlier)" in batch, batch
    assert f"[meshrun] job {job_id} restart 1 on {third} at " in batch, batch  # the requeued start, on n3 alone
    fields = slurm_job_fields(str(testbed["slurm_conf"]), job_id)
    assert (fields["NodeList"], fields["NumNodes"], fields["NumTasks"]) == (third, "1", "1"), fields
    assert set(expand_hostlist(fields["ExcNodeList"])) == {first, second}, fields
    assert "REQUEUED" in _sacct_states(testbed, job_id)
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps[-1] == 40 and sorted(set(steps)) == list(range(1, 41)), steps
    requeued = (run_dir / "logs" / "rank-0.log").read_text().split(f"({third}) job {job_id} restart 1 master")
    resumed = re.search(r"resuming from step (\d+)", requeued[-1])
    assert len(requeued) == 2 and resumed and int(resumed[1]) >= saved, requeued[-1]  # the spare's checkpoint
