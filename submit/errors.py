"""The error hierarchy: every message names the key, the value and the fix.

`InputError` is bad input (exit code 2), found before anything touches a
cluster. `ClusterError` is the cluster or the transport refusing (exit code 1).
`InputError` is a `SchemaError` (the torch-free meshrun.launcher.contract.spec.schema's bad-input type,
shared by both sides), so there is one type for bad input. `InternalError` is a
meshrun bug, never reported as bad input.
"""

from __future__ import annotations

from meshrun.launcher.contract.exitcodes import EXIT_INPUT
from meshrun.launcher.contract.spec.schema import SchemaError

EXIT_CLUSTER = 1


class MeshrunError(Exception):
    """Base of every error meshrun reports as one line, never a traceback."""

    exit_code = EXIT_CLUSTER


class InputError(SchemaError, MeshrunError):
    """Bad input: a key, its value and the fix. The one bad-input type: it IS the schema's
    SchemaError (shared with the torch-free launcher), so either side's bad input exits 2."""

    exit_code = EXIT_INPUT


class FlagConflict(InputError):
    """Two flags that do not go together. The other flag is not a value, so it is not quoted as one:
    `--json without --dry-run: --json prints the request of a --dry-run: add --dry-run`."""

    def __init__(self, flag: str, other: str, fix: str) -> None:
        super().__init__(flag, other, fix)
        self.args = (f"{flag} {other}: {fix}",)


class InternalError(MeshrunError):
    """A bug in meshrun itself (never reported as bad input): exit 1, with a request to report it."""

    exit_code = EXIT_CLUSTER

    def __init__(self, what: str) -> None:
        super().__init__(f"internal error: {what}; this is a meshrun bug, please report it")


class ClusterError(MeshrunError):
    """The cluster, the scheduler or the transport failed; says what to check."""

    exit_code = EXIT_CLUSTER


class JobNotFound(InputError):
    """No job by that id in the local registry."""


class HostKeyError(ClusterError):
    """An SSH host key meshrun refuses (unknown, changed or revoked). Reconnecting cannot fix it, and
    the message is for the person even where other errors are summarised (`security`: status prints it)."""

    retry = False
    security = True


class HostKeyUnknown(HostKeyError):
    """The host is not in known_hosts: `meshrun trust CLUSTER` after checking the fingerprint."""


class HostKeyChanged(HostKeyError):
    """known_hosts records another key for the host: the full man-in-the-middle warning."""


class HostKeyRevoked(HostKeyError):
    """The host presents a key that known_hosts marks `@revoked`."""


class ConnectionLost(ClusterError):
    """The connection dropped mid-command; the caller may reconnect and resume."""
