"""The sidecar's alerts end to end on `local`: a real straggler and a real hang (launcher/testing/faults.py), found by
the real sidecar, each one `straggler` / `hang` line in RUN_DIR/alerts.jsonl and one line in its log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS
from meshrun.launcher.contract.records import alerts
from meshrun.launcher.contract.records.rundir import RunDir, node_name
from tests.helpers.cli import (
    FAST_WATCH,
    SLOW_RANK_1,
    STRAGGLER_FACTOR,
    TINY,
    meshrun,
    submitted,
    wait_for_state,
    wait_for_step,
)


def sidecar_alerts(run_dir: Path, rule: str) -> list[dict[str, Any]]:
    return [r for r in alerts.read(RunDir(str(run_dir)).alerts) if r["rule"] == rule]


def test_a_straggler_is_one_alert_line_and_one_log_line(tmp_path: Path, corpus: Path) -> None:
    args = [*TINY, "--set", f"data.path={corpus}", "--set", "train.steps=100000", *FAST_WATCH]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, *SLOW_RANK_1, check=True))
    deadline = time.monotonic() + 90
    try:
        while not sidecar_alerts(run_dir, "straggler"):
            assert time.monotonic() < deadline, "no straggler alert"
            time.sleep(0.5)
        time.sleep(3)  # three more checks: the same streak raises nothing more
        (alert,) = sidecar_alerts(run_dir, "straggler")
    finally:
        meshrun(tmp_path, "cancel", job_id)
        wait_for_state(tmp_path, job_id, {"CANCELLED", "FAILED", "COMPLETED"})  # its processes gone with it
    named = json.loads(Path(RunDir(str(run_dir)).stragglers).read_text())["stragglers"]
    assert alert["rank"] == 1 and alert["node"] == node_name({}) and alert["threshold"] == STRAGGLER_FACTOR, alert
    assert alert["value"] > STRAGGLER_FACTOR and any(s["rank"] == 1 for s in named), (alert, named)
    assert isinstance(alert["step"], int) and alert["step"] > 0, alert
    log = Path(RunDir(str(run_dir)).sidecar_log(node_name({}))).read_text()
    assert log.count("ALERT straggler") == 1 and f"rank 1: {alert['message']}" in log, log[-2000:]


def test_a_hang_is_one_alert_with_the_verdicts_first_sentence(tmp_path: Path, corpus: Path) -> None:
    args = [*TINY, "--set", f"data.path={corpus}", "--set", "train.steps=1000", *FAST_WATCH]
    # Step 120, not earlier: the watch times a step only once it has seen 3 step durations (before, a step
    # gets the setup timeout), and on a loaded 2-core CI machine the sidecar can start after step 30
    # (~2 s into training), which left the hang to the 1200 s setup timeout and failed this test.
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, "--set", "env.MESHRUN_TEST_HANG=1:120", check=True))
    wait_for_step(run_dir, 119)
    row = wait_for_state(tmp_path, job_id, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=120)
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_NO_PROGRESS, row
    verdict = json.loads(Path(RunDir(str(run_dir)).verdict_json).read_text())
    (alert,) = sidecar_alerts(run_dir, "hang")
    assert alert["message"] == verdict["verdict"].split(". ")[0] + ".", (alert, verdict["verdict"])
    assert alert["message"].startswith("Hang at step 120 (phase step), found by "), alert
    assert (alert["rank"], alert["node"], alert["step"]) == (1, node_name({}), 120), alert
    assert alert["value"] == verdict["silent_s"] and alert["threshold"] == verdict["timeout_s"], alert
    log = Path(RunDir(str(run_dir)).sidecar_log(node_name({}))).read_text()
    assert log.count("ALERT hang") == 1, log[-2000:]
