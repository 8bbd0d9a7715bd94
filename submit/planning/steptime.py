"""The step-time model of `meshrun plan` (torch-free): model FLOPs (the Megatron formula) at a stated share of
the GPU's peak, the pipeline bubble, tensor- and pipeline-parallel traffic in series, data-parallel traffic
overlapped with compute, and a memory-bound optimizer step, from the GPU type's figures (launcher/contract/gpus.py)
and the profile's interconnect bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from meshrun.launcher.contract.gpus import FP32_FRACTION
from meshrun.launcher.contract.spec import dsconfig
from meshrun.launcher.contract.spec.job import JobSpec, Prediction
from meshrun.launcher.contract.spec.modelshape import ModelPart, flops_per_token, layer_elements
from meshrun.submit.config.cluster import Cost
from meshrun.submit.planning.estimate import cdiv, local_params, mixed

COMPUTE_EFFICIENCY = 0.5
"""Share of the GPU's dense peak the model's matmuls reach between communications (large-model training on
H100s reaches 40-55% MFU; the communication terms below take the rest)."""
CPU_ADAM_GBS = 20.0
"""Memory bandwidth (GB/s) DeepSpeed's CPU Adam gets when the optimizer is offloaded."""
PCIE_GBS = 25.0
"""Host<->GPU bandwidth (GB/s) of one GPU: offloaded gradients go down, updated parameters come back."""
ADAM_BYTES_PER_PARAM = 28
"""An AdamW step reads the fp32 param, grad and two states and writes the param and states: 28 bytes."""
GEMM_EFFICIENCY = 0.7
"""Share of a large GEMM's measured rate (`meshrun doctor`'s) the model's matmuls reach between communications:
smaller shapes, attention and the element-wise kernels between them (0.5 of an H100's peak / its ~0.7 GEMM)."""


@dataclass(frozen=True)
class GlooCost:
    """What one collective inside a training step costs on CPU ranks, against doctor's figures."""

    bytes_factor: float
    """Its bytes take this many times what doctor's lone all-reduce bandwidth says (the ranks share the cores:
    a collective also waits for the other ranks' compute)."""
    blocks_per_call: float
    """Its fixed cost, in doctor's per-block framework overhead (`layer_overhead_us`): the Python around each call
    (FSDP2's hooks and copies, DTensor's redistribution), which tracks the CPU's speed as that overhead does."""


