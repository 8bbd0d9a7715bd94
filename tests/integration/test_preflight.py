"""Preflight on the real Slurm testbed, from a laptop over SSH: a job that would die in its
first second is refused before it queues, in one line per problem, exit 2, in one SSH connection, and Slurm
never sees a job (sacct lists none of its name). A job that would start is told when."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import yaml

from tests.helpers import sshbed
from tests.helpers.cli import TWO_NODES, meshrun, status, submitted


def _profile(tmp_path: Path, **changes: object) -> Path:
    """The SSH profile, with `changes` to its top-level keys (setup, partitions...)."""
    path = sshbed.profile(tmp_path)
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _sacct_names(name: str) -> list[str]:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobName", "--name", name, "-S", "now-1hour"], capture_output=True, text=True
    )
    return [line for line in out.stdout.split() if line]


def _refused(tmp_path: Path, profile: Path, *sets: str) -> str:
    """`meshrun submit` of the two-node example with `sets`: refused by the preflight; its stderr."""
    name = f"pf-{uuid.uuid4().hex[:8]}"
    args = [TWO_NODES[0], "-c", str(profile), *TWO_NODES[3:], "--set", f"name={name}", *sets]
    before = sshbed.logins()
    out = sshbed.meshrun(tmp_path, "submit", *args)
    assert out.returncode == 2 and out.stdout == "", out
    lines = out.stderr.splitlines()
    assert lines[-1] == "meshrun: error: nothing was queued (`--no-check` skips these checks)", out.stderr
    assert all(line.startswith("meshrun: error: preflight: ") for line in lines[:-1]) and len(lines) >= 2, lines
    assert sshbed.logins() - before == 1  # the whole submit, the preflight included, in one connection
    assert _sacct_names(name) == []  # Slurm never saw it
    return out.stderr


def test_preflight_refuses_what_would_die_at_once_and_queues_nothing(
    testbed: dict, tmp_path: Path, default_corpus: Path
) -> None:
    profile = _profile(tmp_path)
    # A data file this laptop has, the cluster (its home) not.
    here = tmp_path / "only-here.u16"
    here.write_bytes(b"\0" * 1024)
    said = _refused(tmp_path, profile, "--set", "data.path=~/meshrun-preflight-nowhere/tokens.u16")
    assert (
        "preflight: files: data.path: " in said
        and "/meshrun-preflight-nowhere/tokens.u16 is not on the cluster" in said
    )
    # A setup line that breaks the interpreter: the venv's activation replaced by one that does not exist.
    broken = _profile(tmp_path, setup=["source /nonexistent/venv/bin/activate"], python="/nonexistent/bin/python")
    said = _refused(tmp_path, broken)
    assert "preflight: environment: `/nonexistent/bin/python` after the profile's setup lines failed" in said, said
    assert "setup[0] (source /nonexistent/venv/bin/activate) failed" in said, said
    # A partition the profile names and Slurm does not have; a node count above what Slurm's partition has.
    shape = {"gpus_per_node": 2, "cpus_per_node": 4, "memory_gb": 2, "max_time": "1-00:00:00"}
    ghost = _profile(tmp_path, partitions=[{"name": "ghost", "max_nodes": 2, "default": True, **shape}])
    said = _refused(tmp_path, ghost)
    assert "preflight: slurm: Slurm refuses the request: Invalid partition name specified" in said, said
    wider = _profile(tmp_path, partitions=[{"name": "debug", "max_nodes": 3, "default": True, **shape}])
    three = ["--set", "resources.nodes=3", "--set", "parallel.dp=3", "--set", "train.global_batch=12"]
    said = _refused(tmp_path, wider, *three)
    assert "preflight: slurm: Slurm refuses the request: Requested node configuration is not available" in said
    # More memory than Slurm knows the nodes have (the profile says 2 GB; slurm.conf, 2000 MB).
    said = _refused(tmp_path, profile, "--set", "resources.memory_gb=2")
    assert "preflight: slurm: Slurm refuses the request: Requested node configuration is not available" in said


def test_check_alone_says_when_the_job_would_start_and_submits_nothing(
    testbed: dict, tmp_path: Path, default_corpus: Path
) -> None:
    name = f"pf-{uuid.uuid4().hex[:8]}"
    profile = _profile(tmp_path)
    args = [TWO_NODES[0], "-c", str(profile), *TWO_NODES[3:], "--set", f"name={name}", "--check"]
    out = sshbed.meshrun(tmp_path, "submit", *args)
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ok    slurm       Slurm can run it: on n[1-2] in debug, estimated start 20"), lines
    assert [line.split()[1] for line in lines] == ["slurm", "files", "environment", "space", "code"], lines
    assert lines[-1].startswith("ok    code        snapshot "), lines  # on the cluster already, or to upload
    assert out.stderr.endswith("nothing was queued; the job would start\n") and _sacct_names(name) == []
    # A sweep is checked first too (`--sweep ... --check` was once refused): its array's test-only.
    out = sshbed.meshrun(tmp_path, "submit", *args, "--sweep", "train.lr=1e-3,3e-4")
    assert out.returncode == 0 and out.stdout.startswith("ok    slurm       Slurm can run it"), out
    assert out.stderr.endswith("nothing was queued; the job array (2 tasks) would start\n"), out.stderr
    assert _sacct_names(name) == []


def test_any_cluster_goes_where_the_job_starts_first_and_says_why(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    """Two profiles over the same Slurm: one only its `debug` partition (n1, n2), kept busy by a long job; the
    other only `wide` (n1-n3), where a one-node job starts at once on n3. `-c A,B` asks both, shows both
    estimates, and submits to `wide`; status says why."""
    base = yaml.safe_load(Path("cluster_configs/testbed.yaml").read_text())
    files = []
    for name, partition in (("busy", "debug"), ("idle", "wide")):
        data = {**base, "partitions": [{**p, "default": True} for p in base["partitions"] if p["name"] == partition]}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        files.append(str(path))
    hold = subprocess.run(
        # --exclusive: whole nodes (one task a node would leave 3 of their 4 CPUs, where the job fits at once)
        [
            "sbatch",
            "--parsable",
            "-p",
            "debug",
            "-N",
            "2",
            "--exclusive",
            "-t",
            "10",
            "--job-name=pf-hold",
            "--output=/dev/null",  # not slurm-JOB.out in the checkout (four of them were committed once)
            "--wrap",
            "sleep 600",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        # Busy only once the holding job runs: while it is still pending, debug looks free and both estimates are
        # "now" (seen on a loaded machine, where slurmctld's scheduling pass came later)
        deadline = time.monotonic() + 60
        while _squeue_state(hold) != "RUNNING":
            assert time.monotonic() < deadline, f"the holding job {hold} never ran: {_squeue_state(hold)}"
            time.sleep(0.5)
        one_node = ["--set", "resources.nodes=1", "--set", "parallel.dp=2", "--set", "train.steps=2"]
        one_node += ["--set", f"data.path={corpus}"]
        out = meshrun(tmp_path, "submit", "examples/two-node.yaml", "-c", ",".join(files), *one_node, check=True)
        table = out.stderr.splitlines()
        busy = next(line for line in table if line.startswith("busy "))
        idle = next(line for line in table if line.startswith("idle "))
        assert "debug" in busy and "Slurm's estimate: 20" in busy and "wide" in idle and "Slurm's estimate" in idle
        assert busy.split()[2] > idle.split()[2], table  # debug starts only when the holding job ends
        header = next(line for line in table if line.startswith("CLUSTER "))
        assert header.split()[:7] == ["CLUSTER", "PARTITION", "STARTS", "STEP", "FINISH", "FREE", "WHY"], table
        assert busy.split()[3:5] == ["?", "?"], table  # fake GPUs: no peak, no step time (said, not guessed)
        # sinfo's idle nodes: the holding job has debug's two; wide's third node, n3, is free
        assert (busy.split()[5], idle.split()[5]) == ("0", "1"), table
        assert "# chose idle, partition wide: soonest of 2 asked (busy/debug, idle/wide): the soonest start;" in (
            out.stderr
        ), out.stderr
        job_id, _ = submitted(out)
        row = status(tmp_path, job_id)
        assert row["cluster"] == "idle" and "soonest of 2 asked (busy/debug, idle/wide)" in row["chosen"], row
        shown = meshrun(tmp_path, "status", job_id, check=True).stdout
        assert "chosen: soonest of 2 asked" in shown, shown
    finally:
        subprocess.run(["scancel", hold], check=False)


def _squeue_state(job_id: str) -> str:
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return done.stdout.strip()
