"""The mesh dry run: the bytes of model state each rank would hold, counted on the real, sharded model.

    echo '{"name": "x", ...JobSpec...}' | python -m meshrun.launcher.probes.meshcount      # -> {"stages": [...], ...}

The real model part (launcher/train/model.py, one pipeline stage) is built on the meta device (shapes and
dtypes, no storage) and split by the real parallel code (launcher/train/parallel.py: the ("pp", "dp", "tp")
mesh, DTensor tensor parallelism, FSDP2 / replicate / DDP) under torch's fake process-group backend,
which answers every collective at once: a world of thousands of ranks costs no more than one of eight,
and no step runs. Parameters are counted from what the rank really holds (each DTensor's local shard,
its shape times its dtype's size); gradients and optimizer state follow from them by the engine's rules.

One representative rank per pipeline stage is counted: its (dp, tp) = (0, 0). The dp and tp ranks of a
stage build the same modules and hold equal shards when the sizes divide (ParallelDims checks heads and
vocabulary against tp; FSDP2 pads every shard to the first one's size when dim 0 does not divide by dp),
so rank 0 of the stage holds what each of them allocates (tests/integration/test_meshcount.py counts two
ranks of a stage and finds them equal). Middle stages build the same blocks under other names, so one
count serves all of them.

Launcher side: never imports submit. submit/planning/meshcheck.py runs this module with the job's interpreter
and builds meshrun.launcher.contract.spec.modelshape.StageBytes from the JSON it prints. Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator, TextIO

from meshrun.launcher.contract.exitcodes import EXIT_FAILED, EXIT_INPUT
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.modelshape import ModelPart, StageBytes
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.launcher.contract.spec.schema import SchemaError, load

FP32 = 4
ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq per parameter, in the parameter's dtype (fp32 masters here)."""


@dataclass(frozen=True)
class Held:
    """What counting one rank's parameters found: elements and bytes of its local shards."""

    numel: int
    """Elements of the local shards."""
    nbytes: int
    """Bytes of the local shards (each shard's elements times its dtype's size)."""


def dims_of(job: JobSpec) -> ParallelDims:
    """The job's layout, refused with one line when it cannot be built (the planner's own checks)."""
    if job.train is None:
        raise SchemaError("train", None, "a command job's model is your program: the mesh dry run counts train: jobs")
    model = job.trainer.model
    if model.d_model % model.n_heads or (model.d_model // model.n_heads) % 2:  # what GPT() refuses, as input
        raise SchemaError(
            "train.model.d_model",
            model.d_model,
            f"must split into n_heads({model.n_heads}) heads of an even size (rotary embeddings rotate pairs)",
        )
    dims = job.dims
    problem = job.layout_problem(dims)
    if problem:
        raise SchemaError(problem.key, problem.value, problem.fix)
    return dims


# ------------------------------------------------------------------ the real model, split for one rank


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Join a fake process group as `rank` for the block: collectives return at once, nothing is sent."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():  # never replace a real world this process is part of
        raise RuntimeError("the mesh dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_part(job: JobSpec, part: ModelPart) -> Any:
    """The GPT part on the meta device: the model's own constructor, minus the seeded init (meta tensors
    have no values to draw, and a generator cannot live there)."""
    import torch

    from meshrun.launcher.train.model import GPT

    class MetaGPT(GPT):
        def init_weights(self, seed: int) -> None:
            pass

    with torch.device("meta"):
        return MetaGPT(job.trainer.model, part=part)


def held_by_rank(job: JobSpec, rank: int) -> Held:
    """Build `rank`'s model part on the meta device, split it as the native engine does, count its shards.

    Mirrors launcher/train/engines/native.py's build: the ("pp", "dp", "tp") mesh, tensor parallel, then data parallel.
    The caller is in a fake world of the job's size as `rank` (`fake_world`; `count_rank` does both).
    """
    import torch

    from meshrun.launcher.train.parallel import apply_data_parallel, apply_tensor_parallel, build_mesh
    from meshrun.launcher.train.runtime import AMP_DTYPES, Runtime

    dims = dims_of(job)
    coords = dims.coordinates(rank)
    runtime = Runtime(torch.device("cpu"), "fake", AMP_DTYPES.get(job.trainer.precision))
    mesh = build_mesh(dims, runtime)
    model = _meta_part(job, ModelPart.stage(job.trainer.model, coords.pp, dims.pp))
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], job.parallel.sequence_parallel)
    if not (job.parallel.dp_mode == "ddp" and dims.tp == 1 and dims.pp == 1):
        # Plain DDP changes no parameter (it replicates them as they are) and its constructor
        # broadcasts values, which meta tensors lack: the unwrapped part is what each rank holds.
        apply_data_parallel(model, job.parallel.dp_mode, dims, mesh["dp"], runtime)
    return _count(model.parameters())


def _count(params: Any) -> Held:
    numel = nbytes = 0
    for param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        numel += local.numel()
        nbytes += local.numel() * local.element_size()
    return Held(numel, nbytes)


