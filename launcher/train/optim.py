"""Optimizer, learning-rate schedule, the true global gradient norm, clipping and fp16 loss scaling.

The gradient norm is the one of the whole model, whatever the layout (DTensor
gradients sharded by FSDP over dp, by TP over tp, or both; pipeline stages), so every
rank holds the number a single process would compute, from one all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from meshrun.launcher.contract.spec.job import Train

try:  # a public name since torch 2.4; the private module keeps older builds working
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor, Replicate  # type: ignore[no-redef]


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


def _replication(g: torch.Tensor, plain_copies: int) -> int:
    """How many ranks hold this very gradient (shard): its local square is counted that many times.

    A DTensor is copied over the mesh dims it is Replicate on; a plain tensor over
    every rank of its pipeline stage (world / pp), since only the stages differ.
    """
    if not isinstance(g, DTensor):
        return plain_copies
    mesh = g.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())


def _settled(g: torch.Tensor) -> torch.Tensor:
    """The gradient with its Partial mesh dims summed (Replicate): partial sums' squares do not add up.

    Sequence parallelism leaves its norm weights' gradients Partial over tp (each tp rank holds the sum
    over its sequence shard): those cost one all-reduce each, and count once per tp copy afterwards.
    """
    if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
        return g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
    return g


def _spans_ranks(grads: list[torch.Tensor], pp_group: Optional[dist.ProcessGroup]) -> bool:
    """True when some rank holds a gradient another lacks: a shard, or another pipeline stage's."""
    if pp_group is not None:
        return True
    return any(isinstance(g, DTensor) and not all(p.is_replicate() for p in g.placements) for g in grads)


def global_grad_norm(
    params: list[nn.Parameter], device: torch.device, pp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model (a 0-dim fp32 tensor, the same on every rank).

    One collective (plus one per Partial gradient: sequence-parallel norm weights), whatever the layout: each
    rank sums the squares of its local
    shards, each divided by the number of ranks holding the same shard, and one
    all_reduce(SUM) over the world adds them up (the pipeline stages' too). Reducing
    each DTensor group's Partial norm instead costs one collective per group and, over a
    2-D mesh, two sequential all-reduces each.
    """
    grads = [p.grad for p in params if p.grad is not None]
    distributed = dist.is_available() and dist.is_initialized() and _spans_ranks(grads, pp_group)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for (copies, _, _), locals_ in _local_groups(grads, pp_group, distributed).items():
        norms = torch.stack(torch._foreach_norm(locals_, 2.0)).to(device=device, dtype=torch.float32)
        squares = squares + norms.pow(2).sum() / copies
    if distributed:  # every rank adds its part of the squares: one all-reduce over the world
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    return squares.sqrt()


def _local_groups(
    grads: list[torch.Tensor], pp_group: Optional[dist.ProcessGroup], distributed: bool
) -> dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]]:
    """Local shards grouped by (copies, device, dtype): one foreach norm per group.

    Not `distributed` (every rank holds every gradient whole): each counts once.
    """
    plain_copies = dist.get_world_size() // (dist.get_world_size(pp_group) if pp_group else 1) if distributed else 1
    groups: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in map(_settled, grads):
        local = g.to_local() if isinstance(g, DTensor) else g
        copies = _replication(g, plain_copies) if distributed else 1
        if local.numel():
            groups.setdefault((copies, local.device, local.dtype), []).append(local)
    return groups


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

    def state_dict(self) -> dict[str, Any]:
        """Stateful: what a checkpoint keeps of it (an exact resume continues the same growth count)."""
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])

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
