"""meshrun's own folders on the user's machine, under the XDG base directories: the one place that works
them out (the registry and the notified-alerts record in the state folder, profiles and settings in the
config folder).

tbserve.py (a standalone script on the login node) and the TensorBoard shell line work out the cache
folder themselves: they run where this module is not imported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from meshrun.launcher.contract.private import make_private_dir


def _base(variable: str, default: str) -> Path:
    return Path(os.environ.get(variable) or os.path.expanduser(default)) / "meshrun"


def state_dir() -> Path:
    """$XDG_STATE_HOME/meshrun (default ~/.local/state/meshrun): what meshrun remembers."""
    return _base("XDG_STATE_HOME", "~/.local/state")


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/meshrun (default ~/.config/meshrun): what the user writes."""
    return _base("XDG_CONFIG_HOME", "~/.config")


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/meshrun (default ~/.cache/meshrun): what meshrun can make again (compiled templates,
    the checkout's file hashes)."""
    return _base("XDG_CACHE_HOME", "~/.cache")


def own_cache(name: str) -> Optional[Path]:
    """cache_dir()/name, made private, when it is this user's and no one else can write it; else None and the
    caller does without (what is cached there is trusted as Python's own __pycache__ is: compiled code to run,
    hashes that decide what ships)."""
    folder = cache_dir() / name
    try:
        make_private_dir(folder)
        found = os.stat(folder)
    except OSError:
        return None
    if found.st_uid != os.getuid() or found.st_mode & 0o022:
        return None
    return folder
