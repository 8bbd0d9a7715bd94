"""The crash-loop guard: repeated failures from one checkpoint fall back, then give up."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.launcher.checkpoint import resume
from meshrun.launcher.contract.records import ckptdir


def _complete(root: Path, *steps: int) -> None:
    for step in steps:
        path = ckptdir.step_dir(root, step)
        path.mkdir(parents=True)
        (path / ckptdir.MARKER).write_text("{}")


def test_fresh_job_starts_from_scratch_then_gives_up_after_repeated_crashes(tmp_path: Path) -> None:
    assert resume.choose(tmp_path).step is None
    assert resume.choose(tmp_path).step is None
    third = resume.choose(tmp_path)
    assert third.gave_up and "crash loop" in third.note


def test_newest_checkpoint_then_fallback_then_give_up(tmp_path: Path) -> None:
    _complete(tmp_path, 10, 20)
    assert [resume.choose(tmp_path).step for _ in range(2)] == [20, 20]
    fallback = resume.choose(tmp_path)
    assert fallback.step == 10 and "step 20 quarantined" in fallback.note
    assert ckptdir.complete_steps(tmp_path) == [10]  # never loaded again
    assert (ckptdir.step_dir(tmp_path, 20) / resume.QUARANTINE_MARKER).is_file()
    assert resume.choose(tmp_path).step == 10
    final = resume.choose(tmp_path)
    assert final.gave_up and final.step is None and ckptdir.complete_steps(tmp_path) == []


def test_progress_clears_the_count(tmp_path: Path) -> None:
    _complete(tmp_path, 10)
    resume.choose(tmp_path)
    resume.choose(tmp_path)
    resume.progress_made(tmp_path)
    assert resume.choose(tmp_path).step == 10 and resume.read_attempts(tmp_path) == {"10": 1}


def test_requested_step_must_be_complete(tmp_path: Path) -> None:
    _complete(tmp_path, 10, 20)
    (tmp_path / "step-00000030.tmp").mkdir()
    assert resume.choose(tmp_path, requested=10).step == 10
    with pytest.raises(ckptdir.CheckpointError, match="incomplete"):
        resume.choose(tmp_path, requested=30)
