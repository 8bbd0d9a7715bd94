"""meshrun.submit.executor without a cluster: what a profile puts into submitit's sbatch script, the resource
checks (one line naming key, value and fix), the run-dir layout, and a real LocalExecutor job."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from submitit.slurm.slurm import _make_sbatch_string

from meshrun.submit.config.cluster import load_profile, profile_path
from meshrun.submit.core.registry import Registry
from meshrun.submit.errors import InputError
from meshrun.submit.executor import (
    MeshrunLocalExecutor,
    MeshrunSlurmExecutor,
    Resources,
    executor,
    new_run_dir,
    runs_folder,
    setup_lines,
    slurm_parameters,
)
from tests.helpers.builders import hostile

PROFILE = """\
name: login
scheduler: slurm
paths: {{work_dir: "~/meshrun-work"}}
setup: ["module load cuda/12.4"]
python: python3
partitions:
  - {{name: gpu, gpus_per_node: 4, cpus_per_node: 16, max_time: "02:00:00", max_nodes: 4, default: true}}
  - {{name: cpu, cpus_per_node: 8}}
interconnect:
  nccl: {{NCCL_IB_HCA: "=mlx5_0", NCCL_DEBUG: "{hostile}"}}
defaults: {{account: llm, qos: high, constraint: h100, exclusive: true, signal_seconds: 300}}
"""


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "login.yaml"
    path.write_text(PROFILE.format(hostile=hostile(tmp_path / "pwned").replace('"', '\\"')))
    return path


def test_the_sbatch_script_carries_what_the_profile_says(profile_file: Path, tmp_path: Path) -> None:
    profile = load_profile(str(profile_file))
    res = Resources(nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=4)
    params = slurm_parameters(profile, profile.partition(None), res, minutes=90, name="probe")
    script = _make_sbatch_string(command="python -m x", folder=tmp_path, **params)
    for line in (
        "--partition=gpu",
        "--account=llm",
        "--qos=high",
        "--constraint=h100",
        "#SBATCH --exclusive",
        "--signal=USR2@300",
        "#SBATCH --requeue",
        "--time=90",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--cpus-per-task=4",
        "--job-name=probe",
    ):
        assert line in script, line
    setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup[0] == "module load cuda/12.4" and len(setup) == 3  # the profile's lines first, then the preset


def test_nccl_preset_is_quoted_and_yields_to_the_users_own_export(profile_file: Path, tmp_path: Path) -> None:
    lines = setup_lines(load_profile(str(profile_file)))[1:]
    probe = "\n".join([*lines, 'printf "%s|%s" "$NCCL_DEBUG" "$NCCL_IB_HCA"'])
    out = subprocess.run(
        ["bash", "-c", probe], capture_output=True, text=True, env={"NCCL_IB_HCA": "mine"}, check=True
    ).stdout
    assert out == hostile(tmp_path / "pwned") + "|mine"
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"gpus_per_node": 8}, "gpus_per_node"),
        ({"nodes": 5}, "nodes"),
        ({"nodes": 0}, "nodes"),
        ({"tasks_per_node": 8, "cpus_per_task": 4}, "cpus_per_task"),
        ({"time": "03:00:00"}, "time"),
        ({"time": "soon"}, "time"),
        ({"partition": "gpus"}, "partition"),
        ({"mem_gigs": 4}, "mem_gigs"),
    ],
)
def test_bad_resources_name_the_keyword_and_the_fix(profile_file: Path, kwargs: dict, key: str) -> None:
    with pytest.raises(InputError) as err:
        executor(str(profile_file), **kwargs)
    assert err.value.key == key and err.value.fix, err.value
    assert "\n" not in str(err.value)


def test_unknown_partition_and_parameter_suggest_the_close_name(profile_file: Path) -> None:
    with pytest.raises(InputError, match="did you mean 'gpu'"):
        executor(str(profile_file), partition="gpus")
    with pytest.raises(InputError, match="did you mean 'mem'"):
        executor(str(profile_file), mme="4GB")


def test_an_ssh_profile_is_refused_the_api_runs_on_the_login_node() -> None:
    with pytest.raises(InputError) as err:
        executor("h200-ndr")
    assert err.value.key == "cluster" and "login node" in err.value.fix


def test_executor_is_configured_and_its_runs_go_under_the_work_dir(
    profile_file: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runs_folder(load_profile(str(profile_file)), None) == tmp_path / "home" / "meshrun-work" / "runs"
    ex = executor(
        str(profile_file),
        partition="cpu",
        time="45",
        cpus_per_task=2,
        mem="4GB",
        additional_parameters={"mail-type": "END"},
    )
    assert isinstance(ex, MeshrunSlurmExecutor) and ex.python == "python3"
    assert ex.folder == tmp_path / "home" / "meshrun-work" / "runs"
    p = ex.parameters
    assert (p["partition"], p["time"], p["cpus_per_task"], p["mem"]) == ("cpu", 45, 2, "4GB")
    assert p["additional_parameters"] == {"requeue": True, "mail-type": "END"}  # merged, not replaced
    assert "gpus_per_node" not in p and not list((tmp_path / "home").rglob("*"))  # nothing made before a submit
    assert p["signal_delay_s"] == 300
    # A signal due before the function starts would kill it: at most half the limit, as the template does.
    assert executor(str(profile_file), time="2").parameters["signal_delay_s"] == 60


def test_run_dirs_are_named_by_job_time_and_keep_submitit_hidden(tmp_path: Path) -> None:
    when = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    run = new_run_dir(str(tmp_path), "my job/1", when)
    assert Path(run.root).name.startswith("submitit-my_job_1-20250102-030405-")
    assert run.submitit == f"{run.root}/.meshrun/submitit" and run.task(2).root == f"{run.root}/tasks/2"


def test_local_profile_runs_a_submitit_job_and_records_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(InputError, match="use 1"):
        executor("local", nodes=2)
    ex = executor("local", folder=tmp_path / "runs", tasks_per_node=2, time="00:02:00", name="sq")
    assert isinstance(ex, MeshrunLocalExecutor)
    job = ex.submit(pow, 3, 2)
    assert job.results() == [9, 9]
    registry = Registry()
    try:
        record = registry.find(job.job_id)
    finally:
        registry.close()
    assert ex.run_dir is not None and record.run_dir == str(ex.run_dir) and record.scheduler == "local"
    assert record.cluster == "local" and record.name == "sq" and record.profile == str(profile_path("local"))
    assert Path(record.run_dir).stat().st_mode & 0o777 == 0o700
    logs = Path(record.run_dir) / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.err", "rank-0.log", "rank-1.err", "rank-1.log"]
    assert (logs / "rank-1.log").resolve() == job.task(1).paths.stdout.resolve()
    # `meshrun status` reads submitit's own result files for such a job (its executor writes no meshrun state).
    from meshrun.submit import api

    (found,) = api.statuses([record], api.Clusters())
    assert found.state == "COMPLETED" and found.done, found


def test_the_api_module_stays_torch_free() -> None:
    code = (
        "import sys, meshrun.submit.executor; bad = [m for m in ('torch', 'numpy', 'paramiko') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("setup", [False, True], ids=["no-setup", "setup-lines"])
def test_meshrun_cancel_stops_a_local_submitit_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: bool
) -> None:
    """The local profile's API jobs are cancelled like any other job (their controller's pid is the id). With
    setup lines the id is the pid of the shell submitit runs them in: the cancel must reach the controller
    under it (a TERM to the shell alone said CANCELLED and left the function running)."""
    import time as _time

    from meshrun.submit import api

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    profile = "local"
    if setup:
        profile = str(tmp_path / "mine.yaml")
        text = (
            (Path(__file__).resolve().parents[2] / "cluster_configs" / "local.yaml")
            .read_text()
            .replace("name: local", "name: mine", 1)
        )
        Path(profile).write_text(text + 'setup:\n  - "export MESHRUN_TEST_SETUP=1"\n')
    ex = executor(profile, folder=tmp_path / "runs", tasks_per_node=1, time="00:02:00", name="sleepy")
    job = ex.submit(_time.sleep, 120)
    registry = Registry()
    try:
        record = registry.find(job.job_id)
    finally:
        registry.close()
    deadline = _time.monotonic() + 30
    while api.statuses([record], api.Clusters())[0].state != "RUNNING":
        assert _time.monotonic() < deadline
        _time.sleep(0.2)
    # Once the task runs the function it has submitit's handlers, which pass over a SIGTERM ("Bypassing signal
    # SIGTERM"): a cancel must stop it then too (a TERM to the controller said CANCELLED and the function ran on).
    while "Loading pickle" not in (job.paths.stdout.read_text() if job.paths.stdout.exists() else ""):
        assert _time.monotonic() < deadline, "the task never started the function"
        _time.sleep(0.1)
    _time.sleep(0.5)
    api.cancel([record], api.Clusters())
    deadline = _time.monotonic() + 30
    while not job.done():
        assert _time.monotonic() < deadline, "the submitit job survived the cancel"
        _time.sleep(0.2)
    assert api.statuses([record], api.Clusters())[0].state == "CANCELLED"
    folder, deadline = str(tmp_path / "runs"), _time.monotonic() + 10
    while left := [p.pid for p in psutil.process_iter(["cmdline"]) if folder in " ".join(p.info["cmdline"] or [])]:
        assert _time.monotonic() < deadline, f"still running after the cancel: {left}"  # the controller, its task
        _time.sleep(0.2)


def _records(job_ids: list[str]) -> list:
    registry = Registry()
    try:
        return [registry.find(j) for j in job_ids]
    finally:
        registry.close()


def _fails_on_two(x: int) -> int:
    if x == 2:
        raise ValueError("two is not allowed")
    return x


def test_a_local_array_task_ends_completed_or_failed_not_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """map_array on `local`: each task is its own controller, but submitit's files are the submission's (not
    the task's run dir): status must find them there, or `watch` and `top` wait for ever."""
    from meshrun.submit import api

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    ex = executor("local", folder=tmp_path / "runs", time="00:02:00", name="arr")
    jobs = ex.map_array(_fails_on_two, [1, 2, 3])
    for job in jobs:
        job.wait()
    found = api.statuses(_records([j.job_id for j in jobs]), api.Clusters())
    assert [s.state for s in found] == ["COMPLETED", "FAILED", "COMPLETED"], found
    assert all(s.done for s in found) and "two is not allowed" in (found[1].reason or "")


def test_a_local_submitit_job_whose_controller_was_killed_is_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal
    import time as _time

    import psutil

    from meshrun.submit import api

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    job = executor("local", folder=tmp_path / "runs", time="00:02:00", name="killed").submit(_time.sleep, 120)
    (record,) = _records([job.job_id])
    controller = psutil.Process(int(job.job_id))
    assert api.statuses([record], api.Clusters())[0].state == "RUNNING"
    children = controller.children(recursive=True)
    os.kill(controller.pid, signal.SIGKILL)
    controller.wait(10)
    for child in children:  # the task the controller started outlives it: not this test's to leave behind
        child.kill()
    (after,) = api.statuses([record], api.Clusters())
    assert after.state == "FAILED" and after.done and "without a result" in (after.reason or ""), after


def test_a_local_executor_refuses_an_unknown_parameter_but_takes_slurms(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="bogus"):
        executor("local", folder=tmp_path / "runs", bogus=1)
    ex = executor("local", folder=tmp_path / "runs", mem="4G", visible_gpus=())  # cluster code runs unchanged
    assert isinstance(ex, MeshrunLocalExecutor)
    with pytest.raises(InputError, match="visible_gpus"):
        executor(str(profile_path("testbed")), folder=tmp_path / "runs", visible_gpus=())
