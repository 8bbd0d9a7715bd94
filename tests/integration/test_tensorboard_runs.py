"""The job writes its own TensorBoard event files. A real `tensorboard --logdir WORK_DIR`
shows two local runs side by side; `meshrun tb JOB JOB` serves them together, and an array id serves
its tasks (old runs without event files are converted from metrics.jsonl)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from meshrun.launcher.contract.records.rundir import RunDir, node_name
from meshrun.submit.core.registry import JobRecord, Registry
from tests.helpers import sshbed, tbhelp
from tests.helpers.cli import TINY as CLI_TINY
from tests.helpers.cli import meshrun, metrics, status, submitted

TINY = [*CLI_TINY, "--set", "train.steps=4"]
WANTED = {"loss", "grad_norm", "tokens_per_s", "data_wait_fraction", "step_time_s", "lr"}


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return json.loads(answer.read())
    except (urllib.error.URLError, ConnectionError):
        return None  # not listening yet, or still loading in the background (a tag may not exist yet: HTTP 400)


def _losses(url: str, run: str) -> list[tuple[int, float]]:
    query = urllib.parse.urlencode({"run": run, "tag": "loss"})
    return [(step, value) for _, step, value in _get(f"{url}data/plugin/scalars/scalars?{query}") or []]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _two_runs(home: Path, corpus: Path) -> dict[str, Path]:
    jobs = [submitted(meshrun(home, "submit", *TINY, "--set", f"data.path={corpus}", check=True)) for _ in range(2)]
    for job_id, _ in jobs:
        deadline = time.monotonic() + 180
        while status(home, job_id)["state"] not in ("COMPLETED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, f"job {job_id} did not finish"
            time.sleep(1.0)
        assert status(home, job_id)["state"] == "COMPLETED"
    return dict(jobs)


def _last_beats(run_dir: Path) -> dict[str, dict]:
    return json.loads(Path(RunDir(str(run_dir)).last_beats(node_name({}))).read_text())["beats"]


def test_two_local_runs_in_one_tensorboard_and_in_meshrun_tb(tmp_path: Path, corpus: Path) -> None:
    runs = _two_runs(tmp_path, corpus)
    for run_dir in runs.values():
        assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
        assert all("mfu" not in r for r in metrics(run_dir))  # CPU ranks: no MFU, said once in the log
        assert (run_dir / "logs" / "rank-0.log").read_text().count("no MFU: the ranks compute on the CPU") == 1
        beat = _last_beats(run_dir)["1"]  # what the sidecar kept of the heartbeats on (cleared) scratch
        assert (beat["rank"], beat["step"], beat["phase"]) == (1, 4, "checkpoint")
    work_dir = tmp_path / ".local" / "share" / "meshrun"
    port = _free_port()
    board = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(work_dir), "--host", "127.0.0.1"]
        + ["--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        names = {str(d.relative_to(work_dir) / "tensorboard"): d for d in runs.values()}
        tags = tbhelp.until(
            "both runs", lambda: (t := _get(url + "data/plugin/scalars/tags")) and set(names) <= set(t) and t
        )
        for name, run_dir in names.items():
            assert WANTED <= set(tags[name]) and "mfu" not in tags[name], tags[name]
            assert _losses(url, name) == [(r["step"], r["loss"]) for r in metrics(run_dir)]
    finally:
        board.terminate()
        board.wait(timeout=30)
    _meshrun_tb(tmp_path, list(runs), {job: [(r["step"], r["loss"]) for r in metrics(d)] for job, d in runs.items()})


def _meshrun_tb(home: Path, jobs: list[str], expected: dict[str, list[tuple[int, float]]]) -> None:
    """`meshrun tb JOB...` on this machine: one URL, each run named by its job id, then Ctrl-C stops it."""
    cleanup = tbhelp.Cleanup()
    cleanup.under.append(home)  # on this machine the server keeps its state in HOME/.cache
    proc = tbhelp.meshrun_tb(home, *jobs)
    try:
        line = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:")
        assert line, proc.stderr.read() if proc.poll() is not None else "no URL"
        browser = tbhelp.Browser(line.split()[-1])
        for run, points in expected.items():
            tbhelp.until(f"the loss of {run}", lambda run=run, points=points: browser.losses(run) == points)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        cleanup.stop()
    assert proc.returncode == 0 and "stopped TensorBoard" in proc.stderr.read()


def test_an_array_id_serves_its_tasks_and_old_runs_are_converted(tmp_path: Path) -> None:
    """Runs without event files (written before the job wrote its own) show through metrics.jsonl."""
    expected = {}
    registry = Registry(tmp_path / "state" / "meshrun" / "registry.sqlite")
    for task in range(2):
        run_dir = tmp_path / "sweep" / "tasks" / str(task)
        run_dir.mkdir(parents=True)
        expected[f"700_{task}"] = [(step, 5.0 - step - task) for step in (1, 2, 3)]
        (run_dir / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in expected[f"700_{task}"])
        )
        registry.add(JobRecord(f"700_{task}", "local", "sweep", str(run_dir), "local", 0.0, None, "h", "COMPLETED"))
    registry.close()
    _meshrun_tb(tmp_path, ["700"], expected)


def test_jobs_on_two_clusters_are_refused_in_one_line(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state" / "meshrun" / "registry.sqlite")
    for job, cluster in (("801", "local"), ("802", "testbed")):
        registry.add(JobRecord(job, cluster, "j", str(tmp_path / job), "local", 0.0, None, "h", "COMPLETED"))
    registry.close()
    out = meshrun(tmp_path, "tb", "801", "802")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "meshrun: error: JOB: '801 802': these jobs run on 2 clusters (local, testbed); one `meshrun tb` serves "
        "one cluster's runs: start one per cluster"
    ]


def test_the_command_example_reports_through_report(tmp_path: Path) -> None:
    """examples/command.yaml calls report() from the python3 on PATH: status, metrics.jsonl, TensorBoard, heartbeats."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    venv = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # as in an activated venv
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "local", "--wait", check=True, env=venv)
    job_id, run_dir = submitted(out)
    row = status(tmp_path, job_id)
    assert row["progress"]["step"] == 3 and abs(row["progress"]["loss"] - 1 / 3) < 1e-9
    assert [(r["step"], r["loss"]) for r in metrics(run_dir)] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5), (3, 0.333333)]
    for rank in (0, 1):
        beat = _last_beats(run_dir)[str(rank)]
        assert (beat["rank"], beat["step"], beat["phase"]) == (rank, 3, "step")
