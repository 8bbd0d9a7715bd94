"""Memory per GPU of a training job, from its spec alone (torch-free): what `meshrun plan` reports and
`meshrun submit` checks before paying for a job that cannot fit.

Every figure is bytes on ONE GPU (the worst pipeline stage, unless a stage is named), split into:
- params, grads, optimizer: the model state the engine keeps (`model_state_bytes`, the interface the
  mesh dry run, launcher/probes/meshcount.py, counts from the real model);
- activations: Megatron's method (Korthikanti et al. 2022: the bytes each layer saves for its backward,
  per s*b*h; the tensor-parallel parts / tp, all of it / tp with sequence parallelism; each micro-batch in
  flight), with this model's own coefficients (LAYER_BYTES, counted from launcher/train/model.py's saved tensors)
  instead of Megatron's sbh(34 + 5as/h): that assumes a GeLU MLP of 4h, dropout masks and all-16-bit
  tensors, where ours has a SwiGLU (four tensors of ffn_hidden), fp32 RMSNorm upcasts and fused attention
  (no s x s scores). A 16-bit-parameter layer of ffn 8/3 h keeps ~45 sbh bytes against Megatron's 34.
  Plus the loss's logits on the last stage;
- allowance: what is neither: a fixed CUDA context (cuBLAS workspace, NCCL buffers), the transient working
  copies the engine makes (FSDP's gathered blocks, DDP's gradient buckets, the 16-bit weight copies of
  mixed precision) and a fragmentation share of everything else (see `allowance_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshrun.launcher.contract.spec import dsconfig
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.job import Model as ModelConfig
from meshrun.launcher.contract.spec.modelshape import ModelPart, StageBytes, ffn_hidden, part_param_count

GIB = 1024**3
CONTEXT_BYTES = GIB
"""Fixed per GPU: the CUDA context, cuBLAS workspaces and NCCL's buffers (about 1 GiB on H100s)."""
FRAGMENTATION = 0.05
"""The caching allocator's fragmentation: this share of the model state, activations and working copies."""
HEADROOM = 0.05
"""A job fits when its total is at most gpu_memory_gb x (1 - HEADROOM): 5% of the GPU is left free."""
DS_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default reduce/all-gather bucket (reduce_bucket_size, 5e8 elements): ZeRO 1-2 working set."""


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU of one pipeline stage, by kind."""

    stage: int
    """Pipeline stage."""
    params: int
    """Parameters (model state)."""
    grads: int
    """Gradients."""
    optimizer: int
    """Optimizer state and fp32 master copies."""
    activations: int
    """Activations kept for the backward (the micro-batches in flight) and the loss's logits."""
    allowance: int
    """CUDA context, transient working copies and fragmentation (see the module's docstring)."""
    cpu: int = 0
    """Model state DeepSpeed offloads to CPU memory (not on the GPU, not in total)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.allowance

    def as_json(self) -> dict[str, int]:
        keys = ("params", "grads", "optimizer", "activations", "allowance", "total", "cpu")
        return {key: int(getattr(self, key)) for key in keys}


def gib(n: float) -> str:
    """Bytes as GiB for a person (the plan's table, submit's refusal)."""
    return f"{n / 2**30:,.1f} GiB"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mixed(spec: JobSpec) -> bool:
    """16-bit compute (bf16/fp16): activations and DeepSpeed's working weights take 2 bytes."""
    return spec.trainer.precision in ("bf16", "fp16")


def local_params(cfg: ModelConfig, part: ModelPart, tp: int) -> int:
    """Parameters one tp rank of a model part holds: the matmul weights, embedding and head split over tp
    (launcher/train/parallel.py), the RMSNorm weights whole on every tp rank (a tied head's matrix is the
    embedding's: modelshape.part_param_count counts it once)."""
    d = cfg.d_model
    layers = part.end_layer - part.first_layer
    norms = layers * 2 * d + (d if part.head else 0)
    return cdiv(part_param_count(cfg, part) - norms, tp) + norms


def _native_state(spec: JobSpec, local: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, cpu) bytes: fp32 master params, fp32 grads and AdamW's two fp32 states
    whatever the precision (the 16-bit copies are transient); fsdp shards all three over dp, ddp replicates."""
    dp = spec.parallel.dp
    shard = dp if spec.parallel.dp_mode == "fsdp" else 1
    n = cdiv(local, shard)
    return 4 * n, 4 * n, 8 * n, 0


def _deepspeed_state(spec: JobSpec, n: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, cpu) bytes under ZeRO 0-3 (dp only). Mixed precision: 2-byte params and
    grads, fp32 master + Adam (the ZeRO paper's 2 + 2 + 12 bytes); fp32: 4 + 4 + 8, and ZeRO 1-2 keep an fp32
    master partition too (measured: bench/deepspeed.py). Offloaded state moves to `cpu`."""
    par, dp, stage = spec.parallel, spec.parallel.dp, dsconfig.zero_stage(spec)
    w = 2 if mixed(spec) else 4
    optimizer_per_param = 12 if (mixed(spec) or stage in (1, 2)) else 8
    params = w * (cdiv(n, dp) if stage == 3 else n)
    grads = w * (cdiv(n, dp) if stage >= 2 else n)  # ZeRO-1 holds every gradient through the backward
    optimizer = optimizer_per_param * (cdiv(n, dp) if stage >= 1 else n)
    cpu = 0
    if par.offload_optimizer:
        cpu, optimizer = cpu + optimizer, 0
    if par.offload_params:
        cpu, params = cpu + params, 0
    return params, grads, optimizer, cpu


