"""The health gate before each start: each node's checks (launcher/probes/health.py), the
verdict on the batch host (launcher/batch/gate.py: suspects recorded, nodes excluded, the job requeued or ended) and
the requeue policy's part in it. The real thing on the Slurm testbed: tests/integration/test_health_gate.py."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import pytest

from meshrun.launcher.batch import gate
from meshrun.launcher.batch.requeue import decide
from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS, EXIT_UNHEALTHY
from meshrun.launcher.contract.records import suspects
from meshrun.launcher.contract.records.rundir import RunDir, attempt_id
from meshrun.launcher.contract.spec import modelshape
from meshrun.launcher.contract.spec.job import (
    JobSpec,
    Model,
    Resilience,
    Resources,
    RunInfo,
    RunSpec,
    Train,
    read_run_spec,
    write_run_spec,
)
from meshrun.launcher.contract.spec.modelshape import param_count
from meshrun.launcher.contract.spec.presets import PRESETS
from meshrun.launcher.probes import health
from tests.unit import fake_nvml
from tests.unit.fake_nvml import FakeGpu

GPU_A = FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0", throttle=0x1)  # idle: no finding
GPU_B = FakeGpu(uuid="GPU-bbbb2222-0000", bus="00000000:41:00.0", throttle=0x1)


def _run(tmp_path: Path, gpus: int = 0, **resilience: object) -> str:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = JobSpec(
        name="h",
        resources=Resources(nodes=2, gpus_per_node=gpus),
        train=Train(model=Model(d_model=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=64)),
        resilience=Resilience(**resilience),  # type: ignore[arg-type]
    )
    info = RunInfo(
        cluster="c", scheduler="slurm", run_dir=str(run_dir), suspects_file=str(tmp_path / "work/.meshrun/s.jsonl")
    )
    write_run_spec(RunSpec(job, info), run_dir)
    return str(run_dir)


def _answer(run_dir: str, node: str, *checks: tuple[str, str, str]) -> None:
    path = Path(RunDir(run_dir).health_result(node))
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps({"node": node, "checks": [dict(zip(("name", "verdict", "evidence"), c)) for c in checks]})
    )


class Slurm:
    """Recorded answers of scontrol and sinfo, and the commands the gate ran."""

    def __init__(
        self,
        excluded: str = "(null)",
        partition: Sequence[str] = ("n1", "n2", "n3"),
    ):
        self.excluded, self.partition = excluded, partition
        self.ran: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> Optional[str]:
        self.ran.append(list(argv))
        if argv[:3] == ["scontrol", "show", "job"]:
            return f"JobId={argv[-1]} JobName=h Partition=debug ExcNodeList={self.excluded} NodeList=n[1-2]\n"
        if argv[0] == "sinfo":
            return "".join(f"{n}\n" for n in self.partition)
        raise AssertionError(argv)


# ------------------------------------------------------------------ a node's checks


def test_gpus_pass_when_every_asked_gpu_is_there_and_fail_on_a_lasting_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make([GPU_A, GPU_B]))
    assert health.check_gpus(2, None, broken=False) == health.Check("gpus", "pass", "2 x NVIDIA H200")
    short = health.check_gpus(2, "1", broken=False)
    assert short.verdict == "fail" and short.evidence.startswith("1 of the 2 GPUs asked for are visible")
    ecc = FakeGpu(uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0", ecc=(0, 2), throttle=0x1)
    rows = FakeGpu(uuid="GPU-bbbb2222-0000", bus="00000000:41:00.0", rows=(0, 0, 1, 0), pages_pending=1, throttle=0x40)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make([ecc, rows]))
    bad = health.check_gpus(2, None, broken=False)
    assert bad.verdict == "fail"
    assert bad.evidence == (
        "GPU-aaaa1111-0000: 2 uncorrectable ECC errors since the driver loaded; "
        "GPU-bbbb2222-0000: retired pages pending (the GPU needs a reset); "
        "GPU-bbbb2222-0000: clocks held down by the "
        "hardware (throttle reasons 0x40: slowdown, thermal or power brake); "
        "GPU-bbbb2222-0000: remapped rows pending (the GPU needs a reset)"
    )
    # A counter the GPU does not support is no finding.
    quiet = FakeGpu(
        uuid="GPU-aaaa1111-0000", bus="00000000:01:00.0", ecc=(0, 5), unsupported={"ecc", "rows", "pages", "throttle"}
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make([quiet]))
    assert health.check_gpus(1, None, broken=False).verdict == "pass"


def test_gpus_skip_on_a_cpu_job_fail_without_nvml_and_fail_when_injected(monkeypatch: pytest.MonkeyPatch) -> None:
    assert health.check_gpus(0, None, broken=False).verdict == "skip"
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make([], init_error=fake_nvml.NVMLError_LibraryNotFound))
    none = health.check_gpus(8, None, broken=False)
    assert none.verdict == "fail" and none.evidence.startswith("8 GPUs asked for, but NVML cannot start")
    injected = health.check_gpus(0, None, broken=health.injected("n2", {health.FAIL_ENV: "n1, n2"}))
    assert injected.verdict == "fail" and "injected" in injected.evidence
    assert not health.injected("n2", {health.FAIL_ENV: "n22"})


def test_space_needs_two_checkpoints_of_the_model_or_the_given_figure(tmp_path: Path) -> None:
    spec = read_run_spec(Path(_run(tmp_path)))
    assert health.needed_bytes(spec) == modelshape.MIN_FREE_BYTES  # a tiny model: the floor
    assert spec.job.train is not None
    big = Model(**PRESETS["llama3-8b"])  # as the planner resolved it
    big_spec = replace(spec, job=replace(spec.job, train=replace(spec.job.train, model=big)))
    assert health.needed_bytes(big_spec) == 2 * 12 * param_count(big)  # ~190 GB for 8B parameters
    given = replace(spec, job=replace(spec.job, resilience=Resilience(min_free_gb=2.5)))
    assert health.needed_bytes(given) == 2_500_000_000
    ok = health.check_space([str(tmp_path / "not" / "yet")], 1)  # a folder not made yet: its parent is measured
    assert ok.verdict == "pass"
    low = health.check_space([str(tmp_path)], 1 << 62)
    assert (
        low.verdict == "fail" and low.evidence.startswith(f"{tmp_path}: ") and "resilience.min_free_gb" in low.evidence
    )


def test_storage_python_and_clock(tmp_path: Path) -> None:
    assert health.check_storage(str(tmp_path / "ckpt"), "n1").verdict == "pass"
    assert not any((tmp_path / "ckpt").iterdir())  # the probe file is gone
    (tmp_path / "file").write_text("x")
    bad = health.check_storage(str(tmp_path / "file" / "ckpt"), "n1")
    assert bad.verdict == "fail" and bad.evidence.startswith(f"{tmp_path}/file/ckpt: ")
    assert health.check_python(trainer=False, gpus=0).verdict == "skip"
    assert health.check_python(trainer=True, gpus=0).verdict == "pass"  # found, not imported (CPU job)
    assert health.check_clock(1000.0, 1003.0).verdict == "pass"
    skewed = health.check_clock(1000.0, 1000.0 - 600)
    assert skewed == health.Check("clock", "fail", "-600 s from the batch host's clock (at most 60 s)")


def test_a_node_answers_in_its_file_and_a_broken_spec_is_its_finding(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    env = {"SLURMD_NODENAME": "n1", health.FAIL_ENV: "n1"}
    assert health.run([run_dir, "1000"], env) == 0
    answer = json.loads(Path(RunDir(run_dir).health_result("n1")).read_text())
    verdicts = {c["name"]: c["verdict"] for c in answer["checks"]}
    assert answer["node"] == "n1" and verdicts == {
        "gpus": "fail",
        "space": "pass",
        "storage": "pass",
        "python": "pass",
        "clock": "fail",  # 1000 is 1970
    }
    Path(RunDir(run_dir).spec).write_text("{")
    assert health.run([run_dir, "1000"], {"SLURMD_NODENAME": "n2"}) == 0
    broken = json.loads(Path(RunDir(run_dir).health_result("n2")).read_text())
    assert broken["checks"][0]["name"] == "setup" and broken["checks"][0]["verdict"] == "fail"


# ------------------------------------------------------------------ the verdict


def test_failures_name_each_failing_check_and_a_silent_node() -> None:
    answers = {
        "n1": {"node": "n1", "checks": [{"name": "gpus", "verdict": "pass", "evidence": "8 x H100"}]},
        "n2": {
            "node": "n2",
            "checks": [
                {"name": "gpus", "verdict": "fail", "evidence": "GPU-1: 2 uncorrectable ECC errors"},
                {"name": "clock", "verdict": "fail", "evidence": "-600 s"},
            ],
        },
    }
    found = gate.failures(["n1", "n2", "n3"], answers, 120)
    assert found == {
        "n2": "gpus: GPU-1: 2 uncorrectable ECC errors; clock: -600 s",
        "n3": "no answer within 120 s (the node is down, or cannot run Python)",
    }


def test_exclusion_merges_with_what_is_excluded_and_never_leaves_too_few_nodes() -> None:
    assert gate.exclusion({}, [], ["n1", "n2"], 2).action == "start"
    v = gate.exclusion({"n2": "gpus: x"}, ["n9"], ["n1", "n2", "n3", "n9"], 2)
    assert (v.action, v.excluded) == ("requeue", ("n2", "n9"))
    assert v.why == "health check failed on n2 (gpus: x): requeueing with n[2,9] excluded"
    stop = gate.exclusion({"n2": "gpus: x"}, [], ["n1", "n2"], 2)
    assert stop.action == "stop" and stop.excluded == ()
    assert "would leave the partition 1 of the 2 nodes the job needs: not requeueing" in stop.why
    assert "`meshrun nodes -c CLUSTER --clear n2` once repaired, then `meshrun resume JOB`" in stop.why
    unknown = gate.exclusion({"n2": "gpus: x"}, [], [], 2)  # sinfo did not answer: Slurm keeps the job pending
    assert unknown.action == "requeue"


def test_judge_records_suspects_and_excludes_them_from_the_requeued_job(tmp_path: Path) -> None:
    run_dir = _run(tmp_path)
    _answer(run_dir, "n1", ("gpus", "pass", "8 x H100"))
    _answer(run_dir, "n2", ("space", "fail", "/ckpt: 0.1 GB free, 1.0 GB needed"))
    slurm = Slurm(excluded="n9")
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "41"}
    verdict = gate.judge(run_dir, env, slurm, now=5000.0)
    assert verdict.action == "requeue" and verdict.excluded == ("n2", "n9")
    assert not [argv for argv in slurm.ran if argv[:2] == ["scontrol", "update"]]  # the batch script does, later
    ledger = suspects.parse(Path(tmp_path / "work/.meshrun/s.jsonl").read_text().splitlines())
    assert ledger == [
        {
            "node": "n2",
            "evidence": "health check: space: /ckpt: 0.1 GB free, 1.0 GB needed",
            "job": "41",
            "time": 5000.0,
        }
    ]
    _answer(run_dir, "n2", ("space", "pass", "plenty"))
    passed = gate.judge(run_dir, env, Slurm())
    assert (passed.action, passed.why) == ("start", "health check passed on 2 nodes (the slowest took 0.0 s)")


def test_main_prints_the_action_and_keeps_the_verdict_for_the_requeue_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run(tmp_path)
    _answer(run_dir, "n1", ("gpus", "fail", "GPU-1: row remapping failed"))
    monkeypatch.setattr(gate, "run_slurm", Slurm(partition=("n1",)))
    monkeypatch.setattr(gate.judge, "__defaults__", (gate.run_slurm, None))
    assert gate.main([run_dir], {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "41"}) == 0
    out, err = capsys.readouterr()
    assert out == "stop \n" and err == ""  # the requeue policy's reason says it, once (below)
    assert gate.verdict_of(run_dir)["action"] == "stop"
    # One alert, the sentence the batch log has, for status and `watch --notify`.
    (alert,) = [json.loads(line) for line in Path(RunDir(run_dir).alerts).read_text().splitlines()]
    assert (alert["rule"], alert["node"], alert["job"]) == ("node_unhealthy", "n1", "41"), alert
    assert alert["message"].startswith("health check failed on n1 (gpus: GPU-1: row remapping failed)"), alert
    # The requeue policy ends the job with the gate's reason; a requeue verdict is requeued like a failure.
    d = decide(run_dir, EXIT_UNHEALTHY, restarts=0, max_requeues=3)
    assert not d.requeue and d.code == EXIT_UNHEALTHY and "health check failed on n1" in d.why
    assert "health check failed on n1" in Path(RunDir(run_dir).rank_error).read_text()
    Path(RunDir(run_dir).health_verdict).write_text(json.dumps({"action": "requeue"}))
    again = decide(run_dir, EXIT_UNHEALTHY, restarts=0, max_requeues=3)
    assert again.requeue and again.why == "requeueing: restart 1 of at most 3"


def test_a_requeue_after_a_hang_leaves_out_the_blamed_nodes_when_the_partition_can_spare_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.launcher.batch.requeue import requeue_leaves_out

    run_dir = _run(tmp_path)
    env = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_RESTART_COUNT": "0"}
    verdict = {
        "attempt": attempt_id(env),
        "verdict": "Rank 1 on n2 is stuck in inject_hang. Others wait.",
        "ranks": [{"rank": 0, "node": "n1", "state": "collective"}, {"rank": 1, "node": "n2", "state": "stalled"}],
    }
    Path(RunDir(run_dir).verdict_json).parent.mkdir(parents=True, exist_ok=True)
    Path(RunDir(run_dir).verdict_json).write_text(json.dumps(verdict))
    requeue_leaves_out(run_dir, EXIT_NO_PROGRESS, 0, env, Slurm(partition=("n1", "n2", "n3")))
    out, err = capsys.readouterr()
    assert out == "exclude n2\n"
    assert "[meshrun] the requeued job leaves out n2 (hang verdict: Rank 1 on n2 is stuck in inject_hang" in err, err
    requeue_leaves_out(
        run_dir, EXIT_NO_PROGRESS, 0, env, Slurm(partition=("n1", "n2"))
    )  # the job needs both: n2 stays in
    out, err = capsys.readouterr()
    assert (
        out == "" and "node(s) n2 stay in the requeued job: the partition cannot spare them beside the job's 2" in err
    )
    # An older attempt's verdict blames nobody now.
    requeue_leaves_out(
        run_dir, EXIT_NO_PROGRESS, 1, {**env, "SLURM_RESTART_COUNT": "1"}, Slurm(partition=("n1", "n2", "n3"))
    )
    assert capsys.readouterr() == ("", "")


def test_a_requeue_leaves_out_the_ledgers_suspects_too_and_this_ends_own_first(tmp_path: Path) -> None:
    from meshrun.launcher.batch.requeue import requeue_leaves_out

    run_dir = _run(tmp_path)
    ledger = tmp_path / "work/.meshrun/s.jsonl"
    ledger.parent.mkdir(parents=True)
    ledger.write_text(
        suspects.finding_line("n3", "straggler: rank 1 took 2.00x the median step time", "40", 900.0) + "\n"
    )
    Path(RunDir(run_dir).batch_log("41")).parent.mkdir(parents=True, exist_ok=True)
    Path(RunDir(run_dir).batch_log("41")).write_text(
        "[meshrun] job 41 restart 0 on n[1-2] at x\nsrun: error: n2: task 1: Killed\n"
    )
    env = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        requeue_leaves_out(run_dir, 137, 0, env, Slurm(partition=("n1", "n2", "n3", "n4", "n5")), now=1000.0)
    assert out.getvalue() == "exclude n2,n3\n"  # the killed rank's node and the ledger's straggler
    rows = suspects.parse(ledger.read_text().splitlines())
    assert [(r["node"], r["evidence"].split(" (")[0]) for r in rows][-1] == ("n2", "rank 1 was killed by SIGKILL")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # room for one only: this end's own node
        requeue_leaves_out(run_dir, 137, 0, env, Slurm(partition=("n1", "n2", "n3")), now=1000.0)
    assert out.getvalue() == "exclude n2\n"


def test_a_saved_stop_blames_no_node_for_slurms_own_kills(tmp_path: Path) -> None:
    from meshrun.launcher.batch.requeue import main

    run_dir = _run(tmp_path)
    Path(RunDir(run_dir).batch_log("41")).parent.mkdir(parents=True, exist_ok=True)
    Path(RunDir(run_dir).batch_log("41")).write_text(
        "[meshrun] job 41 restart 0 on n[1-2] at x\nsrun: error: n2: task 1: Killed\n"
    )
    env = {"SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_RESTART_COUNT": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([run_dir, "75", "0", "20"]) == 0  # saved after a preemption's signal
    assert out.getvalue().startswith("requeue 75 ") and "exclude" not in out.getvalue()
    assert not (tmp_path / "work/.meshrun/s.jsonl").exists()  # nobody recorded
