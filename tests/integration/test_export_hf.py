"""`export --format hf` and `train.init_from`, against transformers itself.

The checkpoints are real: DCP shards and a committed marker, made here as the native engine makes them
(one process), or by real ranks training on the corpus. transformers' LlamaForCausalLM loads the export
and gives meshrun's logits; the export's tokenizer is transformers' fast tokenizer of the same file;
a run started from the export (another layout: tensor parallel) has the trained run's validation loss.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec import schema, weights
from meshrun.launcher.contract.spec.job import Checkpoint, Data, JobSpec, Model, Parallel, Train
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.export import run as export
from meshrun.launcher.train.model import GPT
from tests.helpers.ranks import finish, make_run, metrics, start, tiny_train


def transformers() -> Any:
    """transformers (a dev requirement), imported by the tests that use it: at the module's top it was imported
    by every pytest worker's collection (~0.7 s of CPU each)."""
    import transformers as module

    return module


GQA_TIED = Model(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, tie_embeddings=True, seq_len=32, rope_theta=5e5)
UNTIED = Model(n_layers=2, d_model=64, n_heads=4, seq_len=32)


def saved_checkpoint(root: Path, cfg: Model, data_path: str = "/nonexistent/tokens.u16") -> GPT:
    """A complete step-3 checkpoint under `root` of a GPT whose weights are not the init's; returns the GPT."""
    job = JobSpec(name="hf", train=Train(model=cfg, seed=1), data=Data(path=data_path))
    model = GPT(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norms too: a transposed or misnamed tensor must show
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    tmp = ckptdir.step_dir(root, 3).with_suffix(".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp), no_dist=True)
    marker_job = {k: v for k, v in schema.to_plain(job).items() if k != "env"}
    ckptdir.commit(tmp, ckptdir.step_dir(root, 3), {"step": 3, "job": marker_job})
    return model


@pytest.mark.parametrize("cfg", [GQA_TIED, UNTIED], ids=["gqa-tied", "untied"])
def test_hf_export_gives_transformers_the_same_logits(tmp_path: Path, cfg: Model) -> None:
    model = saved_checkpoint(tmp_path / "ck", cfg)
    out = tmp_path / "hf"
    # A small shard limit: several files and their index, as a large model gets.
    assert export.main([str(tmp_path / "ck"), str(out), "--format", "hf", "--max-shard-size", "60KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert ("lm_head.weight" in index["weight_map"]) is not cfg.tie_embeddings
    hf = transformers().LlamaForCausalLM.from_pretrained(str(out)).eval()
    assert hf.config.num_key_value_heads == cfg.kv_heads and hf.config.tie_word_embeddings == cfg.tie_embeddings
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    # The meshrun format, streamed too, holds the state dict exactly.
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "m.safetensors")]) == 0
    from safetensors.torch import load_file

    flat = load_file(str(tmp_path / "m.safetensors"))
    assert flat.keys() == model.state_dict().keys()
    assert all(torch.equal(flat[k], v) for k, v in model.state_dict().items())


def test_hf_export_carries_the_tokenizer_and_refuses_a_foreign_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(["def export(path, out):\n    return path\n"] * 50, trainer)
    data = tmp_path / "text.u16"
    data.write_bytes(b"\0\0")
    tok.save(str(tmp_path / "text.tokenizer.json"))
    record = {"vocab_size": tok.get_vocab_size(), "eot_id": 0, "tokenizer": "text.tokenizer.json"}
    (tmp_path / "text.u16.json").write_text(json.dumps(record))
    saved_checkpoint(
        tmp_path / "ck", Model(n_layers=1, d_model=32, n_heads=2, vocab_size=tok.get_vocab_size()), str(data)
    )
    out = tmp_path / "hf"
    assert export.main([str(tmp_path / "ck"), str(out), "--format", "hf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    fast = transformers().AutoTokenizer.from_pretrained(str(out))
    text = "def export(out):"
    assert fast(text)["input_ids"] == tok.encode(text).ids and fast.eos_token == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    assert export.main([str(tmp_path / "ck"), str(out), "--format", "hf"]) == 0  # an earlier export: replaced
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "ck"), "--format", "hf"]) == 2  # not an export


def test_init_from_shape_check_names_the_first_mismatching_tensor(tmp_path: Path) -> None:
    saved_checkpoint(tmp_path / "ck", GQA_TIED)
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "m.safetensors")]) == 0

    def job(path: Path, **model: object) -> JobSpec:
        cfg = schema.load(Model, {**schema.to_plain(GQA_TIED), **model})
        return JobSpec(name="init", train=Train(model=cfg, init_from=str(path)), data=Data(path=str(tmp_path / "none")))

    for path in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors", tmp_path / "m.safetensors"):
        weights.check_init_from(job(path))  # the export fits the model it came from, in both namings
    with pytest.raises(SchemaError) as wrong:
        weights.check_init_from(job(tmp_path / "hf", n_kv_heads=4))
    assert wrong.value.key == "train.init_from"
    assert "model.layers.0.self_attn.k_proj.weight has shape [32, 64] in the file, train.model needs [64, 64]" in str(
        wrong.value
    )
    with pytest.raises(SchemaError, match="tensor layers.2.attention_norm.weight is missing"):
        weights.check_init_from(job(tmp_path / "m.safetensors", n_layers=3))
    with pytest.raises(
        SchemaError, match=r"tensor model.layers.1.input_layernorm.weight is not in train.model \(9 extra"
    ):
        weights.check_init_from(job(tmp_path / "hf", n_layers=1))
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(SchemaError, match="not a readable safetensors file"):
        weights.check_init_from(job(tmp_path / "bad.safetensors"))


def test_init_from_an_hf_export_starts_another_layout_at_the_trained_loss(tmp_path: Path, corpus: Path) -> None:
    cfg = Model(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, tie_embeddings=True, seq_len=64)
    trained = make_run(tmp_path, "trained", corpus, 2, train=tiny_train(model=cfg, steps=10, eval_every=10))
    finish(start(trained, 2))
    out = tmp_path / "hf"
    assert export.main([str(trained / "checkpoints"), str(out), "--format", "hf"]) == 0
    # lr 1e-12 (a spec's lr must be positive): the weights stay the export's to far below the tolerance, so every
    # validation is the trained model's, under tensor parallel.
    frozen = tiny_train(model=cfg, steps=2, eval_every=1, lr=1e-12, min_lr=0.0, init_from=str(out))
    tuned = make_run(tmp_path, "tuned", corpus, 2, train=frozen, parallel=Parallel(dp=1, tp=2), checkpoint=Checkpoint())
    outputs = finish(start(tuned, 2))
    assert f"initialised 20 tensors from {out} (Hugging Face Llama naming)" in outputs[0]
    want = [r["val_loss"] for r in metrics(trained) if "val_loss" in r][-1]
    got = [r["val_loss"] for r in metrics(tuned) if "val_loss" in r]
    assert got[0] == pytest.approx(want, abs=1e-5) and got[1] == pytest.approx(want, abs=1e-5)
    assert want < math.log(cfg.vocab_size) - 0.2  # trained: a fresh init would sit near log(vocab)
