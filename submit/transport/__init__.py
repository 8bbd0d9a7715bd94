"""How meshrun reaches a cluster and ships code there: local and SSH transports, host keys, snapshots."""

from __future__ import annotations

from submit.transport.base import LocalTransport, Transport


def connect(ssh: object | None, cluster: str = "CLUSTER") -> Transport:
    """The transport for a cluster profile's `ssh` section (None: this machine); `cluster` names it in errors."""
    if ssh is None:
        return LocalTransport()
    from submit.transport.ssh import SshTransport  # paramiko is imported only when a cluster needs it

    return SshTransport(ssh, cluster)  # type: ignore[arg-type]
