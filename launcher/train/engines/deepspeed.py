"""The deepspeed engine: ZeRO 0-3 and CPU offload, from the same spec as the native engine.

DeepSpeed joins the process group meshrun already started (no `deepspeed` runner, pdsh or
hostfile); its config is generated from the spec (launcher/contract/spec/dsconfig.py) with the same global
batch, micro batch, accumulation, precision and clipping. meshrun builds the model (the same
seeded GPT as the native engine: both start from the same weights) and AdamW with the same
groups (weight decay on matrices only; DeepSpeed's CPU Adam when the optimizer is offloaded),
and sets the learning rate of every step itself (meshrun.launcher.train.optim.lr_at).

A checkpoint holds DeepSpeed's own save in `step-N/deepspeed/` (made inside `step-N.tmp/`, so
the marker-last commit, retention, staging on scratch and the crash-loop guard are the same as
the native engine's) and the Trainer's parts (step, data position, RNG) as DCP files beside it.
DeepSpeed loads ZeRO shards only into the same number of data-parallel ranks: a resume with
another world size is refused with that fix (the native engine reshards; DeepSpeed's universal
checkpoint is the way across sizes).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from meshrun.launcher.checkpoint.commit import Checkpointer, Writer
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec import dsconfig
from meshrun.launcher.contract.spec.job import JobSpec, Train
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.launcher.data.dataset import Layout, MicroBatches
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train import initweights
from meshrun.launcher.train.engines.base import StepResult
from meshrun.launcher.train.model import GPT, loss_fn
from meshrun.launcher.train.pipeline import StepLoss
from meshrun.launcher.train.runtime import Runtime

TAG = "deepspeed"
"""DeepSpeed's folder inside a meshrun checkpoint: `step-N/deepspeed/`."""


