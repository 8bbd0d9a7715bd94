"""Private by default, whatever the umask: real jobs started under `umask 000`, every file
and folder they create walked, at the end and while they run, for any group or other permission bit.

Under umask 000 a 0755 scratch folder became 0777, DCP's shards in `step-N.tmp/` 0666, TensorBoard's and the
sidecar's files 0666: meshrun sets a private umask at every entry point it controls (the CLI, the batch
script, the supervisor, each rank, the sidecar, submitit's jobs) and makes its folders 0700 explicitly.
"""

from __future__ import annotations

import getpass
import os
import secrets
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from meshrun.launcher.contract.records.rundir import RunDir, node_name
from meshrun.submit.executor import executor
from tests.helpers import sshbed
from tests.helpers.cli import TINY, meshrun, submitted
from tests.integration import submitit_fns
from tests.testbed import testbed as tb

STEPS = ["--set", "train.steps=6", "--set", "checkpoint.every=2", "--set", "checkpoint.async_save=false"]


def exposed(roots: Sequence[Path]) -> list[str]:
    """Every file or folder under `roots` (the roots included) with a group or other bit: 'mode path'."""
    found = []
    for root in roots:
        for parent, dirs, files in os.walk(root):
            for path in [parent, *(os.path.join(parent, n) for n in dirs + files)]:
                try:
                    mode = os.lstat(path).st_mode
                except FileNotFoundError:
                    continue  # removed while walked (a renamed step-N.tmp, a cleared scratch folder)
                if not stat.S_ISLNK(mode) and mode & 0o077:  # a link's own mode means nothing
                    found.append(f"{stat.S_IMODE(mode):04o} {path}")
    return sorted(set(found))


class Watch:
    """Walks the folders `roots()` names over and over while a job runs: what is exposed for a moment (a
    shard being written) is caught too, not only what is left at the end."""

    def __init__(self, roots: Callable[[], list[Path]]) -> None:
        self.roots, self.found, self.walks = roots, set[str](), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.found.update(exposed([r for r in self.roots() if r.exists()]))
            self.walks += 1

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's home (work dir ~/.local/share/meshrun, scratch ~/.cache/meshrun/scratch, the registry):
    for the CLI's subprocesses and this process's API calls alike."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    for key, value in {"HOME": home, "XDG_STATE_HOME": home / "state", "XDG_CONFIG_HOME": home / "config"}.items():
        monkeypatch.setenv(key, str(value))
    return home


def test_a_local_training_job_under_umask_000_leaves_nothing_for_others(home: Path, corpus: Path) -> None:
    """Scratch staging, checkpoints, TensorBoard, the sidecar, submitit's folder, the registry, the work dir."""
    with umask(0), Watch(lambda: [home]) as watch:
        out = meshrun(home, "submit", *TINY, "--set", f"data.path={corpus}", *STEPS, "--wait", check=True)
    _, run_dir = submitted(out)
    work = home / ".local" / "share" / "meshrun"
    assert run_dir.parent == work / "runs"
    rd = RunDir(str(run_dir))
    node = node_name({})
    made = [rd.tensorboard, rd.sidecar_tensorboard(node), rd.submitit, rd.default_checkpoints]
    assert all(Path(p).is_dir() for p in made), [p for p in made if not Path(p).is_dir()]
    assert sorted(p.name for p in Path(rd.default_checkpoints).glob("step-*")) == [f"step-{s:08d}" for s in (2, 4, 6)]
    scratch = home / ".cache" / "meshrun" / "scratch" / f"meshrun-{getpass.getuser()}"
    assert scratch.is_dir() and (home / "state" / "meshrun" / "registry.sqlite").is_file()
    assert watch.walks > 10, watch.walks  # it looked while the job ran
    assert exposed([home]) == [] and sorted(watch.found) == []


def test_a_submitit_api_job_under_umask_000_leaves_nothing_for_others(home: Path) -> None:
    """The API runs in the user's process: its umask is theirs again after the submission."""
    with umask(0):
        ex = executor("local", name="square")
        job = ex.submit(submitit_fns.square, 3)
        assert job.result() == 9
        assert os.umask(0) == 0  # the caller's own umask, untouched
    assert ex.run_dir is not None and (ex.run_dir / ".meshrun" / "submitit").is_dir()
    assert exposed([home]) == []


def test_a_testbed_job_under_umask_000_leaves_nothing_for_others(testbed: dict, home: Path, corpus: Path) -> None:
    """Real Slurm: the batch log Slurm opens, the ranks' shards on node-local scratch (/tmp/meshrun-$USER) and
    on the shared checkpoint root, the copier's copies, the sidecars' files."""
    name = f"umask-{secrets.token_hex(4)}"  # this job's folders, told apart from other jobs' on the testbed
    spec = ["examples/tiny.yaml", "-c", "testbed", *TINY[3:], "--set", f"data.path={corpus}", "--set", f"name={name}"]
    scratch = Path("/tmp") / f"meshrun-{getpass.getuser()}"
    tops = [tb.TESTBED_DIR / "work" / "runs", tb.TESTBED_DIR / "checkpoints", scratch]

    def roots() -> list[Path]:
        return [home, *(p for top in tops if top.is_dir() for p in top.glob(f"{name}*"))]

    with umask(0), Watch(roots) as watch:
        out = meshrun(home, "submit", *spec, *STEPS, "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    _, run_dir = submitted(out)
    ckpts = tops[1] / run_dir.name
    assert run_dir.parent == tops[0] and sorted(p.name for p in ckpts.glob("step-*"))[-1] == "step-00000006"
    assert list((run_dir / "logs").glob("slurm-*.out")) and (run_dir / "tensorboard").is_dir()
    assert watch.walks > 10, watch.walks
    assert stat.S_IMODE(scratch.stat().st_mode) == 0o700  # meshrun's own folder on the node's scratch
    assert exposed(roots()) == [] and sorted(watch.found) == []


def test_a_job_submitted_over_ssh_leaves_nothing_for_others(testbed: dict, tmp_path: Path) -> None:
    """Over SSH the login node's own umask (sshd's, 022 here) would rule: every remote command meshrun runs
    is under umask 077, so sbatch hands the job that one (Slurm's batch log), and the job's own files too."""
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    writes = "echo hi > $MESHRUN_RUN_DIR/out.txt && mkdir -p $MESHRUN_RUN_DIR/made/deep"
    root = sshbed.project(tmp_path, {"job.yaml": sshbed.command_spec("umask-ssh", ["sh", "-c", writes])})
    with umask(0):
        out = sshbed.meshrun(laptop, "submit", str(root / "job.yaml"), "-c", str(sshbed.profile(tmp_path)), "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    _, run_dir = submitted(out)
    assert (run_dir / "out.txt").is_file() and list((run_dir / "logs").glob("slurm-*.out"))
    assert exposed([run_dir]) == []
