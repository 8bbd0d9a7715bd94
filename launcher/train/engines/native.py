"""The native engine: FSDP2 / DDP x DTensor tensor parallel x torch.distributed.pipelining on a ("pp", "dp", "tp") mesh.

Its checkpoint part goes through torch.distributed.checkpoint.state_dict, keyed by the full
model's parameter names (layout-free), so a checkpoint saved under one (dp, tp, pp) loads
under another. Model, optimizer and loss scaler are Stateful: DCP asks them for their state
when it saves and hands the loaded state back to them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshrun.launcher.checkpoint import commit as ckpt
from meshrun.launcher.checkpoint.commit import Checkpointer, Writer, dcp_writer
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
from meshrun.launcher.data.dataset import Layout, MicroBatches
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train.engines.base import StepResult
from meshrun.launcher.train.model import GPT, ModelPart
from meshrun.launcher.train.optim import LossScaler, build_optimizer, clip_factor, global_grad_norm, scale_grads_
from meshrun.launcher.train.parallel import apply_data_parallel, apply_tensor_parallel, build_mesh
from meshrun.launcher.train.pipeline import Executor, PipelineExecutor, PlainExecutor, StepLoss
from meshrun.launcher.train.runtime import Runtime


@dataclass
class ModelState:
    """The model part's weights as DCP sees them (Stateful): full-model names, whatever the layout."""

    model: nn.Module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


# Flat keys, one per parameter: `state.<fqn>.exp_avg` and `param_groups.<fqn>.lr`. The nested form keeps
# param_groups as a list, which DCP flattens to `param_groups.0.*`: every pipeline stage writes its own
# group 0 (its own parameter names) under the same key, one stage's copy wins, and the other stages load
# a group that names none of their parameters (resume failed with `KeyError: 'betas'`). torchtitan flattens
# for the same reason.
OPTIMIZER_STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class OptimizerState:
    """The optimizer's state keyed by parameter names (Stateful), so it reshards like the weights, and
    loads on any pipeline stage (each stage holds only its own parameters' keys)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    flat: bool = True
    """False only to load a checkpoint saved before the flat keys (nested param_groups; see above)."""

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self._options())

    def _options(self) -> StateDictOptions:
        return OPTIMIZER_STATE_OPTIONS if self.flat else StateDictOptions()


def saved_flat(path: Path) -> bool:
    """Whether the checkpoint at `path` holds the flat optimizer keys (every one meshrun writes now)."""
    # Nested groups are indexed (`optim.param_groups.0.lr`); flat ones by parameter name, never a bare index.
    return not any(re.fullmatch(r"optim\.param_groups\.\d+\.lr", key) for key in ckpt.saved_keys(path))


@dataclass
class NativeEngine:
    """One rank's model part, sharded in place, its executor, optimizer and loss scaler."""

    model: GPT
    executor: Executor
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    params: list[nn.Parameter]
    """The trainable parameters after wrapping (the sharded ones)."""
    device: torch.device
    grad_clip: float
    labels: list[str]
    pp_group: Optional[dist.ProcessGroup]
    name: str = "native"

    @classmethod
    def build(cls, job: JobSpec, env: RankEnv, runtime: Runtime, dims: ParallelDims, layout: Layout) -> NativeEngine:
        """Mesh -> model part -> tensor parallel -> data parallel -> executor -> optimizer."""
        cfg, par = job.trainer, job.parallel
        coords = dims.coordinates(env.rank)
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
        autocast_dtype = None if dims.fsdp_wraps(par.dp_mode) else runtime.amp_dtype
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
        params = [p for p in model.parameters() if p.requires_grad]
        labels = (
            [par.dp_mode]
            + ([par.pp_schedule] if dims.pp > 1 else [])
            + (["sequence parallel"] if par.sequence_parallel and dims.tp > 1 else [])
        )
        return cls(
            model=model,
            executor=executor,
            optimizer=build_optimizer(params, cfg),
            scaler=scaler,
            params=params,
            device=runtime.device,
            grad_clip=cfg.grad_clip,
            labels=labels,
            pp_group=mesh["pp"].get_group() if dims.pp > 1 else None,
        )

    @property
    def fp16_scaled(self) -> bool:
        return self.scaler.enabled

    def describe(self) -> list[str]:
        return list(self.labels)

    def train_step(self, micro_batches: MicroBatches, lr: float) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self.executor.train_step(micro_batches)
        inv_scale = 1.0 / self.scaler.loss_multiplier()
        norm = global_grad_norm(self.params, self.device, self.pp_group) * inv_scale
        # The norm is global, so every rank takes the same decision (fp16 only: it is a host sync).
        if self.scaler.update(bool(torch.isfinite(norm)) if self.scaler.enabled else True):
            scale_grads_(self.params, clip_factor(norm, self.grad_clip) * inv_scale)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm, lr)

    def eval_step(self, micro_batches: MicroBatches) -> StepLoss:
        return self.executor.eval_step(micro_batches)

    def set_training(self, training: bool) -> None:
        self.model.train(training)

    def loss_scale(self) -> Optional[float]:
        return self.scaler.scale if self.scaler.enabled else None

    def _state(self, trainer_state: dict[str, Any], flat_optimizer: bool = True) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optim": OptimizerState(self.model, self.optimizer, flat_optimizer),
            "scaler": self.scaler,
            **trainer_state,
        }

    def checkpoint_writer(self, saver: Checkpointer, trainer_state: dict[str, Any]) -> Writer:
        return dcp_writer(saver, self._state(trainer_state))

    def load_checkpoint(self, saver: Checkpointer, trainer_state: dict[str, Any], path: Path) -> None:
        engine = ckptdir.read_marker(path).get("engine", self.name)
        if engine != self.name:
            raise ckptdir.CheckpointError(
                f"{path} was saved by the {engine} engine; the native engine loads only its own checkpoints: "
                f"resume with train.engine: {engine}, or start a new run"
            )
        saver.dcp_load(self._state(trainer_state, saved_flat(path)), path)
