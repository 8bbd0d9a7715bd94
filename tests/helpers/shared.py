"""A fixture's result computed once per test session, whatever the number of pytest-xdist workers.

A module-scoped fixture runs once per worker that gets one of its tests: spread over three workers, the numerics
tests' one-process reference runs were trained three times. Here the first worker to ask computes the result in a
folder of the session (shared by its workers) under a lock, and the others wait for it and read it. The result must
be JSON (its dict keys come back as strings). A compute that fails leaves no result: the next asker tries again.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest


def session_root(factory: pytest.TempPathFactory) -> Path:
    """The session's temporary folder: under pytest-xdist the parent of every worker's own."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def computed_once(factory: pytest.TempPathFactory, name: str, compute: Callable[[Path], Any]) -> Any:
    """compute(a folder of its own), once in the session; every caller gets the same (JSON) result."""
    root = session_root(factory)
    result = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when compute raises
        if not result.exists():
            folder = root / f"{name}.d"
            folder.mkdir(exist_ok=True)
            tmp = root / f"{name}.json.tmp"
            tmp.write_text(json.dumps(compute(folder)))
            tmp.rename(result)
    return json.loads(result.read_text())
