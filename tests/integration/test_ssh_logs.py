"""`meshrun logs -f` over SSH survives the server side of its connection being killed mid-job:
it reconnects, resumes at its byte offset, and what it printed equals the log file exactly."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import sshbed
from tests.helpers.cli import REPO, env_for, submitted
from tests.helpers.sshbed import meshrun

# 80 lines over ~8 s, of varying length (so chunk boundaries fall mid-line), no trailing newline.
TALKER = (
    "import sys, time; [(sys.stdout.write(f'line {i} ' + 'x' * (i * 7 % 61) + chr(10)), sys.stdout.flush(), "
    "time.sleep(0.1)) for i in range(80)]; sys.stdout.write('the end')"
)


def test_follow_resumes_after_the_ssh_session_is_killed(testbed: dict, tmp_path: Path) -> None:
    profile = sshbed.profile(tmp_path)
    root = sshbed.project(tmp_path, {"talker.yaml": sshbed.command_spec("talker", ["python", "-u", "-c", TALKER])})
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", str(root / "talker.yaml"), "-c", str(profile), check=True))
    out_path, err_path = tmp_path / "followed.out", tmp_path / "followed.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        follower = subprocess.Popen(
            [sys.executable, "-m", "meshrun.submit.cli.main", "logs", job_id, "-f"],
            cwd=REPO,
            env=env_for(tmp_path, laptop=True),
            stdout=out,
            stderr=err,
        )
        deadline = time.monotonic() + 120
        while out_path.read_bytes().count(b"\n") < 15:  # well into the job, well before its end
            assert follower.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        assert sshbed.kill_sessions() >= 1
        assert follower.wait(timeout=180) == 0, err_path.read_text()
    assert "connection to sshbed" in err_path.read_text() and "reconnected" in err_path.read_text()
    log = (run_dir / "logs" / "rank-0.log").read_bytes()
    assert log.endswith(b"the end") and b"line 79 " in log
    assert out_path.read_bytes() == log
