"""A ~1B-parameter GPT on one GPU through meshrun's own trainer: tokens/s and MFU.

    python bench/gpu_train.py                 # ~1.04B params, seq 2048, bf16, 30 steps (H100/H200)
    python bench/gpu_train.py --ac --compile  # activation checkpointing, torch.compile per block
    python bench/gpu_train.py --smoke         # a tiny config on CPU, to check the script itself (= --quick)

The trainer is built as `meshrun.launcher.train.loop` builds it (same checks, runtime, process
group of one, model, executor, optimizer, loop), from a job spec made here; only the
data is a byte-level stdlib corpus (token ids < 256 are valid for any vocab). MFU is
model FLOPs (Megatron: 6N + 12*L*d*T per token, N without the embedding) over the
GPU's dense bf16 peak; the first --warmup steps (allocator, autotuning, compile) are
left out of the averages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from trainer_setup import corpus, single_rank_trainer  # noqa: E402

from meshrun.launcher.checkpoint.manager import CheckpointManager  # noqa: E402
from meshrun.launcher.contract.gpus import peak_tflops  # noqa: E402
from meshrun.launcher.contract.spec.job import Data, JobSpec, Model, Parallel, Resources, Train  # noqa: E402
from meshrun.launcher.contract.spec.modelshape import flops_per_token, param_count  # noqa: E402
from meshrun.launcher.rank.env import rank_env  # noqa: E402
from meshrun.launcher.sidecar.energy import EnergyMeter, nvml_gpus, rapl_packages  # noqa: E402
from meshrun.launcher.sidecar.nvml import NvmlUnavailable, discover, load_nvml, resolve  # noqa: E402
from meshrun.launcher.train.loop import run_loop  # noqa: E402
from meshrun.launcher.train.metrics import METRICS_FILE, MetricsLog  # noqa: E402


def peak_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak in FLOP/s, from the one table the trainer's MFU uses too (meshrun.launcher.contract.gpus)."""
    peak = peak_tflops(device_name)
    return peak * 1e12 if peak else None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke",
        "--quick",
        dest="smoke",
        action="store_true",
        help="tiny model on CPU (checks the script, no GPU needed; CI runs it)",
    )
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the averages")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument(
        "--gpu-hour", type=float, default=2.5, help="price of a GPU-hour for the cost line (default 2.50, USD)"
    )
    args = p.parse_args()
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab, args.seq = 2, 64, 4, 256, 64
        args.micro_batch, args.steps, args.warmup = 2, 6, 2
    return args


def make_job(args: argparse.Namespace, data: Path) -> JobSpec:
    model = Model(
        n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, vocab_size=args.vocab, seq_len=args.seq
    )
    train = Train(
        model=model,
        steps=args.steps,
        precision=args.precision,
        global_batch=args.micro_batch * args.accumulation,
        micro_batch=args.micro_batch,
        lr=3e-4,
        min_lr=3e-5,
        warmup_steps=min(10, args.steps),
        log_every=1,
        activation_checkpointing=args.ac,
        seed=0,
    )
    gpus = 0 if args.smoke else 1
    return JobSpec(
        name="gpu-bench",
        resources=Resources(gpus_per_node=gpus, tasks_per_node=1),
        parallel=Parallel(dp=1, tp=1, pp=1),
        train=train,
        data=Data(path=str(data)),
    )


def energy_meter() -> EnergyMeter:
    """What the sidecar reads (launcher/sidecar/energy.py): the first visible GPU's NVML energy counter, and the
    CPU packages' RAPL counters where readable."""
    try:
        nvml = load_nvml()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        targets, _ = resolve(tuple(visible.split(","))[:1] if visible else None, discover(nvml), 1)
        gpus = nvml_gpus(nvml, targets[:1])
    except NvmlUnavailable:
        gpus = []
    return EnergyMeter(gpus, rapl_packages())


def used_text(used: dict[str, Optional[float]], wall_s: float, steps: int, gpus: int, price: float) -> str:
    """'energy GPU 5.2 kJ (172 J/step), CPU unmeasured; 0.0083 GPU-hours, 0.02 USD at 2.50/GPU-hour'."""
    parts = []
    for key, label in (("gpu_j", "GPU"), ("cpu_j", "CPU")):
        value = used[key]
        parts.append(
            f"{label} {value / 1000:.3g} kJ ({value / steps:.3g} J/step)"
            if value is not None
            else f"{label} unmeasured"
        )
    hours = gpus * wall_s / 3600
    return f"energy {', '.join(parts)}; {hours:.3g} GPU-hours, {hours * price:.3g} USD at {price:.2f}/GPU-hour"


def main() -> None:
    args = parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_train: no CUDA device; run with --smoke to check the script on CPU")
    with tempfile.TemporaryDirectory() as tmp:
        tokens = (args.steps + 2) * args.micro_batch * args.accumulation * (args.seq + 1) * 2
        job = make_job(args, corpus(Path(tmp), max(tokens, 200_000)))
        cfg = job.trainer
        with single_rank_trainer(job) as t:
            device = t.runtime.device
            name = torch.cuda.get_device_name(device) if t.runtime.cuda else "cpu"
            print(
                f"gpu_train: {param_count(cfg.model) / 1e9:.3f}B params on {name}, {t.runtime.precision}, "
                f"seq {cfg.model.seq_len}, batch {cfg.global_batch} (micro {cfg.micro_batch}), "
                f"ac={args.ac} compile={args.compile}",
                flush=True,
            )
            if args.compile:
                for block in t.engine.model.layers.values():
                    block.compile()
            if t.runtime.cuda:
                torch.cuda.reset_peak_memory_stats(device)
            meter, began = energy_meter(), time.monotonic()
            run_loop(
                t,
                rank_env({}),
                MetricsLog(tmp, enabled=True, steps=cfg.steps),
                CheckpointManager.off(rank_env({}), "a benchmark saves nothing"),
            )
            if t.runtime.cuda:
                torch.cuda.synchronize(device)
            used = used_text(meter.read(), time.monotonic() - began, cfg.steps, int(t.runtime.cuda), args.gpu_hour)
            peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if t.runtime.cuda else 0.0
        rows = [json.loads(line) for line in (Path(tmp) / METRICS_FILE).read_text().splitlines()]
    report(rows[args.warmup :], cfg, name, peak_mem, used)


def report(rows: list[dict], cfg: Train, device_name: str, peak_mem_gib: float, used: str) -> None:
    if not rows:
        sys.exit("gpu_train: no steps after warmup; raise --steps")
    step_time = statistics.mean(r["step_time_s"] for r in rows)
    tokens_per_s = cfg.global_batch * cfg.model.seq_len / step_time
    achieved = flops_per_token(cfg.model) * tokens_per_s
    peak = peak_flops(device_name)
    mfu = f"{achieved / peak * 100:.1f}% of {peak / 1e12:.0f} TFLOP/s" if peak else "n/a (unknown peak)"
    print(
        f"steps {rows[0]['step']}-{rows[-1]['step']}: {step_time * 1000:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, "
        f"{achieved / 1e12:.1f} TFLOP/s model FLOPs, MFU {mfu}, data_wait "
        f"{statistics.mean(r['data_wait_s'] for r in rows) * 1000:.2f} ms/step, peak memory {peak_mem_gib:.1f} GiB, "
        f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; {used}"
    )


if __name__ == "__main__":
    main()
