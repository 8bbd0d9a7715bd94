"""meshrun against the real Slurm testbed (slurmctld, two slurmd, slurmdbd): submit, status, logs, cancel."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.errors import InputError
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers.render import render
from meshrun.submit.schedulers.slurm import BACKEND as SLURM
from tests.helpers.builders import hostile
from tests.helpers.cli import REPO, meshrun, metrics, status, submitted

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Examples sized for another machine, and the key the testbed (2 nodes x 4 CPUs, 2 fake GPUs) refuses.
SIZED_ELSEWHERE = {
    "h100-8node": "resources.gpus_per_node",  # a real 8-node H100 cluster
    "gpt-3d": "resources.cpus_per_task",
}  # 8 ranks on one node of `local`


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_sbatch_test_only_accepts_every_example(testbed: dict, tmp_path: Path, example: Path) -> None:
    try:
        plan = plan_file(example, load_profile("testbed"), home=str(tmp_path), run_dir=str(tmp_path / "run"))
    except InputError as exc:
        assert SIZED_ELSEWHERE.get(example.stem) == exc.key, exc
        return
    script = tmp_path / "job.sbatch"
    script.write_text(render(plan, SLURM))
    (tmp_path / "run" / "logs").mkdir(parents=True)
    done = subprocess.run(
        ["sbatch", "--test-only", f"--job-name={plan.spec.name}", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr


def test_two_nodes_four_ranks_train_together(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    out = meshrun(
        tmp_path,
        "submit",
        "examples/two-node.yaml",
        "-c",
        "testbed",
        "--set",
        f"data.path={corpus}",
        "--set",
        "train.steps=10",
        "--set",
        "train.log_every=1",
        "--wait",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert job_id.isdigit() and f"job {job_id} COMPLETED" in out.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[-1]["loss"] < rows[0]["loss"]
    logs = {r: (run_dir / "logs" / f"rank-{r}.log").read_text() for r in range(4)}
    for rank, text in logs.items():
        assert f"rank {rank}/4" in text, text  # every rank joined the same 4-rank group
    row = status(tmp_path, job_id)
    assert row["state"] == "COMPLETED" and row["cluster"] == "testbed" and row["progress"]["step"] == 10
    batch = meshrun(tmp_path, "logs", job_id, "--batch", check=True).stdout
    assert f"[meshrun] job {job_id} restart 0 on n[1-2]" in batch and "ranks exited with status 0" in batch


# A small GPT for 3D layouts on 2 nodes x 2 CPU ranks: 2 layers (1 per stage at pp=2), 4 heads and a
# vocabulary of 256 (both split by tp=2), 64 tokens (split by sequence parallelism at tp=2);
# global batch 16 = micro 4 x dp 2 x accumulation 2 (at pp=2: 2 pipeline micro-batches). A failure
# must fail the test at once, not come back as requeues: checkpoint.max_requeues 0. One OpenMP thread per rank:
# nothing sets OMP_NUM_THREADS on the ranks, and 4 ranks x torch's default 2 threads on 2 cores spin
# in libgomp barriers inside MKL's sgemm (tp=2 steps measured 4x slower: ~2.2 s against 0.5 s).
LAYOUT_STEPS = 8
SMALL_3D = [
    "train.model.n_layers=2",
    "train.model.d_model=64",
    "train.model.n_heads=4",
    "train.model.vocab_size=256",
    "train.model.seq_len=64",
    "train.global_batch=16",
    "train.micro_batch=4",
    f"train.steps={LAYOUT_STEPS}",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "train.log_every=1",
    f"train.eval_every={LAYOUT_STEPS}",
    "train.eval_sequences=16",
    "checkpoint.max_requeues=0",
    "env.OMP_NUM_THREADS=1",
]
BANNER = re.compile(r"\[meshrun\] rank (\d+)/4 local \d+/2 node \d+/2 \((\w+)\)")


def _train_layout(tmp_path: Path, corpus: Path, dims: ParallelDims, extra: list[str]) -> str:
    """Submit the small GPT with layout `dims` to the testbed, wait, check it all; returns rank 0's log."""
    layout = [f"parallel.dp={dims.dp}", f"parallel.tp={dims.tp}", f"parallel.pp={dims.pp}", *extra]
    sets = [arg for kv in [f"data.path={corpus}", *SMALL_3D, *layout] for arg in ("--set", kv)]
    started = time.monotonic()
    out = meshrun(tmp_path, "submit", "examples/two-node.yaml", "-c", "testbed", *sets, "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert f"job {job_id} COMPLETED" in out.stdout
    print(f"{' '.join(layout)}: {time.monotonic() - started:.1f} s")  # shown with pytest -s
    rows = metrics(run_dir)
    # metrics.jsonl is complete: every step, finite, with a validation loss at the end; the loss fell.
    assert [r["step"] for r in rows] == list(range(1, LAYOUT_STEPS + 1)), rows
    assert all(r["loss"] is not None and r["grad_norm"] is not None and r["data_wait_s"] >= 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2, [r["loss"] for r in rows]
    assert rows[-1]["val_loss"] is not None and rows[-1]["val_ppl"] > 1 and "val_loss" not in rows[0]
    assert rows[-1]["tokens"] == LAYOUT_STEPS * 16 * 64
    # Every rank joined the one 4-rank group, two per node: rank r runs on node r // 2 (n1, n2).
    logs = {r: (run_dir / "logs" / f"rank-{r}.log").read_text() for r in range(4)}
    node_of = {}
    for rank, text in logs.items():
        assert f"[meshrun] rank {rank}/4 local {rank % 2}/2 node {rank // 2}/2 (n{rank // 2 + 1})" in text, text
        assert "Traceback" not in text, text
        node_of[rank] = next(m[2] for m in BANNER.finditer(text) if int(m[1]) == rank)
    # Tensor parallelism never leaves a node: the ranks of each tp group ran on one host.
    groups: dict[tuple[int, int], set[str]] = {}
    for rank, node in node_of.items():
        c = dims.coordinates(rank)
        groups.setdefault((c.pp, c.dp), set()).add(node)
    assert all(len(nodes) == 1 for nodes in groups.values()), groups
    batch = meshrun(tmp_path, "logs", job_id, "--batch", check=True).stdout
    assert "ranks exited with status 0" in batch, batch
    assert status(tmp_path, job_id)["state"] == "COMPLETED"
    return logs[0]


def test_two_nodes_train_dp2_tp2_with_tp_inside_each_node(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    """Mesh (pp, dp, tp) = (1, 2, 2): ranks {0, 1} on n1 and {2, 3} on n2 each form a tp group (the
    layers' matmuls, the vocabulary and, with sequence parallelism, the sequence split over them);
    dp (FSDP2) crosses the nodes."""
    log = _train_layout(
        tmp_path, corpus, ParallelDims(dp=2, tp=2, pp=1), ["parallel.dp_mode=fsdp", "parallel.sequence_parallel=true"]
    )
    assert "4 rank(s), dp=2 tp=2 pp=1 (native engine, fsdp, sequence parallel), gloo on cpu" in log, log
    assert "global batch 16 = micro 4 x dp 2 x accumulation 2" in log, log


def test_two_nodes_train_dp2_pp2_with_the_pipeline_across_nodes(testbed: dict, tmp_path: Path, corpus: Path) -> None:
    """Mesh (pp, dp, tp) = (2, 2, 1): stage 0 (layer 0, the embedding) on n1's ranks {0, 1}, stage 1
    (layer 1, the head and the loss) on n2's {2, 3}; each stage replicated over dp inside its node.
    1F1B over the step's 2 accumulation micro-batches."""
    log = _train_layout(
        tmp_path, corpus, ParallelDims(dp=2, tp=1, pp=2), ["parallel.dp_mode=ddp", "parallel.pp_schedule=1f1b"]
    )
    assert "4 rank(s), dp=2 tp=1 pp=2 (native engine, ddp, 1f1b), gloo on cpu" in log, log
    assert "global batch 16 = micro 4 x dp 2 x accumulation 2" in log, log


def test_hostile_name_and_env_reach_the_job_literally(testbed: dict, tmp_path: Path, canary: Path) -> None:
    HOSTILE = hostile(canary)
    probe = 'import os; print("NAME=" + os.environ["MESHRUN_JOB_NAME"]); print("VALUE=" + os.environ["HOSTILE"])'
    out = meshrun(
        tmp_path,
        "submit",
        "examples/command.yaml",
        "-c",
        "testbed",
        "--set",
        f"name={HOSTILE}",
        "--set",
        f"env.HOSTILE={HOSTILE}",
        "--set",
        f"command=python,-c,{probe}",
        "--set",
        "resources.tasks_per_node=1",
        "--wait",
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    text = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"NAME={HOSTILE}" in text and f"VALUE={HOSTILE}" in text
    # slurmctld keeps the literal name (slurmdbd itself rewrites '"' as '`' in sacct's JobName).
    queued = subprocess.run(
        ["squeue", "--states=all", "-h", "-j", job_id, "-o", "%j"], capture_output=True, text=True, check=True
    ).stdout.rstrip("\n")
    assert queued == HOSTILE
    assert not canary.exists()


@pytest.mark.parametrize("override", ["name=two\nlines", "env.X=a\nb", "resources.partition=debug\n"])
def test_newlines_are_refused_before_sbatch(testbed: dict, tmp_path: Path, override: str) -> None:
    out = meshrun(tmp_path, "submit", "examples/two-node.yaml", "-c", "testbed", "--set", override)
    assert out.returncode == 2 and "newlines and control characters" in out.stderr
    assert not (tmp_path / "state").exists() or "submitted" not in out.stdout
    queue = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, check=True).stdout
    assert "two\nlines" not in queue


def _no_sacct(tmp_path: Path) -> dict[str, str]:
    """PATH with an sacct that fails as it does without slurmdbd."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    (fake / "sacct").chmod(0o755)
    return {"PATH": f"{fake}:{os.environ['PATH']}"}


@pytest.mark.parametrize("accounting", [True, False], ids=["sacct", "squeue-without-accounting"])
def test_status_and_cancel_of_a_running_job(testbed: dict, tmp_path: Path, accounting: bool) -> None:
    """Without accounting (sacct failing, no slurmdbd) squeue --states=all still tells the state, in one round trip."""
    env = None if accounting else _no_sacct(tmp_path)
    sleeper = ["examples/command.yaml", "-c", "testbed", "--set", "command=sleep,300"]
    job_id, _ = submitted(meshrun(tmp_path, "submit", *sleeper, "--set", "resources.tasks_per_node=1", check=True))
    deadline = time.monotonic() + 60
    while (row := status(tmp_path, job_id, env=env))["state"] != "RUNNING":
        assert time.monotonic() < deadline and row["state"] in ("PENDING", "UNKNOWN"), row
        time.sleep(0.5)
    meshrun(tmp_path, "cancel", job_id, check=True)
    deadline = time.monotonic() + 60
    while (row := status(tmp_path, job_id, env=env))["state"] != "CANCELLED":
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    assert row["done"] is True and row["succeeded"] is False


def test_after_a_job_slurm_does_not_know_or_that_cannot_release_is_refused(testbed: dict, tmp_path: Path) -> None:
    """Slurm 22.05 drops a dependency on an unknown id (the job would start at once) and holds afterok on a
    failed job forever: both are exit 2 before anything is sent; any: on the failed job is fine."""
    failing = [
        "examples/command.yaml",
        "-c",
        "testbed",
        "--set",
        "command=false",
        "--set",
        "resources.tasks_per_node=1",
    ]
    failed_id, _ = submitted(meshrun(tmp_path, "submit", *failing, check=True))
    deadline = time.monotonic() + 60
    while status(tmp_path, failed_id)["state"] != "FAILED":
        assert time.monotonic() < deadline, status(tmp_path, failed_id)
        time.sleep(0.5)
    after = ["examples/command.yaml", "-c", "testbed", "--set", "command=true", "--dry-run", "--after"]
    unknown = meshrun(tmp_path, "submit", *after, "99999999")
    assert unknown.returncode == 2 and "Slurm knows no job 99999999" in unknown.stderr, unknown.stderr
    never = meshrun(tmp_path, "submit", *after, failed_id)
    assert never.returncode == 2 and f"job {failed_id} ended FAILED: afterok would never" in never.stderr, never.stderr
    anyway = meshrun(tmp_path, "submit", *after, f"any:{failed_id}", check=True)
    assert f"--dependency=afterany:{failed_id}" in anyway.stdout, anyway.stdout
