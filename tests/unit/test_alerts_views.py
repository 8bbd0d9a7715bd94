"""The alert views: the --wait progress line, the ALERTS column, status JOB's alerts, the findings round trip."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from meshrun.submit.core.status import Status
from meshrun.submit.transport.base import new_marker
from meshrun.submit.views.tables import progress_line


def _status(**kw: Any) -> Status:
    base: dict[str, Any] = dict(
        job_id="j1",
        cluster="local",
        name="n",
        state="RUNNING",
        run_dir="/r",
        submitted_at=0.0,
        done=False,
        succeeded=False,
    )
    return Status(**{**base, **kw})


def test_progress_line_shows_a_null_loss_as_nan() -> None:
    # A diverged job writes "loss": null (strict JSON has no NaN); --wait died formatting it.
    line = progress_line(_status(progress={"step": 3, "loss": None}), 10)
    assert "step 3/10" in line and "loss nan" in line


# ------------------------------------------------------------------ alerts in the status round trip


def _alert(rule: str, step: int, when: float = 0.0, **kw: Any) -> dict[str, Any]:
    from meshrun.launcher.contract.records.alerts import Alert

    return Alert(
        rule, 9.0, 3.0, f"{rule} at {step}", step=step, rank=0, node="n1", time=when or time.time(), **kw
    ).record()


def test_the_remote_command_brings_each_jobs_newest_alerts_and_gpu_lines_capped(tmp_path: Path) -> None:
    from meshrun.launcher.contract.records import alerts
    from meshrun.launcher.contract.records.alerts import Alert
    from meshrun.submit.core import findings
    from meshrun.submit.transport.base import LocalTransport

    busy, quiet = tmp_path / "busy", tmp_path / "quiet"
    quiet.mkdir()
    many = [Alert("loss_spike", float(i), 3.0, "spike", step=i) for i in range(2000)]  # far over the tail cap
    alerts.append(str(busy / "alerts.jsonl"), many)
    gpu = [
        {"time": time.time(), "node": "n1", "kind": "gpu", "rank": r, "uuid": f"u{r}", "util_pct": 50 + r}
        for r in (1, 0)
    ]
    (busy / "gpu.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gpu))
    marker = new_marker()
    dirs = [str(busy), str(quiet)]
    done = LocalTransport().run(findings.findings_argv(dirs, False, marker, with_gpus=True))
    got = findings.split_findings(done.stdout, 2, marker)
    assert len(got[0][findings.ALERTS]) <= findings.TAIL_BYTES and got[1] == {}
    assert got[0] == findings.read_files(str(busy), False, with_gpus=True)  # local and remote read the same
    found = findings.findings_from(got[0], submitted_at=time.time() - 60)
    assert len(found.alerts) == findings.ALERTS_KEPT and found.alerts[-1]["step"] == 1999  # the newest, in order
    assert [g["util_pct"] for g in found.gpus] == [50, 51]  # by rank
    no_gpus = findings.split_findings(
        LocalTransport().run(findings.findings_argv(dirs, False, marker)).stdout, 2, marker
    )
    assert set(no_gpus[0]) == {findings.ALERTS}


def test_an_earlier_jobs_alerts_in_the_same_run_dir_are_not_this_jobs() -> None:
    from meshrun.submit.core import findings

    text = json.dumps(_alert("hang", 1, when=1000.0)) + "\n" + json.dumps(_alert("loss_spike", 7)) + "\n{garbled"
    found = findings.findings_from({findings.ALERTS: text}, submitted_at=time.time() - 10)
    assert [a["rule"] for a in found.alerts] == ["loss_spike"]


def test_the_list_gets_an_alerts_column_only_when_a_job_has_alerts() -> None:
    from meshrun.submit.views.tables import detail_lines, status_table

    quiet = _status(progress={"step": 3, "loss": 2.5})
    assert "ALERTS" not in status_table([quiet])
    noisy = _status(job_id="j2", alerts=[_alert("nonfinite_loss", 3), _alert("loss_spike", 5)], progress={"loss": None})
    lines = status_table([quiet, noisy]).splitlines()
    head = lines[0].split()
    assert "ALERTS" in head
    assert lines[2].split()[head.index("ALERTS")] == "2" and "2 loss_spike" in lines[2]
    assert lines[2].split()[head.index("LOSS")] == "nan"
    detail = detail_lines(noisy)
    assert (
        detail[0].startswith("alerts (2 recent") and "loss_spike step 5 rank 0 node n1: loss_spike at 5" in detail[-1]
    )


def test_json_carries_the_alert_records() -> None:
    record = _alert("gpu_util_low", 4)
    assert _status(alerts=[record]).as_json()["alerts"] == [record]


def test_wait_prints_each_new_alert_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.submit import api
    from meshrun.submit.cli import common as cli
    from meshrun.submit.core.registry import JobRecord

    first, second = _alert("loss_spike", 2), _alert("nonfinite_loss", 3)
    seq = iter(
        [
            _status(progress={"step": 2, "loss": 5.0}, alerts=[first]),
            _status(progress={"step": 3, "loss": None}, alerts=[first, second]),
            _status(state="FAILED", done=True, progress={"step": 3, "loss": None}, alerts=[first, second]),
        ]
    )
    monkeypatch.setattr(api, "statuses", lambda records, clusters, registry=None: [next(seq)])
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    out = io.StringIO()
    cli.wait_for(JobRecord("1", "c", "n", "/r", "local", 0.0, None, "h"), None, None, total_steps=5, out=out)
    lines = out.getvalue().splitlines()
    assert [line.split()[3] for line in lines if line.startswith("ALERT")] == [
        "loss_spike",
        "nonfinite_loss",
    ]
    assert lines[-1] == "[FAILED] step 3/5 loss nan"


# ------------------------------------------------------------------ top's cells


def test_top_cells_step_of_steps_time_left_and_a_non_finite_loss_in_the_sparkline() -> None:
    from meshrun.submit.core import findings
    from meshrun.submit.views import top

    assert top.sparkline([3.0, None, 2.0]) == "█!▁" and top.sparkline([None]) == "!" and top.sparkline([]) == ""
    spec = json.dumps({"job": {"command": None, "train": {"steps": 100}}})
    assert findings.parse_steps(spec) == 100
    assert findings.parse_steps(json.dumps({"job": {"command": ["sleep", "1"]}})) is None
    assert findings.parse_steps("{cut") is None
    running = _status(progress={"step": 40, "loss": None, "step_time_s": 0.5}, steps=100, losses=[2.0, None])
    cells = top.row(running)
    assert cells[4:7] == ("40/100", "nan", "▁!") and cells[top.HEAD.index("ETA")] == "0:00:30"
    # LEFT is what the time limit leaves, as in --wait's line; ETA the steps left at the step time.
    limited = _status(elapsed_s=60, time_limit_s=600)
    cells = top.row(limited)
    assert cells[9:11] == ("-", "-") and (cells[top.HEAD.index("ETA")], cells[top.HEAD.index("LEFT")]) == (
        "-",
        "0:09:00",
    )
    # GOODPUT: the job's effective training time so far, from its goodput record.
    assert top.row(_status(goodput={"effective_pct": 81.4}))[top.HEAD.index("GOODPUT")] == "81%"
    assert limited and cells[top.HEAD.index("GOODPUT")] == "-"
    huge = _status(progress={"step": 1, "step_time_s": 3.0}, steps=10**9, elapsed_s=60, time_limit_s=300)
    assert top.row(huge)[top.HEAD.index("ETA")] == ">99 days"
    assert progress_line(huge, 10**9).endswith("eta >99 days left 0:04:00 (the limit comes first)")


def test_a_wrapped_reason_keeps_an_option_name_whole() -> None:
    from meshrun.submit.views.tables import detail_lines

    said = "pyxis: the cluster has no enroot; drop the option '--container-image=nvcr.io/nvidia/pytorch:24.05-py3'"
    lines = detail_lines(_status(state="FAILED", done=True, reason=said, exit_code=2), width=100)
    assert lines == [
        "reason (exit 2, bad input): pyxis: the cluster has no enroot; drop the option",
        "  '--container-image=nvcr.io/nvidia/pytorch:24.05-py3'",
    ]


def test_status_of_one_job_says_why_it_ended_with_its_exit_codes_meaning() -> None:
    from meshrun.submit.views.tables import detail_lines

    failed = _status(state="FAILED", done=True, reason="rank 0: bad token file", exit_code=2)
    assert detail_lines(failed)[0] == "reason (exit 2, bad input): rank 0: bad token file"
    odd = _status(state="FAILED", done=True, reason="rank 1 exited with code 3", exit_code=3)
    assert detail_lines(odd)[0] == "reason (exit 3): rank 1 exited with code 3"
    gave_up = _status(state="FAILED", done=True, reason="gave up (crash loop: 2 runs in a row failed)", exit_code=77)
    assert detail_lines(gave_up)[0] == "reason (exit 77): gave up (crash loop: 2 runs in a row failed)"
    waiting = _status(state="PENDING", reason="Resources")
    assert detail_lines(waiting) == ["reason: Resources"]
    assert detail_lines(_status(state="COMPLETED", done=True, succeeded=True)) == []


def test_top_once_lists_the_running_jobs_and_the_named_ones_ended_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """`top --once` listed COMPLETED jobs (the registry still thought them running) while README says
    'every running job'."""
    from meshrun.submit import api
    from meshrun.submit.views import top

    found = [_status(job_id="run1"), _status(job_id="done1", state="COMPLETED", done=True, succeeded=True)]
    monkeypatch.setattr(api, "statuses", lambda *_a, **_k: found)
    out = io.StringIO()
    assert top.run([], None, None, out=out, once=True) == 0
    assert "run1" in out.getvalue() and "done1" not in out.getvalue()
    named = io.StringIO()
    assert top.run([], None, None, out=named, once=True, named=True) == 0
    assert "run1" in named.getvalue() and "done1" in named.getvalue()
