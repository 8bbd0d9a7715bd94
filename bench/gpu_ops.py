"""The GPU machine's own numbers, the baselines the trainer's are judged against.

    python bench/gpu_ops.py nvml              # what NVML reports per GPU (name, UUID, memory, power, temperature)
    python bench/gpu_ops.py gemm              # bf16 GEMM TFLOP/s (8192^3) against the dense bf16 peak
    torchrun --nproc_per_node=N bench/gpu_ops.py allreduce   # NCCL all-reduce bus bandwidth on the local GPUs
    python bench/gpu_ops.py all --quick       # CPU: every check with tiny sizes (gloo, 2 processes); CI runs it

bench/gpu.sh runs these with the GPU tests and bench/gpu_train.py and prints one table.
Each result is one line `ROW<TAB>check<TAB>value`, which gpu.sh collects. Bus bandwidth is
nccl-tests' definition: algorithm bandwidth (bytes / time) x 2(n-1)/n, comparable to the
NVLink/NVSwitch figure; with one GPU there is nothing to measure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.launcher.probes.doctor import (  # one timing and one busbw for the doctor and the bench
    busbw,
    seconds_per_call,
)

BENCH = Path(__file__).resolve().parent


def row(check: str, value: str) -> None:
    print(f"ROW\t{check}\t{value}", flush=True)


def nvml(quick: bool) -> None:
    """One row per GPU from NVML (the nvidia-ml-py package meshrun depends on)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver, no library: reported, fatal only on a GPU run
        row("nvml", f"unavailable ({type(exc).__name__}: {exc})")
        if not quick:
            sys.exit(1)
        return
    try:
        row("nvml driver", str(pynvml.nvmlSystemGetDriverVersion()))
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            watts = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
            temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            row(
                f"nvml gpu {index}",
                f"{pynvml.nvmlDeviceGetName(handle)} {pynvml.nvmlDeviceGetUUID(handle)}, "
                f"{mem.used / 2**30:.1f}/{mem.total / 2**30:.1f} GiB used, {watts:.0f} W, "
                f"{temp} C",
            )
    finally:
        pynvml.nvmlShutdown()


def gemm(quick: bool) -> None:
    cuda = torch.cuda.is_available() and not quick
    n, iters = (256, 3) if quick else (8192, 50)
    device = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = seconds_per_call(lambda: torch.mm(a, b), iters, cuda)
    achieved = 2 * n**3 / seconds
    name = torch.cuda.get_device_name() if cuda else "cpu"
    sys.path.insert(0, str(BENCH))
    from gpu_train import peak_flops  # one table of peaks; imported here: the all-reduce ranks skip it

    peak = peak_flops(name)
    share = f", {achieved / peak * 100:.0f}% of the {peak / 1e12:.0f} TFLOP/s dense peak" if peak else ""
    row(f"bf16 gemm {n}^3", f"{achieved / 1e12:.2f} TFLOP/s on {name}{share}")


def allreduce(quick: bool) -> None:
    """Under torchrun: the bus bandwidth of the largest size (sizes double up to 1 GiB; quick: 1 MiB)."""
    cuda = torch.cuda.is_available() and not quick
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        sizes = [1 << 20] if quick else [1 << p for p in range(24, 31, 2)]  # 16 MiB ... 1 GiB
        results = []
        for size in sizes:
            data = torch.ones(
                size // 2, dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu"
            )
            seconds = seconds_per_call(lambda d=data: dist.all_reduce(d), 3 if quick else 20, cuda)
            results.append((size, busbw(seconds, data.numel() * data.element_size(), world)))
        if rank == 0:
            size, gbytes_s = results[-1]
            backend = "nccl" if cuda else "gloo"
            value = (
                f"{gbytes_s:.1f} GB/s bus bandwidth ({backend}, {world} ranks, {size / 2**20:.0f} MiB)"
                if world > 1
                else "n/a (one GPU: nothing to all-reduce across)"
            )
            row("all-reduce", value)
    finally:
        dist.destroy_process_group()


def launch_allreduce(quick: bool) -> None:
    """`all`: all-reduce needs its own processes, one per GPU (quick: 2 CPU processes)."""
    ranks = 2 if quick or not torch.cuda.is_available() else torch.cuda.device_count()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        __file__,
        "allreduce",
        *(["--quick"] if quick else []),
    ]
    subprocess.run(argv, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("nvml", "gemm", "allreduce", "all"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes on CPU (checks the script; CI runs it)")
    args = parser.parse_args()
    if not args.quick and not torch.cuda.is_available():
        sys.exit("gpu_ops: no CUDA device; run with --quick to check the script on CPU")
    if args.check in ("nvml", "all"):
        nvml(args.quick)
    if args.check in ("gemm", "all"):
        gemm(args.quick)
    if args.check == "allreduce":
        allreduce(args.quick)
    elif args.check == "all":
        launch_allreduce(args.quick)


if __name__ == "__main__":
    main()
