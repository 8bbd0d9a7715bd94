"""The sidecar (launcher/sidecar): UUID mapping, every metric path and XID events through a fake NVML,
the no-NVML path for real on this machine, host metrics from a fake /proc, the env record, the loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records import goodput
from meshrun.launcher.contract.records.envcheck import env_mismatches
from meshrun.launcher.contract.records.rundir import RunDir, node_name
from meshrun.launcher.contract.spec.job import JobSpec, Resources, RunInfo, RunSpec, Sidecar, write_run_spec
from meshrun.launcher.contract.spec.schema import SchemaError, load
from meshrun.launcher.sidecar import keeper, loop, nvml, sidelog
from meshrun.launcher.sidecar.host import Host
from tests.unit import fake_nvml
from tests.unit.fake_nvml import FakeGpu

REPO = Path(__file__).resolve().parents[2]
# NVML's index order (the list's) is not PCI order: NVML 0 is the GPU on bus 0x41, CUDA 0 the one on 0x01.
GPUS = [
    FakeGpu(uuid="GPU-bbbb2222-0000", bus="00000000:41:00.0"),
    FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0"),
    FakeGpu(uuid="GPU-cccc3333-0000", bus="00000000:81:00.0", migs=("MIG-dddd4444-0000", "MIG-eeee5555-0000")),
]


def devices(gpus: list[FakeGpu] = GPUS) -> list[nvml.Device]:
    return nvml.discover(fake_nvml.make(gpus))


def mapped(visible: Any, tasks: int = 8) -> tuple[list[tuple[int, str, Any]], list[str]]:
    targets, problems = nvml.resolve(visible, devices(), tasks)
    return [(t.cuda_index, t.uuid, t.local_rank) for t in targets], problems


class Lines(list):  # a Log stand-in
    def __call__(self, message: str) -> None:
        self.append(message)


# --- CUDA_VISIBLE_DEVICES -> UUIDs ---------------------------------------------------------------------


def test_indexes_count_in_pci_order_never_nvml_order() -> None:
    assert mapped(("0", "1")) == ([(0, "GPU-aaaa1111-0000", 0), (1, "GPU-bbbb2222-0000", 1)], [])
    assert mapped(("2", "0"))[0] == [(0, "GPU-cccc3333-0000", 0), (1, "GPU-aaaa1111-0000", 1)]


def test_unset_means_every_gpu_and_ranks_only_as_many_as_the_node_runs() -> None:
    assert mapped(None, tasks=2)[0] == [
        (0, "GPU-aaaa1111-0000", 0),
        (1, "GPU-bbbb2222-0000", 1),
        (2, "GPU-cccc3333-0000", None),
    ]


def test_uuids_full_prefixed_unprefixed_and_mig() -> None:
    assert mapped(("GPU-bbbb2222-0000", "gpu-aaaa", "cccc3333"))[0] == [
        (0, "GPU-bbbb2222-0000", 0),
        (1, "GPU-aaaa1111-0000", 1),
        (2, "GPU-cccc3333-0000", 2),
    ]
    targets, problems = nvml.resolve(("MIG-eeee5555",), devices(), 1)
    assert problems == [] and targets[0].uuid == "MIG-eeee5555-0000"
    assert targets[0].device.uuid == "GPU-cccc3333-0000"  # the parent GPU is what is sampled


@pytest.mark.parametrize(
    "visible, kept, why",
    [
        (("1", "7", "0"), ["GPU-bbbb2222-0000"], "'7': no GPU 7 on this node (3 GPUs)"),
        (("GPU-aaaa", "GPU-ffff"), ["GPU-aaaa1111-0000"], "'GPU-ffff': no GPU of this node has that UUID"),
        (("GPU-",), [], "'GPU-': that prefix names several GPUs"),
    ],
)
def test_a_missing_gpu_is_one_line_and_ends_the_list_as_in_cuda(visible: Any, kept: list[str], why: str) -> None:
    targets, problems = mapped(visible)
    assert [uuid for _, uuid, _ in targets] == kept
    assert len(problems) == 1 and problems[0].startswith(f"CUDA_VISIBLE_DEVICES entry {why}"), problems


def test_a_gpu_named_twice_is_sampled_once() -> None:
    targets, problems = mapped(("0", "GPU-aaaa1111"))
    assert [t[1] for t in targets] == ["GPU-aaaa1111-0000"] and "twice" in problems[0]


# --- every metric, unsupported ones, errors, XID ------------------------------------------------------------


def gpus_for(fakes: list[FakeGpu], visible: Any = None, **make: Any) -> tuple[nvml.Gpus, Any, Lines]:
    module = fake_nvml.make(fakes, **make)
    targets, _ = nvml.resolve(visible, nvml.discover(module), 8)
    log = Lines()
    return nvml.Gpus(module, targets, log), module, log


def test_every_metric_of_one_gpu() -> None:
    gpu = FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0")
    gpus, _, log = gpus_for([gpu])
    (first,) = gpus.sample(now=100.0)
    assert first == {
        "uuid": "GPU-aaaa1111-0000",
        "cuda_index": 0,
        "local_rank": 0,
        "util_pct": 50,
        "mem_util_pct": 25,
        "mem_used_mib": 10 * 1024,
        "mem_total_mib": 141 * 1024,
        "power_w": 400.0,
        "temp_c": 60,
        "sm_clock_mhz": 1980,
        "throttle": ["sw_power_cap", "hw_thermal"],
        "ecc_corrected": 3,
        "ecc_uncorrected": 0,
        "pcie_tx_kb_s": 1000,
        "pcie_rx_kb_s": 2000,
    }  # NVLink is a rate: from the second sample on
    gpu.nvlink_kib[:] = [2000.0, 500.0]
    (second,) = gpus.sample(now=102.0)
    assert second["nvlink_tx_kib_s"] == 1000.0 and second["nvlink_rx_kib_s"] == 250.0
    assert log == []


def test_a_metric_the_driver_lacks_is_left_out_and_asked_once() -> None:
    gpu = FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0", unsupported={"ecc", "nvlink", "pcie"})
    gpus, module, log = gpus_for([gpu])
    calls = []
    real = module.nvmlDeviceGetTotalEccErrors
    module.nvmlDeviceGetTotalEccErrors = lambda *a: calls.append(a) or real(*a)
    rows = [gpus.sample(now=float(t))[0] for t in range(3)]
    assert all("ecc_corrected" not in r and "nvlink_tx_kib_s" not in r and "pcie_tx_kb_s" not in r for r in rows)
    assert all(r["util_pct"] == 50 for r in rows)
    assert len(calls) == 2  # corrected and uncorrected asked once, never again
    assert sum("not given by this driver" in line for line in log) == 4  # corrected, uncorrected, pcie, nvlink


def test_an_nvml_error_is_logged_once_and_sampling_goes_on() -> None:
    gpu = FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0", broken={"power"})
    gpus, _, log = gpus_for([gpu])
    rows = [gpus.sample(now=float(t))[0] for t in range(3)]
    assert all("power_w" not in r and r["temp_c"] == 60 for r in rows)
    assert log == ["power_w: NVML error 999 (logged once; sampling goes on)"]


def test_an_xid_event_lands_on_its_gpus_line_and_in_the_log() -> None:
    fakes = [
        FakeGpu(uuid="GPU-bbbb2222-0000", bus="00000000:41:00.0"),
        FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0"),
    ]
    gpus, module, log = gpus_for(fakes)
    assert sorted(module.state["registered"]) == ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000"]
    module.state["pending"].extend([("GPU-bbbb2222-0000", 79), ("GPU-bbbb2222-0000", 48)])
    rows = {r["uuid"]: r for r in gpus.sample(now=1.0)}
    assert rows["GPU-bbbb2222-0000"]["xid"] == [79, 48] and "xid" not in rows["GPU-aaaa1111-0000"]
    assert log == ["XID 79, 48 on GPU-bbbb2222-0000 (CUDA 1, local rank 1)"]
    assert all("xid" not in r for r in gpus.sample(now=2.0))  # each event once


def test_without_event_support_it_says_so_and_samples_on() -> None:
    gpus, _, log = gpus_for([FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0")], events=False)
    assert gpus.events is None and len(log) == 1 and log[0].startswith("XID events: not available here")
    assert gpus.sample(now=1.0)[0]["util_pct"] == 50


# --- the whole sidecar with the fake NVML ------------------------------------------------------------------


def run_dir_with_spec(tmp_path: Path, tasks: int = 2, nodes: int = 1) -> RunDir:
    job = JobSpec(name="t", resources=Resources(nodes=nodes, tasks_per_node=tasks), command=("true",))
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="local", scheduler="local", run_dir=str(tmp_path))), tmp_path)
    return RunDir(str(tmp_path))


def gpu_lines(run_dir: RunDir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(run_dir.gpu_metrics).read_text().splitlines()]


def test_sidecar_with_nvml_writes_gpu_lines_by_uuid_env_record_and_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make(GPUS))
    run_dir = run_dir_with_spec(tmp_path, tasks=2, nodes=2)
    environ = {
        "CUDA_VISIBLE_DEVICES": "GPU-bbbb2222,0",
        "SLURMD_NODENAME": "n2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "7",
    }
    log = sidelog.Log(run_dir.sidecar_log("n2"), "n2")
    sidecar = loop.Sidecar(run_dir, node_name(environ), environ, log)
    sidecar.sample()
    sidecar.close()
    lines = gpu_lines(run_dir)
    gpu = [(l["uuid"], l["cuda_index"], l["local_rank"], l["rank"], l["node"]) for l in lines if l["kind"] == "gpu"]
    assert gpu == [("GPU-bbbb2222-0000", 0, 0, 2, "n2"), ("GPU-aaaa1111-0000", 1, 1, 3, "n2")]
    assert [l["kind"] for l in lines].count("host") == 1
    record = json.loads(Path(run_dir.env_record("n2")).read_text())
    assert record["driver"] == "550.54.15" and record["cuda"] == "12.4" and record["run"] == "7.0"
    assert [g["uuid"] for g in record["gpus"]] == ["GPU-bbbb2222-0000", "GPU-aaaa1111-0000"]
    assert record["gpus"][0]["model"] == "NVIDIA H200" and record["meshrun"] and record["python"]
    assert list(Path(run_dir.sidecar_tensorboard("n2")).glob("events.out.tfevents.*"))
    text = Path(run_dir.sidecar_log("n2")).read_text()
    assert "CUDA 0=GPU-bbbb2222-0000 (local rank 0), CUDA 1=GPU-aaaa1111-0000 (local rank 1)" in text


def test_tensorboard_scalars_are_tagged_by_rank_and_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make(GPUS[1:2]))
    run_dir = run_dir_with_spec(tmp_path, tasks=1)
    sidecar = loop.Sidecar(run_dir, "n1", {}, Lines())
    sidecar.host.last = (time.monotonic() - 1.0, *sidecar.host.last[1:])  # type: ignore[index]
    sidecar.sample()
    sidecar.close()
    events = EventAccumulator(run_dir.sidecar_tensorboard("n1"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"gpu/rank0/util_pct", "gpu/rank0/power_w", "host/cpu_pct", "host/mem_used_mib"} <= tags, tags
    assert events.Scalars("gpu/rank0/util_pct")[0].value == 50


def test_an_empty_cuda_visible_devices_means_host_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make(GPUS))
    log = Lines()
    sidecar = loop.Sidecar(run_dir_with_spec(tmp_path), "vm", {"CUDA_VISIBLE_DEVICES": ""}, log)
    assert sidecar.gpus is None and log == [
        "the job has no GPUs here (CUDA_VISIBLE_DEVICES is empty): host metrics only"
    ]


def test_without_nvml_for_real_one_line_and_host_metrics_only(tmp_path: Path) -> None:
    """pynvml.nvmlInit() really fails on this machine (no driver)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here: tests/gpu covers this machine")
    run_dir = run_dir_with_spec(tmp_path)
    log = Lines()
    sidecar = loop.Sidecar(run_dir, "vm", {}, log)
    for _ in range(2):
        sidecar.sample()
    sidecar.close()
    assert log == [
        "no GPU metrics: NVML cannot start: NVML Shared Library Not Found; host CPU, memory and disk I/O only"
    ]
    lines = gpu_lines(run_dir)
    assert [l["kind"] for l in lines] == ["host", "host"]
    assert lines[0]["mem_total_mib"] > 0 and lines[0]["load1"] >= 0
    record = json.loads(Path(run_dir.env_record("vm")).read_text())
    assert record["driver"] is None and record["gpus"] == [] and record["torch"]


