"""The Lightning recipe (examples/lightning_train.py, docs/guides/bring-your-own.md) starts from the newest of
Lightning's own checkpoints, not from whichever Lightning prefers."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_script("examples/lightning_train.py")


def test_a_preemption_after_a_time_limit_save_resumes_from_the_preemption(example: ModuleType, tmp_path: Path) -> None:
    """A new user's trial: the time limit's hpc_ckpt_1.ckpt (epoch 610), then a preemption's newer
    on_exception.ckpt (epoch 700); Lightning left to itself (ckpt_path=None) loaded the hpc one and trained
    200 steps again."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    run_dir.mkdir()
    checkpoints.mkdir()
    assert example.newest_checkpoint(str(run_dir), str(checkpoints)) is None  # a first start
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    hpc.write_bytes(b"610")
    os.utime(hpc, (1000, 1000))
    assert example.newest_checkpoint(str(run_dir), str(checkpoints)) == str(hpc)
    preempted = checkpoints / "on_exception.ckpt"
    preempted.write_bytes(b"700")
    os.utime(preempted, (2000, 2000))
    assert example.newest_checkpoint(str(run_dir), str(checkpoints)) == str(preempted)
    later_hpc = run_dir / "hpc_ckpt_2.ckpt"
    later_hpc.write_bytes(b"800")
    os.utime(later_hpc, (3000, 3000))
    assert example.newest_checkpoint(str(run_dir), str(checkpoints)) == str(later_hpc)
