"""The schedulers meshrun submits to, one module each, behind one interface (`base.Backend`).

This package is the only place that knows a scheduler by name. The API (submit/api.py) asks
`backend(name)` what it can do (ship code, arrays, dependencies) and lets it act; planning, rendering, status
and resume are handed the backend, or the one thing they need of it, and never look one up.
Backends are imported on first use, so that a verb pays only for the one it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from meshrun.submit.errors import InputError

if TYPE_CHECKING:
    from meshrun.submit.config.cluster import ClusterProfile
    from meshrun.submit.schedulers.base import Backend

_MODULES = {"slurm": "meshrun.submit.schedulers.slurm", "local": "meshrun.submit.schedulers.local"}
NAMES = tuple(_MODULES)
_loaded: dict[str, Backend] = {}


def check_profile(profile: ClusterProfile) -> ClusterProfile:
    """A profile against its scheduler: an `ssh:` section only where the scheduler runs on other machines."""
    if profile.ssh is not None and not backend(profile.scheduler).over_ssh:
        raise InputError("ssh", profile.ssh.host, f"a {profile.scheduler} cluster runs on this machine; remove `ssh`")
    return profile


def backend(name: str) -> Backend:
    """The backend for a profile's (or a job record's) `scheduler`."""
    if name not in _loaded:
        if name not in _MODULES:
            raise KeyError(f"no scheduler backend {name!r}; known: {', '.join(NAMES)}")
        _loaded[name] = importlib.import_module(_MODULES[name]).BACKEND
    return _loaded[name]
