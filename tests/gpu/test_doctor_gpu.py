"""On a GPU machine: the doctor program (launcher/probes/doctor.py) on every local GPU, one rank each under torchrun,
judged by submit/jobs/doctor.py against a partition of this machine's own GPUs. Skips without a CUDA GPU.
`pytest -q -s tests/gpu/test_doctor_gpu.py` prints the table and the figures (GEMM TFLOP/s and share of
the dense bf16 peak, local all-reduce bus bandwidth) for the record; bench/gpu.sh runs it with tests/gpu."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher import installed_version
from meshrun.launcher.contract.gpus import PEAK_BF16_TFLOPS, peak_tflops
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import JobSpec, Resources, RunInfo, RunSpec, write_run_spec
from meshrun.submit.config.cluster import Partition, load_profile
from meshrun.submit.jobs.doctor import Options, judge, table

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here"),
]


def _run_dir(tmp_path: Path, gpus: int) -> str:
    job = JobSpec(name="doctor", resources=Resources(tasks_per_node=gpus, gpus_per_node=gpus), command=("true",))
    info = RunInfo(
        cluster="here",
        scheduler="local",
        run_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "ckpt"),
        scratch_dir=str(tmp_path / "scratch"),
    )
    write_run_spec(RunSpec(job=job, run=info), tmp_path)
    return str(tmp_path)


def _partition(results: list[dict[str, Any]], gpus: int) -> Partition:
    """This machine as a profile would describe it: its GPU type (a key of the peak table) and memory."""
    model = results[0]["gpus"]["devices"][0]["model"]
    gpu_type = next((k for k in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True) if k in model.lower()), None)
    memory = int(round(results[0]["gpus"]["devices"][0]["memory_gib"]))
    return Partition(name="here", gpus_per_node=gpus, gpu_type=gpu_type, gpu_memory_gb=memory)


def test_doctor_on_this_machines_gpus_passes_and_reports_its_figures(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    run_dir = _run_dir(tmp_path, gpus)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    argv += ["-m", "meshrun.launcher.probes.doctor", "--storage-mib", "256"]
    done = subprocess.run(
        argv, env=dict(os.environ, MESHRUN_RUN_DIR=run_dir), capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(Path(RunDir(run_dir).doctor_result(r)).read_text()) for r in range(gpus)]
    assert all(r["phase"] == "done" for r in results), results
    versions = results[0]["versions"]
    assert versions["cuda"] and versions["nccl"] and versions["driver"], versions  # NCCL and the driver seen
    uuids = {d["uuid"] for r in results for d in r["gpus"]["devices"]}
    assert len(uuids) == gpus and all(u.startswith("GPU-") for u in uuids), uuids
    tflops = [r["compute"]["tflops"] for r in results]
    assert min(tflops) > 0, results
    part = _partition(results, gpus)
    profile = dataclasses.replace(load_profile("h200-ndr"), partitions=(part,))
    report = judge(results, Options(nodes=1, partition=part, gpus_per_node=gpus), profile, installed_version())
    text = table(report)
    peak = peak_tflops(results[0]["compute"]["device"])
    share = f" = {min(tflops) / peak:.0%} of {peak:g}" if peak else ""
    busbw = results[0]["comm"].get("intra_node_busbw_gbps")
    print(f"\n{text}GEMM bf16 8192^3: {min(tflops):g} TFLOP/s{share}; local all-reduce busbw: {busbw} GB/s")
    assert report.bad_nodes == (), text
    if gpus > 1:
        assert busbw and busbw > 1.0, results  # NCCL over NVLink/PCIe: far above a CPU's gloo
