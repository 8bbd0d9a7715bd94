"""The local cluster's state file and the --wait display, without starting processes."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from meshrun.launcher.contract.records.rundir import local_state_path, merge_state
from meshrun.submit.api import Status, poll_interval
from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.errors import ClusterError
from meshrun.submit.schedulers import local
from meshrun.submit.views.tables import progress_line


def _status(**kw) -> Status:
    base = dict(
        job_id="1",
        cluster="c",
        name="n",
        state="RUNNING",
        run_dir="/r",
        submitted_at=0.0,
        done=False,
        succeeded=False,
        elapsed_s=75,
        time_limit_s=600,
        progress={"step": 20, "loss": 3.14159},
    )
    return Status(**{**base, **kw})


def test_progress_line_shows_state_step_loss_and_time_left() -> None:
    assert progress_line(_status(), 60) == "[RUNNING] step 20/60 loss 3.1416 elapsed 0:01:15 left 0:08:45"
    assert (
        progress_line(_status(state="PENDING", progress={}, elapsed_s=None, reason="Resources"), 60)
        == "[PENDING] (Resources)"
    )


def test_wait_shows_the_newest_validation_loss_and_its_step() -> None:
    """A new user's trial: --wait never showed val_loss (only the newest step line, rarely an eval step's)."""
    from meshrun.submit.core.status import parse_metrics_tail

    lines = [
        {"step": 30, "loss": 3.5, "val_loss": 3.25, "job": "j"},
        {"step": 31, "loss": 3.4, "job": "j"},
        {"event": "checkpoint", "checkpoint_step": 30, "job": "j"},
        {"step": 32, "loss": 3.3, "job": "j"},
    ]
    progress = parse_metrics_tail("\n".join(json.dumps(line) for line in lines), "j")
    assert progress["step"] == 32 and (progress["val_loss"], progress["val_step"]) == (3.25, 30)
    line = progress_line(_status(progress=progress), 60)
    assert line.startswith("[RUNNING] step 32/60 loss 3.3000 val_loss 3.2500 (step 30) elapsed"), line


def test_polling_backs_off_on_slurm() -> None:
    assert [poll_interval("slurm", t) for t in (0, 29, 31, 299, 301)] == [2.0, 2.0, 5.0, 5.0, 10.0]
    assert poll_interval("local", 1000) == 0.5


def test_a_dead_supervisor_reads_as_failed(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    merge_state(local_state_path(str(tmp_path), "local-1"), state="RUNNING", supervisor_pid=proc.pid, pgid=proc.pid)
    state = local.current_state(str(tmp_path), "local-1")
    assert state["state"] == "FAILED" and "supervisor" in state["message"]
    record = JobRecord("local-1", "local", "n", str(tmp_path), "local", 0.0, None, "h")
    with pytest.raises(ClusterError, match="not running: it ended FAILED"):
        local.BACKEND.cancel([record], None)


def test_a_finished_state_is_kept(tmp_path: Path) -> None:
    path = local_state_path(str(tmp_path), "local-2")
    merge_state(path, state="COMPLETED", supervisor_pid=1)
    merge_state(path, exit_codes=[0, 0])
    assert local.current_state(str(tmp_path), "local-2") == {
        "state": "COMPLETED",
        "supervisor_pid": 1,
        "exit_codes": [0, 0],
    }
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_each_job_id_of_a_run_dir_keeps_its_own_outcome(tmp_path: Path) -> None:
    """A resumed run shares the run dir, never the first id's state."""
    merge_state(local_state_path(str(tmp_path), "local-a"), state="CANCELLED")
    merge_state(local_state_path(str(tmp_path), "local-b"), state="COMPLETED")
    assert local.current_state(str(tmp_path), "local-a")["state"] == "CANCELLED"
    assert local.current_state(str(tmp_path), "local-b")["state"] == "COMPLETED"


