"""The suspect-node ledger: what a hang verdict records, how long a node stays suspect, how a
clearing ends it, and how a new submit leaves suspects out only as far as its partition can spare them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from meshrun.launcher.contract.records import suspects
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import Alerts
from meshrun.launcher.sidecar.alerting import Alerting
from meshrun.submit.config.cluster import load_profile
from meshrun.submit.planning.plan import avoid_suspects, plan_file
from meshrun.submit.schedulers import backend
from meshrun.submit.schedulers.render import render

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def _row(node: str, t: float, **extra: object) -> dict[str, object]:
    return {"node": node, "evidence": "hang verdict: Hang at step 7", "job": "41", "time": t, **extra}


def test_a_node_is_suspect_from_its_newest_finding_until_it_is_cleared_or_forgotten() -> None:
    now = 100 * HOUR
    rows = [
        _row("n1", now - 30 * HOUR),  # forgotten: older than 24 h
        _row("n2", now - 2 * HOUR),
        _row("n3", now - 5 * HOUR),
        {"node": "n3", "cleared": True, "time": now - 1 * HOUR},  # cleared after its finding
        _row("n4", now - 3 * HOUR),
        {"node": "n4", "cleared": True, "time": now - 4 * HOUR},  # cleared before a newer finding: suspect
    ]
    found = suspects.suspects(rows, now)
    assert sorted(found) == ["n2", "n4"] and found["n2"].job == "41"
    assert sorted(suspects.suspects(rows, now, forget_after_s=2.5 * HOUR)) == ["n2"]
    lines = [json.dumps(r) for r in rows] + ['{"node": "n9", "ti', "not json", json.dumps({"node": 5, "time": 1})]
    assert suspects.parse(lines) == rows  # torn, garbled and malformed lines skipped


def _plan(tmp_path: Path, nodes: int, **extra: object):  # type: ignore[no-untyped-def]
    profile = load_profile("testbed")
    spec = tmp_path / "job.yaml"
    data = {
        "name": "j",
        "resources": {"nodes": nodes, "tasks_per_node": 1, "time": "00:05:00"},
        "command": ["true"],
        **extra,
    }
    spec.write_text(json.dumps(data))
    return plan_file(
        spec, profile, home=str(tmp_path), run_dir=str(tmp_path / "run"), scheduler_check=backend("slurm").check
    )


def test_a_submit_leaves_out_the_suspects_its_partition_can_spare_and_says_which(tmp_path: Path) -> None:
    now = 50 * HOUR
    rows = [_row("n2", now - 60), _row("n1", now - 120)]
    one, said = avoid_suspects(_plan(tmp_path, 1), rows, now)
    # the testbed's partition has 2 nodes: a 1-node job can spare one (n1, in name order), keeping n2 in
    assert one.cluster.defaults.exclude == ("n1",), one.cluster.defaults.exclude
    assert said[0].startswith("leaving out suspect node n1 (hang verdict: Hang at step 7; job 41, 2 min ago)")
    assert said[1].startswith("suspect node(s) n2 kept in: the job needs 1 of partition debug's 2 nodes")
    assert "#SBATCH --exclude=n1" in render(one, backend("slurm"))
    two, said = avoid_suspects(_plan(tmp_path, 2), rows, now)
    assert two.cluster.defaults.exclude == () and "n[1-2] kept in: the job needs 2" in said[0]
    mine, said = avoid_suspects(_plan(tmp_path, 1, resilience={"avoid_suspects": False}), rows, now)
    assert mine.cluster.defaults.exclude == () and said == ()
    forgetful, said = avoid_suspects(_plan(tmp_path, 1, resilience={"forget_after_h": 0.01}), rows, now)
    assert forgetful.cluster.defaults.exclude == () and said == ()  # both findings older than 36 s
    bad, said = avoid_suspects(_plan(tmp_path, 1), [_row("n1;reboot", now)], now)
    assert bad.cluster.defaults.exclude == () and "cannot pass to sbatch" in said[0]


def test_the_plan_carries_the_ledger_and_a_bad_forget_after_is_refused(tmp_path: Path) -> None:
    plan = _plan(tmp_path, 1)
    work = plan.cluster.paths.work_dir  # the shipped profile's, or a worker's own testbed's (tests/testbed)
    assert plan.run_spec.run.suspects_file == f"{work}/.meshrun/suspect-nodes.jsonl"
    with pytest.raises(Exception, match="resilience.forget_after_h"):
        _plan(tmp_path, 1, resilience={"forget_after_h": -1})


def test_node_0s_hang_verdict_records_the_stalled_ranks_nodes_privately(tmp_path: Path) -> None:
    ledger = tmp_path / "work" / suspects.LEDGER
    old = os.umask(0)
    try:
        lines: list[str] = []
        alerting = Alerting(RunDir(str(tmp_path)), "n1", 0, Alerts(), lines.append, lambda: 7, str(ledger))
        verdict = {
            "verdict": "Hang at step 7 (phase step), found by n1. Rank 3 on n2 stalled.",
            "ranks": [{"rank": 3, "node": "n2", "state": "stalled"}, {"rank": 0, "node": "n1", "state": "collective"}],
        }
        alerting.on_verdict(verdict, 1000.0)
        alerting.on_verdict(verdict, 1001.0)  # the same verdict seen again: recorded once
    finally:
        os.umask(old)
    rows = suspects.parse(ledger.read_text().splitlines())
    assert [(r["node"], r["evidence"]) for r in rows] == [
        ("n2", "hang verdict: Hang at step 7 (phase step), found by n1")
    ]
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600 and stat.S_IMODE(ledger.parent.stat().st_mode) == 0o700
    other = Alerting(RunDir(str(tmp_path)), "n2", 1, Alerts(), lines.append, lambda: 7, str(ledger))
    other.on_verdict(verdict, 1002.0)  # another node's sidecar: node 0 records, once
    assert len(ledger.read_text().splitlines()) == 1


def test_a_straggler_and_a_hardware_xid_make_their_nodes_suspects_once(tmp_path: Path) -> None:
    from meshrun.launcher.sidecar.stragglers import RankTime

    ledger = tmp_path / "work" / suspects.LEDGER
    alerting = Alerting(RunDir(str(tmp_path)), "n1", 0, Alerts(), [].append, lambda: 7, str(ledger))
    alerting.on_straggler(RankTime(3, "n2", 0.9), 1.8, 0.5, 1.5, 1000.0)
    alerting.on_straggler(RankTime(3, "n2", 0.9), 1.9, 0.5, 1.5, 1010.0)  # the same straggler again: once
    rows = [
        {"uuid": "GPU-a", "rank": 0, "xid": [13]},  # the program's own illegal access: not the node's
        {"uuid": "GPU-b", "rank": 1, "xid": [79, 79]},  # fallen off the bus
    ]
    alerting.on_sample(rows, 1020.0)
    found = [(r["node"], r["evidence"]) for r in suspects.parse(ledger.read_text().splitlines())]
    assert found == [
        ("n2", "straggler: rank 3 took 1.80x the median step time"),
        ("n1", "XID 79 on GPU-b"),
    ]


def test_a_job_with_spares_leaves_out_only_what_the_partition_can_spare_beside_its_spares_too() -> None:
    profile = load_profile("testbed")  # partition debug: 2 nodes
    spec = REPO / "examples" / "two-node.yaml"
    sets = {"resources.nodes": 1, "resources.tasks_per_node": 1, "parallel.dp": 1, "resilience.spare_nodes": 1}
    plan = plan_file(spec, profile, overrides=[f"{k}={v}" for k, v in sets.items()])
    now = 100 * HOUR
    kept, lines = avoid_suspects(plan, [_row("n1", now - HOUR)], now)
    assert kept.cluster.defaults.exclude == ()  # 1 node + 1 spare need both: n1 stays in
    assert lines and "kept in" in lines[0]
