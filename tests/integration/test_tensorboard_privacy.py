"""Another user of the login node (or of the laptop) cannot read your TensorBoard, and
no server outlives the `meshrun tb` that started it: closing the terminal (SIGHUP) stops it, and
`meshrun tb --stop` stops one left running (a `meshrun tb` killed with -9), never another process.

The second user is a real Unix user (tbhelp.other_user), asking with curl as TensorBoard's own
frontend would. The runs are old-style (metrics.jsonl only: the server converts them), so no job runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.views import tbserve
from tests.helpers import sshbed, tbhelp
from tests.helpers.cli import REPO, env_for, meshrun
from tests.helpers.tbhelp import Cleanup

LOSSES = [5.5, 4.25, 3.125]


def _job(home: Path, job: str, cleanup: Cleanup) -> Path:
    """A finished local job whose run wrote metrics.jsonl only."""
    run_dir = home / "runs" / job
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(LOSSES))
    )
    registry = Registry(home / "state" / "meshrun" / "registry.sqlite")
    registry.add(JobRecord(job, "local", "j", str(run_dir), "local", 0.0, None, "h", "COMPLETED"))
    registry.close()
    cleanup.runs([(job, run_dir)])
    return run_dir


def _tb(home: Path, *jobs: str) -> tuple[subprocess.Popen, str]:
    proc = tbhelp.meshrun_tb(home, *jobs)
    line = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:")
    if not line:
        proc.kill()
        pytest.fail(f"meshrun tb printed no URL: {proc.communicate()[1]}")
    return proc, line.split()[-1]


def _server(home: Path, run_dir: Path, job: str) -> tuple[int, int]:
    """(pid, start time) of the server of this run, from the state the helper keeps in HOME/.cache."""
    state = home / ".cache" / "meshrun" / "tb" / tbserve.state_dir([(job, run_dir)]).name
    pid = int(json.loads((state / "server.json").read_text())["pid"])
    started = tbhelp.start_time(pid)
    assert started is not None
    return pid, started


def test_another_user_reads_nothing_and_sighup_stops_the_server(tmp_path: Path, tb_cleanup: Cleanup) -> None:
    run_dir = _job(tmp_path, "900101", tb_cleanup)
    proc, url = _tb(tmp_path, "900101")
    try:
        base, token = tbhelp.split_url(url)
        assert token, f"the URL carries no secret: {url}"
        series = f"{base}data/plugin/scalars/scalars?run=900101&tag=loss"
        # The owner, with the printed URL, sees the loss.
        browser = tbhelp.Browser(url)
        assert tbhelp.until("the loss", lambda: browser.losses("900101") == list(enumerate(LOSSES, 1)))
        # Another user of the same host, on the same loopback port: refused, without a byte of the run.
        for attempt in (series, base, f"{base}?token=wrong", f"{series}&token={token[:-1]}"):
            code, body = tbhelp.http_code_as_other(attempt)
            assert code == 403 and "4.25" not in body and "900101" not in body, (attempt, code, body[:200])
        # ... and cannot learn the secret: not in any process's argv, not in a file it can open.
        pid, started = _server(tmp_path, run_dir, "900101")
        state = tmp_path / ".cache" / "meshrun" / "tb" / tb_cleanup.keys[0]
        for other in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                assert token.encode() not in other.read_bytes(), f"the token is in {other}'s argv"
            except OSError:
                continue
        assert os.stat(state).st_mode & 0o777 == 0o700
        assert {p.name: p.stat().st_mode & 0o777 for p in state.iterdir() if p.is_file()} == {
            "server.json": 0o600,
            "token": 0o600,
            "server.log": 0o600,
            "converted.json": 0o600,
            "claimed": 0o600,
        }
        assert tbhelp.as_other("cat", str(state / "token")).returncode != 0
        # The terminal closes: meshrun's output has nowhere to go, and SIGHUP arrives.
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=60)
        assert tbhelp.gone(pid, started), "the TensorBoard server outlived a SIGHUP to meshrun tb"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_ends_a_server_left_running_and_nothing_else(tmp_path: Path, tb_cleanup: Cleanup) -> None:
    run_dir = _job(tmp_path, "900102", tb_cleanup)
    proc, _ = _tb(tmp_path, "900102")
    proc.kill()  # meshrun tb killed with -9: its server is left running
    proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    pid, started = _server(tmp_path, run_dir, "900102")
    # A second run whose recorded server pid is now someone else's process: --stop must not touch it.
    other_dir = _job(tmp_path, "900103", tb_cleanup)
    decoy = subprocess.Popen(["sleep", "300"])
    try:
        state = tmp_path / ".cache" / "meshrun" / "tb" / tb_cleanup.keys[1]
        state.mkdir(mode=0o700, parents=True)
        (state / "runs").mkdir(mode=0o700)
        (state / "runs" / "900103").symlink_to(other_dir)
        decoy_started = tbhelp.start_time(decoy.pid)
        (state / "server.json").write_text(
            json.dumps({"port": 1, "pid": decoy.pid, "started": decoy_started, "runs": ["900103"]})
        )
        out = meshrun(tmp_path, "tb", "--stop", "900102", "900103")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [f"stopped TensorBoard (pid {pid} on this machine) serving 900102"]
        assert tbhelp.gone(pid, started, timeout=15)
        assert decoy.poll() is None and tbhelp.start_time(decoy.pid) == decoy_started
        again = meshrun(tmp_path, "tb", "--stop", "900102")
        assert (again.returncode, again.stdout) == (0, "no TensorBoard of yours serves 900102 on local\n")
        # `--stop -c CLUSTER`: every server of yours there (the decoy's record still names no server).
        proc, _ = _tb(tmp_path, "900102")
        assert proc.stdout.readline().startswith("the URL carries this server's secret")  # type: ignore[union-attr]
        proc.kill()  # no laptop line on the `local` cluster: this machine's own jobs need no tunnel
        proc.wait()
        pid, started = _server(tmp_path, run_dir, "900102")
        out = meshrun(tmp_path, "tb", "--stop", "-c", "local")
        assert out.stdout.splitlines() == [f"stopped TensorBoard (pid {pid} on this machine) serving 900102"]
        assert tbhelp.gone(pid, started, timeout=15) and decoy.poll() is None
        assert meshrun(tmp_path, "tb", "--stop", "-c", "local").stdout == "no TensorBoard of yours runs on local\n"
    finally:
        decoy.kill()
        decoy.wait()


def test_a_tb_whose_server_another_terminal_stopped_ends_and_says_so(tmp_path: Path, tb_cleanup: Cleanup) -> None:
    """A new user's trial: after `meshrun tb --stop JOB` in a second terminal, the first `meshrun tb` kept
    running, forwarding to nothing."""
    run_dir = _job(tmp_path, "900104", tb_cleanup)
    proc, _ = _tb(tmp_path, "900104")
    try:
        pid, _started = _server(tmp_path, run_dir, "900104")
        stopped = meshrun(tmp_path, "tb", "--stop", "900104")
        assert stopped.stdout.startswith(f"stopped TensorBoard (pid {pid} "), stopped
        assert proc.wait(timeout=60) == 1
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert err.count("\n") == 1 and f"TensorBoard (pid {pid} on this machine) has stopped" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_needs_jobs_or_a_cluster(tmp_path: Path) -> None:
    out = meshrun(tmp_path, "tb")
    assert out.returncode == 2 and "JOB" in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


def test_ctrl_c_while_tensorboard_loads_leaves_no_server(tmp_path: Path, tb_cleanup: Cleanup) -> None:
    """Interrupted while the server starts, meshrun tb stops it once the helper has answered (a Ctrl-C just
    after the helper claimed the server, before its answer was read, left it running for 24 h: 1 run in 4);
    a server whose start was interrupted before any claim stops itself."""
    _job(tmp_path, "900104", tb_cleanup)
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun.submit.cli.main", "tb", "900104"],
        cwd=REPO,
        env=env_for(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        found = tbhelp.until("a server process", lambda: tbhelp.servers(tb_cleanup.keys), timeout=60)
        proc.send_signal(signal.SIGINT)  # TensorBoard is still loading (seconds): no URL printed yet
        assert proc.wait(timeout=30) == 0
        ((pid, started),) = found.items()
        # It looks for a claim once TensorBoard has loaded (seconds when idle; under a loaded suite, up to the
        # start's own limit), then stops within a second.
        wait = tbserve.START_TIMEOUT_S + 10
        assert tbhelp.gone(pid, started, timeout=wait), "a server nobody knows of outlived meshrun tb"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
