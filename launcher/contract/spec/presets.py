"""Model-size presets (`train.model.preset: llama-7b`): the shapes of well-known models in our GPT's terms.

Torch-free (part of the contract): the planner expands a preset when it loads a spec, so the ranks read
plain shape keys in spec.json. Our GPT is Llama-shaped (RMSNorm, rotary, SwiGLU, grouped-query attention,
a head tied or not): a Llama preset keeps the original's layers, width, heads, key/value heads, SwiGLU
width, vocabulary and RoPE base, so its parameter count is the original's (llama-70b: 69.0B, llama3-8b:
8.0B). The GPT-2 sizes keep GPT-2's shapes and tied head with a SwiGLU of 4 x d_model and the vocabulary
padded to 50304 (a multiple of 64, as nanoGPT does: tp divides it); their rotary embeddings stand in
for GPT-2's learned positions. A tied head needs pp = 1 (the embedding and the head in one stage).
"""

from __future__ import annotations

from typing import Any, Mapping

SHAPE_KEYS = (
    "n_layers",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "ffn_mult",
    "vocab_size",
    "seq_len",
    "rope_theta",
    "tie_embeddings",
)
"""The train.model keys a preset sets."""

LLAMA2_THETA = 10000.0
LLAMA3_THETA = 500000.0


def _shape(
    n_layers: int,
    d_model: int,
    n_heads: int,
    ffn: int,
    vocab: int,
    seq: int,
    *,
    kv_heads: int = 0,
    theta: float = LLAMA2_THETA,
    tied: bool = False,
) -> dict[str, Any]:
    """A preset from the original's SwiGLU width `ffn` (ffn_mult = ffn / d_model reproduces it exactly);
    kv_heads 0 is full multi-head attention (kept 0, not n_heads, so an explicit n_heads stays valid)."""
    return {
        "n_layers": n_layers,
        "d_model": d_model,
        "n_heads": n_heads,
        "n_kv_heads": kv_heads,
        "ffn_mult": ffn / d_model,
        "vocab_size": vocab,
        "seq_len": seq,
        "rope_theta": theta,
        "tie_embeddings": tied,
    }


PRESETS: Mapping[str, Mapping[str, Any]] = {
    "gpt2-small": _shape(12, 768, 12, 3072, 50304, 1024, tied=True),
    "gpt2-medium": _shape(24, 1024, 16, 4096, 50304, 1024, tied=True),
    "gpt2-large": _shape(36, 1280, 20, 5120, 50304, 1024, tied=True),
    "gpt2-xl": _shape(48, 1600, 25, 6400, 50304, 1024, tied=True),
    "llama-1b": _shape(22, 2048, 32, 5632, 32000, 2048, kv_heads=4),  # TinyLlama-1.1B's shape
    "llama-7b": _shape(32, 4096, 32, 11008, 32000, 4096),
    "llama-13b": _shape(40, 5120, 40, 13824, 32000, 4096),
    "llama-70b": _shape(80, 8192, 64, 28672, 32000, 4096, kv_heads=8),
    "llama3-8b": _shape(32, 4096, 32, 14336, 128256, 8192, kv_heads=8, theta=LLAMA3_THETA),
    "llama3-70b": _shape(80, 8192, 64, 28672, 128256, 8192, kv_heads=8, theta=LLAMA3_THETA),
}
"""Preset name -> the train.model keys it sets (explicit keys in the spec win; see submit/planning/plan.py)."""


def preset(name: str) -> Mapping[str, Any]:
    """The shape keys of a preset; KeyError for an unknown name (the planner words the error)."""
    return PRESETS[name]
