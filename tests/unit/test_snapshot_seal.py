"""A published code snapshot is never removed or replaced, bytecode does not break its seal, and the batch
script refuses to start from a folder that is not the sealed snapshot. Real shell, real files (the login
node's side, through LocalTransport: the same scripts run over SSH)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import Code
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.schedulers.render import render
from meshrun.submit.schedulers.slurm import BACKEND as SLURM
from meshrun.submit.transport import snapshot
from meshrun.submit.transport.base import LocalTransport

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny.yaml"


def _project(tmp_path: Path) -> snapshot.Snapshot:
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("X = 41\n")
    (root / "train.py").write_text("import pkg.mod\nprint(pkg.mod.X + 1)\n")
    snap = snapshot.collect(root, Code(root="."))
    assert snap is not None
    return snap


def _published(tmp_path: Path) -> tuple[snapshot.Snapshot, Path, str]:
    """The project uploaded (as a first submit does): (snapshot, work dir, its folder)."""
    snap, work = _project(tmp_path), tmp_path / "work"
    _, found = snapshot.probe(LocalTransport(), str(work), snap)
    assert found is not None and not found.present and found.name == snap.digest and not found.changed
    code_dir = snapshot.remote_dir(str(work), snap, found.name)
    assert snapshot.sync(LocalTransport(), snap, code_dir, present=found.present) is True
    return snap, work, code_dir


def test_bytecode_a_job_writes_keeps_the_snapshot_sealed_and_reused(tmp_path: Path) -> None:
    snap, work, code_dir = _published(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([sys.executable, "train.py"], cwd=code_dir, env=env, capture_output=True, text=True)
    assert done.stdout == "42\n" and list(Path(code_dir).glob("pkg/__pycache__/mod.*.pyc")), done.stderr
    _, found = snapshot.probe(LocalTransport(), str(work), snap)
    assert found == snapshot.Found(name=snap.digest, present=True)  # the same folder, nothing to upload
    assert snapshot.sync(LocalTransport(), snap, code_dir, present=found.present) is False


def test_a_changed_snapshot_is_left_in_place_and_the_code_goes_to_a_new_folder(tmp_path: Path) -> None:
    snap, work, code_dir = _published(tmp_path)
    (Path(code_dir) / "out.txt").write_text("a job's output, written in its working folder\n")
    _, found = snapshot.probe(LocalTransport(), str(work), snap)
    assert found is not None and not found.present and found.name == f"{snap.digest}-1"
    assert found.changed == ((snap.digest, "extra out.txt"),)
    (warning,) = snapshot.changed_warning(str(work), found)
    assert f"{code_dir} changed since it was uploaded: it holds out.txt, which was never uploaded" in warning
    assert "left as it is" in warning and f"runs from {code_dir}-1" in warning and "only yours" not in warning
    assert snapshot.sync(LocalTransport(), snap, snapshot.remote_dir(str(work), snap, found.name)) is True
    # The first folder is untouched: a job running from it keeps every file.
    assert (Path(code_dir) / "out.txt").exists() and (Path(code_dir) / "pkg" / "mod.py").read_text() == "X = 41\n"
    _, again = snapshot.probe(LocalTransport(), str(work), snap)
    assert again is not None and again.present and again.name == f"{snap.digest}-1"  # found, not uploaded again
    (Path(code_dir) / "out.txt").unlink()
    (Path(code_dir) / "pkg" / "mod.py").write_text("X = 0\n")
    _, edited = snapshot.probe(LocalTransport(), str(work), snap)
    assert edited is not None and edited.changed == ((snap.digest, "content pkg/mod.py"),)


def test_publishing_never_replaces_a_folder_that_does_not_verify(tmp_path: Path) -> None:
    snap, work, code_dir = _published(tmp_path)
    (Path(code_dir) / "pkg" / "mod.py").write_text("X = 0\n")
    try:
        snapshot.sync(LocalTransport(), snap, code_dir, present=False)
    except Exception as exc:
        assert "appeared meanwhile and does not verify" in str(exc) and "left as it is" in str(exc)
    else:
        raise AssertionError("a changed folder was replaced")
    assert (Path(code_dir) / "pkg" / "mod.py").read_text() == "X = 0\n"
    assert [p.name for p in (work / "code").iterdir()] == [snap.digest]  # no temporary folder left


def test_render_read_only_probe_writes_nothing(tmp_path: Path) -> None:
    snap = _project(tmp_path)
    _, found = snapshot.probe(LocalTransport(), str(tmp_path / "work"), snap, read_only=True)
    assert found == snapshot.Found(name=snap.digest, present=False) and not (tmp_path / "work").exists()


def _check_block(script: str) -> str:
    """The batch script's lines from the code exports to the end of the snapshot check."""
    lines = script.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("export MESHRUN_CODE_DIR="))
    end = next(i for i in range(start, len(lines)) if lines[i] == "fi")
    return "\n".join(lines[start : end + 1])


def _run_check(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "MESHRUN_RUN_DIR": str(run_dir)}
    body = "set -uo pipefail\n" + _check_block(script) + '\necho "ranks start in $MESHRUN_CODE_DIR"'
    return subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)


def test_the_batch_script_starts_only_from_its_sealed_snapshot(tmp_path: Path) -> None:
    snap = _project(tmp_path)
    work = tmp_path / "work"
    plan = plan_file(TINY, load_profile("testbed"), home="/h", run_dir=str(tmp_path / "run"))
    code_dir = snapshot.remote_dir(str(work), snap)
    script = render(
        dataclasses.replace(plan, code_dir=code_dir, code_seal=(snap.manifest_sha, snap.listing_sha)), SLURM
    )
    assert "export PYTHONDONTWRITEBYTECODE=1\n" in script  # the ranks write no bytecode into the snapshot
    missing = _run_check(tmp_path, script)  # rendered, never uploaded (a hand-submitted `render -o` script)
    assert missing.returncode == 2 and missing.stdout == "", missing
    assert missing.stderr.count("\n") == 1 and f"code snapshot {code_dir}: missing" in missing.stderr
    assert "`meshrun submit`" in missing.stderr
    assert Path(RunDir(str(tmp_path / "run")).rank_error).read_text() == missing.stderr  # status shows why
    assert snapshot.sync(LocalTransport(), snap, code_dir) is True
    ok = _run_check(tmp_path, script)
    assert ok.returncode == 0 and ok.stdout == f"ranks start in {code_dir}\n", ok
    (Path(code_dir) / "out.txt").write_text("a job's output\n")  # beside the sealed files: a requeue starts
    (Path(code_dir) / "wandb").mkdir()
    os.symlink("run-1", Path(code_dir) / "wandb" / "latest-run")  # as wandb writes into its working folder
    assert _run_check(tmp_path, script).returncode == 0
    (Path(code_dir) / "train.py").write_text("print(0)\n")  # a sealed file changed: not the sealed snapshot
    assert _run_check(tmp_path, script).returncode == 2
    (Path(code_dir) / "train.py").write_text("import pkg.mod\nprint(pkg.mod.X + 1)\n")
    assert _run_check(tmp_path, script).returncode == 0
    (Path(code_dir) / "pkg").chmod(0o770)  # writable by the group: anyone in it could plant code
    assert _run_check(tmp_path, script).returncode == 2
