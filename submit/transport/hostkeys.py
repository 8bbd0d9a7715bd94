"""Host keys: the known_hosts file, the refusal of unknown hosts, the changed-key warning.

meshrun never accepts a host key by itself: an unknown host is refused (RejectPolicy,
with the fingerprint in the message) and a changed key is refused with a
man-in-the-middle warning. Only `meshrun trust` records a key, on the user's word.

known_hosts is read here, not by paramiko: paramiko crashes on OpenSSH's marker lines.
`@revoked` keys are refused for the hosts their pattern matches (even where a plain
line lists them); `@cert-authority` lines are skipped: meshrun does not verify host
certificates, only plain host keys.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import paramiko

from meshrun.submit.errors import ClusterError, HostKeyChanged, HostKeyRevoked, HostKeyUnknown

REVOKED, CERT_AUTHORITY = "@revoked", "@cert-authority"


class UnknownHostKey(HostKeyUnknown):
    """The host is not in known_hosts."""

    def __init__(self, key_name: str, key: paramiko.PKey, known_hosts: str, cluster: str) -> None:
        self.key = key
        super().__init__(
            f"unknown host {key_name}: its {key.get_name()} key {key.fingerprint} is not in "
            f"{known_hosts}, and meshrun never accepts an unknown host by itself; check the "
            f"fingerprint with the cluster's admins, then run `meshrun trust {cluster}`"
        )


class ChangedHostKey(HostKeyChanged):
    """known_hosts holds another key for the host."""

    def __init__(
        self, key_name: str, got: paramiko.PKey, expected: paramiko.PKey, known_hosts: str, cluster: str
    ) -> None:
        self.key = got
        super().__init__(
            f"WARNING: the host key of {key_name} has CHANGED: it now presents {got.get_name()} "
            f"{got.fingerprint}, but {known_hosts} has {expected.get_name()} {expected.fingerprint}. "
            f"Someone may be intercepting the connection (man-in-the-middle attack), or the host "
            f"was reinstalled; nothing was sent to it. Ask the cluster's admins; only if they confirm "
            f"the new key, run `meshrun trust {cluster} --replace`"
        )


class RevokedHostKey(HostKeyRevoked):
    """The host presents a key known_hosts marks @revoked."""

    def __init__(self, key_name: str, key: paramiko.PKey, known_hosts: str) -> None:
        self.key = key
        super().__init__(
            f"REFUSED: {key_name} presents the {key.get_name()} host key {key.fingerprint}, which "
            f"{known_hosts} marks @revoked (a compromised or retired key must never be accepted); "
            f"nothing was sent to it. Ask the cluster's admins which key the host should present"
        )


class RefuseUnknown(paramiko.RejectPolicy):  # type: ignore[misc]  # paramiko ships no type hints
    """RejectPolicy that says which host, which key and what to do (and refuses a revoked key as such)."""

    def __init__(self, known_hosts: str, cluster: str) -> None:
        self.known_hosts, self.cluster = known_hosts, cluster

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if revoked(self.known_hosts, hostname, key):
            raise RevokedHostKey(hostname, key, self.known_hosts)
        raise UnknownHostKey(hostname, key, self.known_hosts, self.cluster)


def _lines(path: str) -> Iterator[tuple[str, str, paramiko.PKey]]:
    """(marker or "", host field, key) for each usable line. Lines paramiko cannot read (an unknown key
    type, a broken line) are skipped, as OpenSSH skips them."""
    if not os.path.isfile(path):
        return
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise ClusterError(f"cannot read known_hosts {path}: {exc.strerror or exc}; fix or move the file") from None
    for raw in text.splitlines():
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else ""
        if marker not in ("", REVOKED, CERT_AUTHORITY) or len(fields) < 3:
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]))
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError, TypeError):
            entry = None  # a corrupt key (InvalidHostKey is a plain Exception, not an SSHException)
        if entry is not None and entry.key is not None:
            yield marker, fields[0], entry.key


def _pattern_matches(pattern: str, key_name: str) -> bool:
    """One OpenSSH host pattern (`*` and `?` wildcards only; `[host]:port` is literal), case-insensitive."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(regex, key_name.lower()) is not None


def _revoked_for(host_field: str, key_name: str) -> bool:
    """Does an @revoked line's host field cover key_name? (Patterns, `!negation`, hashed names.)"""
    hit = False
    for entry in host_field.split(","):
        if entry.startswith("!"):
            if _pattern_matches(entry[1:], key_name):
                return False
        elif _matches(entry, key_name) or (not entry.startswith("|1|") and _pattern_matches(entry, key_name)):
            hit = True
    return hit


def revoked(path: str, key_name: str, key: paramiko.PKey) -> bool:
    """Does known_hosts mark this key @revoked for key_name?"""
    return any(
        marker == REVOKED and found == key and _revoked_for(hosts, key_name) for marker, hosts, found in _lines(path)
    )


def known(path: str, key_name: str) -> dict[str, paramiko.PKey]:
    """key type -> key recorded for key_name by plain lines (empty when the host is unknown); revoked keys
    are never known, and @cert-authority lines are not host keys."""
    lines = list(_lines(path))
    bad = [found for marker, hosts, found in lines if marker == REVOKED and _revoked_for(hosts, key_name)]
    return {
        found.get_name(): found
        for marker, hosts, found in lines
        if not marker and _matches(hosts, key_name) and found not in bad
    }


def check(path: str, key_name: str, key: paramiko.PKey, cluster: str) -> bool:
    """True if `key` is the recorded key; False if the host is unknown; ChangedHostKey if another key is
    recorded; RevokedHostKey if known_hosts marks it @revoked."""
    if revoked(path, key_name, key):
        raise RevokedHostKey(key_name, key, path)
    recorded = known(path, key_name)
    if not recorded:
        return False
    same = recorded.get(key.get_name())
    if same is not None and same == key:
        return True
    expected = same if same is not None else next(iter(recorded.values()))
    raise ChangedHostKey(key_name, key, expected, path, cluster)


def host_keys(path: str, key_name: str) -> paramiko.HostKeys:
    """The keys paramiko may accept for key_name (what `known` says), for SSHClient's host key check."""
    keys = paramiko.HostKeys()
    for key_type, key in known(path, key_name).items():
        keys.add(key_name, key_type, key)
    return keys


def _matches(host_field: str, key_name: str) -> bool:
    """Is key_name one of the field's names, plain or hashed? (Exact: what `remove` may drop.)"""
    for entry in host_field.split(","):
        if entry == key_name:
            return True
        if entry.startswith("|1|"):
            try:
                if paramiko.HostKeys.hash_host(key_name, entry.split("|")[2]) == entry:
                    return True
            except (IndexError, ValueError, AssertionError):  # a mangled hash: not this host
                continue
    return False


def remove(path: str, key_name: str) -> int:
    """Drop the lines for key_name (plain or hashed); other lines stay byte for byte. Returns how many."""
    if not os.path.isfile(path):
        return 0
    lines = Path(path).read_text().splitlines(keepends=True)
    kept = [
        line
        for line in lines
        if not (line.strip() and not line.startswith(("#", "@")) and _matches(line.split()[0], key_name))
    ]
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
