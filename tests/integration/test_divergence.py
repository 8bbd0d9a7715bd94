"""The divergence alert's trainer side on the local cluster, through the real `meshrun` command: a job made to
diverge stops at once with exit 78 and nothing non-finite saved; a starved job fires data_wait; the
best checkpoint survives retention and exports."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file

from meshrun.launcher.contract.exitcodes import EXIT_DIVERGED
from meshrun.launcher.contract.records import alerts, ckptdir
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.export.consolidate import consolidated_state
from tests.helpers.cli import TINY, meshrun, metrics, submitted, wait_for_state

ENDED = {"FAILED", "COMPLETED", "CANCELLED", "PREEMPTED", "TIMEOUT"}


def _submit(home: Path, corpus: Path, *sets: str) -> tuple[str, Path]:
    args = [*TINY, "--set", f"data.path={corpus}"]
    for item in sets:
        args += ["--set", item]
    return submitted(meshrun(home, "submit", *args, check=True))


def test_a_diverging_job_stops_at_once_with_78_and_saves_nothing_non_finite(tmp_path: Path, corpus: Path) -> None:
    job_id, run_dir = _submit(
        tmp_path,
        corpus,
        "train.lr=1e6",
        "train.warmup_steps=0",
        "train.grad_clip=0",
        "train.steps=200",
        "train.log_every=50",  # the check is every step, not only at logged steps
        "checkpoint.every=1",
        "checkpoint.keep=100",
        "checkpoint.async_save=false",
    )
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=120)
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_DIVERGED, row
    assert "diverged (exit 78)" in (row.get("reason") or ""), row

    (alert,) = [a for a in alerts.read(RunDir(str(run_dir)).alerts) if a["rule"] == "nonfinite_loss"]
    bad = alert["step"]
    assert 1 <= bad < 50 and alert["rank"] == 0 and "train.lr" in alert["message"], alert
    text = Path(RunDir(str(run_dir)).rank_log(0)).read_text(errors="replace")
    assert f"ALERT nonfinite_loss step {bad}" in text and "meshrun resume" in text
    assert not [r for r in metrics(run_dir) if r["step"] > bad]  # stopped at once

    root = run_dir / "checkpoints"
    steps = ckptdir.complete_steps(root)
    assert steps and max(steps) == bad - 1, (steps, bad)  # every finite step saved, none after
    assert not list(root.glob("step-*.tmp"))
    tensors, _ = consolidated_state(ckptdir.step_dir(root, max(steps)))
    assert all(bool(t.isfinite().all()) for t in tensors.values())
    # No checkpoint.keep_best: no marker records a val_loss, so there is no best to export.
    none = meshrun(tmp_path, "export", job_id, "--best", "-o", str(tmp_path / "best.safetensors"))
    assert none.returncode == 2 and "checkpoint.keep_best" in none.stderr, none
    assert len(none.stderr.strip().splitlines()) == 1 and "Traceback" not in none.stderr

    # `meshrun resume` starts again from the last finite checkpoint (at lr 1e6 even that one's weights are
    # already ruined, so here it diverges again; a real run resumes from one before the loss climbed, which
    # `--set checkpoint.resume_step=N` picks).
    fix = ["--set", "train.lr=3e-4", "--set", "checkpoint.resume_step=1", "--set", "train.steps=3"]
    again = meshrun(tmp_path, "resume", job_id, *fix, "--wait")
    assert "Traceback" not in again.stderr, again.stderr
    assert "resuming from the requested step 1" in Path(RunDir(str(run_dir)).rank_log(0)).read_text(errors="replace")


def test_a_starved_job_fires_data_wait(tmp_path: Path, corpus: Path) -> None:
    job_id, run_dir = _submit(tmp_path, corpus, "train.steps=8", "env.MESHRUN_TEST_DATA_DELAY=0.3")
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=120)
    assert row["state"] == "COMPLETED", row
    (alert,) = [a for a in alerts.read(RunDir(str(run_dir)).alerts) if a["rule"] == "data_wait"]
    assert alert["step"] == 3 and alert["value"] > 0.2 and alert["threshold"] == 0.2, alert


def test_keep_best_survives_retention_and_exports(tmp_path: Path, corpus: Path) -> None:
    sets = ["train.eval_every=5", "train.eval_sequences=16", "checkpoint.every=5", "checkpoint.keep=1"]
    job_id, run_dir = _submit(tmp_path, corpus, "train.steps=20", "checkpoint.keep_best=true", *sets)
    assert wait_for_state(tmp_path, job_id, ENDED, timeout=120)["state"] == "COMPLETED"
    # Ten more steps at a learning rate far too high: validation gets worse, so the best stays behind.
    again = ["--set", "train.steps=30", "--set", "train.lr=1.0", "--set", "train.min_lr=1.0"]
    meshrun(tmp_path, "resume", job_id, *again, "--wait", timeout=120)
    vals = {r["step"]: r["val_loss"] for r in metrics(run_dir) if r.get("val_loss") is not None}
    best_step = min(vals, key=lambda s: (vals[s], -s))
    assert best_step <= 20 and max(vals) == 30, vals  # the case this test is about
    root = run_dir / "checkpoints"
    assert set(ckptdir.complete_steps(root)) == {best_step, 30}, (ckptdir.complete_steps(root), vals)
    assert ckptdir.best(root) == (best_step, vals[best_step])
    shown = meshrun(tmp_path, "status", job_id, check=True).stdout
    assert f"best checkpoint: step {best_step}, val_loss {vals[best_step]:.4f}" in shown, shown

    out = tmp_path / "best.safetensors"
    done = meshrun(tmp_path, "export", job_id, "--best", "-o", str(out), check=True)
    assert f"step-{best_step:08d}" in done.stdout, done.stdout
    tensors = load_file(str(out))
    assert tensors and all(bool(t.isfinite().all()) for t in tensors.values())
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["step"] == str(best_step)
