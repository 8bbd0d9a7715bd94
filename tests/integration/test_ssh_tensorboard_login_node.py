"""`meshrun tb` run on the login node itself (local transport): it starts TensorBoard there, prints
the URL and the `ssh -L` line a laptop would need, serves the run's loss, and Ctrl-C stops it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from submit.registry import JobRecord, Registry
from tests.integration import sshbed
from tests.integration.cli import REPO, env_for


def test_tb_on_the_login_node_prints_the_tunnel_line(testbed: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    losses = [5.5, 4.25, 3.125]
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses))
    )
    Registry(tmp_path / "state" / "meshrun" / "registry.sqlite").add(
        JobRecord("900001", "testbed", "fake", str(run_dir), "slurm", 0.0, None, "h", "COMPLETED")
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "submit.cli", "tb", "900001"],
        cwd=REPO,
        text=True,
        env=env_for(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:").split()[-1]
        hint = sshbed.first_line_with(proc.stdout, "ssh -N -L")
        port = url.rstrip("/").rsplit(":", 1)[1]
        assert f"ssh -N -L {port}:127.0.0.1:{port} " in hint and f"http://127.0.0.1:{port}/" in hint
        deadline = time.monotonic() + 60
        while True:
            try:  # TensorBoard loads in the background: the tag may not exist yet (HTTP 400)
                with urllib.request.urlopen(url + "data/plugin/scalars/scalars?run=900001&tag=loss", timeout=10) as r:
                    points = json.loads(r.read())
            except urllib.error.HTTPError:
                points = []
            if len(points) == len(losses) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [(step, value) for _, step, value in points] == [(i + 1, v) for i, v in enumerate(losses)]
    except Exception:
        proc.kill()
        raise
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0 and "stopped TensorBoard" in proc.stderr.read()
