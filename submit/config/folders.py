"""meshrun's own folders on the user's machine, under the XDG base directories: the one place that works
them out (the registry and the notified-alerts record in the state folder, profiles and settings in the
config folder).

tbserve.py (a standalone script on the login node) and the TensorBoard shell line work out the cache
folder themselves: they run where this module is not imported.
"""

from __future__ import annotations

import os
from pathlib import Path


def _base(variable: str, default: str) -> Path:
    return Path(os.environ.get(variable) or os.path.expanduser(default)) / "meshrun"


def state_dir() -> Path:
    """$XDG_STATE_HOME/meshrun (default ~/.local/state/meshrun): what meshrun remembers."""
    return _base("XDG_STATE_HOME", "~/.local/state")


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/meshrun (default ~/.config/meshrun): what the user writes."""
    return _base("XDG_CONFIG_HOME", "~/.config")


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/meshrun (default ~/.cache/meshrun): what meshrun can make again (compiled templates)."""
    return _base("XDG_CACHE_HOME", "~/.cache")
