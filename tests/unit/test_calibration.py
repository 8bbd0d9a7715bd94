"""submit/planning/calibration.py and the plan it times: what `meshrun doctor` measured is kept per cluster and
partition, private and dated, and `meshrun plan` uses it (a CPU job gets a step time only from it)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import stat
from pathlib import Path
from typing import Any, Optional

import pytest

from meshrun.launcher.contract.spec.modelshape import layer_elements
from meshrun.submit.cli.plan import build, render
from meshrun.submit.config.cluster import SHIPPED_DIR, load_profile
from meshrun.submit.planning import calibration, steptime
from meshrun.submit.planning.plan import REMOTE_HOME, plan_file
from tests.helpers import builders

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 12, 4, 1, 2, 3, tzinfo=dt.timezone.utc)


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


def _rank(rank: int, gemm: Optional[float], device: str = "cpu", **extra: Any) -> dict[str, Any]:
    res: dict[str, Any] = {
        "rank": rank,
        "node": f"n{1 + rank // 2}",
        "compute": {"tflops": gemm, "device": device} if gemm is not None else {"skipped": "x"},
        "comm": {
            "intra_node_busbw_gbps": 0.5 + rank,
            "inter_node_busbw_gbps": 0.3 - rank / 100,
            "intra_node_latency_us": 1000.0 * (rank + 1),
        },
    }
    if rank % 2 == 0:
        res["storage"] = {"checkpoint": {"path": "/c", "mbps": 100.0 * (rank + 1)}}
    return {**res, **extra}


CPU_RUN = [_rank(r, g) for r, g in enumerate((0.010, 0.012, 0.011, 0.030))]


def test_a_doctor_run_becomes_the_median_rank_and_the_slowest_cross_node_link() -> None:
    found = calibration.from_results(CPU_RUN, "41", nodes=2, now=NOW)
    assert found == calibration.Calibration(
        measured_at="2026-12-04T01:02:03Z",
        job="41",
        kind="cpu",
        device="cpu",
        nodes=2,
        ranks=4,
        gemm_tflops=0.0115,
        intra_node_busbw_gbps=2.0,
        inter_node_busbw_gbps=0.27,
        storage_write_mbps=200.0,
        allreduce_latency_us=2500.0,
    )
    assert calibration.from_results([_rank(0, None), None], "42", nodes=1) is None  # nothing measured a GEMM
    one_node = calibration.from_results([_rank(0, 500.0, "NVIDIA H100")], "43", nodes=1, now=NOW)
    assert one_node is not None and one_node.kind == "gpu" and one_node.inter_node_busbw_gbps is None


def test_each_partition_keeps_its_newest_gpu_and_cpu_figures_apart_in_a_private_file(state: Path) -> None:
    cpu = calibration.from_results(CPU_RUN, "41", nodes=2, now=NOW)
    gpu = calibration.from_results([_rank(0, 700.0, "NVIDIA H100")], "44", nodes=1, now=NOW)
    assert cpu is not None and gpu is not None
    old = os.umask(0)  # whatever the umask: the file names the cluster's figures and jobs
    try:
        path = calibration.save("c1", "gpu", cpu)
        calibration.save("c1", "gpu", gpu)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert calibration.load("c1", "gpu", "cpu") == cpu and calibration.load("c1", "gpu", "gpu") == gpu
    newer = calibration.Calibration(**{**gpu.__dict__, "job": "45", "gemm_tflops": 650.0})
    calibration.save("c1", "gpu", newer)
    assert calibration.load("c1", "gpu", "gpu") == newer and calibration.load("c1", "gpu", "cpu") == cpu
    assert calibration.load("c2", "gpu", "gpu") is None
    path.write_text("{not json")
    assert calibration.load_all("c1") == {}  # a damaged file is no calibration, never a crash


def _plan(cluster: str, spec: str = "tiny.yaml", *overrides: str) -> dict[str, Any]:
    profile = load_profile(str(SHIPPED_DIR / f"{cluster}.yaml"))
    plan = builders.plan(spec, profile, *overrides, home=REMOTE_HOME, run_dir=None)
    return build(plan.spec, profile, plan.partition)


def test_a_cpu_job_gets_a_step_time_only_from_a_doctor_run_of_its_cluster() -> None:
    before = _plan("local")
    assert before["step_time_s"] is None and before["figures"] is None
    measured = calibration.from_results(CPU_RUN, "41", nodes=1, now=NOW)
    assert measured is not None
    calibration.save("local", "local", measured)
    after = _plan("local")
    profile = load_profile(str(SHIPPED_DIR / "local.yaml"))
    spec = plan_file(REPO / "examples" / "tiny.yaml", profile, [], home=REMOTE_HOME).spec
    rate = 0.0115 * steptime.GEMM_EFFICIENCY * 1e12  # one rank's fp32 matmuls, the job being fp32
    assert after["time"]["compute_s"] == pytest.approx(after["flops_per_step"] / (2 * rate))
    # tiny.yaml: fsdp over dp 2, 2 micro-batches: 3 collectives per block and the root, each 2.5 ms at least
    assert after["time"]["dp_comm_s"] >= 3 * (spec.train.model.n_layers + 1) * 2 * 2.5e-3
    terms = after["time"]
    assert after["step_time_s"] == pytest.approx(terms["compute_s"] + terms["dp_comm_s"] + terms["optimizer_s"])
    assert after["figures"].startswith("calibrated on 2026-12-04 (doctor job 41, cpu)")  # gloo: in series
    text = render(after, spec)
    assert "; calibrated on 2026-12-04 (doctor job 41, cpu)" in text and "not estimated" not in text
    assert "doctor -c local --gpus-per-node 0" in render(before, spec)


def test_a_gpu_partition_doctor_measured_is_timed_with_its_figures() -> None:
    datasheet = _plan("h100-ndr", "h100-8node.yaml")
    assert datasheet["figures"] == "datasheet figures"
    run = [_rank(r, 600.0, "NVIDIA H100 80GB HBM3") for r in range(4)]
    measured = calibration.from_results(run, "46", nodes=2, now=NOW)
    assert measured is not None
    calibration.save("h100-ndr", "gpu", measured)
    calibrated = _plan("h100-ndr", "h100-8node.yaml")
    assert calibrated["figures"] == "calibrated on 2026-12-04 (doctor job 46, NVIDIA H100 80GB HBM3)"
    # 600 x 0.7 = 420 TFLOP/s for the matmuls against the datasheet's 989 x 0.5 = 494.5
    ratio = calibrated["time"]["compute_s"] / datasheet["time"]["compute_s"]
    assert ratio == pytest.approx(494.5 / 420, rel=1e-3)
    assert calibrated["mfu"] < datasheet["mfu"]  # MFU stays against the datasheet peak


def test_the_any_cluster_table_shows_the_step_time_and_when_the_job_would_finish() -> None:
    from meshrun.submit.api import Candidate
    from meshrun.submit.cli.main import _step_and_finish

    assert _step_and_finish(Candidate("a", "p", "now", "starts jobs at once", "a", 2.0, 100)) == ("2s", "+3m20s")
    later = Candidate("b", "gpu", "2026-12-04T10:00:00", "Slurm's estimate", "b", 0.5, 7200)
    assert _step_and_finish(later) == ("0.5s", "2026-12-04T11:00:00")
    quick = Candidate("q", "cpu", "now", "starts jobs at once", "q", 0.0436, 60)
    assert _step_and_finish(quick) == ("0.0436s", "+2.6s")  # not "0.0s": a step is often well under a second
    assert _step_and_finish(Candidate("s", "gpu", "now", "x", "s", 75.0, 100))[0] == "1m15s"
    assert _step_and_finish(Candidate("c", "gpu", "now", "x", "c")) == ("?", "?")  # step time unknown: said


def test_a_cpu_candidate_is_timed_with_its_clusters_calibration() -> None:
    from meshrun.submit.api import Candidate, _timed

    profile = load_profile(str(SHIPPED_DIR / "local.yaml"))
    plan = plan_file(REPO / "examples" / "tiny.yaml", profile, [], home=REMOTE_HOME)
    asked = Candidate("local", "local", "now", "starts jobs at once", "local")
    assert _timed(asked, plan).step_s is None  # no doctor run yet
    measured = calibration.from_results(CPU_RUN, "41", nodes=1, now=NOW)
    assert measured is not None
    calibration.save("local", "local", measured)
    timed = _timed(asked, plan)
    assert timed.step_s == pytest.approx(build(plan.spec, profile, plan.partition)["step_time_s"])
    assert timed.steps == plan.spec.trainer.steps and timed.run_s == pytest.approx(timed.step_s * timed.steps)


def test_of_clusters_that_start_together_the_one_that_finishes_first_is_chosen() -> None:
    from meshrun.submit.api import Candidate, soonest

    unknown = Candidate("a", "p", "now", "x", "a")
    slow = Candidate("b", "p", "now", "x", "b", step_s=2.0, steps=10)
    fast = Candidate("c", "p", "now", "x", "c", step_s=1.0, steps=10)
    later = Candidate("d", "p", "2026-12-04T10:00:00", "x", "d", step_s=0.1, steps=10)
    assert soonest([unknown, slow, fast, later]) is fast
    assert soonest([unknown, later]) is unknown  # starting first still wins
    assert soonest([unknown, Candidate("e", "p", "now", "x", "e")]) is unknown  # then the order asked


def _priced(tmp_path: Path, cost: Optional[dict[str, Any]]) -> Path:
    import yaml

    data = yaml.safe_load((SHIPPED_DIR / "h100-ndr.yaml").read_text())
    if cost is not None:
        data["cost"] = cost
    path = tmp_path / "priced.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_prices_the_whole_run_when_the_profile_gives_a_gpu_hour(tmp_path: Path) -> None:
    profile = load_profile(str(_priced(tmp_path, {"gpu_hour": 2.5, "currency": "EUR"})))
    plan = plan_file(REPO / "examples" / "h100-8node.yaml", profile, [], home=REMOTE_HOME)
    out = build(plan.spec, profile, plan.partition)
    res, steps = plan.spec.resources, plan.spec.trainer.steps
    assert out["run_s"] == pytest.approx(steps * out["step_time_s"])
    assert out["gpu_hours"] == pytest.approx(res.nodes * res.gpus_per_node * out["run_s"] / 3600)
    assert out["cost"] == {"amount": pytest.approx(out["gpu_hours"] * 2.5), "currency": "EUR"}
    line = next(x for x in render(out, plan.spec).splitlines() if x.startswith("run: "))
    assert f"run: {steps} steps in " in line and f" on {res.nodes * res.gpus_per_node} GPUs: " in line
    assert line.endswith(" EUR at the profile's cost.gpu_hour")
    unpriced = load_profile(str(_priced(tmp_path, None)))
    bare = build(plan.spec, unpriced, plan.partition)
    assert bare["cost"] is None and bare["gpu_hours"] == pytest.approx(out["gpu_hours"])
    assert "add cost.gpu_hour to the priced profile to price it" in render(bare, plan.spec)


def test_a_cpu_job_holds_no_gpu_hours_and_an_untimed_plan_no_run_estimate() -> None:
    untimed = _plan("local")
    assert untimed["run_s"] is None and untimed["gpu_hours"] is None and untimed["cost"] is None
    measured = calibration.from_results(CPU_RUN, "41", nodes=1, now=NOW)
    assert measured is not None
    calibration.save("local", "local", measured)
    timed = _plan("local")
    assert timed["gpu_hours"] == 0 and timed["cost"] is None and timed["run_s"] > 0


@pytest.mark.parametrize(
    ("cost", "message"),
    [
        ({"gpu_hour": -1}, r"priced.yaml:2: cost.gpu_hour: -1.0: a price per GPU-hour: a number, 0 or more"),
        ({"gpu_hour": float("nan")}, r"priced.yaml:2: cost.gpu_hour: nan: expected a finite number"),
        ({"gpu_hour": 1, "currency": "$ USD"}, r"cost.currency: '\$ USD': a unit of 1-12 letters"),
    ],
)
def test_a_bad_price_is_refused_naming_the_key(tmp_path: Path, cost: dict[str, Any], message: str) -> None:
    from meshrun.submit.errors import InputError

    with pytest.raises(InputError, match=message):
        load_profile(str(_priced(tmp_path, cost)))


def _block_s(shape: tuple[int, int, int, int], gemm_tflops: float, overhead_s: float, element_s: float) -> float:
    """What the planner's CPU block model says one block of `shape` costs a micro-batch."""
    from meshrun.launcher.contract.spec.job import Model
    from meshrun.launcher.contract.spec.modelshape import layer_elements, layer_flops_per_token

    d_model, n_heads, seq_len, micro = shape
    cfg = Model(n_layers=1, d_model=d_model, n_heads=n_heads, vocab_size=256, seq_len=seq_len)
    matmuls = layer_flops_per_token(cfg) * seq_len * micro / (gemm_tflops * 1e12)
    return matmuls + overhead_s + element_s * layer_elements(cfg, micro)


