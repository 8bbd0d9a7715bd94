"""meshrun as a user installs it on a login node: a wheel, installed (not editable) into a fresh venv
outside the repo, used from another folder. Nothing of the repo is on that venv's path, so a template,
a profile or a module missing from the wheel fails here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import tomllib

from tests.helpers.cli import SMALL_MODEL, env_for, submitted

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "meshrun", "submit", "launcher", "templates", "cluster_configs")
"""What the wheel is built from: a copy, so that the build leaves nothing in the repo."""
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
TRAIN = [
    "--set",
    "resources.tasks_per_node=1",
    "--set",
    "parallel.dp=1",
    *SMALL_MODEL,
    "--set",
    "train.global_batch=4",  # after SMALL_MODEL's: one process, micro 4
    "--set",
    "train.eval_every=0",
    "--set",
    "train.log_every=1",
    "--set",
    "train.steps=3",
]
"""One CPU rank, three steps: the cheapest job that still trains."""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    home: Path
    """The user's HOME and the working directory of every command: outside the repo."""

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """A command of the venv, as after `source VENV/bin/activate`, run from `home`."""
        env = {k: v for k, v in env_for(self.home).items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(VIRTUAL_ENV=str(self.venv), PATH=f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        done = subprocess.run(
            [str(self.venv / "bin" / argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            env=env,
            cwd=self.home,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{' '.join(argv)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip {' '.join(args)} -> {done.returncode}\n{done.stderr}"


def build_wheel(out: Path) -> Path:
    src = out / "src"
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, src / name)
    # This venv's setuptools (the dev extra) builds it: an isolated build env would cost seconds.
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out / "dist"), str(src))
    (wheel,) = (out / "dist").glob("meshrun-*.whl")
    return wheel


def _venv_parent(tmp: Path) -> Path:
    """Memory when there is room: writing ~0.9 GB of torch to disk, and deleting it, took 30-40 s
    each on a busy CI disk and 0.1 s in /dev/shm."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 << 30:
        return Path(tempfile.mkdtemp(prefix="meshrun-wheel-", dir=shm))
    return tmp


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    out = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(out)
    venv_parent = _venv_parent(out)
    venv = venv_parent / "venv"
    # A fresh venv; this venv's pip installs into it (skips ensurepip), the CPU torch pinned as
    # scripts/setup.sh pins it. --no-compile: byte-compiling all of torch costs more than the ranks'
    # imports compile.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    _pip(
        "--python",
        str(venv / "bin" / "python"),
        "install",
        "--no-compile",
        "-c",
        str(REPO / "constraints" / "cpu.txt"),
        str(wheel),
    )
    home = out / "home"
    home.mkdir()
    try:
        yield Installed(wheel, venv, home)
    finally:
        shutil.rmtree(venv_parent if venv_parent != out else venv, ignore_errors=True)  # ~1 GB of torch


def test_wheel_holds_templates_profiles_and_every_module(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    templates = {f"meshrun/templates/{p.name}" for p in (REPO / "templates").glob("*.j2")}
    profiles = {f"meshrun/cluster_configs/{p.name}" for p in (REPO / "cluster_configs").glob("*.yaml")}
    modules = {
        f"meshrun/{p.relative_to(REPO).as_posix()}"
        for top in ("submit", "launcher")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert {"meshrun/templates/slurm.sbatch.j2", "meshrun/cluster_configs/local.yaml"} <= templates | profiles
    missing = sorted((templates | profiles | modules) - names)
    assert not missing, f"not in the wheel: {missing}; list their packages in pyproject's [tool.setuptools]"
    # One installed name: nothing of meshrun's lands in site-packages beside meshrun/ and its dist-info.
    tops = {name.split("/")[0] for name in names}
    assert tops == {"meshrun", f"meshrun-{VERSION}.dist-info"}, tops


def test_installed_meshrun_runs_from_anywhere(installed: Installed) -> None:
    where = installed.run(
        "python",
        "-c",
        "import meshrun.submit as s, meshrun.launcher as l; print(s.__file__, l.__file__, s.__version__, l.__version__)",
    ).stdout.split()
    assert all(path.startswith(str(installed.venv)) for path in where[:2]), where
    assert where[2:] == [VERSION, VERSION]
    # The names other projects own stay theirs: `submit` and `launcher` are not importable from the install.
    taken = installed.run(
        "python", "-c", "import importlib.util as u; print([u.find_spec(n) for n in ('submit', 'launcher')])"
    ).stdout
    assert taken.strip() == "[None, None]", taken

    listed = installed.run("meshrun", "clusters").stdout
    assert {line.split()[0] for line in listed.splitlines()[1:]} >= {"local", "testbed", "h100-ndr", "h200-ndr"}

    spec = installed.home / "tiny.yaml"
    shutil.copy2(REPO / "examples" / "tiny.yaml", spec)
    script = installed.run("meshrun", "render", spec.name, "-c", "local").stdout
    assert f"# Rendered by meshrun {VERSION} for the local cluster local" in script

    tokens = installed.home / "tokens.u16"
    stdlib_logging = Path(sysconfig.get_paths()["stdlib"]) / "logging"
    installed.run("meshrun", "data", "--source", str(stdlib_logging), "--max-mb", "0.2", "--out", str(tokens))
    out = installed.run("meshrun", "submit", spec.name, "-c", "local", "--set", f"data.path={tokens}", *TRAIN, "--wait")
    _, run_dir = submitted(out)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps if "event" not in row] == [1, 2, 3]
    assert json.loads((run_dir / "spec.json").read_text())["run"]["meshrun_version"] == VERSION
    # The ranks ran the same meshrun that rendered the job: no version line in their logs.
    assert "version mismatch" not in (run_dir / "logs" / "rank-0.log").read_text()
