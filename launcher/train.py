"""The built-in trainer: one short linear loop (torchtitan's shape) that always tears down.

3D parallel: data (FSDP2 / replicate / DDP) x tensor (DTensor, optionally sequence
parallel) x pipeline (GPipe / 1F1B) on a ("pp", "dp", "tp") mesh. Batch sizes are
global (Megatron): accumulation = global_batch / (micro_batch * dp), and with pp > 1
those micro-batches are the pipeline's, so changing only the layout changes no number.
Rank 0 appends one JSON line per logged step to RUN_DIR/metrics.jsonl (see metrics.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from launcher import divergence, resume, trainstate
from launcher.busy import BusyClock
from launcher.checkpoint import Checkpointer
from launcher.checkpoint import step_dir as ckpt_step_dir
from launcher.data import (
    Layout,
    MicroBatches,
    Prefetcher,
    TokenDataset,
    TrainStream,
    check_token_ids,
    check_train_data,
    val_steps,
)
from launcher.entry import node_dir_for
from launcher.env import RankEnv, setdefault_env
from launcher.exitcodes import EXIT_DIVERGED
from launcher.faults import faults_for
from launcher.gpus import mfu_peak
from launcher.losswatch import Watch as _Watch
from launcher.metrics import MetricsLog, perplexity
from launcher.model import GPT, ModelPart, param_count
from launcher.optim import LossScaler, build_optimizer, clip_factor, global_grad_norm, lr_at, scale_grads_
from launcher.parallel import apply_data_parallel, apply_tensor_parallel, build_mesh, uses_fsdp_precision
from launcher.parallel_dims import Coordinates, ParallelDims
from launcher.pipeline import Executor, PipelineExecutor, PlainExecutor, StepLoss
from launcher.preempt import EXIT_FINISHED, EXIT_GAVE_UP, EXIT_REQUEUE, StopFlag
from launcher.rundir import RunDir, attempt_id
from launcher.runtime import Runtime, check_tasks, init_distributed, pick_runtime
from launcher.schema import SchemaError
from launcher.spec import JobSpec, RunSpec, Train

# ------------------------------------------------------------------ checks before any collective


def check_layout(job: JobSpec, env: RankEnv) -> ParallelDims:
    """Validate the parallel layout and the batch arithmetic before any collective can hang on it."""
    par, cfg = job.parallel, job.trainer
    dims = ParallelDims(par.dp, par.tp, par.pp)
    problem = dims.problem(
        env.world_size,
        cfg.model.n_layers,
        cfg.model.n_heads,
        env.local_world_size,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.model.seq_len,
        sequence_parallel=par.sequence_parallel,
    ) or dims.batch_problem(cfg.global_batch, cfg.micro_batch)
    if problem:
        raise SchemaError(problem.key, problem.value, problem.fix)
    return dims


def check_eval_data(job: JobSpec, dataset: TokenDataset) -> None:
    cfg = job.trainer
    usable = min(dataset.num_windows["val"], cfg.eval_sequences)
    if cfg.eval_every > 0 and usable < cfg.global_batch:
        raise SchemaError(
            "train.eval_sequences",
            cfg.eval_sequences,
            f"validation uses whole global batches, but min(eval_sequences, "
            f"{dataset.num_windows['val']} held-out windows of {dataset.path}) = {usable} < "
            f"global_batch ({cfg.global_batch}); raise eval_sequences or data.val_fraction, use a "
            "bigger token file, or set eval_every: 0",
        )


def check_data(job: JobSpec, dataset: TokenDataset) -> None:
    """Enough sequences for a step and for validation, and every id inside the vocabulary."""
    check_train_data(dataset, job.trainer.global_batch)
    check_eval_data(job, dataset)
    check_token_ids(dataset, job.trainer.model.vocab_size)


def eval_due(cfg: Train, step: int, last: int) -> bool:
    """Validate every eval_every steps and at the last one (eval_every > 0), whatever log_every is."""
    return cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == last)


# ------------------------------------------------------------------ the trainer's objects


@dataclass
class Trainer:
    """Everything one rank trains with; built by `build_trainer` (the benches build it too)."""

    job: JobSpec
    dims: ParallelDims
    coords: Coordinates
    runtime: Runtime
    layout: Layout
    dataset: TokenDataset
    stream: TrainStream
    model: GPT
    """This rank's part of the model (a pipeline stage or the whole), sharded in place."""
    executor: Executor
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    params: list[nn.Parameter]
    pp_group: Optional[dist.ProcessGroup]

    @property
    def cfg(self) -> Train:
        return self.job.trainer