def test_the_cpu_block_terms_are_what_the_two_timed_shapes_solve_to() -> None:
    """doctor times a block at two shapes; less their matmuls at the measured GEMM rate, the two times give the
    framework's overhead and the element-wise cost, which time any other shape as the model says."""
    shapes = [(64, 4, 16, 1), (128, 4, 128, 4)]
    layers = [
        {"d_model": d, "n_heads": h, "seq_len": s, "micro_batch": b, "seconds": _block_s((d, h, s, b), 0.2, 4e-4, 9e-9)}
        for d, h, s, b in shapes
    ]
    runs = [_rank(r, 0.2, compute={"tflops": 0.2, "device": "cpu", "layers": layers}) for r in range(2)]
    found = calibration.from_results(runs, "7", nodes=1, now=NOW)
    assert found is not None
    assert found.layer_overhead_us == pytest.approx(400, rel=1e-3)
    assert found.layer_element_ns == pytest.approx(9, rel=1e-3)
    hw = steptime.Hardware(0.2, 10, 2, 1, 1, compute_tflops=0.2, cpu=True, layer_overhead_s=4e-4, layer_element_s=9e-9)
    for layout in ({"parallel.dp": 2, "parallel.dp_mode": "ddp"}, {"parallel.dp": 1, "parallel.tp": 2}):
        spec = _tiny(layout)
        cfg, micro = spec.trainer.model, spec.trainer.global_batch // (spec.trainer.micro_batch * spec.parallel.dp)
        elements = layer_elements(cfg, spec.trainer.micro_batch, spec.parallel.tp)
        time = steptime.step_time(spec, hw)
        assert time.layers_s == pytest.approx(cfg.n_layers * micro * (4e-4 + 9e-9 * elements)), layout
        assert time.step_s > time.compute_s + time.layers_s
        gpu = steptime.step_time(spec, dataclasses.replace(hw, cpu=False, layer_overhead_s=0, layer_element_s=0))
        assert gpu.layers_s == 0  # GPUs without doctor's blocks: the rest of a block is inside COMPUTE_EFFICIENCY
        # gloo's collectives inside a step: their bytes at GLOO_COSTS' factor of doctor's bandwidth, and each call
        # a number of block overheads instead of doctor's (swinging) tiny all-reduce; NCCL's as measured
        which, comm = ("tp", "tp_comm_s") if spec.parallel.tp > 1 else ("dp", "dp_comm_s")
        cost = steptime.GLOO_COSTS[which]
        no_calls = steptime.step_time(spec, dataclasses.replace(hw, layer_overhead_s=1e-12))
        calls = (getattr(time, comm) - getattr(no_calls, comm)) / (cost.blocks_per_call * 4e-4)
        assert calls == pytest.approx(round(calls)) and round(calls) >= 1, layout
        bytes_only = steptime.step_time(spec, dataclasses.replace(hw, cpu=False, latency_s=0.0))
        assert getattr(no_calls, comm) == pytest.approx(cost.bytes_factor * getattr(bytes_only, comm), rel=1e-6)


