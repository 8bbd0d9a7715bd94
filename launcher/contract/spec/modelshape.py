"""The GPT's shape from its config alone: parameter counts (whole, or one pipeline stage's), training FLOPs.

Torch-free (part of the contract submit may import): the planner (`meshrun plan`) sizes models with the
same numbers the trainer reports, and launcher/train/model.py builds exactly these parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.job import Model as ModelConfig


def ffn_hidden(cfg: ModelConfig) -> int:
    """SwiGLU hidden size: ffn_mult * d_model rounded up to a multiple of 64 (tensor-core friendly)."""
    return int(math.ceil(cfg.ffn_mult * cfg.d_model / 64) * 64)


def kv_dim(cfg: ModelConfig) -> int:
    """Width of the key and value projections: kv_heads x head size (d_model under full multi-head attention)."""
    return cfg.kv_heads * (cfg.d_model // cfg.n_heads)


def head_param_count(cfg: ModelConfig) -> int:
    """Parameters the output head adds: none when tied (it is the embedding's matrix), else d_model x vocab."""
    return 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size


def param_count(cfg: ModelConfig, exclude_embedding: bool = False) -> int:
    """Parameters of the whole model, from the config alone (no model needed: MFU, planning); a tied head's
    matrix is the embedding's, counted once (as GPT.num_params does)."""
    d, v = cfg.d_model, cfg.vocab_size
    embedding = 0 if exclude_embedding else v * d
    return embedding + cfg.n_layers * block_param_count(cfg) + d + head_param_count(cfg)  # + final norm + head


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token (forward + backward): 6N + 12*L*d*T (PaLM/Megatron).

    N excludes the embedding table (a lookup, not a matmul) but keeps the head's matmul,
    tied or not; the second term is attention's QK^T and AV over the full sequence (over the
    query heads, so grouped-query attention does not change it).
    """
    matmul = param_count(cfg, exclude_embedding=True) + (cfg.d_model * cfg.vocab_size if cfg.tie_embeddings else 0)
    return 6 * matmul + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def layer_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token of one block: its share of `flops_per_token` (6 x its parameters + attention's 12 d T)."""
    return 6 * block_param_count(cfg) + 12 * cfg.d_model * cfg.seq_len


def layer_elements(cfg: ModelConfig, micro_batch: int, tp: int = 1) -> int:
    """Values one block's element-wise work passes over per micro-batch (norms, activations, residuals: T b d; the
    attention scores' softmax: T^2 b heads, the heads split over tp ranks): what the memory-bound part of a block's
    time on a CPU grows with (the planner's CPU term, calibrated by doctor)."""
    tokens = cfg.seq_len * micro_batch
    return tokens * cfg.d_model + tokens * cfg.seq_len * cfg.n_heads // tp


@dataclass(frozen=True)
class ModelPart:
    """Which pieces of the model one rank builds: a pipeline stage, or the whole model."""

    first_layer: int
    """Global index of the first block built."""
    end_layer: int
    """One past the last block built."""
    embed: bool = True
    """Build the token embedding (the first stage)."""
    head: bool = True
    """Build the final norm and the output head (the last stage)."""

    @staticmethod
    def whole(cfg: ModelConfig) -> ModelPart:
        return ModelPart(0, cfg.n_layers)

    @staticmethod
    def stage(cfg: ModelConfig, stage: int, stages: int) -> ModelPart:
        """Stage `stage` of `stages` equal stages (stages divides n_layers; ParallelDims checks)."""
        per = cfg.n_layers // stages
        return ModelPart(stage * per, (stage + 1) * per, embed=stage == 0, head=stage == stages - 1)


def block_param_count(cfg: ModelConfig) -> int:
    """Parameters of one transformer block: q and o (d x d), k and v (d x kv_dim: smaller under grouped-query
    attention); w1, w2, w3; two norms."""
    d, h = cfg.d_model, ffn_hidden(cfg)
    return 2 * d * d + 2 * d * kv_dim(cfg) + 3 * d * h + 2 * d


def part_param_count(cfg: ModelConfig, part: ModelPart) -> int:
    """Parameters one model part builds: its blocks, plus the embedding (first stage) and the final norm and
    head (last stage); a tied head adds no matrix (tying needs both ends in one part: pp = 1)."""
    d, v = cfg.d_model, cfg.vocab_size
    blocks = (part.end_layer - part.first_layer) * block_param_count(cfg)
    tied = cfg.tie_embeddings and part.embed and part.head
    return blocks + (v * d if part.embed else 0) + ((d + (0 if tied else d * v)) if part.head else 0)


@dataclass(frozen=True)
class StageBytes:
    """Model-state bytes one rank of a pipeline stage holds: the planner's estimate (submit/planning/estimate.py) and the
    mesh dry run's count (launcher/probes/meshcount.py) are both lists of these, one per stage."""

    stage: int
    """Pipeline stage."""
    params: int
    """Bytes of parameters one rank of this stage holds (model state, not transient gathers)."""
    grads: int
    """Bytes of gradients it holds at the optimizer step (ZeRO-1: the backward's full set, its peak)."""
    optimizer: int
    """Bytes of optimizer state (+ fp32 master copies where the engine keeps extra ones)."""


CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint holds each parameter in fp32 and Adam's two fp32 moments."""
MIN_FREE_BYTES = 1 << 30


def checkpoint_space_needed(job: JobSpec) -> int:
    """Free bytes a job's checkpoint folders need: the spec's `resilience.min_free_gb`, else two checkpoints of
    the model (one being written beside the newest complete one), at least 1 GiB. The health gate checks it on
    every node, the submit's preflight on the checkpoint root."""
    given = job.resilience.min_free_gb
    if given > 0:
        return int(given * 1e9)
    if job.train is None:  # a command job: its checkpoints are its own business
        return MIN_FREE_BYTES
    return max(MIN_FREE_BYTES, 2 * CHECKPOINT_BYTES_PER_PARAM * param_count(job.train.model))
