"""`meshrun watch`'s own pieces: the notify command's input and its one-line errors, and the lines a
person following jobs sees (the live loop against real jobs is tests/integration/test_alerts_live.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from submit.errors import InputError
from submit.jobs.state import JobState
from submit.jobs.status import Status
from submit.views import watch


def _status(**kw: Any) -> Status:
    base: dict[str, Any] = dict(
        job_id="j1", cluster="local", name="n", state=JobState.RUNNING, run_dir="/r", submitted_at=0.0,
        done=False, succeeded=False,
    )  # fmt: skip
    return Status(**{**base, **kw})


def test_the_notify_input_is_one_json_line_ending_in_a_newline() -> None:
    data = watch.payload(_status(), {"rule": "loss_spike", "step": 3})
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert json.loads(data) == {"rule": "loss_spike", "step": 3, "job_id": "j1", "cluster": "local", "name": "n"}


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: "no-such-program-xyz", "on PATH"),
        (lambda d: str(d / "missing" / "cmd"), "no such file; check the path"),
        (lambda d: str(d), "a folder, not a program"),
        (lambda d: str(d / "plain.sh"), "chmod u+x"),
    ],
    ids=["bare-name", "missing-path", "folder", "not-executable"],
)
def test_a_notify_command_that_cannot_run_says_why(tmp_path: Path, make: Any, says: str) -> None:
    (tmp_path / "plain.sh").write_text("#!/bin/sh\n")
    program = make(tmp_path)
    with pytest.raises(InputError) as caught:
        watch.notify_argv(f"{program} --flag", None)
    assert says in str(caught.value) and program in str(caught.value) and "--notify" in str(caught.value)
    if "/" in program:
        assert "PATH" not in str(caught.value)  # a path is not looked up on PATH: do not send the user there


def test_an_executable_path_is_taken_as_it_is(tmp_path: Path) -> None:
    script = tmp_path / "notify.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o700)
    assert watch.notify_argv(f"{script} a 'b c'", None) == [str(script), "a", "b c"]


def test_each_job_that_ends_gets_one_line_with_why_it_failed() -> None:
    out, ended = io.StringIO(), set()
    running = _status(job_id="a")
    watch.report_ends([running, _status(job_id="b", state=JobState.COMPLETED, done=True, succeeded=True)], ended, out)
    failed = _status(job_id="a", state=JobState.FAILED, done=True, reason="rank 1: killed by SIGKILL")
    watch.report_ends([failed, _status(job_id="b", state=JobState.COMPLETED, done=True, succeeded=True)], ended, out)
    assert out.getvalue().splitlines() == [
        "b (local) ended COMPLETED",
        "a (local) ended FAILED: rank 1: killed by SIGKILL",
    ]
