"""What a person reads lines up, says the truth and carries no raw control characters: status columns with
wide and emoji names, errors and the sweep's input with escape sequences, terminal widths
(submit/textwidth.py), readable ASCII run-dir names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.errors import InputError
from meshrun.submit.planning import sweep
from meshrun.submit.planning.plan import run_dir_for
from meshrun.submit.textwidth import display_width, ljust, printable, slug
from meshrun.submit.views.tables import progress_line, status_table
from tests.unit.test_local_and_wait import _status

REPO = Path(__file__).resolve().parents[2]


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


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    return subprocess.run(
        [sys.executable, "-m", "meshrun.submit.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )


# --- control characters in errors -------------------------------------------------------------------------------


class _OddRepr:
    def __repr__(self) -> str:
        return "odd\x1b[2Jvalue"


def test_input_error_never_shows_raw_control_characters() -> None:
    assert str(InputError("k", _OddRepr(), "fix")) == "k: odd\\x1b[2Jvalue: fix"
    assert str(InputError("k", "a\x1b\u202eb", "fix")) == "k: 'a\\x1b\\u202eb': fix"
    assert printable("x\n\x07\u2028y é") == "x\\n\\x07\\u2028y é"


@pytest.mark.parametrize("item", ["train.lr=1e-3,\x1b[31mred", "env.X=a,b\u202eevil", "env.X\x07=a,b"])
def test_sweep_refuses_control_characters(item: str) -> None:
    with pytest.raises(InputError) as caught:
        sweep.parse([item])
    assert caught.value.key == "--sweep" and str(caught.value).isprintable()


def test_cli_errors_from_sweeps_and_sets_print_no_raw_control_characters(tmp_path: Path) -> None:
    for args in (
        ["--sweep", "train.lr=1e-3,\x1b[31mred"],
        ["--sweep", "env.X=a,b\x1b]0;title\x07"],
        ["--set", "env.X\x1b[31m=a"],
    ):
        out = _cli(["render", "examples/tiny.yaml", "-c", "testbed", *args], tmp_path)
        assert out.returncode == 2, out
        assert out.stderr.count("\n") == 1 and out.stderr.rstrip("\n").isprintable(), repr(out.stderr)
        assert "\\x1b" in out.stderr


# --- wide names and run-dir names -------------------------------------------------------------------------------


def test_display_width_counts_terminal_columns() -> None:
    assert display_width("job") == 3
    assert display_width("模型训练") == 8 and display_width("ｆｕｌｌ") == 8
    assert display_width("✨") == 2 and display_width("🚀 run") == 6 and display_width("❤\ufe0f") == 2
    assert display_width("cafe\u0301") == 4 and display_width("a\u200db") == 2
    names = ["plain", "模型", "rocket 🚀", "e\u0301te\u0301"]
    widths = {display_width(ljust(name, 12) + "|") for name in names}
    assert widths == {13}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("Über-Modell ✨", "Uber-Modell"),
        ("naïve café", "naive_cafe"),
        ("Straße Ærø", "Strasse_AEro"),
        ("ｆｕｌｌ-width", "full-width"),
        ("tiny-gpt", "tiny-gpt"),
        ("my model+v2", "my_model+v2"),
        ("模型", "job"),
        ("✨✨", "job"),
        ("", "job"),
        ("-rf ../..", "rf"),
    ],
)
def test_slug_is_readable_ascii_and_never_empty(name: str, expected: str) -> None:
    assert slug(name) == expected


def test_slug_is_file_name_safe_and_bounded() -> None:
    for name in ["a/b\\c", "x" * 300, "../../etc", "\x1b[31m", "é" * 100, ". ..", "a\nb"]:
        result = slug(name)
        assert result and len(result) <= 64 and result.isascii()
        assert all(c.isalnum() or c in "_+-" for c in result) and not result.startswith("-"), result


def test_an_error_shows_a_long_path_whole_and_a_pasted_blob_shortened() -> None:
    """A 2-worker run found error lines cutting paths at 80 characters ('/tmp/.../miss...'): a user with a
    deep project folder saw no file name."""
    from meshrun.launcher.contract.spec.schema import SchemaError

    path = "/home/someone/projects/" + "deep/" * 30 + "tokens.u16"
    assert f"'{path}'" in str(SchemaError("data.path", path, "no token file there"))
    blob = "x" * 5000
    assert len(str(SchemaError("name", blob, "too long"))) < 400
