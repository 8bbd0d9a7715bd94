"""The testbed itself behaves like a real multi-node GPU Slurm cluster with a login node over ssh."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

# sacct trails squeue by 1-3 s.
SACCT_TIMEOUT_S = 15.0


def run(*argv: str, timeout_s: float = 60.0) -> str:
    """Run a Slurm client (SLURM_CONF comes from the testbed fixture); return its stdout."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert res.returncode == 0, f"{' '.join(argv)} failed ({res.returncode}): {res.stderr}"
    return res.stdout


def sbatch(tmp_path: Path, script: str, *options: str) -> str:
    """Submit script; return the job id. Output goes to tmp_path/job.out."""
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n" + script)
    return (
        run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/job.out", *options, str(path))
        .strip()
        .split(";")[0]
    )


def sacct_state(job_id: str) -> str | None:
    """The job's own accounting row state (not its steps'), or None while sacct does not know it."""
    out = run("sacct", "--parsable2", "-j", job_id, "-o", "JobID,State")
    rows = dict(line.split("|", 1) for line in out.splitlines()[1:] if "|" in line)
    return rows.get(job_id)


def wait_sacct_state(job_id: str, prefix: str) -> str:
    deadline = time.monotonic() + SACCT_TIMEOUT_S
    while True:
        state = sacct_state(job_id)
        if state is not None and state.startswith(prefix) or time.monotonic() > deadline:
            return str(state)
        time.sleep(0.25)


def wait_node_states(want: str, timeout_s: float = 15.0) -> dict[str, tuple[str, str]]:
    """{node: (state, gres)} once every node is in state want (or the last seen after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = run("sinfo", "-h", "-N", "-o", "%N %t %G")
        nodes = {n: (s, g) for n, s, g in (line.split() for line in out.splitlines())}
        if all(s == want for s, _ in nodes.values()) or time.monotonic() > deadline:
            return nodes
        time.sleep(0.25)


def test_nodes_idle_with_two_gpus(testbed: dict) -> None:
    # n1 and n2 (the default partition) and n3 (only in `wide`: the spare of a 2-node job)
    assert wait_node_states("idle") == {"n1": ("idle", "gpu:2"), "n2": ("idle", "gpu:2"), "n3": ("idle", "gpu:2")}


@pytest.fixture(scope="module")
def two_node_job(testbed: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(job id, output) of a 2 nodes x 2 tasks job whose tasks print their Slurm identity."""
    tmp_path = tmp_path_factory.mktemp("two_node_job")
    job_id = sbatch(
        tmp_path,
        "srun bash -c 'echo \"$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURMD_NODENAME\"'\n",
        "--nodes=2",
        "--ntasks-per-node=2",
        "--wait",
    )
    return job_id, (tmp_path / "job.out").read_text()


def test_two_node_job_gets_ranks_across_nodes(two_node_job: tuple[str, str]) -> None:
    _, output = two_node_job
    ranks = {tuple(line.split()) for line in output.splitlines()}
    assert ranks == {("0", "0", "0", "n1"), ("1", "1", "0", "n1"), ("2", "0", "1", "n2"), ("3", "1", "1", "n2")}


def test_sacct_reports_completed(two_node_job: tuple[str, str]) -> None:
    job_id, _ = two_node_job
    assert wait_sacct_state(job_id, "COMPLETED") == "COMPLETED"


def test_gpus_per_node_sets_cuda_visible_devices(testbed: dict, tmp_path: Path) -> None:
    sbatch(tmp_path, 'echo "CVD=$CUDA_VISIBLE_DEVICES"\n', "--nodes=1", "--gpus-per-node=2", "--wait")
    assert (tmp_path / "job.out").read_text().strip() == "CVD=0,1"


def test_scancel_ends_cancelled(testbed: dict, tmp_path: Path) -> None:
    job_id = sbatch(tmp_path, "sleep 300\n")
    deadline = time.monotonic() + 15.0
    while run("squeue", "-h", "-j", job_id, "-o", "%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.2)
    run("scancel", job_id)
    # sacct writes "CANCELLED by 0" (the uid that cancelled it).
    assert wait_sacct_state(job_id, "CANCELLED").startswith("CANCELLED")


def ssh_client(known_hosts: str) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return client


def connect(client: paramiko.SSHClient, ssh: dict) -> None:
    client.connect(
        ssh["host"],
        port=ssh["port"],
        username=ssh["user"],
        key_filename=ssh["identity_file"],
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )


def test_ssh_login_reaches_slurm(testbed: dict) -> None:
    ssh = testbed["ssh"]
    client = ssh_client(ssh["known_hosts"])
    try:
        connect(client, ssh)
        # squeue --version needs no config; listing the queue does: it proves SetEnv SLURM_CONF.
        _, stdout, stderr = client.exec_command(
            'squeue --version && squeue -h -o %i && echo "SLURM_CONF=$SLURM_CONF"', timeout=30
        )
        out = stdout.read().decode()
        assert stdout.channel.recv_exit_status() == 0, stderr.read().decode()
    finally:
        client.close()
    assert re.match(r"slurm(-wlm)? \d+\.\d+", out), out  # Debian says "slurm-wlm 22.05.8"
    assert f"SLURM_CONF={testbed['slurm_conf']}" in out


def test_ssh_unknown_host_key_is_refused(testbed: dict, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    client = ssh_client(str(empty))
    try:
        with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
            connect(client, testbed["ssh"])
    finally:
        client.close()
