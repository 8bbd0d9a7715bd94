"""The layout search: which dp x tp x pp, micro-batch and activation checkpointing fit a partition and train
fastest by the estimate (submit/planning/estimate.py); and on which GPUs, how many, a model fits at all.

The global batch, the model and the engine stay the user's: the search changes only how the work is split.
tp stays inside one node's NVLink domain and divides the heads; pp divides the layers; the micro-batch
divides the per-replica batch; sequence parallelism is on whenever tp > 1 allows it (same traffic, less
memory). Ranked by estimated tokens/s; a tie goes to the smaller memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional

from meshrun.launcher.contract.gpus import memory_bandwidth_gbs, memory_gb, peak_tflops
from meshrun.launcher.contract.spec import dsconfig
from meshrun.launcher.contract.spec.job import JobSpec, Prediction
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.submit.config.cluster import ClusterProfile, Partition
from meshrun.submit.planning.calibration import Calibration, load_all
from meshrun.submit.planning.estimate import Memory, fits, memory_per_gpu
from meshrun.submit.planning.steptime import CPU_MEMORY_GBS, GEMM_EFFICIENCY, Hardware, StepTime, prediction, step_time

MAX_MICRO_BATCH = 64
"""The largest micro-batch the search tries."""


@dataclass(frozen=True)
class Choice:
    """A layout the search found, with its memory and time."""

    spec: JobSpec
    """The job with the layout applied."""
    memory: Memory
    """Its worst stage's bytes per GPU."""
    time: Optional[StepTime]
    """Its step time (None when the GPU type's peak is unknown)."""

    @property
    def layout(self) -> dict[str, object]:
        """The `recommended` object of `meshrun plan --json`."""
        par, t = self.spec.parallel, self.spec.trainer
        out: dict[str, object] = {
            "nodes": self.spec.resources.nodes,
            "dp": par.dp,
            "tp": par.tp,
            "pp": par.pp,
            "micro_batch": t.micro_batch,
            "accumulation": t.global_batch // (t.micro_batch * par.dp),
            "activation_checkpointing": t.activation_checkpointing,
            "sequence_parallel": par.sequence_parallel,
        }
        if dsconfig.uses_deepspeed(self.spec):
            out["zero"] = dsconfig.zero_stage(self.spec)
        else:
            out["dp_mode"] = par.dp_mode
        return out

    def overrides(self, against: JobSpec) -> list[str]:
        """The `--set` items that turn `against` into this layout (only the keys that differ)."""
        keys = {
            "resources.nodes": (against.resources.nodes, self.spec.resources.nodes),
            "parallel.dp": (against.parallel.dp, self.spec.parallel.dp),
            "parallel.tp": (against.parallel.tp, self.spec.parallel.tp),
            "parallel.pp": (against.parallel.pp, self.spec.parallel.pp),
            "parallel.dp_mode": (against.parallel.dp_mode, self.spec.parallel.dp_mode),
            "parallel.zero": (against.parallel.zero, self.spec.parallel.zero),
            "parallel.sequence_parallel": (against.parallel.sequence_parallel, self.spec.parallel.sequence_parallel),
            "train.micro_batch": (against.trainer.micro_batch, self.spec.trainer.micro_batch),
            "train.activation_checkpointing": (
                against.trainer.activation_checkpointing,
                self.spec.trainer.activation_checkpointing,
            ),
        }
        return [f"{k}={_text(new)}" for k, (old, new) in keys.items() if old != new]


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def gpu_memory(part: Partition) -> Optional[float]:
    """One GPU's memory (GiB) on a partition: the profile's gpu_memory_gb, else the GPU type's datasheet."""
    if part.gpu_memory_gb:
        return float(part.gpu_memory_gb)
    return memory_gb(part.gpu_type) if part.gpu_type else None


def hardware(cluster: ClusterProfile, part: Partition, measured: Optional[Calibration] = None) -> Optional[Hardware]:
    """The partition's figures for the time model: the GPU type's datasheet and the profile's interconnect, with
    what `meshrun doctor` measured there in their place where given; None when its GPU type is unknown."""
    name = part.gpu_type or ""
    peak, bandwidth = peak_tflops(name), memory_bandwidth_gbs(name)
    if not part.gpus_per_node or peak is None or bandwidth is None:
        return None
    net = cluster.interconnect
    hw = Hardware(peak, bandwidth, part.gpus_per_node, net.nvlink_gbytes_s, net.ib_gbytes_s)
    if measured is None or measured.kind != "gpu" or not measured.gemm_tflops:
        return hw
    # Doctor's timed blocks give the share of the GEMM a block reaches and a block's fixed cost (kernel launches).
    share = measured.block_efficiency or GEMM_EFFICIENCY
    return replace(
        hw,
        compute_tflops=measured.gemm_tflops * share,
        layer_overhead_s=(measured.layer_overhead_us or 0.0) / 1e6 if measured.block_efficiency else 0.0,
        nvlink_gbytes_s=measured.intra_node_busbw_gbps or hw.nvlink_gbytes_s,
        ib_gbytes_s=measured.inter_node_busbw_gbps or hw.ib_gbytes_s,
        source=calibrated_on(measured),
        latency_s=(measured.allreduce_latency_us or 0.0) / 1e6,
    )


