"""A plain Hugging Face Accelerate loop, no meshrun imports: what an Accelerate user brings (examples/accelerate.yaml).

It fits a small linear regression on a fixed synthetic data set (gloo on CPU), saves its state with
`accelerator.save_state()` every 10 steps, and, like most hand-written loops, stops cleanly on SIGTERM: every
rank agrees at the next step, the state is saved, and it exits 0. Under meshrun that exit 0 after a preemption is
a stop, not a finish: the job is requeued, and the next start's `accelerator.load_state()` continues from the
step it stopped after (skipping the batches of the epoch it had done). It prints the final loss (over the whole
data set, from the final weights) on every rank.

    python examples/accelerate_train.py [--epochs N] [--sleep S]
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STOP = [False]


def stop_soon(_signum: int, _frame: Any) -> None:
    STOP[0] = True  # only a flag: the loop saves at the next step, where every rank agrees


class Progress:
    """The optimizer steps done, saved and loaded with the rest of the state (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """The same 128 samples on every run."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    return x, x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(128, 1, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, stop_soon)
    project = os.environ.get("MESHRUN_CHECKPOINT_DIR", "checkpoints")
    accelerator = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    )
    set_seed(0)
    x, y = samples()
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    saved = sorted(int(p.name.split("_")[1]) for p in Path(project, "checkpoints").glob("checkpoint_*"))
    if saved:
        accelerator.load_state()  # the newest: every save completes before the next step (see below)
        accelerator.project_configuration.iteration = saved[-1] + 1  # the next save's number (load_state keeps 0)
        accelerator.print(f"resumed at step {progress.step}")
    total = args.epochs * len(loader)
    while progress.step < total:
        done_in_epoch = progress.step % len(loader)
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for inputs, targets in batches:
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            time.sleep(args.sleep)
            stopping = accelerator.reduce(torch.tensor([int(STOP[0])]), reduction="sum").item() > 0
            if progress.step % 10 == 0 or stopping:
                accelerator.save_state()
                accelerator.print(f"step {progress.step} saved")
            if stopping:
                accelerator.print(f"stopped on SIGTERM after step {progress.step}")
                return  # exit 0: a stop, which meshrun requeues (it is no finish)
            if progress.step >= total:
                break
    with torch.no_grad():
        final = nn.functional.mse_loss(accelerator.unwrap_model(model)(x), y).item()
    print(f"final loss {final:.8f} after step {progress.step}", flush=True)
    if torch.distributed.is_initialized():
        # Every rank leaves the process group together: one torn down by the interpreter's exit can abort a
        # rank ("terminate called without an active exception", SIGABRT) after its work is done.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
