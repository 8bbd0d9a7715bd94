"""What a checkpoint holds, and putting it back: everything an exact resume needs.

Model and optimizer go through torch.distributed.checkpoint.state_dict, keyed by the
full model's parameter names (fully-qualified, layout-free), so a checkpoint saved
under one (dp, tp, pp) loads under another. The rest: the step, the data position,
the fp16 loss scale, and each rank's RNG state (restored only when the rank exists
in the checkpoint with the same world size). The job spec rides in the marker, less its
`env` (values a user may not want copied into every checkpoint; export needs none of it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launcher import checkpoint as ckpt
from launcher import resume
from launcher.env import RankEnv
from launcher.schema import to_plain
from launcher.spec import RunSpec

if TYPE_CHECKING:
    from launcher.train import Trainer


def _rng_key(env: RankEnv) -> str:
    return f"rng.world{env.world_size}.rank{env.rank}"


def app_state(t: Trainer, step: int, env: RankEnv) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "train": {
            "step": step,
            "data": t.stream.state_dict(),
            "loss_scale": t.scaler.scale,
            "good_steps": t.scaler._good_steps,
        },
        _rng_key(env): torch.get_rng_state(),
    }


def marker_job(run_spec: RunSpec) -> dict[str, Any]:
    """The job spec as the marker records it: everything but `env`."""
    return {key: value for key, value in to_plain(run_spec.job).items() if key != "env"}


def save(
    saver: ckpt.Checkpointer,
    t: Trainer,
    step: int,
    env: RankEnv,
    run_spec: RunSpec,
    val_loss: Optional[float] = None,
) -> None:
    """Start saving step N; `val_loss` (the step's validation, with checkpoint.keep_best) goes into the
    marker, where retention and `export --best` find it."""
    info: dict[str, Any] = {
        "layout": {"dp": t.dims.dp, "tp": t.dims.tp, "pp": t.dims.pp},
        "world_size": env.world_size,
        "restart_count": env.restart_count,
        "job": marker_job(run_spec),
    }
    if val_loss is not None:
        info[ckpt.VAL_LOSS] = val_loss
    saver.save(step, app_state(t, step, env), info)


def load(saver: ckpt.Checkpointer, t: Trainer, path: Path, env: RankEnv) -> int:
    """Restore everything from a complete checkpoint; returns the step it was saved at."""
    state = app_state(t, 0, env)
    if _rng_key(env) not in ckpt.saved_keys(path):
        del state[_rng_key(env)]  # another world size: its RNG streams do not map onto ours
    saver.load(state, path)
    set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train = state["train"]
    t.stream.load_state_dict(train["data"])
    t.scaler.scale, t.scaler._good_steps = float(train["loss_scale"]), int(train["good_steps"])
    if _rng_key(env) in state:
        torch.set_rng_state(state[_rng_key(env)])
    return int(train["step"])


def choose_start(root: Path, requested: int | None, env: RankEnv) -> resume.Choice:
    """Rank 0 picks (and counts) the checkpoint; every rank gets the same choice."""
    box: list[Any] = [resume.choose(root, requested) if env.rank == 0 else None]
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
