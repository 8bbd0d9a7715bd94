"""One rank of the engine parity probe: `python ds_probe.py RUN_DIR CASE...` with torchrun's variables.

RUN_DIR's spec.json holds the base job (the reference model, the data, dp = the world size). For each
case in turn, in the same process group, the rank builds a Trainer with that engine (build_trainer,
as the launcher does), trains steps 1..train.steps from the same seed and the same data position
(t.train_step on the Trainer's own stream, the learning rate of each step), and rank 0 prints one
JSON line: {"case": CASE, "loss": [...], "grad_norm": [...]} (the global mean loss of every step).

Cases: `native` (FSDP2), `zero0`..`zero3` (the deepspeed engine), `zero3-offload-params` (ZeRO-3, parameters and optimizer in CPU memory), `zero2-offload` (ZeRO-2 with
DeepSpeed's CPU Adam); any of them with `-gqa-tied` trains the model with grouped-query attention and a tied head. Run by tests/integration/test_deepspeed_engine.py.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.launcher.contract.spec.job import JobSpec, read_run_spec
from meshrun.launcher.data.dataset import TokenDataset
from meshrun.launcher.rank.env import rank_env
from meshrun.launcher.train.runtime import init_distributed, pick_runtime
from meshrun.launcher.train.trainer import build_trainer, mean_over_ranks

GQA_TIED = "-gqa-tied"
"""A case suffix: the base model with 2 key/value heads and its head tied to the embedding."""


def job_for(base: JobSpec, case: str) -> JobSpec:
    """The base job with the engine, ZeRO stage and offload the case names (and the model, with GQA_TIED)."""
    if case.endswith(GQA_TIED):
        case = case.removesuffix(GQA_TIED)
        model = dataclasses.replace(base.trainer.model, n_kv_heads=2, tie_embeddings=True)
        base = dataclasses.replace(base, train=dataclasses.replace(base.trainer, model=model))
    if case == "native":
        return base
    stage, _, extra = case.removeprefix("zero").partition("-")
    parallel = dataclasses.replace(
        base.parallel,
        zero=int(stage),
        offload_optimizer=extra in ("offload", "offload-params"),
        offload_params=extra == "offload-params",
    )
    train = dataclasses.replace(base.trainer, engine="deepspeed")
    return dataclasses.replace(base, train=train, parallel=parallel)


def train_case(job: JobSpec, dataset: TokenDataset) -> dict[str, list]:
    env = rank_env(os.environ)
    runtime = pick_runtime(job, env, os.environ)
    torch.manual_seed(job.trainer.seed)  # as train() does: every case starts from the same RNG
    t = build_trainer(job, env, runtime, dataset)
    losses, norms = [], []
    for step in range(1, job.trainer.steps + 1):
        micro_batches = t.stream.next_step()
        result = t.train_step(step, micro_batches)
        losses.append(mean_over_ranks(result.loss.total, result.loss.count))
        norms.append(float(result.grad_norm))
    return {"loss": losses, "grad_norm": norms, "describe": [t.engine.name, *t.engine.describe()]}


def main(run_dir: Path, cases: list[str]) -> None:
    base = read_run_spec(run_dir).job
    env = rank_env(os.environ)
    init_distributed(env, pick_runtime(base, env, os.environ))
    try:
        dataset = TokenDataset(base.data.path, base.trainer.model.seq_len, base.data.val_fraction)
        for case in cases:
            start = time.perf_counter()
            result = train_case(job_for(base, case), dataset)
            if env.rank == 0:
                print(json.dumps({"case": case, **result, "seconds": time.perf_counter() - start}), flush=True)
            gc.collect()  # the previous engine's model and optimizer go before the next is built
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
