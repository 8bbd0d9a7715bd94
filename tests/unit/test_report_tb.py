"""report() from a user's script, the job's own TensorBoard event files, and MFU arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshrun.launcher.contract.gpus import mfu, peak_tflops
from meshrun.launcher.contract.records.rundir import NodeDir, RunDir, node_name
from meshrun.launcher.train import tbwriter
from meshrun.launcher.train.tbwriter import ScalarWriter

REPO = Path(__file__).resolve().parents[2]


def _scalars(logdir: str, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(logdir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """report() in a fresh process, as a user's script calls it (atexit flushes the event file)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MESHRUN_RUN_DIR", "RANK", "SLURM_PROCID")}
    return subprocess.run(
        [sys.executable, "-c", "from meshrun.launcher.report import report\n" + code],
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def _node(run: RunDir) -> NodeDir:
    """Where report() stamps without $MESHRUN_NODE_DIR: the run dir's own folder for this node."""
    return run.node_dir("", node_name(os.environ))


def test_report_on_rank_0_writes_metrics_tensorboard_and_heartbeat(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path / "run"))
    _run(
        "report(1, loss=4.0, lr=0.1)\nreport(2, loss=3.5, lr=0.05, bad=float('nan'))\nreport(3, phase='eval')",
        MESHRUN_RUN_DIR=run.root,
        RANK="0",
    )
    lines = [json.loads(line) for line in Path(run.metrics).read_text().splitlines()]
    assert [(r["step"], r["loss"], r["lr"]) for r in lines] == [(1, 4.0, 0.1), (2, 3.5, 0.05)]
    assert lines[1]["bad"] is None and isinstance(lines[0]["time"], float)  # strict JSON, no NaN
    assert _scalars(run.tensorboard, "loss") == [(1, 4.0), (2, 3.5)]
    assert "bad" not in EventAccumulator(run.tensorboard).Reload().Tags()["scalars"]
    beat = json.loads(Path(_node(run).progress(0)).read_text())
    # started_at: the pid's start time, so a watchdog never signals a process that reused the pid (meshrun.launcher.contract.procs).
    assert set(beat) == {"rank", "step", "phase", "time", "pid", "started_at", "stack_signal"}
    assert (beat["rank"], beat["step"], beat["phase"]) == (0, 3, "eval")
    assert os.stat(run.metrics).st_mode & 0o777 == 0o600


def test_report_on_other_ranks_stamps_only_the_heartbeat(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path / "run"))
    _run("report(7, loss=1.0)", MESHRUN_RUN_DIR=run.root, RANK="3")
    assert json.loads(Path(_node(run).progress(3)).read_text())["step"] == 7
    assert not os.path.exists(run.metrics) and not os.path.exists(run.tensorboard)


def test_report_outside_meshrun_warns_once_and_writes_nothing(tmp_path: Path) -> None:
    done = _run("report(1, loss=1.0)\nreport(2, loss=0.5)\nprint('done')")
    assert done.stdout == "done\n"
    assert done.stderr.count("MESHRUN_RUN_DIR is not set") == 1


def test_report_names_a_value_that_is_not_a_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.launcher.report import report

    monkeypatch.setenv("MESHRUN_RUN_DIR", str(tmp_path))
    with pytest.raises(TypeError, match=r"loss='high' is not a number"):
        report(1, loss="high")


def test_a_resumed_attempt_replaces_the_points_past_its_checkpoint(tmp_path: Path) -> None:
    """Attempt 1 logs steps 1-6 and dies; attempt 2 resumes from step 4: TensorBoard shows one curve."""
    logdir = str(tmp_path / "tb")
    first = ScalarWriter(logdir)
    for step in range(1, 7):
        first.add(step, {"loss": 10.0 - step})
    first.close()
    second = ScalarWriter(logdir, first_step=5)
    for step in range(5, 8):
        second.add(step, {"loss": 100.0 + step})
    second.close()
    assert _scalars(logdir, "loss") == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 106.0), (7, 107.0)]


