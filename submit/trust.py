"""`meshrun trust CLUSTER`: show a host's key fingerprint and record it, on the user's word only.

The key is fetched without logging in (the key exchange alone) and recorded in the
profile's known_hosts only when the user types `yes` or passes the fingerprint
they got from the cluster's admins (`--fingerprint SHA256:...`). A key that differs
from the recorded one is refused with the man-in-the-middle warning unless
`--replace` is given, and even then it needs the same confirmation. Jump hosts
(ProxyJump) are checked first, the same way.
"""
from __future__ import annotations

import socket
from typing import Callable, Optional

import paramiko

from submit import hostkeys
from submit.cluster import Ssh
from submit.errors import ClusterError
from submit.ssh import _connect_error, hop_channel, open_chain
from submit.sshconfig import Target, resolve

Ask = Callable[[str], str]
Say = Callable[[str], None]


def probe(target: Target, cluster: str) -> paramiko.PKey:
    """The host key target presents (through its jump hosts, which must already be trusted)."""
    chain: list[paramiko.SSHClient] = []
    try:
        if target.jump is not None:
            chain = open_chain(target.jump, cluster)
            sock: object = hop_channel(chain[-1], target)
        elif target.proxy_command:
            sock = paramiko.ProxyCommand(target.proxy_command)
        else:
            sock = socket.create_connection((target.hostname, target.port), timeout=target.timeout_s)
        transport = paramiko.Transport(sock)
        try:
            hostkeys.preferred_types(target.known_hosts, target.key_name, transport)
            transport.start_client(timeout=target.timeout_s)
            return transport.get_remote_server_key()
        finally:
            transport.close()
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise _connect_error(exc, target) from None
    finally:
        for client in reversed(chain):
            client.close()


def _normal(fingerprint: str) -> str:
    """`SHA256:abc` or `abc` -> `SHA256:abc` (as paramiko and ssh-keygen -l print it)."""
    text = fingerprint.strip()
    return text if text.startswith("SHA256:") else f"SHA256:{text}"


def _confirm(target: Target, key: paramiko.PKey, expected: Optional[str], ask: Ask) -> None:
    if expected is not None:
        if _normal(expected) != key.fingerprint:
            raise ClusterError(f"{target.key_name} presents {key.fingerprint}, not the {_normal(expected)} you "
                               f"gave; nothing recorded (a man-in-the-middle, or the wrong host?)")
        return
    try:
        answer = ask(f"Is this the key your cluster's admins publish for {target.key_name}? "
                     f"Type yes to record it in {target.known_hosts}: ")
    except EOFError:
        answer = ""
    if answer.strip().lower() != "yes":
        raise ClusterError(f"{target.key_name} not trusted: nothing recorded (answer `yes`, or pass "
                           f"--fingerprint SHA256:... as your admins publish it)")


def _trust(target: Target, cluster: str, expected: Optional[str], replace: bool, ask: Ask, say: Say) -> None:
    if target.jump is not None:
        _trust(target.jump, cluster, None, False, ask, say)  # the bastion first: the target is reached through it
    key = probe(target, cluster)
    changed = False
    try:
        if hostkeys.check(target.known_hosts, target.key_name, key, cluster):
            say(f"{target.key_name} is already trusted ({key.get_name()} {key.fingerprint})")
            return
    except hostkeys.ChangedHostKey:
        if not replace:
            raise
        changed = True
        say(f"WARNING: {target.key_name} presents a DIFFERENT key than {target.known_hosts} records; replace it "
            f"only if the cluster's admins confirm the change")
    say(f"{hostkeys.describe(target.key_name, key)}")
    _confirm(target, key, expected, ask)
    if changed:
        hostkeys.remove(target.known_hosts, target.key_name)
    hostkeys.append(target.known_hosts, target.key_name, key)
    say(f"recorded {target.key_name} in {target.known_hosts}")


def trust(ssh: Ssh, cluster: str, fingerprint: Optional[str] = None, replace: bool = False,
          ask: Ask = input, say: Say = print) -> None:
    """Fetch the cluster's login-node key (and its jump hosts'), show it, record it on the user's word."""
    _trust(resolve(ssh), cluster, fingerprint, replace, ask, say)
