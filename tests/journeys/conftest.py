"""The journeys' HOME: a folder every user of this machine may enter (0755), as a real home often is, so
that what keeps a job's files from another user is meshrun's own doing (the folders it makes private),
not the test's private tmp_path. Removed when the journey ends."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture
def home() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="meshrun-journey-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
