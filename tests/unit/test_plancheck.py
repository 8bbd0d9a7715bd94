"""Rank 0's check of the run against the plan (launcher/train/plancheck.py), fed records as the loop logs them."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from meshrun.launcher.contract.spec.job import Prediction
from meshrun.launcher.train.plancheck import WARMUP_STEPS, PlanCheck

PLAN = Prediction(
    step_s=0.2, tokens_per_s=1000.0, compute_s=0.15, communication_s=0.05, memory_bytes=None, figures="datasheet"
)


def record(step: int, step_time: float, busy: float, wait: float = 0.0) -> dict[str, Any]:
    return {"step": step, "step_time_s": step_time, "busy_s": busy, "data_wait_s": wait}


def feed(
    check: PlanCheck, step_time: float, busy: float, wait: float = 0.0, every: int = 5, peak: Optional[int] = None
) -> list[Any]:
    alerts: list[Any] = []
    step = check.first - 1
    while check.result is None:
        step += every
        alerts += check.observe(record(step, step_time, busy, wait), peak)
    return alerts


def test_the_warm_up_is_not_measured_and_the_check_comes_after_its_steps() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False)
    # a slow warm-up (steps 1-5) must not count: the steps after it run exactly at the plan
    assert check.observe(record(5, 9.0, 9.0), None) == []
    assert check.observe(record(10, 0.2, 0.15), None) == [] and check.result is None
    assert check.observe(record(15, 0.2, 0.15), None) == []
    assert check.result is not None and check.result["steps"] == 10 and check.result["step"] == 15
    assert check.result["step_time_ratio"] == pytest.approx(1.0)
    assert check.annotations() == {"plan_step_ratio": pytest.approx(1.0), "plan_term": check.result["term"]}


def test_a_record_that_straddles_the_warm_up_is_skipped() -> None:
    """log_every 4 from step 1: the record of step 8 covers steps 5-8, one of them warm-up."""
    check = PlanCheck(PLAN, drift=0.3, steps=8, first=1, gpu=False)
    for step in (4, 8):
        check.observe(record(step, 5.0, 5.0), None)
    assert check.measured == []
    check.observe(record(12, 0.2, 0.15), None)
    assert [n for n, _ in check.measured] == [4]


def test_a_resumed_attempt_warms_up_from_its_own_first_step() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=5, first=101, gpu=False)
    assert check.observe(record(100 + WARMUP_STEPS, 9.0, 9.0), None) == [] and check.measured == []
    check.observe(record(110, 0.2, 0.15), None)
    assert check.result is not None and check.result["steps"] == 5


def test_a_rank_that_computes_slowly_names_compute() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False, cluster="local")
    (alert,) = feed(check, step_time=0.6, busy=0.55)
    assert alert.rule == "plan_drift" and alert.value == pytest.approx(3.0) and alert.threshold == pytest.approx(1.3)
    assert check.result is not None and check.result["term"] == "compute"
    assert "compute is off: 0.55 s a step against 0.15 s predicted" in alert.message
    assert "`meshrun doctor -c local`" in alert.message and "datasheet" in alert.message


def test_waiting_besides_its_own_work_names_communication() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False)
    (alert,) = feed(check, step_time=0.6, busy=0.15)
    assert check.result is not None and check.result["term"] == "communication"
    assert "straggler" in alert.message


def test_on_cpu_ranks_compute_drift_names_how_busy_the_nodes_cpus_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second job on the same cores makes every step wait for a CPU, which the rank's runnable time counts as its
    own work (launcher/train/worktime.py): the alert says how many processes the node runs on how many CPUs, before
    doctor's figures."""
    monkeypatch.setattr("os.getloadavg", lambda: (4.2, 3.0, 2.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    (alert,) = feed(PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False), step_time=0.6, busy=0.55)
    assert "other work on the node's CPUs: 4.2 processes runnable on its 2 over the last minute; or the plan's" in (
        alert.message
    )
    gpu = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=True)
    assert all("runnable" not in a.message for a in feed(gpu, step_time=0.6, busy=0.55))


