"""A plain PyTorch Lightning script, no meshrun imports: what a Lightning user brings (examples/lightning.yaml).

It fits a small linear regression on a fixed synthetic data set with DDP (gloo on CPU), one epoch a few
batches long, and prints the final loss on every rank. What makes a preemption or the time limit resume
exactly where it stopped is Lightning's own protocol, with two lines a Lightning user adds under meshrun
(docs/guides/bring-your-own.md, "Frameworks with Slurm habits of their own"):

- `default_root_dir` in the run dir: Lightning's SIGUSR1 handler (the time limit's warning, which meshrun
  passes on once) saves `hpc_ckpt_N.ckpt` there and runs `scontrol requeue` itself; the next start loads it;
- `OnExceptionCheckpoint`: a preemption's SIGTERM makes Lightning stop at the next batch and exit 0, and this
  callback of Lightning's saves first; meshrun takes that exit 0 for the stop it is and requeues the job;
- `ckpt_path=newest_checkpoint(...)`: the newer of the two. Left to itself (ckpt_path=None) Lightning loads an
  hpc checkpoint whenever there is one, however old: after a time limit's save and a later preemption's, it
  went back to the time limit's and trained the steps between again.

    python examples/lightning_train.py [--epochs N] [--sleep S]
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from typing import Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.sleep_s = sleep_s

    def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        time.sleep(self.sleep_s)  # a step long enough for a preemption to land mid-run
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0 and self.current_epoch % 10 == 0:
            print(f"epoch {self.current_epoch} done", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> DataLoader:
    """The same 128 samples on every run (Lightning's DistributedSampler splits them between the ranks)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(128, 1, generator=g)
    return DataLoader(
        TensorDataset(x, y), batch_size=64
    )  # one batch a rank an epoch (2 ranks): every stop ends an epoch, and a resume is exact


def newest_checkpoint(*folders: str) -> Optional[str]:
    """The newest checkpoint Lightning saved on a stop: a time limit's hpc_ckpt_N.ckpt or a preemption's
    on_exception.ckpt, in any of `folders`; None on a first start."""
    found = [
        path
        for folder in folders
        for pattern in ("hpc_ckpt_*.ckpt", "on_exception.ckpt")
        for path in glob.glob(os.path.join(folder, pattern))
    ]
    return max(found, key=os.path.getmtime, default=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    pl.seed_everything(0)
    run_dir = os.environ.get("MESHRUN_RUN_DIR", ".")
    checkpoints = os.environ.get("MESHRUN_CHECKPOINT_DIR", run_dir)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=nodes,
        strategy="ddp",
        max_epochs=args.epochs,
        default_root_dir=run_dir,  # the time limit's hpc_ckpt_N.ckpt lands here (not in the shared code snapshot)
        callbacks=[OnExceptionCheckpoint(checkpoints)],  # a preemption's on_exception.ckpt lands here
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(args.sleep)
    trainer.fit(model, data(), ckpt_path=newest_checkpoint(run_dir, checkpoints))
    loss = trainer.callback_metrics.get("train_loss")
    print(f"final loss {float(loss):.8f} after epoch {trainer.current_epoch} step {trainer.global_step}", flush=True)
    if torch.distributed.is_initialized():
        # Every rank leaves the process group together: one torn down by the interpreter's exit can abort a
        # rank ("terminate called without an active exception", SIGABRT) after its work is done.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
