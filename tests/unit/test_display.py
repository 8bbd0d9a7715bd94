"""Small display findings of issue 15 (item 34): what a person reads lines up and says the truth."""

from __future__ import annotations

from pathlib import Path

from launcher.contract.spec import JobSpec
from submit.config.cluster import load_profile
from submit.planning.plan import run_dir_for
from submit.views.tables import progress_line, status_table
from submit.views.textwidth import display_width
from tests.unit.test_local_and_wait import _status


def test_status_columns_line_up_with_wide_and_emoji_names() -> None:
    lines = status_table([_status(name="训练 🚀 run"), _status(job_id="2", name="plain")]).splitlines()
    starts = [display_width(line[: line.index("RUNNING")]) for line in lines[1:]]
    assert len(set(starts)) == 1, lines


def test_status_table_never_prints_control_characters() -> None:
    table = status_table([_status(name="evil\x1b[2Jname")])
    assert "\x1b" not in table and "\\x1b[2Jname" in table


def test_a_finished_job_shows_no_time_left() -> None:
    done = _status(state="COMPLETED", done=True, succeeded=True)
    assert "left" not in progress_line(done, 60) and "left" in progress_line(_status(), 60)


def test_non_ascii_names_give_readable_run_dirs() -> None:
    run_dir = run_dir_for(JobSpec(name="Über-Modell ✨"), load_profile("local"), home="/h")
    assert Path(run_dir).name.startswith("Uber-Modell-")
