"""The planner on this machine's GPUs, through meshrun's own CLI: datasheet plan, doctor, calibrated plan, the run.

    python bench/gpu_plan.py            # on a GPU machine (bench/gpu.sh runs it): a ~1B GPT on one GPU
    python bench/gpu_plan.py --cpu      # the same journey with 2 CPU ranks and a tiny model (checks the script)
    python bench/gpu_plan.py --quick    # --cpu with 8 steps and one job: CI's check that it runs

In a HOME of its own (yours is not touched) it writes a profile of this machine (scheduler `local`, one
partition: this machine's GPU type, count and memory, `cost.gpu_hour`), then: `meshrun plan --json` with the
datasheet figures; `meshrun doctor` (which records the calibration); `meshrun plan --json` again, calibrated;
`meshrun submit --wait` of the same job with `alerts.plan_check_steps` so rank 0 compares the run with the plan
it carries; and `meshrun status JOB`, whose `vs plan:` and `used:` lines (GPU-hours, energy from NVML, cost)
are what a user reads. Prints `ROW name<TAB>result` lines (bench/gpu.sh's table) and exits 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshrun_cli import isolated_env, meshrun

GPU_MODEL = {"n_layers": 18, "d_model": 2048, "n_heads": 16, "vocab_size": 32768, "seq_len": 2048}
"""bench/gpu_train.py's ~1B GPT: the same step, so its ms/step and this job's can be read side by side."""
OTHER_GPU_JOB = {"n_layers": 8, "d_model": 1024, "n_heads": 8, "seq_len": 1024, "micro_batch": 8, "global_batch": 8}
"""A second, smaller job planned and run with the same calibration (kernel launches weigh more in its step)."""
OTHER_CPU_JOB = {"n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128, "micro_batch": 4, "global_batch": 8}
CPU_MODEL = {"n_layers": 2, "d_model": 128, "n_heads": 4, "vocab_size": 256, "seq_len": 128}
FIGURES = ("gemm_tflops", "block_efficiency", "layer_overhead_us", "layer_element_ns", "storage_write_mbps")
"""What doctor measured that the plan's step time follows from."""
WARMUP_LOGGED = 3
"""Logged steps left out of the measured median (allocator, autotuning, first calls)."""


def run(env: dict[str, str], *args: str, timeout: float = 900) -> str:
    """meshrun ARGS, each command and its output in the bench's log (bench/gpu.sh keeps it)."""
    return meshrun(env, *args, timeout=timeout, echo=True)


def this_machine(cpu: bool) -> dict[str, Any]:
    """The partition this machine is: GPU type (the peak table's key), count and memory, or CPU ranks."""
    if cpu:
        return {"name": "here", "gpus_per_node": 0, "cpus_per_node": os.cpu_count() or 1, "default": True}
    import torch

    from meshrun.launcher.contract.gpus import PEAK_BF16_TFLOPS

    name = torch.cuda.get_device_name(0).lower()
    gpu_type = next((k for k in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True) if k in name), None)
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    part = {"name": "here", "gpus_per_node": torch.cuda.device_count(), "cpus_per_node": os.cpu_count() or 1}
    return {**part, **({"gpu_type": gpu_type} if gpu_type else {}), "gpu_memory_gb": int(memory), "default": True}


def write_inputs(home: Path, cpu: bool, steps: int, price: float) -> tuple[Path, Path]:
    profile = {
        "description": "this machine (bench/gpu_plan.py)",
        "scheduler": "local",
        "paths": {"work_dir": str(home / "work"), "scratch": str(home / "scratch")},
        "python": sys.executable,
        "partitions": [this_machine(cpu)],
        "cost": {"gpu_hour": price, "currency": "USD"},
    }
    model = CPU_MODEL if cpu else GPU_MODEL
    job = {
        "name": "gpu-plan",
        "resources": {"nodes": 1, "tasks_per_node": 2} if cpu else {"nodes": 1, "gpus_per_node": 1},
        "parallel": {"dp": 2 if cpu else 1, "tp": 1, "pp": 1},
        "train": {
            "model": model,
            "precision": "fp32" if cpu else "bf16",
            "global_batch": 8 if cpu else 4,
            "micro_batch": 4,
            "steps": steps,
            "log_every": 1,
            "eval_every": 0,
            "warmup_steps": 5,
        },
        "checkpoint": {"every": 0},
        "alerts": {"plan_check_steps": max(1, steps - 10)},
        "data": {"path": str(corpus(home))},
    }
    paths = home / "here.yaml", home / "job.yaml"
    for path, content in zip(paths, (profile, job)):
        path.write_text(json.dumps(content, indent=1))  # JSON is YAML
    return paths


