"""A laptop's view of the real Slurm testbed, reached only over the real sshd: submit a 2-node
training job, watch it to completion, follow its merged logs, see its loss in TensorBoard through
the tunnel, resubmit unchanged code without uploading it, cancel another job; resubmit while a job runs
from its code snapshot (the snapshot stays, bytecode and all), and hand-submit a `render -o` script whose
snapshot is not there (it refuses to start)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.helpers import sshbed, tbhelp
from tests.helpers.cli import REPO, env_for, metrics, submitted
from tests.helpers.sshbed import meshrun
from tests.helpers.tbhelp import Cleanup
from tests.testbed import testbed as tb

SLEEPER = sshbed.command_spec("sleeper", ["sleep", "300"])


@pytest.fixture(scope="module")
def trained(testbed: dict, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("laptop")
    profile = sshbed.profile(home)
    root = sshbed.project(
        home,
        {
            "train.yaml": (REPO / "examples" / "two-node.yaml").read_text(),
            "sleeper.yaml": SLEEPER,
            "mypkg/__init__.py": "VALUE = 42\n",
            # New content each session: content addressing would find an old upload.
            "mypkg/nonce.py": f"NONCE = {uuid.uuid4().hex!r}\n",
        },
    )
    before = sshbed.logins()
    out = meshrun(
        home,
        "submit",
        str(root / "train.yaml"),
        "-c",
        str(profile),
        "--set",
        f"data.path={corpus}",
        "--set",
        "train.steps=10",
        "--set",
        "train.log_every=1",
        check=True,
    )
    logins = sshbed.logins() - before
    job_id, run_dir = submitted(out)
    final = sshbed.watch_until_done(home, job_id)
    yield {
        "home": home,
        "profile": profile,
        "root": root,
        "job": job_id,
        "run_dir": run_dir,
        "out": out,
        "logins": logins,
        "final": final,
    }


def test_two_node_job_over_ssh_trains_and_is_watched_to_completion(trained: dict[str, Any]) -> None:
    assert trained["logins"] == 1  # one SSH connection for the whole submit, counted by sshd
    (row,) = trained["final"]
    assert row["state"] == "COMPLETED" and row["cluster"] == "sshbed" and row["progress"]["step"] == 10
    rows = metrics(trained["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[-1]["loss"] < rows[0]["loss"]
    assert trained["run_dir"].stat().st_mode & 0o777 == 0o700
    code_dir = Path(next(l.split(": ", 1)[1] for l in trained["out"].stdout.splitlines() if l.startswith("code: ")))
    assert (code_dir / "mypkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (code_dir / "train.yaml").exists() and code_dir.stat().st_mode & 0o777 == 0o700
    assert "uploading code (4 files)" in trained["out"].stderr  # the project's files; nothing from .git


def test_logs_follow_all_ranks_merged_with_prefixes(trained: dict[str, Any]) -> None:
    out = meshrun(trained["home"], "logs", trained["job"], "-f", "--rank", "all", check=True).stdout
    for rank in range(4):
        mine = [l.removeprefix(f"[rank {rank}] ") for l in out.splitlines() if l.startswith(f"[rank {rank}] ")]
        assert mine == (trained["run_dir"] / "logs" / f"rank-{rank}.log").read_text().splitlines()
        assert mine[0].startswith(f"[meshrun] rank {rank}/4")


def test_tensorboard_through_the_tunnel_serves_the_jobs_loss(trained: dict[str, Any], tb_cleanup: Cleanup) -> None:
    tb_cleanup.runs([(trained["job"], trained["run_dir"])])
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun.submit.cli.main", "tb", trained["job"]],
        cwd=REPO,
        text=True,
        env=env_for(trained["home"], laptop=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:")
        assert line, proc.stderr.read() if proc.poll() is not None else "no URL"
        browser = tbhelp.Browser(line.split()[-1])  # the URL carries the server's token once: then a cookie
        deadline = time.monotonic() + 60
        while "loss" not in (browser.get("data/plugin/scalars/tags") or {}).get(trained["job"], {}):
            assert time.monotonic() < deadline, "TensorBoard never showed the loss"
            time.sleep(0.5)
        points = browser.get(f"data/plugin/scalars/scalars?run={trained['job']}&tag=loss")
        expected = [(r["step"], r["loss"]) for r in metrics(trained["run_dir"])]
        assert [(step, pytest.approx(value, rel=1e-6)) for _, step, value in points] == expected
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    stderr = proc.stderr.read()
    assert proc.returncode == 0 and "stopped TensorBoard (pid " in stderr
    pid = int(stderr.split("stopped TensorBoard (pid ", 1)[1].split()[0])
    deadline = time.monotonic() + 30
    while _running(pid):  # Ctrl-C tore down the server it started
        assert time.monotonic() < deadline, "the TensorBoard server outlived meshrun tb"
        time.sleep(0.2)


def _running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 here reaps orphans late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_unchanged_code_uploads_nothing_and_another_job_is_cancelled(trained: dict[str, Any]) -> None:
    home = trained["home"]
    before = sshbed.logins()
    out = meshrun(home, "submit", str(trained["root"] / "sleeper.yaml"), "-c", str(trained["profile"]), check=True)
    assert sshbed.logins() - before == 1
    assert "code: unchanged" in out.stderr and "uploading" not in out.stderr
    job_id, _ = submitted(out)
    sshbed.wait_state(home, job_id, ("RUNNING",))
    assert meshrun(home, "cancel", job_id, check=True).stdout.startswith(f"cancelled job {job_id} on sshbed")
    (row,) = sshbed.watch_until_done(home, job_id, timeout=120)
    assert row["state"] == "CANCELLED" and row["done"] and not row["succeeded"]


def test_after_makes_a_job_wait_for_another(trained: dict[str, Any]) -> None:
    home, profile, root = trained["home"], str(trained["profile"]), trained["root"]
    first, _ = submitted(meshrun(home, "submit", str(root / "sleeper.yaml"), "-c", profile, check=True))
    second, _ = submitted(
        meshrun(home, "submit", str(root / "sleeper.yaml"), "-c", profile, "--after", first, check=True)
    )
    deadline = time.monotonic() + 60
    while (row := sshbed.wait_state(home, second, ("PENDING",)))["reason"] != "Dependency":
        assert time.monotonic() < deadline, row  # (the scheduler fills in the reason within seconds)
        time.sleep(0.5)
    meshrun(home, "cancel", first, check=True)
    meshrun(home, "cancel", second, check=True)


def test_export_over_ssh_downloads_consolidated_weights(trained: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    target = trained["home"] / "model.safetensors"
    out = meshrun(trained["home"], "export", trained["job"], "-o", str(target), check=True)
    assert out.stdout.startswith(f"wrote {target} from ") and out.stdout.rstrip().endswith("step-00000010")
    weights = load_file(str(target))
    assert weights["tok_embeddings.weight"].shape == (256, 64) and "layers.1.attention.wq.weight" in weights


# Reads a file of its code snapshot again and again, as a training script reads its vocabulary; it imports
# a module of the snapshot first (Python would write pkg/__pycache__/ there).
READER = """import sys, time
from pathlib import Path

