"""The testbed reached ONLY over SSH: a cluster profile, a user project, and sshd's own record of logins.

The profile points at the testbed's sshd (127.0.0.1:2222, key only, its known_hosts);
its setup line activates this venv by absolute path (an SSH session has no
MESHRUN_TESTBED_VENV). Nothing in it lets meshrun run Slurm commands locally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from tests.integration import cli
from tests.testbed import testbed as tb

SSHD_LOG = tb.LOG / "sshd.log"


def profile(tmp: Path, name: str = "sshbed", **ssh: Any) -> Path:
    """A profile YAML file reaching the testbed over SSH (`ssh` entries override the testbed's)."""
    info = tb.ssh_info()
    section = {
        "host": info["host"],
        "port": info["port"],
        "user": info["user"],
        "identity_file": info["identity_file"],
        "known_hosts": info["known_hosts"],
        **ssh,
    }
    data = {
        "name": name,
        "scheduler": "slurm",
        "ssh": {k: v for k, v in section.items() if v is not None},
        "paths": {"work_dir": f"{tb.TESTBED_DIR}/work-ssh", "checkpoint_root": f"{tb.TESTBED_DIR}/ckpt-ssh"},
        "setup": [f"source {sys.prefix}/bin/activate"],
        "python": "python",
        "partitions": [
            {
                "name": tb.PARTITION,
                "gpus_per_node": tb.GPUS_PER_NODE,
                "cpus_per_node": tb.CPUS_PER_NODE,
                "memory_gb": 2,
                "max_time": "1-00:00:00",
                "max_nodes": 2,
                "default": True,
            }
        ],
        "interconnect": {"nvlink_domain": 2, "nccl": {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def project(tmp: Path, files: dict[str, str]) -> Path:
    """A user's project: a git work tree holding the job spec(s) and code."""
    root = tmp / "project"
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def meshrun(home: Path, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """`meshrun ARGS` as on a laptop: no Slurm here, the cluster only over SSH."""
    return cli.meshrun(home, *args, laptop=True, **kwargs)


def command_spec(name: str, argv: list[str], **resources: Any) -> str:
    spec = {
        "name": name,
        "resources": {"nodes": 1, "tasks_per_node": 1, "time": "00:05:00", **resources},
        "command": argv,
    }
    return yaml.safe_dump(spec, sort_keys=False)


def logins() -> int:
    """Successful SSH logins so far, from sshd's own log: connections opened, counted by the server."""
    return SSHD_LOG.read_text(errors="replace").count("Accepted publickey") if SSHD_LOG.exists() else 0


def kill_sessions() -> int:
    """Kill every per-connection sshd process (the server side of each open SSH connection)."""
    listener = int(Path(tb.RUN / "sshd.pid").read_text().split()[0])
    out = subprocess.run(["pgrep", "-P", str(listener)], capture_output=True, text=True).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(out)


def watch_until_done(home: Path, job: str, timeout: float = 300) -> list[dict[str, Any]]:
    """`meshrun status JOB --watch --json`: it returns once the job is done; the last refresh."""
    out = meshrun(home, "status", job, "--watch", "--json", timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_state(home: Path, job: str, states: tuple[str, ...], timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        (row,) = json.loads(meshrun(home, "status", job, "--json", check=True).stdout)
        if row["state"] in states:
            return row
        assert time.monotonic() < deadline, row
        time.sleep(0.5)


def first_line_with(stream: Any, needle: str, timeout: float = 60) -> Optional[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if needle in line:
            return line
        if not line:
            time.sleep(0.1)
    return None
