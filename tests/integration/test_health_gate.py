"""The health gate on the real Slurm testbed: a node that fails its check before the ranks
start is recorded as a suspect and excluded, and the job requeued onto a healthy node, where it trains; when
excluding it would leave the partition too few nodes the job ends with exit 79 and says why. The failure comes
from launcher/probes/health.py's test variable, which the submitting environment passes to the job."""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.launcher.contract.exitcodes import EXIT_UNHEALTHY
from meshrun.launcher.contract.records.rundir import RunDir
from tests.helpers.cli import SMALL_MODEL, TWO_NODES, meshrun, metrics, slurm_job_fields, submitted, wait_for_state

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def _scontrol_field(testbed: dict, job_id: str, key: str) -> str:
    return slurm_job_fields(str(testbed["slurm_conf"]), job_id).get(key, "")


def test_a_node_failing_its_health_check_is_excluded_and_the_job_requeued_onto_a_healthy_one(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    # One node: Slurm takes n1 first, whose check is made to fail; the requeued job must go to n2.
    args = [*TWO_NODES, *SMALL_MODEL, "--set", "resources.nodes=1", "--set", "parallel.dp=1"]
    args += ["--set", "resilience.avoid_suspects=false"]  # whatever the ledger holds, Slurm picks n1 first
    args += ["--set", f"data.path={corpus}", "--set", "train.steps=6", "--set", "train.log_every=1"]
    out = meshrun(tmp_path, "submit", *args, env={"MESHRUN_TEST_HEALTH_FAIL": "n1"}, check=True)
    job_id, run_dir = submitted(out)
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=240)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch)
    assert "health check failed on n1 (gpus: MESHRUN_TEST_HEALTH_FAIL: 1 uncorrectable ECC error" in batch, batch
    assert "requeueing with n1 excluded" in batch and f"ranks exited with status {EXIT_UNHEALTHY}" not in batch, batch
    assert "health check passed on 1 node " in batch, batch
    assert _scontrol_field(testbed, job_id, "ExcNodeList") == "n1"
    assert _scontrol_field(testbed, job_id, "NodeList") == "n2"
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 7))  # no rank ran on n1: nothing repeated
    assert [(a["rule"], a["node"]) for a in row["alerts"]] == [("node_unhealthy", "n1")], row["alerts"]
    # The latest start's verdict, and n2's answer, in the run dir.
    assert json.loads(Path(RunDir(str(run_dir)).health_verdict).read_text())["action"] == "start"
    answer = json.loads(Path(RunDir(str(run_dir)).health_result("n2")).read_text())
    assert {c["name"]: c["verdict"] for c in answer["checks"]} == {
        "gpus": "skip",
        "space": "pass",
        "storage": "pass",
        "python": "pass",
        "clock": "pass",
    }, answer
    # n1 is a suspect now, with the check as its evidence: the next submit to the cluster leaves it out.
    listed = json.loads(meshrun(tmp_path, "nodes", "-c", "testbed", "--json", check=True).stdout)
    (n1,) = [s for s in listed if s["node"] == "n1"]
    assert n1["evidence"].startswith("health check: gpus: MESHRUN_TEST_HEALTH_FAIL") and n1["job"] == job_id, listed


def test_a_failing_node_that_cannot_be_spared_ends_the_job_with_79_and_its_reason(
    testbed: dict, tmp_path: Path
) -> None:
    # Both testbed nodes: excluding n2 would leave 1 of the 2 the job needs.
    sets = ["--set", "resources.tasks_per_node=1", "--set", "command=python3,-c,print('ran')"]
    out = meshrun(
        tmp_path,
        "submit",
        "examples/command.yaml",
        "-c",
        "testbed",
        "--set",
        "resources.nodes=2",
        *sets,
        env={"MESHRUN_TEST_HEALTH_FAIL": "n2"},
        check=True,
    )
    job_id, run_dir = submitted(out)
    row = wait_for_state(tmp_path, job_id, ENDED, timeout=120)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "FAILED" and row["exit_code"] == EXIT_UNHEALTHY and row["restarts"] == 0, (row, batch)
    assert not list((run_dir / "logs").glob("rank-*.log")), batch  # no rank started
    assert batch.count("health check failed on n2") == 1, batch  # the reason once, in the policy's line
    shown = " ".join(meshrun(tmp_path, "status", job_id, check=True).stdout.split())  # unwrapped
    assert "health check failed on n2" in shown, shown
    assert f"`meshrun nodes -c testbed --clear n2` once repaired, then `meshrun resume {job_id}`" in shown, shown
