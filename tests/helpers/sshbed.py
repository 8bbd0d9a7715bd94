"""The testbed reached ONLY over SSH: a cluster profile, a user project, and sshd's own record of logins.

The profile points at the testbed's sshd (127.0.0.1:2222 in slot 0, key only, its known_hosts);
its setup line activates this venv by absolute path (an SSH session has no
MESHRUN_TESTBED_VENV). Nothing in it lets meshrun run Slurm commands locally.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from tests.helpers import cli
from tests.testbed import testbed as tb

SSHD_LOG = tb.LOG / "sshd.log"
SSHD_START_S = 10.0


def _partition(name: str, nodes: int, default: bool = False) -> dict[str, Any]:
    shape = {"gpus_per_node": tb.GPUS_PER_NODE, "cpus_per_node": tb.CPUS_PER_NODE, "memory_gb": 2}
    return {
        "name": name,
        **shape,
        "max_time": "1-00:00:00",
        "max_nodes": nodes,
        **({"default": True} if default else {}),
    }


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
        # As cluster_configs/testbed.yaml: the 2-node default, its preempting twin, and `wide` (n1-n3: room for
        # a spare node).
        "partitions": [
            _partition(tb.PARTITION, len(tb.PARTITION_NODES), default=True),
            _partition(tb.HIGH_PARTITION, len(tb.PARTITION_NODES)),
            _partition(tb.WIDE_PARTITION, len(tb.NODES)),
        ],
        "interconnect": {"nvlink_domain": 2, "nccl": {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}},
    }
    path = tmp / f"{name}.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # a user's profile: private, as meshrun's files
    with os.fdopen(fd, "w") as handle:
        handle.write(yaml.safe_dump(data, sort_keys=False))
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
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
    pauses = cli.poll_pauses(states)
    while True:
        (row,) = json.loads(meshrun(home, "status", job, "--json", check=True).stdout)
        if row["state"] in states:
            return row
        assert time.monotonic() < deadline, row
        time.sleep(next(pauses))


def first_line_with(stream: Any, needle: str, timeout: float = 60) -> Optional[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if needle in line:
            return line
        if not line:
            time.sleep(0.1)
    return None


# ------------------------------------------------------------------ a second sshd (a jump host)


def fingerprint(pub: Path) -> str:
    """A public key's SHA256 fingerprint as `ssh-keygen -l` prints it (what an admin would publish)."""
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the caller binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class ExtraSshd:
    """A second real OpenSSH sshd on 127.0.0.1, with a host key of its own, in front of the testbed's."""

    folder: Path
    """Its config, host key, PID file and log."""
    port: int
    """The loopback port it listens on (kept across restarts, so known_hosts names the same host)."""
    process: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False)
    """The running sshd (-D: this is its own PID), None while stopped."""

    @property
    def host_key(self) -> Path:
        return self.folder / "ssh_host_ed25519_key"

    @property
    def fingerprint(self) -> str:
        """Its host key's fingerprint, as `ssh-keygen -l` prints it."""
        return fingerprint(Path(f"{self.host_key}.pub"))

    @property
    def key_name(self) -> str:
        """How known_hosts (and meshrun's messages) name it."""
        return f"[127.0.0.1]:{self.port}"

    @property
    def log(self) -> Path:
        return self.folder / "sshd.log"

    def logins(self) -> int:
        """Successful logins so far, counted by this sshd itself."""
        return self.log.read_text(errors="replace").count("Accepted publickey") if self.log.exists() else 0

    def new_host_key(self) -> None:
        """A fresh host key (as a reinstalled host, or an impostor, would present)."""
        for path in (self.host_key, Path(f"{self.host_key}.pub")):
            path.unlink(missing_ok=True)
        comment = f"meshrun-extra-sshd-{time.time_ns()}"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(self.host_key)], check=True
        )

    def start(self) -> None:
        """Run sshd on `port` with the testbed's settings (key-only, root, forwarding) but this host key."""
        kept = [
            line
            for line in (tb.ETC / "sshd_config").read_text().splitlines()
            if not line.startswith(("Port ", "HostKey ", "PidFile ", "ListenAddress "))
        ]
        config = self.folder / "sshd_config"
        head = [f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}"]
        config.write_text("\n".join([*head, f"PidFile {self.folder / 'sshd.pid'}", *kept]) + "\n")
        self.process = subprocess.Popen([tb._bin("sshd"), "-D", "-f", str(config), "-E", str(self.log)])
        deadline = time.monotonic() + SSHD_START_S
        while not _says_ssh(self.port):
            running = self.process.poll() is None
            assert running and time.monotonic() < deadline, f"extra sshd did not start: {self.log.read_text()}"
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop this sshd by its own PID (never by name: other testbeds run sshds too)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def restart_with_new_key(self) -> None:
        """Stop, regenerate the host key, start again on the same port: the same host, another key."""
        self.stop()
        self.new_host_key()
        self.start()


def _says_ssh(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def extra_sshd(folder: Path) -> ExtraSshd:
    """Start a second sshd with a new host key of its own on a free loopback port; the caller's fixture
    stops it (`.stop()`, by its PID) in its finaliser."""
    folder.mkdir(parents=True, exist_ok=True)
    server = ExtraSshd(folder, free_port())
    server.new_host_key()
    server.start()
    return server


def jump_config(home: Path, alias: str, server: ExtraSshd) -> Path:
    """~/.ssh/config in `home` naming `alias` as `server` (the testbed's user and client key)."""
    info = tb.ssh_info()
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    path = home / ".ssh" / "config"
    path.write_text(
        f"Host {alias}\n  HostName 127.0.0.1\n  Port {server.port}\n  User {info['user']}\n"
        f"  IdentityFile {info['identity_file']}\n  IdentitiesOnly yes\n"
    )
    return path
