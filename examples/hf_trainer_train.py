"""A plain Hugging Face Trainer script, no meshrun imports: what a transformers user brings (examples/hf-trainer.yaml).

It fits a small linear regression on a fixed synthetic data set with the Trainer's own DDP (gloo on CPU),
saving a checkpoint every 10 steps, and prints the final loss (over the whole data set, from the final
weights) on every rank. Under meshrun it needs two things a Trainer user writes anyway (docs/guides/
bring-your-own.md, "Frameworks with Slurm habits of their own"):

- `output_dir` where the checkpoints live across starts: MESHRUN_CHECKPOINT_DIR (shared storage, private);
- `trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))`: the next start resumes from the
  newest one. The Trainer installs no SIGTERM handler: a preempted rank dies of the signal, and meshrun
  requeues a program that died of the stop signal it passed on.

    python examples/hf_trainer_train.py [--epochs N] [--sleep S]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.layer(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Samples(torch.utils.data.Dataset):
    """The same 128 samples on every run."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(128, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(128, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Slow(TrainerCallback):
    """A step long enough for a preemption to land mid-run; rank 0 says where it is every 10 steps."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def on_step_end(self, args, state, control, **_kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.sleep_s)
        if state.is_world_process_zero and state.global_step % 10 == 0:
            print(f"step {state.global_step} done", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    output_dir = os.environ.get("MESHRUN_CHECKPOINT_DIR", "checkpoints")
    training = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=16,
        num_train_epochs=args.epochs,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=10,
        save_total_limit=2,
        logging_steps=10,
        report_to=[],
        seed=0,
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    data = Samples()
    trainer = Trainer(model=Regression(), args=training, train_dataset=data, callbacks=[Slow(args.sleep)])
    newest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if newest and trainer.is_world_process_zero():
        print(f"resuming from {newest}", flush=True)
    trainer.train(resume_from_checkpoint=newest)
    with torch.no_grad():
        model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        loss = model(data.x, data.y)["loss"].item()
    print(f"final loss {loss:.8f} after step {trainer.state.global_step}", flush=True)
    if torch.distributed.is_initialized():
        # Every rank leaves the process group together: one torn down by the interpreter's exit can abort a
        # rank ("terminate called without an active exception", SIGABRT) after its work is done.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
