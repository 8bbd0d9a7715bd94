"""The sidecar's alerts (launcher/sidecar/alerting.py): GPU utilisation and memory streaks from the fake
NVML, rules turned off, stragglers from the real tracker, a hang from two real watchdogs, and node 0's
forwarding of the other nodes' lines (offsets, half-written lines, a requeued sidecar)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records import alerts
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import Alerts, JobSpec, Resources, RunInfo, RunSpec, write_run_spec
from meshrun.launcher.sidecar import loop, nvml
from meshrun.launcher.sidecar import watchdog as wd
from meshrun.launcher.sidecar.alerting import Alerting, Forwarder, GpuRules
from meshrun.launcher.sidecar.stragglers import RankTime, StragglerTracker
from tests.unit import fake_nvml
from tests.unit.fake_nvml import FakeGpu
from tests.unit.test_watchdog import SETTINGS, STALLED, USR2, WAITING, Clock, Kill, Lines, beat

GIB = 2**30


def low_gpu(**kw: Any) -> FakeGpu:
    """CUDA 0 (the first on the PCI bus), local rank 0: idle."""
    return FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0", **{"util": 10, **kw})


def busy_gpu(**kw: Any) -> FakeGpu:
    """CUDA 1, local rank 1: busy."""
    return FakeGpu(uuid="GPU-bbbb2222-0000", bus="00000000:41:00.0", **{"util": 85, **kw})


def gpu_rows(gpus: nvml.Gpus, now: float) -> list[dict[str, Any]]:
    """What Sidecar.sample hands the rules: the fake NVML's rows with their global rank."""
    return [{**row, "rank": row["local_rank"]} for row in gpus.sample(now)]


def fake_gpus(*fakes: FakeGpu) -> nvml.Gpus:
    module = fake_nvml.make(list(fakes))
    targets, _ = nvml.resolve(None, nvml.discover(module), 8)
    return nvml.Gpus(module, targets, Lines())


def rules_over(rules: GpuRules, gpus: nvml.Gpus, times: range) -> list[tuple[float, str, Any]]:
    """(time, rule, rank) of every alert a sample at each time raises."""
    fired = []
    for t in times:
        fired += [(a.time, a.rule, a.rank) for a in rules.check(gpu_rows(gpus, float(t)), "n1", float(t), 7)]
    return fired


# --- GPU rules -------------------------------------------------------------------------------------------


def test_low_utilisation_fires_once_per_streak_per_gpu_and_a_busy_sample_breaks_the_streak() -> None:
    low, busy = low_gpu(), busy_gpu()
    gpus = fake_gpus(low, busy)
    rules = GpuRules(Alerts(gpu_util_below_pct=30, gpu_util_minutes=10, gpu_memory_fraction=0))
    assert rules_over(rules, gpus, range(0, 600, 60)) == []  # 9 min below: not yet
    (alert,) = rules.check(gpu_rows(gpus, 600.0), "n1", 600.0, 7)
    assert (alert.rule, alert.value, alert.threshold, alert.rank, alert.node, alert.step) == (
        "gpu_util_low",
        10.0,
        30,
        0,
        "n1",
        7,
    )
    assert "GPU-aaaa1111-0000" in alert.message and "70-90%" in alert.message
    assert rules_over(rules, gpus, range(660, 1800, 60)) == []  # the same streak: never again
    low.util = 30  # at the threshold is not below it: the streak ends
    assert rules_over(rules, gpus, range(1800, 1801)) == []
    low.util = 5
    assert rules_over(rules, gpus, range(1860, 2460, 60)) == []
    assert rules_over(rules, gpus, range(2460, 2461)) == [(2460.0, "gpu_util_low", 0)]  # a new streak
    low.util = 50  # one busy sample restarts the count; the other GPU's streak is its own
    busy.util = 5
    assert rules_over(rules, gpus, range(2520, 2521)) == []
    low.util = 5
    fired = rules_over(rules, gpus, range(2580, 3600, 60))
    assert fired == [(3120.0, "gpu_util_low", 1), (3180.0, "gpu_util_low", 0)]