@dataclass(frozen=True)
class StepResult:
    loss: StepLoss
    grad_norm: torch.Tensor
    """The true global gradient norm before clipping (0-dim; read it only when logging: a host sync)."""
    lr: float


def build_trainer(job: JobSpec, env: RankEnv, runtime: Runtime, dataset: TokenDataset) -> Trainer:
    """Mesh -> model part -> tensor parallel -> data parallel -> executor -> optimizer (needs a process group)."""
    cfg, par = job.trainer, job.parallel
    dims = ParallelDims(par.dp, par.tp, par.pp)
    coords = dims.coordinates(env.rank)
    layout = Layout(cfg.global_batch, cfg.micro_batch, dp_rank=coords.dp, dp_size=dims.dp)
    mesh = build_mesh(dims, runtime)
    with torch.device(runtime.device):  # built where it runs: no full-size copy on the host for GPUs
        model = GPT(
            cfg.model,
            seed=cfg.seed,
            activation_checkpointing=cfg.activation_checkpointing,
            part=ModelPart.stage(cfg.model, coords.pp, dims.pp),
        )
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], par.sequence_parallel)
    module = apply_data_parallel(model, par.dp_mode, dims, mesh["dp"], runtime)
    autocast_dtype = None if uses_fsdp_precision(par.dp_mode, dims) else runtime.amp_dtype
    scaler = LossScaler(enabled=runtime.amp_dtype == torch.float16)
    executor: Executor
    if dims.pp > 1:
        executor = PipelineExecutor(
            module,
            coords.pp,
            dims.pp,
            mesh["pp"],
            runtime.device,
            layout.accumulation,
            par.pp_schedule,
            autocast_dtype,
            scaler,
        )
    else:
        executor = PlainExecutor(module, runtime.device, autocast_dtype, scaler)
    params = [p for p in model.parameters() if p.requires_grad]  # after wrapping: the sharded ones
    return Trainer(
        job=job,
        dims=dims,
        coords=coords,
        runtime=runtime,
        layout=layout,
        dataset=dataset,
        stream=TrainStream(dataset, layout, cfg.seed),
        model=model,
        executor=executor,
        optimizer=build_optimizer(params, cfg),
        scaler=scaler,
        params=params,
        pp_group=mesh["pp"].get_group() if dims.pp > 1 else None,
    )


# ------------------------------------------------------------------ one step, evaluation


def train_step(t: Trainer, step: int, micro_batches: MicroBatches) -> StepResult:
    """Forward/backward over the step's micro batches, true global norm, clip, optimizer step."""
    lr = lr_at(step, t.cfg)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    loss = t.executor.train_step(micro_batches)
    inv_scale = 1.0 / t.scaler.loss_multiplier()
    norm = global_grad_norm(t.params, t.runtime.device, t.pp_group) * inv_scale
    # The norm is global, so every rank takes the same decision (fp16 only: it is a host sync).
    if t.scaler.update(bool(torch.isfinite(norm)) if t.scaler.enabled else True):
        scale_grads_(t.params, clip_factor(norm, t.cfg.grad_clip) * inv_scale)
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, norm, lr)


