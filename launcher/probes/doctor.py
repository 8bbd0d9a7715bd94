"""`meshrun doctor`'s per-rank preflight program, run as the doctor job's `command:` on every rank.

    python -m meshrun.launcher.probes.doctor [--storage-mib N] [--data PATH]

Each rank records what it finds in RUN_DIR/doctor/rank-N.json (RunDir.doctor_result): versions, the GPUs
it sees, a GEMM throughput sniff (bf16 on a GPU, fp32 on the CPU of a CPU job), and on each node's local rank 0 the write throughput of
the checkpoint dir and scratch and the read throughput of the data path. It writes that file once
before any collective (so a node whose network is broken still reports its own checks), then the
all-reduce bus bandwidth inside its node and across nodes, and writes it again. A check that fails
is data, not a crash: the program exits 0 and `submit/jobs/doctor.py` judges the figures.

Fault injection for tests and drills (in the style of launcher/testing/faults.py; read by nothing else):

    MESHRUN_TEST_DOCTOR_FAIL=NODE   the ranks on NODE find their accelerator broken (the compute check fails)
    MESHRUN_TEST_DOCTOR_SLOW=NODE   NODE's storage is slow (each timed write or read takes 50x longer)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from meshrun.launcher import installed_version
from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.records.rundir import RunDir, expand_node_path, node_name, write_json
from meshrun.launcher.contract.spec.job import RunSpec, read_run_spec
from meshrun.launcher.probes.health import node_checks
from meshrun.launcher.rank.env import RankEnv, rank_env

FAIL_ENV = "MESHRUN_TEST_DOCTOR_FAIL"
SLOW_ENV = "MESHRUN_TEST_DOCTOR_SLOW"
SLOW_FACTOR = 50
"""MESHRUN_TEST_DOCTOR_SLOW makes each timed storage operation of its node take this many times longer
(a factor, not a fixed delay: the node is that much slower than its peers however loaded the machine is)."""
LATENCY_ELEMENTS, LATENCY_ITERS = 8, 30
"""The all-reduce whose time is all latency: what each of a step's many small collectives costs at least."""
CHUNK = 4 << 20
MIB = 1 << 20


def injected(env_key: str, node: str, environ: Mapping[str, str]) -> bool:
    """True when `env_key` names this node (a comma-separated list of node names)."""
    return node in {n.strip() for n in environ.get(env_key, "").split(",") if n.strip()}


# ------------------------------------------------------------------ versions and GPUs


