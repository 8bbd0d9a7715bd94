"""A laptop's view of the real Slurm testbed, reached only over the real sshd: submit a 2-node
training job, watch it to completion, follow its merged logs, see its loss in TensorBoard through
the tunnel, resubmit unchanged code without uploading it, cancel another job."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.integration import sshbed, tbhelp
from tests.integration.cli import REPO, env_for, metrics, submitted
from tests.integration.sshbed import meshrun
from tests.integration.tbhelp import Cleanup

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
        [sys.executable, "-m", "submit.cli", "tb", trained["job"]],
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
