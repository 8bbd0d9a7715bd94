"""ParallelDims: torch-free validation of a dp x tp x pp layout.

Shared by the planner (on the caller's machine, before submission) and the
launcher (which builds the DeviceMesh from it: tp innermost, inside a node,
then dp, then pp). Messages carry the arithmetic, as torchtitan's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

MESH_DIMS = ("pp", "dp", "tp")
"""DeviceMesh dimension names, outermost first: consecutive ranks (one node) share a tp group."""


@dataclass(frozen=True)
class Problem:
    key: str
    value: Union[int, str]
    fix: str


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in the ("pp", "dp", "tp") mesh."""

    pp: int
    dp: int
    tp: int


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

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh sizes in MESH_DIMS order."""
        return (self.pp, self.dp, self.tp)

    def coordinates(self, rank: int) -> Coordinates:
        """This rank's (pp, dp, tp) indices: row-major over MESH_DIMS, as init_device_mesh lays them out."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside dp({self.dp})*tp({self.tp})*pp({self.pp})={self.world_size}")
        return Coordinates(pp=rank // (self.dp * self.tp), dp=rank // self.tp % self.dp, tp=rank % self.tp)

    def problem(
        self,
        world_size: int,
        n_layers: int,
        n_heads: int,
        ranks_per_node: int,
        *,
        vocab_size: int = 0,
        seq_len: int = 0,
        sequence_parallel: bool = False,
        n_kv_heads: int = 0,
        tie_embeddings: bool = False,
    ) -> Optional[Problem]:
        """The first thing wrong with this layout, or None.

        The keyword arguments are optional so older callers keep working: vocab_size > 0 checks that
        tp splits the embedding and the head; sequence_parallel checks that tp splits seq_len;
        n_kv_heads > 0 checks that tp splits the key/value heads; tie_embeddings checks that one
        stage holds both the embedding and the head (pp = 1).
        """
        product = f"dp({self.dp})*tp({self.tp})*pp({self.pp})={self.world_size}"
        for key, value in (("parallel.dp", self.dp), ("parallel.tp", self.tp), ("parallel.pp", self.pp)):
            if value < 1:
                return Problem(key, value, "every parallel degree is at least 1")
        if self.world_size != world_size:
            return Problem(
                "parallel",
                f"dp={self.dp} tp={self.tp} pp={self.pp}",
                f"{product} != world size {world_size} (nodes x tasks per node); "
                f"make the product equal the number of ranks",
            )
        if ranks_per_node % self.tp:
            return Problem(
                "parallel.tp",
                self.tp,
                f"tensor parallelism stays inside a node: tp({self.tp}) must divide the "
                f"{ranks_per_node} ranks per node",
            )
        if n_layers % self.pp:
            return Problem(
                "parallel.pp",
                self.pp,
                f"pp({self.pp}) must divide train.model.n_layers({n_layers}) so stages get equal "
                f"layers: {n_layers} % {self.pp} = {n_layers % self.pp}",
            )
        if n_heads % self.tp:
            return Problem(
                "parallel.tp",
                self.tp,
                f"train.model.n_heads({n_heads}) must be divisible by tp({self.tp}): "
                f"{n_heads} % {self.tp} = {n_heads % self.tp}",
            )
        if n_kv_heads and n_kv_heads % self.tp:
            return Problem(
                "parallel.tp",
                self.tp,
                f"train.model.n_kv_heads({n_kv_heads}) must be divisible by tp({self.tp}) (each tp rank holds "
                f"whole key/value heads): {n_kv_heads} % {self.tp} = {n_kv_heads % self.tp}; "
                f"use a tp that divides {n_kv_heads}",
            )
        if tie_embeddings and self.pp > 1:
            return Problem(
                "parallel.pp",
                self.pp,
                "train.model.tie_embeddings shares one matrix between the first stage's embedding and the last "
                "stage's head; use pp 1 or set train.model.tie_embeddings: false",
            )
        if vocab_size and vocab_size % self.tp:
            return Problem(
                "parallel.tp",
                self.tp,
                f"train.model.vocab_size({vocab_size}) must be divisible by tp({self.tp}) "
                f"(the embedding and the head split over tp): {vocab_size} % {self.tp} = "
                f"{vocab_size % self.tp}",
            )
        if sequence_parallel and self.tp > 1 and seq_len % self.tp:
            return Problem(
                "parallel.sequence_parallel",
                True,
                f"sequence parallelism splits train.model.seq_len({seq_len}) over tp({self.tp}): "
                f"{seq_len} % {self.tp} = {seq_len % self.tp}; pick a seq_len divisible by tp "
                f"or set sequence_parallel: false",
            )
        return None

    def fsdp_wraps(self, dp_mode: str) -> bool:
        """True when FSDP2 (fully_shard, or replicate under tp/pp) wraps the model, and so applies the mixed
        precision policy (16-bit parameters); otherwise autocast does (dp = 1, or torch DDP). The trainer
        (launcher/train/engines/native.py) and the planner's activation bytes (submit/planning/estimate.py) both follow this."""
        return self.dp > 1 and (dp_mode == "fsdp" or self.tp > 1 or self.pp > 1)

    def batch_problem(self, global_batch: int, micro_batch: int) -> Optional[Problem]:
        """Megatron's rule: the global batch splits into micro-batches on every dp rank.

        With pp > 1 the accumulation micro-batches are the pipeline's micro-batches, and a
        pipeline needs at least pp of them (1F1B refuses fewer; GPipe would be all bubble).
        """
        per_step = micro_batch * self.dp
        if global_batch % per_step:
            return Problem(
                "train.global_batch",
                global_batch,
                f"must be a multiple of micro_batch({micro_batch})*dp({self.dp})={per_step} "
                f"(accumulation = global_batch / (micro_batch*dp)); e.g. "
                f"{max(per_step, global_batch // per_step * per_step)}",
            )
        accumulation = global_batch // per_step
        if self.pp > 1 and accumulation < self.pp:
            return Problem(
                "train.global_batch",
                global_batch,
                f"gives {accumulation} micro-batch(es) per step (global_batch / (micro_batch({micro_batch})"
                f"*dp({self.dp}))), fewer than the pp({self.pp}) pipeline stages; use a global_batch "
                f"of at least {per_step * self.pp} or a smaller micro_batch",
            )
        return None

    def validate(self, world_size: int, n_layers: int, n_heads: int, ranks_per_node: int) -> None:
        """Raise ValueError with the arithmetic when the layout does not fit."""
        found = self.problem(world_size, n_layers, n_heads, ranks_per_node)
        if found:
            raise ValueError(f"{found.key}: {found.value}: {found.fix}")
