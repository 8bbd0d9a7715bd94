"""Sweeps (planning, the array script) and code snapshots (which files, the content address), pure."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.job import Code
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.errors import InputError
from meshrun.submit.planning.plan import plan_file
from meshrun.submit.planning.sweep import parse, plan_sweep
from meshrun.submit.schedulers.render import render
from meshrun.submit.schedulers.slurm import BACKEND as SLURM
from meshrun.submit.transport import snapshot

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny.yaml"


def test_sweep_grid_in_order_and_refusals() -> None:
    assert parse(["train.lr=1e-3,3e-4", "train.seed=0,1"]) == [
        (("train.lr", "1e-3"), ("train.seed", "0")),
        (("train.lr", "1e-3"), ("train.seed", "1")),
        (("train.lr", "3e-4"), ("train.seed", "0")),
        (("train.lr", "3e-4"), ("train.seed", "1")),
    ]
    for bad, why in (
        ("train.lr", "KEY=V1"),
        ("resources.nodes=1,2", "whole job array"),
        ("name=a,b", "whole job array"),
        ("train.lr=1,,2", "empty"),
    ):
        with pytest.raises(InputError, match=why):
            parse([bad])
    with pytest.raises(InputError, match="twice"):
        parse(["train.lr=1", "train.lr=2"])


def test_each_task_is_validated_and_gets_its_own_run_dir_and_checkpoints() -> None:
    plan = plan_sweep(
        TINY,
        load_profile("testbed"),
        ["train.steps=7"],
        ["train.lr=1e-3,2e-3", "train.seed=3"],
        home="/home/u",
        run_dir="/w/runs/r",
    )
    assert [t.run_dir for t in plan.tasks] == ["/w/runs/r/tasks/0", "/w/runs/r/tasks/1"]
    assert [t.run_spec.job.trainer.lr for t in plan.tasks] == [1e-3, 2e-3]
    assert all(t.run_spec.job.trainer.steps == 7 and t.run_spec.job.trainer.seed == 3 for t in plan.tasks)
    assert [t.run_spec.run.run_dir for t in plan.tasks] == [t.run_dir for t in plan.tasks]
    dirs = {t.run_spec.run.checkpoint_dir for t in plan.tasks}
    root = load_profile("testbed").paths.checkpoint_root
    assert len(dirs) == 2 and all(d.startswith(f"{root}/r/") for d in dirs)
    with pytest.raises(InputError, match=r"--sweep parallel.dp=3: parallel"):
        plan_sweep(TINY, load_profile("testbed"), [], ["parallel.dp=2,3"], home="/home/u")


def _bash_n(tmp_path: Path, text: str) -> None:
    path = tmp_path / "s.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_array_script_points_each_task_at_its_run_dir(tmp_path: Path) -> None:
    plan = plan_sweep(TINY, load_profile("testbed"), [], ["train.lr=1e-3,2e-3,3e-3"], home="/h", run_dir="/w/r")
    text = render(plan, SLURM)
    _bash_n(tmp_path, text)
    assert "#SBATCH --array=0-2\n" in text and "#SBATCH --output=/w/r/tasks/%a/logs/slurm-%A_%a.out\n" in text
    assert 'export MESHRUN_RUN_DIR="$MESHRUN_SWEEP_DIR/tasks/${SLURM_ARRAY_TASK_ID:?' in text
    assert "MESHRUN_SPEC_EOF" not in text  # each task's spec.json is written at submit time
    env = {"SLURM_ARRAY_TASK_ID": "2", "PATH": os.environ["PATH"]}
    lines = [l for l in text.splitlines() if l.startswith("export MESHRUN_")][:2]
    out = subprocess.run(
        ["bash", "-c", "\n".join(lines + ['echo "$MESHRUN_RUN_DIR"'])],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "/w/r/tasks/2"


def test_code_snapshot_is_importable_and_the_ranks_cwd(tmp_path: Path) -> None:
    import dataclasses

    plan = plan_file(TINY, load_profile("testbed"), home="/h", run_dir="/w/r")
    assert "MESHRUN_CODE_DIR" not in render(plan, SLURM)
    text = render(dataclasses.replace(plan, code_dir="/w/code/abc 'd'"), SLURM)
    _bash_n(tmp_path, text)
    assert "export MESHRUN_CODE_DIR='/w/code/abc '\"'\"'d'\"'\"''\n" in text
    assert 'export PYTHONPATH="$MESHRUN_CODE_DIR${PYTHONPATH:+:$PYTHONPATH}"' in text
    assert '--chdir="$MESHRUN_CODE_DIR"' in text


def _git_project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    for rel, text in {
        "train.py": "print(1)\n",
        "pkg/mod.py": "X = 1\n",
        "data/big.bin": "x" * 100,
        "notes.log": "ignored\n",
        ".gitignore": "*.log\n",
        "pkg/__pycache__/m.pyc": "c",
        "run.sh": "#!/bin/sh\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "run.sh").chmod(0o755)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "train.py"], check=True)  # the rest is untracked
    return root


def test_snapshot_takes_what_git_does_not_ignore_plus_include_minus_exclude(tmp_path: Path) -> None:
    root = _git_project(tmp_path)
    snap = snapshot.collect(root / "pkg", Code())  # the spec may sit anywhere in the work tree
    assert snap is not None and snap.root == root
    assert [f for f, _ in snap.files] == [".gitignore", "data/big.bin", "pkg/mod.py", "run.sh", "train.py"]
    assert dict(snap.files)["run.sh"] == 0o700 and dict(snap.files)["train.py"] == 0o600
    snap2 = snapshot.collect(root, Code(include=("*.log",), exclude=("data",)))
    assert [f for f, _ in snap2.files] == [".gitignore", "notes.log", "pkg/mod.py", "run.sh", "train.py"]
    assert snapshot.collect(root, Code(sync=False)) is None


def test_snapshot_address_follows_content_only(tmp_path: Path) -> None:
    root = _git_project(tmp_path)
    first = snapshot.collect(root, Code())
    assert snapshot.collect(root, Code()).digest == first.digest
    (root / "pkg" / "mod.py").write_text("X = 2\n")
    assert snapshot.collect(root, Code()).digest != first.digest
    assert snapshot.remote_dir("/w/", first) == f"/w/code/{first.digest}"


def test_outside_git_only_an_explicit_root_ships(tmp_path: Path) -> None:
    (tmp_path / "loose" / "sub").mkdir(parents=True)
    (tmp_path / "loose" / "sub" / "a.py").write_text("")
    (tmp_path / "loose" / "job.yaml").write_text("")
    assert snapshot.collect(tmp_path / "loose", Code()) is None
    snap = snapshot.collect(tmp_path / "loose", Code(root="."))
    assert [f for f, _ in snap.files] == ["job.yaml", "sub/a.py"]
    with pytest.raises(InputError, match="code.root"):
        snapshot.collect(tmp_path, Code(root="missing"))


@pytest.mark.parametrize(
    "rel, patterns, hit",
    [
        ("data/x/y.bin", ("data",), True),
        ("a/data/y", ("data",), True),
        ("a/b.ckpt", ("*.ckpt",), True),
        ("src/a/b.py", ("src/*.py",), True),
        ("srcx/a.py", ("src",), False),
        ("runs-1/x", ("runs-*",), True),
        ("model.py", ("data",), False),
    ],
)
def test_glob_rules(rel: str, patterns: tuple[str, ...], hit: bool) -> None:
    assert snapshot.matches(rel, patterns) is hit


def test_dry_run_shows_tasks_and_the_code(tmp_path: Path, default_corpus: Path) -> None:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun.submit.cli.main",
            "submit",
            str(TINY),
            "-c",
            "testbed",
            "--dry-run",
            "--json",
            "--sweep",
            "train.lr=1e-3,2e-3",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=True,
    )
    shown = json.loads(out.stdout)
    assert [t["overrides"] for t in shown["tasks"]] == [{"train.lr": "1e-3"}, {"train.lr": "2e-3"}]
    assert shown["code"]["root"] == str(REPO) and shown["code"]["files"] > 10


def test_snapshot_never_ships_meshrun_state_even_inside_the_work_tree(tmp_path: Path, monkeypatch) -> None:
    """The registry, known_hosts, profiles and caches are meshrun's (and the user's) state, not code: when
    the XDG dirs or HOME sit inside the project, shipping them would leak them and change the digest on
    every submit (the registry is written by each one)."""
    root = _git_project(tmp_path)
    state = {
        "xdg/state/meshrun/jobs.sqlite": "db",
        "xdg/config/meshrun/clusters/c.yaml": "name: c\n",
        "xdg/cache/meshrun/data/t.u16": "tok",
        ".local/state/meshrun/jobs.sqlite": "db",
        ".config/meshrun/clusters/d.yaml": "",
        ".cache/meshrun/x": "",
        ".ssh/known_hosts": "h k v\n",
        ".ssh/id_ed25519": "PRIVATE",
        "cfg/known_hosts": "h k v\n",
        "cfg/.known_hosts.meshrun-tmp": "",
        snapshot.MANIFEST: "planted\n",
    }
    for rel, text in state.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("HOME", str(root))
    for kind in ("STATE", "CONFIG", "CACHE"):
        monkeypatch.setenv(f"XDG_{kind}_HOME", str(root / "xdg" / kind.lower()))
    snap = snapshot.collect(root, Code())
    assert [f for f, _ in snap.files] == [".gitignore", "data/big.bin", "pkg/mod.py", "run.sh", "train.py"]
    (root / "xdg/state/meshrun/jobs.sqlite").write_text("db with one more job")
    assert snapshot.collect(root, Code()).digest == snap.digest
    # Not even when asked for by code.include: these never leave the machine.
    forced = snapshot.collect(root, Code(include=(".ssh", "xdg", ".local", "cfg")))
    assert [f for f, _ in forced.files] == [f for f, _ in snap.files]


def test_snapshot_manifest_lists_paths_modes_and_hashes(tmp_path: Path) -> None:
    root = _git_project(tmp_path)
    snap = snapshot.collect(root, Code())
    lines = snap.manifest.splitlines()
    assert len(lines) == len(snap.files)
    script_hash = hashlib.sha256(b"#!/bin/sh\n").hexdigest()
    assert f"{script_hash}  run.sh" in lines  # the format `sha256sum -c` reads
    assert sorted(snap.listing.splitlines()) == sorted(f"{rel}\t{mode:o}" for rel, mode in snap.files)
    (root / "run.sh").chmod(0o644)  # a mode change is a new snapshot (it changes what runs)
    assert snapshot.collect(root, Code()).digest != snap.digest
