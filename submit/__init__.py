"""meshrun's caller side (laptop or login node): plans, renders and submits jobs.

Never imports torch nor the launcher's torch code.
"""

from __future__ import annotations

from functools import cache


@cache
def installed_version() -> str:
    """The installed meshrun distribution's version, whose one source is pyproject's `version`.

    Recorded in every script it renders and in spec.json, so that a rank can tell a different meshrun.
    """
    from importlib import metadata  # lazy: tens of ms that only a render or a rank's start pays

    try:
        return metadata.version("meshrun")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
