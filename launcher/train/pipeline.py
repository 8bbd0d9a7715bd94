"""Forward/backward of one optimizer step: a plain micro-batch loop, or a torch.distributed.pipelining schedule.

Both executors see the same micro batches (the step's accumulation micro-batches,
which are the pipeline's micro-batches when pp > 1) and give the same gradients:
the mean over micro-batches of the per-micro-batch mean loss. Each returns the
summed micro-batch losses and how many there were; a pipeline stage other than the
last computes no loss and returns a count of 0, so a world-wide sum of (loss, count)
gives the true mean on every layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.launcher.data.dataset import MicroBatches
from meshrun.launcher.train.model import loss_fn
from meshrun.launcher.train.optim import LossScaler


@dataclass(frozen=True)
class StepLoss:
    """Summed micro-batch mean losses (0-dim fp32, unscaled) and their count on this rank."""

    total: torch.Tensor
    count: int


class Executor(Protocol):
    def train_step(self, micro_batches: MicroBatches) -> StepLoss: ...

    def eval_step(self, micro_batches: MicroBatches) -> StepLoss: ...


def autocast(device: torch.device, dtype: Optional[torch.dtype]) -> ContextManager[Any]:
    """Autocast for mixed precision where FSDP2's MixedPrecisionPolicy does not already do it."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _no_sync(model: nn.Module, last: bool) -> ContextManager[Any]:
    # DDP: all-reduce only on the last micro batch. FSDP2 keeps reduce-scattering every
    # micro batch: skipping it would keep unsharded gradients and give back ZeRO's memory win.
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


class PlainExecutor:
    """pp = 1: one forward/backward per micro batch, gradients accumulated in place."""

    def __init__(
        self, model: nn.Module, device: torch.device, autocast_dtype: Optional[torch.dtype], scaler: LossScaler
    ) -> None:
        self.model, self.device, self.autocast_dtype, self.scaler = model, device, autocast_dtype, scaler

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast(self.device, self.autocast_dtype):
            return loss_fn(self.model(x), y)

    def train_step(self, micro_batches: MicroBatches) -> StepLoss:
        total = torch.zeros((), device=self.device)
        multiplier = self.scaler.loss_multiplier() / len(micro_batches)  # the mean over micro batches
        for i, (x, y) in enumerate(micro_batches):
            with _no_sync(self.model, last=i == len(micro_batches) - 1):
                loss = self._loss(x, y)
                (loss * multiplier if multiplier != 1.0 else loss).backward()
            total += loss.detach()
        return StepLoss(total, len(micro_batches))

    @torch.no_grad()
    def eval_step(self, micro_batches: MicroBatches) -> StepLoss:
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            total += self._loss(x, y).float()
        return StepLoss(total, len(micro_batches))


class PipelineExecutor:
    """pp > 1: this rank's stage inside a GPipe/1F1B schedule over the step's micro batches."""

    def __init__(
        self,
        stage_module: nn.Module,
        stage: int,
        stages: int,
        pp_mesh: DeviceMesh,
        device: torch.device,
        n_microbatches: int,
        schedule: str,
        autocast_dtype: Optional[torch.dtype],
        scaler: LossScaler,
    ) -> None:
        self.stage, self.stages, self.device = stage, stages, device
        self.autocast_dtype, self.scaler = autocast_dtype, scaler
        # Imported here: pipelining pulls in torch._dynamo (~1 s per rank), which pp = 1 never needs.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        schedules = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        pipeline_stage = PipelineStage(stage_module, stage, stages, device, group=pp_mesh.get_group())
        # scale_grads: the schedule divides gradients by the micro-batch count, so with the
        # per-micro-batch mean loss below they are the step's mean, as in PlainExecutor.
        self.schedule = schedules[schedule](
            pipeline_stage, n_microbatches=n_microbatches, loss_fn=self._scaled_loss, scale_grads=True
        )

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) * self.scaler.loss_multiplier()

    def _run(self, run: Callable[..., Any], micro_batches: MicroBatches) -> StepLoss:
        # The schedule splits whole-batch inputs along dim 0 into n_microbatches equal chunks:
        # concatenating the step's micro batches gives back exactly those micro batches.
        x = torch.cat([mb[0] for mb in micro_batches]).to(self.device, non_blocking=True)
        y = torch.cat([mb[1] for mb in micro_batches]).to(self.device, non_blocking=True)
        losses: list[torch.Tensor] = []
        args = (x,) if self.is_first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.is_last else {}
        with autocast(self.device, self.autocast_dtype):
            run(*args, **kwargs)
        if not self.is_last:
            return StepLoss(torch.zeros((), device=self.device), 0)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() / self.scaler.loss_multiplier()
        return StepLoss(total, len(losses))

    def train_step(self, micro_batches: MicroBatches) -> StepLoss:
        return self._run(self.schedule.step, micro_batches)

    @torch.no_grad()
    def eval_step(self, micro_batches: MicroBatches) -> StepLoss:
        return self._run(self.schedule.eval, micro_batches)