GLOO_COSTS = {"tp": GlooCost(4.1, 8.0), "dp": GlooCost(4.8, 2.0)}
"""Tensor-parallel all-reduces, and data-parallel traffic (DDP, FSDP2), on CPU ranks with doctor's block timings.
Fitted by bench/plan_accuracy.py on 2 cores (2026-12-04, 24 jobs): each job then within 10% on its own. The fixed
cost is counted in block overheads, not doctor's tiny all-reduce, whose latency swung 293-735 us between doctor runs
on the same idle machine while the block overhead stayed within 582-615 us."""
CPU_MEMORY_GBS = 10.0
"""Memory bandwidth (GB/s) one CPU rank's optimizer step gets (a few cores' share of a socket's)."""


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
    """Data-parallel gradient reduction and FSDP/ZeRO-3 parameter gathers, overlapped with compute on GPUs."""
    dp_overlapped: bool
    """Whether that traffic overlaps with compute (GPU streams) or runs in series with it (gloo on CPU ranks)."""
    optimizer_s: float
    """The optimizer step: memory-bound (28 bytes per local parameter at HBM speed, or CPU Adam + PCIe)."""
    layers_s: float
    """The blocks' fixed cost in series with their matmuls, from doctor's block timings: on CPU ranks their work
    besides the matmuls (element-wise passes, softmax, the framework's own per-block cost), on GPUs launching their
    kernels; 0 with datasheet figures (inside COMPUTE_EFFICIENCY)."""
    calls_s: float
    """CPU ranks: the Python around the step's collectives (GLOO_COSTS' per-call part of tp_comm_s and dp_comm_s):
    the rank's own CPU work, though it is counted in those terms; 0 on GPUs."""
    cpu_bound_s: float
    """CPU ranks: the node's CPUs' share of a step, every rank's own work (compute, blocks, optimizer, calls) over
    the node's CPUs (doctor's count); a step takes at least this when more ranks than CPUs share a node; 0 on GPUs."""
    step_s: float
    """max(pipeline compute (+ blocks) + tp + pp traffic, dp traffic) + the optimizer step (dp in series on CPU
    ranks); on CPU ranks at least cpu_bound_s."""
    tokens_per_s: float
    """global_batch x seq_len / step_s."""
    mfu: float
    """Model FLOPs per second over the GPUs' dense bf16 peak."""

    def as_json(self) -> dict[str, float | bool]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Hardware:
    """What the time model needs of a partition and its interconnect: datasheet figures, or measured ones."""

    peak_tflops: float
    """Dense bf16 TFLOP/s of one GPU (the datasheet's: MFU is against it); on CPU ranks, one rank's measured
    fp32 GEMM."""
    memory_gbs: float
    """HBM bandwidth of one GPU, GB/s (on CPU ranks: CPU_MEMORY_GBS)."""
    gpus_per_node: int
    """GPUs (or CPU ranks) of one node (a group wider than this crosses nodes)."""
    nvlink_gbytes_s: float
    """Bus bandwidth inside a node, GB/s."""
    ib_gbytes_s: float
    """Bus bandwidth across nodes, GB/s per GPU."""
    compute_tflops: float = 0.0
    """The rate the model's matmuls reach (in the job's precision on a GPU); 0: peak x COMPUTE_EFFICIENCY."""
    cpu: bool = False
    """The ranks compute on CPU cores (fp32 whatever the precision: compute_tflops is already that rate)."""
    source: str = "datasheet figures"
    """Where the figures come from, for the plan's reader: "datasheet figures" or "calibrated on DATE (...)"."""
    latency_s: float = 0.0
    """What each collective costs however small (doctor's tiny all-reduce); 0 with datasheet figures."""
    overlap_dp: bool = True
    """Data-parallel traffic overlaps with compute (GPU streams); on CPU ranks (gloo) it runs in series."""
    layer_overhead_s: float = 0.0
    """A block's forward and backward per micro-batch besides its matmuls (and on CPU ranks its element-wise work):
    doctor's; on GPUs the launch of its kernels."""
    layer_element_s: float = 0.0
    """CPU ranks: a block's element-wise work per value (`modelshape.layer_elements`), seconds (doctor's)."""
    node_cpus: int = 0
    """CPU ranks: the CPUs of a node (doctor's count; 0: unknown)."""


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