def test_a_gpus_block_terms_are_its_launch_cost_and_its_share_of_the_gemm() -> None:
    """On GPUs doctor times a block at a launch-bound and a compute-bound shape (bf16): the two give the block's
    fixed cost and the share of the GEMM's rate its FLOPs reach, and the calibrated plan times blocks with them
    (an H200's ~1B GPT ran at 0.186 s a step where 0.7 of the GEMM planned 0.108 s)."""
    from meshrun.launcher.probes.doctor import GPU_LAYER_SHAPES

    gemm, share, launch = 780.0, 0.55, 3e-4
    layers = [
        {"d_model": d, "n_heads": h, "seq_len": s, "micro_batch": b, "seconds": launch + flops / (gemm * 1e12 * share)}
        for d, h, s, b in GPU_LAYER_SHAPES
        for flops in [calibration._block_flops((d, h, s, b))]
    ]
    run = [
        _rank(r, gemm, "NVIDIA H200", compute={"tflops": gemm, "device": "NVIDIA H200", "layers": layers})
        for r in range(2)
    ]
    found = calibration.from_results(run, "9", nodes=1, now=NOW)
    assert found is not None and found.kind == "gpu" and found.layer_element_ns is None
    assert found.block_efficiency == pytest.approx(share, rel=1e-3)
    assert found.layer_overhead_us == pytest.approx(launch * 1e6, rel=1e-2)
    calibration.save("h100-ndr", "gpu", found)
    calibrated = _plan("h100-ndr", "h100-8node.yaml")
    calibration.calibration_file("h100-ndr").unlink()
    datasheet = _plan("h100-ndr", "h100-8node.yaml")
    spec = plan_file(REPO / "examples" / "h100-8node.yaml", load_profile("h100-ndr"), [], home=REMOTE_HOME).spec
    par, t = spec.parallel, spec.trainer
    micro = t.global_batch // (t.micro_batch * par.dp)
    blocks = -(-t.model.n_layers // par.pp) * micro * launch * (4 / 3 if t.activation_checkpointing else 1)
    assert calibrated["time"]["layers_s"] == pytest.approx(blocks, rel=1e-2) and datasheet["time"]["layers_s"] == 0
    # the matmuls at the measured share of the GEMM: 780 x 0.55 against the datasheet's 989 x 0.5
    ratio = calibrated["time"]["compute_s"] / datasheet["time"]["compute_s"]
    assert ratio == pytest.approx(989 * 0.5 / (gemm * share), rel=1e-3)


def test_a_node_with_more_ranks_than_cpus_is_bound_by_them() -> None:
    """README's main job runs 8 ranks on 2 cores: each rank's own work (compute, blocks, optimizer, the Python around
    its collectives) x 8 ranks / 2 CPUs is what a step takes at least (it measured 2.8 times the plan without it)."""
    hw = steptime.Hardware(0.2, 10, 8, 1, 1, compute_tflops=0.2, cpu=True, layer_overhead_s=6e-4, layer_element_s=1e-8)
    spec = plan_file(REPO / "examples" / "gpt-3d.yaml", load_profile("local"), [], home=REMOTE_HOME).spec
    free = steptime.step_time(spec, hw)
    assert free.cpu_bound_s == 0 and free.calls_s > 0  # no CPU count: no bound
    crowded = steptime.step_time(spec, dataclasses.replace(hw, node_cpus=2))
    own = crowded.compute_s + crowded.layers_s + crowded.optimizer_s + crowded.calls_s
    assert crowded.cpu_bound_s == pytest.approx(own * spec.tasks_per_node / 2) and spec.tasks_per_node == 8
    assert crowded.step_s == pytest.approx(max(free.step_s, crowded.cpu_bound_s))
    assert crowded.step_s > free.step_s
    roomy = steptime.step_time(spec, dataclasses.replace(hw, node_cpus=64))
    assert roomy.step_s == free.step_s  # enough CPUs: the ranks' critical path, as before


def test_without_two_timed_shapes_a_cpu_calibration_has_no_block_terms() -> None:
    one = [{"d_model": 64, "n_heads": 4, "seq_len": 16, "micro_batch": 1, "seconds": 1e-3}]
    runs = [_rank(0, 0.2, compute={"tflops": 0.2, "device": "cpu", "layers": one})]
    found = calibration.from_results(runs, "7", nodes=1, now=NOW)
    assert found is not None and found.layer_overhead_us is None and found.layer_element_ns is None
    assert calibration.from_results(CPU_RUN, "8", nodes=2, now=NOW).layer_element_ns is None  # type: ignore[union-attr]


def _tiny(keys: dict[str, Any]) -> Any:
    overrides = [f"{key}={value}" for key, value in keys.items()]
    return builders.plan("tiny.yaml", "local", *overrides, home=REMOTE_HOME, run_dir=None).spec
