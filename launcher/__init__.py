"""meshrun's rank side: runs on every rank; never imports `submit` or paramiko.

Importing this package is cheap and torch-free; the torch code lives in
modules that only the ranks import (train, model, data).
"""

from __future__ import annotations

from typing import Any

__all__ = ["installed_version"]


def __getattr__(name: str) -> Any:
    # Lazily: every small rank-side process (sidecar, copier, probes, the batch script's helpers) imports this
    # package, and most never ask for the version.
    from meshrun.launcher.contract.version import installed_version

    if name == "installed_version":
        return installed_version
    if name == "__version__":
        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