def _dp_collectives(spec: JobSpec, micro: int) -> int:
    """How many data-parallel collectives one rank issues in a step (each pays the latency once)."""
    par = spec.parallel
    if par.dp == 1:
        return 0
    if dsconfig.uses_deepspeed(spec):
        return 2 * micro
    if par.dp_mode == "fsdp":
        gathers = 2 if par.pp == 1 else 1
        return (gathers + 1) * (spec.trainer.model.n_layers // par.pp + 1) * micro  # per block, and the root
    if par.tp == 1 and par.pp == 1:
        return 1  # torch DDP: one bucketed all-reduce
    return micro


def _optimizer_s(spec: JobSpec, local: int, hw: Hardware) -> float:
    par = spec.parallel
    sharded = dsconfig.uses_deepspeed(spec) and dsconfig.zero_stage(spec) >= 1 or par.dp_mode == "fsdp"
    n = cdiv(local, par.dp) if sharded else local
    if dsconfig.uses_deepspeed(spec) and par.offload_optimizer:
        return n * ADAM_BYTES_PER_PARAM / (CPU_ADAM_GBS * 1e9) + n * 2 * 4 / (PCIE_GBS * 1e9)
    return n * ADAM_BYTES_PER_PARAM / (hw.memory_gbs * 1e9)


def _gloo_costs(hw: Hardware) -> bool:
    """Whether a collective's per-call cost is GLOO_COSTS' Python on the rank (CPU ranks doctor timed blocks on)."""
    return hw.cpu and hw.layer_overhead_s > 0


def _collective_cost(hw: Hardware, which: str) -> tuple[float, float]:
    """(factor on the bytes' time, seconds per call) of a tensor- ("tp") or data-parallel ("dp") collective: as
    measured on GPUs; GLOO_COSTS on CPU ranks that doctor timed blocks on."""
    if not _gloo_costs(hw):
        return 1.0, hw.latency_s
    cost = GLOO_COSTS[which]
    return cost.bytes_factor, cost.blocks_per_call * hw.layer_overhead_s


def _node_cpu_bound_s(spec: JobSpec, hw: Hardware, own_work_s: float) -> float:
    """What a step takes at least when the node's ranks need more CPU than it has: each rank's own work x its
    threads x the ranks on the node / the node's CPUs (README's 8-rank example on 2 cores measured 2.8 times the
    plan that ignored it). 0 on GPUs, or without doctor's count of the node's CPUs."""
    if not hw.cpu or not hw.node_cpus:
        return 0.0
    return own_work_s * spec.resources.cpus_per_task * spec.tasks_per_node / hw.node_cpus


def _layers_s(spec: JobSpec, hw: Hardware, micro: int) -> float:
    """One rank's blocks besides their matmuls, a step: per block and micro-batch doctor's fixed cost (and on CPU
    ranks their element-wise work), x 4/3 with activation checkpointing (one more forward)."""
    if not (hw.layer_overhead_s or hw.layer_element_s):
        return 0.0
    cfg, par = spec.trainer.model, spec.parallel
    elements = layer_elements(cfg, spec.trainer.micro_batch, par.tp)
    per_block = hw.layer_overhead_s + hw.layer_element_s * elements
    recompute = 4 / 3 if spec.trainer.activation_checkpointing else 1
    return cdiv(cfg.n_layers, par.pp) * micro * per_block * recompute


def flops_per_step(spec: JobSpec) -> int:
    """Model FLOPs of one optimizer step: (6N + 12 L d s) per token x global_batch x seq_len."""
    cfg = spec.trainer.model
    return int(flops_per_token(cfg) * spec.trainer.global_batch * cfg.seq_len)


def step_time(spec: JobSpec, hw: Hardware) -> StepTime:
    """The step time model (docs/guides/plan-and-doctor.md): compute at COMPUTE_EFFICIENCY of the peak (fp32 at
    gpus.FP32_FRACTION of it), the pipeline bubble, tp/pp traffic in series, dp traffic overlapped."""
    cfg, par, t = spec.trainer.model, spec.parallel, spec.trainer
    world = par.dp * par.tp * par.pp
    micro = max(t.global_batch // (t.micro_batch * par.dp), 1)
    tokens = t.global_batch * cfg.seq_len
    flops = flops_per_step(spec)
    rate = (hw.compute_tflops or hw.peak_tflops * COMPUTE_EFFICIENCY) * 1e12
    if not hw.cpu and not mixed(spec):
        rate *= FP32_FRACTION
    compute = flops * (4 / 3 if t.activation_checkpointing else 1) / (world * rate)
    layers = _layers_s(spec, hw, micro)
    w = 2 if mixed(spec) else 4
    activation = cfg.seq_len * t.micro_batch * cfg.d_model * w  # one micro-batch's hidden states
    in_node = hw.nvlink_gbytes_s * 1e9
    tp_calls = (6 if t.activation_checkpointing else 4) * (cfg.n_layers // par.pp) * micro
    tp_bytes, tp_call = _collective_cost(hw, "tp")
    tp_comm = tp_calls * (tp_bytes * 2 * _ring(par.tp) * activation / in_node + tp_call) if par.tp > 1 else 0.0
    stage_ranks = par.dp * par.tp  # consecutive ranks: a stage fills whole nodes once this reaches a node
    pp_bw = hw.ib_gbytes_s * 1e9 if stage_ranks >= hw.gpus_per_node else in_node
    pp_comm = 2 * micro * (activation / par.tp / pp_bw + hw.latency_s) if par.pp > 1 else 0.0
    bubble = (par.pp - 1) / (micro + par.pp - 1)
    local = max(local_params(cfg, ModelPart.stage(cfg, s, par.pp), par.tp) for s in range(par.pp))
    dp_bw = hw.ib_gbytes_s * 1e9 if stage_ranks > hw.gpus_per_node else in_node
    dp_bytes, dp_call = _collective_cost(hw, "dp")
    dp_calls = _dp_collectives(spec, micro)
    dp_comm = dp_bytes * _dp_bytes(spec, local, micro) / dp_bw + dp_calls * dp_call
    # the Python around each call is the rank's own CPU work (a GPU's or doctor's latency is waiting)
    calls = ((tp_calls * tp_call if par.tp > 1 else 0.0) + dp_calls * dp_call) if _gloo_costs(hw) else 0.0
    optimizer = _optimizer_s(spec, local, hw)
    pipeline = (compute + layers + tp_comm + pp_comm) / (1 - bubble)
    step = (max(pipeline, dp_comm) if hw.overlap_dp else pipeline + dp_comm) + optimizer
    cpu_bound = _node_cpu_bound_s(spec, hw, compute + layers + optimizer + calls)
    step = max(step, cpu_bound)
    return StepTime(
        flops_per_step=flops,
        compute_s=compute,
        bubble=bubble,
        tp_comm_s=tp_comm,
        pp_comm_s=pp_comm,
        dp_comm_s=dp_comm,
        dp_overlapped=hw.overlap_dp,
        optimizer_s=optimizer,
        layers_s=layers,
        calls_s=calls,
        cpu_bound_s=cpu_bound,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=flops / (step * world * hw.peak_tflops * 1e12),
    )


def run_estimate(spec: JobSpec, cost: Cost, step_s: Optional[float]) -> dict[str, Any]:
    """The whole run at `step_s`: its time (train.steps steps), the GPU-hours it holds (every allocated GPU, for
    that time) and, when the profile prices them (cost.gpu_hour), what they cost; all None without a step time."""
    if step_s is None:
        return {"run_s": None, "gpu_hours": None, "cost": None}
    run_s = spec.trainer.steps * step_s
    res = spec.resources
    hours = res.nodes * res.gpus_per_node * run_s / 3600
    price = cost.gpu_hour if res.gpus_per_node else 0.0
    return {
        "run_s": run_s,
        "gpu_hours": hours,
        "cost": {"amount": hours * price, "currency": cost.currency} if price else None,
    }


def prediction(spec: JobSpec, hw: Hardware, memory_bytes: Optional[int]) -> Prediction:
    """What the job carries for rank 0 to check the run against (launcher/train/plancheck.py): the step time, split
    into the ranks' own work (the matmuls and the optimizer step) and what a step waits on besides it (collectives
    not hidden behind compute, the pipeline's bubble); `memory_bytes`, a GPU's peak (None on CPU ranks)."""
    time = step_time(spec, hw)
    # the ranks' own work: what plancheck measures as compute on CPU ranks (their CPU time) includes the Python
    # around each collective; a wait for a CPU on a crowded node counts with the communication
    compute = time.compute_s + time.layers_s + time.optimizer_s + time.calls_s
    return Prediction(
        step_s=time.step_s,
        tokens_per_s=time.tokens_per_s,
        compute_s=compute,
        communication_s=max(time.step_s - compute, 0.0),
        memory_bytes=memory_bytes,
        figures=hw.source,
    )
