"""The profile's work_dir on the real Slurm testbed (and over the real sshd): a failed sbatch leaves no run dir
in it, a `%` in it is not a pattern, `render` over SSH shows the login node's real home for `~`."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from tests.helpers import sshbed
from tests.helpers.cli import REPO, meshrun, submitted
from tests.testbed import testbed as tb


def _testbed_profile(tmp_path: Path, **paths: str) -> Path:
    data = yaml.safe_load((REPO / "cluster_configs" / "testbed.yaml").read_text())
    data["paths"] = {**data["paths"], **paths}
    path = tmp_path / "mybed.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_failed_sbatch_leaves_no_run_dir(testbed: dict, tmp_path: Path) -> None:
    """Item 21: a partition the profile lists but Slurm does not have: sbatch fails, nothing is left."""
    work = tmp_path / "work"
    profile = _testbed_profile(tmp_path, work_dir=str(work))
    data = yaml.safe_load(profile.read_text())
    data["partitions"][0]["name"] = "gpu"
    profile.write_text(yaml.safe_dump(data))
    spec = tmp_path / "job.yaml"
    spec.write_text(sshbed.command_spec("no-such-partition", ["true"]))
    # The preflight refuses it first (Slurm's own words, exit 2), before anything is written ...
    out = meshrun(tmp_path, "submit", str(spec), "-c", str(profile))
    assert out.returncode == 2 and "Invalid partition name specified" in out.stderr, out.stdout + out.stderr
    assert not (work / "runs").exists() or list((work / "runs").iterdir()) == []
    # ... and past it (--no-check), the failed sbatch leaves nothing behind either.
    out = meshrun(tmp_path, "submit", str(spec), "-c", str(profile), "--no-check")
    assert out.returncode == 1 and "sbatch failed" in out.stderr, out.stdout + out.stderr
    assert list((work / "runs").iterdir()) == []
    assert "Traceback" not in out.stderr


def test_a_percent_sign_in_the_work_dir_is_no_pattern(testbed: dict, tmp_path: Path) -> None:
    """Item 23: `%` in work_dir went unescaped into --output: the job failed at once with no log."""
    profile = _testbed_profile(tmp_path, work_dir=str(tmp_path / "100%j-work"))
    spec = tmp_path / "job.yaml"
    spec.write_text(sshbed.command_spec("percent", ["echo", "hello from the rank"]))
    out = meshrun(tmp_path, "submit", str(spec), "-c", str(profile), "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    assert "%j" in str(run_dir)
    assert "hello from the rank" in (run_dir / "logs" / "rank-0.log").read_text()
    assert (run_dir / "logs" / f"slurm-{job_id}.out").is_file()


def test_render_over_ssh_shows_the_login_nodes_real_home(testbed: dict, tmp_path: Path) -> None:
    """Item 24: `~` was shown as /home/USER; the script must use the home the login node reports."""
    profile = sshbed.profile(tmp_path)
    data = yaml.safe_load(profile.read_text())
    data["paths"]["work_dir"] = "~/meshrun-render-check"
    profile.write_text(yaml.safe_dump(data))
    spec = tmp_path / "job.yaml"
    spec.write_text(sshbed.command_spec("render-home", ["true"]))
    out = sshbed.meshrun(tmp_path, "render", str(spec), "-c", str(profile), check=True)
    real_home = os.path.expanduser(f"~{tb.ssh_info()['user']}")
    assert f"export MESHRUN_RUN_DIR={real_home}/meshrun-render-check/runs/render-home-" in out.stdout
    assert not Path(real_home, "meshrun-render-check").exists()  # render wrote nothing on the cluster