import pkg.words

print("reading", flush=True)
deadline, reads = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < deadline:
    assert Path("pkg/words.txt").read_text() == pkg.words.WORDS
    reads, _ = reads + 1, time.sleep(0.2)
print(f"read pkg/words.txt {reads} times", flush=True)
"""
# `meshrun submit` in a process of its own that also prints its SSH round trips and bytes sent.
COUNTED = """import sys
from meshrun.submit.cli import main as cli
from meshrun.submit.transport.ssh import STATS
try:
    code = cli.main(sys.argv[1:])
finally:
    print(f"ssh-stats {STATS.round_trips} {STATS.bytes_sent}", file=sys.stderr)
sys.exit(code)
"""


def _counted_submit(home: Path, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """(the finished `meshrun submit ARGS`, its round trips)."""
    done = subprocess.run(
        [sys.executable, "-c", COUNTED, "submit", *args],
        capture_output=True,
        text=True,
        env=env_for(home, laptop=True),
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done, int(done.stderr.rsplit("ssh-stats ", 1)[1].split()[0])


def _code_dir(out: subprocess.CompletedProcess) -> Path:
    return Path(next(l.split(": ", 1)[1] for l in out.stdout.splitlines() if l.startswith("code: ")))


def _reading(run_dir: Path, timeout: float = 60) -> None:
    """Wait until the job's rank 0 has imported its package and reads (it runs from its snapshot)."""
    log, deadline = run_dir / "logs" / "rank-0.log", time.monotonic() + timeout
    while not (log.exists() and "reading" in log.read_text(errors="replace").splitlines()):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no rank log"
        time.sleep(0.2)


