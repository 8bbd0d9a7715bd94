"""Host keys and connection failures against the real sshd: an unknown host and a changed key are
refused (nothing reaches the cluster), `meshrun trust` records a key only on the user's word, and
every failure is one line. ~/.ssh/config aliases and ProxyJump are honoured."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import sshbed
from tests.helpers.cli import submitted
from tests.helpers.sshbed import meshrun
from tests.testbed import testbed as tb

PROBE = sshbed.command_spec("probe", ["true"])
SSHD_PORT = tb.PORTS["sshd"]  # this worker's testbed's


def _host_fingerprint() -> str:
    """The testbed host key's fingerprint as OpenSSH prints it (what an admin would publish)."""
    out = subprocess.run(["ssh-keygen", "-lf", f"{tb.SSH_HOST_KEY}.pub"], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]


def _other_key(tmp_path: Path) -> str:
    """Another host's key (type and base64), as an attacker's host would present it."""
    if not (tmp_path / "other.pub").exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    return " ".join((tmp_path / "other.pub").read_text().split()[:2])


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("meshrun: error: "), done.stderr
    return done.stderr


def _submit(tmp_path: Path, profile: Path) -> subprocess.CompletedProcess:
    root = tmp_path / "project"
    if not root.exists():
        sshbed.project(tmp_path, {"probe.yaml": PROBE})
    return meshrun(tmp_path, "submit", str(root / "probe.yaml"), "-c", str(profile))


def test_unknown_host_is_refused_until_the_user_trusts_it(testbed: dict, tmp_path: Path) -> None:
    known = tmp_path / "ssh" / "known_hosts"
    profile = sshbed.profile(tmp_path, known_hosts=str(known))
    error = _one_line_error(_submit(tmp_path, profile))
    assert (
        f"unknown host [127.0.0.1]:{SSHD_PORT}" in error and _host_fingerprint() in error and "meshrun trust" in error
    )
    refused = meshrun(tmp_path, "trust", str(profile), input="no\n")
    assert refused.returncode == 1 and _host_fingerprint() in refused.stdout and not known.exists()
    trusted = meshrun(tmp_path, "trust", str(profile), input="yes\n", check=True)
    assert f"recorded [127.0.0.1]:{SSHD_PORT} in {known}" in trusted.stdout
    assert known.read_text().split()[:2] == [f"[127.0.0.1]:{SSHD_PORT}", "ssh-ed25519"]
    assert _submit(tmp_path, profile).returncode == 0
    again = meshrun(tmp_path, "trust", str(profile), check=True)
    assert "already trusted" in again.stdout and known.read_text().count("\n") == 1


def test_changed_host_key_is_refused_with_a_mitm_warning(testbed: dict, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(f"# kept\n[127.0.0.1]:{SSHD_PORT} {_other_key(tmp_path)}\n")
    profile = sshbed.profile(tmp_path, known_hosts=str(known))
    error = _one_line_error(_submit(tmp_path, profile))
    assert "CHANGED" in error and "man-in-the-middle" in error and _host_fingerprint() in error
    assert meshrun(tmp_path, "status", "--json", check=True).stdout.strip() == "[]"  # nothing was submitted
    assert "CHANGED" in _one_line_error(meshrun(tmp_path, "trust", str(profile), input="yes\n"))
    wrong = meshrun(tmp_path, "trust", str(profile), "--replace", "--fingerprint", "SHA256:" + "A" * 43)
    assert wrong.returncode == 1 and "nothing recorded" in wrong.stderr
    meshrun(tmp_path, "trust", str(profile), "--replace", "--fingerprint", _host_fingerprint(), check=True)
    lines = known.read_text().splitlines()
    assert lines[0] == "# kept" and len(lines) == 2 and _other_key(tmp_path) not in known.read_text()
    assert _submit(tmp_path, profile).returncode == 0


@pytest.fixture
def silent_port() -> int:
    """A TCP port that accepts connections and never says a word (no SSH banner)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    stop.set()
    server.close()
    for conn in held:
        conn.close()


@pytest.fixture
def http_port() -> Iterator[int]:
    """A TCP port where something else answers: one HTTP error line, then it closes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def answer() -> None:
        while True:
            try:
                conn = server.accept()[0]
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def test_connection_failures_are_one_line_each(testbed: dict, tmp_path: Path, silent_port: int, http_port: int) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "stranger")], check=True)
    bad_key = sshbed.profile(tmp_path, "badkey", identity_file=str(tmp_path / "stranger"))
    assert "authentication as 'root' failed" in _one_line_error(_submit(tmp_path, bad_key))
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    refused = sshbed.profile(tmp_path, "refused", port=closed)
    assert "connection refused" in _one_line_error(_submit(tmp_path, refused))
    silent = sshbed.profile(tmp_path, "silent", port=silent_port, timeout_s=1)
    assert "no answer within 1 s" in _one_line_error(_submit(tmp_path, silent))
    # Something answers at once, but it is no SSH server: say what answered, not "no answer within 15 s".
    other = sshbed.profile(tmp_path, "http", port=http_port, timeout_s=15)
    error = _one_line_error(_submit(tmp_path, other))
    assert "something answered, but not an SSH server (it said 'HTTP/1.1 400 Bad Request')" in error, error
    unknown = sshbed.profile(tmp_path, "nohost", host="no-such-host.invalid")
    assert "cannot resolve host name" in _one_line_error(_submit(tmp_path, unknown))


def test_ssh_config_alias_and_proxy_jump(testbed: dict, tmp_path: Path) -> None:
    info = tb.ssh_info()
    common = (
        f"  HostName {info['host']}\n  Port {info['port']}\n  User {info['user']}\n"
        f"  IdentityFile {info['identity_file']}\n  IdentitiesOnly yes\n"
    )
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(
        f"Host bastion\n{common}\nHost cluster-login\n{common}  ProxyJump bastion\n"
    )
    # The profile names only the alias: host name, port, user, key and the jump come from ~/.ssh/config.
    profile = sshbed.profile(tmp_path, host="cluster-login", port=None, user=None, identity_file=None)
    before = sshbed.logins()
    out = _submit(tmp_path, profile)
    assert out.returncode == 0, out.stderr
    assert sshbed.logins() - before == 2  # the bastion, then the login node through it
    job_id, _ = submitted(out)
    assert sshbed.watch_until_done(tmp_path, job_id)[0]["state"] == "COMPLETED"
