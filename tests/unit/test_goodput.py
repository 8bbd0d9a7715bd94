"""Goodput accounting (launcher/contract/records/goodput.py) on recorded lines: the parts of every allocation add up
to it, lost work is exactly the steps a later start computed again, and the records stay private."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.launcher.batch import attempt as attempt_cli
from meshrun.launcher.contract.records import goodput
from meshrun.launcher.contract.records.rundir import RunDir

SUBMITTED, START0 = 1000.0, 1010.0


def _steps(job: str, restart: int, first: int, last: int, t0: float, dt: float, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "step": s,
            "loss": 1.0,
            "time": t0 + (s - first + 1) * dt,
            "step_time_s": dt,
            "job": job,
            "restart_count": restart,
            **extra,
        }
        for s in range(first, last + 1)
    ]


def _start(job: str, restart: int, from_step: int, t: float) -> dict[str, Any]:
    return {"event": goodput.TRAIN_START, "from_step": from_step, "restart_count": restart, "time": t, "job": job}


def test_a_killed_attempt_and_its_requeue_add_up_and_the_redone_steps_are_the_lost_ones() -> None:
    # Attempt 0: setup 5 s, steps 1..37 at 1 s each (validation of step 20 took 2 s, the save after step 35
    # stalled 0.5 s), then killed 3 s after step 37. Attempt 1: queued again for 20 s, setup 4 s, resumes from
    # 35 (36 and 37 are computed again: lost), steps 36..60, ends 1 s after.
    a0 = _steps("7", 0, 1, 20, START0 + 5, 1.0)
    a0[-1]["eval_s"] = 2.0
    a0 += _steps("7", 0, 21, 37, START0 + 5 + 20 + 2, 1.0)
    ckpt = {"event": "checkpoint", "checkpoint_step": 35, "save_stall_s": 0.5, "time": a0[-1]["time"], "job": "7"}
    # the save after step 35 delays steps 36 and 37 by its stall
    for row in a0[35:]:
        row["time"] += 0.5
    end0 = a0[-1]["time"] + 3.0
    start1 = end0 + 20.0
    a1 = _steps("7", 1, 36, 60, start1 + 4.0, 1.0)
    end1 = a1[-1]["time"] + 1.0
    metrics = [_start("7", 0, 0, START0 + 5), *a0, ckpt, _start("7", 1, 35, start1 + 4.0), *a1]
    attempts = goodput.attempts_of(
        [
            {"event": "start", "job": "7", "restart": 0, "time": START0, "submitted": SUBMITTED, "nodes": "n[1-2]"},
            {"event": "end", "job": "7", "restart": 0, "time": end0, "status": 143},
            {"event": "start", "job": "7", "restart": 1, "time": start1, "submitted": end0, "nodes": "n[1-2]"},
            {"event": "end", "job": "7", "restart": 1, "time": end1, "status": 0},
            {"event": "start", "job": "8", "restart": 0, "time": 0.0},  # another job's: not this one's
        ],
        "7",
    )
    g = goodput.account(attempts, metrics, now=end1 + 100)
    parts = g["parts_s"]
    assert g["allocated_s"] == pytest.approx((end0 - START0) + (end1 - start1))
    assert sum(parts.values()) == pytest.approx(g["allocated_s"])
    assert parts["setup"] == pytest.approx(5.0 + 4.0)
    assert parts["eval"] == pytest.approx(2.0)
    assert parts["ckpt_stall"] == pytest.approx(0.5)
    assert g["lost_steps"] == 2 and parts["lost"] == pytest.approx(2.0)
    assert parts["productive"] == pytest.approx(60.0)  # every step once, at 1 s
    assert parts["end"] == pytest.approx(3.0 + 1.0)
    assert g["queue_s"] == pytest.approx(START0 - SUBMITTED) and g["requeue_s"] == pytest.approx(20.0)
    assert g["effective_pct"] == pytest.approx(100 * 60.0 / g["allocated_s"], abs=0.01)
    # What the user waited counts the requeue's 20 s too (the trial: 71% said, 68.2% waited).
    assert g["wall_s"] == pytest.approx(end1 - START0)
    assert g["wall_effective_pct"] == pytest.approx(100 * 60.0 / (end1 - START0), abs=0.01)
    from meshrun.submit.views.tables import goodput_line

    line = goodput_line(g)
    assert f"; {g['wall_effective_pct']:.0f}% of the " in line and "since the first start" in line, line
    assert line.index("allocated") < line.index("since the first start") < line.index("requeue "), line
    assert [a["restart"] for a in g["attempts"]] == [0, 1] and not g["running"]
    assert g["attempts"][0]["lost_steps"] == 2 and g["attempts"][1]["lost_steps"] == 0


def test_a_running_attempt_counts_to_now_and_a_job_that_never_stepped_is_all_setup() -> None:
    attempts = goodput.attempts_of([{"event": "start", "job": "9", "restart": 0, "time": 100.0}], "9")
    g = goodput.account(attempts, [], now=130.0)
    assert g["running"] and g["allocated_s"] == 30.0 and g["parts_s"]["setup"] == 30.0 and g["effective_pct"] == 0
    from meshrun.submit.views.tables import goodput_line

    # The built-in trainer that never stepped: all setup, as measured. A command job's program that reports no
    # step (a new user's trial: Lightning's jobs read '0% effective ... setup 1m39s' while training throughout):
    # only the allocation is measured, and the line says how to get the split.
    assert goodput_line(g).startswith("goodput so far: 0% effective (productive 0.0s of 30.0s allocated")
    assert goodput_line(g, trainer=False) == (
        "goodput so far: not measured (30.0s allocated in 1 start(s)): the program reports no steps "
        "(meshrun.launcher.job.report(step) in its loop gives the split: setup, productive, lost)"
    )


def test_an_ended_jobs_goodput_is_not_so_far_and_a_stepless_programs_run_dir_total_is_not_measured() -> None:
    from meshrun.submit.core.state import JobState
    from meshrun.submit.core.status import Status
    from meshrun.submit.views.tables import detail_lines

    attempts = goodput.attempts_of([{"event": "start", "job": "9", "restart": 0, "time": 100.0}], "9")
    unfinished = goodput.account(attempts, [], now=399.0)  # its end never recorded (a killed job's)
    assert unfinished["running"]
    run = {"jobs": 2, "allocated_s": 299.0, "productive_s": 0.0, "lost_steps": 0, "effective_pct": 0.0}
    base: dict[str, Any] = dict(job_id="9", cluster="local", name="n", run_dir="/r", submitted_at=0.0, succeeded=False)
    ended = Status(**base, state=JobState.CANCELLED, done=True, goodput=unfinished, run_goodput=run)
    lines = detail_lines(ended)
    assert lines[0].startswith("goodput: not measured (4m59s allocated in 1 start(s)): the program reports no steps")
    assert lines[1] == "the run dir's 2 jobs: goodput not measured (4m59s allocated): the program reports no steps"
    running = Status(**base, state=JobState.RUNNING, done=False, goodput=unfinished)
    assert detail_lines(running)[0].startswith("goodput so far: not measured (4m59s allocated")
    # a trainer's run dir keeps its figures
    trained = Status(**base, state=JobState.COMPLETED, done=True, steps=10, run_goodput=run)
    assert detail_lines(trained) == ["the run dir's 2 jobs: 0% effective (productive 0.0s of 4m59s allocated)"]


def test_a_resume_under_a_new_job_id_makes_the_parents_unsaved_steps_lost() -> None:
    parent = [_start("a", 0, 0, 10.0), *_steps("a", 0, 1, 12, 10.0, 1.0)]
    child = [_start("b", 0, 10, 50.0), *_steps("b", 0, 11, 20, 50.0, 1.0)]
    attempts = goodput.attempts_of(
        [
            {"event": "start", "job": "a", "restart": 0, "time": 8.0},
            {"event": "end", "job": "a", "restart": 0, "time": 23.0},
        ],
        "a",
    )
    g = goodput.account(attempts, parent + child, now=60.0)
    assert g["lost_steps"] == 2 and g["parts_s"]["lost"] == pytest.approx(2.0)
    assert sum(g["parts_s"].values()) == pytest.approx(g["allocated_s"]) == 15.0


def test_lines_of_an_older_trainer_without_train_start_bound_setup_by_the_first_step() -> None:
    attempts = goodput.attempts_of(
        [
            {"event": "start", "job": "c", "restart": 0, "time": 0.0},
            {"event": "end", "job": "c", "restart": 0, "time": 20.0},
        ],
        "c",
    )
    g = goodput.account(attempts, _steps("c", 0, 1, 10, 5.0, 1.0), now=99.0)
    assert g["parts_s"]["setup"] == pytest.approx(5.0) and g["parts_s"]["productive"] == pytest.approx(10.0)
    assert g["parts_s"]["end"] == pytest.approx(5.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 30),  # setup
            st.integers(0, 25),  # steps computed
            st.floats(0.01, 3),  # step time
            st.floats(0, 10),  # tail to the end
            st.integers(0, 4),  # log every
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 5),
)
def test_any_history_adds_up_and_loses_exactly_the_steps_computed_again(history: list, step_back: int) -> None:
    """Attempts that each resume `step_back` steps before where the one before stopped (its last checkpoint)."""
    lines, metrics, t, done_to, recomputed = [], [], 0.0, 0, 0
    highest = 0
    for restart, (setup, steps, dt, tail, log_every) in enumerate(history):
        lines.append({"event": "start", "job": "j", "restart": restart, "time": t})
        resume = max(0, done_to - step_back) if restart else 0
        recomputed += max(0, highest - resume) if restart else 0
        metrics.append(_start("j", restart, resume, t + setup))
        now, last_logged = t + setup, resume
        for s in range(resume + 1, resume + steps + 1):
            now += dt
            if log_every == 0 or s % log_every == 0 or s == resume + steps:
                metrics.append({"step": s, "time": now, "step_time_s": dt, "job": "j", "restart_count": restart})
                last_logged = s
        done_to = highest = max(last_logged, resume) if steps else resume
        t = now + tail
        lines.append({"event": "end", "job": "j", "restart": restart, "time": t})
        t += 1.0  # requeued
    g = goodput.account(goodput.attempts_of(lines, "j"), metrics, now=t)
    assert all(v >= -1e-9 for v in g["parts_s"].values()), g["parts_s"]
    assert sum(g["parts_s"].values()) == pytest.approx(g["allocated_s"], abs=0.005)  # each rounded to 1 ms
    assert g["lost_steps"] == recomputed


def test_the_batch_scripts_records_are_private_and_account_the_job(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
        assert attempt_cli.main([str(tmp_path), "start", "2026-12-03T09:02:50"], env) == 0
        (tmp_path / RunDir.METRICS).write_text(json.dumps(_start("42", 0, 0, 1e12)) + "\n")
        assert attempt_cli.main([str(tmp_path), "end", "75"], env) == 0
    finally:
        os.umask(old)
    rd = RunDir(str(tmp_path))
    lines = [json.loads(line) for line in Path(rd.attempts).read_text().splitlines()]
    assert [(r["event"], r["job"], r["restart"]) for r in lines] == [("start", "42", 0), ("end", "42", 0)]
    assert lines[0]["nodes"] == "n[1-2]" and lines[1]["status"] == 75
    assert lines[0]["submitted"] == attempt_cli.submitted_time("2026-12-03T09:02:50")
    figures = json.loads(Path(rd.goodput("42")).read_text())
    assert figures["job"] == "42" and not figures["running"] and len(figures["attempts"]) == 1
    for path in (Path(rd.attempts), Path(rd.goodput("42")), Path(rd.goodput("42")).parent):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


def test_outside_a_job_or_with_bad_arguments_it_says_how_and_never_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert attempt_cli.main([str(tmp_path), "start"], {}) == 0
    assert attempt_cli.main([str(tmp_path), "begin"], {"SLURM_JOB_ID": "1"}) == 0
    assert capsys.readouterr().err.count("usage:") == 2
    assert not Path(RunDir(str(tmp_path)).attempts).exists()


def test_an_attempt_whose_end_was_never_recorded_ends_at_the_next_start() -> None:
    """A batch shell Slurm killed after a preemption records no end: the next start bounds it."""
    lines = [
        {"event": "start", "job": "k", "restart": 0, "time": 0.0},
        {"event": "start", "job": "k", "restart": 1, "time": 50.0},
        {"event": "end", "job": "k", "restart": 1, "time": 80.0},
    ]
    g = goodput.account(goodput.attempts_of(lines, "k"), [], now=1000.0)
    assert g["allocated_s"] == 80.0 and not g["running"] and g["attempts"][0]["end"] == 50.0


def test_the_run_dirs_total_sums_every_jobs_whole_record_and_only_when_there_are_several() -> None:
    import json as _json

    from meshrun.submit.core.findings import GOODPUT_DIR, run_total

    def record(job: str, allocated: float, productive: float, lost: int) -> str:
        parts = {"productive": productive, "setup": allocated - productive}
        return _json.dumps({"job": job, "allocated_s": allocated, "parts_s": parts, "lost_steps": lost})

    files = {f"{GOODPUT_DIR}/41.json": record("41", 100.0, 60.0, 5)}
    assert run_total(files) is None  # one job: its own line says it all
    files[f"{GOODPUT_DIR}/57.json"] = record("57", 50.0, 45.0, 0)  # its resume, in the same run dir
    files[f"{GOODPUT_DIR}/58.json"] = '{"job": "58", "allocated_s": '  # torn: left out
    files[f"{GOODPUT_DIR}/59.json"] = record("60", 10.0, 10.0, 0)  # names another job: left out
    assert run_total(files) == {
        "jobs": 2,
        "allocated_s": 150.0,
        "productive_s": 105.0,
        "lost_steps": 5,
        "effective_pct": 70.0,
    }


def test_a_start_too_new_to_measure_says_so_and_restarts_inside_the_allocation_count_in_every_view() -> None:
    from types import SimpleNamespace

    from meshrun.submit.views.tables import goodput_line, restarts_cell

    fresh = goodput.account([goodput.Attempt(job="7", restart=0, start=100.0, submitted=99.0)], [], now=100.4)
    assert fresh["effective_pct"] is None  # 0.4 s allocated: no percentage to give yet
    shown = goodput_line({**fresh, "running": True})
    assert shown == "goodput so far: not measured yet (a running job's record is refreshed each minute)"
    # an ended job is not told it is running (a command that failed in its first second)
    ended = goodput_line({**fresh, "running": False})
    assert ended == "goodput: not measured (the job ended before its first second of work was recorded)"
    assert restarts_cell(SimpleNamespace(restarts=1, restarts_in_job=2)) == "1+2 in job"
    assert restarts_cell(SimpleNamespace(restarts=1, restarts_in_job=2), short=True) == "1+2"
    assert restarts_cell(SimpleNamespace(restarts=3, restarts_in_job=0)) == "3"


@pytest.mark.parametrize(
    "seconds, shown",
    [
        (0.34, "0.3s"),
        (59.94, "59.9s"),
        (59.96, "1m00s"),
        (60.98, "1m01s"),
        (187.0, "3m07s"),
        (3599.4, "59m59s"),
        (3599.6, "1h00m"),
        (7529.0, "2h05m"),
    ],
)
def test_a_part_of_a_jobs_time_is_rounded_not_cut(seconds: float, shown: str) -> None:
    from meshrun.submit.views.tables import span

    assert span(seconds) == shown