def test_memory_above_the_fraction_fires_once_per_streak() -> None:
    gpu = busy_gpu(used=130 * GIB, total=141 * GIB)
    gpus = fake_gpus(gpu)
    rules = GpuRules(Alerts(gpu_util_below_pct=0, gpu_memory_fraction=0.9))
    fired = rules.check(gpu_rows(gpus, 1.0), "n1", 1.0, None)
    assert [(a.rule, a.value, a.threshold) for a in fired] == [("gpu_memory_high", round(130 / 141, 4), 0.9)]
    assert "uses 133120 of 144384 MiB (92%, over 90%)" in fired[0].message
    assert rules_over(rules, gpus, range(2, 10)) == []
    gpu.used = 100 * GIB
    assert rules_over(rules, gpus, range(10, 11)) == []
    gpu.used = 140 * GIB
    assert [r for _, r, _ in rules_over(rules, gpus, range(11, 13))] == ["gpu_memory_high"]


def test_rules_at_zero_or_false_are_off(tmp_path: Path) -> None:
    gpus = fake_gpus(low_gpu(used=140 * GIB))
    off = Alerts(gpu_util_below_pct=0, gpu_util_minutes=1, gpu_memory_fraction=0, stragglers=False, hangs=False)
    alerting = Alerting(RunDir(str(tmp_path)), "n1", 0, off, Lines(), lambda: None)
    for t in range(0, 3600, 60):
        alerting.on_sample(gpu_rows(gpus, float(t)), float(t))
    alerting.on_straggler(RankTime(1, "n1", 2.0), 4.0, 0.5, 1.5, 10.0)
    alerting.on_verdict({"verdict": "Hang at step 3 (phase step). More.", "step": 3}, 11.0)
    assert not Path(RunDir(str(tmp_path)).alerts).exists()
    on = Alerting(RunDir(str(tmp_path)), "n1", 0, Alerts(gpu_util_minutes=1), Lines(), lambda: None)
    for t in range(0, 120, 60):  # the defaults: both GPU rules on
        on.on_sample(gpu_rows(gpus, float(t)), float(t))
    assert [r["rule"] for r in alerts.read(on.path)] == ["gpu_memory_high", "gpu_util_low"]


def spec_dir(tmp_path: Path, **alert_settings: Any) -> RunDir:
    job = JobSpec(
        name="t", resources=Resources(nodes=2, tasks_per_node=1), command=("true",), alerts=Alerts(**alert_settings)
    )
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="local", scheduler="local", run_dir=str(tmp_path))), tmp_path)
    return RunDir(str(tmp_path))


def test_the_sidecar_of_another_node_writes_its_own_file_and_node_0_forwards_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole Sidecar over the fake NVML: node 1's GPU memory alert lands in its node file and its log,
    node 0's forwarding task copies it into alerts.jsonl."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make([busy_gpu(used=140 * GIB)]))
    run_dir = spec_dir(tmp_path, gpu_memory_fraction=0.9)
    Path(run_dir.logs).mkdir()  # a job's batch script makes it
    n2_log, n1_log = Lines(), Lines()
    n2 = loop.Sidecar(run_dir, "n2", {"SLURM_NODEID": "1", "SLURM_NNODES": "2"}, n2_log)
    n1 = loop.Sidecar(run_dir, "n1", {"SLURM_NODEID": "0", "SLURM_NNODES": "2"}, n1_log)
    assert [t.name for t in n2.tasks()].count("alert forwarding") == 0
    assert [t.name for t in n1.tasks()].count("alert forwarding") == 1
    n2.sample()
    n2.sample()
    (record,) = alerts.read(run_dir.node_alerts("n2"))
    assert (record["rule"], record["rank"], record["node"]) == ("gpu_memory_high", 1, "n2")
    assert [line for line in n2_log if "ALERT" in line] == [
        alerts.Alert(**{k: record[k] for k in record}).line()  # the log line of the very alert
    ]
    assert not Path(run_dir.alerts).exists()
    next(t for t in n1.tasks() if t.name == "alert forwarding").run()
    assert alerts.read(run_dir.alerts) == [record]
    rank0_log = Path(run_dir.rank_log(0)).read_text()  # and a line where rank 0's own alerts are
    assert rank0_log == alerts.Alert(**record).line() + " (sidecar n2)\n", rank0_log
    n1.close()  # a last forward at stop: nothing new, nothing twice
    n2.close()
    assert alerts.read(run_dir.alerts) == [record]
    assert Path(run_dir.rank_log(0)).read_text() == rank0_log