def cpu_hardware(ranks_per_node: int, measured: Calibration) -> Hardware:
    """The figures of CPU ranks, all measured by `meshrun doctor` on a CPU job: fp32 GEMM and gloo all-reduces."""
    gemm = measured.gemm_tflops or 0.0
    intra = measured.intra_node_busbw_gbps or 0.0
    return Hardware(
        peak_tflops=gemm,
        memory_gbs=CPU_MEMORY_GBS,
        gpus_per_node=ranks_per_node,
        nvlink_gbytes_s=intra,
        ib_gbytes_s=measured.inter_node_busbw_gbps or intra,
        # With doctor's block timings the matmuls run at the GEMM's rate, the rest of a block in its own term.
        compute_tflops=gemm if measured.layer_element_ns is not None else gemm * GEMM_EFFICIENCY,
        cpu=True,
        source=calibrated_on(measured),
        latency_s=(measured.allreduce_latency_us or 0.0) / 1e6,
        overlap_dp=False,
        layer_overhead_s=(measured.layer_overhead_us or 0.0) / 1e6,
        layer_element_s=(measured.layer_element_ns or 0.0) / 1e9,
        node_cpus=measured.node_cpus or 0,
    )


def job_hardware(
    spec: JobSpec, cluster: ClusterProfile, part: Partition, measured: dict[str, Calibration]
) -> Optional[Hardware]:
    """The figures a job's step time is estimated with (`measured`: calibration.load_all of the cluster): its
    partition's GPUs (doctor's figures, else the datasheet's), or the CPU figures doctor measured for a CPU job;
    None when there are none."""
    if not spec.resources.gpus_per_node:
        cpu = measured.get(f"{part.name}:cpu")
        return cpu_hardware(spec.resources.tasks_per_node or 1, cpu) if cpu else None
    return hardware(cluster, part, measured.get(part.name))


def estimated_step(spec: JobSpec, cluster: ClusterProfile, part: Partition) -> Optional[StepTime]:
    """The job's step time on `part` by what is known of it (doctor's calibration first); None: unknown."""
    hw = job_hardware(spec, cluster, part, load_all(cluster.name))
    return step_time(spec, hw) if hw is not None else None


def predicted(spec: JobSpec, cluster: ClusterProfile, part: Optional[Partition]) -> Optional[Prediction]:
    """The step time and memory a trainer job carries for rank 0 to check the run against (RunInfo.prediction),
    by what is known of `part` (doctor's calibration first); None for a command job or where nothing times it."""
    if spec.train is None or spec.command is not None or part is None:
        return None
    hw = job_hardware(spec, cluster, part, load_all(cluster.name))
    if hw is None:
        return None
    return prediction(spec, hw, memory_per_gpu(spec).total if spec.resources.gpus_per_node else None)


def calibrated_on(measured: Calibration) -> str:
    return f"calibrated on {measured.date} (doctor job {measured.job}, {measured.device})"


