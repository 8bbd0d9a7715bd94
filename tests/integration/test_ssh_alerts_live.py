"""The live views over SSH against the real Slurm testbed: `meshrun watch --notify` runs its command
exactly once per new alert (across a restart too) and `meshrun top` in a real terminal (tmux) shows what
the run dir holds, each refresh one round trip. The laptop has no Slurm: the cluster only over sshd."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import sshbed
from tests.helpers.cli import submitted
from tests.helpers.sshbed import meshrun
from tests.integration.test_alerts_live import IDLE, check_top, check_watch, until


def _idle_job(tmp_path: Path, name: str) -> tuple[Path, str, Path]:
    home = tmp_path / "laptop"
    profile = sshbed.profile(tmp_path)
    root = sshbed.project(tmp_path, {f"{name}.yaml": sshbed.command_spec(name, ["bash", "-c", IDLE])})
    job, run_dir = submitted(meshrun(home, "submit", str(root / f"{name}.yaml"), "-c", str(profile), check=True))
    until(lambda: (run_dir / "up").exists(), f"job {job} started on the testbed", timeout=120)
    return home, job, run_dir


def test_watch_notifies_each_alert_exactly_once_over_ssh(testbed: dict, tmp_path: Path) -> None:
    home, job, run_dir = _idle_job(tmp_path, "alerting")
    check_watch(home, tmp_path, job, run_dir, laptop=True)


def test_top_in_a_real_terminal_over_ssh(testbed: dict, tmp_path: Path) -> None:
    home, job, run_dir = _idle_job(tmp_path, "topped")
    try:
        before = sshbed.logins()
        check_top(tmp_path, home, job, run_dir, laptop=True)
        # One connection for top's whole session (and one for its plain run), however many refreshes.
        assert sshbed.logins() - before == 2
    finally:
        (run_dir / "stop").touch()
