"""The sidecar in real jobs: one per local job, one per node of a 2-node Slurm testbed job. Each writes host
samples to gpu.jsonl (no NVML on this machine), its node's env record and its log, and is gone when the job ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import psutil

from meshrun.launcher.contract.records import ckptdir, lost
from meshrun.launcher.contract.records.rundir import RunDir, node_name
from tests.helpers.cli import TINY, TWO_NODES, meshrun, metrics, status, submitted, trials, wait_for_state

SHORT = ["--set", "sidecar.interval_s=0.3", "--set", "resources.tasks_per_node=1"]
# Long enough for several samples at 0.3 s once the sidecar has started (it imports tensorboard: ~1 s).
COMMAND = ["--set", "command=python3,-c,import time; time.sleep(4)"]


def sidecars_of(run_dir: Path) -> list[int]:
    """Live processes running `meshrun.launcher.sidecar RUN_DIR` (this machine hosts every testbed node)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"meshrun.launcher.sidecar" in argv and str(run_dir).encode() in argv and state not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def check_sidecar_outputs(run_dir: Path, nodes: list[str]) -> None:
    rd = RunDir(str(run_dir))
    lines = [json.loads(line) for line in Path(rd.gpu_metrics).read_text().splitlines()]
    for node in nodes:
        host = [l for l in lines if l["node"] == node and l["kind"] == "host"]
        assert len(host) >= 2, f"{node}: {len(host)} host samples in {lines}"
        assert any("cpu_pct" in l for l in host) and all(l["mem_total_mib"] > 0 for l in host)
        record = json.loads(Path(rd.env_record(node)).read_text())
        assert record["node"] == node and record["meshrun"] and record["torch"] and record["driver"] is None
        log = Path(rd.sidecar_log(node)).read_text()
        assert "host CPU, memory and disk I/O only" in log or "the job has no GPUs here" in log, log
        assert "stopping: stop requested" in log and "error" not in log.lower(), log
        assert list(Path(rd.sidecar_tensorboard(node)).glob("events.out.tfevents.*")), node
    assert sorted(p.stem for p in (run_dir / "env").glob("*.json")) == sorted(nodes)


def test_a_local_job_has_one_sidecar_that_ends_with_it(tmp_path: Path) -> None:
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "local", *SHORT, *COMMAND, "--wait", check=True)
    job_id, run_dir = submitted(out)
    assert f"job {job_id} COMPLETED" in out.stdout
    check_sidecar_outputs(run_dir, [node_name({})])
    assert sidecars_of(run_dir) == []


def test_a_two_node_slurm_job_has_a_sidecar_per_node_gone_when_the_ranks_end(testbed: dict, tmp_path: Path) -> None:
    out = meshrun(
        tmp_path,
        "submit",
        "examples/command.yaml",
        "-c",
        "testbed",
        "--set",
        "resources.nodes=2",
        *SHORT,
        # 4 ranks x 1 CPU fill each testbed node: the ranks' step must still start beside the sidecar's
        # (without --overlap it would wait for the sidecar's CPU, and the sidecar waits for the ranks).
        "--set",
        "resources.tasks_per_node=4",
        *COMMAND,
        "--wait",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert f"job {job_id} COMPLETED" in out.stdout
    check_sidecar_outputs(run_dir, ["n1", "n2"])
    assert sidecars_of(run_dir) == []
    # No step of the job is left: the sidecar's srun ended with the ranks, not at the time limit.
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job_id], capture_output=True, text=True).stdout
    assert steps.strip() == "", steps
    batch = meshrun(tmp_path, "logs", job_id, "--batch", check=True).stdout
    assert "ranks exited with status 0" in batch and "srun: error" not in batch, batch
    # The batch shell did not wait out the sidecar's SIGKILL grace: it stopped on SIGTERM.
    assert "Killed" not in batch, batch


# --- A dead sidecar ---------------------------------------------------------------------------------------------------

SAVING = ["--set", "checkpoint.every=5", "--set", "checkpoint.keep=2", "--set", "sidecar.interval_s=0.5"]


def kept_sidecars(run_dir: Path, node: str = "") -> tuple[list[int], list[int]]:
    """(keepers, sidecars) of RUN_DIR (on NODE when given): a sidecar is a keeper's child, with
    MESHRUN_SIDECAR_KEPT in its environment."""
    keepers, kept = [], []
    for pid in sidecars_of(run_dir):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if node and f"SLURMD_NODENAME={node}".encode() not in env:
            continue
        (kept if any(e.startswith(b"MESHRUN_SIDECAR_KEPT=") for e in env) else keepers).append(pid)
    # A sidecar's own forked children (its checkpoint copier) share its command line and environment: not them.
    return keepers, [pid for pid in kept if _parent(pid) not in kept]


