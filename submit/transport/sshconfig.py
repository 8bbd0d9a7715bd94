"""Where an SSH connection goes: the profile's `ssh:` section, completed by ~/.ssh/config.

As with `ssh -o`, what the profile says wins and ~/.ssh/config fills in the rest:
Host aliases, HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyJump and
ProxyCommand. A ProxyJump chain becomes nested Targets, each hop resolved
through the same config. Pure but for reading the config file; imports no paramiko.
"""

from __future__ import annotations

import getpass
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from meshrun.submit.errors import InputError

DEFAULT_PORT = 22
MAX_JUMPS = 8
_JUMP = re.compile(r"^(?:ssh://)?(?:(?P<user>[^@/:]+)@)?(?P<host>\[[^\]]+\]|[^:/@]+)(?::(?P<port>\d+))?/?$")


class Ssh(Protocol):
    """What a transport reads of a cluster profile's `ssh:` section (`meshrun.submit.config.cluster.Ssh` is one, and
    documents each field): handed in by the API, so that transport and config, siblings, never import each other."""

    @property
    def host(self) -> str: ...
    @property
    def user(self) -> Optional[str]: ...
    @property
    def port(self) -> Optional[int]: ...
    @property
    def identity_file(self) -> Optional[str]: ...
    @property
    def proxy_jump(self) -> Optional[str]: ...
    @property
    def known_hosts(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...


@dataclass(frozen=True)
class Target:
    """One resolved SSH destination."""

    alias: str
    """The name as written (profile host, or a ProxyJump hop)."""
    hostname: str
    """What is connected to (HostName, else the alias)."""
    port: int
    user: str
    identity_files: tuple[str, ...]
    """Key files to offer, the profile's first."""
    look_for_keys: bool
    """Also offer ~/.ssh/id_* (off with IdentitiesOnly yes)."""
    known_hosts: str
    """The known_hosts file host keys are checked against (and `meshrun trust` appends to)."""
    timeout_s: float
    jump: Optional[Target] = None
    """The hop to connect through (ProxyJump), itself possibly behind another."""
    proxy_command: Optional[str] = None
    """A ProxyCommand from ~/.ssh/config (used when there is no jump)."""

    @property
    def key_name(self) -> str:
        """The host's name in known_hosts: `host`, or `[host]:port` off port 22."""
        return self.hostname if self.port == DEFAULT_PORT else f"[{self.hostname}]:{self.port}"

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def config_path() -> Path:
    """~/.ssh/config of the user running meshrun ($MESHRUN_SSH_CONFIG overrides it)."""
    return Path(os.environ.get("MESHRUN_SSH_CONFIG") or os.path.expanduser("~/.ssh/config"))


def _lookup(host: str) -> dict[str, Any]:
    path = config_path()
    if not path.is_file():
        return {}
    import paramiko  # its SSHConfig parser is the one that knows Match, %h tokens and wildcards

    try:
        return dict(paramiko.SSHConfig.from_path(str(path)).lookup(host))
    except Exception as exc:  # a malformed config: say where, not a traceback
        raise InputError(str(path), host, f"cannot read the SSH config ({exc}); fix the file") from None


def _expand(path: str) -> str:
    return os.path.expanduser(path)


def resolve(ssh: Ssh) -> Target:
    """The profile's ssh section as a Target (with its ProxyJump chain)."""
    return _resolve(
        ssh.host,
        ssh.user,
        ssh.port,
        ssh.identity_file,
        ssh.proxy_jump,
        _expand(ssh.known_hosts),
        ssh.timeout_s,
        depth=0,
    )


def _resolve(
    host: str,
    user: Optional[str],
    port: Optional[int],
    identity: Optional[str],
    proxy_jump: Optional[str],
    known_hosts: str,
    timeout_s: float,
    depth: int,
) -> Target:
    if depth > MAX_JUMPS:
        raise InputError("ssh.proxy_jump", proxy_jump, f"more than {MAX_JUMPS} hops; is ProxyJump circular?")
    cfg = _lookup(host)
    identities = [_expand(identity)] if identity else []
    identities += [_expand(p) for p in cfg.get("identityfile", []) if _expand(p) not in identities]
    for path in identities[:1] if identity else []:
        if not os.path.isfile(path):
            raise InputError("ssh.identity_file", identity, "no such key file; give the private key's path")
    jump_spec = proxy_jump or cfg.get("proxyjump")
    jump = None
    if jump_spec and jump_spec.lower() != "none":
        jump = _jump_chain(jump_spec, known_hosts, timeout_s, depth)
    command = cfg.get("proxycommand")
    return Target(
        alias=host,
        hostname=cfg.get("hostname", host),
        port=int(port or cfg.get("port", DEFAULT_PORT)),
        user=user or cfg.get("user") or getpass.getuser(),
        identity_files=tuple(identities),
        look_for_keys=cfg.get("identitiesonly", "no").lower() != "yes",
        known_hosts=known_hosts,
        timeout_s=float(cfg.get("connecttimeout", timeout_s)) if "connecttimeout" in cfg else timeout_s,
        jump=jump,
        proxy_command=None if jump or not command or command.lower() == "none" else command,
    )


def _jump_chain(spec: str, known_hosts: str, timeout_s: float, depth: int) -> Target:
    """`a,b,c` (like ssh -J): connect to a, through it to b, through b to c; return c's Target."""
    previous: Optional[Target] = None
    for hop in [h.strip() for h in spec.split(",") if h.strip()]:
        match = _JUMP.fullmatch(hop)
        if not match:
            raise InputError("ssh.proxy_jump", spec, "use [user@]host[:port], comma-separated for several hops")
        target = _resolve(
            match["host"].strip("[]"),
            match["user"],
            int(match["port"]) if match["port"] else None,
            None,
            None if previous is None else "none",
            known_hosts,
            timeout_s,
            depth + 1,
        )
        # Each hop after the first goes through the one before it (not through its own ProxyJump).
        previous = target if previous is None else _through(target, previous)
    assert previous is not None
    return previous


def _through(target: Target, jump: Target) -> Target:
    return Target(
        alias=target.alias,
        hostname=target.hostname,
        port=target.port,
        user=target.user,
        identity_files=target.identity_files,
        look_for_keys=target.look_for_keys,
        known_hosts=target.known_hosts,
        timeout_s=target.timeout_s,
        jump=jump,
    )
