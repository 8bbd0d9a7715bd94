"""What a rank writes and what it refuses, in one process: private checkpoints, every commit reported,
validation cadence, data and vocabulary checks, a readable error for a bad spec.json, rank-error.txt and
the exit code a failure gets. The items are a new user's; the real ranks' side is
tests/integration/test_rank_outputs_and_bad_input.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrun.launcher.checkpoint import commit as ckpt
from meshrun.launcher.checkpoint import resume
from meshrun.launcher.checkpoint.manager import marker_job
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import (
    JobSpec,
    Model,
    RunInfo,
    RunSpec,
    SpecFileError,
    Train,
    dumps_run_spec,
    read_run_spec,
)
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.data.dataset import (
    Layout,
    TokenDataset,
    TrainStream,
    check_token_ids,
    check_train_data,
    largest_token,
)
from meshrun.launcher.rank import failure as rankfail
from meshrun.launcher.train.loop import eval_due


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The umask a shared login node often has: what privacy must not rely on."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return dict(nn.Linear(4, 4).state_dict())


# ------------------------------------------------------------------ private checkpoints


def test_checkpoints_under_a_checkpoint_root_are_private(tmp_path: Path, group: None, open_umask: None) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    root = shared / "ckpt-root" / "run-1"  # paths.checkpoint_root/RUN: neither exists yet
    saver = ckpt.Checkpointer(root, keep=1, async_save=True)
    saver.prepare()
    for step in (1, 2):
        saver.save(step, ckpt.dcp_writer(saver, {"model": _state()}), {"job": {"name": "x"}})
        tmp = root / f"step-{step:08d}.tmp"
        assert _mode(tmp) == 0o700  # the tmp dir, while the shards are written
    saver.close()
    resume.write_attempts(root, {"scratch": 1})
    resume.quarantine(root, 2, "test")
    assert _mode(shared) == 0o755  # a folder that already existed is not ours to change
    for folder in (shared / "ckpt-root", root, ckptdir.step_dir(root, 2)):
        assert _mode(folder) == 0o700, folder
    files = [p for p in root.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {resume.QUARANTINE_MARKER, "QUARANTINED.txt", "resume-attempts.json", ".metadata"} <= names
    assert any(n.endswith(".distcp") for n in names)
    assert {p.name: oct(_mode(p)) for p in files} == {p.name: oct(0o600) for p in files}


def test_the_marker_keeps_no_env_and_export_can_still_rebuild_the_job() -> None:
    job = JobSpec(name="j", train=Train(model=Model(n_layers=2)), env={"WANDB_API_KEY": "s3cret"})
    stored = marker_job(RunSpec(job, RunInfo(cluster="c", scheduler="local", run_dir="/r")))
    assert "env" not in stored and "s3cret" not in json.dumps(stored)
    from meshrun.launcher.contract.spec import schema

    assert schema.load(JobSpec, stored).trainer.model.n_layers == 2


# ------------------------------------------------------------------ every commit is reported


@pytest.mark.parametrize("async_save", [True, False])
def test_every_commit_calls_on_commit_whichever_call_commits_it(tmp_path: Path, group: None, async_save: bool) -> None:
    seen: list[int] = []
    saver = ckpt.Checkpointer(tmp_path, keep=5, async_save=async_save, on_commit=lambda step, stall: seen.append(step))
    saver.prepare()
    saver.save(1, ckpt.dcp_writer(saver, {"model": _state()}), {})
    saver.save(2, ckpt.dcp_writer(saver, {"model": _state()}), {})  # async: step 1 commits inside this save's wait
    saver.close()  # and step 2 here
    assert seen == [1, 2] == ckptdir.complete_steps(tmp_path)


# ------------------------------------------------------------------ validation cadence


@pytest.mark.parametrize(
    "eval_every, last, validated", [(4, 10, [4, 8, 10]), (0, 10, []), (5, 10, [5, 10]), (3, 7, [3, 6, 7])]
)
def test_validation_every_eval_every_steps_and_at_the_last(eval_every: int, last: int, validated: list[int]) -> None:
    cfg = Train(log_every=3, eval_every=eval_every, steps=last)
    assert [s for s in range(1, last + 1) if eval_due(cfg, s, last)] == validated


# ------------------------------------------------------------------ data checks


def _tokens(path: Path, values: list[int]) -> Path:
    torch.tensor(values, dtype=torch.int32).to(torch.uint16).numpy().tofile(path)
    return path


def test_a_file_smaller_than_one_global_batch_is_refused_with_the_numbers(tmp_path: Path) -> None:
    path = _tokens(tmp_path / "small.u16", [1] * 1000)
    ds = TokenDataset(path, seq_len=64, val_fraction=0.05)  # 950 train tokens: 14 windows of 65
    with pytest.raises(SchemaError) as err:
        check_train_data(ds, global_batch=16)
    text = str(err.value)
    assert str(path) in text and "1000 tokens" in text and "14 training sequences" in text
    assert "global batch of 16" in text and "bigger token file" in text and "\n" not in text
    check_train_data(ds, global_batch=14)


def test_an_empty_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty.u16").write_bytes(b"")
    with pytest.raises(SchemaError, match="empty"):
        TokenDataset(tmp_path / "empty.u16", seq_len=8)


def test_token_ids_beyond_the_vocabulary_name_the_id_the_file_and_the_fix(tmp_path: Path) -> None:
    values = [5] * 300
    values[217] = 4000
    path = _tokens(tmp_path / "ids.u16", values)
    assert largest_token(TokenDataset(path, 8, 0.0).tokens, chunk=7) == (4000, 217)
    with pytest.raises(SchemaError) as err:
        check_token_ids(TokenDataset(path, 8, 0.0), vocab_size=256)
    text = str(err.value)
    assert "token id 4000" in text and str(path) in text and "vocab_size to at least 4001" in text
    check_token_ids(TokenDataset(path, 8, 0.0), vocab_size=4001)


def test_resuming_over_other_data_is_bad_input_not_a_crash(tmp_path: Path) -> None:
    path = _tokens(tmp_path / "t.u16", [3] * 5000)
    layout = Layout(global_batch=4, micro_batch=2, dp_rank=0, dp_size=1)
    saved = TrainStream(TokenDataset(path, seq_len=32), layout, seed=0).state_dict()
    with pytest.raises(SchemaError, match="window=33 but this data gives 17"):  # exit 2: never requeued
        TrainStream(TokenDataset(path, seq_len=16), layout, seed=0).load_state_dict(saved)


# ------------------------------------------------------------------ spec.json


def _spec_dir(tmp_path: Path, text: str) -> Path:
    (tmp_path / RunDir.SPEC).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda t: t[: len(t) // 2], "not valid JSON"),
        (lambda t: t.replace('"steps": 100', '"steps": "many"'), "train.steps"),
        (lambda t: t.replace('"steps": 100', '"stepz": 100'), "did you mean 'steps'"),
        (lambda t: "[]", "expected a JSON object"),
    ],
)
def test_a_broken_spec_json_is_one_line_naming_the_file(tmp_path: Path, edit, expect: str) -> None:
    good = dumps_run_spec(
        RunSpec(JobSpec(name="j", train=Train()), RunInfo(cluster="c", scheduler="local", run_dir=str(tmp_path)))
    )
    with pytest.raises(SpecFileError) as err:
        read_run_spec(_spec_dir(tmp_path, edit(good)))
    assert isinstance(err.value, SchemaError)
    text = str(err.value)
    assert text.startswith(str(tmp_path / RunDir.SPEC)) and expect in text and "\n" not in text


def test_a_missing_spec_json_names_the_run_dir(tmp_path: Path) -> None:
    with pytest.raises(SpecFileError, match="no run spec there"):
        read_run_spec(tmp_path)


# ------------------------------------------------------------------ rank-error.txt


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> None:
    """This process as rank RANK of a torchrun-style world (what reports_fatal_errors names)."""
    for name, value in {"RANK": rank, "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, str(value))


def test_the_first_rank_error_wins_and_is_private(tmp_path: Path, open_umask: None) -> None:
    assert rankfail.record_rank_error(tmp_path, 1, "data.path: 'x': no token file there")
    assert not rankfail.record_rank_error(tmp_path, 0, "a peer's echo")
    path = Path(RunDir(str(tmp_path)).rank_error)
    assert path.read_text() == "rank 1: data.path: 'x': no token file there\n" and _mode(path) == 0o600


def test_bad_input_becomes_exit_2_and_anything_else_is_recorded_and_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    as_rank(monkeypatch, 3, world_size=4)

    @rankfail.reports_fatal_errors
    def bad(run_dir: str) -> int:
        raise SchemaError("data.path", "/x", "line one\nline two")

    assert bad(str(tmp_path)) == 2
    assert capsys.readouterr().err == "meshrun launcher: error: data.path: '/x': line one line two\n"
    assert rankfail.read_rank_error(tmp_path) == "rank 3: data.path: '/x': line one line two"
    assert (tmp_path / RunDir.EXIT_CODE).read_text() == "2\n"

    other = tmp_path / "other"
    other.mkdir()

    @rankfail.reports_fatal_errors
    def broken(run_dir: str) -> int:
        raise IndexError("index out of range in self")

    with pytest.raises(IndexError):
        broken(str(other))
    assert rankfail.read_rank_error(other) == "rank 3: IndexError: index out of range in self"


def test_a_file_that_vanishes_during_the_run_is_a_failure_that_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 2 is for what the user wrote (checked and named where it is read); a file gone mid-run is not."""
    as_rank(monkeypatch, 0, world_size=2)

    @rankfail.reports_fatal_errors
    def reads_a_removed_file(run_dir: str) -> int:
        open(tmp_path / "code" / "vocab.txt")  # noqa: SIM115 (raises)
        return 0

    with pytest.raises(FileNotFoundError):
        reads_a_removed_file(str(tmp_path))
    line = rankfail.read_rank_error(tmp_path)
    assert line is not None and line.startswith(f"rank 0: FileNotFoundError: {tmp_path}/code/vocab.txt vanished")
    assert not (tmp_path / RunDir.EXIT_CODE).exists()  # no "bad input" verdict: the job failed

    gone = tmp_path / "snapshot"
    gone.mkdir()
    monkeypatch.chdir(gone)
    monkeypatch.setenv("MESHRUN_CODE_DIR", str(gone))
    gone.rmdir()  # the working folder removed under the rank (as a replaced snapshot was)
    exc = FileNotFoundError(2, "No such file or directory")  # what os.getcwd() raises then: no file name
    assert rankfail.one_line(exc) == (
        f"FileNotFoundError: the working folder {gone} vanished while the job ran (a code snapshot removed under it?)"
    )


def test_python_m_launcher_does_not_call_a_vanished_file_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m meshrun.launcher` (what srun runs) let FileNotFoundError through as exit 2 as well."""
    from meshrun.launcher import __main__ as launcher_main
    from meshrun.launcher.rank import entry

    def vanished(run_dir: str) -> int:
        raise FileNotFoundError(2, "No such file or directory", f"{run_dir}/gone.txt")

    monkeypatch.setattr(entry, "run_rank", vanished)
    with pytest.raises(FileNotFoundError):  # a failure (exit 1, its traceback in the rank's log)
        launcher_main.main(["launcher", str(tmp_path)])
    assert not (tmp_path / RunDir.EXIT_CODE).exists()