def versions() -> dict[str, Any]:
    """torch, its CUDA and NCCL, the driver (NVML), meshrun and Python, as this rank runs them."""
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "driver": None,
        "meshrun": installed_version(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    out["driver"] = driver_version()
    return out


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version through NVML (launcher/sidecar/nvml.py), None without one."""
    from meshrun.launcher.sidecar.nvml import NvmlUnavailable, load_nvml

    try:
        nvml = load_nvml()
    except NvmlUnavailable:
        return None
    try:
        value = nvml.nvmlSystemGetDriverVersion()
        return value.decode() if isinstance(value, bytes) else str(value)
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()


def gpus(environ: Mapping[str, str]) -> dict[str, Any]:
    """The GPUs this task sees, as CUDA numbers them: UUID, model and memory of each."""
    import torch

    devices = []
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "index": index,
                "uuid": f"GPU-{props.uuid}" if hasattr(props, "uuid") else None,
                "model": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    return {"cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"), "count": count, "devices": devices}


# ------------------------------------------------------------------ compute


CPU_GEMM_N = 512
"""The CPU GEMM's size: large enough to run at the cores' matmul speed, small enough for 2-core machines."""
CPU_GEMM_SECONDS = 0.5
"""About how long the CPU GEMM is timed for."""


def gemm_tflops(local_rank: int, broken: bool, cpu: bool = False) -> dict[str, Any]:
    """bf16 GEMM throughput on this rank's GPU (8192^3, timed with CUDA events), or with `cpu` (a job that asks
    for no GPU) fp32 GEMM throughput on the CPU threads this rank trains with: what the planner calibrates with."""
    import torch

    if broken:
        raise RuntimeError(f"{FAIL_ENV}: this node's accelerator fails (injected fault)")
    if cpu:
        return cpu_gemm_tflops()
    if not torch.cuda.is_available():  # a GPU job on a rank without CUDA: the GPUs check says why
        return {"skipped": "no CUDA GPU on this rank"}
    torch.cuda.set_device(local_rank)
    n, iters = 8192, 30
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = seconds_per_call(lambda: torch.mm(a, b), iters, cuda=True)
    out = {"tflops": round(2 * n**3 / seconds / 1e12, 2), "device": torch.cuda.get_device_name(), "n": n}
    try:
        out["layers"] = layer_seconds(GPU_LAYER_SHAPES, cuda=True)
    except Exception as exc:  # the planner then keeps its datasheet share of the GEMM; the GEMM's verdict stands
        out["layers_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def cpu_gemm_tflops() -> dict[str, Any]:
    """fp32 GEMM throughput of this rank on the CPU, with the threads torch gives it (the job's OMP_NUM_THREADS)."""
    import torch

    n = CPU_GEMM_N
    a, b = torch.randn(n, n), torch.randn(n, n)
    once = seconds_per_call(lambda: torch.mm(a, b), 1, cuda=False)
    iters = max(3, min(200, int(CPU_GEMM_SECONDS / max(once, 1e-6))))
    seconds = seconds_per_call(lambda: torch.mm(a, b), iters, cuda=False)
    return {
        "tflops": round(2 * n**3 / seconds / 1e12, 4),
        "device": "cpu",
        "dtype": "float32",
        "n": n,
        "threads": torch.get_num_threads(),
        "node_cpus": os.cpu_count(),
        "layers": layer_seconds(LAYER_SHAPES, cuda=False),
    }


LAYER_SHAPES = ((64, 4, 16, 1), (128, 4, 128, 4))
"""(d_model, n_heads, seq_len, micro_batch) of the two models whose blocks the CPU probe times: the first so small
that its time is the framework's own (Python, autograd, dispatch), the second the size of a test job's."""
GPU_LAYER_SHAPES = ((256, 4, 256, 1), (4096, 32, 2048, 1))
"""The GPU probe's two shapes, in bf16: the first so small that its time is launching kernels (the per-block cost),
the second a 7B-class block whose matmuls keep the GPU busy (the share of the GEMM's rate blocks reach)."""
LAYER_DEPTHS = (1, 3)
"""Each shape timed with this many blocks: the difference is the blocks' own time (embedding, head and loss cancel)."""


def layer_seconds(shapes: Sequence[tuple[int, int, int, int]], cuda: bool) -> list[dict[str, Any]]:
    """Forward and backward of one of meshrun's own GPT blocks per micro-batch at each shape, on this rank's CPU
    threads (fp32) or its GPU (bf16, as the trainer's mixed precision computes): what the planner adds to a CPU job's
    matmuls, or the share of the GEMM's rate a GPU job's blocks reach (submit/planning/calibration.py fits them)."""
    import torch

    from meshrun.launcher.contract.spec.job import Model
    from meshrun.launcher.train.model import GPT, loss_fn

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    out = []
    for d_model, n_heads, seq_len, batch in shapes:
        steps = []
        for depth in LAYER_DEPTHS:
            model = GPT(Model(n_layers=depth, d_model=d_model, n_heads=n_heads, vocab_size=256, seq_len=seq_len))
            model = model.to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
            tokens = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)

            def step(model: Any = model, tokens: Any = tokens) -> None:
                model.zero_grad(set_to_none=True)
                loss_fn(model(tokens), tokens).backward()

            once = seconds_per_call(step, 1, cuda=cuda)
            steps.append((step, max(3, min(20, int(0.07 / max(once, 1e-6))))))
        # The fastest of 3 rounds, the depths timed in turn within each round: another process on a shared core
        # only ever adds time, and the two depths see the same load (the small block's 0.2 ms is the difference of
        # the two times; timed one depth after the other, a load burst on one made it 0 in a test).
        rounds = [[seconds_per_call(fn, iters, cuda=cuda) for fn, iters in steps] for _ in range(3)]
        times = [min(column) for column in zip(*rounds)]
        per_layer = max(times[1] - times[0], 0.0) / (LAYER_DEPTHS[1] - LAYER_DEPTHS[0])
        shape = {"d_model": d_model, "n_heads": n_heads, "seq_len": seq_len, "micro_batch": batch}
        out.append({**shape, "seconds": round(per_layer, 7)})
    return out


