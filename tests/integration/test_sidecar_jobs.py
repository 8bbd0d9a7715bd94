"""The sidecar in real jobs: one per local job, one per node of a 2-node Slurm testbed job. Each writes host
samples to gpu.jsonl (no NVML on this machine), its node's env record and its log, and is gone when the job ends."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from launcher.rundir import RunDir, node_name
from tests.integration.cli import meshrun, submitted

SHORT = ["--set", "sidecar.interval_s=0.3", "--set", "resources.tasks_per_node=1"]
# Long enough for several samples at 0.3 s once the sidecar has started (it imports tensorboard: ~1 s).
COMMAND = ["--set", "command=python3,-c,import time; time.sleep(4)"]


def sidecars_of(run_dir: Path) -> list[int]:
    """Live processes running `launcher.sidecar RUN_DIR` (this machine hosts every testbed node)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"launcher.sidecar" in argv and str(run_dir).encode() in argv and state not in ("Z", "X"):
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