# --- forwarding ------------------------------------------------------------------------------------------


def alert_line(rule: str, t: float, node: str = "n2") -> str:
    return json.dumps(alerts.Alert(rule, 1.0, 0.5, f"{rule} at {t}", 3, 1, node, t).record(), sort_keys=True) + "\n"


def test_forwarding_remembers_offsets_waits_for_a_half_written_line_and_skips_garbage(tmp_path: Path) -> None:
    run_dir = RunDir(str(tmp_path))
    n2 = Path(run_dir.node_alerts("n2"))
    n3 = Path(run_dir.node_alerts("n3"))
    n2.parent.mkdir(parents=True)
    first, second, third = (alert_line("straggler", t) for t in (1.0, 2.0, 3.0))
    n2.write_text(first + second + third[:20])  # the third is being written
    n3.write_text(alert_line("gpu_util_low", 1.5, "n3"))
    log = Lines()
    forwarder = Forwarder(run_dir, log)
    assert len(forwarder.forward()) == 3
    assert [r["time"] for r in alerts.read(run_dir.alerts)] == [1.0, 2.0, 1.5]
    assert forwarder.forward() == []  # nothing new: nothing twice
    with n2.open("a") as handle:
        handle.write(third[20:] + "{not json\n")
    assert len(forwarder.forward()) == 1
    assert [r["time"] for r in alerts.read(run_dir.alerts)] == [1.0, 2.0, 1.5, 3.0]
    assert log == [f"alerts: skipped a garbled line of {n2}"]


def test_a_new_node_0_sidecar_resumes_after_what_was_forwarded(tmp_path: Path) -> None:
    """A requeued job's node 0 starts a fresh sidecar: it finds its predecessor's forwarding in alerts.jsonl."""
    run_dir = RunDir(str(tmp_path))
    n2 = Path(run_dir.node_alerts("n2"))
    n2.parent.mkdir(parents=True)
    n2.write_text(alert_line("straggler", 1.0) + alert_line("gpu_memory_high", 2.0))
    Forwarder(run_dir, Lines()).forward()
    alerts.append(run_dir.alerts, [alerts.Alert("loss_spike", 9.0, 3.0, "rank 0's own", 5, 0, "n1", 2.5)])
    with n2.open("a") as handle:  # written after the old sidecar's last forward
        handle.write(alert_line("gpu_util_low", 3.0) + alert_line("straggler", 4.0)[:10])
    fresh = Alerting(run_dir, "n1", 0, Alerts(), Lines(), lambda: None)
    fresh.forward()
    assert [(r["rule"], r["time"]) for r in alerts.read(run_dir.alerts)] == [
        ("straggler", 1.0),
        ("gpu_memory_high", 2.0),
        ("loss_spike", 2.5),
        ("gpu_util_low", 3.0),
    ]


# --- stragglers and hangs ----------------------------------------------------------------------------------


def test_a_straggler_alert_once_per_streak_from_the_tracker(tmp_path: Path) -> None:
    run_dir = RunDir(str(tmp_path))
    log = Lines()
    alerting = Alerting(run_dir, "n1", 0, Alerts(), log, lambda: 12)
    tracker = StragglerTracker(1.5, log, on_named=alerting.on_straggler)
    slow = [RankTime(0, "n1", 0.1), RankTime(1, "n2", 0.4), RankTime(2, "n1", 0.1)]
    even = [RankTime(0, "n1", 0.1), RankTime(1, "n2", 0.1), RankTime(2, "n1", 0.1)]
    for t, times in enumerate([slow] * 6 + [even] + [slow] * 3):
        tracker.check(times, float(t))
    records = alerts.read(run_dir.alerts)
    assert [(r["rule"], r["rank"], r["node"], r["time"], r["step"]) for r in records] == [
        ("straggler", 1, "n2", 2.0, 12),
        ("straggler", 1, "n2", 9.0, 12),
    ]
    assert records[0]["value"] == 4.0 and records[0]["threshold"] == 1.5 and "n2's GPU" in records[0]["message"]
    assert sum("ALERT straggler step 12 rank 1: " in line for line in log) == 2


