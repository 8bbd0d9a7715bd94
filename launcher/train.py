"""The built-in trainer: one short linear loop (torchtitan's shape) that always tears down.

Data parallel only for now: FSDP2 `fully_shard` (dp_mode fsdp) or DDP (dp_mode ddp).
Tensor and pipeline parallelism arrive with the 3D trainer; until then tp and pp
must be 1. Rank 0 appends one JSON line per logged step to RUN_DIR/metrics.jsonl
(the sidecar and `meshrun status` read it) and prints a human line to stdout.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Optional, TextIO

import torch
import torch.distributed as dist
from torch import nn

from launcher.data import Layout, TokenDataset, TrainStream, val_batches
from launcher.env import RankEnv, setdefault_env
from launcher.model import GPT, loss_fn
from launcher.parallel_dims import ParallelDims
from launcher.schema import SchemaError
from launcher.spec import JobSpec, RunSpec, Train

METRICS_FILE = "metrics.jsonl"
EVAL_WINDOWS = 128
"""Validation sequences per evaluation, over all ranks (a fixed set: the first val windows)."""


@dataclass(frozen=True)
class Runtime:
    """Where and how this rank computes."""
    device: torch.device
    backend: str
    amp_dtype: Optional[torch.dtype]  # None: plain fp32

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ------------------------------------------------------------------ checks and setup

def check_layout(job: JobSpec, env: RankEnv) -> Layout:
    """Validate the parallel layout and the batch arithmetic before any collective can hang on it."""
    par, cfg = job.parallel, job.trainer
    for key, value in (("parallel.tp", par.tp), ("parallel.pp", par.pp)):
        if value != 1:
            raise SchemaError(key, value, "tensor and pipeline parallelism come with the 3D trainer in a later "
                                          "version; this trainer is data parallel only: set tp=1 and pp=1")
    dims = ParallelDims(par.dp, par.tp, par.pp)
    problem = (dims.problem(env.world_size, cfg.model.n_layers, cfg.model.n_heads, env.local_world_size)
               or dims.batch_problem(cfg.global_batch, cfg.micro_batch))
    if problem:
        raise SchemaError(problem.key, problem.value, problem.fix)
    # tp = pp = 1, so the dp rank is the global rank.
    return Layout(cfg.global_batch, cfg.micro_batch, dp_rank=env.rank, dp_size=par.dp)


def pick_runtime(job: JobSpec, env: RankEnv) -> Runtime:
    """NCCL on this rank's GPU when the job asked for GPUs and has them, else gloo on CPU (fp32 math)."""
    if job.resources.gpus_per_node > 0 and torch.cuda.is_available():
        # Modulo: a task may see all the node's GPUs (index = local rank) or only its own (index 0).
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.trainer.precision)
        return Runtime(device, "nccl", amp)
    return Runtime(torch.device("cpu"), "gloo", None)


def init_distributed(env: RankEnv, runtime: Runtime) -> None:
    """Join the process group from the RankEnv (not os.environ: one place reads the environment)."""
    device_id = runtime.device if runtime.cuda else None
    if env.world_size == 1:
        # No rendezvous needed: a private store cannot collide with a busy port.
        dist.init_process_group(runtime.backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device_id)
        return
    dist.init_process_group(runtime.backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, device_id=device_id)


def build_model(cfg: Train, runtime: Runtime) -> GPT:
    model = GPT(cfg.model, seed=cfg.seed, activation_checkpointing=cfg.activation_checkpointing)
    return model.to(runtime.device)


def wrap_data_parallel(model: GPT, mode: str, runtime: Runtime, dp: int) -> nn.Module:
    """FSDP2 (each block its own unit, then the root) or DDP over all ranks."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[runtime.device.index] if runtime.cuda else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(runtime.device.type, (dp,), mesh_dim_names=("dp",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_optimizer(model: nn.Module, cfg: Train) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (never on norms or biases, which are 1-D)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: Train) -> float:
    """LR for 1-based `step`: linear warmup to lr, then cosine down to min_lr at the last step."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def autocast(runtime: Runtime) -> ContextManager[Any]:
    if runtime.amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=runtime.amp_dtype)


# ------------------------------------------------------------------ one step

