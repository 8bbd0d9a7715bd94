"""What a job used (submit/core/usage.py), end to end: on the real Slurm testbed the GPUs come from Slurm's
accounting (sacct's AllocTRES), the cost from the profile's cost.gpu_hour, and the energy says "unmeasured" where
the nodes have no counter (the testbed's GPUs are device files NVML does not know; this machine has no RAPL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from meshrun.launcher.contract.records.rundir import RunDir
from tests.helpers.cli import meshrun, status, submitted
from tests.testbed.testbed import profile_file

PRICE = 2.5


def priced_profile(tmp_path: Path) -> Path:
    """The worker's testbed profile with GPU-hours priced, as a user's own profile file."""
    profile = yaml.safe_load(profile_file().read_text())
    profile["cost"] = {"gpu_hour": PRICE, "currency": "EUR"}
    path = tmp_path / "priced.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def test_a_gpu_jobs_gpu_hours_come_from_slurm_accounting_and_are_priced(testbed: dict, tmp_path: Path) -> None:
    spec = {
        "name": "gpu-usage",
        "resources": {"nodes": 1, "gpus_per_node": 1, "time": "00:05:00"},
        "command": ["sleep", "3"],
        # the testbed's GPUs are device files: the health gate's NVML check would fail every node
        "resilience": {"health_check": False},
    }
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = meshrun(tmp_path, "submit", str(path), "-c", str(priced_profile(tmp_path)), "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    written = json.loads((run_dir / "spec.json").read_text())
    assert (written["run"]["gpu_hour_price"], written["run"]["currency"]) == (PRICE, "EUR")
    row = status(tmp_path, job_id)
    used = row["usage"]
    assert used["gpus"] == 1, used  # sacct's AllocTRES: gres/gpu=1
    allocated = (row.get("goodput") or {}).get("allocated_s") or row["elapsed_s"]
    assert used["gpu_hours"] == pytest.approx(allocated / 3600) and used["gpu_hours"] > 0, row
    assert used["cost"] == {"amount": pytest.approx(used["gpu_hours"] * PRICE), "currency": "EUR"}, used
    # the sidecar measured the node: no counter there, so unmeasured, never a guess
    assert used["energy"] == {"nodes": 1, "gpu_kwh": None, "cpu_kwh": None}, used
    records = list(Path(RunDir(str(run_dir)).energy(job_id, "x")).parent.glob(f"{job_id}.*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["gpu_j"] is None
    shown = meshrun(tmp_path, "status", job_id, check=True).stdout
    line = next(line for line in shown.splitlines() if line.startswith("used: "))
    assert line == (
        f"used: {used['gpu_hours']:.3g} GPU-hours (1 GPUs), energy GPU unmeasured, CPU unmeasured; "
        f"cost {used['cost']['amount']:.2f} EUR"
    ), shown


def test_a_cpu_job_on_local_used_no_gpu_hours_and_its_energy_is_unmeasured(tmp_path: Path) -> None:
    spec = {
        "name": "cpu-usage",
        "resources": {"nodes": 1, "tasks_per_node": 1, "time": "00:05:00"},
        "command": ["sleep", "2"],
    }
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = meshrun(tmp_path, "submit", str(path), "-c", "local", "--wait", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, _ = submitted(out)
    used = status(tmp_path, job_id)["usage"]
    assert used["gpus"] == 0 and used["gpu_hours"] == 0 and used["cost"] is None, used
    assert used["energy"] == {"nodes": 1, "gpu_kwh": None, "cpu_kwh": None}, used
    assert meshrun(tmp_path, "status", job_id, check=True).stdout.count("used: no GPUs; energy not measured") == 1
