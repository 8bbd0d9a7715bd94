"""The requeue policy's restart inside the allocation: which ends restart on a spare node,
which node they leave out, and when the job falls back to a requeue. The real thing on the Slurm testbed:
tests/integration/test_spare_nodes.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest

from meshrun.launcher.batch.requeue import main, restart_in_allocation
from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS, EXIT_REQUEUE
from meshrun.launcher.contract.records import suspects
from meshrun.launcher.contract.records.rundir import RunDir, attempt_id
from meshrun.launcher.contract.spec.job import JobSpec, Resilience, Resources, RunInfo, RunSpec, write_run_spec

ENV = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
KILLED = "[meshrun] job 41 restart 0 on n[1-2] at 2026-12-03T15:15:09Z\nsrun: error: n1: task 0: Killed\n"


def _run(tmp_path: Path, **resilience: object) -> str:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    job = JobSpec(name="s", resources=Resources(nodes=1), command=("true",), resilience=Resilience(**resilience))  # type: ignore[arg-type]
    info = RunInfo(cluster="c", scheduler="slurm", run_dir=str(run_dir), suspects_file=str(tmp_path / "ledger.jsonl"))
    write_run_spec(RunSpec(job, info), run_dir)
    return str(run_dir)


def test_a_rank_killed_by_a_signal_restarts_on_a_spare_without_its_node(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, spare_nodes=1)
    Path(RunDir(run_dir).batch_log("41")).write_text(KILLED)
    found = restart_in_allocation(run_dir, 137, 0, spares=1, environ=ENV)
    assert found is not None
    decision, blamed = found
    assert decision.line().startswith(
        "restart 137 restarting inside the allocation without n1 (rank 0 was killed by SIGKILL"
    )
    assert decision.line().endswith("restart 1 of at most 3 (exit 137)") and list(blamed) == ["n1"]


@pytest.mark.parametrize(
    "resilience, status, spares, env",
    [
        ({}, 137, 1, ENV),  # no spare nodes asked for: requeued as ever
        ({"spare_nodes": 1}, 137, 0, ENV),  # no healthy spare left
        ({"spare_nodes": 1}, EXIT_REQUEUE, 1, ENV),  # a stop signal saved: preempted or timed out, requeued
        ({"spare_nodes": 1, "restart_on": ("hang",)}, 137, 1, ENV),  # failures do not restart here
        ({"spare_nodes": 1, "max_restarts": 2}, 137, 1, {**ENV, "MESHRUN_RESTART_IN_JOB": "2"}),  # limit reached
    ],
    ids=["no-spares", "none-left", "saved", "not-restart-on", "limit"],
)
def test_when_the_job_falls_back_to_a_requeue(
    tmp_path: Path, resilience: dict, status: int, spares: int, env: dict[str, str]
) -> None:
    run_dir = _run(tmp_path, **resilience)
    Path(RunDir(run_dir).batch_log("41")).write_text(KILLED)
    assert restart_in_allocation(run_dir, status, 0, spares=spares, environ=env) is None


def test_a_hang_leaves_its_stalled_node_and_a_program_error_blames_no_node(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, spare_nodes=1)
    verdict = {
        "attempt": attempt_id(ENV),
        "verdict": "Rank 0 on n1 stalled. More.",
        "ranks": [{"node": "n1", "state": "stalled"}],
    }
    Path(RunDir(run_dir).verdict_json).parent.mkdir(parents=True)
    Path(RunDir(run_dir).verdict_json).write_text(json.dumps(verdict))
    found = restart_in_allocation(run_dir, EXIT_NO_PROGRESS, 0, spares=1, environ=ENV)
    assert found is not None and found[1] == {"n1": "hang verdict: Rank 0 on n1 stalled"}
    # A rank that exited 1 by itself: restarted in place (its node is not to blame), on the same nodes.
    Path(RunDir(run_dir).batch_log("41")).write_text(KILLED.replace("Killed", "Exited with exit code 1"))
    again = restart_in_allocation(run_dir, 1, 0, spares=1, environ=ENV)
    assert again is not None and again[1] == {} and "without" not in again[0].why


def test_main_prints_restart_and_the_node_to_leave_out_and_records_it_as_a_suspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _run(tmp_path, spare_nodes=1)
    Path(RunDir(run_dir).batch_log("41")).write_text(KILLED)
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    assert main([run_dir, "137", "0", "20", "--spares=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("restart 137 restarting inside the allocation without n1") and out[1:] == ["exclude n1"]
    (row,) = suspects.parse((tmp_path / "ledger.jsonl").read_text().splitlines())
    assert row["node"] == "n1" and row["evidence"].startswith("rank 0 was killed by SIGKILL") and row["job"] == "41"
    assert main([run_dir, "137", "0", "20", "--spares=x"]) == 2  # a bad count: the usage line


def test_status_counts_restarts_inside_the_allocation_apart_from_requeues() -> None:
    from meshrun.submit.views.tables import goodput_line

    figures = {
        "allocated_s": 60.0,
        "parts_s": {"productive": 45.0, "setup": 15.0},
        "effective_pct": 75.0,
        "attempts": [
            {"restart": 0, "in_job": 0, "nodes": "n1"},
            {"restart": 0, "in_job": 1, "nodes": "n2"},
        ],
    }
    line = goodput_line(figures)
    assert line.startswith("goodput: 75% effective (productive 45.0s of 1m00s allocated in 2 starts")
    assert line.endswith("; 1 restart(s) inside the allocation (n1 -> n2)"), line


def test_a_stop_signal_or_a_segfault_blames_no_node(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, spare_nodes=1)
    for words in ("User defined signal 1", "Segmentation fault", "Terminated"):
        Path(RunDir(run_dir).batch_log("41")).write_text(KILLED.replace("Killed", words))
        found = restart_in_allocation(run_dir, 1, 0, spares=1, environ=ENV)
        assert found is not None and found[1] == {}, words


def test_a_ranks_banner_and_the_status_table_name_the_restart_inside_the_allocation() -> None:
    from meshrun.launcher.rank.entry import rank_banner
    from meshrun.launcher.rank.env import RankEnv
    from meshrun.submit.core.findings import Findings

    env = RankEnv(0, 0, 1, 1, 0, 1, "n1", 29500, "41", 0, ("n1",), "slurm")
    first = rank_banner(env, {"SLURMD_NODENAME": "n1"})
    again = rank_banner(env, {"SLURMD_NODENAME": "n2", "MESHRUN_RESTART_IN_JOB": "1"})
    assert "(n1) job 41 restart 0 master" in first and "(n2) job 41 restart 0 in-job 1 master" in again
    attempts = [{"restart": 0, "in_job": 0, "nodes": "n1"}, {"restart": 0, "in_job": 1, "nodes": "n2"}]
    assert Findings(goodput={"attempts": attempts}).status_fields()["restarts_in_job"] == 1
    assert Findings().status_fields()["restarts_in_job"] == 0


class _Slurm:
    """Recorded answers of `scontrol show job` and `sinfo` for job 41 in a partition of four nodes (or those given)."""

    def __init__(self, partition: tuple[str, ...] = ("n1", "n2", "n3", "n4")) -> None:
        self.partition = partition

    def __call__(self, argv: Sequence[str]) -> str | None:
        if list(argv[:3]) == ["scontrol", "show", "job"]:
            return "JobId=41 Partition=wide ExcNodeList=(null)\n"
        if argv[0] == "sinfo":
            return "".join(f"{node}\n" for node in self.partition)
        return None


def test_a_requeue_after_the_last_spare_is_lost_leaves_out_every_node_this_allocation_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 nodes + 1 spare; n2 failed and the spare n3 took its place; then n3's rank was killed, no spare
    was left, and the job was requeued asking for 3 nodes again, with only n3 excluded: it could land on n2, the
    node it had just left. Both stay out, and the partition (4 nodes) cannot spare them beside 3: the requeued job
    asks for 2, its spare given up, rather than land on either."""
    from meshrun.launcher.batch.requeue import requeue_leaves_out

    run_dir = _run(tmp_path, spare_nodes=1, avoid_suspects=False)
    job = RunSpec(
        JobSpec(name="s", resources=Resources(nodes=2), command=("true",), resilience=Resilience(spare_nodes=1)),
        RunInfo(cluster="c", scheduler="slurm", run_dir=run_dir),
    )
    write_run_spec(job, Path(run_dir))
    env = {**ENV, "SLURM_JOB_NODELIST": "n[1-3]", "MESHRUN_LEFT_OUT": " n2", "MESHRUN_RESTART_IN_JOB": "1"}
    killed = "[meshrun] job 41 restart 0 in-job 1 on n1,n3 at x\nsrun: error: n3: task 1: Killed\n"
    Path(RunDir(run_dir).batch_log("41")).write_text(killed)
    requeue_leaves_out(run_dir, 137, 0, env, _Slurm())
    out, err = capsys.readouterr()
    assert out.splitlines() == ["exclude n2,n3", "nodes 2"], (out, err)
    assert "leaves out n2 (left out of this allocation earlier); n3 (rank 1 was killed by SIGKILL" in err, err
    assert "it asks for 2 nodes instead of 3" in err, err


