"""Folders meshrun creates on the way to a run dir or a snapshot are private to the user (0700): on a
shared login node, a 0755 work dir lets everyone list runs and read what is not locked down."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from meshrun.launcher.contract import private
from meshrun.launcher.contract.spec.job import Code
from meshrun.submit.transport import snapshot
from meshrun.submit.transport.base import PUT_SCRIPT, LocalTransport, Upload

REPO = Path(__file__).resolve().parents[2]


def _modes(top: Path, *rels: str) -> list[str]:
    return [oct(top.joinpath(rel).stat().st_mode & 0o777) for rel in rels]


def test_local_put_makes_every_new_parent_private(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask: what os.makedirs would use for the parents
    try:
        LocalTransport().put({"a.txt": Upload(b"x")}, str(tmp_path / "work" / "runs" / "job-1"))
    finally:
        os.umask(old)
    assert _modes(tmp_path, "work", "work/runs", "work/runs/job-1") == ["0o700"] * 3


def test_remote_put_script_makes_every_new_parent_private(tmp_path: Path) -> None:
    """PUT_SCRIPT is what runs on the login node over SSH: `mkdir -p -m` sets the mode of the leaf only."""
    subprocess.run(
        ["sh", "-c", f"umask 022; {PUT_SCRIPT}", "sh", str(tmp_path / "w" / "runs" / "r")], input=b"", check=False
    )
    assert _modes(tmp_path, "w", "w/runs", "w/runs/r") == ["0o700"] * 3


def test_snapshot_on_the_login_node_makes_work_dir_runs_and_code_private(tmp_path: Path) -> None:
    root = tmp_path / "project"
    root.mkdir()
    (root / "a.py").write_text("A = 1\n")
    snap = snapshot.collect(root, Code(root="."))
    work = tmp_path / "work"
    code_dir = snapshot.remote_dir(str(work), snap)
    old = os.umask(0o022)
    try:
        assert snapshot.sync(LocalTransport(), snap, code_dir) is True
        assert snapshot.sync(LocalTransport(), snap, code_dir) is False  # verified, reused
    finally:
        os.umask(old)
    assert _modes(tmp_path, "work", "work/runs", "work/code", f"work/code/{snap.digest}") == ["0o700"] * 4


def test_the_private_folder_helper_ignores_the_umask_and_leaves_folders_above_alone(tmp_path: Path) -> None:
    """meshrun.launcher.contract.private: the one helper every folder meshrun makes goes through."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    old = os.umask(0)
    try:
        private.make_private_dir(shared / "a" / "b")
        mine = tmp_path / "mine"
        mine.mkdir()  # 0777 under umask 000: a folder the user named keeps its mode, what is made below is 0700
        private.make_private_dir(mine / "out", keep_existing=True)
        private.make_private_dir(mine, keep_existing=True)
    finally:
        os.umask(old)
    assert _modes(tmp_path, "shared", "shared/a", "shared/a/b", "mine", "mine/out") == [
        "0o755",
        "0o700",
        "0o700",
        "0o777",
        "0o700",
    ]


def test_the_scratch_chain_is_made_private_again_up_to_the_profiles_scratch(tmp_path: Path) -> None:
    """An older meshrun (or umask 000) left scratch/meshrun-USER/RUN 0755/0777: a rank's start fixes them."""
    run = tmp_path / "scratch" / "meshrun-me" / "run-1"
    run.mkdir(parents=True)
    for folder in (run, run.parent, run.parent.parent):
        os.chmod(folder, 0o777)
    private.make_private_below(tmp_path / "scratch", run / "n1")
    assert _modes(
        tmp_path, "scratch", "scratch/meshrun-me", "scratch/meshrun-me/run-1", "scratch/meshrun-me/run-1/n1"
    ) == [
        "0o777",
        "0o700",
        "0o700",
        "0o700",
    ]


def test_the_private_umask_is_set_for_a_while_and_given_back(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        with private.private_umask_while():
            (tmp_path / "f").write_text("x")
            assert os.umask(0o077) == 0o077
        assert os.umask(0o002) == 0o002
    finally:
        os.umask(old)
    assert _modes(tmp_path, "f") == ["0o600"]


def test_every_entry_point_sets_the_private_umask() -> None:
    """The processes a job runs: each sets it itself, so none depends on how it was started."""
    repo = Path(__file__).resolve().parents[2]
    for module, call in {
        "submit/cli/main.py": "private_umask()",
        "launcher/rank/entry.py": "private_umask()",
        "launcher/local/supervisor.py": "private_umask()",
        "launcher/sidecar/__main__.py": "private_umask()",
        "launcher/data/corpus.py": "private_umask()",
        "submit/executor.py": "private_umask_while()",
        "submit/transport/ssh.py": "umask 077; ",
        "templates/slurm.sbatch.j2": "\numask 077\n",
        "templates/local.sh.j2": "\numask 077\n",
    }.items():
        assert call in (repo / module).read_text(), module


def test_the_testbeds_profile_command_writes_a_private_profile_whatever_the_umask(tmp_path: Path) -> None:
    """A new user's trial: `testbed profile mycluster` left ~/.config/meshrun 0755 and the profile (which names
    the key file) 0644 under umask 022."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"))
    done = subprocess.run(
        [sys.executable, "-m", "tests.testbed.testbed", "profile", "mycluster"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert done.returncode == 0, done.stderr
    profile = tmp_path / "config" / "meshrun" / "clusters" / "mycluster.yaml"
    assert done.stdout.strip() == str(profile)
    for path, mode in ((profile, 0o600), (profile.parent, 0o700), (profile.parent.parent, 0o700)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
