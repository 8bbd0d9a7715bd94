"""The schedulers meshrun submits to, one module each, behind one interface (`base.Backend`).

This package is the only place that knows a scheduler by name: everything else asks
`backend(name)` what it can do (ship code, arrays, dependencies) and lets it act.
Backends are imported on first use, so that a verb pays only for the one it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from submit.schedulers.base import Backend

_MODULES = {"slurm": "submit.schedulers.slurm", "local": "submit.schedulers.local"}
NAMES = tuple(_MODULES)
_loaded: dict[str, Backend] = {}


def backend(name: str) -> Backend:
    """The backend for a profile's (or a job record's) `scheduler`."""
    if name not in _loaded:
        if name not in _MODULES:
            raise KeyError(f"no scheduler backend {name!r}; known: {', '.join(NAMES)}")
        _loaded[name] = importlib.import_module(_MODULES[name]).BACKEND
    return _loaded[name]
