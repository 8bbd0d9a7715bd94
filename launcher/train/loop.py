"""The built-in trainer: one short linear loop (torchtitan's shape) that always tears down.

3D parallel: data (FSDP2 / replicate / DDP) x tensor (DTensor, optionally sequence
parallel) x pipeline (GPipe / 1F1B) on a ("pp", "dp", "tp") mesh. Batch sizes are
global (Megatron): accumulation = global_batch / (micro_batch * dp), and with pp > 1
those micro-batches are the pipeline's, so changing only the layout changes no number.
Rank 0 appends one JSON line per logged step to RUN_DIR/metrics.jsonl (see metrics.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from meshrun.launcher.checkpoint.manager import CheckpointManager
from meshrun.launcher.contract.exitcodes import EXIT_DIVERGED
from meshrun.launcher.contract.gpus import mfu_peak
from meshrun.launcher.contract.spec import tokens, weights
from meshrun.launcher.contract.spec.job import JobSpec, RunSpec, Train
from meshrun.launcher.contract.spec.modelshape import param_count
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.data.dataset import Prefetcher, TokenDataset, check_token_ids, check_train_data, open_dataset
from meshrun.launcher.rank.env import RankEnv, setdefault_env
from meshrun.launcher.rank.preempt import EXIT_FINISHED, EXIT_GAVE_UP, EXIT_REQUEUE, StopFlag
from meshrun.launcher.testing.faults import faults_for
from meshrun.launcher.train import divergence
from meshrun.launcher.train.engines.base import StepResult
from meshrun.launcher.train.losswatch import Watch as _Watch
from meshrun.launcher.train.metrics import MetricsLog, perplexity
from meshrun.launcher.train.runtime import Runtime, check_tasks, join_or_exit, pick_runtime
from meshrun.launcher.train.trainer import Trainer, build_trainer, mean_over_ranks
from meshrun.launcher.train.worktime import BusyClock

# ------------------------------------------------------------------ checks before any collective


def check_layout(job: JobSpec, env: RankEnv) -> ParallelDims:
    """Validate the parallel layout and the batch arithmetic before any collective can hang on it."""
    cfg = job.trainer
    dims = job.dims
    problem = job.layout_problem(dims, world_size=env.world_size, ranks_per_node=env.local_world_size)
    problem = problem or dims.batch_problem(cfg.global_batch, cfg.micro_batch)
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


# ------------------------------------------------------------------ the loop


def announce(t: Trainer, env: RankEnv) -> None:
    if env.rank != 0:
        return
    cfg, rt = t.cfg, t.runtime
    note = (
        f" (precision {cfg.precision} requested; CPU ranks compute in fp32)"
        if not rt.cuda and cfg.precision != "fp32"
        else ""
    )
    extras = [f"{t.engine.name} engine", *t.engine.describe()]
    threads = torch.get_num_threads()  # CPU ranks: resources.cpus_per_task each (match_math_threads)
    on_cpu = "" if rt.cuda else f" ({threads} math thread{'s' if threads > 1 else ''} a rank)"
    print(
        f"meshrun: GPT {param_count(cfg.model) / 1e6:.2f}M params, {env.world_size} rank(s), "
        f"dp={t.dims.dp} tp={t.dims.tp} pp={t.dims.pp} ({', '.join(extras)}), {rt.backend} on {rt.device.type}{on_cpu}, "
        f"global batch {cfg.global_batch} = micro {cfg.micro_batch} x dp {t.dims.dp} "
        f"x accumulation {t.layout.accumulation}, precision {rt.precision}{note}",
        flush=True,
    )


def match_math_threads(environ: Mapping[str, str]) -> None:
    """torch's math threads = OMP_NUM_THREADS, which meshrun.launcher.rank.entry sets to the job's cpus_per_task. torch reads
    it when it loads; a rank forked from a process that had loaded it already (launcher/local/controller.py, a local
    job's ranks) would keep one thread per core of the machine in every rank instead, and co-located ranks would
    spin in each other's OpenMP barriers."""
    try:
        threads = int(environ.get("OMP_NUM_THREADS") or 0)
    except ValueError:
        return  # not a count: as torch itself would, leave its default
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def train(run_spec: RunSpec, env: RankEnv, flag: Optional[StopFlag] = None) -> int:
    """Train the reference GPT as the spec says; returns the process exit code (see preempt.py).

    `flag` is the stop flag the caller installed (meshrun.launcher.rank.entry does, before importing torch).
    """
    tokens.check_data_files(run_spec.job)
    weights.check_init_from(run_spec.job)
    job = tokens.resolve_vocab(run_spec.job)  # vocab_size 0: the tokenizer's
    run_spec = dataclasses.replace(run_spec, job=job)
    check_tasks(job, env)
    check_layout(job, env)
    dataset = open_dataset(job.data, job.trainer.model.seq_len)
    check_data(job, dataset)
    setdefault_env(run_spec.run.nccl_env, os.environ)  # the cluster preset, unless the user set a key
    match_math_threads(os.environ)
    runtime = pick_runtime(job, env, os.environ)
    torch.manual_seed(job.trainer.seed)
    own_flag = flag is None
    flag = StopFlag().install() if flag is None else flag
    peak, no_mfu = mfu_peak(run_spec.run.gpu_type, runtime.cuda, device_name(runtime))
    metrics = MetricsLog(
        run_spec.run.run_dir, enabled=env.rank == 0, steps=job.trainer.steps, peak_tflops=peak, rank=env.rank
    )
    metrics.stamp(0, "rendezvous")  # the sidecars judge a stalled rendezvous from it (launcher/sidecar/rendezvous.py)
    try:
        failed = join_or_exit(env, runtime, job, run_spec.run.run_dir, on_joined=lambda: metrics.stamp(0, "setup"))
        if failed is not None:
            return failed
        trainer = build_trainer(job, env, runtime, dataset)
        checkpoints = CheckpointManager.for_run(run_spec, env, metrics)
        first = checkpoints.resume(trainer)
        if first is None:
            return EXIT_GAVE_UP
        metrics.resume_at(first, env.restart_count)
        announce(trainer, env)
        if env.rank == 0 and no_mfu:
            print(f"[meshrun] no MFU: {no_mfu}", flush=True)
        code = run_loop(trainer, env, metrics, checkpoints, first, flag=flag, run_spec=run_spec)
        checkpoints.close()
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


def peak_memory(runtime: Runtime) -> Optional[int]:
    """A GPU's peak allocated bytes since the start (the plan check's memory); None on CPU ranks."""
    return int(torch.cuda.max_memory_allocated(runtime.device)) if runtime.cuda else None


def run_loop(
    t: Trainer,
    env: RankEnv,
    metrics: MetricsLog,
    checkpoints: CheckpointManager,
    first: int = 1,
    last: Optional[int] = None,
    flag: Optional[StopFlag] = None,
    run_spec: Optional[RunSpec] = None,
) -> int:
    """Steps first..last (default: to train.steps); logs every log_every steps and at the last one.

    `checkpoints` says when to save (CheckpointManager.off for a loop that must not). With a flag:
    every step the ranks agree whether any of them was signalled, and if so all save after the same
    step and return EXIT_REQUEUE. A NaN/inf loss or grad norm stops every rank before any save of
    that step and returns EXIT_DIVERGED (when it is checked: launcher/train/divergence.py).
    """
    cfg = t.cfg
    last = cfg.steps if last is None else last
    prefetch = Prefetcher(t.stream, pin_memory=t.runtime.cuda)
    clock = _Clock(first - 1)
    busy = BusyClock(t.runtime.cuda)
    faults = faults_for(env.rank, env.restart_count)
    sentinel = divergence.Sentinel(t.runtime.device, check_norm=not t.engine.fp16_scaled)
    watch = _Watch.for_job(t.job, env, run_spec, first, t.runtime.cuda, metrics.event)
    try:
        for step in range(first, last + 1):
            metrics.stamp(step, "step", busy.last)
            busy.start()
            faults.at_step(step)
            micro_batches, wait = prefetch.next_step()
            clock.waited += wait + faults.delay_data()
            result = t.train_step(step, micro_batches)
            sentinel.observe(step, result.loss.total, result.grad_norm)
            clock.busy += busy.stop() or 0.0
            validate = eval_due(cfg, step, last)
            logged = step % cfg.log_every == 0 or step == last or validate
            if logged:
                record = log_step(
                    t, env, metrics, step, result, clock, checkpoints.shared_step, validate, watch.annotations()
                )
                watch.logged(record, peak_memory(t.runtime))
            save_due = checkpoints.due(step, last)
            if flag is None and not (logged or save_due):
                continue
            # The stop flag's all-reduce carries the non-finite check (no extra sync): see divergence.py.
            stopping, bad_step = divergence.agree(bool(flag and flag.raised), sentinel)
            if bad_step is not None:
                watch.diverged(bad_step, checkpoints.saver)
                return EXIT_DIVERGED
            checkpoints.poll()
            if stopping and checkpoints.enabled:
                if not logged:  # the step saved is the step shown: status's STEP never trails its CKPT
                    watch.logged(
                        log_step(
                            t, env, metrics, step, result, clock, checkpoints.shared_step, False, watch.annotations()
                        ),
                        peak_memory(t.runtime),
                    )
                metrics.stamp(step, "checkpoint")
                checkpoints.save_now(t, step, watch.val_loss(step))
                if env.rank == 0:
                    print(
                        f"[meshrun] stopping after step {step} on {flag.describe() if flag and flag.raised else 'a peer'}"
                        f"'s signal: checkpoint saved, exit {EXIT_REQUEUE} (saved to continue: a requeue or `meshrun resume`)",
                        flush=True,
                    )
                return EXIT_REQUEUE
            if save_due:
                metrics.stamp(step, "checkpoint")
                checkpoints.save(t, step, watch.val_loss(step))
        checkpoints.finish()
        return EXIT_FINISHED
    finally:
        prefetch.close()


@dataclass
class _Clock:
    last_step: int
    waited: float = 0.0
    busy: float = 0.0
    """The rank's own work since the last record (launcher/train/worktime.py), for the plan check."""
    start: float = field(default_factory=time.perf_counter)
    last_time: float = field(default_factory=time.perf_counter)


def log_step(
    t: Trainer,
    env: RankEnv,
    metrics: MetricsLog,
    step: int,
    result: StepResult,
    clock: _Clock,
    checkpoint_step: Optional[int] = None,
    validate: Optional[bool] = None,
    annotations: Optional[dict[str, Any]] = None,
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
        "busy_s": clock.busy / done,
        "elapsed_s": now - clock.start,
        "tflops_per_rank": t.engine.model.flops_per_token() * tokens_per_step * done / interval / env.world_size / 1e12,
        "restart_count": env.restart_count,
        "time": time.time(),
    }
    if checkpoint_step is not None:
        record["checkpoint_step"] = checkpoint_step
    record.update(annotations or {})
    loss_scale = t.engine.loss_scale()
    if loss_scale is not None:
        record["loss_scale"] = loss_scale
    if eval_due(cfg, step, cfg.steps) if validate is None else validate:
        metrics.stamp(step, "eval")
        began = time.perf_counter()
        record["val_loss"] = t.evaluate()
        record["eval_s"] = time.perf_counter() - began  # after the line's time stamp: goodput books it so
        record["val_ppl"] = perplexity(record["val_loss"])
    metrics.write(record, extra=gpu_memory(t.runtime))
    clock.last_time, clock.last_step, clock.waited, clock.busy = time.perf_counter(), step, 0.0, 0.0
    return record
