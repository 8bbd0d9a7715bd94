"""One rank of a resharding probe: build the trainer for RUN_DIR's layout, load a checkpoint
saved under another layout, and write this rank's full (unsharded) parameters to
RUN_DIR/probe-<rank>.pt. Run by tests/integration/test_checkpoint_resume.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshrun.launcher.checkpoint.commit import Checkpointer
from meshrun.launcher.checkpoint.manager import CheckpointManager
from meshrun.launcher.contract.spec.job import read_run_spec
from meshrun.launcher.data.dataset import TokenDataset
from meshrun.launcher.rank.env import rank_env
from meshrun.launcher.train.runtime import init_distributed, pick_runtime
from meshrun.launcher.train.trainer import build_trainer


def main(run_dir: Path, checkpoint: Path) -> None:
    job = read_run_spec(run_dir).job
    env = rank_env(os.environ)
    runtime = pick_runtime(job, env, os.environ)
    init_distributed(env, runtime)
    try:
        dataset = TokenDataset(job.data.path, job.trainer.model.seq_len, job.data.val_fraction)
        t = build_trainer(job, env, runtime, dataset)
        CheckpointManager(Checkpointer(checkpoint.parent, keep=1, coordinator=False), None, env).load(t, checkpoint)
        full = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in t.engine.model.state_dict().items()
        }
        if t.coords.dp == 0 and t.coords.tp == 0:  # one writer per pipeline stage
            torch.save(full, run_dir / f"probe-{env.rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