def grad_norm_and_clip(model: nn.Module, max_norm: float) -> float:
    """Global gradient norm (all shards), clipping to max_norm when it is > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if hasattr(total, "full_tensor"):  # FSDP2: a DTensor of per-shard partial norms
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def no_sync(model: nn.Module, last: bool) -> ContextManager[Any]:
    # DDP: all-reduce only on the last micro batch. FSDP2 keeps reduce-scattering every
    # micro batch: skipping it would keep unsharded gradients and give back ZeRO's memory win.
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def train_step(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
               runtime: Runtime, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Forward/backward over this rank's micro batches; returns the summed (detached) micro losses."""
    total = torch.zeros((), device=runtime.device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(runtime.device, non_blocking=True), y.to(runtime.device, non_blocking=True)
        with no_sync(model, last=i == len(micro_batches) - 1):
            with autocast(runtime):
                loss = loss_fn(model(x), y)
            # Dividing by the micro-batch count makes the accumulated gradient the batch mean.
            scaler.scale(loss / len(micro_batches)).backward()
        total += loss.detach()
    return total


def mean_over_ranks(total: torch.Tensor, count: int) -> float:
    """sum(totals) / sum(counts) over all ranks (gloo has no AVG op, so SUM both, then divide)."""
    packed = torch.stack([total.float(), torch.tensor(float(count), device=total.device)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return float(packed[0] / packed[1])


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TokenDataset, layout: Layout, runtime: Runtime) -> float:
    model.eval()
    total, count = torch.zeros((), device=runtime.device), 0
    for x, y in val_batches(dataset, layout, EVAL_WINDOWS):
        with autocast(runtime):
            # Weighted by sequences: the last micro batch may be short.
            total += loss_fn(model(x.to(runtime.device)), y.to(runtime.device)) * len(x)
        count += len(x)
    model.train()
    return mean_over_ranks(total, count)


# ------------------------------------------------------------------ metrics

class MetricsLog:
    """Rank 0's metrics.jsonl (appended: restarts add to it) and its human log line."""

    def __init__(self, run_dir: str, enabled: bool, steps: int) -> None:
        self.steps = steps
        self.file: Optional[TextIO] = None
        if enabled:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(run_dir) / METRICS_FILE, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        # Non-finite floats become null: strict JSON readers reject NaN/Infinity.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        print(self.line(record), flush=True)

    def line(self, r: dict[str, Any]) -> str:
        text = (f"step {r['step']}/{self.steps} loss {r['loss']:.4f} lr {r['lr']:.2e} "
                f"grad_norm {r['grad_norm']:.3f} tok/s {r['tokens_per_s']:,.0f} step_time {r['step_time_s']:.3f}s")
        return text + (f" val_loss {r['val_loss']:.4f}" if "val_loss" in r else "")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def announce(model: GPT, job: JobSpec, runtime: Runtime, layout: Layout, env: RankEnv) -> None:
    if env.rank != 0:
        return
    cfg = job.trainer
    note = f" (precision {cfg.precision} requested; CPU ranks compute in fp32)" \
        if not runtime.cuda and cfg.precision != "fp32" else ""
    print(f"meshrun: GPT {model.num_params() / 1e6:.2f}M params, {env.world_size} rank(s), "
          f"dp={layout.dp_size} {job.parallel.dp_mode}, {runtime.backend} on {runtime.device.type}, "
          f"global batch {cfg.global_batch} = micro {cfg.micro_batch} x dp {layout.dp_size} "
          f"x accumulation {layout.accumulation}, precision {cfg.precision if runtime.cuda else 'fp32'}{note}",
          flush=True)


# ------------------------------------------------------------------ the loop

def train(run_spec: RunSpec, env: RankEnv) -> int:
    """Train the reference GPT as the spec says; returns the process exit code (0: done)."""
    job, cfg = run_spec.job, run_spec.job.trainer
    layout = check_layout(job, env)
    dataset = TokenDataset(job.data.path, cfg.model.seq_len, job.data.val_fraction)
    if cfg.eval_every > 0 and dataset.num_windows["val"] < layout.dp_size:
        raise SchemaError("data.val_fraction", job.data.val_fraction,
                          f"holds {dataset.num_windows['val']} validation windows, fewer than dp({layout.dp_size}); "
                          "raise it or set train.eval_every=0")
    setdefault_env(run_spec.run.nccl_env, os.environ)  # the cluster preset, unless the user set a key
    torch.manual_seed(cfg.seed)
    runtime = pick_runtime(job, env)
    init_distributed(env, runtime)
    metrics = MetricsLog(run_spec.run.run_dir, enabled=env.rank == 0, steps=cfg.steps)
    try:
        base = build_model(cfg, runtime)
        announce(base, job, runtime, layout, env)
        model = wrap_data_parallel(base, job.parallel.dp_mode, runtime, layout.dp_size)
        run_loop(model, base, cfg, dataset, layout, runtime, env, metrics)
    finally:
        metrics.close()
        dist.destroy_process_group()
    return 0


def run_loop(model: nn.Module, base: GPT, cfg: Train, dataset: TokenDataset, layout: Layout,
             runtime: Runtime, env: RankEnv, metrics: MetricsLog) -> None:
    optimizer = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler("cuda", enabled=runtime.amp_dtype == torch.float16)
    stream = TrainStream(dataset, layout, cfg.seed)
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    flops_per_token = base.flops_per_token()
    start = last_time = time.perf_counter()
    last_step = 0
    for step in range(1, cfg.steps + 1):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = stream.next_step()
        loss_sum = train_step(model, micro_batches, runtime, scaler)
        scaler.unscale_(optimizer)  # clip and report the true norm, not the loss-scaled one
        grad_norm = grad_norm_and_clip(model, cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % cfg.log_every and step != cfg.steps:
            continue
        loss = mean_over_ranks(loss_sum, len(micro_batches))  # also syncs: timings below are real
        now = time.perf_counter()
        interval, done = now - last_time, step - last_step
        record: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens": step * tokens_per_step,
            "tokens_per_s": tokens_per_step * done / interval,
            "step_time_s": interval / done,
            "elapsed_s": now - start,
            "tflops_per_rank": flops_per_token * tokens_per_step * done / interval / env.world_size / 1e12,
            "restart_count": env.restart_count,
            "time": time.time(),
        }
        if runtime.amp_dtype == torch.float16:
            record["loss_scale"] = float(scaler.get_scale())
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
            record["val_loss"] = evaluate(model, dataset, layout, runtime)
        metrics.write(record)
        last_time, last_step = time.perf_counter(), step
