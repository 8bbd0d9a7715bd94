"""The engine interface: what the training loop drives, whichever engine holds the model.

Two engines implement it: `native` (launcher/train/engines/native.py: FSDP2/DDP + DTensor tensor parallel +
torch.distributed.pipelining) and `deepspeed` (launcher/train/engines/deepspeed.py: ZeRO 0-3 and CPU offload).
The loop (launcher/train/loop.py), the Trainer (launcher/train/trainer.py) and the checkpoint manager
(launcher/checkpoint/manager.py) know only this interface; `train.engine` in the spec picks one.

An engine owns the model, the optimizer and the loss scaler, and the engine's part of a
checkpoint. The Trainer owns the rest of what an exact resume needs (the step, the data
position, the RNG); the checkpoint manager owns when to save, what to keep and what to load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from meshrun.launcher.checkpoint.commit import Writer
from meshrun.launcher.data.dataset import MicroBatches
from meshrun.launcher.train.model import GPT
from meshrun.launcher.train.pipeline import StepLoss

if TYPE_CHECKING:
    from meshrun.launcher.checkpoint.commit import Checkpointer


@dataclass(frozen=True)
class StepResult:
    loss: StepLoss
    grad_norm: torch.Tensor
    """The true global gradient norm before clipping (0-dim; reading it is a host sync: only when logging)."""
    lr: float


class Engine(Protocol):
    name: str
    """The spec's train.engine value."""
    model: GPT
    """This rank's part of the model (a pipeline stage or the whole), unwrapped: FLOPs, parameter names."""

    @property
    def fp16_scaled(self) -> bool:
        """fp16 with dynamic loss scaling: an inf gradient norm is an overflow the scaler skips, not a divergence."""

    def describe(self) -> list[str]:
        """How it runs, for the first log line (e.g. ["fsdp", "1f1b"] or ["ZeRO-2", "optimizer offload"])."""

    def train_step(self, micro_batches: MicroBatches, lr: float) -> StepResult:
        """Forward and backward over the step's micro batches, the global norm, clipping, one optimizer step."""

    def eval_step(self, micro_batches: MicroBatches) -> StepLoss:
        """Validation loss over micro batches (no gradients)."""

    def set_training(self, training: bool) -> None:
        """Train or eval mode (dropout-free today, but a user model may care)."""

    def loss_scale(self) -> Optional[float]:
        """The current fp16 loss scale; None when there is none."""

    def checkpoint_writer(self, saver: Checkpointer, trainer_state: dict[str, Any]) -> Writer:
        """How this engine writes a checkpoint holding its own parts and `trainer_state` (DCP-able values)."""

    def load_checkpoint(self, saver: Checkpointer, trainer_state: dict[str, Any], path: Path) -> None:
        """Restore its own parts from complete checkpoint `path`, and `trainer_state`'s values in place."""