# --- host metrics from a fake /proc -------------------------------------------------------------------------


def fake_proc(root: Path, busy: int, idle: int, read_sectors: int, written_sectors: int) -> None:
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n")
    (root / "meminfo").write_text("MemTotal:       8000000 kB\nMemFree:  100 kB\nMemAvailable:   6000000 kB\n")
    (root / "loadavg").write_text("1.50 1.00 0.50 2/300 1234\n")
    (root / "diskstats").write_text(
        f"   8       0 sda 10 0 {read_sectors} 0 10 0 {written_sectors} 0 0 0 0\n"
        f"   8       1 sda1 10 0 {read_sectors} 0 10 0 {written_sectors} 0 0 0 0\n"
        "   7       0 loop0 10 0 99999 0 10 0 99999 0 0 0 0\n"
    )


def test_host_cpu_memory_and_disk_rates(tmp_path: Path) -> None:
    proc, block = tmp_path / "proc", tmp_path / "block"
    proc.mkdir()
    (block / "sda").mkdir(parents=True)
    (block / "loop0").mkdir()
    fake_proc(proc, busy=100, idle=100, read_sectors=0, written_sectors=0)
    host = Host(str(proc), str(block))
    host.last = (time.monotonic() - 2.0, *host.last[1:])  # type: ignore[index]
    fake_proc(proc, busy=175, idle=125, read_sectors=2 * 2048 * 10, written_sectors=2 * 2048 * 4)
    row = host.sample()
    assert row["cpu_pct"] == 75.0 and row["mem_used_mib"] == 1953 and row["mem_total_mib"] == 7812
    assert row["load1"] == 1.5
    # 20 MiB read and 8 MiB written over ~2 s; the partition and the loop device are not counted
    assert row["disk_read_mib_s"] == pytest.approx(10.0, rel=0.01)
    assert row["disk_write_mib_s"] == pytest.approx(4.0, rel=0.01)