def test_registry_finds_by_id_and_refuses_ambiguity(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "r.sqlite")
    for cluster in ("a", "b"):
        reg.add(JobRecord("7", cluster, "n", f"/{cluster}", "slurm", 1.0, None, "h"))
    reg.add(JobRecord("8", "a", "n", "/a8", "slurm", 2.0, None, "h"))
    assert reg.find("8").run_dir == "/a8" and reg.find("7", "b").run_dir == "/b"
    assert [r.job_id for r in reg.recent()] == ["8", "7", "7"]
    try:
        reg.find("7")
    except Exception as exc:
        assert "-c CLUSTER" in str(exc)
    else:
        raise AssertionError("an ambiguous id must be refused")
    reg.set_state(reg.find("8"), "COMPLETED")
    assert Registry(tmp_path / "r.sqlite").find("8").last_state == "COMPLETED"


def test_wait_prints_plain_lines_only_on_change(monkeypatch) -> None:
    from meshrun.submit import api
    from meshrun.submit.cli import common as cli

    seq = iter(
        [
            _status(progress={"step": 1, "loss": 5.0}),
            _status(progress={"step": 1, "loss": 5.0}),
            _status(progress={"step": 2, "loss": 4.0}),
            _status(state="COMPLETED", done=True, succeeded=True, progress={"step": 2, "loss": 4.0}),
        ]
    )
    monkeypatch.setattr(api, "statuses", lambda records, clusters, registry=None: [next(seq)])
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    out = io.StringIO()
    record = JobRecord("1", "c", "n", "/r", "local", 0.0, None, "h")
    final = cli.wait_for(record, None, None, total_steps=2, out=out)
    assert final.succeeded
    assert [l.split(" loss")[0] for l in out.getvalue().splitlines()] == [
        "[RUNNING] step 1/2",
        "[RUNNING] step 2/2",
        "[COMPLETED] step 2/2",
    ]


def test_wait_polls_by_the_time_since_the_wait_began_across_a_requeue(monkeypatch) -> None:
    """`--wait` polled every 2 s again after each requeue. The interval grows with the time since the
    wait began, whatever the job's attempts: the statuses here report the current attempt's elapsed time (reset
    to 0 by a requeue at 400 s), and an interval taken from it would fall back to 2 s."""
    from meshrun.submit import api
    from meshrun.submit.cli import common as cli

    clock = [1000.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds

    def statuses(records, clusters, registry=None):
        waited = clock[0] - 1000.0
        if waited >= 700:
            return [_status(state="COMPLETED", done=True, succeeded=True, elapsed_s=300, restarts=1)]
        requeued = waited >= 400
        attempt = waited - 400 if requeued else waited  # what the newest attempt alone has run
        state = "PENDING" if 400 <= waited < 410 else "RUNNING"
        return [_status(state=state, elapsed_s=int(attempt), restarts=int(requeued))]

    monkeypatch.setattr(api, "statuses", statuses)
    monkeypatch.setattr(cli.time, "sleep", sleep)
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    cli.wait_for(
        JobRecord("1", "c", "n", "/r", "slurm", 0.0, None, "h"), None, None, total_steps=None, out=io.StringIO()
    )
    assert sleeps[0] == 2.0
    after_requeue = [s for s, at in zip(sleeps, itertools.accumulate(sleeps)) if at > 400]
    assert after_requeue and set(after_requeue) == {10.0}, sleeps  # not 2 s again after the requeue
    assert len(sleeps) < 15 + 54 + 45  # 2 s for 30 s, 5 s to 300 s, then 10 s: about 60 queries, not 130


def test_wait_line_shows_the_jobs_whole_life() -> None:
    """ELAPSED in `--wait`'s lines: the job's every run (13 s before its requeue, 66 s since), not the newest's."""
    from meshrun.submit.schedulers import slurm_cli
    from meshrun.submit.schedulers.slurm import _status
    from meshrun.submit.transport.base import Result

    record = JobRecord("4", "c", "n", "/r", "slurm", 0.0, None, "h")
    job = slurm_cli.SlurmJob("4", slurm_cli.JobState.RUNNING, elapsed="00:01:06", restarts=1, earlier_s=13)
    empty = Result(("true",), 0, "", "")
    status = _status(record, job, empty, empty)
    assert status.elapsed_s == 79
    assert "elapsed 0:01:19" in progress_line(status, None)
