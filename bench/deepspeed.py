"""The deepspeed engine against the native engine, measured in the same run: step time and bytes per rank.

    .venv/bin/python bench/deepspeed.py [--steps N] [--rounds R] [--quick]

Two CPU ranks (gloo, dp 2, fp32) run this file as real processes. Each builds the native engine
(FSDP2) and the deepspeed engine under ZeRO 0, 1, 2 and 3, all on the same model, layout and batch
(build_trainer, as the launcher does), keeps them all alive and times meshrun's own loop (run_loop,
no checkpoints) with them in alternating rounds (native, ZeRO-0, ..., native, ...) so that drifts in
machine load hit all of them; a ratio is native's median step time over the engine's (> 1: faster).

Bytes per rank, measured from the real engine just before its optimizer's second step (the moment
gradients and optimizer state are both held): the unique storages of the module's parameters (ZeRO-3: the
rank's partitions, ds_tensor), of every gradient (the module's and the optimizer's partitions'), of
the optimizer's state (Adam's moments) and of fp32 master copies the optimizer steps when they are
not the parameters themselves. Beside each, the simple expected value for P parameters, dp ranks:
params 4P (ZeRO-3: 4P/dp), grads 4P (ZeRO-2/3: 4P/dp), Adam state 8P (ZeRO 1-3: 8P/dp).
These are held at the optimizer step, not the peak in backward: ZeRO-0 and ZeRO-1 hold the whole
gradient (4P) until the accumulation boundary, where ZeRO-1 reduces it into its partition (4P/dp, what
the table shows). Measured (CPU, fp32, 0.92M params): params, grads and Adam state are the expected
values to within DeepSpeed's padding; ZeRO-1 and ZeRO-2 also keep an fp32 master copy of the rank's
partition (4P/dp) even in fp32 training, ZeRO-3 steps its partitions in place (no copy).
--quick: a tiny model, 2 steps x 1 round (CI's check that the bench runs; its ratios mean little).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trainer_setup import REPO, corpus  # noqa: E402

# This file's name is the package's: with bench/ on the path, `import deepspeed` would import this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

CASES = ["native", "zero0", "zero1", "zero2", "zero3"]
PARTS = ("params", "grads", "optimizer", "master")


def job_spec(data: Path, quick: bool, steps: int) -> Any:
    from meshrun.launcher.contract.spec.job import Data, JobSpec, Model, Parallel, Resources, Train

    model = (
        Model(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64)
        if quick
        else Model(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128)
    )
    train = Train(model=model, steps=steps, global_batch=8, micro_batch=4, lr=1e-3, warmup_steps=2, log_every=10**6)
    return JobSpec(
        name="deepspeed-bench",
        resources=Resources(tasks_per_node=2),
        parallel=Parallel(dp=2),
        train=dataclasses.replace(train, eval_every=0),
        data=Data(path=str(data)),
    )


def case_job(base: Any, case: str) -> Any:
    if case == "native":
        return base
    train = dataclasses.replace(base.trainer, engine="deepspeed")
    return dataclasses.replace(base, train=train, parallel=dataclasses.replace(base.parallel, zero=int(case[-1])))


# ------------------------------------------------------------------ one rank


def storages(tensors: Any) -> dict[int, int]:
    """data_ptr -> bytes of each tensor's storage (shared storage counted once; empty ones skipped)."""
    out = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def tensors_in(value: Any, depth: int = 3) -> list[Any]:
    """Tensors in a value of DeepSpeed's bookkeeping (a tensor, or lists/dicts of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in items for t in tensors_in(item, depth - 1)]


def innermost(optimizer: Any) -> Any:
    """The torch optimizer inside DeepSpeed's ZeRO wrapper (ZeRO-0: the optimizer itself)."""
    import torch

    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def held_bytes(ds: Any) -> dict[str, int]:
    """What this rank's DeepSpeed engine holds, by part (called just before its optimizer steps).

    params: the module's parameters (ZeRO-3: the rank's partitions, ds_tensor); master: the tensors the
    torch optimizer steps when they are not those; grads: every .grad of both, and the gradient buffers
    the ZeRO optimizer keeps (its attributes named *grad*: partitions, accumulation and reduce buckets);
    optimizer: the torch optimizer's state (Adam's moments).
    """
    import torch

    params = list(ds.module.parameters())
    own = storages(p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params)
    inner = innermost(ds.optimizer)
    stepped = [p for group in inner.param_groups for p in group["params"]]
    master = {k: v for k, v in storages(stepped).items() if k not in own}
    buffers = [t for name, v in vars(ds.optimizer).items() if "grad" in name for t in tensors_in(v)]
    grads = {
        k: v
        for k, v in storages([p.grad for p in params + stepped] + buffers).items()
        if k not in own and k not in master
    }
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    opt = {k: v for k, v in storages(state).items() if k not in own and k not in master and k not in grads}
    return {p: sum(d.values()) for p, d in zip(PARTS, (own, grads, opt, master))}


def measure_before_step(engine: Any) -> dict[str, int]:
    """Bytes held just before the second optimizer step of the engine's DeepSpeed engine (its ZeRO
    optimizer's step is wrapped): Adam creates its moments in its first step, so the second sees all."""
    ds = engine.ds
    seen: dict[str, int] = {}
    calls = [0]
    original = ds.optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            seen.update(held_bytes(ds))
        return original(*args, **kwargs)

    ds.optimizer.step = step
    return seen


