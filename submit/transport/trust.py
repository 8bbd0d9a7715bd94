"""`meshrun trust CLUSTER`: show a host's key fingerprint and record it, on the user's word only.

The key is fetched without logging in (the key exchange alone) and recorded in the
profile's known_hosts only when the user types `yes` or passes the fingerprint
they got from the cluster's admins (`--fingerprint SHA256:...`, once per hop: each is
matched against whichever hop presents it). A key that differs from the recorded one
is refused with the man-in-the-middle warning unless `--replace` is given, and even
then it needs the same confirmation. Jump hosts (ProxyJump) are handled first, the
same way (`--replace` too: a bastion's key can change). A key known_hosts marks
`@revoked` is never recorded.
"""

from __future__ import annotations

import socket
from typing import Callable, Optional, Sequence, Union

import paramiko

from meshrun.submit.errors import ClusterError
from meshrun.submit.transport import hostkeys
from meshrun.submit.transport.ssh import _connect_error, hop_channel, open_chain
from meshrun.submit.transport.sshconfig import Ssh, Target, resolve

Ask = Callable[[str], str]
Say = Callable[[str], None]
Fingerprints = Union[None, str, Sequence[str]]


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


def _confirm(target: Target, key: paramiko.PKey, expected: tuple[str, ...], ask: Ask) -> None:
    if expected:
        if key.fingerprint not in expected:
            given = ", ".join(expected)
            raise ClusterError(
                f"{target.key_name} presents {key.fingerprint}, not the fingerprint you gave ({given}); "
                f"nothing recorded (a man-in-the-middle, or the wrong host? for a jump host, "
                f"give its fingerprint too: --fingerprint may be repeated, one per hop)"
            )
        return
    try:
        answer = ask(
            f"Is this the key your cluster's admins publish for {target.key_name}? "
            f"Type yes to record it in {target.known_hosts}: "
        )
    except EOFError:
        answer = ""
    if answer.strip().lower() != "yes":
        raise ClusterError(
            f"{target.key_name} not trusted: nothing recorded (answer `yes`, or pass "
            f"--fingerprint SHA256:... as your admins publish it, once per hop)"
        )


def _hops(target: Target) -> list[Target]:
    """The jump hosts outermost first, then the target: each is reached through the ones before it."""
    return ([] if target.jump is None else _hops(target.jump)) + [target]


def _verdict(hop: Target, cluster: str, replace: bool, say: Say) -> Optional[paramiko.PKey]:
    """The key to record for a hop (None when it is already trusted); raises when it must be refused."""
    key = probe(hop, cluster)
    try:
        if hostkeys.check(hop.known_hosts, hop.key_name, key, cluster):
            say(f"{hop.key_name} is already trusted ({key.get_name()} {key.fingerprint})")
            return None
    except hostkeys.ChangedHostKey:
        if not replace:
            raise
        say(
            f"WARNING: {hop.key_name} presents a DIFFERENT key than {hop.known_hosts} records; replace it "
            f"only if the cluster's admins confirm the change"
        )
    say(hostkeys.describe(hop.key_name, key))
    return key


def _record(hop: Target, key: paramiko.PKey, say: Say) -> None:
    hostkeys.remove(hop.known_hosts, hop.key_name)  # a replaced key's old lines (none for a new host)
    hostkeys.append(hop.known_hosts, hop.key_name, key)
    say(f"recorded {hop.key_name} in {hop.known_hosts}")


def _expected(fingerprints: Fingerprints) -> tuple[str, ...]:
    given = [fingerprints] if isinstance(fingerprints, str) else list(fingerprints or ())
    return tuple(_normal(f) for f in given if f.strip())


def trust(
    ssh: Ssh, cluster: str, fingerprint: Fingerprints = None, replace: bool = False, ask: Ask = input, say: Say = print
) -> None:
    """Fetch the key of the cluster's login node and of each jump host before it, show each, and record
    each on the user's word: `yes` typed, or one of `fingerprint` (a string or several, one per hop,
    matched against whichever hop presents it). Hop by hop, outermost first: the next one is reached
    through the hops already trusted. Nothing is recorded for a hop that is refused."""
    expected = _expected(fingerprint)
    for hop in _hops(resolve(ssh)):
        key = _verdict(hop, cluster, replace, say)
        if key is not None:
            _confirm(hop, key, expected, ask)
            _record(hop, key, say)
