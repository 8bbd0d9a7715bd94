"""Issue 15, small CLI findings: `tb --port`, `logs --rank` past the job, control characters and wide
or non-ASCII names (items 19, 22 and parts of 34)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from launcher.contract.rundir import RunDir
from submit.errors import ClusterError, InputError
from submit.jobs.registry import JobRecord
from submit.planning import sweep
from submit.transport.base import LocalTransport
from submit.transport.portforward import PortForward
from submit.views import logs
from submit.views.tensorboard import check_local_port
from submit.views.textwidth import display_width, ljust, printable, slug

REPO = Path(__file__).resolve().parents[2]


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    return subprocess.run(
        [sys.executable, "-m", "submit.cli.main", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        yield other.getsockname()[1]


# --- item 19: tb --port ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_port_out_of_range_is_bad_input(port: int) -> None:
    with pytest.raises(InputError) as caught:
        check_local_port(port)
    assert caught.value.key == "--port" and caught.value.value == port
    assert "1024-65535, or 0" in str(caught.value)


def test_port_in_use_is_bad_input(busy_port: int) -> None:
    with pytest.raises(InputError) as caught:
        check_local_port(busy_port)
    assert caught.value.key == "--port" and "in use" in str(caught.value).lower()


def test_free_port_and_zero_pass() -> None:
    check_local_port(0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    check_local_port(free)


@pytest.mark.parametrize("bad", ["busy", 70000, -5])
def test_forward_that_cannot_bind_fails_in_one_line(bad: object, busy_port: int) -> None:
    port = busy_port if bad == "busy" else bad
    with pytest.raises(ClusterError) as caught:
        PortForward(lambda peer: None, port)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "--port" in message


# --- item 22: logs --rank past the job's ranks ------------------------------------------------------------------


def test_rank_past_the_world_size_names_the_size() -> None:
    with pytest.raises(InputError) as caught:
        logs.parse_ranks("99", 2)
    assert (caught.value.key, caught.value.value, caught.value.fix) == ("--rank", 99, "the job has 2 ranks (0-1)")
    with pytest.raises(InputError, match="the job has 4 ranks"):
        logs.parse_ranks("0,4", 4)


def _record(run_dir: Path) -> JobRecord:
    return JobRecord(
        job_id="1",
        cluster="local",
        name="j",
        run_dir=str(run_dir),
        scheduler="local",
        submitted_at=time.time(),
        git_sha=None,
        spec_hash="x",
    )


def test_select_ranks_reads_the_world_size_even_for_one_rank(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))
    Path(run.spec).write_text(json.dumps({"job": {"resources": {"nodes": 1, "tasks_per_node": 2}}}))
    record = _record(tmp_path)
    assert logs.select_ranks(LocalTransport(), record, "1") == [1]
    with pytest.raises(InputError, match=r"the job has 2 ranks \(0-1\)"):
        logs.select_ranks(LocalTransport(), record, "99")


def test_select_ranks_without_a_spec_yet_accepts_any_rank(tmp_path: Path) -> None:
    assert logs.select_ranks(LocalTransport(), _record(tmp_path), "7") == [7]


# --- item 34: control characters in errors ----------------------------------------------------------------------


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


# --- item 34: wide names and run-dir names ----------------------------------------------------------------------


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
