"""The installed meshrun's version, read once: the one definition both sides use. Torch-free, stdlib only."""

from __future__ import annotations

from functools import cache


@cache
def installed_version() -> str:
    """The installed meshrun distribution's version, whose one source is pyproject's `version`.

    Recorded in every script submit renders and in spec.json (run.meshrun_version), and compared on every
    rank with the version that rendered its job: a cluster install lagging the login node explains odd
    failures.
    """
    from importlib import metadata  # lazy: tens of ms that only a render or a rank's start pays

    try:
        return metadata.version("meshrun")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "0+unknown"
