"""Issue 14's views: the --wait progress line, the ALERTS column, status JOB's alerts, the findings round trip."""

from __future__ import annotations

from typing import Any

from submit.cli import progress_line
from submit.status import Status


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
