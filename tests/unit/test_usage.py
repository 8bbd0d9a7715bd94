"""What a job used: the GPUs in Slurm's accounting, the nodes' energy counters (never a guess), GPU-hours and cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records import energy
from meshrun.launcher.sidecar.energy import EnergyMeter, nvml_gpus, rapl_packages
from meshrun.submit.core.findings import ENERGY_DIR, SPEC, findings_from
from meshrun.submit.core.usage import usage, usage_line
from meshrun.submit.schedulers.slurm_cli import allocated_gpus, parse_sacct
from meshrun.submit.views.top import used_cell


def test_the_gpus_of_an_allocation_come_from_sacct_alloctres() -> None:
    assert allocated_gpus("billing=16,cpu=16,gres/gpu=8,gres/gpu:h100=8,mem=64G,node=1") == 8
    assert allocated_gpus("billing=4,cpu=4,mem=2G,node=1") == 0
    assert allocated_gpus("") is None and allocated_gpus(None) is None
    line = "41|tiny|COMPLETED|0:0|00:01:40|00:30:00|n1|0|billing=2,cpu=2,gres/gpu=2,node=1"
    assert parse_sacct(line)["41"].gpus == 2
    assert parse_sacct("41|tiny|RUNNING|0:0|00:01:40|00:30:00|n1|0")["41"].gpus is None  # an older sacct line


def test_a_jobs_energy_is_the_sum_of_its_nodes_and_unmeasured_unless_every_node_measured() -> None:
    a = {"job": "7", "node": "n1", "gpu_j": 3.6e6, "cpu_j": None}
    b = {"job": "7", "node": "n2", "gpu_j": 7.2e6, "cpu_j": 1.0}
    assert energy.total([a, b]) == {"nodes": 2, "gpu_kwh": pytest.approx(3.0), "cpu_kwh": None}
    assert energy.total([]) is None
    assert energy.parse('{"job": "7", "gpu_j": -1}', "7") is None  # garbled: no record, not a figure
    assert energy.parse('{"job": "8", "gpu_j": 1}', "7") is None  # another job's


def test_rapl_counters_are_summed_over_packages_and_their_wrap_is_undone(tmp_path: Path) -> None:
    for name, start in (("intel-rapl:0", 990), ("intel-rapl:1", 10), ("intel-rapl:0:0", 5)):
        zone = tmp_path / name
        zone.mkdir()
        (zone / "energy_uj").write_text(f"{start}\n")
        (zone / "max_energy_range_uj").write_text("1000\n")
    cpus = rapl_packages(str(tmp_path))
    assert len(cpus) == 2  # the packages, not their sub-zones (parts of them)
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("20\n")  # wrapped: 990 -> 1000 -> 20, 30 uJ
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("60\n")
    assert EnergyMeter([], cpus).read() == {"gpu_j": None, "cpu_j": pytest.approx(80e-6)}


def test_no_readable_rapl_means_cpu_unmeasured(tmp_path: Path) -> None:
    assert rapl_packages(str(tmp_path / "none")) == []
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()  # the zone is there, its counter is root's: not readable
    assert rapl_packages(str(tmp_path)) == []


@dataclass(frozen=True)
class FakeDevice:
    uuid: str
    handle: Any


@dataclass(frozen=True)
class FakeTarget:
    uuid: str
    device: FakeDevice


class FakeNvml:
    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802 (NVML's name)
        if handle not in self.counters:
            raise RuntimeError("NVMLError_NotSupported")
        return self.counters[handle]


def test_nvml_counters_give_the_gpus_joules_and_a_gpu_without_one_makes_it_unmeasured() -> None:
    nvml = FakeNvml({"a": 1_000_000, "b": 2_000_000})
    targets = [FakeTarget(u, FakeDevice(u, u)) for u in ("a", "b")]
    gpus = nvml_gpus(nvml, targets)
    nvml.counters.update(a=1_500_000, b=2_250_000)  # mJ
    assert EnergyMeter(gpus, []).read() == {"gpu_j": pytest.approx(750.0), "cpu_j": None}
    assert nvml_gpus(FakeNvml({"a": 1}), targets) == []  # "b" has no counter: the node's GPU energy is unmeasured
    mig = [FakeTarget("MIG-1", FakeDevice("a", "a"))]
    assert nvml_gpus(nvml, mig) == []  # a MIG instance shares its GPU's counter


def test_usage_prices_gpu_hours_and_says_what_was_not_measured() -> None:
    used = usage(8, 1800.0, 3600.0, {"nodes": 1, "gpu_kwh": 1.25, "cpu_kwh": None}, 2.5, "USD")
    assert used["gpu_hours"] == 4.0 and used["run_gpu_hours"] == 8.0
    assert used["cost"] == {"amount": 10.0, "currency": "USD"}
    assert usage_line(used) == (
        "used: 4 GPU-hours (8 GPUs; the run dir's jobs 8), energy GPU 1.25 kWh, CPU unmeasured; cost 10.00 USD"
    )
    unpriced = usage(0, 60.0, None, None, 0.0, "")
    # A CPU job (a new user's trial: "used: 0 GPU-hours (0 GPUs; the run dir's jobs 0)"): said as what it is.
    assert unpriced["cost"] is None and usage_line(unpriced) == "used: no GPUs; energy not measured"
    assert usage_line(usage(None, 60.0, None, None, 0.0, "")) == "used: GPU-hours unknown, energy unmeasured"
    assert used_cell(used) == "10.00 USD" and used_cell(usage(8, 1800.0, None, None, 0.0, "")) == "4 GPU-h"
    assert used_cell(unpriced) == "-" and used_cell(None) == "-"


def test_a_job_without_gpus_says_nothing_of_gpu_energy() -> None:
    unmeasured = usage(0, 60.0, None, {"nodes": 1, "gpu_kwh": None, "cpu_kwh": None}, 0.0, "")
    assert usage_line(unmeasured) == "used: no GPUs; energy not measured"
    measured = usage(0, 60.0, None, {"nodes": 1, "gpu_kwh": None, "cpu_kwh": 0.0125}, 0.0, "")
    assert usage_line(measured) == "used: no GPUs; energy CPU 0.0125 kWh"
    gpu_job = usage(2, 3600.0, None, {"nodes": 1, "gpu_kwh": None, "cpu_kwh": None}, 0.0, "")
    assert usage_line(gpu_job) == "used: 2 GPU-hours (2 GPUs), energy GPU unmeasured, CPU unmeasured"


def test_status_reads_the_usage_from_the_run_dirs_records() -> None:
    files = {
        SPEC: '{"job": {"resources": {"nodes": 2, "gpus_per_node": 4}}, "run": {"gpu_hour_price": 3.0, "currency": "EUR"}}',
        f"{ENERGY_DIR}/12.n1.json": '{"job": "12", "node": "n1", "gpu_j": 3.6e6, "cpu_j": null}',
        f"{ENERGY_DIR}/12.n2.json": '{"job": "12", "node": "n2", "gpu_j": 3.6e6, "cpu_j": null}',
        f"{ENERGY_DIR}/11.n1.json": '{"job": "11", "node": "n1", "gpu_j": 9e9, "cpu_j": null}',  # the parent's
    }
    found = findings_from(files, submitted_at=0.0, job_id="12")
    used = found.usage(elapsed_s=900.0, allocated_gpus=None)  # no accounting: the spec's 2 x 4 GPUs
    assert used is not None and used["gpus"] == 8 and used["gpu_hours"] == 2.0
    assert used["energy"] == {"nodes": 2, "gpu_kwh": pytest.approx(2.0), "cpu_kwh": None}
    assert used["cost"] == {"amount": 6.0, "currency": "EUR"}
    assert found.usage(900.0, allocated_gpus=4)["gpus"] == 4  # type: ignore[index]  # Slurm's word first
    assert findings_from({}, 0.0, "12").usage(900.0, None) is None  # the list view fetches neither


def test_the_sidecar_plots_gpu_hours_and_their_cost() -> None:
    from types import SimpleNamespace

    from meshrun.launcher.sidecar.loop import Settings, Sidecar

    priced = SimpleNamespace(settings=Settings(gpus=8, gpu_hour_price=2.0))
    assert Sidecar.used(priced, {"allocated_s": 1800.0}) == {"usage/gpu_hours": 4.0, "usage/cost": 8.0}  # type: ignore[arg-type]
    cpu = SimpleNamespace(settings=Settings())
    assert Sidecar.used(cpu, {"allocated_s": 1800.0}) == {}  # type: ignore[arg-type]
