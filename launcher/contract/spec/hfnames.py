"""meshrun's GPT in Hugging Face Llama's terms: tensor names, shapes and config.json, from the model config alone.

Torch-free and stdlib-only: the export writes with it, and the planner, the ranks (train.init_from) and the
export read with it. The GPT is Llama's architecture tensor for tensor (RMSNorm eps 1e-5, rotate-half
rotary embeddings, SwiGLU with w1 = gate, w3 = up, w2 = down, grouped-query attention, an optional tied
head), so the map is a renaming: no tensor is permuted, split or fused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from meshrun.launcher.contract.spec.job import Model
from meshrun.launcher.contract.spec.modelshape import ffn_hidden, kv_dim

RMS_NORM_EPS = 1e-5
"""meshrun.launcher.train.model.RMSNorm's eps (config.json's rms_norm_eps)."""

_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
HEAD, HF_HEAD = "output.weight", "lm_head.weight"
"""The output head's names; a tied head has no tensor of its own in Hugging Face's files."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_MESHRUN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FROM_HF_BLOCK = {hf: ours for ours, hf in _BLOCK.items()}
_FROM_HF_TOP = {hf: ours for ours, hf in _TOP.items()} | {HF_HEAD: HEAD}


def meshrun_shapes(cfg: Model) -> dict[str, tuple[int, ...]]:
    """Every tensor of the GPT's state dict and its shape, in file order (output.weight even when tied:
    the state dict names the shared matrix twice)."""
    d, hidden, kv = cfg.d_model, ffn_hidden(cfg), kv_dim(cfg)
    block = {
        "attention_norm.weight": (d,),
        "attention.wq.weight": (d, d),
        "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, d),
        "ffn_norm.weight": (d,),
        "feed_forward.w1.weight": (hidden, d),
        "feed_forward.w3.weight": (hidden, d),
        "feed_forward.w2.weight": (d, hidden),
    }
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in block.items()})
    shapes["norm.weight"] = (d,)
    shapes[HEAD] = (cfg.vocab_size, d)
    return shapes


def to_hf(name: str) -> str:
    """A GPT tensor's name in Hugging Face Llama's naming (output.weight -> lm_head.weight)."""
    layer = _MESHRUN_LAYER.match(name)
    if layer is not None:
        return f"model.layers.{layer.group(1)}.{_BLOCK[layer.group(2)]}"
    return HF_HEAD if name == HEAD else _TOP[name]


def from_hf(name: str) -> Optional[str]:
    """A Hugging Face Llama tensor's name in the GPT's naming; None for a name the GPT has no tensor for."""
    layer = _HF_LAYER.match(name)
    if layer is not None:
        ours = _FROM_HF_BLOCK.get(layer.group(2))
        return None if ours is None else f"layers.{layer.group(1)}.{ours}"
    return _FROM_HF_TOP.get(name)


def is_hf(names: list[str]) -> bool:
    """Whether a file's tensors are in Hugging Face naming (every Llama tensor but the head starts `model.`)."""
    return any(name.startswith("model.") for name in names)


def hf_shapes(cfg: Model) -> dict[str, tuple[int, ...]]:
    """The tensors of a Hugging Face export of a model with this config (no lm_head when tied)."""
    shapes = {to_hf(name): shape for name, shape in meshrun_shapes(cfg).items()}
    if cfg.tie_embeddings:
        del shapes[HF_HEAD]
    return shapes


def hf_config(cfg: Model, torch_dtype: str, eos_token_id: Optional[int] = None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with this model's shape (rope_theta under both the old key and
    transformers 5's rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": ffn_hidden(cfg),
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": torch_dtype,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "use_cache": True,
    }


def replaceable_folder(out: Path) -> bool:
    """Whether `export --format hf` may write OUT: it does not exist, is an empty folder, or is an earlier
    export (its config.json names LlamaForCausalLM), which is replaced whole. Anything else is the user's."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    try:
        return not any(out.iterdir()) or "LlamaForCausalLM" in (out / "config.json").read_text()
    except OSError:
        return False


def parse_size(text: str) -> int:
    """'5GB' (10^9, as Hugging Face counts), '500MiB', '1000000' -> bytes; ValueError names the forms."""
    match = _SIZE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is no size; give e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
