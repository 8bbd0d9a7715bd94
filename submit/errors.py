"""The error hierarchy: every message names the key, the value and the fix.

`InputError` is bad input (exit code 2), found before anything touches a
cluster. `ClusterError` is the cluster or the transport refusing (exit code 1).
The schema's own `SchemaError` (from the torch-free launcher.schema, shared by
both sides) is bad input too; the CLI treats it as an InputError.
"""
from __future__ import annotations

from typing import Any

from launcher.schema import SchemaError

EXIT_INPUT = 2
EXIT_CLUSTER = 1


class MeshrunError(Exception):
    """Base of every error meshrun reports as one line, never a traceback."""
    exit_code = EXIT_CLUSTER


class InputError(MeshrunError):
    """Bad input: a key, its value and the fix."""
    exit_code = EXIT_INPUT

    def __init__(self, key: str, value: Any, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in repr(value))  # even odd __repr__s
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(f"{key}: {shown}: {fix}")

    @classmethod
    def from_schema(cls, exc: SchemaError, where: str = "") -> "InputError":
        key = f"{where}: {exc.key}" if where else exc.key
        return cls(key, exc.value, exc.fix)


class ClusterError(MeshrunError):
    """The cluster, the scheduler or the transport failed; says what to check."""
    exit_code = EXIT_CLUSTER


class JobNotFound(InputError):
    """No job by that id in the local registry."""