def test_host_without_proc_records_nothing(tmp_path: Path) -> None:
    assert Host(str(tmp_path / "none"), str(tmp_path)).sample() == {}


# --- environment record ---------------------------------------------------------------------------------------


def test_env_mismatches_names_each_differing_version_and_its_nodes() -> None:
    same = {"driver": "550.54", "cuda": "12.4", "torch": "2.6.0", "nccl": None, "meshrun": "0.1.0", "python": "3.11.7"}
    records = [
        {**same, "node": "n1"},
        {**same, "node": "n2", "driver": "535.104"},
        {**same, "node": "n3", "torch": "2.5.1"},
    ]
    assert env_mismatches(records) == [
        "driver differs between nodes: 535.104 on n2; 550.54 on n[1,3]",
        "torch differs between nodes: 2.5.1 on n3; 2.6.0 on n[1-2]",
    ]
    assert env_mismatches([{**same, "node": "n1"}, {**same, "node": "n2", "driver": None}]) == []


def test_the_env_check_warns_once_and_compares_only_this_run(tmp_path: Path) -> None:
    run_dir = run_dir_with_spec(tmp_path)
    log = Lines()
    sidecar = loop.Sidecar(run_dir, "n1", {"SLURM_JOB_ID": "9"}, log)
    other = {**sidecar.record, "node": "n2", "meshrun": "0.0.9"}
    old_run = {**sidecar.record, "node": "n3", "meshrun": "0.0.1", "run": "8.0"}
    for record in (other, old_run):
        Path(run_dir.env_record(record["node"])).write_text(json.dumps(record))
    sidecar.check_env()
    sidecar.check_env()
    sidecar.close()
    warnings = [line for line in log if line.startswith("warning:")]
    assert warnings == [f"warning: meshrun differs between nodes: 0.0.9 on n2; {sidecar.record['meshrun']} on n1"]