# ------------------------------------------------------------------ the engine's rules


def native_bytes(stage: int, held: Held) -> StageBytes:
    """Native engine: the parameters are fp32 masters (FSDP2's param_dtype is for compute, gathered per
    use), gradients are fp32 and shaped like them (FSDP2 reduce-scatters in fp32; replicated under ddp),
    AdamW keeps 2 fp32 states per parameter."""
    return StageBytes(stage, held.nbytes, held.nbytes, ADAM_STATES * held.nbytes)


def deepspeed_bytes(job: JobSpec, held: Held) -> StageBytes:
    """DeepSpeed ZeRO by stage, for P parameters (the whole model: the engine runs dp only) over dp ranks.

    fp32 (measured, bench/deepspeed.py): params 4P, grads 4P, Adam 8P; ZeRO-1 partitions Adam and adds a
    4P/dp fp32 master partition, ZeRO-2 also the grads, ZeRO-3 the params too, with no extra master.
    bf16/fp16 (the ZeRO paper's 2 + 2 + 12): 2-byte params and grads, fp32 master + Adam 12P, partitioned
    the same way. DeepSpeed's partitions are the flat buffer split in dp equal parts (ceil). Offloaded
    state lives in CPU memory: it counts 0 on the rank's device.
    """
    from meshrun.launcher.contract.spec.dsconfig import zero_stage

    p, dp, zero = held.numel, job.parallel.dp, zero_stage(job)
    part = math.ceil(p / dp)
    half = job.trainer.precision in ("bf16", "fp16")
    width = 2 if half else FP32
    params = width * (part if zero == 3 else p)
    grads = width * (part if zero >= 2 else p)
    if half:
        optimizer = (FP32 + ADAM_STATES * FP32) * (part if zero >= 1 else p)
    else:
        optimizer = ADAM_STATES * FP32 * (part if zero >= 1 else p) + (FP32 * part if zero in (1, 2) else 0)
    par = job.parallel
    return StageBytes(0, 0 if par.offload_params else params, grads, 0 if par.offload_optimizer else optimizer)


# ------------------------------------------------------------------ the job


def count_rank(job: JobSpec, rank: int) -> Held:
    """Any one rank's shards, counted in its own fake world of the job's size."""
    with fake_world(rank, dims_of(job).world_size):
        return held_by_rank(job, rank)


def representative_rank(dims: ParallelDims, stage: int) -> int:
    """The rank at (pp, dp, tp) = (stage, 0, 0)."""
    return stage * dims.dp * dims.tp


def count(job: JobSpec) -> list[StageBytes]:
    """Per pipeline stage, the bytes one of its ranks holds, from the real model split in a fake world."""
    dims = dims_of(job)
    if job.trainer.engine == "deepspeed":
        # DeepSpeed partitions a flat buffer of the whole model (dp only): its split is arithmetic on P.
        whole = _meta_part(job, ModelPart.whole(job.trainer.model))
        return [deepspeed_bytes(job, _count(whole.parameters()))]
    seen: dict[tuple[bool, bool], Held] = {}
    stages = []
    for stage in range(dims.pp):
        part = ModelPart.stage(job.trainer.model, stage, dims.pp)
        key = (part.embed, part.head)  # equal block counts: only the ends differ between stages
        if key not in seen:
            seen[key] = count_rank(job, representative_rank(dims, stage))
        stages.append(native_bytes(stage, seen[key]))
    return stages


def report(job: JobSpec) -> dict[str, Any]:
    """The JSON this module prints: the stages, and what was counted and how long importing and counting took."""
    started = time.perf_counter()
    import meshrun.launcher.train.parallel  # noqa: F401  (torch and its distributed packages: timed apart from the count)

    imported = time.perf_counter()
    stages = count(job)
    return {
        "stages": [asdict(s) for s in stages],
        "world_size": job.world_size,
        "engine": job.trainer.engine,
        "import_seconds": round(imported - started, 3),
        "seconds": round(time.perf_counter() - imported, 3),
    }


def main(stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    try:
        data = json.loads(stdin.read())
        job = load(JobSpec, data)
        out = report(job)
    except json.JSONDecodeError as exc:
        stderr.write(f"meshcount: error: stdin: not valid JSON ({exc.msg} at line {exc.lineno}); give a JobSpec\n")
        return EXIT_INPUT
    except SchemaError as exc:
        # The line for a person on stderr; the parts on stdout for submit/planning/meshcheck.py to raise again.
        stderr.write(f"meshcount: error: {exc}\n")
        stdout.write(json.dumps({"error": {"key": exc.key, "value": exc.value, "fix": exc.fix}}, default=str) + "\n")
        return EXIT_INPUT
    except Exception as exc:  # a bug here, not bad input: one line, never a traceback
        stderr.write(f"meshcount: internal error: {type(exc).__name__}: {exc}; this is a meshrun bug\n")
        return EXIT_FAILED
    stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
