"""Host keys: the known_hosts file, the refusal of unknown hosts, the changed-key warning.

meshrun never accepts a host key by itself: an unknown host is refused (RejectPolicy,
with the fingerprint in the message) and a changed key is refused with a
man-in-the-middle warning. Only `meshrun trust` records a key, on the user's word.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import paramiko

from submit.errors import ClusterError


class UnknownHostKey(ClusterError):
    """The host is not in known_hosts."""
    retry = False  # reconnecting cannot fix it

    def __init__(self, key_name: str, key: paramiko.PKey, known_hosts: str, cluster: str) -> None:
        self.key = key
        super().__init__(f"unknown host {key_name}: its {key.get_name()} key {key.fingerprint} is not in "
                         f"{known_hosts}, and meshrun never accepts an unknown host by itself; check the "
                         f"fingerprint with the cluster's admins, then run `meshrun trust {cluster}`")


class ChangedHostKey(ClusterError):
    """known_hosts holds another key for the host."""
    retry = False

    def __init__(self, key_name: str, got: paramiko.PKey, expected: paramiko.PKey, known_hosts: str,
                 cluster: str) -> None:
        self.key = got
        super().__init__(f"WARNING: the host key of {key_name} has CHANGED: it now presents {got.get_name()} "
                         f"{got.fingerprint}, but {known_hosts} has {expected.get_name()} {expected.fingerprint}. "
                         f"Someone may be intercepting the connection (man-in-the-middle attack), or the host "
                         f"was reinstalled; nothing was sent to it. Ask the cluster's admins; only if they confirm "
                         f"the new key, run `meshrun trust {cluster} --replace`")


class RefuseUnknown(paramiko.RejectPolicy):
    """RejectPolicy that says which host, which key and what to do."""

    def __init__(self, known_hosts: str, cluster: str) -> None:
        self.known_hosts, self.cluster = known_hosts, cluster

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(hostname, key, self.known_hosts, self.cluster)


def load(path: str) -> paramiko.HostKeys:
    """The known_hosts file (an empty set when it does not exist yet)."""
    keys = paramiko.HostKeys()
    if os.path.isfile(path):
        try:
            keys.load(path)
        except (OSError, paramiko.SSHException) as exc:
            raise ClusterError(f"cannot read known_hosts {path}: {exc}; fix or move the file") from None
    return keys


def known(path: str, key_name: str) -> dict[str, paramiko.PKey]:
    """key type -> key recorded for key_name (empty when the host is unknown)."""
    found = load(path).lookup(key_name)
    return dict(found) if found is not None else {}


def check(path: str, key_name: str, key: paramiko.PKey, cluster: str) -> bool:
    """True if `key` is the recorded key; False if the host is unknown; ChangedHostKey if another key is recorded."""
    recorded = known(path, key_name)
    if not recorded:
        return False
    same = recorded.get(key.get_name())
    if same is not None and same == key:
        return True
    expected = same if same is not None else next(iter(recorded.values()))
    raise ChangedHostKey(key_name, key, expected, path, cluster)


def _matches(host_field: str, key_name: str) -> bool:
    for entry in host_field.split(","):
        if entry == key_name:
            return True
        if entry.startswith("|1|"):
            salt = entry.split("|")[2]
            if paramiko.HostKeys.hash_host(key_name, salt) == entry:
                return True
    return False


def remove(path: str, key_name: str) -> int:
    """Drop the lines for key_name (plain or hashed); other lines stay byte for byte. Returns how many."""
    if not os.path.isfile(path):
        return 0
    lines = Path(path).read_text().splitlines(keepends=True)
    kept = [line for line in lines if not (line.strip() and not line.startswith(("#", "@"))
                                           and _matches(line.split()[0], key_name))]
    if len(kept) != len(lines):
        _write_private(path, "".join(kept))
    return len(lines) - len(kept)


def append(path: str, key_name: str, key: paramiko.PKey) -> None:
    """Record key_name's key: one OpenSSH known_hosts line."""
    text = Path(path).read_text() if os.path.isfile(path) else ""
    if text and not text.endswith("\n"):
        text += "\n"
    _write_private(path, text + f"{key_name} {key.get_name()} {key.get_base64()}\n")


def _write_private(path: str, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.meshrun-tmp")
    tmp.write_text(text)
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o600
    os.chmod(tmp, mode)
    os.replace(tmp, target)


def preferred_types(path: str, key_name: str, transport: Any) -> None:
    """Ask the server for the key type we have on record first, so a known host compares like with like."""
    recorded = list(known(path, key_name))
    if not recorded:
        return
    options = transport.get_security_options()
    first = [t for t in recorded if t in options.key_types]
    if "ssh-rsa" in recorded:
        first += [t for t in ("rsa-sha2-512", "rsa-sha2-256") if t in options.key_types]
    options.key_types = tuple(first + [t for t in options.key_types if t not in first])


def describe(key_name: str, key: paramiko.PKey) -> str:
    return f"{key_name} presents this {key.get_name()} host key: {key.fingerprint}"


def fingerprint_of(key: Optional[paramiko.PKey]) -> str:
    return key.fingerprint if key is not None else "-"
