"""Folders meshrun creates on the way to a run dir or a snapshot are private to the user (0700): on a
shared login node, a 0755 work dir lets everyone list runs and read what is not locked down."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from launcher.spec import Code
from submit import snapshot
from submit.transport import PUT_SCRIPT, LocalTransport, Upload


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
