"""The model options (grouped-query attention, a tied head, the RoPE base) in one process: the
model computes what they mean, and the planner's shapes (launcher/contract/spec/modelshape.py, the presets) are the built
model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshrun.launcher.contract.spec.job import Model
from meshrun.launcher.contract.spec.modelshape import flops_per_token, param_count, part_param_count
from meshrun.launcher.contract.spec.presets import PRESETS
from meshrun.launcher.contract.spec.schema import SchemaError, load
from meshrun.launcher.train.model import GPT, ModelPart, rope_tables

GQA = Model(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256, seq_len=32)
TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def test_gqa_equals_full_attention_with_each_kv_head_repeated_for_its_query_heads() -> None:
    """Llama's repeat_kv: key/value head j serves query heads j*g .. j*g+g-1 (g = n_heads / n_kv_heads)."""
    gqa = GPT(GQA, seed=1).eval()
    full = GPT(Model(**{**vars(GQA), "n_kv_heads": 0}), seed=1).eval()
    head_dim, group = 16, 2
    state = gqa.state_dict()
    for name, tensor in gqa.state_dict().items():
        if name.endswith(("wk.weight", "wv.weight")):
            assert tensor.shape == (2 * head_dim, 64)  # kv_heads x head_dim rows
            heads = tensor.view(2, head_dim, 64)
            state[name] = heads.repeat_interleave(group, dim=0).reshape(4 * head_dim, 64)
    full.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(gqa(TOKENS), full(TOKENS), rtol=1e-5, atol=1e-5)
        # and the grouping matters: pairing each kv head with other query heads changes the output
        for name in state:
            if name.endswith(("wk.weight", "wv.weight")):
                state[name] = gqa.state_dict()[name].view(2, head_dim, 64).repeat(group, 1, 1).reshape(-1, 64)
        full.load_state_dict(state)
        assert not torch.allclose(gqa(TOKENS), full(TOKENS), atol=1e-3)


def test_a_tied_model_has_one_matrix_for_embedding_and_head() -> None:
    cfg = Model(**{**vars(GQA), "tie_embeddings": True})
    model = GPT(cfg, seed=1)
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert {"tok_embeddings.weight", "output.weight"} <= set(model.state_dict())  # both names load and save
    untied = GPT(GQA, seed=1)
    assert model.num_params() == untied.num_params() - 256 * 64 == param_count(cfg)
    # one optimizer step moves both uses together: the head's gradient lands on the embedding's matrix
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(TOKENS).float().pow(2).mean().backward()
    optimizer.step()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.grad is not None
    only_rows = torch.zeros(256, dtype=torch.bool)
    only_rows[TOKENS.unique()] = True
    # rows of tokens never seen get a gradient too: from the head, which scores every token
    assert model.tok_embeddings.weight.grad[~only_rows].abs().sum() > 0


def test_a_tied_head_stays_untied_when_a_pipeline_splits_it_from_the_embedding() -> None:
    """pp > 1 is refused for tied models (ParallelDims); the stages themselves still build valid parts."""
    cfg = Model(**{**vars(GQA), "tie_embeddings": True})
    parts = [ModelPart.stage(cfg, s, 2) for s in range(2)]
    built = [sum(p.numel() for p in GPT(cfg, part=part).parameters()) for part in parts]
    assert [part_param_count(cfg, part) for part in parts] == built


def test_rope_theta_changes_the_tables_and_the_logits_but_not_position_0() -> None:
    cos_a, sin_a = rope_tables(32, 16, 10000.0)
    cos_b, sin_b = rope_tables(32, 16, 500000.0)
    assert torch.equal(cos_a[0], cos_b[0]) and torch.equal(sin_a[0], sin_b[0])  # angle 0 whatever the base
    assert not torch.allclose(cos_a[1:], cos_b[1:])
    # the slowest pair turns by position / theta^((d-2)/d): a larger base, a slower turn
    assert sin_b[1, 7] < sin_a[1, 7]
    a = GPT(GQA, seed=1).eval()
    b = GPT(Model(**{**vars(GQA), "rope_theta": 500000.0}), seed=1).eval()
    assert [n for n, _ in a.state_dict().items()] == [n for n, _ in b.state_dict().items()]  # no saved tables
    with torch.no_grad():
        la, lb = a(TOKENS), b(TOKENS)
    torch.testing.assert_close(la[:, 0], lb[:, 0])  # the first token attends only to itself
    assert not torch.allclose(la[:, 1:], lb[:, 1:], atol=1e-4)


def _small(preset: dict[str, Any]) -> Model:
    """A preset at a small scale: its layout (kv heads, tie, SwiGLU ratio, theta), head size 8, 2 layers."""
    return Model(**{**preset, "n_layers": 2, "d_model": 8 * preset["n_heads"], "vocab_size": 128, "seq_len": 16})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_planner_counts_are_the_built_models_numel_for_every_preset_shape(name: str) -> None:
    cfg = _small(dict(PRESETS[name]))
    model = GPT(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters()) == model.num_params()
    head = cfg.d_model * cfg.vocab_size
    assert flops_per_token(cfg) == 6 * (
        model.num_params(exclude_embedding=True) + (head if cfg.tie_embeddings else 0)
    ) + (12 * cfg.n_layers * cfg.d_model * cfg.seq_len)  # the tied head is still a matmul per token


@pytest.mark.parametrize(
    "name, billions, kv_heads, theta, tied",
    [
        ("llama-1b", 1.100, 4, 10000.0, False),
        ("llama-7b", 6.738, 32, 10000.0, False),
        ("llama-13b", 13.016, 40, 10000.0, False),
        ("llama-70b", 68.977, 8, 10000.0, False),
        ("llama3-8b", 8.030, 8, 500000.0, False),
        ("llama3-70b", 70.554, 8, 500000.0, False),
        ("gpt2-small", 0.152, 12, 10000.0, True),
    ],
)
def test_presets_have_the_originals_shapes_and_parameter_counts(
    name: str, billions: float, kv_heads: int, theta: float, tied: bool
) -> None:
    """The published counts (Llama 2 paper, Meta's model cards; TinyLlama's 1.1B)."""
    cfg = Model(**PRESETS[name])
    assert (cfg.kv_heads, cfg.rope_theta, cfg.tie_embeddings) == (kv_heads, theta, tied)
    assert param_count(cfg) / 1e9 == pytest.approx(billions, abs=5e-4)


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"n_heads": 4, "n_kv_heads": 3}, "train.model.n_kv_heads"),
        ({"n_heads": 4, "n_kv_heads": -1}, "train.model.n_kv_heads"),
        ({"rope_theta": 1.0}, "train.model.rope_theta"),
    ],
)
def test_bad_model_options_name_the_key_and_the_fix(fields: dict[str, Any], key: str) -> None:
    with pytest.raises(SchemaError) as info:
        load(Model, fields, "train.model")  # as a spec's train.model section is read
    assert info.value.key == key and info.value.fix
