"""The SSH transport: paramiko behind transport.Transport.

One connection per meshrun command, reused for every step (each step is one exec
channel on it); keepalives; host keys checked against the profile's known_hosts
with a RejectPolicy (hostkeys.py); ProxyJump hops nested as direct-tcpip
channels. Every failure the user meets is one ClusterError line.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import paramiko

from meshrun.submit.errors import ClusterError, ConnectionLost
from meshrun.submit.transport import hostkeys
from meshrun.submit.transport.base import (
    PUT_FAILED,
    PUT_SCRIPT,
    Forward,
    Progress,
    Result,
    Stream,
    Upload,
    tar_bytes,
)
from meshrun.submit.transport.portforward import PortForward
from meshrun.submit.transport.sshconfig import Ssh, Target, resolve

KEEPALIVE_S = 15
_CHUNK = 32768
# paramiko logs transport failures itself ("Exception (client): ..."); meshrun reports each as one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass
class Counters:
    """What this process sent over SSH: read by bench/ssh_submit.py and the tests (never timings)."""

    connections: int = 0
    round_trips: int = 0
    """Remote commands: each is one channel (open + exec + its output)."""
    bytes_sent: int = 0
    """Command input (uploads) sent, in bytes."""

    def snapshot(self) -> Counters:
        return Counters(self.connections, self.round_trips, self.bytes_sent)


STATS = Counters()


def _connect_error(exc: BaseException, target: Target) -> ClusterError:
    """The one line a user reads for each way a connection can fail."""
    where = f"{target.hostname}:{target.port}"
    if isinstance(exc, paramiko.PasswordRequiredException):
        return ClusterError(
            f"ssh to {where}: the private key is encrypted; load it into your agent (`ssh-add KEYFILE`) and retry"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        agent = ["ssh-agent"] if os.environ.get("SSH_AUTH_SOCK") else []
        tried = ", ".join([*agent, *target.identity_files] + (["~/.ssh/id_*"] if target.look_for_keys else []))
        return ClusterError(
            f"ssh to {where}: authentication as {target.user!r} failed (tried {tried}); check "
            f"ssh.user and ssh.identity_file, or `ssh-add` the right key"
        )
    if isinstance(exc, socket.gaierror):
        return ClusterError(
            f"ssh: cannot resolve host name {target.hostname!r}; check ssh.host (or HostName in "
            f"~/.ssh/config) and your network/VPN"
        )
    if isinstance(exc, (socket.timeout, TimeoutError)) or any(
        word in str(exc).lower() for word in ("timeout", "timed out", "banner", "no existing session")
    ):
        return ClusterError(
            f"ssh to {where}: no answer within {target.timeout_s:g} s; is the host up and "
            f"reachable (VPN)? raise ssh.timeout_s for a slow link"
        )
    if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
        return ClusterError(f"ssh: cannot reach {where}: connection refused; check ssh.host and ssh.port")
    if isinstance(exc, OSError):
        return ClusterError(
            f"ssh: cannot reach {where}: {exc.strerror or exc}; check ssh.host, ssh.port and your network"
        )
    text = " ".join(str(exc).split()) or type(exc).__name__
    return ClusterError(f"ssh to {where} failed: {text}")


def _quick_banner_failure(exc: BaseException, target: Target, elapsed_s: float) -> bool:
    """No SSH banner, well before the timeout: a peer answered (and closed, or spoke another protocol)."""
    return "banner" in str(exc).lower() and elapsed_s < 0.8 * target.timeout_s and not target.proxy_command


def _what_answers(target: Target) -> str:
    """What the port says first, as one short printable phrase (a second, plain TCP connection)."""
    try:
        with socket.create_connection((target.hostname, target.port), timeout=2) as peer:
            first = peer.recv(80)
    except OSError:
        first = b""
    text = " ".join(first.decode("ascii", errors="replace").split())
    shown = "".join(c if c.isprintable() else "?" for c in text)
    return f"it said {shown[:60]!r}" if shown else "it closed the connection without a word"


def open_client(target: Target, cluster: str, sock: Optional[object] = None) -> paramiko.SSHClient:
    """An authenticated client for target, its host key checked; `sock` is the channel of a previous hop."""
    client = paramiko.SSHClient()
    # Read by hostkeys, not paramiko (which crashes on @cert-authority/@revoked lines): only this host's keys.
    for key_type, key in hostkeys.known(target.known_hosts, target.key_name).items():
        client.get_host_keys().add(target.key_name, key_type, key)
    client.set_missing_host_key_policy(hostkeys.RefuseUnknown(target.known_hosts, cluster))
    if sock is None and target.proxy_command:
        sock = paramiko.ProxyCommand(target.proxy_command)
    started = time.monotonic()
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.identity_files) or None,
            timeout=target.timeout_s,
            banner_timeout=target.timeout_s,
            auth_timeout=target.timeout_s,
            channel_timeout=target.timeout_s,
            allow_agent=True,
            look_for_keys=target.look_for_keys,
            sock=sock,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        if hostkeys.revoked(target.known_hosts, target.key_name, exc.key):
            raise hostkeys.RevokedHostKey(target.key_name, exc.key, target.known_hosts) from None
        raise hostkeys.ChangedHostKey(target.key_name, exc.key, exc.expected_key, target.known_hosts, cluster) from None
    except ClusterError:  # the host key refusals (unknown, revoked), already one line each
        client.close()
        raise
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        if _quick_banner_failure(exc, target, time.monotonic() - started) and sock is None:
            raise ClusterError(
                f"ssh to {target.hostname}:{target.port}: something answered, but not an SSH server "
                f"({_what_answers(target)}); check ssh.port and ssh.host"
            ) from None
        raise _connect_error(exc, target) from None
    transport = client.get_transport()
    assert transport is not None
    transport.set_keepalive(KEEPALIVE_S)
    STATS.connections += 1
    return client


def hop_channel(client: paramiko.SSHClient, target: Target) -> paramiko.Channel:
    """A direct-tcpip channel from an open hop to the next one (ProxyJump)."""
    transport = client.get_transport()
    assert transport is not None
    try:
        return transport.open_channel(
            "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=target.timeout_s
        )
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise ClusterError(
            f"ssh: the jump host cannot reach {target.hostname}:{target.port} "
            f"({' '.join(str(exc).split()) or type(exc).__name__}); check ssh.host/port "
            f"and ProxyJump"
        ) from None


def open_chain(target: Target, cluster: str) -> list[paramiko.SSHClient]:
    """Clients for every hop, outermost first; the last one is the target's."""
    if target.jump is None:
        return [open_client(target, cluster)]
    chain = open_chain(target.jump, cluster)
    try:
        chain.append(open_client(target, cluster, sock=hop_channel(chain[-1], target)))
    except ClusterError:
        for client in reversed(chain):
            client.close()
        raise
    return chain