def _parent(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return 0


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def newest_step(run_dir: Path) -> int:
    rows = metrics(run_dir)
    return rows[-1]["step"] if rows else 0


def complete(run_dir: Path) -> list[int]:
    return ckptdir.complete_steps(Path(lost.checkpoint_dir_of(str(run_dir))))


def test_a_killed_local_sidecar_is_started_again_and_no_checkpoint_is_lost(tmp_path: Path, corpus: Path) -> None:
    steps = 30
    args = [*TINY, "--set", f"data.path={corpus}", "--set", f"train.steps={steps}", *SAVING]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_until(lambda: newest_step(run_dir) >= 12 and kept_sidecars(run_dir)[1] != [], "no training")
    (victim,) = kept_sidecars(run_dir)[1]
    os.kill(victim, signal.SIGKILL)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED"})
    assert row["state"] == "COMPLETED" and row["alerts"] == [], row
    assert complete(run_dir)[-1] == steps and row["progress"]["checkpoint_step"] == steps, complete(run_dir)
    log = Path(RunDir(str(run_dir)).sidecar_log(node_name({}))).read_text()
    assert f"the sidecar (pid {victim}) ended (killed by SIGKILL) while the job runs: starting it again" in log
    assert "lost" not in log and sidecars_of(run_dir) == []


def test_a_sidecar_dead_for_good_fails_the_job_names_the_lost_steps_and_export_says_which_it_used(
    tmp_path: Path, corpus: Path
) -> None:
    steps = 30
    args = [*TINY, "--set", f"data.path={corpus}", "--set", f"train.steps={steps}", *SAVING]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_until(lambda: complete(run_dir) != [] and newest_step(run_dir) >= 12, "no complete checkpoint")
    keepers, kept = kept_sidecars(run_dir)
    os.kill(keepers[0], signal.SIGKILL)  # the keeper first, so nothing starts its sidecar again
    os.kill(kept[0], signal.SIGKILL)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED"})
    newest = complete(run_dir)[-1]
    assert newest < steps and row["state"] == "FAILED" and row["exit_code"] == 1, row
    assert "never reached shared storage" in row["reason"] and f"{steps}" in row["reason"], row
    assert [a["rule"] for a in row["alerts"]] == ["checkpoint_lost"] and row["alerts"][0]["step"] == steps, row
    assert row["progress"]["checkpoint_step"] == newest  # CKPT: what is complete on shared storage
    out = meshrun(tmp_path, "export", job_id, "-o", str(tmp_path / "w.safetensors"), check=True).stdout
    assert f"this uses step {newest}: the job's last checkpoint, step {steps}, never became complete" in out, out
    resumed = meshrun(tmp_path, "resume", job_id, check=True).stdout
    assert f"this uses step {newest}" in resumed, resumed
    second = resumed.split(" as job ")[1].split()[0]  # training the lost steps again: the Slurm test's part
    meshrun(tmp_path, "cancel", second, check=True)
    assert wait_for_state(tmp_path, second, {"CANCELLED", "FAILED", "COMPLETED"})["state"] == "CANCELLED"


def test_a_killed_local_supervisor_leaves_its_ranks_training_until_cancelled_and_elapsed_stops(
    tmp_path: Path, corpus: Path
) -> None:
    """README's orphan flow with the trainer and scratch staging: the sidecar no longer removes the node's
    scratch folder under the ranks; status says orphaned, resume refuses, cancel stops them, ELAPSED ends."""
    args = [*TINY, "--set", f"data.path={corpus}", "--set", "train.steps=100000", *SAVING]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_until(lambda: newest_step(run_dir) >= 8, "no training")
    state = json.loads((run_dir / ".meshrun" / "jobs" / f"{job_id}.json").read_text())
    os.kill(state["supervisor_pid"], signal.SIGKILL)
    killed_at = newest_step(run_dir)
    wait_until(lambda: newest_step(run_dir) >= killed_at + 10, "the ranks stopped training without their supervisor")
    row = status(tmp_path, job_id)
    assert row["state"] == "RUNNING" and "orphaned" in row["reason"], row
    resumed = meshrun(tmp_path, "resume", job_id)
    assert resumed.returncode == 2 and "still RUNNING" in resumed.stderr, resumed.stderr
    meshrun(tmp_path, "cancel", job_id, check=True)
    row = wait_for_state(tmp_path, job_id, {"CANCELLED", "FAILED"})
    assert row["state"] == "CANCELLED", row
    wait_until(lambda: sidecars_of(run_dir) == [], "the sidecar outlived its ranks")
    time.sleep(1.5)
    assert status(tmp_path, job_id)["elapsed_s"] == row["elapsed_s"]  # no longer counting
    ranks = " ".join(Path(RunDir(str(run_dir)).rank_log(r)).read_text() for r in (0, 1))
    assert "No such file or directory" not in ranks, ranks[-2000:]


def test_a_killed_sidecar_on_the_second_slurm_node_is_started_again_and_no_checkpoint_is_lost(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    """A dead sidecar where it happened: two nodes, saves staged on each node's scratch, n2's sidecar
    killed with -9 mid-run. Its keeper starts it again; every later step reaches shared storage, the job
    does not wait out sidecar.final_copy_s (300 s, longer than this test waits), no checkpoint_lost alert."""
    steps = 30
    args = [*TWO_NODES, "--set", f"data.path={corpus}", "--set", f"train.steps={steps}", "--set", "train.log_every=1"]
    args += ["--set", "train.eval_every=0", *SAVING]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_until(lambda: newest_step(run_dir) >= 12 and kept_sidecars(run_dir, "n2")[1] != [], "no training", 180)
    (victim,) = kept_sidecars(run_dir, "n2")[1]
    os.kill(victim, signal.SIGKILL)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED"}, timeout=200)
    assert row["state"] == "COMPLETED" and row["alerts"] == [], row
    assert complete(run_dir)[-1] == steps and row["progress"]["checkpoint_step"] == steps, complete(run_dir)
    log = Path(RunDir(str(run_dir)).sidecar_log("n2")).read_text()
    assert f"the sidecar (pid {victim}) ended (killed by SIGKILL) while the job runs: starting it again" in log, log
    assert "is lost" not in log + Path(RunDir(str(run_dir)).sidecar_log("n1")).read_text()
    assert sidecars_of(run_dir) == []


def test_a_slurm_job_whose_sidecar_dies_for_good_is_requeued_and_trains_the_lost_steps_again(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    """n2's keeper and sidecar both killed: nothing copies n2's parts any more, so the ranks finish (exit 0)
    with steps only on scratch. Node 0's sidecar stops waiting for them once n2's liveness stamp is stale
    (not sidecar.final_copy_s, 300 s); the batch script's end-of-run check makes the run a failure with a
    checkpoint_lost alert; the requeue resumes from the newest complete checkpoint and saves the rest."""
    steps = 30
    args = [*TWO_NODES, "--set", f"data.path={corpus}", "--set", f"train.steps={steps}", "--set", "train.log_every=1"]
    args += ["--set", "train.eval_every=0", *SAVING]  # sidecar.final_copy_s: 300 s, not waited out
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, check=True))
    wait_until(lambda: complete(run_dir) != [] and newest_step(run_dir) >= 12, "no complete checkpoint", 180)
    keepers, kept = kept_sidecars(run_dir, "n2")
    os.kill(keepers[0], signal.SIGKILL)
    os.kill(kept[0], signal.SIGKILL)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED"}, timeout=300)
    assert row["state"] == "COMPLETED" and row["restarts"] == 1 and complete(run_dir)[-1] == steps, row
    assert [a["rule"] for a in row["alerts"]] == ["checkpoint_lost"] and row["alerts"][0]["step"] == steps, row
    batch = meshrun(tmp_path, "logs", job_id, "--batch", check=True).stdout
    assert "requeueing: restart 1" in batch and "finished (exit 0): not requeueing" in batch, batch
    n1 = Path(RunDir(str(run_dir)).sidecar_log("n1")).read_text()
    assert "node rank(s) 1 stopped copying: not waiting for their parts" in n1, n1


def test_a_cancel_before_the_ranks_beat_loses_no_checkpoint(tmp_path: Path, corpus: Path) -> None:
    """The local cluster stages checkpoints on scratch. A cancel in the ranks' first seconds reaches the
    sidecar before any heartbeat: it must wait for the ranks to start, save on the TERM and end, then copy
    their checkpoint (it stopped at once and the checkpoint was lost, 2 times in 3)."""
    for trial in range(trials(2, soak=10)):
        home = tmp_path / f"t{trial}"
        args = [*TINY, "--set", f"data.path={corpus}", "--set", "train.steps=100000", "--set", "checkpoint.every=1000"]
        job_id, run_dir = submitted(meshrun(home, "submit", *args, check=True))
        rank_log = run_dir / "logs" / "rank-0.log"
        deadline = time.monotonic() + 60
        while not rank_log.exists():  # the ranks have started (their banner), and are importing torch
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        meshrun(home, "cancel", job_id, check=True)
        row = wait_for_state(home, job_id, {"CANCELLED", "FAILED", "COMPLETED"})
        assert row["state"] == "CANCELLED", row
        alerts = (run_dir / "alerts.jsonl").read_text() if (run_dir / "alerts.jsonl").exists() else ""
        assert "checkpoint_lost" not in alerts, (trial, alerts)
        log = rank_log.read_text()
        assert "checkpoint saved" in log, log[-1500:]  # they started, trained a step, saved on the TERM
        assert ckptdir.complete_steps(run_dir / "checkpoints"), (trial, log[-1500:])  # ... on shared storage
