"""On a GPU machine: the sidecar reads real NVML, maps CUDA_VISIBLE_DEVICES to UUIDs as CUDA does, and
writes GPU lines by UUID. Skips cleanly without NVML (CI, the CPU dev machines); run with
`pytest -q -s tests/gpu/test_sidecar_nvml.py` (-s prints one sample per GPU for the record)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import JobSpec, Resources, RunInfo, RunSpec, write_run_spec
from meshrun.launcher.sidecar import loop
from meshrun.launcher.sidecar.nvml import Gpus, NvmlUnavailable, discover, load_nvml, resolve


def _nvml() -> Any:
    try:
        return load_nvml()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")


pytestmark = pytest.mark.gpu


def test_real_gpus_have_uuids_in_pci_order_and_every_basic_metric() -> None:
    nvml = _nvml()
    devices = discover(nvml)
    if not devices:
        pytest.skip("NVML sees no GPU")
    assert all(d.uuid.startswith(("GPU-", "MIG-")) for d in devices)
    assert [d.pci_bus_id for d in devices] == sorted(d.pci_bus_id for d in devices)
    targets, problems = resolve(None, devices, len(devices))
    log: list[str] = []
    gpus = Gpus(nvml, targets, log.append)
    gpus.sample(now=1.0)
    rows = gpus.sample(now=2.0)  # the second has the NVLink rate where the driver gives it
    for row in rows:
        print(json.dumps(row, sort_keys=True))
    print("\n".join(log))
    assert problems == [] and len(rows) == len(devices)
    for row in rows:
        assert 0 <= row["util_pct"] <= 100 and 0 < row["mem_used_mib"] <= row["mem_total_mib"]
        assert row["power_w"] > 0 and 0 < row["temp_c"] < 120 and row["sm_clock_mhz"] > 0
        assert isinstance(row["throttle"], list)
    described = gpus.describe()
    assert described["driver"] and described["cuda"]
    gpus.close()


def test_cuda_index_and_uuid_name_the_same_gpu_as_torch() -> None:
    """NVML's order is not CUDA's: our index 0 must be CUDA's device 0 (checked by UUID through torch)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    nvml = _nvml()
    devices = discover(nvml)
    props = torch.cuda.get_device_properties(0)
    if not hasattr(props, "uuid"):
        pytest.skip("this torch gives no device UUID")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = None if visible is None else tuple(e for e in visible.split(",") if e)
    targets, _ = resolve(entries, devices, 1)
    assert targets[0].uuid.removeprefix("GPU-") == str(props.uuid), (targets[0], props.uuid)
    by_uuid, _ = resolve((targets[0].uuid,), devices, 1)
    assert by_uuid[0].uuid == targets[0].uuid


def test_the_sidecar_writes_gpu_lines_by_uuid_and_the_env_record(tmp_path: Path) -> None:
    nvml = _nvml()
    if not discover(nvml):
        pytest.skip("NVML sees no GPU")
    nvml.nvmlShutdown()
    job = JobSpec(name="t", resources=Resources(tasks_per_node=1, gpus_per_node=1), command=("true",))
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="local", scheduler="local", run_dir=str(tmp_path))), tmp_path)
    run_dir = RunDir(str(tmp_path))
    log: list[str] = []
    sidecar = loop.Sidecar(run_dir, "gpu0", {"CUDA_VISIBLE_DEVICES": "0"}, log.append)
    sidecar.sample()
    sidecar.close()
    lines = [json.loads(line) for line in Path(run_dir.gpu_metrics).read_text().splitlines()]
    (gpu,) = [line for line in lines if line["kind"] == "gpu"]
    assert gpu["uuid"].startswith(("GPU-", "MIG-")) and gpu["local_rank"] == 0 and gpu["rank"] == 0
    record = json.loads(Path(run_dir.env_record("gpu0")).read_text())
    assert record["driver"] and record["cuda"] and record["gpus"][0]["uuid"] == gpu["uuid"]
    print(json.dumps(record, sort_keys=True))


def test_the_gpus_energy_counter_measures_a_burst_of_matmuls() -> None:
    """What the sidecar records as the job's GPU energy (launcher/sidecar/energy.py): NVML's total-energy counter
    of each GPU rises while it computes (a GPU without one, pre-Volta, is unmeasured and skips)."""
    import time

    from meshrun.launcher.sidecar.energy import EnergyMeter, nvml_gpus

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    nvml = _nvml()
    targets, _ = resolve(("0",), discover(nvml), 1)
    counters = nvml_gpus(nvml, targets)
    if not counters:
        pytest.skip("this GPU has no total-energy counter")
    meter = EnergyMeter(counters, [])
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    began = time.monotonic()
    while time.monotonic() - began < 3:
        a @ a
    torch.cuda.synchronize()
    used = meter.read()["gpu_j"]
    print(f"GPU 0: {used:.0f} J in {time.monotonic() - began:.1f} s of bf16 matmuls")
    assert used is not None and used > 3 * 30  # above 30 W for 3 s: any datacenter GPU computing