def _divisors(n: int, at_most: int) -> list[int]:
    """The divisors of n up to `at_most`: a layout needs no more (pp <= the GPUs, micro <= MAX_MICRO_BATCH),
    and n_layers or global_batch may be huge (fuzzing found n_layers 10^7 taking seconds)."""
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def layouts(spec: JobSpec, cluster: ClusterProfile, part: Partition, nodes: int) -> Iterator[JobSpec]:
    """Every valid layout of `spec` on `nodes` nodes of `part` (the model, batch and engine kept)."""
    cfg, t = spec.trainer.model, spec.trainer
    gpus = part.gpus_per_node
    world = nodes * gpus
    deepspeed = dsconfig.uses_deepspeed(spec)
    domain = min(gpus, cluster.interconnect.nvlink_domain)
    tps = [1] if deepspeed else [d for d in _divisors(domain, domain) if cfg.n_heads % d == 0]
    for tp in tps:
        for pp in [1] if deepspeed else _divisors(cfg.n_layers, world):
            if world % (tp * pp):
                continue
            dims = ParallelDims(dp=world // (tp * pp), tp=tp, pp=pp)
            sp = tp > 1 and cfg.seq_len % tp == 0
            problem = spec.layout_problem(dims, world_size=world, ranks_per_node=gpus, sequence_parallel=sp)
            if problem or t.global_batch % dims.dp:
                continue
            for micro in _divisors(t.global_batch // dims.dp, MAX_MICRO_BATCH):
                if micro > MAX_MICRO_BATCH or dims.batch_problem(t.global_batch, micro):
                    continue
                for mode in _zero_stages(spec) if deepspeed else ("fsdp", "ddp"):
                    for ac in (False, True):
                        yield _apply(spec, nodes, gpus, dims, sp, micro, mode, ac)


def _zero_stages(spec: JobSpec) -> list[str]:
    """The ZeRO stages the spec's offload settings allow (optimizer offload: 1-3; parameter offload: 3)."""
    par = spec.parallel
    low = 3 if par.offload_params else 1 if par.offload_optimizer else 0
    return [f"zero{stage}" for stage in range(low, 4)]


def _apply(
    spec: JobSpec, nodes: int, gpus: int, dims: ParallelDims, sp: bool, micro: int, mode: str, ac: bool
) -> JobSpec:
    par = spec.parallel
    parallel = replace(par, dp=dims.dp, tp=dims.tp, pp=dims.pp, sequence_parallel=sp)
    if mode.startswith("zero"):
        parallel = replace(parallel, zero=int(mode[4:]))
    else:
        parallel = replace(parallel, dp_mode=mode)  # type: ignore[arg-type]
    resources = replace(spec.resources, nodes=nodes, gpus_per_node=gpus, tasks_per_node=None)
    train = replace(spec.trainer, micro_batch=micro, activation_checkpointing=ac)
    return replace(spec, resources=resources, parallel=parallel, train=train)


def _choices(
    spec: JobSpec, cluster: ClusterProfile, part: Partition, nodes: int, measured: Optional[Calibration]
) -> Iterator[Choice]:
    hw = hardware(cluster, part, measured)
    for candidate in layouts(spec, cluster, part, nodes):
        yield Choice(candidate, memory_per_gpu(candidate), step_time(candidate, hw) if hw else None)


def _rank(choice: Choice) -> tuple[float, int]:
    return (choice.time.tokens_per_s if choice.time else 0.0, -choice.memory.total)


def best(
    spec: JobSpec, cluster: ClusterProfile, part: Partition, nodes: int, measured: Optional[Calibration] = None
) -> Optional[Choice]:
    """The fastest layout that fits `nodes` nodes of `part` (None: none fits, or the GPU size is unknown), timed
    with what doctor `measured` there when given."""
    size = gpu_memory(part)
    fitting = [c for c in _choices(spec, cluster, part, nodes, measured) if fits(c.memory, size)]
    return max(fitting, key=_rank) if fitting else None


def node_counts(part: Partition, start: int = 1) -> list[int]:
    """Node counts to try: powers of two from `start`, up to the partition's max_nodes (or 1024)."""
    limit = part.max_nodes or 1024
    counts, n = [], start
    while n <= limit:
        counts.append(n)
        n *= 2
    if limit not in counts and limit > start:
        counts.append(limit)
    return counts


def smallest(
    spec: JobSpec, cluster: ClusterProfile, part: Partition, measured: Optional[Calibration] = None
) -> Optional[Choice]:
    """The fewest nodes of `part` on which some layout fits, and the fastest layout there."""
    for nodes in node_counts(part):
        choice = best(spec, cluster, part, nodes, measured)
        if choice is not None:
            return choice
    return None


def nearest_fix(spec: JobSpec, cluster: ClusterProfile, part: Partition) -> str:
    """The refusal's fix: the fastest layout that fits the job's own nodes, else the fewest nodes that do."""
    choice = best(spec, cluster, part, spec.resources.nodes)
    if choice is not None:
        return "set " + " ".join(choice.overrides(spec))
    more = smallest(spec, cluster, part)
    if more is None:
        return (
            f"no layout fits any number of {part.name!r} nodes (up to {node_counts(part)[-1]}); shrink the model "
            f"or train.micro_batch, or use a GPU with more memory"
        )
    return f"no layout fits {spec.resources.nodes} node(s); it fits on {more.spec.resources.nodes}: set " + " ".join(
        more.overrides(spec)
    )