def test_a_rank_waiting_for_a_cpu_counts_it_as_its_own_work() -> None:
    """The busy clock of a CPU rank counts the time its thread was runnable: a spin of 0.3 s counts whole however
    loaded the machine (its CPU time alone would be less under load), and sleep (a gloo wait) not at all."""
    import time

    from meshrun.launcher.train.worktime import SCHEDSTAT, BusyClock

    if not SCHEDSTAT.exists():
        pytest.skip("no /proc/thread-self/schedstat: the clock is the process CPU time here")
    clock = BusyClock(cuda=False)
    clock.start()
    time.sleep(0.2)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    busy = clock.stop()
    assert busy is not None and 0.27 < busy < 0.45, busy


def test_a_starved_input_names_data_wait() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False)
    (alert,) = feed(check, step_time=0.6, busy=0.15, wait=0.4)
    assert check.result is not None and check.result["term"] == "data wait"
    assert check.result["terms"]["data wait"] == {"measured_s": pytest.approx(0.4), "predicted_s": 0.0}


def test_a_run_faster_than_the_plan_names_the_term_furthest_below_it() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False)
    (alert,) = feed(check, step_time=0.08, busy=0.03)
    assert alert.value == pytest.approx(0.4) and alert.threshold == pytest.approx(0.7)
    assert check.result is not None and check.result["term"] == "compute"


def test_within_the_bound_or_with_the_rule_off_there_is_no_alert_but_the_ratio_is_kept() -> None:
    within = PlanCheck(PLAN, drift=0.3, steps=10, first=1, gpu=False)
    assert feed(within, step_time=0.25, busy=0.19) == []
    assert within.result is not None and within.result["step_time_ratio"] == pytest.approx(1.25)
    off = PlanCheck(PLAN, drift=0.0, steps=10, first=1, gpu=False)
    assert feed(off, step_time=2.0, busy=2.0) == []
    assert off.annotations()["plan_step_ratio"] == pytest.approx(10.0)


def test_it_judges_once() -> None:
    check = PlanCheck(PLAN, drift=0.3, steps=5, first=1, gpu=False)
    assert len(feed(check, step_time=1.0, busy=1.0)) == 1
    assert check.observe(record(100, 5.0, 5.0), None) == []


def test_on_gpus_compute_and_communication_are_one_term_and_memory_is_checked() -> None:
    plan = Prediction(step_s=0.2, tokens_per_s=1.0, compute_s=0.15, communication_s=0.05, memory_bytes=10 * 2**30)
    check = PlanCheck(plan, drift=0.3, steps=10, first=1, gpu=True)
    alerts = feed(check, step_time=0.5, busy=0.45, peak=20 * 2**30)
    assert check.result is not None and check.result["term"] == "compute and communication"
    assert check.result["memory_ratio"] == pytest.approx(2.0)
    assert [a.message.split(" is ")[0] for a in alerts] == ["step time 0.5 s", "peak memory 20.00 GiB"]


def test_a_job_carries_its_plans_prediction_where_the_planner_can_time_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshrun.launcher.contract.spec.job import loads_run_spec
    from meshrun.submit import api
    from meshrun.submit.config.cluster import SHIPPED_DIR, load_profile
    from meshrun.submit.planning.plan import plan_file
    from meshrun.submit.schedulers import backend
    from tests.unit.test_render import REPO

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no calibration: datasheet figures
    gpus = load_profile(str(SHIPPED_DIR / "h100-ndr.yaml"))

    def carried(example: str, profile: Any) -> Optional[Prediction]:
        plan = plan_file(REPO / "examples" / example, profile, home="/home/u", run_dir="/shared/runs/x")
        return api.with_prediction(plan).run_spec.run.prediction

    found = carried("h100-8node.yaml", gpus)
    assert found is not None and found.figures == "datasheet figures" and found.memory_bytes
    # what the ranks read: the spec.json the batch script writes
    plan = plan_file(REPO / "examples" / "h100-8node.yaml", gpus, home="/home/u", run_dir="/shared/runs/x")
    script = backend(gpus.scheduler).dryrun(api.with_prediction(plan)).script
    text = script.split("<<'MESHRUN_SPEC_EOF'\n", 1)[1].split("\nMESHRUN_SPEC_EOF", 1)[0]
    assert loads_run_spec(text, "spec.json").run.prediction == found
    assert found.step_s == pytest.approx(found.compute_s + found.communication_s)
    assert carried("command.yaml", gpus) is None  # a command job: nothing to time
    local = load_profile(str(SHIPPED_DIR / "local.yaml"))
    assert carried("tiny.yaml", local) is None  # a CPU job before `meshrun doctor` calibrated the partition
