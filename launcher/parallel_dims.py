"""ParallelDims: torch-free validation of a dp x tp x pp layout.

Shared by the planner (on the caller's machine, before submission) and the
launcher (which builds the DeviceMesh from it: tp innermost, inside a node,
then dp, then pp). Messages carry the arithmetic, as torchtitan's do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Problem:
    key: str
    value: int
    fix: str


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def problem(self, world_size: int, n_layers: int, n_heads: int, ranks_per_node: int) -> Optional[Problem]:
        """The first thing wrong with this layout, or None."""
        product = f"dp({self.dp})*tp({self.tp})*pp({self.pp})={self.world_size}"
        if self.world_size != world_size:
            return Problem("parallel", self.world_size,
                           f"{product} != world size {world_size} (nodes x tasks per node); "
                           f"make the product equal the number of ranks")
        if ranks_per_node % self.tp:
            return Problem("parallel.tp", self.tp,
                           f"tensor parallelism stays inside a node: tp({self.tp}) must divide the "
                           f"{ranks_per_node} ranks per node")
        if n_layers % self.pp:
            return Problem("parallel.pp", self.pp,
                           f"pp({self.pp}) must divide train.model.n_layers({n_layers}) so stages get equal "
                           f"layers: {n_layers} % {self.pp} = {n_layers % self.pp}")
        if n_heads % self.tp:
            return Problem("parallel.tp", self.tp,
                           f"train.model.n_heads({n_heads}) must be divisible by tp({self.tp}): "
                           f"{n_heads} % {self.tp} = {n_heads % self.tp}")
        return None

    def batch_problem(self, global_batch: int, micro_batch: int) -> Optional[Problem]:
        """Megatron's rule: the global batch splits into micro-batches on every dp rank."""
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            return Problem("train.global_batch", global_batch,
                           f"must be a multiple of micro_batch({micro_batch})*dp({self.dp})={per_step} "
                           f"(accumulation = global_batch / (micro_batch*dp)); e.g. "
                           f"{max(per_step, global_batch // per_step * per_step)}")
        return None

    def validate(self, world_size: int, n_layers: int, n_heads: int, ranks_per_node: int) -> None:
        """Raise ValueError with the arithmetic when the layout does not fit."""
        found = self.problem(world_size, n_layers, n_heads, ranks_per_node)
        if found:
            raise ValueError(f"{found.key}: {found.value}: {found.fix}")
