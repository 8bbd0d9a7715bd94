"""meshrun's rank side: runs on every rank; never imports `submit` or paramiko.

Importing this package is cheap and torch-free; the torch code lives in
modules that only the ranks import (train, model, data).
"""

from __future__ import annotations

from functools import cache


@cache
def installed_version() -> str:
    """The installed meshrun distribution's version, whose one source is pyproject's `version`.

    Compared on every rank with the version that rendered the job (spec.json's run.meshrun_version);
    read here, not from submit, because the ranks never import submit.
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
