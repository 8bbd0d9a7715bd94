"""Integration-test fixtures (the Slurm testbed's are in tests/conftest.py: the journeys use it too)."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture
def tb_cleanup() -> Iterator[object]:
    """Every TensorBoard server a test starts is stopped by pid when it ends, passed or failed or
    interrupted (Ctrl-C runs finalizers): name its runs with `tb_cleanup.runs([(job, run_dir)])`, or its
    HOME with `tb_cleanup.under.append(home)` (a `meshrun tb` on this machine keeps its state there)."""
    from tests.helpers.tbhelp import Cleanup

    cleanup = Cleanup()
    try:
        yield cleanup
    finally:
        cleanup.stop()