def seconds_per_call(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Seconds per call of `fn` after two warm-up calls; on CUDA measured with events, not host clocks
    (bench/gpu_ops.py times its GEMM and all-reduce with this too)."""
    import torch

    for _ in range(2):
        fn()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1000 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) / iters


# ------------------------------------------------------------------ storage


def write_mbps(folder: str, name: str, mib: int, slow: bool) -> float:
    """MB/s of writing `mib` MiB into `folder` and fsyncing it (the file is removed afterwards)."""
    make_private_dir(folder)
    path = os.path.join(folder, name)
    block = os.urandom(min(CHUNK, mib * MIB))
    begin = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < mib * MIB:
            written += os.write(fd, block[: min(len(block), mib * MIB - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    if slow:
        time.sleep((SLOW_FACTOR - 1) * (time.perf_counter() - begin))
    seconds = time.perf_counter() - begin
    os.unlink(path)
    return round(mib * MIB / seconds / 1e6, 1)


def read_mbps(path: str, mib: int, slow: bool) -> float:
    """MB/s of reading up to `mib` MiB of `path`, after asking the kernel to drop it from its cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # best effort: a cached file reads at RAM speed
        begin, total = time.perf_counter(), 0
        while total < mib * MIB:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                break
            total += len(chunk)
    finally:
        os.close(fd)
    if slow:
        time.sleep((SLOW_FACTOR - 1) * (time.perf_counter() - begin))
    return round(total / (time.perf_counter() - begin) / 1e6, 1)


STORAGE_TRIES = 3
"""Each storage figure is the best of this many: one write can share the disk with a neighbour's burst (on the
testbed, with the other node's own check), while a node whose storage is slow stays slow in every try."""


def measured(fn: Callable[[], float]) -> dict[str, Any]:
    """{"mbps": the best of STORAGE_TRIES} or {"error": one line}: a storage path that fails is reported, not raised."""
    try:
        return {"mbps": max(fn() for _ in range(STORAGE_TRIES))}
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def storage(run_spec: RunSpec, node: str, mib: int, data: Optional[str], slow: bool) -> dict[str, Any]:
    """Write throughput of the checkpoint dir and scratch, read throughput of the data path."""
    name = f".doctor-{node}-{os.getpid()}.bin"
    out: dict[str, Any] = {"mib": mib}
    ckpt = run_spec.run.checkpoint_dir or RunDir(run_spec.run.run_dir).default_checkpoints
    out["checkpoint"] = {"path": ckpt, **measured(lambda: write_mbps(ckpt, name, mib, slow))}
    scratch = expand_node_path(run_spec.run.scratch_dir)
    if scratch:
        out["scratch"] = {"path": scratch, **measured(lambda: write_mbps(scratch, name, mib, slow))}
        _remove_if_empty(scratch)  # the run's own folder on a node's scratch: leave nothing behind
    if data:
        out["data"] = {"path": data, **measured(lambda: read_mbps(data, mib, slow))}
    return out


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass  # another rank's file is still there, or it was never made


# ------------------------------------------------------------------ communication


def busbw(seconds: float, nbytes: int, ranks: int) -> float:
    """Bus bandwidth in GB/s as nccl-tests reports it for all-reduce: algbw x 2(n-1)/n."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


TIMED_BATCHES = 5
"""Each all-reduce figure is the median of this many timed batches: on CPU ranks that share their cores one batch
swung 2.5x between doctor runs (a tiny all-reduce 293-725 us on 2 cores), and the planner multiplies these."""


def _time_allreduce(tensor: Any, group: Any, iters: int, cuda: bool) -> float:
    """Seconds per all-reduce of `tensor`: the median over TIMED_BATCHES batches of `iters`, after two warm-ups."""
    import torch
    import torch.distributed as dist

    for _ in range(2):
        dist.all_reduce(tensor, group=group)
    batches = []
    for _ in range(TIMED_BATCHES):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)
        begin = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor, group=group)
        if cuda:
            torch.cuda.synchronize()
        batches.append((time.perf_counter() - begin) / iters)
    return statistics.median(batches)


def communication(env: RankEnv, node: str, cuda: bool) -> dict[str, Any]:
    """All-reduce bus bandwidth inside this node (a group per node) and across all nodes (the world), and the
    latency of a tiny all-reduce inside the node."""
    import torch
    import torch.distributed as dist

    nodes: list[Any] = [None] * env.world_size
    dist.all_gather_object(nodes, node)
    members: dict[str, list[int]] = {}
    for rank, name in enumerate(nodes):
        members.setdefault(str(name), []).append(rank)
    groups = {name: dist.new_group(ranks) for name, ranks in members.items()}  # every rank creates every group
    nbytes, iters = (256 * MIB, 10) if cuda else (4 * MIB, 5)
    dtype = torch.bfloat16 if cuda else torch.float32
    tensor = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device="cuda" if cuda else "cpu")
    out: dict[str, Any] = {"backend": dist.get_backend(), "bytes": nbytes, "ranks_on_node": len(members[node])}
    if len(members[node]) > 1:
        seconds = _time_allreduce(tensor, groups[node], iters, cuda)
        out["intra_node_busbw_gbps"] = round(busbw(seconds, nbytes, len(members[node])), 3)
        tiny = torch.ones(LATENCY_ELEMENTS, dtype=dtype, device=tensor.device)
        seconds = _time_allreduce(tiny, groups[node], LATENCY_ITERS, cuda)
        out["intra_node_latency_us"] = round(seconds * 1e6, 1)
    if len(members) > 1:
        seconds = _time_allreduce(tensor, None, iters, cuda)
        out["inter_node_busbw_gbps"] = round(busbw(seconds, nbytes, env.world_size), 3)
        out["nodes"] = len(members)
    return out


def init_group(env: RankEnv, cuda: bool) -> None:
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=120),
    )


# ------------------------------------------------------------------ the program


def check(result: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    """Run one check into result[key]; an exception becomes {"error": one line} (the node's verdict)."""
    try:
        result[key] = fn()
    except Exception as exc:  # a broken GPU or driver: reported, so the other checks still run
        result[key] = {"error": f"{type(exc).__name__}: {exc}"}


def run(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    args = parse_args(argv)
    run_dir = environ["MESHRUN_RUN_DIR"]
    run_spec = read_run_spec(Path(run_dir))
    env = rank_env(environ)
    node = node_name(environ)
    path = RunDir(run_dir).doctor_result(env.rank)
    result: dict[str, Any] = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "world_size": env.world_size,
        "node": node,
        "hostname": socket.gethostname(),
        "phase": "local",
    }
    check(result, "versions", versions)
    check(result, "gpus", lambda: gpus(environ))
    on_cpu = run_spec.job.resources.gpus_per_node == 0
    check(result, "compute", lambda: gemm_tflops(env.local_rank, injected(FAIL_ENV, node, environ), cpu=on_cpu))
    if env.local_rank == 0:
        slow = injected(SLOW_ENV, node, environ)
        check(result, "storage", lambda: storage(run_spec, node, args.storage_mib, args.data, slow))
        # The health gate's own checks (GPU faults, free space, Python), the one implementation of them.
        check(result, "health", lambda: [asdict(c) for c in node_checks(run_spec, node, environ, reference=None)])
    write_json(path, result, indent=1)  # before any collective: a node that cannot talk still reports
    import torch

    cuda = torch.cuda.is_available() and run_spec.job.resources.gpus_per_node > 0
    try:
        init_group(env, cuda)
        check(result, "comm", lambda: communication(env, node, cuda))
    except Exception as exc:  # the rendezvous itself failed: that is this node's finding
        result["comm"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["phase"] = "done"
    write_json(path, result, indent=1)
    print(f"[doctor] rank {env.rank} on {node}: results in {path}", flush=True)
    _teardown()
    return 0


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m meshrun.launcher.probes.doctor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--storage-mib", type=int, default=64, help="MiB written (and read) per storage check")
    parser.add_argument("--data", help="the data path to read (absolute, as the ranks see it)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], os.environ))
