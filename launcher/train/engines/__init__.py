"""The engines that hold the model: the interface (base.py), the native one (FSDP2/DDP, TP, PP; native.py)
and DeepSpeed (deepspeed.py); `build_engine` picks one by `train.engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import JobSpec
    from meshrun.launcher.contract.spec.parallel_dims import ParallelDims
    from meshrun.launcher.data.dataset import Layout
    from meshrun.launcher.rank.env import RankEnv
    from meshrun.launcher.train.engines.base import Engine
    from meshrun.launcher.train.runtime import Runtime


def build_engine(job: JobSpec, env: RankEnv, runtime: Runtime, dims: ParallelDims, layout: Layout) -> Engine:
    """The engine the spec asks for (needs the process group)."""
    if job.trainer.engine == "deepspeed":
        from meshrun.launcher.train.engines.deepspeed import (
            DeepSpeedEngine,  # deepspeed is an optional extra: imported only here
        )

        return DeepSpeedEngine.build(job, env, runtime, dims, layout)
    from meshrun.launcher.train.engines.native import NativeEngine

    return NativeEngine.build(job, env, runtime, dims, layout)
