"""The local rank controller's record of how each rank ended, and the words the supervisor makes of it
(the processes themselves: tests/integration/test_local_job_lifecycle.py)."""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.launcher.batch import rankends
from meshrun.launcher.local import controller


def _ends(tmp_path: Path, *rows: dict, torn: bool = False) -> Path:
    path = controller.ends_path(tmp_path, 4242)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    path.write_text(text + ('{"rank": 3, "co' if torn else ""))
    return path


def test_ends_are_read_first_first_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    _ends(tmp_path, {"rank": 0, "code": 1, "time": 5.0}, {"rank": 1, "code": -9, "time": 2.0}, torn=True)
    assert [end["rank"] for end in controller.read_ends(tmp_path, 4242)] == [1, 0]
    assert controller.read_ends(tmp_path, 1) == []


def test_the_first_death_skips_clean_ends_and_a_rank_that_returned_speaks_for_itself() -> None:
    ends = [
        {"rank": 2, "code": 0, "time": 1.0},
        {"rank": 0, "code": 0, "time": 2.0},
        {"rank": 1, "code": -9, "time": 3.0},
    ]
    assert controller.first_death(ends, (0, 75), {2: (0.9, 75), 0: (1.9, 0)}) == {"rank": 1, "code": -9, "time": 3.0}
    # A process that exited 0 after its function returned a failing code: that code, when it was written.
    assert controller.first_death(ends, (0, 75), {2: (0.9, 2)}) == {"rank": 2, "code": 2, "time": 0.9}
    # Rank 1 returned 3, then its peers were stopped and its own process caught the TERM while exiting:
    # its returned code, not the TERM, and it came first.
    late = [{"rank": 0, "code": -15, "time": 5.0}, {"rank": 1, "code": -15, "time": 5.1}]
    assert controller.first_death(late, (0, 75), {1: (4.0, 3)}) == {"rank": 1, "code": 3, "time": 4.0}
    assert controller.first_death(ends[:2], (0, 75), {}) is None


def test_how_a_rank_ended_in_words() -> None:
    assert rankends.how(-9).startswith("was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer")
    assert rankends.how(-15) == "was killed by SIGTERM"
    assert rankends.how(137).startswith("exited with code 137 (its program was killed by SIGKILL")
    assert rankends.how(3) == "exited with code 3"


def test_ranks_are_forked_only_from_a_process_without_a_cuda_context(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys
    import types

    def torch_with(initialized: bool) -> types.ModuleType:
        fake = types.ModuleType("torch")
        fake.cuda = types.SimpleNamespace(is_initialized=lambda: initialized)  # type: ignore[attr-defined]
        return fake

    monkeypatch.setitem(sys.modules, "torch", torch_with(False))
    assert controller._preloaded(["json"])
    monkeypatch.setitem(sys.modules, "torch", torch_with(True))
    assert not controller._preloaded(["json"])  # a CUDA context does not survive a fork: one interpreter per rank


def test_the_reason_leads_with_the_first_death_only_when_a_signal_left_it_no_words(tmp_path: Path) -> None:
    """A flaky run: both ranks met the same bad data path; rank 1 exited (code 2) a moment before rank 0 wrote
    the rank error, and the reason led with 'rank 1 exited with code 2, first' instead of the error itself."""
    import types

    from meshrun.launcher.local import supervisor

    class _Task:
        paths = types.SimpleNamespace(result_pickle=tmp_path / "none.pkl")

    job = types.SimpleNamespace(paths=types.SimpleNamespace(folder=tmp_path), job_id="4242", num_tasks=2)
    job.task = lambda _k: _Task()
    error = "rank 0: data.path: '/x': no token file there"
    _ends(tmp_path, {"rank": 1, "code": 2, "time": 1.0}, {"rank": 0, "code": 2, "time": 1.5})
    assert supervisor.first_death(job, error) == ""  # the error speaks for both
    _ends(tmp_path, {"rank": 1, "code": -9, "time": 1.0}, {"rank": 0, "code": 1, "time": 1.5})
    said = supervisor.first_death(job, "rank 0: Connection closed by peer")
    assert said.startswith("rank 1 was killed by SIGKILL") and said.endswith("then rank 0: Connection closed by peer")
    assert supervisor.first_death(job, "").startswith("rank 1 was killed by SIGKILL")