def _failed_check(run_dir: str, *nodes: str) -> None:
    """Each node's health check answer: its free space failed."""
    for node in nodes:
        path = Path(RunDir(run_dir).health_result(node))
        path.parent.mkdir(exist_ok=True)
        check = {"name": "space", "verdict": "fail", "evidence": "/ckpt: 0.1 GB free"}
        path.write_text(json.dumps({"node": node, "checks": [check]}))


@pytest.mark.parametrize(
    "nodes, spares, left_out, failing, partition, excluded, asked",
    [
        # 1 node + 1 spare: n1's rank was killed and the spare n2 took over; then n2 fails its check before the
        # next run. The partition (3 nodes) cannot spare n1 and n2 beside 2: the requeue asks for 1, on n3.
        (1, 1, "n1", ("n2",), ("n1", "n2", "n3"), ("n1", "n2"), 1),
        # 1 node + 2 spares, every node of the allocation fails its first check: beside 3 nodes the partition (4)
        # has no room for them (the gate used to end the job there); beside 1 it has, n4.
        (1, 2, "", ("n1", "n2", "n3"), ("n1", "n2", "n3", "n4"), ("n1", "n2", "n3"), 1),
    ],
    ids=["after-a-restart", "every-node-failed"],
)
def test_a_failed_health_check_with_no_spare_left_requeues_as_a_rank_failure_does(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    nodes: int,
    spares: int,
    left_out: str,
    failing: tuple[str, ...],
    partition: tuple[str, ...],
    excluded: tuple[str, ...],
    asked: int,
) -> None:
    """The health gate's requeue left out only the failing nodes and asked for nodes + spares again, so
    it could land on a node spares had replaced earlier in the allocation (or end a job a smaller request fits).
    It makes the rank-failure path's decision (meshrun.launcher.batch.requeue.leave_out): the batch script gets the gate's
    `requeue NODES` and then the policy's `nodes N` (scontrol update ExcNodeList= NumNodes= NumTasks=)."""
    from meshrun.launcher.batch import gate

    run_dir = _run(tmp_path, spare_nodes=spares)
    _failed_check(run_dir, *failing)
    allocated = partition[: nodes + spares]
    env = {**ENV, "SLURM_JOB_NODELIST": ",".join(allocated), "MESHRUN_LEFT_OUT": f" {left_out}"}
    env["MESHRUN_RESTART_IN_JOB"] = "1" if left_out else "0"
    # Only the nodes still in the allocation are asked; a node left out earlier has no answer, and needs none.
    slurm = _Slurm(partition)
    monkeypatch.setattr(gate.judge, "__defaults__", (slurm, None))
    assert gate.main([run_dir], env) == 0
    out, err = capsys.readouterr()
    assert out == f"requeue {','.join(excluded)}\n", (out, err)
    assert f"instead of {nodes + spares}, its spares given up" in err, err
    if left_out:
        assert f"({left_out}: left out of this allocation earlier)" in err, err
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main([run_dir, "79", "0", "20", "--spares=0"]) == 0
    policy = capsys.readouterr().out.splitlines()
    assert policy[0].startswith("requeue 79 ") and policy[1:] == [f"nodes {asked}"], policy
