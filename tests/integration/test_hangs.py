"""Hangs, end to end: one rank made to hang (launcher/testing/faults.py), found by the real sidecar, diagnosed
(its stack, its node), the job ended with exit 76; on the real Slurm testbed it is requeued and finishes."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS
from meshrun.launcher.contract.records.rundir import RunDir, node_name
from meshrun.launcher.contract.spec.job import read_run_spec
from tests.helpers.cli import (
    FAST_WATCH,
    SLOW_RANK_1,
    STRAGGLER_FACTOR,
    TINY,
    TWO_NODES,
    meshrun,
    metrics,
    submitted,
    wait_for_state,
    wait_for_step,
)

FLOOR_S = 3
"""watchdog.step_floor_s in FAST_WATCH: the step timeout is then ~FLOOR_S."""


def _verdict(run_dir: Path) -> dict[str, Any]:
    return json.loads(Path(RunDir(str(run_dir)).verdict_json).read_text())


def _rank(verdict: dict[str, Any], rank: int) -> dict[str, Any]:
    return next(r for r in verdict["ranks"] if r["rank"] == rank)


def test_local_hang_is_found_within_the_timeout_diagnosed_and_ends_with_76(tmp_path: Path, corpus: Path) -> None:
    args = [*TINY, "--set", f"data.path={corpus}", "--set", "train.steps=1000", *FAST_WATCH]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, "--set", "env.MESHRUN_TEST_HANG=1:80", check=True))
    wait_for_step(run_dir, 79)
    hung_at = time.monotonic()
    row = wait_for_state(tmp_path, job_id, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=120)
    ended_after = time.monotonic() - hung_at
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_NO_PROGRESS, row
    assert row["verdict"] and "inject_hang" in row["verdict"]["verdict"], row  # status carries the verdict

    verdict = _verdict(run_dir)
    node = node_name({})
    assert verdict["step"] == 80 and verdict["phase"] == "step" and verdict["found_by"] == node
    # Found within the timeout in force (a few tiny steps + the floor) plus the sidecar's 1 s tick.
    assert FLOOR_S <= verdict["timeout_s"] < FLOOR_S + 2, verdict
    assert verdict["silent_s"] < verdict["timeout_s"] + 2.5, verdict
    assert ended_after < 60, ended_after
    hung, waiting = _rank(verdict, 1), _rank(verdict, 0)
    assert hung["state"] == "stalled" and "inject_hang" in hung["where"] and "faults.py" in hung["where"], hung
    assert waiting["state"] == "collective", waiting
    assert hung["node"] == node and "Rank 1 " in verdict["verdict"], verdict["verdict"]
    stack = Path(RunDir(str(run_dir)).node_diagnosis(node), "rank-1.stack.txt").read_text()
    assert "inject_hang" in stack and "run_loop" in stack

    shown = meshrun(tmp_path, "status", job_id, check=True).stdout
    assert "inject_hang" in shown, shown
    diagnosis = meshrun(tmp_path, "logs", job_id, "--diagnosis", check=True).stdout
    assert "inject_hang" in diagnosis and "rank 1" in diagnosis.lower(), diagnosis


def test_testbed_hang_on_the_second_node_is_requeued_resumes_and_finishes(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    args = [
        *TWO_NODES,
        "--set",
        f"data.path={corpus}",
        "--set",
        "train.steps=80",
        "--set",
        "env.MESHRUN_TEST_HANG=1:50",
        *FAST_WATCH,
    ]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch)
    assert f"ranks exited with status {EXIT_NO_PROGRESS}" in batch and "requeueing: restart 1" in batch, batch
    # The requeue would leave out n2, the node the verdict blamed, but the job needs both of the partition's.
    assert "node(s) n2 stay in the requeued job: the partition cannot spare them beside the job's 2 nodes" in batch

    verdict = _verdict(run_dir)
    hung = _rank(verdict, 1)
    assert hung["node"] == "n2" and hung["state"] == "stalled" and "inject_hang" in hung["where"], verdict
    assert _rank(verdict, 0)["node"] == "n1" and _rank(verdict, 0)["state"] == "collective", verdict
    assert "n2" in verdict["verdict"] and "inject_hang" in verdict["verdict"], verdict["verdict"]
    for node in ("n1", "n2"):  # every node sent its part before anything was killed
        assert (Path(RunDir(str(run_dir)).node_diagnosis(node)) / "done.json").exists(), node
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "resuming from step 40" in rank0, rank0[-2000:]
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps[-1] == 80 and steps.count(41) == 2  # steps 41.. ran again after the resume from 40

    # Goodput: two starts; the steps the first trained past its last checkpoint (40) are the lost
    # ones; the parts add up to the allocated time, which is Slurm's own elapsed time of both runs.
    good = row["goodput"]
    redone = [r["step"] for r in metrics(run_dir) if r.get("restart_count") == 0 and r["step"] > 40]
    assert [a["restart"] for a in good["attempts"]] == [0, 1] and not good["running"], good
    assert good["lost_steps"] == len(redone) > 0, (good, redone)
    assert abs(sum(good["parts_s"].values()) - good["allocated_s"]) <= 0.01 * good["allocated_s"], good
    assert all(v >= 0 for v in good["parts_s"].values()) and 0 < good["effective_pct"] < 100, good
    assert good["parts_s"]["lost"] > 0 and good["requeue_s"] > 0, good
    elapsed = subprocess.run(
        ["sacct", "-X", "-D", "-n", "-P", "-o", "ElapsedRaw", "-j", job_id], capture_output=True, text=True, check=True
    ).stdout.split()
    assert abs(sum(map(int, elapsed)) - good["allocated_s"]) <= 3.0, (elapsed, good)
    assert "goodput: " in meshrun(tmp_path, "status", job_id, check=True).stdout

    # The verdict blamed n2: the cluster's ledger lists it, a new 1-node job leaves it out
    # (the 2-node partition can spare one node) and says so, until n2 is cleared.
    listed = meshrun(tmp_path, "nodes", "-c", "testbed", check=True).stdout
    ledger = Path(read_run_spec(run_dir).run.suspects_file)  # what the job wrote, should `nodes` not show it
    said = ledger.read_text() if ledger.exists() else f"{ledger}: gone"
    assert "n2" in listed and job_id in listed and "hang verdict: Hang at step" in listed, (listed, said)
    one_node = ["examples/two-node.yaml", "-c", "testbed", "--set", "resources.nodes=1", "--set", "parallel.dp=2"]
    rendered = meshrun(tmp_path, "render", *one_node, check=True)
    assert "#SBATCH --exclude=n2" in rendered.stdout and "leaving out suspect node n2" in rendered.stderr
    dry = meshrun(
        tmp_path, "submit", *one_node, "--set", f"data.path={corpus}", "--dry-run", check=True
    )  # the dry run reads it too
    assert "#SBATCH --exclude=n2" in dry.stdout and "leaving out suspect node n2" in dry.stderr, dry
    two_nodes = meshrun(tmp_path, "render", *TWO_NODES, check=True)
    assert "--exclude" not in two_nodes.stdout and "n2 kept in: the job needs 2" in two_nodes.stderr
    bare = meshrun(tmp_path, "nodes", "-c", "testbed", "--clear")  # argparse's usage error before
    assert bare.returncode == 2 and "--clear: '': name the node to trust again" in bare.stderr, bare.stderr
    assert "or --clear-all" in bare.stderr, bare.stderr
    cleared = meshrun(tmp_path, "nodes", "-c", "testbed", "--clear", "n1", "--clear-all", check=True).stdout
    assert "cleared n2: new submits to testbed may use it again" in cleared, cleared
    assert "n1 is not a suspect on testbed: nothing to clear" in cleared, cleared  # nothing claimed for n1
    assert "no suspect nodes on testbed" in meshrun(tmp_path, "nodes", "-c", "testbed", check=True).stdout
    assert "--exclude" not in meshrun(tmp_path, "render", *one_node, check=True).stdout


# A `command:` job that reports progress (meshrun.launcher.report) gets the same watch: rank 1 stops reporting.
REPORTING_SCRIPT = """
import os, time
from meshrun.launcher.report import report