def _state(spec: JobSpec, stage: int) -> tuple[int, int, int, int]:
    cfg, par = spec.trainer.model, spec.parallel
    local = local_params(cfg, ModelPart.stage(cfg, stage, par.pp), par.tp)
    if dsconfig.uses_deepspeed(spec):
        return _deepspeed_state(spec, local)
    return _native_state(spec, local)


def model_state_bytes(spec: JobSpec) -> list[StageBytes]:
    """Model-state bytes per rank, one entry per pipeline stage, for the spec's engine and layout."""
    out = []
    for stage in range(spec.parallel.pp):
        params, grads, optimizer, _cpu = _state(spec, stage)
        out.append(StageBytes(stage=stage, params=params, grads=grads, optimizer=optimizer))
    return out


def megatron_layer_activations(
    s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False, scores: bool = True
) -> float:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al. 2022, 16-bit activations):
    sbh(34 + 5as/h); with tp: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism: sbh(34 + 5as/h)/t.
    `scores`: count the s x s attention scores, softmax and dropout mask (5as/h); a fused attention
    kernel (SDPA's flash / memory-efficient paths, which our model uses) keeps none of them."""
    attention = 5 * a * s / h if scores else 0.0
    if sequence_parallel and tp > 1:
        return s * b * h * (34 + attention) / tp
    return s * b * h * (10 + 24 / tp + attention / tp)


def in_flight(spec: JobSpec, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: 1 without pipelining; 1F1B: pp - stage
    (at most the step's micro-batches); GPipe: every micro-batch of the step."""
    par, t = spec.parallel, spec.trainer
    if par.pp == 1:
        return 1
    micro = t.global_batch // (t.micro_batch * par.dp)
    return micro if par.pp_schedule == "gpipe" else min(par.pp - stage, micro)


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per s*b*h element position that one block of launcher/train/model.py saves for its backward, by the
    dtypes it computes in (counted from its saved tensors: tests/unit/test_estimate.py checks them)."""

    whole: float
    """Kept whole on every tp rank without sequence parallelism: each RMSNorm's fp32 upcast and output, and
    the inputs of the projections after it."""
    attention: float
    """Split over tp: rotated q and k, v, the fused attention's output (no s x s scores: SDPA), four tensors of
    d_model each under full multi-head attention; grouped-query attention's k and v are kv_heads/n_heads of
    that (`attention_share`)."""
    ffn: float
    """Split over tp, per ffn_hidden/d_model: the SwiGLU's w1 and w3 outputs, their silu, the product."""
    checkpoint: float
    """Kept per layer under activation checkpointing: the block's input (the residual stream)."""


LAYER_BYTES = {
    "fp32": LayerBytes(whole=24, attention=16, ffn=16, checkpoint=4),
    "autocast": LayerBytes(whole=26, attention=8, ffn=8, checkpoint=4),  # fp32 residual, 16-bit matmul inputs
    "16-bit": LayerBytes(whole=16, attention=8, ffn=8, checkpoint=2),  # 16-bit params: FSDP2's or DeepSpeed's
}
"""By how the job computes: fp32; autocast (mixed precision over fp32 parameters: dp 1, or torch DDP);
16-bit parameters (FSDP2's MixedPrecisionPolicy whenever dp > 1 with fsdp, tp or pp; DeepSpeed's bf16/fp16)."""


def compute_mode(spec: JobSpec) -> str:
    """Which LAYER_BYTES row the job's ranks compute in (the trainer's own rule: ParallelDims.fsdp_wraps)."""
    par = spec.parallel
    if not mixed(spec):
        return "fp32"
    if dsconfig.uses_deepspeed(spec) or spec.dims.fsdp_wraps(par.dp_mode):
        return "16-bit"
    return "autocast"


def attention_share(cfg: ModelConfig) -> float:
    """The attention's saved tensors against full multi-head attention's: q and the output stay d_model wide,
    k and v shrink to kv_heads/n_heads of it (measured on the real model: tests/unit/test_estimate.py)."""
    return (2 + 2 * cfg.kv_heads / cfg.n_heads) / 4


def layer_activation_bytes(spec: JobSpec) -> float:
    """One block's saved activations for one micro-batch on one rank: sbh x (whole + (attention + ffn x
    ffn_hidden/d_model) / tp); with sequence parallelism all of it / tp (as Megatron counts it)."""
    cfg, par = spec.trainer.model, spec.parallel
    row = LAYER_BYTES[compute_mode(spec)]
    sbh = cfg.seq_len * spec.trainer.micro_batch * cfg.d_model
    split = row.attention * attention_share(cfg) + row.ffn * ffn_hidden(cfg) / cfg.d_model
    if par.sequence_parallel and par.tp > 1:
        return sbh * (row.whole + split) / par.tp
    return sbh * (row.whole + split / par.tp)


def activation_bytes(spec: JobSpec, stage: int) -> int:
    """Activations one rank of `stage` holds at its peak: its layers' saved tensors for each micro-batch in
    flight. With activation checkpointing each layer keeps only its input (/tp under sequence parallelism)
    and one layer's full set lives during its recompute. The last stage adds the loss's logits (the head's
    output is whole on every tp rank): the logits, the fp32 log-softmax and its gradient."""
    cfg, par, t = spec.trainer.model, spec.parallel, spec.trainer
    full = layer_activation_bytes(spec)
    layers = cfg.n_layers // par.pp
    if t.activation_checkpointing:
        sbh = cfg.seq_len * t.micro_batch * cfg.d_model
        per_layer = sbh * LAYER_BYTES[compute_mode(spec)].checkpoint / (par.tp if par.sequence_parallel else 1)
        kept = layers * per_layer * in_flight(spec, stage) + full
    else:
        kept = layers * full * in_flight(spec, stage)
    logits = cfg.seq_len * t.micro_batch * cfg.vocab_size * ((2 if mixed(spec) else 4) + 8)
    return int(kept + (logits if stage == par.pp - 1 else 0))


def working_bytes(spec: JobSpec, stage: int) -> int:
    """Transient copies the engine makes beside the model state, at their peak."""
    cfg, par = spec.trainer.model, spec.parallel
    part = ModelPart.stage(cfg, stage, par.pp)
    local = local_params(cfg, part, par.tp)
    w = 2 if mixed(spec) else 4
    block = local_params(cfg, ModelPart(0, 1, embed=False, head=False), par.tp)
    ends = local - (part.end_layer - part.first_layer) * block  # embedding, final norm, head
    if dsconfig.uses_deepspeed(spec):
        stage_ = dsconfig.zero_stage(spec)
        if stage_ == 3:  # the gathered layers in use and prefetched, with their 16-bit grads
            return 2 * block * (w + w) + ends * w
        return min(DS_BUCKET_ELEMENTS, local) * w if stage_ else 0
    if par.dp == 1:
        return local * 2 if mixed(spec) else 0  # autocast's 16-bit weight copies, kept for the backward
    if par.dp_mode == "fsdp":
        if par.pp > 1:  # no reshard after forward under pipelining: the whole stage stays gathered
            return local * w + block * 4
        # two blocks gathered (one computing, one prefetched) with their unsharded fp32 grads; the root
        # (embedding, head) stays gathered through the step
        return 2 * block * (w + 4) + ends * w
    ddp_buckets = 4 * local if par.tp == 1 and par.pp == 1 else 0  # torch DDP's flat gradient buckets
    return ddp_buckets + (local * 2 if mixed(spec) else 0)


def allowance_bytes(spec: JobSpec, stage: int, accounted: int) -> int:
    """CONTEXT_BYTES + the working copies + FRAGMENTATION x (accounted + working copies), where
    `accounted` is the stage's model state and activations."""
    working = working_bytes(spec, stage)
    return int(CONTEXT_BYTES + working + FRAGMENTATION * (accounted + working))


def stage_memory(spec: JobSpec, stage: int) -> Memory:
    params, grads, optimizer, cpu = _state(spec, stage)
    activations = activation_bytes(spec, stage)
    accounted = params + grads + optimizer + activations
    return Memory(stage, params, grads, optimizer, activations, allowance_bytes(spec, stage, accounted), cpu)


def memory_per_gpu(spec: JobSpec) -> Memory:
    """The stage with the largest total (the first and last carry the embedding and head)."""
    stages = [stage_memory(spec, stage) for stage in range(spec.parallel.pp)]
    return max(stages, key=lambda m: m.total)


def usable_bytes(gpu_memory_gb: float) -> int:
    """What a job may use of one GPU: its memory less HEADROOM."""
    return int(gpu_memory_gb * GIB * (1 - HEADROOM))


def fits(memory: Memory, gpu_memory_gb: Optional[float]) -> Optional[bool]:
    """Whether the job fits a GPU of that size; None when the size is unknown."""
    if not gpu_memory_gb:
        return None
    return memory.total <= usable_bytes(gpu_memory_gb)
