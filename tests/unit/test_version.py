"""One meshrun version, from the installed distribution, travels with the job: the script's header and
spec.json record it, and a rank that runs another meshrun says so in one line of its log."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib

import meshrun.launcher as launcher
import meshrun.submit as submit
from meshrun.launcher.contract.spec.job import loads_run_spec, write_run_spec
from meshrun.launcher.rank.entry import version_mismatch
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers.render import render
from meshrun.submit.schedulers.slurm import BACKEND as SLURM

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_both_sides_read_the_one_version_of_pyproject() -> None:
    assert submit.__version__ == launcher.__version__ == VERSION


def test_script_header_and_spec_json_record_the_rendering_version(tmp_path: Path) -> None:
    plan = plan_file(REPO / "examples" / "tiny.yaml", load_profile("testbed"), run_dir=str(tmp_path / "run"))
    assert plan.run_spec.run.meshrun_version == VERSION
    script = render(plan, SLURM)
    assert script.splitlines()[1].startswith(f"# Rendered by meshrun {VERSION} for cluster testbed")
    assert f'"meshrun_version": "{VERSION}"' in script  # the spec.json the script carries


def test_a_spec_json_from_before_the_version_record_still_loads(tmp_path: Path) -> None:
    plan = plan_file(REPO / "examples" / "tiny.yaml", load_profile("local"), run_dir=str(tmp_path / "run"))
    data = json.loads(json.dumps(dataclasses.asdict(plan.run_spec)))
    del data["run"]["meshrun_version"]
    assert loads_run_spec(json.dumps(data), "spec.json").run.meshrun_version == ""


def test_mismatch_line_names_both_versions_and_only_when_they_differ() -> None:
    line = version_mismatch("0.1.0", "0.2.0")
    assert line is not None and "\n" not in line
    assert "this rank runs meshrun 0.2.0" in line and "rendered by meshrun 0.1.0" in line
    assert version_mismatch("0.1.0", "0.1.0") is None
    assert version_mismatch("", "0.1.0") is None  # an old spec.json recorded none: nothing to compare


def _rank_log(tmp_path: Path, rendered_by: str) -> str:
    """stdout of a real rank (`command:` job, one process) whose spec.json says `rendered_by`."""
    run_dir = tmp_path / rendered_by.replace(".", "_")
    run_dir.mkdir()
    plan = plan_file(REPO / "examples" / "command.yaml", load_profile("local"), run_dir=str(run_dir))
    run = dataclasses.replace(plan.run_spec.run, meshrun_version=rendered_by)
    write_run_spec(dataclasses.replace(plan.run_spec, run=run), run_dir)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SUBMITIT_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    code = f"from meshrun.launcher.rank.entry import run_rank; raise SystemExit(run_rank({str(run_dir)!r}, replace_process=False))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_rank_running_another_meshrun_says_so_in_one_line(tmp_path: Path) -> None:
    lines = [l for l in _rank_log(tmp_path, "0.0.1").splitlines() if "version mismatch" in l]
    assert lines == [
        f"[meshrun] version mismatch: this rank runs meshrun {VERSION}, the job was rendered by "
        "meshrun 0.0.1; install the same meshrun on the cluster and where you submit"
    ]
    assert "version mismatch" not in _rank_log(tmp_path, VERSION)


def test_the_version_is_read_without_importlib_metadata_and_agrees_with_it(tmp_path: Path) -> None:
    """The installed dist-info's METADATA read directly (importlib.metadata's email parsers cost every render
    ~10 ms): the same answer, and importlib.metadata is left unimported; a tree without one still answers."""
    from importlib import metadata

    from meshrun.launcher.contract import version

    assert version._dist_info_version() == metadata.version("meshrun") == VERSION
    code = "import sys; from meshrun.launcher.contract import version; print(version.installed_version(), 'importlib.metadata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.split() == [VERSION, "False"]
