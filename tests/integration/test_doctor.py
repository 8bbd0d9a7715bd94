"""`meshrun doctor` end to end: the real preflight job through the normal submission path, on the real
2-node Slurm testbed (a row per node; a node made slow is failed and excluded) and on `local` (a node
made broken is failed with its reason). The faults come from launcher/probes/doctor.py's test variables, which
the submitting environment passes to the ranks as sbatch does for any variable."""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.launcher.contract.records.rundir import RunDir, node_name
from tests.helpers.cli import TINY, meshrun, status, submitted


def rows(stdout: str) -> dict[str, list[str]]:
    """The table's node rows by node name (the header row starts with NODE)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NODE "))
    found = {}
    for line in lines[start + 1 :]:
        if not line.strip() or line.split()[-1] not in ("PASS", "WARN", "FAIL"):
            break  # the reasons and notes under the table
        found[line.split()[0]] = line.split()
    return found


def test_doctor_on_the_slurm_testbed_has_a_row_per_node_and_fails_the_slow_one(testbed: dict, tmp_path: Path) -> None:
    # The testbed's GPUs are device files nothing can compute on: the CPU subset (--gpus-per-node 0).
    out = meshrun(
        tmp_path,
        "doctor",
        "-c",
        "testbed",
        "--gpus-per-node",
        "0",
        "--storage-mib",
        "4",
        env={"MESHRUN_TEST_DOCTOR_SLOW": "n2"},
        timeout=180,
    )
    text = out.stdout + out.stderr
    print(out.stdout)  # the table, for the record (pytest -s)
    assert out.returncode == 1, text  # a bad node: exit 1, the cluster failed
    table = rows(out.stdout)
    assert sorted(table) == ["n1", "n2"], text
    assert table["n1"][-1] in ("PASS", "WARN") and table["n2"][-1] == "FAIL", text
    assert "n2: FAIL storage: slow: ckpt write" in out.stdout, text
    assert "across 2 nodes: all-reduce bus bandwidth" in out.stdout, text  # gloo across the two slurmds
    assert "CPU job: skipped GPUs and NCCL; the GEMM ran in fp32 on the CPU" in out.stdout, text
    assert out.stdout.rstrip().endswith("add to submit: --exclude n2"), text
    # Every rank (2 per node) measured the intra-node all-reduce, and the run went through the registry.
    run_dir = next(line.split("run dir ", 1)[1] for line in out.stdout.splitlines() if line.startswith("doctor: job"))
    ranks = [json.loads(Path(RunDir(run_dir).doctor_result(r)).read_text()) for r in range(4)]
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert all(r["phase"] == "done" and r["comm"]["intra_node_busbw_gbps"] > 0 for r in ranks), ranks
    job_id = out.stdout.split("doctor: job ", 1)[1].split()[0]
    assert job_id in meshrun(tmp_path, "status", "--json", check=True).stdout


def test_doctor_on_local_fails_a_broken_node_with_its_reason(tmp_path: Path) -> None:
    node = node_name({})
    out = meshrun(tmp_path, "doctor", "-c", "local", "--storage-mib", "2", env={"MESHRUN_TEST_DOCTOR_FAIL": node})
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert rows(out.stdout)[node][-1] == "FAIL", text
    assert f"{node}: FAIL compute: rank 0: RuntimeError: MESHRUN_TEST_DOCTOR_FAIL" in out.stdout, text
    assert f"--exclude {node}" in out.stdout, text


def test_doctor_on_local_passes_a_healthy_node_and_calibrates_the_plan_of_a_cpu_job(
    tmp_path: Path, corpus: Path
) -> None:
    before = json.loads(meshrun(tmp_path, "plan", "examples/tiny.yaml", "-c", "local", "--json", check=True).stdout)
    assert before["step_time_s"] is None  # a CPU job's time needs this machine's measured CPU
    out = meshrun(tmp_path, "doctor", "-c", "local", "--storage-mib", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = rows(out.stdout).values()
    assert (
        row[-1] == "PASS"
        and "\nno bad nodes\ncalibration: the CPU figures of partition local recorded in " in out.stdout
    ), out.stdout
    assert "ok CPU " in " ".join(row) and " GFLOP/s " in " ".join(row), out.stdout  # the fp32 CPU GEMM
    plan = meshrun(tmp_path, "plan", "examples/tiny.yaml", "-c", "local", check=True).stdout
    time_line = next(line for line in plan.splitlines() if line.startswith("time: "))
    assert " s/step, " in time_line and "; calibrated on " in time_line and ", cpu)" in time_line, plan
    check_the_run_against_its_plan(tmp_path, corpus)


def check_the_run_against_its_plan(home: Path, corpus: Path) -> None:
    """The calibrated job carries its prediction; rank 0 made slow on purpose (0.4 s more CPU a step) reports its
    ratio to the plan and raises the drift alert naming compute."""
    out = meshrun(
        home,
        "submit",
        *TINY,
        "--set",
        f"data.path={corpus}",
        "--set",
        "train.steps=10",
        "--set",
        "train.log_every=1",
        "--set",
        "alerts.plan_check_steps=4",
        "--set",
        "env.MESHRUN_TEST_SLOW=0:0.4",
        "--wait",
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id, run_dir = submitted(out)
    predicted = json.loads((run_dir / "spec.json").read_text())["run"]["prediction"]
    assert predicted["step_s"] > 0 and predicted["figures"].startswith("calibrated on "), predicted
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (check,) = [line for line in lines if line.get("event") == "plan_check"]
    # the 5 warm-up steps (launcher/train/plancheck.py) unmeasured, then 4 steps: 4 x 0.4 s burnt on rank 0
    assert check["step"] == 9 and check["steps"] == 4 and check["term"] == "compute", check
    assert check["step_time_ratio"] > 1.3 and check["terms"]["compute"]["measured_s"] > 0.4, check
    steps = [line for line in lines if "event" not in line]
    # the records after the check carry its ratio (and TensorBoard with them)
    assert [(line["step"], line.get("plan_step_ratio")) for line in steps][-2:] == [
        (9, None),
        (10, check["step_time_ratio"]),
    ], steps
    row = status(home, job_id)
    (alert,) = [a for a in row["alerts"] if a["rule"] == "plan_drift"]
    assert "compute is off" in alert["message"] and "meshrun doctor -c local" in alert["message"], alert
    shown = meshrun(home, "status", job_id, check=True).stdout
    assert f"vs plan: step time {check['step_time_ratio']:.2f}x the plan's (compute furthest off)" in shown, shown


def test_submit_exclude_keeps_the_job_off_that_node_on_the_slurm_testbed(testbed: dict, tmp_path: Path) -> None:
    # One task on one node: Slurm would take n1 first; --exclude n1 (what doctor prints) must move it to n2.
    show = "command=python3,-c,import os; print('on ' + os.environ['SLURMD_NODENAME'])"  # no comma: --set splits
    sets = ["--set", "resources.tasks_per_node=1", "--set", show]
    out = meshrun(tmp_path, "submit", "examples/command.yaml", "-c", "testbed", *sets, "--exclude", "n1", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(next(l.split(": ", 1)[1] for l in out.stdout.splitlines() if l.startswith("run dir: ")))
    assert "on n2\n" in (run_dir / "logs" / "rank-0.log").read_text()
    assert "#SBATCH --exclude=n1\n" in (run_dir / "job.sbatch").read_text()


def test_doctor_json_on_local_is_one_json_document(tmp_path: Path) -> None:
    """--json: stdout is the JSON alone (the job line goes to stderr), one result per rank."""
    out = meshrun(tmp_path, "doctor", "-c", "local", "--storage-mib", "2", "--json", timeout=180)
    document = json.loads(out.stdout)
    assert document["state"] == "COMPLETED" and len(document["ranks"]) >= 1, document
    assert all(rank["phase"] == "done" for rank in document["ranks"]), document
    assert out.stderr.startswith(f"doctor: job {document['job']} on local"), out.stderr
