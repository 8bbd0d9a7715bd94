"""The submitit Python API (meshrun.submit.executor) against the real Slurm testbed: a 2x2 gloo all-reduce,
a Checkpointable job requeued after a signal, a job array, and `meshrun status/logs` seeing them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshrun.submit.core.registry import Registry
from meshrun.submit.executor import MeshrunSlurmExecutor, executor
from tests.helpers.cli import meshrun, status
from tests.integration import submitit_fns


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private registry for this test, shared with the `meshrun` commands it runs (tests/helpers/cli.py)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


def _executor(home: Path, **kw: object) -> MeshrunSlurmExecutor:
    ex = executor("testbed", folder=home / "runs", time="00:05:00", **kw)  # type: ignore[arg-type]
    assert isinstance(ex, MeshrunSlurmExecutor)
    return ex


def test_two_nodes_four_ranks_all_reduce_and_status(testbed: dict, home: Path) -> None:
    ex = _executor(home, nodes=2, tasks_per_node=2, name="allreduce")
    job = ex.submit(submitit_fns.allreduce_ranks)
    results = job.results()
    assert [r["sum"] for r in results] == [1 + 2 + 3 + 4] * 4
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3] and {r["world_size"] for r in results} == {4}
    assert {r["node"] for r in results} == {"n1", "n2"}
    assert {r["gloo_ifname"] for r in results} == {"lo"}  # the profile's NCCL/gloo preset reached the ranks
    # meshrun sees the job: its registry record, its final state from sacct, its run dir and logs.
    run_dir = ex.run_dir
    assert run_dir is not None and run_dir.parent == home / "runs"
    row = _final_status(home, job.job_id)
    assert row["state"] == "COMPLETED" and row["cluster"] == "testbed" and row["run_dir"] == str(run_dir)
    assert job.paths.folder == run_dir / ".meshrun" / "submitit"  # submitit's files stay in the hidden folder
    log = meshrun(home, "logs", job.job_id, "--rank", "3", check=True).stdout
    assert "completed" in log.lower(), log  # rank 3's submitit log, through logs/rank-3.log


def test_checkpointable_job_is_requeued_and_resumes_its_state(testbed: dict, home: Path) -> None:
    marker = home / "halfway"
    job = _executor(home, name="count").submit(submitit_fns.CountTo(), 10, str(marker))
    _wait_for(marker.exists, 60, "the job never reached its halfway point")
    job._interrupt()  # what a preemption looks like to submitit: SIGTERM (bypassed), then its USR2
    assert job.result() == {"count": 10, "restarts": [0, 1]}
    assert _final_status(home, job.job_id)["state"] == "COMPLETED"


def test_map_array_returns_each_result_and_each_task_is_registered(testbed: dict, home: Path) -> None:
    ex = _executor(home, name="squares")
    jobs = ex.map_array(submitit_fns.square, [1, 2, 3])
    assert [j.result() for j in jobs] == [1, 4, 9]
    registry = Registry()
    try:
        array_id = jobs[0].job_id.split("_")[0]
        tasks = registry.find_all(array_id)
    finally:
        registry.close()
    assert [t.job_id for t in tasks] == [j.job_id for j in jobs]
    assert ex.run_dir is not None and [t.run_dir for t in tasks] == [
        str(ex.run_dir / "tasks" / str(i)) for i in range(3)
    ]
    assert (Path(tasks[2].run_dir) / "logs" / "rank-0.log").resolve() == jobs[2].paths.stdout.resolve()


def test_meshrun_cancel_stops_a_submitit_job(testbed: dict, home: Path) -> None:
    job = _executor(home, name="sleeper").submit(submitit_fns.sleep_for, 120)
    _wait_for(lambda: status(home, job.job_id)["state"] == "RUNNING", 30, "the job never started")
    meshrun(home, "cancel", job.job_id, check=True)
    assert _final_status(home, job.job_id)["state"].startswith("CANCELLED")
    assert job.done(force_check=True) and job.state.startswith("CANCELLED")  # submitit sees it too


def _final_status(home: Path, job_id: str, timeout: float = 30) -> dict:
    """`meshrun status JOB --json` once the job is done (sacct trails the job's end by 1-3 s)."""
    row: dict = {}

    def done() -> bool:
        row.update(status(home, job_id))
        return bool(row["done"])

    _wait_for(done, timeout, f"meshrun status never saw job {job_id} end: {row}")
    return row


def _wait_for(condition: object, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.5)
