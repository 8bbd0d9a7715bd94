"""The live views against real jobs: `meshrun watch --notify` runs its command exactly once per new
alert (across a restart of watch too), and `meshrun top` in a real terminal (tmux) shows what the run dirs
hold. Locally here; over SSH against the Slurm testbed in test_ssh_alerts_live.py.

The jobs are command jobs that idle until told to stop; the test writes alerts.jsonl, metrics.jsonl and
gpu.jsonl lines into their run dirs, as rank 0 and the sidecars would (the same appenders' formats)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import yaml

from meshrun.launcher.contract.records import alerts
from meshrun.launcher.contract.records.alerts import Alert
from tests.helpers.cli import REPO, env_for, meshrun, submitted

IDLE = 'touch "$MESHRUN_RUN_DIR/up"; while [ ! -e "$MESHRUN_RUN_DIR/stop" ]; do sleep 0.2; done'


def idle_spec(tmp_path: Path, name: str) -> Path:
    spec = {
        "name": name,
        "resources": {"nodes": 1, "tasks_per_node": 1, "time": "00:10:00"},
        "command": ["bash", "-c", IDLE],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def until(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return found


def notify_script(tmp_path: Path) -> tuple[Path, Path]:
    """A notify command appending its stdin (one JSON line, newline included) to a file."""
    script, out = tmp_path / "notify.sh", tmp_path / "notified.jsonl"
    script.write_text('#!/bin/sh\ncat >> "$1"\n')
    return script, out


def notified(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def spike(step: int) -> Alert:
    return Alert("loss_spike", 9.5, 3.0, f"the loss spiked at step {step}", step=step, rank=0, node="n1")


def start_watch(home: Path, job: str, *extra: str, laptop: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshrun.submit.cli.main", "watch", job, "--interval", "0.5", *extra],
        env=env_for(home, laptop),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_watch(home: Path, tmp_path: Path, job: str, run_dir: Path, laptop: bool = False) -> None:
    """Two alerts, then a third while watch runs, then watch restarted (from the user's config) with a
    fourth: the notify command ran exactly once for each, with the job named."""
    script, out = notify_script(tmp_path)
    alerts.append(str(run_dir / "alerts.jsonl"), [spike(1), spike(2)])
    first = start_watch(home, job, "--notify", f"sh {script} {out}", laptop=laptop)
    try:
        until(lambda: len(notified(out)) >= 2, f"two notifications in {out}")
        alerts.append(str(run_dir / "alerts.jsonl"), [spike(3)])
        until(lambda: len(notified(out)) >= 3, "the third alert's notification")
        time.sleep(1.5)  # three more refreshes: none may notify again
    finally:
        first.terminate()
        first.wait(10)
    config = home / "config" / "meshrun" / "config.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump({"notify": ["sh", str(script), str(out)]}))
    alerts.append(str(run_dir / "alerts.jsonl"), [spike(4)])
    second = start_watch(home, job, laptop=laptop)
    until(lambda: len(notified(out)) >= 4, "the fourth alert's notification after the restart")
    (run_dir / "stop").touch()  # the job ends: watch returns
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr
    rows = notified(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows  # exactly once each, in order
    assert {(r["job_id"], r["rule"], r["name"]) for r in rows} == {(job, "loss_spike", "alerting")}
    assert "loss_spike step 4" in stdout and "step 1" not in stdout  # the restart printed only the new one
    assert stdout.rstrip().endswith("ended COMPLETED") and f"watching 1 job(s) until they end ({job})" in stderr


def test_watch_notifies_each_alert_exactly_once_locally(tmp_path: Path) -> None:
    home = tmp_path / "home"
    job, run_dir = submitted(meshrun(home, "submit", str(idle_spec(tmp_path, "alerting")), "-c", "local", check=True))
    until(lambda: (run_dir / "up").exists(), "the job started")
    check_watch(home, tmp_path, job, run_dir)


def test_a_job_that_fails_gets_one_digest_with_its_reason_goodput_and_commands(tmp_path: Path) -> None:
    """A failure is one notification holding what a person needs (a real local job, the real loop)."""
    home = tmp_path / "home"
    spec = tmp_path / "failing.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "failing",
                "resources": {"nodes": 1, "tasks_per_node": 1, "time": "00:10:00"},
                "command": ["bash", "-c", "sleep 2; echo broken >&2; exit 3"],
            }
        )
    )
    job, _ = submitted(meshrun(home, "submit", str(spec), "-c", "local", check=True))
    script, out = notify_script(tmp_path)
    watching = start_watch(home, job, "--notify", f"sh {script} {out}")
    stdout, stderr = watching.communicate(timeout=120)
    assert watching.returncode == 0, stderr
    (record,) = notified(out)
    assert record["event"] == "failed" and record["job_id"] == job and record["state"] == "FAILED", record
    assert record["goodput"] is not None and record["goodput"]["allocated_s"] > 0, record
    assert record["commands"]["status"] == f"meshrun status {job}" and "cancel" not in record["commands"], record
    assert f"{job} (local, failing) ended FAILED" in stdout and record["text"] in stdout


def test_a_bad_notify_setting_is_refused_with_exit_2(tmp_path: Path) -> None:
    home = tmp_path / "home"
    done = meshrun(home, "watch", "x", "--notify", "no-such-program-xyz --flag")
    assert done.returncode == 2 and "--notify" in done.stderr and "no-such-program-xyz" in done.stderr
    config = home / "config" / "meshrun" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("notifi: [true]\n")
    done = meshrun(home, "watch", "x")
    assert done.returncode == 2 and "config.yaml:1" in done.stderr and "did you mean 'notify'" in done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ top, as a person sees it


def write_progress(run_dir: Path, losses: list[float], gpus: list[tuple[int, float, float]]) -> None:
    """Metrics lines as rank 0 writes them, and one gpu.jsonl sample per GPU as the sidecar does."""
    now = time.time()
    rows = [
        {"step": i + 1, "loss": loss, "tokens_per_s": 12345.0 + i, "mfu": 0.41, "step_time_s": 2.0, "time": now}
        for i, loss in enumerate(losses)
    ]
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    samples = [
        {
            "time": now,
            "node": "n1",
            "kind": "gpu",
            "rank": rank,
            "uuid": f"GPU-{rank}",
            "util_pct": util,
            "mem_used_mib": used,
            "mem_total_mib": 81920,
        }
        for rank, util, used in gpus
    ]
    with open(run_dir / "gpu.jsonl", "a") as handle:
        handle.write("".join(json.dumps(s) + "\n" for s in samples))


class Terminal:
    """A real terminal: tmux on its own socket, 200x50."""

    def __init__(self, tmp_path: Path, home: Path, argv: list[str], laptop: bool = False) -> None:
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed (tests/testbed/install.sh installs it)")
        self.socket = str(tmp_path / "tmux.sock")
        env = env_for(home, laptop)
        keep = ("HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "PATH", "PYTHONPATH", "SLURM_CONF", "MESHRUN_TESTBED_VENV")
        assigns = [f"{k}={env[k]}" for k in keep if k in env]
        command = [
            "env",
            "-i",
            *assigns,
            "TERM=xterm-256color",
            "LANG=C.UTF-8",
            sys.executable,
            "-m",
            "meshrun.submit.cli.main",
            *argv,
        ]
        subprocess.run(
            ["tmux", "-S", self.socket, "new-session", "-d", "-x", "200", "-y", "50", "-c", str(REPO), *command],
            check=True,
        )

    def screen(self) -> str:
        done = subprocess.run(["tmux", "-S", self.socket, "capture-pane", "-p"], capture_output=True, text=True)
        return done.stdout

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def row_of(screen: str, job: str) -> Optional[list[str]]:
    lines = screen.splitlines()
    head = next((line.split() for line in lines if line.startswith("JOB ")), None)
    line = next((line for line in lines if line.startswith(job + " ")), None)
    if head is None or line is None:
        return None
    return line.split()


def check_top(tmp_path: Path, home: Path, job: str, run_dir: Path, laptop: bool = False) -> None:
    losses = [3.0, 2.8, 2.9, 2.5, 2.2, 2.4, 2.0]
    write_progress(run_dir, losses, [(0, 60.0, 40960), (1, 70.0, 20480)])
    alerts.append(str(run_dir / "alerts.jsonl"), [spike(6)])
    term = Terminal(tmp_path, home, ["top", job], laptop=laptop)
    try:
        cells = until(lambda: row_of(term.screen(), job), f"top's row for {job}:\n{term.screen()}", timeout=90)
        # JOB NAME CLUSTER STATE STEP LOSS HISTORY TOK/S MFU GPU MEM LEFT RST GOODPUT USED ALERTS ("1 loss_spike")
        assert cells[3] == "RUNNING" and cells[4] == "7" and cells[5] == "2.0000", cells
        assert cells[6] == "█▆▇▄▂▃▁", cells  # the losses 3.0 .. 2.0 scaled to 8 bar heights
        assert cells[7] == "12,351" and cells[8] == "41.0%" and cells[9] == "65%" and cells[10] == "60.0/160G", cells
        assert cells[-2:] == ["1", "loss_spike"] and cells[-5] == "0", cells
        assert cells[-4] == "-" or cells[-4].endswith("%"), cells  # GOODPUT: none yet, or node 0's sidecar's
        assert cells[-3] == "-", cells  # USED: a CPU job, unpriced, its energy unmeasured
        assert "\x1b" not in term.screen()  # capture-pane shows the drawn screen, not codes
        write_progress(run_dir, [1.5], [(0, 90.0, 40960), (1, 90.0, 20480)])  # the metrics file grows
        cells = until(
            lambda: (c := row_of(term.screen(), job)) and c[5] == "1.5000" and c,
            f"top refreshed:\n{term.screen()}",
            timeout=30,
        )
        assert cells[4] == "1" and cells[9] == "90%", cells  # the newest line's step; the newest GPU samples
    finally:
        term.close()
    plain = meshrun(home, "top", job, laptop=laptop, check=True).stdout  # a pipe: one refresh, plain lines
    assert "\x1b" not in plain and plain.splitlines()[0].startswith("JOB") and f"{job} " in plain


def test_top_in_a_real_terminal_shows_the_run_dir_numbers_locally(tmp_path: Path) -> None:
    home = tmp_path / "home"
    job, run_dir = submitted(meshrun(home, "submit", str(idle_spec(tmp_path, "topped")), "-c", "local", check=True))
    until(lambda: (run_dir / "up").exists(), "the job started")
    try:
        check_top(tmp_path, home, job, run_dir)
    finally:
        (run_dir / "stop").touch()