def rank_main(run_dir: Path, steps: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from meshrun.launcher.checkpoint.manager import CheckpointManager
    from meshrun.launcher.contract.spec.job import read_run_spec
    from meshrun.launcher.contract.spec.modelshape import param_count
    from meshrun.launcher.data.dataset import TokenDataset
    from meshrun.launcher.rank.env import rank_env
    from meshrun.launcher.train.loop import run_loop
    from meshrun.launcher.train.metrics import MetricsLog
    from meshrun.launcher.train.runtime import init_distributed, pick_runtime
    from meshrun.launcher.train.trainer import build_trainer

    base = read_run_spec(run_dir).job
    env = rank_env(os.environ)
    runtime = pick_runtime(base, env, os.environ)
    init_distributed(env, runtime)
    quiet = open(os.devnull, "w")
    try:
        dataset = TokenDataset(base.data.path, base.trainer.model.seq_len, base.data.val_fraction)
        trainers = {}
        for case in CASES:
            torch.manual_seed(base.trainer.seed)
            trainers[case] = build_trainer(case_job(base, case), env, runtime, dataset)
        times: dict[str, list[float]] = {case: [] for case in CASES}
        memory: dict[str, dict[str, int]] = {}
        off = CheckpointManager.off(env, "a benchmark saves nothing")
        for round_ in range(rounds + 1):  # round 0 warms every engine up (and measures bytes): not timed
            first = round_ * steps + 1
            for case, t in trainers.items():
                if round_ == 0 and case != "native":
                    memory[case] = measure_before_step(t.engine)
                metrics = MetricsLog(str(run_dir / case), enabled=env.rank == 0, steps=t.cfg.steps)
                dist.barrier()
                start = time.perf_counter()
                real, sys.stdout = sys.stdout, quiet
                try:
                    run_loop(t, env, metrics, off, first=first, last=first + steps - 1)
                finally:
                    sys.stdout = real
                elapsed = time.perf_counter() - start
                metrics.close()
                if round_:
                    times[case].append(elapsed / steps)
        print(
            "RESULT "
            + json.dumps(
                {
                    "rank": env.rank,
                    "params": param_count(base.trainer.model),
                    "step_s": {c: statistics.median(v) for c, v in times.items()},
                    "bytes": memory,
                }
            ),
            flush=True,
        )
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the driver


def launch(run_dir: Path, steps: int, rounds: int) -> list[dict[str, Any]]:
    """Two ranks of this file, with torchrun's variables; each one's RESULT line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            PYTHONPATH=str(REPO),
        )
        argv = [sys.executable, __file__, "--rank-of", str(run_dir), "--steps", str(steps), "--rounds", str(rounds)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for rank, proc in enumerate(procs):
        out = proc.communicate()[0]
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"bench/deepspeed.py: rank {rank} exited {proc.returncode}:\n{out}")
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


def expected(params: int, stage: int, dp: int) -> dict[str, float]:
    """The simple model: fp32 params 4P, grads 4P, Adam moments 8P; ZeRO-1 shards the optimizer state,
    ZeRO-2 the gradients too, ZeRO-3 the parameters too (fp32 training: no master copy needed)."""
    return {
        "params": 4 * params / (dp if stage >= 3 else 1),
        "grads": 4 * params / (dp if stage >= 2 else 1),
        "optimizer": 8 * params / (dp if stage >= 1 else 1),
        "master": 0.0,
    }


def report(results: list[dict[str, Any]], steps: int, rounds: int) -> None:
    params, dp = results[0]["params"], len(results)
    step = {c: max(r["step_s"][c] for r in results) for c in CASES}  # a step ends when the slower rank's does
    print(
        f"model {params / 1e6:.2f}M params (P), dp {dp} on {dp} CPU ranks (gloo, fp32), {steps} steps x {rounds} rounds"
    )
    print(f"native engine (fsdp): {step['native'] * 1000:.1f} ms/step")
    header = f"{'engine':8} {'ms/step':>8} {'ratio':>6}  " + "  ".join(f"{p + ' KiB (exp)':>20}" for p in PARTS)
    print(header)
    for case in CASES[1:]:
        stage = int(case[-1])
        held = {p: max(r["bytes"][case][p] for r in results) for p in PARTS}  # the larger rank's
        want = expected(params, stage, dp)
        cells = "  ".join(f"{held[p] / 1024:>10.1f} ({want[p] / 1024:>7.1f})" for p in PARTS)
        print(f"ZeRO-{stage:<3} {step[case] * 1000:>8.1f} {step['native'] / step[case]:>6.3f}  {cells}")
    print("ratio: native ms/step over the engine's (> 1: faster than native); KiB per rank, measured (expected)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 steps x 1 round (CI's check)")
    parser.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)  # internal: run as one rank
    args = parser.parse_args()
    if args.rank_of:
        rank_main(args.rank_of, args.steps, args.rounds)
        return
    if args.quick:
        args.steps, args.rounds = 2, 1
    from meshrun.launcher.contract.spec.job import RunInfo, RunSpec, write_run_spec

    with tempfile.TemporaryDirectory() as tmp:
        job = job_spec(corpus(Path(tmp), 50_000 if args.quick else 400_000), args.quick, args.steps * (args.rounds + 1))
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        write_run_spec(RunSpec(job, RunInfo(cluster="local", scheduler="local", run_dir=str(run_dir))), run_dir)
        report(launch(run_dir, args.steps, args.rounds), args.steps, args.rounds)


if __name__ == "__main__":
    main()
