"""Shared by the training benches: one in-process rank (world size 1) built exactly as `meshrun.launcher.train.loop` builds it."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

from meshrun.launcher.checkpoint.manager import CheckpointManager  # noqa: E402
from meshrun.launcher.contract.spec.job import JobSpec  # noqa: E402
from meshrun.launcher.data.corpus import build_corpus  # noqa: E402
from meshrun.launcher.data.dataset import TokenDataset  # noqa: E402
from meshrun.launcher.rank.env import rank_env  # noqa: E402
from meshrun.launcher.train.loop import check_layout, run_loop  # noqa: E402
from meshrun.launcher.train.metrics import MetricsLog  # noqa: E402
from meshrun.launcher.train.runtime import check_tasks, init_distributed, pick_runtime  # noqa: E402
from meshrun.launcher.train.trainer import Trainer, build_trainer  # noqa: E402


def corpus(folder: Path, tokens: int) -> Path:
    """A byte-level token file of `tokens` tokens from the stdlib (ids < 256 fit any vocab)."""
    path = folder / "bench.u16"
    build_corpus(path, max_bytes=tokens)
    return path


@contextlib.contextmanager
def single_rank_trainer(job: JobSpec) -> Iterator[Trainer]:
    """The trainer's objects for a one-rank job: the same checks, runtime, process group and build as train()."""
    env = rank_env({})  # one process: no scheduler, no torchrun variables
    check_tasks(job, env)
    check_layout(job, env)
    dataset = TokenDataset(job.data.path, job.trainer.model.seq_len, job.data.val_fraction)
    runtime = pick_runtime(job, env, os.environ)
    init_distributed(env, runtime)
    try:
        yield build_trainer(job, env, runtime, dataset)
    finally:
        dist.destroy_process_group()


def timed_steps(t: Trainer, metrics: MetricsLog, first: int, steps: int) -> float:
    """Seconds for steps first..first+steps-1 of the trainer's own loop, saving nothing (a bench's rounds)."""
    off = CheckpointManager.off(t.env, "a benchmark saves nothing")
    start = time.perf_counter()
    run_loop(t, t.env, metrics, off, first=first, last=first + steps - 1)
    return time.perf_counter() - start
