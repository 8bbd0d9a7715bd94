"""A repository script that is not in a package (scripts/, examples/), loaded by path as a module for a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """REPO/`relative` as a module named after its file (registered in sys.modules: a dataclass in it looks its
    module up there)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
