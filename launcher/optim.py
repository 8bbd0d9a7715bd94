"""Optimizer, learning-rate schedule, the true global gradient norm, clipping and fp16 loss scaling.

The gradient norm is the one of the whole model, whatever the layout: DTensor
gradients (sharded by FSDP over dp, by TP over tp, or both) are reduced to full
norms, and the squares of the pipeline stages' norms are summed over the pp group,
so every rank holds the same number a single process would compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from launcher.spec import Train

try:  # a public name since torch 2.4; the private module keeps older builds working
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


def build_optimizer(params: Iterable[nn.Parameter], cfg: Train) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (never on norms or biases, which are 1-D)."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: Train) -> float:
    """LR for 1-based `step`: linear warmup to lr, then cosine down to min_lr at the last step."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def _grad_groups(params: Iterable[nn.Parameter]) -> list[list[torch.Tensor]]:
    """Gradients grouped by how they are distributed: one foreach norm per group, one reduction each.

    Plain tensors in one group; DTensors by (mesh, placements), since a norm over
    DTensors of different meshes cannot be one op.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else ("plain", g.device, g.dtype)
        groups.setdefault(key, []).append(g)
    return list(groups.values())


def global_grad_norm(
    params: list[nn.Parameter], device: torch.device, pp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model (a 0-dim fp32 tensor, the same on every rank)."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grads in _grad_groups(params):
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):  # partial norms of the shards -> the full norm (a collective)
            norm = norm.full_tensor()
        squares = squares + norm.float().pow(2)
    if pp_group is not None:  # each stage holds different parameters: add their squares
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_group)
    return squares.sqrt()


def scale_grads_(params: list[nn.Parameter], factor: torch.Tensor) -> None:
    """Multiply every gradient by the 0-dim tensor `factor` (no host sync)."""
    for grads in _grad_groups(params):
        torch._foreach_mul_(grads, factor.to(grads[0].device))


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The clipping coefficient min(1, max_norm / norm) as a tensor; 1 when clipping is off."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16 (GradScaler's policy), decided on the global gradient norm.

    torch.amp.GradScaler decides per rank whether gradients overflowed; under FSDP, TP
    or pipelining each rank sees a different shard, so ranks could disagree and skip
    different steps. Here the decision uses the global norm, which every rank shares.
    """

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    _good_steps: int = 0

    def loss_multiplier(self) -> float:
        return self.scale if self.enabled else 1.0

    def update(self, finite: bool) -> bool:
        """Record one step's outcome; True when the optimizer may step."""
        if not self.enabled:
            return True
        if not finite:
            self.scale, self._good_steps = max(self.scale / 2.0, 1.0), 0
            return False
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale, self._good_steps = self.scale * 2.0, 0
        return True