def test_event_files_are_framed_as_tensorboards_own_writer_frames_them(tmp_path: Path) -> None:
    """tbwriter frames the events itself (tensorboard's writer costs ~260 ms of CPU to import): the same CRC-32C,
    the same TFRecord bytes, and TensorBoard's own record reader (which checks every CRC) reads them back."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New, masked_crc32c

    assert tbwriter.crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value
    for data in (b"", b"x", bytes(range(256)) * 3, os.urandom(1000)):
        assert tbwriter.masked_crc32c(data) == masked_crc32c(data)
    writer = tbwriter.EventFile(str(tmp_path))
    events = [
        event_pb2.Event(
            wall_time=1.5 + step,
            step=step,
            summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="loss", simple_value=1.0 / step)]),
        )
        for step in range(1, 4)
    ]
    for event in events:
        writer.add_event(event)
    writer.close()
    assert Path(writer.path).name.startswith("events.out.tfevents.")
    reader = PyRecordReader_New(writer.path)
    read = []
    while True:
        try:
            reader.GetNext()
        except Exception:  # the stub's reader ends with an OutOfRangeError
            break
        read.append(event_pb2.Event.FromString(reader.record()))
    assert read[0].file_version == "brain.Event:2" and read[1:] == events


def test_mfu_is_achieved_model_flops_over_the_profiles_gpu_peak() -> None:
    assert peak_tflops("h100") == peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("gh200") == peak_tflops("NVIDIA GH200 480GB") == 989.0  # not mistaken for h200
    assert peak_tflops("A100-SXM4-80GB") == 312.0
    assert peak_tflops("fake") is None and peak_tflops("") is None
    # 6N+12LdT FLOPs/token x tokens/s / ranks = 494.5 TFLOP/s per rank on an H200: half its peak.
    assert mfu(494.5, peak_tflops("h200") or 0) == pytest.approx(0.5)


def _record(step: int, wait: float) -> dict[str, float]:
    return {
        "step": step,
        "loss": 2.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 1000.0,
        "step_time_s": 0.5,
        "data_wait_s": wait,
        "tflops_per_rank": 494.5,
        "time": 1.0,
    }


def test_metrics_log_adds_mfu_only_with_a_known_peak_and_tensorboard_gets_the_rest(tmp_path: Path) -> None:
    from meshrun.launcher.train.metrics import MetricsLog

    with_peak, without = tmp_path / "gpu", tmp_path / "cpu"
    for run_dir, peak in ((with_peak, peak_tflops("h200")), (without, None)):
        log = MetricsLog(str(run_dir), enabled=True, steps=2, peak_tflops=peak)
        log.write(_record(1, 0.05), extra={"gpu_memory/peak_allocated_gib": 3.5})
        log.close()
    (line,) = [json.loads(x) for x in (with_peak / "metrics.jsonl").read_text().splitlines()]
    assert line["mfu"] == pytest.approx(0.5) and "data_wait_fraction" not in line  # jsonl keeps its keys
    assert "mfu" not in json.loads((without / "metrics.jsonl").read_text())
    tb = RunDir(str(with_peak)).tensorboard
    assert _scalars(tb, "mfu") == [(1, pytest.approx(0.5))]
    assert _scalars(tb, "data_wait_fraction") == [(1, pytest.approx(0.1))]
    assert _scalars(tb, "gpu_memory/peak_allocated_gib") == [(1, 3.5)]


def test_mfu_peak_says_why_there_is_none() -> None:
    from meshrun.launcher.contract.gpus import mfu_peak

    assert mfu_peak("h100", cuda=True) == (989.0, "")
    assert mfu_peak("", cuda=True, device_name="NVIDIA H200") == (989.0, "")  # no type in the profile
    assert mfu_peak("h200", cuda=False) == (None, "the ranks compute on the CPU (MFU is measured against a GPU's peak)")
    peak, why = mfu_peak("fake", cuda=True, device_name="Mystery GPU")
    assert peak is None and "'fake'" in why and "PEAK_BF16_TFLOPS in launcher/contract/gpus.py" in why


def test_the_plan_carries_the_partitions_gpu_type_and_old_spec_files_still_load(tmp_path: Path) -> None:
    from meshrun.launcher.contract.spec.job import dumps_run_spec, read_run_spec
    from meshrun.submit.config.cluster import load_profile
    from meshrun.submit.planning.plan import plan_file

    plan = plan_file(REPO / "examples" / "h100-8node.yaml", load_profile("h200-ndr"), home="/home/u", run_dir="/r")
    assert plan.run_spec.run.gpu_type == "h200" and peak_tflops(plan.run_spec.run.gpu_type) == 989.0
    local = plan_file(REPO / "examples" / "tiny.yaml", load_profile("local"), home="/home/u", run_dir="/r")
    assert local.run_spec.run.gpu_type == ""
    old = json.loads(dumps_run_spec(plan.run_spec))
    del old["run"]["gpu_type"]  # a spec.json written before the field existed
    (tmp_path / "spec.json").write_text(json.dumps(old))
    assert read_run_spec(tmp_path).run.gpu_type == ""
