"""Functions the submitit API tests send to the testbed's nodes.

They live in a module, not in the test file, because submitit pickles a function by reference:
the workers import it (`python -m submitit.core._submit` runs in the submitter's cwd, the repo root).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import submitit


def allreduce_ranks() -> dict[str, Any]:
    """Every rank adds rank+1 through a gloo all-reduce; each returns the sum and where it ran."""
    import torch
    import torch.distributed as dist

    env = submitit.helpers.TorchDistributedEnvironment().export()
    dist.init_process_group("gloo")
    try:
        total = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(total)
    finally:
        dist.destroy_process_group()
    return {
        "sum": int(total.item()),
        "rank": env.rank,
        "world_size": env.world_size,
        "node": os.environ["SLURMD_NODENAME"],
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def square(x: int) -> int:
    return x * x


class CountTo(submitit.helpers.Checkpointable):
    """Counts to `target`, one step at a time; the count and the restarts seen live in `self`, so
    they come back from the checkpoint submitit pickles when the job is signalled."""

    def __init__(self) -> None:
        self.count = 0
        self.restarts: list[int] = []

    def __call__(self, target: int, halfway_marker: str) -> dict[str, Any]:
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        self.restarts.append(restart)
        while self.count < target:
            self.count += 1
            if restart == 0 and self.count == target // 2:
                Path(halfway_marker).write_text(str(self.count))
                time.sleep(120)  # the test signals the job here; without the signal it returns unrequeued
        return {"count": self.count, "restarts": self.restarts}