def wait_for_peer():  # rank 1: stuck in the user's own code
    while True:
        time.sleep(1)

def all_reduce():  # rank 0: waits for rank 1 in what stands for a collective
    while True:
        time.sleep(1)

rank = int(os.environ["RANK"])
for step in range(1, 10_000):
    report(step, loss=1.0 / step)
    if step == 40:
        wait_for_peer() if rank == 1 else all_reduce()
    time.sleep(0.05)
"""


def test_a_command_job_that_reports_progress_is_watched_too(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(REPORTING_SCRIPT)
    args = ["examples/command.yaml", "-c", "local", "--set", f"command=[python3, {script}]", *FAST_WATCH[:4]]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    row = wait_for_state(tmp_path, job_id, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=120)
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_NO_PROGRESS, row
    verdict = _verdict(run_dir)
    hung = _rank(verdict, 1)
    assert hung["state"] == "stalled" and "wait_for_peer" in hung["where"] and "train.py" in hung["where"], hung
    assert _rank(verdict, 0)["state"] == "collective", verdict


def test_a_straggler_is_named_in_its_file_and_in_status(tmp_path: Path, corpus: Path) -> None:
    args = [*TINY, "--set", f"data.path={corpus}", "--set", "train.steps=100000", *FAST_WATCH]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, *SLOW_RANK_1, check=True))
    found = Path(RunDir(str(run_dir)).stragglers)
    deadline = time.monotonic() + 90
    try:
        while not (found.exists() and json.loads(found.read_text() or "{}").get("stragglers")):
            assert time.monotonic() < deadline, "no straggler named"
            time.sleep(0.5)
        (straggler,) = json.loads(found.read_text())["stragglers"]
        assert straggler["rank"] == 1 and straggler["ratio"] > STRAGGLER_FACTOR, straggler
        shown = meshrun(tmp_path, "status", job_id, check=True).stdout
        assert "stragglers: rank 1" in shown, shown
        assert "straggler: rank 1" in Path(RunDir(str(run_dir)).sidecar_log(node_name({}))).read_text().lower()
    finally:
        meshrun(tmp_path, "cancel", job_id)
        wait_for_state(tmp_path, job_id, {"CANCELLED", "FAILED", "COMPLETED"})  # its processes gone with it
