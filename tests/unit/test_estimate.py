"""The planner's memory and time model (submit/planning/estimate.py) against published figures and measured ones."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from meshrun.launcher.contract.spec.job import JobSpec, Model, Parallel, Resources, Train
from meshrun.launcher.contract.spec.modelshape import flops_per_token, param_count
from meshrun.submit.planning import estimate, steptime
from meshrun.submit.planning.estimate import megatron_layer_activations, memory_per_gpu, model_state_bytes
from meshrun.submit.planning.steptime import Hardware, step_time

LLAMA7B = Model(n_layers=32, d_model=4096, n_heads=32, vocab_size=32000, seq_len=4096, ffn_mult=2.6875)
H100 = Hardware(peak_tflops=989, memory_gbs=3350, gpus_per_node=8, nvlink_gbytes_s=360, ib_gbytes_s=45)


def job(model: Model = LLAMA7B, nodes: int = 1, precision: str = "bf16", engine: str = "native", **kw: Any) -> JobSpec:
    train_keys = {"global_batch", "micro_batch", "activation_checkpointing"}
    train = {k: kw.pop(k) for k in list(kw) if k in train_keys}
    train.setdefault("global_batch", 64)
    train.setdefault("micro_batch", 1)
    return JobSpec(
        name="t",
        resources=Resources(nodes=nodes, gpus_per_node=8),
        parallel=Parallel(**kw),
        train=Train(model=model, precision=precision, engine=engine, **train),  # type: ignore[arg-type]
    )


def per_param(spec: JobSpec) -> float:
    """Model-state bytes per parameter on one GPU (the ZeRO paper's unit)."""
    (stage,) = model_state_bytes(spec)
    return (stage.params + stage.grads + stage.optimizer) / param_count(spec.trainer.model)


@pytest.mark.parametrize(
    "zero, expected",
    [(0, lambda nd: 16), (1, lambda nd: 4 + 12 / nd), (2, lambda nd: 2 + 14 / nd), (3, lambda nd: 16 / nd)],
)
@pytest.mark.parametrize("nd", [8, 64])
def test_zero_paper_model_state_bytes_per_parameter(zero: int, expected: Any, nd: int) -> None:
    """Rajbhandari et al. 2020, Figure 1: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter; ZeRO-1
    partitions the 12, ZeRO-2 also the gradients' 2, ZeRO-3 everything, over Nd data-parallel GPUs."""
    spec = job(engine="deepspeed", dp=nd, zero=zero, nodes=nd // 8, global_batch=nd)
    assert per_param(spec) == pytest.approx(expected(nd), rel=1e-6)


P = param_count(LLAMA7B)


@pytest.mark.parametrize(
    "zero, params, grads, optimizer",
    [
        (0, 4 * P, 4 * P, 8 * P),
        (1, 4 * P, 4 * P, (8 + 4) * P / 2),  # grads: the backward's full set (4P/dp only by the step)
        (2, 4 * P, 4 * P / 2, (8 + 4) * P / 2),
        (3, 4 * P / 2, 4 * P / 2, 8 * P / 2),
    ],
)
def test_deepspeed_fp32_bytes_match_the_measured_engine(
    zero: int, params: float, grads: float, optimizer: float
) -> None:
    """bench/deepspeed.py measured the real engine (CPU fp32, dp 2): ZeRO 1-2 keep an fp32 master partition
    beside Adam's 8 bytes, ZeRO-3 none."""
    (stage,) = model_state_bytes(job(engine="deepspeed", dp=2, zero=zero, precision="fp32", global_batch=2))
    assert (stage.params, stage.grads, stage.optimizer) == pytest.approx((params, grads, optimizer), rel=1e-6)


def test_offloaded_state_leaves_the_gpu() -> None:
    on_gpu = memory_per_gpu(job(engine="deepspeed", dp=8, zero=3))
    both = memory_per_gpu(job(engine="deepspeed", dp=8, zero=3, offload_optimizer=True, offload_params=True))
    assert (both.params, both.optimizer) == (0, 0)
    assert both.cpu == on_gpu.params + on_gpu.optimizer
    assert both.grads == on_gpu.grads and both.total < on_gpu.total


def test_native_fsdp_shards_what_ddp_replicates() -> None:
    ddp = model_state_bytes(job(dp=8, dp_mode="ddp"))[0]
    fsdp = model_state_bytes(job(dp=8, dp_mode="fsdp"))[0]
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * P, 4 * P, 8 * P)  # fp32 master, grads, AdamW x2
    assert fsdp.params * 8 == pytest.approx(ddp.params, rel=1e-6)
    assert fsdp.optimizer * 8 == pytest.approx(ddp.optimizer, rel=1e-6)


def test_tp_splits_all_but_the_norms_and_pp_stages_carry_embedding_and_head() -> None:
    cfg = LLAMA7B
    d, v = cfg.d_model, cfg.vocab_size
    tp4 = model_state_bytes(job(dp=2, tp=4))[0]
    norms = cfg.n_layers * 2 * d + d
    assert tp4.params == 4 * -(-((P - norms) // 4 + norms) // 2)
    stages = model_state_bytes(job(dp=2, pp=4, global_batch=64))
    first, middle, last = stages[0].params, stages[1].params, stages[3].params
    assert (stages[1].params, stages[1].optimizer) == (stages[2].params, stages[2].optimizer)  # blocks only
    assert first - middle == 4 * v * d // 2  # the embedding, sharded over dp 2
    assert last - middle == 4 * (v * d + d) // 2  # the head and the final norm
    worst = memory_per_gpu(job(dp=2, pp=4, global_batch=64))
    assert worst.stage in (0, 3)


def test_megatron_activation_formula() -> None:
    """Korthikanti et al. 2022, the reference our coefficients replace: sbh(34 + 5as/h) per layer."""
    s, b, h, a = 4096, 1, 4096, 32
    assert megatron_layer_activations(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert megatron_layer_activations(s, b, h, a, tp=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert megatron_layer_activations(s, b, h, a, tp=8, sequence_parallel=True) == pytest.approx(
        megatron_layer_activations(s, b, h, a) / 8
    )
    assert megatron_layer_activations(s, b, h, a, scores=False) == s * b * h * 34


SBH = 4096 * 1 * 4096
RATIO = 11008 / 4096  # llama-7b's ffn_hidden / d_model
LOGITS = 4096 * 32000 * (2 + 8)  # the compute-dtype logits, the fp32 log-softmax and its grad


def test_activations_with_tp_sp_checkpointing_and_precision() -> None:
    half = SBH * (16 + 8 + 8 * RATIO)  # FSDP2's 16-bit parameters
    assert memory_per_gpu(job(dp=8)).activations == int(32 * half + LOGITS)
    ac = memory_per_gpu(job(dp=8, activation_checkpointing=True)).activations
    assert ac == int(32 * 2 * SBH + half + LOGITS)  # each block's 16-bit input + one block recomputed
    tp = memory_per_gpu(job(dp=2, tp=4)).activations
    sp = memory_per_gpu(job(dp=2, tp=4, sequence_parallel=True)).activations
    assert tp == int(32 * SBH * (16 + (8 + 8 * RATIO) / 4) + LOGITS)  # the norms' tensors stay whole
    assert sp == int(32 * half / 4 + LOGITS)
    # dp 1: no FSDP2 mixed precision, autocast over fp32 parameters (fp32 residual and norms)
    assert memory_per_gpu(job(dp=1, tp=8)).activations == int(32 * SBH * (26 + (8 + 8 * RATIO) / 8) + LOGITS)
    autocast = memory_per_gpu(job(dp=1)).activations  # one rank: autocast over fp32 parameters
    assert autocast == int(32 * SBH * (26 + 8 + 8 * RATIO) + LOGITS)
    fp32 = memory_per_gpu(job(dp=8, precision="fp32")).activations
    assert fp32 == int(32 * SBH * (24 + 16 + 16 * RATIO) + 4096 * 32000 * 12)


def test_pipeline_stages_hold_their_micro_batches_in_flight() -> None:
    layer = 8 * SBH * (16 + 8 + 8 * RATIO)  # 32 layers over 4 stages
    one_f = estimate.activation_bytes(job(dp=2, pp=4, global_batch=64), 0)
    last = estimate.activation_bytes(job(dp=2, pp=4, global_batch=64), 3)
    gpipe = estimate.activation_bytes(job(dp=2, pp=4, global_batch=64, pp_schedule="gpipe"), 0)
    assert one_f == int(4 * layer)  # 1F1B: stage 0 holds pp micro-batches
    assert gpipe == int(32 * layer)  # GPipe: all 32 of the step
    assert last == int(layer + LOGITS)


def test_megatron_flops_formula() -> None:
    """Narayanan et al. 2021: 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) training FLOPs per step, for a GPT whose
    MLP holds 8h^2 (our SwiGLU with ffn_mult 8/3 at d = 3072: 3 x 3072 x 8192) and an untied head."""
    cfg = Model(n_layers=24, d_model=3072, n_heads=24, vocab_size=50304, seq_len=2048, ffn_mult=8 / 3)
    b, s, L, h, V = 16, cfg.seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    megatron = 72 * b * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    assert flops_per_token(cfg) * b * s == pytest.approx(megatron, rel=1e-4)  # the norms' 6 x 3d L are the rest
    spec = job(model=cfg, dp=8, global_batch=b)
    assert step_time(spec, H100).flops_per_step == flops_per_token(cfg) * b * s


def test_step_time_terms() -> None:
    base = step_time(job(dp=8), H100)
    assert base.tp_comm_s == base.pp_comm_s == base.bubble == 0
    assert base.compute_s == pytest.approx(base.flops_per_step / (8 * 989e12 * steptime.COMPUTE_EFFICIENCY))
    assert base.tokens_per_s == pytest.approx(64 * 4096 / base.step_s)
    assert 0.3 < base.mfu < steptime.COMPUTE_EFFICIENCY
    ac = step_time(job(dp=8, activation_checkpointing=True), H100)
    assert ac.compute_s == pytest.approx(base.compute_s * 4 / 3)
    pp = step_time(job(dp=2, pp=4, global_batch=16), H100)
    assert pp.bubble == pytest.approx(3 / (8 + 3))
    tp = step_time(job(dp=1, tp=8), H100)
    assert tp.tp_comm_s > 0 and tp.dp_comm_s == 0
    across = step_time(job(dp=16, nodes=2), H100)
    assert across.dp_comm_s > step_time(job(dp=8), H100).dp_comm_s  # InfiniBand, not NVLink


def _saved_bytes(cfg: Model, micro: int, mode: str) -> int:
    """Bytes of the activations the real GPT (launcher/train/model.py) saves for its backward in one forward on
    the CPU: every saved tensor's storage once, less the parameters and autocast's weight copies."""
    import torch

    from meshrun.launcher.train.model import GPT

    model = GPT(cfg).train()
    if mode == "16-bit":
        model = model.to(torch.bfloat16)  # what FSDP2's MixedPrecisionPolicy computes with
    weights = {tuple(p.shape) for p in model.parameters()}
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held and tuple(t.shape) not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            model(tokens)
    return sum(saved.values())


@pytest.mark.parametrize("ffn_mult", [2.0, 8 / 3])
@pytest.mark.parametrize("mode, precision, dp", [("fp32", "fp32", 1), ("autocast", "bf16", 1), ("16-bit", "bf16", 2)])
def test_layer_activations_are_what_the_real_model_saves(ffn_mult: float, mode: str, precision: str, dp: int) -> None:
    """The truth for a small model: one more block adds exactly LAYER_BYTES' count (to 1%: the RMSNorm
    scale and the attention's logsumexp are per row, not per element, and left out)."""
    # 3 x 160 tokens: no activation has a weight's shape (the filter for autocast's weight copies)
    shape = {"d_model": 192, "n_heads": 3, "vocab_size": 256, "seq_len": 160, "ffn_mult": ffn_mult}
    two, four = (_saved_bytes(Model(n_layers=n, **shape), 3, mode) for n in (2, 4))
    spec = job(model=Model(n_layers=2, **shape), precision=precision, dp=dp, global_batch=3 * dp, micro_batch=3)
    assert estimate.compute_mode(spec) == mode
    assert (four - two) / 2 == pytest.approx(estimate.layer_activation_bytes(spec), rel=0.01)


@pytest.mark.parametrize("kv_heads", [3, 1])
@pytest.mark.parametrize("mode, precision, dp", [("fp32", "fp32", 1), ("16-bit", "bf16", 2)])
def test_grouped_query_attention_saves_narrower_keys_and_values(
    kv_heads: int, mode: str, precision: str, dp: int
) -> None:
    """k and v are kv_heads/n_heads as wide; q and the attention's output are not (estimate.attention_share)."""
    shape = {"d_model": 384, "n_heads": 6, "n_kv_heads": kv_heads, "vocab_size": 256, "seq_len": 160, "ffn_mult": 2.0}
    two, four = (_saved_bytes(Model(n_layers=n, **shape), 3, mode) for n in (2, 4))
    spec = job(model=Model(n_layers=2, **shape), precision=precision, dp=dp, global_batch=3 * dp, micro_batch=3)
    full = replace(spec, train=replace(spec.trainer, model=replace(spec.trainer.model, n_kv_heads=0)))
    assert estimate.layer_activation_bytes(spec) < estimate.layer_activation_bytes(full)
    assert (four - two) / 2 == pytest.approx(estimate.layer_activation_bytes(spec), rel=0.01)
