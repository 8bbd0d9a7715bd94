"""A user's own DeepSpeed script, run by meshrun as a `command:` job (examples/deepspeed-command.yaml).

Nothing in it knows about meshrun but the optional `report()` call: `deepspeed.init_distributed()`
reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which meshrun sets on every rank as
torchrun would (no `deepspeed` runner, no hostfile, no pdsh). On a job without GPUs meshrun also sets
DS_ACCELERATOR=cpu (unless you did), so DeepSpeed uses gloo. It trains a small MLP on a fixed
synthetic regression task under ZeRO-2 and prints one line per step.

    python examples/deepspeed_train.py [--steps N] [--zero STAGE]
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
from torch import nn


def report(step: int, **scalars: float) -> None:
    """meshrun's metrics and heartbeat when run by meshrun; nothing elsewhere (meshrun not installed)."""
    try:
        from meshrun.launcher.report import report as meshrun_report
    except ImportError:
        return
    meshrun_report(step, **scalars)


def model(width: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank, as DeepSpeed expects
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s data: y = sum(sin(x)), a target the MLP can learn."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, 16, generator=gen)
    return x, torch.sin(x).sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()

    deepspeed.init_distributed()  # the process group from the torchrun-style variables meshrun sets
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    net = model(args.width)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 8 * world,
        "zero_optimization": {"stage": args.zero},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,  # this script prints its own lines
    }
    # A torch optimizer: DeepSpeed's own Adam would compile a C++ op on CPU first.
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    for step in range(1, args.steps + 1):
        x, y = batch(step, rank, 8)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        # The mean over ranks: every rank logs the same number, as a data-parallel trainer would.
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        mean /= world
        if rank == 0:
            print(f"step {step} loss {mean.item():.4f} zero {args.zero} world {world}", flush=True)
        report(step, loss=mean.item())
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
