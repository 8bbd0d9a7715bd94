"""`meshrun tb` run on the login node itself (local transport): it starts TensorBoard there, prints
the URL and the `ssh -L` line a laptop would need, serves the run's loss, and Ctrl-C stops it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from meshrun.submit.core.registry import JobRecord, Registry
from tests.helpers import sshbed, tbhelp
from tests.helpers.cli import REPO, env_for
from tests.helpers.tbhelp import Cleanup


def test_tb_on_the_login_node_prints_the_tunnel_line(testbed: dict, tmp_path: Path, tb_cleanup: Cleanup) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    losses = [5.5, 4.25, 3.125]
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses))
    )
    Registry(tmp_path / "state" / "meshrun" / "registry.sqlite").add(
        JobRecord("900001", "testbed", "fake", str(run_dir), "slurm", 0.0, None, "h", "COMPLETED")
    )
    tb_cleanup.runs([("900001", run_dir)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun.submit.cli.main", "tb", "900001"],
        cwd=REPO,
        text=True,
        env=env_for(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:").split()[-1]
        hint = sshbed.first_line_with(proc.stdout, "ssh -N -L")
        base, token = tbhelp.split_url(url)
        port = base.rstrip("/").rsplit(":", 1)[1]
        # The laptop's tunnel to the same port, then the same URL (its token included) in the laptop's browser.
        assert f"ssh -N -L {port}:127.0.0.1:{port} " in hint and hint.rstrip().endswith(f" open {url}")
        browser = tbhelp.Browser(url)
        tbhelp.until("the loss", lambda: browser.losses("900001") == list(enumerate(losses, 1)))
    except Exception:
        proc.kill()
        raise
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0 and "stopped TensorBoard" in proc.stderr.read()
