"""~/.ssh/config resolution and known_hosts handling, without a server."""

from __future__ import annotations

import getpass
import re
from pathlib import Path

import paramiko
import pytest

from meshrun.submit import errors
from meshrun.submit.config.cluster import Ssh
from meshrun.submit.errors import InputError
from meshrun.submit.transport import hostkeys
from meshrun.submit.transport.sshconfig import resolve

CONFIG = """\
Host login
  HostName login.example.org
  User alice
  Port 2200
  IdentityFile {key}
  ProxyJump bastion

Host bastion
  HostName bastion.example.org
  User bob

Host plain
  IdentitiesOnly yes
"""


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    key = tmp_path / "id_test"
    key.write_text("not really a key")
    path = tmp_path / "config"
    path.write_text(CONFIG.format(key=key))
    monkeypatch.setenv("MESHRUN_SSH_CONFIG", str(path))
    return key


def test_alias_is_completed_by_ssh_config(config: Path) -> None:
    target = resolve(Ssh(host="login", known_hosts="/kh"))
    assert (target.hostname, target.port, target.user) == ("login.example.org", 2200, "alice")
    assert target.identity_files == (str(config),) and target.key_name == "[login.example.org]:2200"
    assert target.jump is not None and (target.jump.hostname, target.jump.user, target.jump.port) == (
        "bastion.example.org",
        "bob",
        22,
    )
    assert target.jump.jump is None and target.known_hosts == target.jump.known_hosts == "/kh"


def test_the_profile_wins_over_ssh_config(config: Path, tmp_path: Path) -> None:
    key = tmp_path / "mine"
    key.write_text("x")
    target = resolve(Ssh(host="login", user="carol", port=22, identity_file=str(key), proxy_jump="none"))
    assert (target.user, target.port, target.key_name) == ("carol", 22, "login.example.org")
    assert target.identity_files[0] == str(key) and target.jump is None


def test_proxy_jump_chain_and_identities_only(config: Path) -> None:
    target = resolve(Ssh(host="plain", proxy_jump="u1@hop1:2201,hop2"))
    assert not target.look_for_keys and target.hostname == "plain"
    assert (target.jump.hostname, target.jump.user) == ("hop2", getpass.getuser())
    assert (target.jump.jump.hostname, target.jump.jump.user, target.jump.jump.port) == ("hop1", "u1", 2201)


def test_bad_proxy_jump_and_missing_key_are_input_errors(config: Path) -> None:
    with pytest.raises(InputError, match="proxy_jump"):
        resolve(Ssh(host="plain", proxy_jump="a@b@c"))
    with pytest.raises(InputError, match="identity_file"):
        resolve(Ssh(host="plain", identity_file="/nonexistent/key"))


def _make_key() -> paramiko.PKey:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{tmp}/k"], check=True)
        return paramiko.Ed25519Key.from_private_key_file(f"{tmp}/k")


def test_known_hosts_check_append_and_replace_keep_other_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "sub" / "known_hosts")
    good, bad = _make_key(), _make_key()
    assert hostkeys.check(path, "[h]:2222", good, "c") is False  # unknown, file absent
    hostkeys.append(path, "[h]:2222", good)
    assert hostkeys.check(path, "[h]:2222", good, "c") is True
    assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
    with pytest.raises(hostkeys.ChangedHostKey, match="man-in-the-middle"):
        hostkeys.check(path, "[h]:2222", bad, "c")
    hashed = paramiko.HostKeys.hash_host("[h]:2222")
    Path(path).write_text(
        f"# comment\nother ssh-ed25519 {good.get_base64()}\n{hashed} ssh-ed25519 "
        f"{bad.get_base64()}\n[h]:2222 ssh-ed25519 {bad.get_base64()}\n"
    )
    assert hostkeys.remove(path, "[h]:2222") == 2
    assert Path(path).read_text() == f"# comment\nother ssh-ed25519 {good.get_base64()}\n"


def test_marker_lines_are_parsed_not_fatal(tmp_path: Path) -> None:
    """`@cert-authority` and `@revoked` are valid OpenSSH known_hosts lines: neither may crash a verb.
    A CA line is skipped for plain matching; a revoked key is refused even where a plain line lists it."""
    path = str(tmp_path / "known_hosts")
    good, ca, revoked = _make_key(), _make_key(), _make_key()
    Path(path).write_text(
        f"@cert-authority *.example.org,[h]:2222 ssh-ed25519 {ca.get_base64()}\n"
        f"@revoked * ssh-ed25519 {revoked.get_base64()}\n"
        f"[h]:2222 ssh-ed25519 {good.get_base64()}\n"
        f"[r]:2222 ssh-ed25519 {revoked.get_base64()}\n"
        f"broken-line-without-a-key\n"
    )
    assert hostkeys.check(path, "[h]:2222", good, "c") is True
    assert hostkeys.known(path, "[h]:2222") == {"ssh-ed25519": good}  # the CA key is not a host key
    assert hostkeys.known(path, "[r]:2222") == {}  # a revoked key is never "known"
    with pytest.raises(
        errors.HostKeyRevoked, match=rf"REFUSED: \[r\]:2222 .*{re.escape(revoked.fingerprint)}.*@revoked"
    ):
        hostkeys.check(path, "[r]:2222", revoked, "c")
    assert hostkeys.revoked(path, "[x]:22", revoked) and not hostkeys.revoked(path, "[x]:22", good)
    hostkeys.append(path, "[n]:2222", good)
    assert hostkeys.remove(path, "[n]:2222") == 1
    assert Path(path).read_text().startswith("@cert-authority") and "@revoked" in Path(path).read_text()


def test_revoked_patterns_follow_openssh(tmp_path: Path) -> None:
    path = str(tmp_path / "known_hosts")
    key = _make_key()
    Path(path).write_text(f"@revoked *.example.org,!bad.example.org ssh-ed25519 {key.get_base64()}\n")
    assert hostkeys.revoked(path, "login.example.org", key)
    assert not hostkeys.revoked(path, "bad.example.org", key) and not hostkeys.revoked(path, "other.org", key)


def test_refusals_are_distinguishable_host_key_errors(tmp_path: Path) -> None:
    """status (and anyone) can tell a refused host key from an unreachable host without importing paramiko."""
    good, bad = _make_key(), _make_key()
    changed = hostkeys.ChangedHostKey("[h]:2222", bad, good, "kh", "c")
    assert isinstance(changed, errors.HostKeyChanged) and isinstance(changed, errors.ClusterError)
    assert changed.security and not changed.retry and "man-in-the-middle" in str(changed)
    unknown = hostkeys.UnknownHostKey("[h]:2222", good, "kh", "c")
    assert isinstance(unknown, errors.HostKeyUnknown) and unknown.security