def _two_node_dogs(tmp_path: Path) -> tuple[RunDir, Clock, list[wd.Watchdog]]:
    """Node 0 (n1: ranks 0, 1, rank 1 stalls at step 3) and node 1 (n2: ranks 2, 3), each with its alerting."""
    run, clock = RunDir(str(tmp_path)), Clock()
    nd1, nd2 = run.node_dir("", "n1"), run.node_dir("", "n2")
    kill = Kill({0: (nd1, WAITING), 1: (nd1, STALLED), 2: (nd2, WAITING), 3: (nd2, WAITING)})
    dogs = []
    for node, node_rank, ranks in (("n1", 0, [0, 1]), ("n2", 1, [2, 3])):
        alerting = Alerting(run, node, node_rank, Alerts(), Lines(), lambda: None)
        dog = wd.Watchdog(
            run,
            run.node_dir("", node),
            node,
            node_rank,
            2,
            ranks,
            SETTINGS,
            "42.0",
            Lines(),
            clock=clock,
            kill=kill,
            on_straggler=alerting.on_straggler,
            on_verdict=alerting.on_verdict,
        )
        dogs.append(dog)
    return run, clock, dogs


def _beat_until_rank_1_stalls(run: RunDir, clock: Clock, dogs: list[wd.Watchdog]) -> None:
    nd1, nd2 = run.node_dir("", "n1"), run.node_dir("", "n2")
    for step in range(1, 5):  # rank 1 stops at step 3
        clock.t += 2
        for rank, node_dir in ((0, nd1), (1, nd1), (2, nd2), (3, nd2)):
            beat(node_dir, rank, step if rank != 1 else min(step, 3), clock.t, stack_signal=USR2)
        for dog in dogs:
            dog.tick()


def test_a_verdict_node_0_never_ticked_on_is_raised_when_its_sidecar_stops(tmp_path: Path) -> None:
    """Node 1 found the hang and ended the job; srun ended node 0's ranks and the batch script its sidecar before
    a tick of node 0 saw the verdict (a full run's hang test: no alert, no suspect in the ledger)."""
    run, clock, dogs = _two_node_dogs(tmp_path)
    _beat_until_rank_1_stalls(run, clock, dogs)
    for _ in range(400):  # only node 1 goes on ticking (it waits for node 0's part, then decides without it)
        clock.t += 1
        dogs[1].tick()
        if dogs[1].ended:
            break
    assert Path(run.verdict_json).exists() and not dogs[0].ended and not Path(run.alerts).exists()
    dogs[0].last_look()  # its sidecar stops
    dogs[0].last_look()
    (record,) = alerts.read(run.alerts)
    assert record["rule"] == "hang" and record["message"].startswith("Hang at step ")


def test_a_hang_found_by_two_watchdogs_is_one_alert_from_node_0_with_the_verdicts_first_sentence(
    tmp_path: Path,
) -> None:
    run, clock, dogs = _two_node_dogs(tmp_path)
    _beat_until_rank_1_stalls(run, clock, dogs)
    for _ in range(40):
        clock.t += 1
        for dog in dogs:
            dog.tick()
        if all(dog.ended for dog in dogs):
            break
    assert all(dog.ended for dog in dogs)
    for dog in dogs:  # ended: more ticks raise nothing more
        dog.tick()
    verdict = json.loads(Path(run.verdict_json).read_text())
    (record,) = alerts.read(run.alerts)
    assert record["message"] == verdict["verdict"].split(". ")[0] + "."
    assert record["message"].startswith("Hang at step ") and "without progress" in record["message"]
    assert (record["rule"], record["rank"], record["node"], record["step"]) == ("hang", 1, "n1", verdict["step"])
    assert record["value"] == verdict["silent_s"] and record["threshold"] == verdict["timeout_s"]
    assert not Path(run.node_alerts("n2")).exists()  # node 0 raises it, whichever node wrote the verdict


def test_the_log_and_the_file_agree_and_time_is_now(tmp_path: Path) -> None:
    log = Lines()
    alerting = Alerting(RunDir(str(tmp_path)), "n2", 1, Alerts(), log, lambda: 4)
    before = time.time()
    alerting.on_straggler(RankTime(3, "n2", 1.0), 3.0, 0.33, 1.5, time.time())
    (record,) = alerts.read(alerting.path)
    assert alerting.path == RunDir(str(tmp_path)).node_alerts("n2") and record["time"] >= before
    assert log == [f"[meshrun] ALERT straggler step 4 rank 3: {record['message']}"]
