"""meshrun's caller side (laptop or login node): plans, renders and submits jobs.

Never imports torch nor the launcher's torch code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["installed_version"]


def __getattr__(name: str) -> Any:
    # Lazily: `status`, `cancel` and `logs` never ask for the version (launcher/__init__.py does the same).
    from meshrun.launcher.contract.version import installed_version

    if name == "installed_version":
        return installed_version
    if name == "__version__":
        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