def corpus(home: Path) -> Path:
    from meshrun.launcher.data.corpus import build_corpus

    out = home / "stdlib.u16"
    if not out.exists():
        build_corpus(out, max_bytes=4_000_000)
    return out


def planned(plan: dict[str, Any]) -> str:
    total = plan["memory_per_gpu_bytes"]["total"] / 2**30
    step = plan["step_time_s"]
    return (
        f"{step:.4g} s/step, memory {total:.1f} GiB a GPU; {plan['figures']}"
        if step
        else "no step time (a CPU job is timed from doctor's figures only)"
    )


def measured(run_dir: Path) -> tuple[float, dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if r.get("step_time_s")][WARMUP_LOGGED:]
    check = next((r for r in records if r.get("event") == "plan_check"), {})
    return statistics.median(times), check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="2 CPU ranks and a tiny model: checks the script")
    parser.add_argument("--quick", action="store_true", help="--cpu, 8 steps, no second job (CI's check that it runs)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--gpu-hour", type=float, default=2.5, help="the profile's cost.gpu_hour (USD)")
    parser.add_argument("--home", type=Path, help="the bench's HOME, kept afterwards (default: a temporary one)")
    args = parser.parse_args()
    if args.quick:
        args.cpu, args.steps = True, 8
    with tempfile.TemporaryDirectory(prefix="meshrun-gpu-plan-") as folder:
        home = args.home or Path(folder)
        home.mkdir(parents=True, exist_ok=True)
        env = isolated_env(home)
        profile, job = write_inputs(home, args.cpu, args.steps, args.gpu_hour)
        cluster = ["-c", str(profile)]
        before = json.loads(run(env, "plan", str(job), *cluster, "--json"))
        print(f"ROW\tplan, datasheet\t{planned(before)}")
        doctor = run(env, "doctor", *cluster, "--storage-mib", "2" if args.cpu else "256", timeout=600)
        verdict = [line for line in doctor.splitlines() if line.startswith(("no bad nodes", "calibration: "))]
        print(f"ROW\tdoctor\t{'; '.join(verdict)}")
        figures = json.loads((home / "state" / "meshrun" / "calibration" / "here.json").read_text())
        shown = ", ".join(f"{k} {v}" for f in figures.values() for k, v in f.items() if k in FIGURES and v is not None)
        print(f"ROW\tcalibration\t{shown}")
        after = json.loads(run(env, "plan", str(job), *cluster, "--json"))
        print(f"ROW\tplan, calibrated\t{planned(after)}")
        out = run(env, "submit", str(job), *cluster, "--wait", timeout=900)
        job_id = next(line.split()[1] for line in out.splitlines() if line.startswith("job "))
        run_dir = Path(next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("run dir: ")))
        step_s, check = measured(run_dir)
        plans = (("datasheet", before), ("calibrated", after))
        errors = [f"{name} {p['step_time_s'] / step_s - 1:+.0%}" for name, p in plans if p["step_time_s"]]
        print(
            f"ROW\trun {args.steps} steps\tmeasured {step_s:.4g} s/step (median after warm-up); plan error: {', '.join(errors)}"
        )
        keys = ("step", "step_time_ratio", "memory_ratio", "term")
        print(f"ROW\tplan_check event\t{', '.join(f'{k} {check.get(k)}' for k in keys)}")
        shown = run(env, "status", job_id)
        for line in shown.splitlines():
            if line.strip().startswith(("vs plan:", "used:")):
                label, _, rest = line.strip().partition(": ")
                print(f"ROW\tstatus {label}\t{rest}")
        if args.quick:
            return
        other = OTHER_CPU_JOB if args.cpu else OTHER_GPU_JOB
        sets = [f"train.{k}={v}" if "batch" in k else f"train.model.{k}={v}" for k, v in other.items()]
        sets_args = [item for key in sets for item in ("--set", key)]
        planned_s = json.loads(run(env, "plan", str(job), *cluster, "--json", *sets_args))["step_time_s"]
        out = run(env, "submit", str(job), *cluster, "--wait", *sets_args, timeout=900)
        run_dir = Path(next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("run dir: ")))
        step_s, _ = measured(run_dir)
        shape = " ".join(f"{k} {v}" for k, v in other.items())
        print(
            f"ROW\tsecond job\t{shape}: planned {planned_s:.4g} s/step, measured {step_s:.4g}, plan error {planned_s / step_s - 1:+.0%}"
        )


if __name__ == "__main__":
    main()
