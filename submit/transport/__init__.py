"""How meshrun reaches a cluster and ships code there: local and SSH transports, host keys, snapshots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from meshrun.submit.transport.base import LocalTransport, Transport

if TYPE_CHECKING:
    from meshrun.submit.transport.sshconfig import Ssh


def connect(ssh: Optional[Ssh], cluster: str = "CLUSTER") -> Transport:
    """The transport for a cluster profile's `ssh` section (None: this machine); `cluster` names it in errors."""
    if ssh is None:
        return LocalTransport()
    from meshrun.submit.transport.ssh import SshTransport  # paramiko is imported only when a cluster needs it

    return SshTransport(ssh, cluster)