def mean_over_ranks(total: torch.Tensor, count: int) -> float:
    """sum(totals) / sum(counts) over all ranks (gloo has no AVG op, so SUM both, then divide).

    Ranks without a loss (pipeline stages before the last) add 0/0; the tp ranks of the
    last stage all add the same loss and count, which leaves the mean unchanged.
    """
    packed = torch.stack([total.float(), torch.tensor(float(count), device=total.device)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return float(packed[0] / packed[1])


def evaluate(t: Trainer) -> float:
    """Mean loss over the fixed validation set (the same set and micro batches whatever the layout)."""
    t.model.eval()
    total, count = torch.zeros((), device=t.runtime.device), 0
    for micro_batches in val_steps(t.dataset, t.layout, t.cfg.eval_sequences):
        part = t.executor.eval_step(micro_batches)
        total, count = total + part.total, count + part.count
    t.model.train()
    return mean_over_ranks(total, count)


# ------------------------------------------------------------------ the loop


def announce(t: Trainer, env: RankEnv) -> None:
    if env.rank != 0:
        return
    cfg, par, rt = t.cfg, t.job.parallel, t.runtime
    note = (
        f" (precision {cfg.precision} requested; CPU ranks compute in fp32)"
        if not rt.cuda and cfg.precision != "fp32"
        else ""
    )
    extras = (
        [par.dp_mode]
        + ([par.pp_schedule] if t.dims.pp > 1 else [])
        + (["sequence parallel"] if par.sequence_parallel and t.dims.tp > 1 else [])
    )
    print(
        f"meshrun: GPT {param_count(cfg.model) / 1e6:.2f}M params, {env.world_size} rank(s), "
        f"dp={t.dims.dp} tp={t.dims.tp} pp={t.dims.pp} ({', '.join(extras)}), {rt.backend} on {rt.device.type}, "
        f"global batch {cfg.global_batch} = micro {cfg.micro_batch} x dp {t.dims.dp} "
        f"x accumulation {t.layout.accumulation}, precision {rt.precision}{note}",
        flush=True,
    )


def train(run_spec: RunSpec, env: RankEnv, flag: Optional[StopFlag] = None) -> int:
    """Train the reference GPT as the spec says; returns the process exit code (see preempt.py).

    `flag` is the stop flag the caller installed (launcher.entry does, before importing torch).
    """
    job = run_spec.job
    check_tasks(job, env)
    check_layout(job, env)
    dataset = TokenDataset(job.data.path, job.trainer.model.seq_len, job.data.val_fraction)
    check_data(job, dataset)
    setdefault_env(run_spec.run.nccl_env, os.environ)  # the cluster preset, unless the user set a key
    runtime = pick_runtime(job, env, os.environ)
    torch.manual_seed(job.trainer.seed)
    own_flag = flag is None
    flag = StopFlag().install() if flag is None else flag
    peak, no_mfu = mfu_peak(run_spec.run.gpu_type, runtime.cuda, device_name(runtime))
    metrics = MetricsLog(
        run_spec.run.run_dir, enabled=env.rank == 0, steps=job.trainer.steps, peak_tflops=peak, rank=env.rank
    )
    metrics.stamp(0, "setup")  # before the rendezvous: a hang there is a hang in setup
    try:
        init_distributed(env, runtime)
        trainer = build_trainer(job, env, runtime, dataset)
        saver = make_checkpointer(run_spec, env, metrics)
        first = start_step(trainer, saver, run_spec, env)
        if first is None:
            return EXIT_GAVE_UP
        metrics.resume_at(first)
        announce(trainer, env)
        if env.rank == 0 and no_mfu:
            print(f"[meshrun] no MFU: {no_mfu}", flush=True)
        code = run_loop(trainer, env, metrics, first, saver=saver, flag=flag, run_spec=run_spec)
        saver.close()
        return code
    finally:
        if own_flag:
            flag.uninstall()
        metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def device_name(runtime: Runtime) -> str:
    return torch.cuda.get_device_name(runtime.device) if runtime.cuda else ""


def gpu_memory(runtime: Runtime) -> dict[str, float]:
    """Peak GPU memory since the start (TensorBoard only): allocated, reserved, allocator retries
    (retries > 0: the caching allocator had to free and retry, a sign of fragmentation near the limit)."""
    if not runtime.cuda:
        return {}
    stats = torch.cuda.memory_stats(runtime.device)
    return {
        "gpu_memory/peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / 2**30,
        "gpu_memory/peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
        "gpu_memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }


def make_checkpointer(run_spec: RunSpec, env: RankEnv, metrics: Optional[MetricsLog] = None) -> Checkpointer:
    """Checkpoints get their own gloo group: an async save's collectives run in a background
    thread and must never interleave with the training thread's on the default group."""
    policy = run_spec.job.checkpoint
    group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    root = Path(run_spec.run.checkpoint_dir or RunDir(run_spec.run.run_dir).default_checkpoints)
    staged = bool(run_spec.run.scratch_dir)
    on_commit = _committed(root, metrics, staged) if env.rank == 0 and metrics is not None else None
    saver = Checkpointer(
        root,
        keep=policy.keep,
        keep_every=policy.keep_every,
        async_save=policy.async_save,
        process_group=group,
        coordinator=env.rank == 0,
        on_commit=on_commit,
        # With node-local scratch the save is staged there (the stall pays for the fast disk only) and
        # the node's sidecar copies it to `root`; resume always reads `root`.
        stage_root=Path(node_dir_for(run_spec, os.environ).staging) if staged else None,
        node_coordinator=env.local_rank == 0,
        attempt=attempt_id(os.environ),
        nodes=env.num_nodes,
        node_rank=env.node_rank,
    )
    saver.prepare()
    return saver


def _committed(root: Path, metrics: MetricsLog, staged: bool) -> Callable[[int, float], None]:
    """Rank 0's reaction to every commit, whichever call commits it (a poll, the next save's
    wait, the final save, a save on a signal): the metrics event and the crash-loop guard.
    A save staged on scratch is not yet on shared storage: the sidecar's copier resets the guard
    when it commits there, and the event says "staged"."""

    def on_commit(step: int, stall_s: float) -> None:
        if not staged:
            resume.progress_made(root)  # a newer checkpoint: earlier failed resumes stop counting
        event = {"event": "checkpoint", "checkpoint_step": step, "save_stall_s": round(stall_s, 4)}
        metrics.event({**event, **({"staged": True} if staged else {}), "time": time.time()})

    return on_commit


def start_step(t: Trainer, saver: Checkpointer, run_spec: RunSpec, env: RankEnv) -> Optional[int]:
    """Resume from the newest complete checkpoint (or the requested one); None: the guard gave up."""
    choice = trainstate.choose_start(saver.root, run_spec.job.checkpoint.resume_step, env)
    if env.rank == 0:
        print(f"[meshrun] {choice.note}", flush=True)
    if choice.gave_up:
        return None
    if choice.step is None:
        return 1
    step = trainstate.load(saver, t, ckpt_step_dir(saver.root, choice.step), env)
    return step + 1


def run_loop(
    t: Trainer,
    env: RankEnv,
    metrics: MetricsLog,
    first: int = 1,
    last: Optional[int] = None,
    saver: Optional[Checkpointer] = None,
    flag: Optional[StopFlag] = None,
    run_spec: Optional[RunSpec] = None,
) -> int:
    """Steps first..last (default: to train.steps); logs every log_every steps and at the last one.

    With a saver: checkpoints every checkpoint.every steps and at the end; with a flag: every
    step the ranks agree whether any of them was signalled, and if so all save after the same
    step and return EXIT_REQUEUE. A NaN/inf loss or grad norm stops every rank before any save of
    that step and returns EXIT_DIVERGED (when it is checked: launcher/divergence.py).
    """
    cfg = t.cfg
    last = cfg.steps if last is None else last
    every = run_spec.job.checkpoint.every if run_spec else 0
    prefetch = Prefetcher(t.stream, pin_memory=t.runtime.cuda)
    clock = _Clock(first - 1)
    busy = BusyClock(t.runtime.cuda)
    faults = faults_for(env.rank, env.restart_count)
    sentinel = divergence.Sentinel(t.runtime.device, check_norm=not t.scaler.enabled)
    watch = _Watch.for_job(t.job, env, run_spec)
    try:
        for step in range(first, last + 1):
            metrics.stamp(step, "step", busy.last)
            busy.start()
            faults.at_step(step)
            micro_batches, wait = prefetch.next_step()
            clock.waited += wait + faults.delay_data()
            result = train_step(t, step, micro_batches)
            sentinel.observe(step, result.loss.total, result.grad_norm)
            busy.stop()
            validate = eval_due(cfg, step, last)
            logged = step % cfg.log_every == 0 or step == last or validate
            if logged:
                record = log_step(
                    t, env, metrics, step, result, clock, saver.last_committed if saver else None, validate=validate
                )
                watch.logged(record)
            save_due = (
                saver is not None and run_spec is not None and (step == last or bool(every and step % every == 0))
            )
            if flag is None and not (logged or save_due):
                continue
            # The stop flag's all-reduce carries the non-finite check (no extra sync): see divergence.py.
            stopping, bad_step = divergence.agree(bool(flag and flag.raised), sentinel)
            if bad_step is not None:
                watch.diverged(bad_step, saver)
                return EXIT_DIVERGED
            if saver is None or run_spec is None:
                continue
            saver.poll()
            if stopping:
                metrics.stamp(step, "checkpoint")
                _save_now(saver, t, step, env, run_spec, watch.val_loss(step))
                if env.rank == 0:
                    print(
                        f"[meshrun] stopping after step {step} on {flag.describe() if flag and flag.raised else 'a peer'}"
                        f"'s signal: checkpoint saved, exit {EXIT_REQUEUE} (requeue)",
                        flush=True,
                    )
                return EXIT_REQUEUE
            if save_due:
                metrics.stamp(step, "checkpoint")
                trainstate.save(saver, t, step, env, run_spec, watch.val_loss(step))
        if saver is not None:
            saver.wait()
        return EXIT_FINISHED
    finally:
        prefetch.close()


@dataclass
class _Clock:
    last_step: int
    waited: float = 0.0
    start: float = field(default_factory=time.perf_counter)
    last_time: float = field(default_factory=time.perf_counter)


def _save_now(
    saver: Checkpointer, t: Trainer, step: int, env: RankEnv, run_spec: RunSpec, val_loss: Optional[float]
) -> None:
    if saver.last_committed != step:
        trainstate.save(saver, t, step, env, run_spec, val_loss)
    saver.wait()


def log_step(
    t: Trainer,
    env: RankEnv,
    metrics: MetricsLog,
    step: int,
    result: StepResult,
    clock: _Clock,
    checkpoint_step: Optional[int] = None,
    validate: Optional[bool] = None,
) -> dict[str, Any]:
    """One metrics.jsonl record (and human line) covering the steps since the last one; returns it
    (every rank builds it: its loss and val_loss are global)."""
    cfg = t.cfg
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    loss = mean_over_ranks(result.loss.total, result.loss.count)  # also syncs: timings are real
    now = time.perf_counter()
    interval, done = now - clock.last_time, step - clock.last_step
    record: dict[str, Any] = {
        "step": step,
        "loss": loss,
        "lr": result.lr,
        "grad_norm": float(result.grad_norm),
        "tokens": step * tokens_per_step,
        "tokens_per_s": tokens_per_step * done / interval,
        "step_time_s": interval / done,
        "data_wait_s": clock.waited / done,
        "elapsed_s": now - clock.start,
        "tflops_per_rank": t.model.flops_per_token() * tokens_per_step * done / interval / env.world_size / 1e12,
        "restart_count": env.restart_count,
        "time": time.time(),
    }
    if checkpoint_step is not None:
        record["checkpoint_step"] = checkpoint_step
    if t.scaler.enabled:
        record["loss_scale"] = t.scaler.scale
    if eval_due(cfg, step, cfg.steps) if validate is None else validate:
        metrics.stamp(step, "eval")
        record["val_loss"] = evaluate(t)
        record["val_ppl"] = perplexity(record["val_loss"])
    metrics.write(record, extra=gpu_memory(t.runtime))
    clock.last_time, clock.last_step, clock.waited = time.perf_counter(), step, 0.0
    return record
