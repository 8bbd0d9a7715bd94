"""The Trainer: one object whose parts are stateful, whichever engine holds the model.

Its parts: the engine (model, optimizer, loss scaler; launcher/train/engines/base.py), the data stream
(its position), the step and each rank's RNG. Each has state_dict/load_state_dict, so the
checkpoint manager (launcher/checkpoint/manager.py) saves and restores a Trainer without knowing
what is inside (torchtitan's shape: the Trainer is Stateful, the checkpointer decides when).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshrun.launcher.contract.spec.job import JobSpec, Train
from meshrun.launcher.contract.spec.parallel_dims import Coordinates, ParallelDims
from meshrun.launcher.data.dataset import Layout, MicroBatches, TokenDataset, TrainStream, val_steps
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train.engines import build_engine
from meshrun.launcher.train.engines.base import Engine, StepResult
from meshrun.launcher.train.optim import lr_at
from meshrun.launcher.train.runtime import Runtime


@dataclass
class Progress:
    """The step a checkpoint was saved after, and the data position to continue from (Stateful)."""

    stream: TrainStream
    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "data": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.stream.load_state_dict(state["data"])


@dataclass
class RngState:
    """This rank's torch RNG (Stateful). Keyed by world size and rank: restored only when the rank
    existed in the saved world (another world size's RNG streams do not map onto this one's)."""

    env: RankEnv

    @property
    def key(self) -> str:
        return f"rng.world{self.env.world_size}.rank{self.env.rank}"

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])


@dataclass
class Trainer:
    """Everything one rank trains with; built by `build_trainer` (the benches build it too)."""

    job: JobSpec
    env: RankEnv
    dims: ParallelDims
    coords: Coordinates
    runtime: Runtime
    layout: Layout
    dataset: TokenDataset
    stream: TrainStream
    engine: Engine
    progress: Progress
    rng: RngState

    @property
    def cfg(self) -> Train:
        return self.job.trainer

    def state_parts(self, step: int, with_rng: bool = True) -> dict[str, Any]:
        """The Trainer's own checkpoint parts, at `step` (the engine adds its own)."""
        self.progress.step = step
        return {"train": self.progress, **({self.rng.key: self.rng} if with_rng else {})}

    def train_step(self, step: int, micro_batches: MicroBatches) -> StepResult:
        return self.engine.train_step(micro_batches, lr_at(step, self.cfg))

    def evaluate(self) -> float:
        """Mean loss over the fixed validation set (the same set and micro batches whatever the layout)."""
        self.engine.set_training(False)
        total, count = torch.zeros((), device=self.runtime.device), 0
        for micro_batches in val_steps(self.dataset, self.layout, self.cfg.eval_sequences):
            part = self.engine.eval_step(micro_batches)
            total, count = total + part.total, count + part.count
        self.engine.set_training(True)
        return mean_over_ranks(total, count)


def build_trainer(job: JobSpec, env: RankEnv, runtime: Runtime, dataset: TokenDataset) -> Trainer:
    """The layout, the engine the spec names, the data stream (needs a process group)."""
    cfg = job.trainer
    dims = job.dims
    coords = dims.coordinates(env.rank)
    layout = Layout(cfg.global_batch, cfg.micro_batch, dp_rank=coords.dp, dp_size=dims.dp)
    stream = TrainStream(dataset, layout, cfg.seed)
    return Trainer(
        job=job,
        env=env,
        dims=dims,
        coords=coords,
        runtime=runtime,
        layout=layout,
        dataset=dataset,
        stream=stream,
        engine=build_engine(job, env, runtime, dims, layout),
        progress=Progress(stream),
        rng=RngState(env),
    )


def mean_over_ranks(total: torch.Tensor, count: int) -> float:
    """sum(totals) / sum(counts) over all ranks (gloo has no AVG op, so SUM both, then divide).

    Ranks without a loss (pipeline stages before the last) add 0/0; the tp ranks of the
    last stage all add the same loss and count, which leaves the mean unchanged.
    """
    packed = torch.stack([total.float(), torch.tensor(float(count), device=total.device)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return float(packed[0] / packed[1])
