"""A plain PyTorch DDP script with meshrun's safety net, run as a `command:` job (examples/ddp.yaml).

It trains a small MLP on a fixed synthetic regression task (each step's batch comes from the step number,
so a resumed run sees exactly the batches an uninterrupted one would), gloo on CPU, NCCL on GPUs. What
`meshrun.launcher.job` adds, and nothing else of meshrun:

- it resumes from job.latest_checkpoint() (the newest *complete* one; an interrupted save is ignored);
- it saves with torch.save into job.new_checkpoint(step), then job.mark_complete() makes it count;
- job.should_stop() turns a preemption or the time limit into a save and job.exit_for_requeue() (75): the
  batch script requeues the job and the next run continues from that step;
- job.report(step, loss=...) feeds metrics.jsonl, `meshrun status`, the heartbeat and the requeue policy.

    python examples/ddp_train.py [--steps N] [--save-every N] [--sleep S]
"""

# First, before torch's second of imports: from here on a stop signal is caught (a flag), not fatal.
from meshrun.launcher import job  # noqa: I001

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BATCH = 32


def init() -> torch.device:
    """The process group from the torchrun-style variables meshrun sets: NCCL on a GPU, else gloo."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step `step`'s data: y = sum(sin(x)), a target the MLP can learn."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, 16, generator=gen)
    return x.to(device), torch.sin(x).sum(dim=1, keepdim=True).to(device)


def save(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Rank 0 writes the whole state (DDP replicas are identical) and marks it complete."""
    if dist.get_rank() == 0:
        folder = job.new_checkpoint(step)
        torch.save({"step": step, "model": model.state_dict(), "optim": optimizer.state_dict()}, folder / "state.pt")
        job.mark_complete(folder)


def resume(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step to start from: 1, or one past the newest complete checkpoint's."""
    path = job.latest_checkpoint()
    if path is None:
        return 1
    state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    print(f"resuming from step {state['step']} ({path})", flush=True)
    return int(state["step"]) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step (slows a demo down)")
    args = parser.parse_args()

    device = init()
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    start = resume(net, optimizer)
    model = DistributedDataParallel(net)
    print(f"rank {rank}/{dist.get_world_size()} restart {os.environ.get(job.RESTART_COUNT_ENV, '0')}", flush=True)
    loss = torch.zeros((), device=device)
    for step in range(start, args.steps + 1):
        x, y = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global loss, the same on every rank
        job.report(step, loss=mean.item() / dist.get_world_size())
        time.sleep(args.sleep)
        if step % args.save_every == 0 or step == args.steps:
            save(step, net, optimizer)
        elif job.should_stop():  # every rank asks at the same point: they all stop after this step
            save(step, net, optimizer)
            print(f"stopping after step {step}: checkpoint saved, exit for requeue", flush=True)
            job.exit_for_requeue()
    if rank == 0 and start <= args.steps:  # a start that found every step done trained none
        print(f"final loss {mean.item() / dist.get_world_size():.6f} at step {args.steps}", flush=True)
    job.finished(args.steps)  # done: an exit 0 after a stop signal is a finish now, not a stop
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
