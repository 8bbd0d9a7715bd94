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

    def first(ends: list[dict], returned: dict) -> rankends.RankEnd | None:
        return rankends.first_death(controller.rank_ends(ends, returned), (0, 75))

    assert first(ends, {2: (0.9, 75), 0: (1.9, 0)}) == rankends.RankEnd(1, -9, 3.0)
    # A process that exited 0 after its function returned a failing code: that code, when it was written.
    assert first(ends, {2: (0.9, 2)}) == rankends.RankEnd(2, 2, 0.9)
    # Rank 1 returned 3, then its peers were stopped and its own process caught the TERM while exiting:
    # its returned code, not the TERM, and it came first.
    late = [{"rank": 0, "code": -15, "time": 5.0}, {"rank": 1, "code": -15, "time": 5.1}]
    assert first(late, {1: (4.0, 3)}) == rankends.RankEnd(1, 3, 4.0)
    assert first(ends[:2], {}) is None


def test_srun_s_lines_give_the_same_kind_of_end_with_its_node_in_order() -> None:
    """One first_death for both sources: srun's task lines (this attempt's part of the batch log, no times: in
    the order srun wrote them) and the local controller's record."""
    log = (
        "[meshrun] job 7 restart 0 on n[1-2]\n"
        "srun: error: n1: task 3: Killed\n"  # an earlier attempt's line is not read: see below
        "[meshrun] job 7 restart 1 on n[1-2]\n"
        "srun: error: n2: task 1: Exited with exit code 3\n"
        "srun: error: n1: task 0: Killed\n"
        "srun: error: n1: task 2: Something srun does not name\n"
    )
    ends = rankends.srun_ends(log, "[meshrun] job 7 restart 1 ")
    assert ends == [rankends.RankEnd(1, 3, node="n2"), rankends.RankEnd(0, -9, node="n1")]
    first = rankends.first_death(ends)
    assert first == rankends.RankEnd(1, 3, node="n2") and first.words() == "rank 1 (on n2) exited with code 3"
    assert rankends.srun_ends(log, "[meshrun] job 8 ") == [] and rankends.first_death([]) is None


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
    assert supervisor.first_death_words(job, error) == ""  # the error speaks for both
    _ends(tmp_path, {"rank": 1, "code": -9, "time": 1.0}, {"rank": 0, "code": 1, "time": 1.5})
    said = supervisor.first_death_words(job, "rank 0: Connection closed by peer")
    assert said.startswith("rank 1 was killed by SIGKILL") and said.endswith("then rank 0: Connection closed by peer")
    assert supervisor.first_death_words(job, "").startswith("rank 1 was killed by SIGKILL")
