"""What a rank writes and what it refuses, with real `python -m meshrun.launcher RUN_DIR` ranks (CPU, gloo, a tiny
model); the items a new user hit, their one-process side is tests/unit/test_rank_outputs_and_bad_input.py.

One short run covers the trainer's findings (validation cadence, every commit in metrics.jsonl
and the crash-loop guard, private checkpoints under a checkpoint root, no `env` in the marker)
and then export's; bad input is tried in this process (fast: it fails before any rendezvous)
and with two real ranks (exit 2, one line, rank-error.txt).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import ATTEMPTS_FILE, RunDir
from meshrun.launcher.contract.spec.job import Checkpoint
from tests.helpers.ranks import REPO, TIMEOUT_S, finish, make_run, metrics, start, tiny_train
from tests.integration.test_train_processes import own_environ  # noqa: F401  (a fixture)

SECRET = "s3cret-token-value"


def _with_checkpoint_dir(run_dir: Path, checkpoint_dir: Path) -> None:
    """As the planner writes spec.json when the cluster has paths.checkpoint_root."""
    spec = json.loads((run_dir / RunDir.SPEC).read_text())
    spec["run"]["checkpoint_dir"] = str(checkpoint_dir)
    (run_dir / RunDir.SPEC).write_text(json.dumps(spec))


def _export(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "meshrun.launcher.export", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=TIMEOUT_S,
    )


def test_validation_checkpoint_events_privacy_and_export(tmp_path: Path, corpus: Path) -> None:
    old = os.umask(0o022)  # the ranks inherit a permissive umask: privacy must not depend on it
    try:
        run_dir = make_run(
            tmp_path,
            "run",
            corpus,
            1,
            env={"API_TOKEN": SECRET},
            train=tiny_train(steps=10, log_every=3, eval_every=4, eval_sequences=8),
            checkpoint=Checkpoint(every=3, keep=2, async_save=False),
        )
        ckroot = tmp_path / "shared" / "ckroot" / "run"
        _with_checkpoint_dir(run_dir, ckroot)
        finish(start(run_dir, 1))
    finally:
        os.umask(old)

    rows = metrics(run_dir)
    # Item 11: validated every eval_every steps and at the last, whatever log_every is.
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 10]
    assert [r["step"] for r in rows] == [3, 4, 6, 8, 9, 10]
    # Item 12: one event per commit (synchronous saves commit inside save()), and the guard saw them.
    events = [json.loads(line) for line in (run_dir / RunDir.METRICS).read_text().splitlines() if '"event"' in line]
    assert [e["checkpoint_step"] for e in events if e["event"] == "checkpoint"] == [3, 6, 9, 10]
    assert [e["from_step"] for e in events if e["event"] == "train_start"] == [0]  # goodput's start of training
    assert json.loads((ckroot / ATTEMPTS_FILE).read_text()) == {}

    # Item 1: private wherever they live, and no env in the marker (nor anywhere in the checkpoint).
    for folder in (ckroot.parent, ckroot, *[p for p in ckroot.rglob("*") if p.is_dir()]):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    files = [p for p in ckroot.rglob("*") if p.is_file()]
    assert ckptdir.MARKER in {p.name for p in files}
    assert {str(p): stat.S_IMODE(p.stat().st_mode) for p in files} == {str(p): 0o600 for p in files}
    assert all(SECRET.encode() not in p.read_bytes() for p in files)
    assert "env" not in ckptdir.read_marker(ckptdir.latest(ckroot))["job"]
    assert stat.S_IMODE((run_dir / RunDir.METRICS).stat().st_mode) == 0o600

    # Item 14/20: export names a missing step, refuses a directory or a missing folder in one line,
    # and writes atomically beside OUT; the checkpoint root exports its newest complete step.
    work = tmp_path / "cwd"
    work.mkdir()
    missing = _export(str(ckptdir.step_dir(ckroot, 7)), str(work / "m.safetensors"), cwd=work)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"meshrun export: no checkpoint step 7 under {ckroot}; complete steps: 9, 10"
    for out, expect in (
        (work, "is a directory; give a file name"),
        (work / "no" / "m.safetensors", f"folder {work / 'no'} does not exist"),
    ):
        done = _export(str(ckroot), str(out), cwd=work)
        assert done.returncode == 2 and expect in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert "Traceback" not in done.stderr
    done = _export(str(ckroot), "model.safetensors", cwd=work)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in work.iterdir()) == ["model.safetensors"]  # no stray .tmp
    from safetensors import safe_open

    with safe_open(str(work / "model.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "10" and len(list(f.keys())) > 0


def _write_tokens(path: Path, values: list[int]) -> Path:
    torch.tensor(values, dtype=torch.int32).to(torch.uint16).numpy().tofile(path)
    return path


@pytest.mark.parametrize("case", ["missing", "empty", "odd", "small", "vocab", "spec"])
def test_bad_input_is_one_line_exit_2_and_rank_error(
    tmp_path: Path,
    corpus: Path,
    case: str,
    own_environ: None,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    from meshrun.launcher.__main__ import main

    data = tmp_path / f"{case}.u16"
    if case == "empty":
        data.write_bytes(b"")
    elif case == "odd":
        data.write_bytes(b"\x01\x00\x02")
    elif case == "small":
        _write_tokens(data, [1] * 500)
    elif case == "vocab":
        _write_tokens(data, [7] * 4000 + [300] + [7] * 4000)
    elif case == "spec":
        data = corpus
    run_dir = make_run(tmp_path, "run", data, 1, train=tiny_train(steps=2, eval_every=0))
    if case == "spec":
        text = (run_dir / RunDir.SPEC).read_text()
        (run_dir / RunDir.SPEC).write_text(text[: len(text) // 2])
    expect = {
        "missing": "no token file there",
        "empty": "empty",
        "odd": "not a whole number",
        "small": "fewer than one global batch of 8",
        "vocab": "token id 300",
        "spec": "not valid JSON",
    }[case]
    assert main(["launcher", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0] and err[0].startswith("meshrun launcher: error: "), err
    named = str(run_dir / RunDir.SPEC) if case == "spec" else str(data)
    line = (run_dir / RunDir.RANK_ERROR).read_text()
    assert line == f"rank 0: {err[0].removeprefix('meshrun launcher: error: ')}\n" and named in line
    assert stat.S_IMODE((run_dir / RunDir.RANK_ERROR).stat().st_mode) == 0o600
    assert (run_dir / RunDir.EXIT_CODE).read_text() == "2\n"


def test_two_ranks_on_an_odd_sized_file_exit_2_and_one_records_it(tmp_path: Path) -> None:
    data = tmp_path / "odd.u16"
    data.write_bytes(b"\x01" * 1001)
    run_dir = make_run(tmp_path, "run", data, 2)
    procs = start(run_dir, 2)
    outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    for out in outputs:
        assert "Traceback" not in out and "1001 bytes is not a whole number of uint16 tokens" in out
    recorded = (run_dir / RunDir.RANK_ERROR).read_text().splitlines()
    assert len(recorded) == 1 and recorded[0].split(":")[0] in ("rank 0", "rank 1") and str(data) in recorded[0]
