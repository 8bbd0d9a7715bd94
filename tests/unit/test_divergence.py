"""The nonfinite_loss alert names what went non-finite: the loss, the grad norm, or both."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.train import divergence


@pytest.mark.parametrize(
    "loss, grad_norm, named",
    [
        (math.nan, 2.0, "the loss went non-finite"),
        (4.25, math.nan, "the grad norm went non-finite"),
        (math.inf, math.nan, "the loss and grad norm went non-finite"),
        (4.25, 2.0, "the loss went non-finite"),  # another rank's loss: this rank's values are finite
        (None, None, "the loss went non-finite"),
    ],
)
def test_the_alert_names_what_was_not_finite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], loss: float | None, grad_norm: float | None, named: str
) -> None:
    divergence.report(str(tmp_path), 7, 5, loss, grad_norm, "n1")
    (line,) = Path(RunDir(str(tmp_path)).alerts).read_text().splitlines()
    message = json.loads(line)["message"]
    assert message.startswith(f"{named} at step 7") and "continues from the newest checkpoint, step 5" in message
    assert "ALERT nonfinite_loss step 7" in capsys.readouterr().out


def test_with_no_checkpoint_saved_the_alert_says_resume_starts_from_step_0(tmp_path: Path) -> None:
    """A new user's trial: a job diverged at step 2 before any save, and the alert and the status reason said
    resume "continues from the last finite checkpoint" (there was none)."""
    divergence.report(str(tmp_path), 2, None, math.nan, None, "n1")
    message = json.loads(Path(RunDir(str(tmp_path)).alerts).read_text())["message"]
    assert "starts it again from step 0 (no checkpoint was saved)" in message and "newest" not in message, message
