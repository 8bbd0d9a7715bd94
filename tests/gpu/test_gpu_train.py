"""On a CUDA GPU: the trainer in one process with mixed precision (NCCL, bf16 / fp16 with loss scaling).

Skips cleanly where there is no CUDA device (CI, the CPU dev machines); run on a GPU machine
with `pytest -q tests/gpu`.
"""

from __future__ import annotations

import math
import signal
import sysconfig
from pathlib import Path

import pytest
import torch

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec.job import (
    Data,
    JobSpec,
    Model,
    Parallel,
    Resources,
    RunInfo,
    RunSpec,
    write_run_spec,
)
from meshrun.launcher.data.corpus import build_corpus
from meshrun.launcher.rank.preempt import EXIT_REQUEUE
from tests.helpers.cli import wait_for_step
from tests.helpers.ranks import finish, metrics, start, tiny_train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 12


def gpu_run(root: Path, precision: str, engine: str = "native", steps: int = STEPS, name: str = "") -> Path:
    corpus = root / "logging.u16"
    if not corpus.exists():
        build_corpus(corpus, roots=[Path(sysconfig.get_paths()["stdlib"]) / "logging"])
    run_dir = root / (name or f"{engine}-{precision}")
    run_dir.mkdir()
    train = tiny_train(
        model=Model(n_layers=4, d_model=256, n_heads=4, seq_len=256),
        steps=steps,
        precision=precision,
        global_batch=16,
        micro_batch=8,
        eval_every=steps,
        eval_sequences=32,
        activation_checkpointing=True,
        engine=engine,
    )
    job = JobSpec(
        name=f"gpu-{engine}-{precision}",
        resources=Resources(gpus_per_node=1),
        parallel=Parallel(),
        train=train,
        data=Data(path=str(corpus)),
    )
    write_run_spec(RunSpec(job, RunInfo(cluster="local", scheduler="local", run_dir=str(run_dir))), run_dir)
    return run_dir


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_on_one_gpu_ends_in_a_checkpoint(tmp_path: Path, precision: str) -> None:
    run_dir = gpu_run(tmp_path, precision)
    (out,) = finish(start(run_dir, 1))
    assert "nccl on cuda" in out and f"precision {precision}" in out, out
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses
    assert math.isfinite(rows[-1]["val_loss"]) and rows[-1]["val_ppl"] > 1.0
    if precision == "fp16":
        assert rows[-1]["loss_scale"] > 0
    # The last step's checkpoint, written asynchronously (a NCCL-only process group made DCP's async_save refuse it)
    assert ckptdir.complete_steps(run_dir / "checkpoints")[-1] == STEPS


def test_a_preempted_gpu_run_saves_requeues_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    """SIGUSR1 (Slurm's warning before a preemption or the time limit) on a GPU rank: it saves, exits 75, and the
    requeued run resumes from that step and ends as an uninterrupted twin does (same steps; GPU kernels may round
    differently from one launch to the next, so the losses are compared to a tolerance, the figures printed)."""
    steps = 60
    ref, pre = (gpu_run(tmp_path, "bf16", steps=steps, name=name) for name in ("ref", "pre"))
    ref_procs, pre_procs = start(ref, 1), start(pre, 1)
    wait_for_step(pre, 3)
    pre_procs[0].send_signal(signal.SIGUSR1)
    out = pre_procs[0].communicate(timeout=120)[0]
    assert pre_procs[0].returncode == EXIT_REQUEUE, out
    saved = ckptdir.complete_steps(pre / "checkpoints")[-1]
    assert 3 <= saved < steps, (saved, out)
    finish(start(pre, 1))
    finish(ref_procs)
    ref_rows, pre_rows = metrics(ref), metrics(pre)
    assert [r["step"] for r in pre_rows] == list(range(1, steps + 1))  # no step lost or repeated
    pairs = [(a["loss"], b["loss"]) for a, b in zip(ref_rows, pre_rows)]
    worst = max(abs(a - b) for a, b in pairs)
    exact = sum(a == b for a, b in pairs)
    print(f"\nGPU resume after step {saved}: {exact}/{steps} losses bit-identical, largest difference {worst:.2e}")
    assert worst < 0.05, pairs
    assert ckptdir.complete_steps(pre / "checkpoints")[-1] == steps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deepspeed_engine_mixed_precision_on_one_gpu(tmp_path: Path, precision: str) -> None:
    """The deepspeed engine (ZeRO-2, DeepSpeed's own bf16 / fp16 loss scaling) on CUDA through NCCL."""
    pytest.importorskip("deepspeed")
    run_dir = gpu_run(tmp_path, precision, engine="deepspeed")
    (out,) = finish(start(run_dir, 1))
    assert "nccl on cuda" in out and "deepspeed engine, ZeRO-2" in out and f"precision {precision}" in out, out
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    if precision == "fp16":
        assert rows[-1]["loss_scale"] > 0
