"""The reference model, the token data and the corpus builder, in one process."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from meshrun.launcher.contract.spec.job import Model
from meshrun.launcher.contract.spec.modelshape import ffn_hidden, flops_per_token, param_count, part_param_count
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.launcher.data.corpus import build_corpus
from meshrun.launcher.data.dataset import Layout, Prefetcher, TokenDataset, TrainStream, val_steps
from meshrun.launcher.data.textsources import Inputs, iter_files
from meshrun.launcher.train.model import GPT, ModelPart, loss_fn

TINY = Model(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32, ffn_mult=2.6667)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A small token file (~48k tokens) from the stdlib's json package: present everywhere, stable."""
    out = tmp_path / "tokens.u16"
    build_corpus(out, roots=[Path(sysconfig.get_paths()["stdlib"]) / "json"])
    return out


# ------------------------------------------------------------------ model


def test_shapes_and_layout() -> None:
    model = GPT(TINY)
    logits = model(torch.randint(0, 256, (3, 32)))
    assert logits.shape == (3, 32, 256)
    assert list(model.layers.keys()) == ["0", "1"]
    assert ffn_hidden(TINY) == 192  # 2.6667 * 64 = 170.7 -> next multiple of 64
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()  # untied


def test_param_count_and_flops() -> None:
    model = GPT(TINY)
    d, h, v, n = 64, 192, 256, 2
    per_block = 4 * d * d + 3 * d * h + 2 * d
    assert model.num_params() == v * d + n * per_block + d + d * v
    assert model.num_params(exclude_embedding=True) == model.num_params() - v * d
    assert model.flops_per_token() == 6 * model.num_params(exclude_embedding=True) + 12 * n * d * 32
    assert param_count(TINY) == model.num_params() and flops_per_token(TINY) == model.flops_per_token()