def test_node_0s_sidecar_accounts_the_running_jobs_goodput_and_others_do_not(tmp_path: Path) -> None:
    run_dir = run_dir_with_spec(tmp_path, nodes=2)
    goodput.record_start(run_dir.root, "9", 0, None, "n[1-2]")
    start = {"event": goodput.TRAIN_START, "from_step": 0, "restart_count": 0, "time": time.time(), "job": "9"}
    Path(run_dir.metrics).write_text(json.dumps(start) + "\n")
    first = loop.Sidecar(run_dir, "n1", {"SLURM_JOB_ID": "9", "SLURM_NODEID": "0"}, Lines())
    second = loop.Sidecar(run_dir, "n2", {"SLURM_JOB_ID": "9", "SLURM_NODEID": "1"}, Lines())
    assert "goodput" in {t.name for t in first.tasks()} and "goodput" not in {t.name for t in second.tasks()}
    first.account()
    first.close()
    second.close()
    figures = json.loads(Path(run_dir.goodput("9")).read_text())
    assert figures["running"] and figures["job"] == "9" and figures["parts_s"]["setup"] >= 0


# --- the loop and the process ------------------------------------------------------------------------------


def test_a_failing_task_is_logged_and_the_loop_goes_on() -> None:
    stop, log, runs = threading.Event(), Lines(), []

    def bad() -> None:
        raise OSError("disk full")

    def good() -> None:
        runs.append(1)
        if len(runs) == 3:
            stop.set()

    why = loop.run_tasks([loop.Periodic("bad", 0.01, bad), loop.Periodic("good", 0.01, good)], stop, lambda: True, log)
    assert why == "stop requested" and len(runs) == 3
    assert log == ["bad failed (1x so far): OSError: disk full"]