def import_deepspeed(runtime: Runtime) -> Any:
    """deepspeed, on the accelerator this rank runs on (it probes otherwise, and may pick CUDA for a CPU job)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if runtime.cuda else "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            f"train.engine: deepspeed needs the deepspeed package on every node ({exc}); install meshrun's "
            "extra after torch: pip install --no-build-isolation 'meshrun[deepspeed]'"
        ) from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines would bury meshrun's in every rank log
    # DeepSpeed 0.19 calls torch.distributed's old names for the same collectives (all_gather_into_tensor,
    # reduce_scatter_tensor); torch 2.13 warns on every rank's first call. Nothing for a user to do, and the
    # collectives are the ones they always were.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated\. Please use", category=FutureWarning
    )
    return deepspeed


def param_groups(model: nn.Module, cfg: Train) -> list[dict[str, Any]]:
    """AdamW's groups, as the native engine's (meshrun.launcher.train.optim.build_optimizer): decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: Train, offload: bool) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    if offload:  # DeepSpeed steps an offloaded optimizer on the CPU with its own (vectorised C++) Adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, adamw_mode=True)  # type: ignore[no-any-return]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class DeepSpeedEngine:
    """One rank's DeepSpeed engine around the whole GPT (data parallelism only)."""

    ds: Any
    """deepspeed.DeepSpeedEngine."""
    model: GPT
    device: torch.device
    stage: int
    labels: list[str]
    world_size: int
    name: str = "deepspeed"

    @classmethod
    def build(cls, job: JobSpec, env: RankEnv, runtime: Runtime, dims: ParallelDims, layout: Layout) -> DeepSpeedEngine:
        deepspeed = import_deepspeed(runtime)
        deepspeed.init_distributed(dist_backend=runtime.backend)  # finds meshrun's process group and keeps it
        cfg, par = job.trainer, job.parallel
        # Parameters offloaded to the CPU are never all on the GPU: build the model in host memory.
        where = torch.device("cpu") if par.offload_params else runtime.device
        with torch.device(where):
            model = GPT(cfg.model, seed=cfg.seed, activation_checkpointing=cfg.activation_checkpointing)
        if cfg.init_from:  # before DeepSpeed copies (ZeRO 1-3: fp32 masters) and partitions it; a resume replaces it
            initweights.start_from(model, cfg.init_from, env.rank)
        optimizer = build_optimizer(model, cfg, par.offload_optimizer)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=dsconfig.generate(job), dist_init_required=False
        )
        stage = dsconfig.zero_stage(job)
        labels = [f"ZeRO-{stage}"]
        labels += ["optimizer offload"] if par.offload_optimizer else []
        labels += ["parameter offload"] if par.offload_params else []
        return cls(engine, model, runtime.device, stage, labels, env.world_size)

    @property
    def fp16_scaled(self) -> bool:
        return bool(self.ds.fp16_enabled())

    def describe(self) -> list[str]:
        return list(self.labels)

    def train_step(self, micro_batches: MicroBatches, lr: float) -> StepResult:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        norm: Optional[torch.Tensor] = None
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = loss_fn(self.ds(x), y)
            self.ds.backward(loss)  # divides by the accumulation steps; reduces gradients at the boundary
            if i == len(micro_batches) - 1 and self.stage == 0:
                norm = self._replicated_grad_norm()  # ZeRO-0 keeps no norm of its own: read it before clipping
            self.ds.step()  # steps the optimizer only at the accumulation boundary (the last micro batch)
            total += loss.detach().float()
        reported = self.ds.get_global_grad_norm()
        if reported is not None:
            norm = torch.as_tensor(reported, dtype=torch.float32, device=self.device)
        assert norm is not None, "DeepSpeed reported no gradient norm"
        return StepResult(StepLoss(total, len(micro_batches)), norm, lr)

    def _replicated_grad_norm(self) -> torch.Tensor:
        """The global norm under ZeRO-0: every rank holds the whole, already averaged gradient."""
        grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, 2.0).float()

    @torch.no_grad()
    def eval_step(self, micro_batches: MicroBatches) -> StepLoss:
        total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            total += loss_fn(self.ds(x.to(self.device)), y.to(self.device)).float()
        return StepLoss(total, len(micro_batches))

    def set_training(self, training: bool) -> None:
        self.ds.train(training)

    def loss_scale(self) -> Optional[float]:
        if not self.fp16_scaled:
            return None
        scale = getattr(self.ds.optimizer, "loss_scale", None)
        return float(scale) if scale is not None else None

    def checkpoint_writer(self, saver: Checkpointer, trainer_state: dict[str, Any]) -> Writer:
        def write(tmp: Path) -> None:
            # DeepSpeed's save is synchronous and collective; the Trainer's parts are a few kB.
            self.ds.save_checkpoint(str(tmp), tag=TAG, save_latest=False)
            saver.dcp_save(trainer_state, tmp, asynchronous=False)

        return write

    def load_checkpoint(self, saver: Checkpointer, trainer_state: dict[str, Any], path: Path) -> None:
        ckptdir.check_complete(path)
        marker = ckptdir.read_marker(path)
        self._check_loadable(path, marker)
        loaded, _ = self.ds.load_checkpoint(
            str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise ckptdir.CheckpointError(f"{path}: DeepSpeed found no checkpoint in {path / TAG}")
        saver.dcp_load(trainer_state, path)

    def _check_loadable(self, path: Path, marker: dict[str, Any]) -> None:
        engine, saved_world = marker.get("engine", "native"), marker.get("world_size")
        if engine != self.name or not (path / TAG).is_dir():
            raise ckptdir.CheckpointError(
                f"{path} was saved by the {engine} engine; the deepspeed engine loads only its own checkpoints: "
                "resume with the engine that saved it (train.engine), or start a new run"
            )
        if self.stage > 0 and saved_world != self.world_size:
            raise ckptdir.CheckpointError(
                f"{path} holds ZeRO shards of {saved_world} ranks and this job runs {self.world_size}: DeepSpeed "
                "loads them only into the same data-parallel size; resume with the same resources, or convert it "
                "with DeepSpeed's universal checkpoint"
            )