def test_part_param_count_is_what_each_pipeline_stage_builds() -> None:
    cfg = Model(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    parts = [ModelPart.stage(cfg, stage, 2) for stage in range(2)]
    built = [sum(p.numel() for p in GPT(cfg, part=part).parameters()) for part in parts]
    assert [part_param_count(cfg, part) for part in parts] == built
    assert sum(built) == param_count(cfg)


def test_pipeline_stages_hold_exactly_the_whole_models_weights() -> None:
    cfg = Model(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    whole = dict(GPT(cfg, seed=3).named_parameters())
    stages = [GPT(cfg, seed=3, part=ModelPart.stage(cfg, s, 2)) for s in range(2)]
    assert list(stages[0].layers) == ["0", "1"] and list(stages[1].layers) == ["2", "3"]
    assert stages[0].output is None and stages[1].tok_embeddings is None
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(whole)  # stable names: checkpoints load across layouts
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, whole[name]), name  # same init whatever the layout
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](x)), GPT(cfg, seed=3)(x), rtol=0, atol=0)


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = GPT(TINY).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_init_is_deterministic_by_seed_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    assert torch.equal(torch.rand(1), before)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    grads = []
    for ckpt in (False, True):
        model = GPT(TINY, seed=3, activation_checkpointing=ckpt)
        loss_fn(model(x[:, :-1]), x[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def test_initial_loss_is_near_uniform() -> None:
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(GPT(TINY)(x[:, :-1]), x[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


# ------------------------------------------------------------------ corpus


def test_corpus_is_deterministic_and_byte_level(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "b.py").write_text("print('b')\n")
    (root / "pkg" / "a.py").write_text("x = 'é'\n")
    (root / "pkg" / "__pycache__" / "c.py").write_text("skipped\n")
    (root / "logo.png").write_bytes(b"\x89PNG")  # not a text format: skipped inside a folder
    first = build_corpus(tmp_path / "one.u16", roots=[root])
    second = build_corpus(tmp_path / "two.u16", roots=[root])
    assert first.sha256 == second.sha256 and first.sources == 2
    raw = (tmp_path / "one.u16").read_bytes()
    assert raw == (tmp_path / "two.u16").read_bytes()
    # sorted: b.py before pkg/a.py; each document ends with the bytes tokenizer's end of text (NUL)
    expected = [*b"print('b')\n", 0, *"x = 'é'\n".encode(), 0]
    assert torch.frombuffer(bytearray(raw), dtype=torch.int16).tolist() == expected
    meta = json.loads((tmp_path / "one.u16.json").read_text())
    assert meta["tokens"] == len(expected) == first.tokens and meta["sha256"] == first.sha256
    assert meta["eot_id"] == 0 and meta["vocab_size"] == 256 and meta["documents"] == 2
    assert not list(tmp_path.glob("*.tmp.*"))


def test_corpus_max_bytes_and_default_roots_exclude_site_packages(tmp_path: Path) -> None:
    stats = build_corpus(tmp_path / "std.u16", max_bytes=50_000)
    # Whole documents up to the cap (none cut), plus one end of text per document.
    assert stats.tokens == stats.text_bytes + stats.sources and 0 < stats.text_bytes <= 50_000
    assert (tmp_path / "std.u16").stat().st_size == 2 * stats.tokens
    first = next(iter_files(Inputs((sysconfig.get_paths()["stdlib"],), suffixes=(".py",))))
    assert "site-packages" not in first.parts


def test_corpus_without_text_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no .* text found"):
        build_corpus(tmp_path / "x.u16", roots=[tmp_path])
    assert not (tmp_path / "x.u16").exists()


# ------------------------------------------------------------------ data


def test_missing_file_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="meshrun data"):
        TokenDataset(tmp_path / "nope.u16", seq_len=32)


def test_split_and_windows(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32, val_fraction=0.1)
    n = len(ds.tokens)
    assert ds.val is not None and ds.val.start == n - int(n * 0.1)
    x, y = ds.batch("train", [0, 1])
    assert x.shape == y.shape == (2, 32) and x.dtype == torch.int64
    assert torch.equal(x[0, 1:], y[0, :-1])  # targets are inputs shifted by one
    last_val = ds.sample("val", ds.num_windows["val"] - 1)
    assert ds.val.start + ds.num_windows["val"] * 33 <= n and last_val.shape == (33,)
    with pytest.raises(IndexError):
        ds.sample("train", ds.num_windows["train"])


def _streams(ds: TokenDataset, dp: int, micro: int, seed: int = 0) -> list[TrainStream]:
    return [TrainStream(ds, Layout(8, micro, r, dp), seed) for r in range(dp)]


def test_dp_ranks_read_disjoint_windows_that_cover_the_global_batch(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32)
    single = _streams(ds, 1, 4)[0]
    ranks = _streams(ds, 2, 2)
    for _ in range(5):
        want = single.step_indices()
        got = [s.step_indices() for s in ranks]
        assert not set(got[0]) & set(got[1])
        assert got[0] + got[1] == want  # same global batch as one process, split in rank order
        single.next_step()
        for s in ranks:
            assert len(s.next_step()) == 2  # accumulation 8 / (2 * 2)


def test_epochs_reshuffle_and_seed_changes_order(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32)
    n = ds.num_windows["train"]
    s = _streams(ds, 1, 4)[0]
    epoch0 = [s.window_index(k) for k in range(n)]
    epoch1 = [s.window_index(k) for k in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and epoch0 != epoch1
    assert _streams(ds, 1, 4, seed=1)[0].step_indices() != s.step_indices()


def test_position_resumes_exactly_even_with_another_dp(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32)
    run = _streams(ds, 1, 4)[0]
    for _ in range(3):
        run.next_step()
    state = json.loads(json.dumps(run.state_dict()))  # what a checkpoint stores
    expected = [run.next_step() for _ in range(2)]
    resumed = _streams(ds, 1, 4)[0]
    resumed.load_state_dict(state)
    for want in [resumed.next_step() for _ in range(2)]:
        got = expected.pop(0)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))
    halves = _streams(ds, 2, 4)
    for h in halves:
        h.load_state_dict(state)
    assert halves[0].step_indices() + halves[1].step_indices() == _after(ds, state)


def _after(ds: TokenDataset, state: dict) -> list[int]:
    s = _streams(ds, 1, 4)[0]
    s.load_state_dict(state)
    return s.step_indices()


def test_resume_refuses_other_data(corpus: Path) -> None:
    state = _streams(TokenDataset(corpus, seq_len=32), 1, 4)[0].state_dict()
    other = _streams(TokenDataset(corpus, seq_len=16), 1, 4)[0]
    with pytest.raises(ValueError, match="window"):
        other.load_state_dict(state)


def test_val_steps_are_the_same_set_whatever_the_layout(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32, val_fraction=0.2)
    one = [mbs for mbs in val_steps(ds, Layout(8, 8, 0, 1), 20)]
    assert len(one) == 2 and one[0][0][0].shape == (8, 32)  # 20 windows -> 16: two global batches
    ranks = [list(val_steps(ds, Layout(8, 2, r, 2), 20)) for r in range(2)]
    for step in range(2):
        mine = [torch.cat([x for x, _ in ranks[r][step]]) for r in range(2)]
        assert all(len(mbs) == 2 and mbs[0][0].shape == (2, 32) for mbs in (ranks[0][step], ranks[1][step]))
        torch.testing.assert_close(torch.cat(mine), one[step][0][0], rtol=0, atol=0)  # disjoint, in rank order


def test_ranks_of_one_tp_and_pp_group_read_the_same_windows(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32)
    dims = ParallelDims(dp=2, tp=2, pp=2)
    seen: dict[int, list[int]] = {}
    for rank in range(8):
        c = dims.coordinates(rank)
        indices = TrainStream(ds, Layout(8, 2, c.dp, dims.dp), 0).step_indices()
        assert seen.setdefault(c.dp, indices) == indices
    assert not set(seen[0]) & set(seen[1])


def test_prefetcher_gives_the_streams_batches_and_keeps_the_position(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32)
    plain, streamed = _streams(ds, 1, 4)[0], _streams(ds, 1, 4)[0]
    streamed.consumed = plain.consumed = 16  # a resumed position
    prefetch = Prefetcher(streamed, depth=2)
    try:
        for _ in range(3):
            got, waited = prefetch.next_step()
            want = plain.next_step()
            assert waited >= 0.0 and len(got) == len(want) == 2
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
            # Read-ahead batches are not counted: a checkpoint resumes at the next untrained step.
            assert streamed.state_dict() == plain.state_dict()
    finally:
        prefetch.close()
    assert not prefetch._thread.is_alive()


def test_prefetcher_raises_read_errors_in_the_trainer(corpus: Path) -> None:
    ds = TokenDataset(corpus, seq_len=32)
    stream = _streams(ds, 1, 4)[0]
    stream.batches_at = lambda consumed: (_ for _ in ()).throw(OSError("disk gone"))  # type: ignore[method-assign]
    prefetch = Prefetcher(stream)
    try:
        with pytest.raises(OSError, match="disk gone"):
            prefetch.next_step()
    finally:
        prefetch.close()


def test_batch_must_divide(corpus: Path) -> None:
    with pytest.raises(ValueError, match=r"micro_batch\(3\)\*dp\(2\)=6"):
        Layout(8, 3, 0, 2)
