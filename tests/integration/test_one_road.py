"""The "one road", proven on the real parts: what `--dry-run` prints is byte for byte what the real
submit writes, and a submit over SSH plans once and renders once (counted), locally and on the real
Slurm testbed reached through the real sshd."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from meshrun.submit import api
from meshrun.submit.cli import main as cli
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.core.registry import Registry
from meshrun.submit.planning import plan as planning
from meshrun.submit.schedulers import render as rendering
from tests.helpers import sshbed


@pytest.fixture
def laptop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """In-process `meshrun` with a private home, a fixed run-dir name, and counters on plan and render."""
    for key, value in {
        "HOME": tmp_path,
        "XDG_STATE_HOME": tmp_path / "state",
        "XDG_CONFIG_HOME": tmp_path / "config",
    }.items():
        monkeypatch.setenv(key, str(value))
    name = f"road-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(
        planning,
        "run_dir_for",
        lambda spec, cluster, home, now=None: (
            f"{planning.expand_home(cluster.paths.work_dir, home).rstrip('/')}/runs/{name}"
        ),
    )
    calls = {"plan": 0, "render": 0}

    def counted(fn: Any, key: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(planning, "make_plan", counted(planning.make_plan, "plan"))
    monkeypatch.setattr(rendering, "render", counted(rendering.render, "render"))
    yield {"home": tmp_path, "calls": calls}


def _dry_run_then_submit(argv: list[str], calls: dict[str, int], capsys: pytest.CaptureFixture) -> tuple[dict, str]:
    assert cli.main([*argv, "--dry-run", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["request"]
    calls.update(plan=0, render=0)
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    run_dir = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("run dir: "))
    assert run_dir == shown["run_dir"]  # the run dir that is printed is the one that is used
    return shown, run_dir


def test_dry_run_is_what_the_local_submit_writes(laptop: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    spec = laptop["home"] / "noop.yaml"
    spec.write_text(sshbed.command_spec("noop", ["true"]))
    shown, run_dir = _dry_run_then_submit(["submit", str(spec), "-c", "local"], laptop["calls"], capsys)
    assert Path(shown["script_path"]).read_text() == shown["script"]
    assert shown["argv"] == ["bash", shown["script_path"]]
    assert {f["path"] for f in shown["files"]} <= {
        str(p) + ("/" if p.is_dir() else "") for p in Path(run_dir).rglob("*")
    }
    assert laptop["calls"] == {"plan": 1, "render": 1}


def test_over_ssh_one_plan_one_render_and_the_dry_run_is_what_is_sent(
    testbed: dict, laptop: dict[str, Any], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_CONF", raising=False)  # a laptop: the cluster only over SSH
    home = laptop["home"]
    profile = sshbed.profile(home)
    root = sshbed.project(home, {"sleeper.yaml": sshbed.command_spec("road", ["true"])})
    shown, run_dir = _dry_run_then_submit(
        ["submit", str(root / "sleeper.yaml"), "-c", str(profile)], laptop["calls"], capsys
    )
    assert laptop["calls"] == {"plan": 1, "render": 1}
    # The testbed's login node is this machine: what sbatch ran is the very file the dry run showed.
    assert Path(shown["script_path"]).read_bytes() == shown["script"].encode()
    assert shown["argv"][0] == "sbatch" and shown["argv"][-1] == shown["script_path"]
    assert not run_dir.startswith("~") and shown["code_dir"] and Path(shown["code_dir"]).is_dir()
    assert f"export MESHRUN_CODE_DIR={shown['code_dir']}" in shown["script"]


def test_the_python_api_takes_the_cli_road_over_ssh_code_snapshot_included(
    testbed: dict, laptop: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """api.submit is `meshrun submit` for a Python caller: one plan, one render, and the code snapshot put on
    the cluster and sealed before the job that runs from it is queued (once it was a second road without
    that step: its jobs refused to start)."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    home = laptop["home"]
    profile_file = sshbed.profile(home)
    root = sshbed.project(home, {"api.yaml": sshbed.command_spec("api-road", ["true"])})
    profile = load_profile(str(profile_file))
    plan = api.plan_job(root / "api.yaml", profile)
    assert not api.is_local(profile) and plan.code_dir is None  # the folder is known once the cluster is asked
    transport = api.connect(profile.ssh, str(profile_file))
    try:
        (record,) = api.submit(plan, Registry(), transport, spec_dir=root, profile_path=str(profile_file))
    finally:
        transport.close()
    assert laptop["calls"] == {"plan": 1, "render": 1}
    script = Path(record.run_dir, "job.sbatch").read_text()
    code_dir = next(
        line.split("=", 1)[1] for line in script.splitlines() if line.startswith("export MESHRUN_CODE_DIR=")
    )
    assert Path(code_dir, "api.yaml").is_file()  # uploaded before sbatch: the job finds its code
    assert Registry().find(record.job_id).run_dir == record.run_dir  # recorded as the CLI records it
