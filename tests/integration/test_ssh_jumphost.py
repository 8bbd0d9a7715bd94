"""Jump hosts through the real CLI: a SECOND real sshd, with a host key of its own, is the jump host in
front of the testbed's login node. Its unknown key is refused (one line: the host, its fingerprint,
`meshrun trust`) and nothing is recorded or sent past it; `meshrun trust` records it on the fingerprint
the admins publish; then submit and status go through the jump; after the jump host's key changes (a
new key, the sshd restarted on the same port) every connection is refused with the man-in-the-middle
warning and known_hosts is left as it was (no AutoAddPolicy anywhere on the road)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from meshrun.submit.core.registry import Registry
from tests.helpers import sshbed
from tests.helpers.cli import submitted
from tests.helpers.sshbed import ExtraSshd, meshrun
from tests.testbed import testbed as tb

PROBE = sshbed.command_spec("probe", ["true"])
LOGIN = f"[127.0.0.1]:{tb.PORTS['sshd']}"


@pytest.fixture
def jump(testbed: dict[str, object], tmp_path: Path) -> Iterator[ExtraSshd]:
    """The jump host: its own sshd and host key, stopped by its PID when the test ends."""
    server = sshbed.extra_sshd(tmp_path / "jump-sshd")
    try:
        yield server
    finally:
        server.stop()


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("meshrun: error: "), done.stderr
    return str(done.stderr)


def test_jump_host_key_unknown_then_trusted_then_changed(jump: ExtraSshd, tmp_path: Path) -> None:
    sshbed.jump_config(tmp_path, "bastion", jump)  # the laptop's ~/.ssh/config (HOME is tmp_path)
    known = tmp_path / "known_hosts"
    login_line = Path(str(tb.ssh_info()["known_hosts"])).read_text()
    known.write_text(login_line)  # the login node is trusted, the jump host is not
    profile = sshbed.profile(tmp_path, "jumped", proxy_jump="bastion", known_hosts=str(known))
    spec = str(sshbed.project(tmp_path, {"probe.yaml": PROBE}) / "probe.yaml")

    def submit() -> subprocess.CompletedProcess[str]:
        return meshrun(tmp_path, "submit", spec, "-c", str(profile))

    # 1. Unknown jump host: refused at key exchange, before any login anywhere.
    logins, jump_logins = sshbed.logins(), jump.logins()
    error = _one_line_error(submit())
    assert f"unknown host {jump.key_name}:" in error and jump.fingerprint in error, error
    assert f"run `meshrun trust {profile}`" in error and "never accepts an unknown host" in error
    assert (sshbed.logins(), jump.logins()) == (logins, jump_logins)  # nothing authenticated, nothing sent on
    assert known.read_text() == login_line  # nothing added by itself
    refused = meshrun(tmp_path, "trust", str(profile), input="no\n")
    assert refused.returncode == 1 and jump.fingerprint in refused.stdout and known.read_text() == login_line

    # 2. Trusted with meshrun's explicit command, on the published fingerprint: the road through the jump works.
    trusted = meshrun(tmp_path, "trust", str(profile), "--fingerprint", jump.fingerprint, check=True)
    assert f"recorded {jump.key_name} in {known}" in trusted.stdout and f"{LOGIN} is already trusted" in trusted.stdout
    logins, jump_logins = sshbed.logins(), jump.logins()  # trust logged in to the jump to reach the login node
    out = submit()
    assert out.returncode == 0, out.stderr
    assert jump.logins() - jump_logins == 1 and sshbed.logins() - logins == 1  # the jump, then the login node
    job_id, _ = submitted(out)
    (row,) = json.loads(meshrun(tmp_path, "status", job_id, "--json", check=True).stdout)
    assert row["job_id"] == job_id and jump.logins() - jump_logins == 2
    trusted_text = known.read_text()

    # 3. The jump host's key changes (same host and port, a new key): refused as a possible MITM.
    old = jump.fingerprint
    jump.restart_with_new_key()
    assert jump.fingerprint != old
    logins, jump_logins = sshbed.logins(), jump.logins()
    shown = meshrun(tmp_path, "status", job_id, "--json")
    if shown.returncode == 0:
        # the quick job's end was seen in step 2 (its row is kept): shown, the error said beside it on stderr
        (row,) = json.loads(shown.stdout)
        assert row["done"] and "Traceback" not in shown.stderr, (row, shown.stderr)
    for error in (_one_line_error(submit()), shown.stderr if shown.returncode == 0 else _one_line_error(shown)):
        assert f"the host key of {jump.key_name} has CHANGED" in error and "man-in-the-middle" in error, error
        assert jump.fingerprint in error and old in error and f"run `meshrun trust {profile} --replace`" in error
    again = _one_line_error(meshrun(tmp_path, "trust", str(profile), input="yes\n"))  # no --replace: no
    assert "CHANGED" in again and jump.fingerprint in again
    assert (sshbed.logins(), jump.logins()) == (logins, jump_logins) and known.read_text() == trusted_text
    registry = Registry(tmp_path / "state" / "meshrun" / "registry.sqlite")
    assert [r.job_id for r in registry.recent()] == [job_id]  # the refused submit recorded nothing
    registry.close()
