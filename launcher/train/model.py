"""GPT reference model, Llama-style: RMSNorm, rotary embeddings, causal SDPA with optional grouped-query
attention (n_kv_heads), SwiGLU, a head optionally tied to the embedding.

Laid out for the parallel code (torchtitan's shape): blocks live in `layers`, an
nn.ModuleDict keyed by their global index, so a pipeline stage builds only the
blocks it owns (`ModelPart`) with stable parameter names (checkpoints load across
layouts); the stage that lacks the embedding or the head holds None there and the
forward passes hidden states through. Q/K/V and the MLP projections are separate
Linear layers so tensor parallelism can shard them column/row-wise.

Every parameter draws its initial values from its own generator, seeded by (seed,
parameter name): a stage that builds two of eight blocks gets exactly the values the
whole model has there, so any layout starts from the same weights.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshrun.launcher.contract.spec.job import Model as ModelConfig
from meshrun.launcher.contract.spec.modelshape import ModelPart, ffn_hidden, flops_per_token

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: under bf16 autocast the mean of squares loses too many bits.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (seq_len, head_dim), for the rotate-half form of rotary embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    t = x.shape[-2]
    return (x * cos[:t] + rotated * sin[:t]).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        kv_dim = cfg.kv_heads * self.head_dim  # grouped-query attention: fewer key/value heads than queries
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not n_heads: under tensor parallelism each rank holds only its share of the heads.
        return x.view(b, t, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = apply_rope(self._heads(self.wq(x)), cos, sin)
        k = apply_rope(self._heads(self.wk(x)), cos, sin)
        v = self._heads(self.wv(x))
        # Each key/value head serves n_heads / n_kv_heads consecutive query heads (Llama's repeat_kv);
        # the ratio is the same on every tensor-parallel rank, which holds its share of both.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        b, _, t, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden(cfg)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(
        self, cfg: ModelConfig, seed: int = 0, activation_checkpointing: bool = False, part: Optional[ModelPart] = None
    ) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
            raise ValueError(
                f"train.model.d_model: {cfg.d_model}: must split into n_heads({cfg.n_heads}) "
                "heads of an even size (rotary embeddings rotate pairs)"
            )
        self.cfg = cfg
        self.part = part or ModelPart.whole(cfg)
        self.activation_checkpointing = activation_checkpointing
        # The layers' default init draws from the global RNG; fork it so building a model
        # never shifts what later code (data order, dropout) draws. init_weights sets the values.
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings: Optional[nn.Embedding] = (
                nn.Embedding(cfg.vocab_size, cfg.d_model) if self.part.embed else None
            )
            self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(self.part.first_layer, self.part.end_layer)})
            self.norm: Optional[RMSNorm] = RMSNorm(cfg.d_model) if self.part.head else None
            self.output: Optional[nn.Linear] = (
                nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if self.part.head else None
            )
        if cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            # One matrix, two uses: named once (tok_embeddings.weight) by named_parameters, so it is
            # initialised, optimised and counted once.
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded init, one private generator per parameter (by name): layout-independent values."""
        # Residual projections scaled by depth (GPT-2): keeps the residual stream's variance flat.
        residual_std = INIT_STD / math.sqrt(2 * max(self.cfg.n_layers, 1))
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
            # crc32, not hash(): str hashes are salted per process, and every rank must agree.
            key = (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF
            gen = torch.Generator(param.device).manual_seed(key)
            nn.init.normal_(param, std=std, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); a middle pipeline stage takes and gives hidden states."""
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than seq_len {self.cfg.seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            if self.activation_checkpointing and self.training:
                h = checkpoint(block, h, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                h = block(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters this module holds (its stage's share under pipelining; global sizes under TP/FSDP)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token of the whole model (see `flops_per_token`)."""
        return flops_per_token(self.cfg)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the autocast dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