class _ChannelStream:
    """A remote command's stdout, chunk by chunk; ConnectionLost if the connection drops under it."""

    def __init__(self, channel: paramiko.Channel, where: str) -> None:
        self._channel, self._where, self._closing = channel, where, False

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                chunk = self._channel.recv(_CHUNK)
            except (OSError, EOFError, paramiko.SSHException):
                chunk = b""
            if chunk:
                yield chunk
                continue
            if self._closing or self._channel.exit_status_ready():
                return
            transport = self._channel.get_transport()
            if transport is None or not transport.is_active() or self._channel.closed:
                raise ConnectionLost(f"ssh: the connection to {self._where} was lost")
            return

    def close(self) -> None:
        self._closing = True
        self._channel.close()


class SshTransport:
    """A cluster's login node over SSH: one connection for the whole command."""

    def __init__(self, ssh: Ssh, cluster: str = "CLUSTER") -> None:
        self.target = resolve(ssh)
        self.cluster = cluster
        self._chain = open_chain(self.target, cluster)
        self._home: Optional[str] = None

    @property
    def _transport(self) -> paramiko.Transport:
        transport = self._chain[-1].get_transport()
        if transport is None or not transport.is_active():
            raise ConnectionLost(f"ssh: the connection to {self.target.where} was lost")
        return transport

    def is_active(self) -> bool:
        transport = self._chain[-1].get_transport()
        return transport is not None and transport.is_active()

    def _session(self, command: str, timeout: float) -> paramiko.Channel:
        try:
            channel = self._transport.open_session(timeout=self.target.timeout_s)
            channel.settimeout(timeout)
            # Every command on the login node runs under the private umask, whatever the account's own: what it
            # creates is the user's alone, and sbatch hands it to the job (Slurm's output file, the ranks).
            channel.exec_command(f"umask 077; {command}")
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if not self.is_active():
                raise ConnectionLost(f"ssh: the connection to {self.target.where} was lost") from None
            raise ClusterError(f"ssh: {self.target.where} refused a command ({exc})") from None
        STATS.round_trips += 1
        return channel

    def _exec(
        self, argv: Sequence[str], timeout: float, stdin: Optional[bytes], progress: Optional[Progress]
    ) -> tuple[int, bytes, bytes]:
        channel = self._session(shlex.join(argv), timeout)
        err: list[bytes] = []
        readers = [threading.Thread(target=_drain, args=(channel.recv_stderr, err), daemon=True)]
        if stdin is not None:
            readers.append(threading.Thread(target=_send, args=(channel, stdin, progress), daemon=True))
        else:
            channel.shutdown_write()  # EOF on its stdin: a command that reads it must not wait forever
        for thread in readers:
            thread.start()
        out: list[bytes] = []
        try:
            _drain(channel.recv, out, reraise=True)
        except TimeoutError:
            channel.close()
            raise ClusterError(
                f"ssh: `{shlex.join(argv)[:80]}` on {self.target.hostname} gave no answer within {timeout:.0f} s"
            ) from None
        for thread in readers:
            thread.join(timeout)
        code = channel.recv_exit_status()
        channel.close()
        if code == -1 and not self.is_active():
            raise ConnectionLost(f"ssh: the connection to {self.target.where} was lost")
        return code, b"".join(out), b"".join(err)

    # -------------------------------------------------------------- the Transport interface

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60.0,
        cwd: Optional[str] = None,
        stdin: Optional[bytes] = None,
        progress: Optional[Progress] = None,
    ) -> Result:
        full = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", cwd, *argv] if cwd else list(argv)
        code, out, err = self._exec(full, timeout, stdin, progress)
        return Result(tuple(argv), code, out.decode(errors="replace"), err.decode(errors="replace"))

    def put(
        self,
        files: Mapping[str, Upload],
        dest: str,
        then: Sequence[str] = (),
        progress: Optional[Progress] = None,
        timeout: float = 600.0,
    ) -> Optional[Result]:
        done = self.run(
            ["sh", "-c", PUT_SCRIPT, "sh", dest, *then], timeout=timeout, stdin=tar_bytes(files), progress=progress
        )
        if done.returncode == PUT_FAILED:
            done.check(f"writing {dest} on {self.target.hostname}")
        return done if then else done.check(f"writing {dest} on {self.target.hostname}")

    def stream(self, argv: Sequence[str]) -> Stream:
        # stderr goes nowhere on the cluster: unread, it would fill the channel's window.
        channel = self._session(shlex.join(["sh", "-c", 'exec "$@" 2>/dev/null', "sh", *argv]), timeout=3600)
        channel.settimeout(None)
        channel.shutdown_write()
        return _ChannelStream(channel, self.target.where)

    def forward(self, remote_port: int, local_port: int = 0) -> Forward:
        def open_channel(peer: tuple[str, int]) -> paramiko.Channel:
            return self._transport.open_channel("direct-tcpip", ("127.0.0.1", remote_port), peer)

        return PortForward(open_channel, local_port)

    def write_text(self, path: str, text: str, mode: int = 0o600) -> None:
        script = 'umask 077 && cat > "$1.tmp" && chmod "$2" "$1.tmp" && mv -f "$1.tmp" "$1"'
        self.run(["sh", "-c", script, "sh", path, f"{mode:o}"], stdin=text.encode()).check(f"writing {path}")

    def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        script = 'tail -c "+$2" -- "$1" 2>/dev/null | head -c "$3"'
        return self._exec(["sh", "-c", script, "sh", path, str(offset + 1), str(limit)], 60.0, None, None)[1]

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        self.run(["mkdir", "-p", "-m", f"{mode:o}", "--", path]).check(f"mkdir {path}")

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", path]).returncode == 0

    def size(self, path: str) -> int:
        done = self.run(["stat", "-c", "%s", "--", path])
        return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else 0

    def home(self) -> str:
        if self._home is None:
            # The last line only: a chatty shell start-up file may print before the command runs.
            done = self.run(["sh", "-c", 'printf "\\n%s" "$HOME"']).check("reading $HOME")
            self._home = done.stdout.splitlines()[-1].strip() if done.stdout.strip() else "/"
        return self._home

    def close(self) -> None:
        for client in reversed(self._chain):
            client.close()


def _drain(recv: object, into: list[bytes], reraise: bool = False) -> None:
    while True:
        try:
            chunk = recv(_CHUNK)  # type: ignore[operator]
        except TimeoutError:
            if reraise:
                raise
            return
        except (OSError, EOFError, paramiko.SSHException):
            return
        if not chunk:
            return
        into.append(chunk)


def _send(channel: paramiko.Channel, data: bytes, progress: Optional[Progress]) -> None:
    sent = 0
    try:
        while sent < len(data):
            n = channel.send(data[sent : sent + _CHUNK])
            if n <= 0:
                break
            sent += n
            STATS.bytes_sent += n
            if progress is not None:
                progress(sent, len(data))
        channel.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the read side reports the failure