def test_the_loop_ends_when_its_parent_is_gone() -> None:
    alive = iter([True, True, False])
    why = loop.run_tasks([loop.Periodic("t", 0.01, lambda: None)], threading.Event(), lambda: next(alive), Lines())
    assert why == "its parent is gone"


def test_sidecar_interval_is_checked_by_the_spec() -> None:
    assert load(JobSpec, {"name": "x", "sidecar": {"interval_s": 2}}).sidecar == Sidecar(interval_s=2.0)
    with pytest.raises(SchemaError, match=r"sidecar.interval_s: 0.0: give 0.1 to 3600 seconds"):
        load(JobSpec, {"name": "x", "sidecar": {"interval_s": 0}})


def test_the_process_samples_at_the_spec_interval_and_stops_on_sigterm(tmp_path: Path) -> None:
    job = JobSpec(name="t", resources=Resources(tasks_per_node=1), command=("true",), sidecar=Sidecar(interval_s=0.2))
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="local", scheduler="local", run_dir=str(tmp_path))), tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURMD_NODENAME": "n1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "meshrun.launcher.sidecar", str(tmp_path)], env=env)
    run_dir = RunDir(str(tmp_path))
    deadline = time.monotonic() + 30
    while not Path(run_dir.gpu_metrics).exists() or len(gpu_lines(run_dir)) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, "no samples"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    log = Path(run_dir.sidecar_log("n1")).read_text()
    assert "stopping: stop requested" in log and log.rstrip().endswith("stopped") and "Traceback" not in log


def test_main_never_raises_into_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.launcher.sidecar.__main__ import main

    def broken(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(loop, "Sidecar", broken)
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("MESHRUN_SIDECAR_KEPT", "1")  # the sidecar itself, as its keeper runs it
    handlers = {sig: signal.getsignal(sig) for sig in (*keeper.STOP_SIGNALS, signal.SIGUSR1)}
    try:  # main() sets the sidecar's handlers, here in the test's own process
        assert main([str(tmp_path)]) == 1  # exit 1 goes to its keeper only, which starts it again
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    monkeypatch.delenv("MESHRUN_SIDECAR_KEPT")
    assert "stopped by an error: RuntimeError: boom" in Path(RunDir(str(tmp_path)).sidecar_log("n1")).read_text()
    assert main([]) == 2 and main(["-h"]) == 2
