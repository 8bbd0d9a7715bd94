"""The installed meshrun's version, read once: the one definition both sides use. Torch-free, stdlib only."""

from __future__ import annotations

import glob
import os
import sys
from functools import cache
from typing import Optional


@cache
def installed_version() -> str:
    """The installed meshrun distribution's version, whose one source is pyproject's `version`.

    Recorded in every script submit renders and in spec.json (run.meshrun_version), and compared on every
    rank with the version that rendered its job: a cluster install lagging the login node explains odd
    failures.
    """
    found = _dist_info_version()
    if found is not None:
        return found
    from importlib import metadata  # its email parsers cost a render ~10 ms: only where the fast path fails

    try:
        return metadata.version("meshrun")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "0+unknown"


def _dist_info_version() -> Optional[str]:
    """The `Version:` line of the first meshrun-*.dist-info/METADATA on sys.path (where importlib.metadata
    looks first too), read directly; None when there is none or it has no such line."""
    for entry in sys.path:
        for meta in sorted(glob.glob(os.path.join(entry or ".", "meshrun-*.dist-info", "METADATA"))):
            try:
                with open(meta, encoding="utf-8") as handle:
                    for line in handle:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip() or None
                        if not line.strip():
                            break  # the headers end at the first blank line
            except OSError:
                continue
    return None
