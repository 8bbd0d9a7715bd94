"""Memory per GPU of a training job, from its spec alone (torch-free): what `meshrun plan` reports and
`meshrun submit` checks before paying for a job that cannot fit.

Every figure is bytes on ONE GPU (the worst pipeline stage, unless a stage is named), split into:
- params, grads, optimizer: the model state the engine keeps (`model_state_bytes`, the interface the
  mesh dry run, launcher/meshcount.py, counts from the real model);
- activations: Megatron's sbh(34 + 5as/h) bytes per layer (Korthikanti et al. 2022, 16-bit activations),
  divided by tp as Megatron does (with sequence parallelism all of it, without only the 24 sbh/t inside
  the tensor-parallel matmuls), kept for the micro-batches in flight, plus the logits of the loss;
- allowance: what is neither: a fixed CUDA context (cuBLAS workspace, NCCL buffers), the transient working
  copies the engine makes (FSDP's gathered blocks, DDP's gradient buckets, the 16-bit weight copies of
  mixed precision) and a fragmentation share of everything else (see `allowance_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from launcher import dsconfig
from launcher.modelshape import ModelPart, block_param_count
from launcher.spec import JobSpec
from launcher.spec import Model as ModelConfig

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
class StageBytes:
    """Model-state bytes one rank of a pipeline stage holds (the planner's and the mesh dry run's interface)."""

    stage: int
    """Pipeline stage."""
    params: int
    """Bytes of parameters one rank of this stage holds (model state, not transient gathers)."""
    grads: int
    """Bytes of gradients it holds at the optimizer step (ZeRO-1: the backward's full set, its peak)."""
    optimizer: int
    """Bytes of optimizer state (+ fp32 master copies where the engine keeps extra ones)."""


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mixed(spec: JobSpec) -> bool:
    """16-bit compute (bf16/fp16): activations and DeepSpeed's working weights take 2 bytes."""
    return spec.trainer.precision in ("bf16", "fp16")


def local_params(cfg: ModelConfig, part: ModelPart, tp: int) -> int:
    """Parameters one tp rank of a model part holds: the matmul weights, embedding and head split over tp
    (launcher/parallel.py), the RMSNorm weights whole on every tp rank."""
    d, v = cfg.d_model, cfg.vocab_size
    layers = part.end_layer - part.first_layer
    norms = layers * 2 * d + (d if part.head else 0)
    split = layers * (block_param_count(cfg) - 2 * d) + (v * d if part.embed else 0) + (d * v if part.head else 0)
    return _cdiv(split, tp) + norms


def _native_state(spec: JobSpec, local: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, cpu) bytes: fp32 master params, fp32 grads and AdamW's two fp32 states
    whatever the precision (the 16-bit copies are transient); fsdp shards all three over dp, ddp replicates."""
    dp = spec.parallel.dp
    shard = dp if spec.parallel.dp_mode == "fsdp" else 1
    n = _cdiv(local, shard)
    return 4 * n, 4 * n, 8 * n, 0


def _deepspeed_state(spec: JobSpec, n: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, cpu) bytes under ZeRO 0-3 (dp only). Mixed precision: 2-byte params and
    grads, fp32 master + Adam (the ZeRO paper's 2 + 2 + 12 bytes); fp32: 4 + 4 + 8, and ZeRO 1-2 keep an fp32
    master partition too (measured: bench/deepspeed.py). Offloaded state moves to `cpu`."""
    par, dp, stage = spec.parallel, spec.parallel.dp, dsconfig.zero_stage(spec)
    w = 2 if mixed(spec) else 4
    optimizer_per_param = 12 if (mixed(spec) or stage in (1, 2)) else 8
    params = w * (_cdiv(n, dp) if stage == 3 else n)
    grads = w * (_cdiv(n, dp) if stage >= 2 else n)  # ZeRO-1 holds every gradient through the backward
    optimizer = optimizer_per_param * (_cdiv(n, dp) if stage >= 1 else n)
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


def activation_bytes(spec: JobSpec, stage: int) -> int:
    """Activations one rank of `stage` holds at its peak. With activation checkpointing each layer keeps
    only its input (2sbh, /t under sequence parallelism) and one layer's full set lives during its
    recompute. fp32 activations take twice the 16-bit formula. The last stage adds the loss's logits
    (the head's output is whole on every tp rank): the compute-dtype logits, their fp32 copy and its grad."""
    cfg, par, t = spec.trainer.model, spec.parallel, spec.trainer
    s, b, h = cfg.seq_len, t.micro_batch, cfg.d_model
    sp = par.sequence_parallel and par.tp > 1
    full = megatron_layer_activations(s, b, h, cfg.n_heads, par.tp, sp, scores=False)
    layers = cfg.n_layers // par.pp
    if t.activation_checkpointing:
        kept = layers * 2 * s * b * h / (par.tp if sp else 1) * in_flight(spec, stage) + full
    else:
        kept = layers * full * in_flight(spec, stage)
    scale = 1 if mixed(spec) else 2
    logits = s * b * cfg.vocab_size * ((2 if mixed(spec) else 4) + 8) if stage == par.pp - 1 else 0
    return int(kept * scale + logits)


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


# ------------------------------------------------------------------ time

COMPUTE_EFFICIENCY = 0.5
"""Share of the GPU's dense peak the model's matmuls reach between communications (large-model training on
H100s reaches 40-55% MFU; the communication terms below take the rest)."""
CPU_ADAM_GBS = 20.0
"""Memory bandwidth (GB/s) DeepSpeed's CPU Adam gets when the optimizer is offloaded."""
PCIE_GBS = 25.0
"""Host<->GPU bandwidth (GB/s) of one GPU: offloaded gradients go down, updated parameters come back."""
ADAM_BYTES_PER_PARAM = 28
"""An AdamW step reads the fp32 param, grad and two states and writes the param and states: 28 bytes."""


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's estimated time on a GPU partition, and what follows from it."""

    flops_per_step: int
    """Model FLOPs of a step: (6N + 12 L d s) per token x global_batch x seq_len (no recompute counted)."""
    compute_s: float
    """The matmuls: hardware FLOPs (x 4/3 with activation checkpointing) / (GPUs x peak x efficiency)."""
    bubble: float
    """The pipeline's idle share (pp-1)/(m+pp-1), m micro-batches per step; 0 without pipelining."""
    tp_comm_s: float
    """Tensor-parallel all-reduces (4 per layer and micro-batch, 6 with recompute), not overlapped."""
    pp_comm_s: float
    """Activations and their grads between pipeline stages, not overlapped."""
    dp_comm_s: float
    """Data-parallel gradient reduction and FSDP/ZeRO-3 parameter gathers, overlapped with compute."""
    optimizer_s: float
    """The optimizer step: memory-bound (28 bytes per local parameter at HBM speed, or CPU Adam + PCIe)."""
    step_s: float
    """max(pipeline compute + tp + pp traffic, dp traffic) + the optimizer step."""
    tokens_per_s: float
    """global_batch x seq_len / step_s."""
    mfu: float
    """Model FLOPs per second over the GPUs' dense bf16 peak."""

    def as_json(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Hardware:
    """What the time model needs of a partition and its interconnect."""

    peak_tflops: float
    """Dense bf16 TFLOP/s of one GPU."""
    memory_gbs: float
    """HBM bandwidth of one GPU, GB/s."""
    gpus_per_node: int
    """GPUs of one node (a group wider than this crosses nodes)."""
    nvlink_gbytes_s: float
    """Bus bandwidth inside a node, GB/s."""
    ib_gbytes_s: float
    """Bus bandwidth across nodes, GB/s per GPU."""


def _ring(n: int) -> float:
    """A ring collective's traffic factor (n-1)/n (an all-reduce moves twice it)."""
    return (n - 1) / n if n > 1 else 0.0


def _dp_bytes(spec: JobSpec, local: int, micro: int) -> float:
    """Bytes one rank's data-parallel collectives move in a step (busbw terms: all-reduce 2(n-1)/n x size,
    all-gather and reduce-scatter (n-1)/n x size). FSDP2 reduces every micro-batch; torch DDP once a step."""
    par, w = spec.parallel, 2 if mixed(spec) else 4
    f = _ring(par.dp)
    if dsconfig.uses_deepspeed(spec):
        stage = dsconfig.zero_stage(spec)
        if stage == 3:
            return f * local * 3 * w * micro
        if stage == 2:
            return f * local * w * (micro + 1)
        return f * local * w * (2 if stage == 0 else 3)
    if par.dp_mode == "fsdp":
        gathers = 2 if par.pp == 1 else 1  # pipelined stages keep the gathered params through the backward
        return f * local * (gathers * w + 4) * micro
    if par.tp == 1 and par.pp == 1:
        return 2 * f * local * 4  # torch DDP: one fp32 all-reduce, the other micro-batches under no_sync
    return 2 * f * local * 4 * micro  # FSDP2's replicate: every micro-batch


def _optimizer_s(spec: JobSpec, local: int, hw: Hardware) -> float:
    par = spec.parallel
    sharded = dsconfig.uses_deepspeed(spec) and dsconfig.zero_stage(spec) >= 1 or par.dp_mode == "fsdp"
    n = _cdiv(local, par.dp) if sharded else local
    if dsconfig.uses_deepspeed(spec) and par.offload_optimizer:
        return n * ADAM_BYTES_PER_PARAM / (CPU_ADAM_GBS * 1e9) + n * 2 * 4 / (PCIE_GBS * 1e9)
    return n * ADAM_BYTES_PER_PARAM / (hw.memory_gbs * 1e9)


def step_time(spec: JobSpec, hw: Hardware) -> StepTime:
    """The step time model (README, `meshrun plan`): compute at COMPUTE_EFFICIENCY of the peak (fp32 at
    gpus.FP32_FRACTION of it), the pipeline bubble, tp/pp traffic in series, dp traffic overlapped."""
    from launcher.gpus import FP32_FRACTION
    from launcher.modelshape import flops_per_token

    cfg, par, t = spec.trainer.model, spec.parallel, spec.trainer
    world = par.dp * par.tp * par.pp
    micro = max(t.global_batch // (t.micro_batch * par.dp), 1)
    tokens = t.global_batch * cfg.seq_len
    flops = flops_per_token(cfg) * tokens
    rate = hw.peak_tflops * 1e12 * COMPUTE_EFFICIENCY * (1 if mixed(spec) else FP32_FRACTION)
    compute = flops * (4 / 3 if t.activation_checkpointing else 1) / (world * rate)
    w = 2 if mixed(spec) else 4
    activation = cfg.seq_len * t.micro_batch * cfg.d_model * w  # one micro-batch's hidden states
    in_node = hw.nvlink_gbytes_s * 1e9
    tp_calls = (6 if t.activation_checkpointing else 4) * (cfg.n_layers // par.pp) * micro
    tp_comm = tp_calls * 2 * _ring(par.tp) * activation / in_node
    stage_ranks = par.dp * par.tp  # consecutive ranks: a stage fills whole nodes once this reaches a node
    pp_bw = hw.ib_gbytes_s * 1e9 if stage_ranks >= hw.gpus_per_node else in_node
    pp_comm = 2 * micro * activation / par.tp / pp_bw if par.pp > 1 else 0.0
    bubble = (par.pp - 1) / (micro + par.pp - 1)
    local = max(local_params(cfg, ModelPart.stage(cfg, s, par.pp), par.tp) for s in range(par.pp))
    dp_bw = hw.ib_gbytes_s * 1e9 if stage_ranks > hw.gpus_per_node else in_node
    dp_comm = _dp_bytes(spec, local, micro) / dp_bw
    optimizer = _optimizer_s(spec, local, hw)
    pipeline = (compute + tp_comm + pp_comm) / (1 - bubble)
    step = max(pipeline, dp_comm) + optimizer
    return StepTime(
        flops_per_step=flops,
        compute_s=compute,
        bubble=bubble,
        tp_comm_s=tp_comm,
        pp_comm_s=pp_comm,
        dp_comm_s=dp_comm,
        optimizer_s=optimizer,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=flops / (step * world * hw.peak_tflops * 1e12),
    )