def test_a_resubmit_while_jobs_run_never_removes_or_replaces_their_code(testbed: dict, tmp_path: Path) -> None:
    """A job's own bytecode made the next submit swap the snapshot under it (exit 2)."""
    profile = str(sshbed.profile(tmp_path, "snapbed"))
    root = sshbed.project(
        tmp_path,
        {
            "reader.yaml": sshbed.command_spec("reader", ["python", "reader.py", "8"]),
            "reader.py": READER,
            "pkg/__init__.py": "",
            "pkg/words.py": "from pathlib import Path\n\nWORDS = (Path(__file__).parent / 'words.txt').read_text()\n",
            "pkg/words.txt": f"{uuid.uuid4().hex}\n",  # new content each session: a new snapshot
        },
    )
    spec = str(root / "reader.yaml")
    first = meshrun(tmp_path, "submit", spec, "-c", profile, check=True)
    assert "uploading code (5 files)" in first.stderr
    job1, run1 = submitted(first)
    code_dir = _code_dir(first)
    _reading(run1)
    inode = code_dir.stat().st_ino

    second, round_trips = _counted_submit(tmp_path, spec, "-c", profile)
    assert "code: unchanged" in second.stderr and "uploading" not in second.stderr and "warning" not in second.stderr
    assert round_trips == 3 and _code_dir(second) == code_dir  # home + snapshot check; preflight; run dir + sbatch
    job2, run2 = submitted(second)
    _reading(run2)

    # A file the folder was never uploaded with (a job's output in its working folder): the next submit
    # says so, leaves the folder to the job running from it, and uploads the code to a folder of its own.
    (code_dir / "out.txt").write_text("written by a job into its working folder\n")
    third = meshrun(tmp_path, "submit", spec, "-c", profile, check=True)
    assert "uploading code (5 files)" in third.stderr and _code_dir(third) == Path(f"{code_dir}-1")
    (warning,) = [l for l in third.stderr.splitlines() if "warning" in l]
    assert f"{code_dir} changed since it was uploaded: it holds out.txt, which was never uploaded" in warning
    assert "not only yours" not in warning
    job3, run3 = submitted(third)

    for job, run_dir in ((job1, run1), (job2, run2), (job3, run3)):
        (row,) = sshbed.watch_until_done(tmp_path, job, timeout=120)
        assert row["state"] == "COMPLETED" and row["succeeded"], row
        assert "read pkg/words.txt" in (run_dir / "logs" / "rank-0.log").read_text()
    assert code_dir.stat().st_ino == inode and (code_dir / "out.txt").exists()  # never removed or replaced
    assert not list(code_dir.rglob("__pycache__")) and not list(Path(f"{code_dir}-1").rglob("__pycache__"))
    fourth, round_trips = _counted_submit(tmp_path, spec, "-c", profile, "--dry-run")
    assert round_trips == 1 and f"\nexport MESHRUN_CODE_DIR={code_dir}-1\n" in fourth.stdout  # found there


def _sacct_state(job: str, timeout: float = 60) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"], capture_output=True, text=True
        ).stdout.split()
        if out and out[0].split("|")[0] not in ("PENDING", "RUNNING", "REQUEUED"):
            state, code = out[0].split("|")
            return state, code
        assert time.monotonic() < deadline, out
        time.sleep(0.5)


def test_a_hand_submitted_render_refuses_to_start_without_its_snapshot(testbed: dict, tmp_path: Path) -> None:
    """`render -o` uploads nothing; its script must not run the code from /tmp."""
    profile = str(sshbed.profile(tmp_path, "handbed"))
    root = sshbed.project(
        tmp_path,
        {
            "hand.yaml": sshbed.command_spec("hand", ["python", "-c", "import os; print('ran in', os.getcwd())"]),
            "nonce.txt": f"{uuid.uuid4().hex}\n",  # a snapshot no earlier session uploaded
        },
    )
    script = tmp_path / "hand.sbatch"
    out = meshrun(tmp_path, "render", str(root / "hand.yaml"), "-c", profile, "-o", str(script), check=True)
    assert f"which is not on the cluster: `meshrun render {root / 'hand.yaml'} -c {profile} -o {script} --upload`" in (
        out.stderr
    )
    job, run_dir = _sbatch(script)
    assert _sacct_state(job) == ("FAILED", "2:0")
    log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "missing or changed since it was uploaded; `meshrun submit` the job's spec" in log and "ran in" not in log
    # `render --upload` puts the snapshot there: such a script, submitted by hand, now runs from it.
    out = meshrun(tmp_path, "render", str(root / "hand.yaml"), "-c", profile, "-o", str(script), "--upload", check=True)
    code_dir = _exported(script, "MESHRUN_CODE_DIR")
    assert f"code: uploaded the code snapshot {code_dir}" in out.stderr
    job, run_dir = _sbatch(script)
    assert _sacct_state(job) == ("COMPLETED", "0:0")
    assert f"ran in {code_dir}" in (run_dir / "logs" / "rank-0.log").read_text()


def _exported(script: Path, name: str) -> str:
    return next(l.split("=", 1)[1] for l in script.read_text().splitlines() if l.startswith(f"export {name}="))


def _sbatch(script: Path) -> tuple[str, Path]:
    """As the script's header says: its run dir's logs/ made, then sbatch by hand on the login node (this
    machine, with the testbed's Slurm environment). (job id, run dir)"""
    run_dir = Path(_exported(script, "MESHRUN_RUN_DIR"))
    (run_dir / "logs").mkdir(parents=True)
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, **tb.client_env()),
    )
    return done.stdout.strip(), run_dir
