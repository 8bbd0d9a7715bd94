"""A stalled rendezvous, judged by the hang watch within about a minute and naming the node that did not join
(a requeued start waited in a store connect that could not complete, under a 1,200 s setup timeout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records import suspects
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import Watchdog as Settings
from meshrun.launcher.contract.spec.schema import SchemaError, load
from meshrun.launcher.sidecar import rendezvous
from meshrun.launcher.sidecar.rendezvous import NodeView, RendezvousTrack, judge
from tests.unit.test_watchdog import Clock, Kill, beat, claim, make

SETTINGS = Settings(setup_timeout_s=1200, straggler_check_s=10, diagnosis_wait_s=30, rendezvous_stall_s=60)


def view(node: str, index: int, reached: dict[int, float], left: bool = False) -> NodeView:
    return NodeView(node, index, reached, left)


def test_some_ranks_reached_it_a_minute_ago_and_a_node_never_came() -> None:
    nodes = [view("n1", 0, {0: 100.0, 1: 101.0}), view("n3", 2, {4: 102.0, 5: 102.0})]
    assert judge(nodes, 3, 2, now=159.0, stall_s=60) is None  # not yet a minute since the first rank came
    stall = judge(nodes, 3, 2, now=161.0, stall_s=60)
    assert stall is not None
    assert stall.missing == (("index 1", (2, 3)),)  # n2 shared nothing: named by its index
    named = judge([*nodes, view("n2", 1, {})], 3, 2, now=161.0, stall_s=60)
    assert named is not None
    assert (
        named.headline()
        == "rendezvous stalled: node n2 (ranks 2-3) did not join in 61 s (watchdog.rendezvous_stall_s 60 s)"
    )
    assert ". " not in named.headline()  # status shows a verdict's first sentence


def test_one_rank_past_it_means_it_completed_whatever_older_shares_say() -> None:
    nodes = [view("n1", 0, {0: 100.0, 1: 100.0}), view("n2", 1, {2: 100.0}, left=True)]
    assert judge(nodes, 2, 2, now=1000.0, stall_s=60) is None


def test_nothing_is_judged_before_any_rank_reached_it() -> None:
    assert judge([view("n1", 0, {}), view("n2", 1, {})], 2, 2, now=1e9, stall_s=60) is None


def test_every_rank_there_but_no_completion_names_the_store_node() -> None:
    stall = judge([view("n1", 0, {0: 10.0}), view("n2", 1, {1: 11.0})], 2, 1, now=80.0, stall_s=60)
    assert stall is not None and stall.missing == ()
    assert "every rank reached it but it did not complete in 70 s" in stall.headline()
    assert stall.headline().endswith("rank 0's store is on node n1")


def test_a_command_jobs_heartbeats_count_as_past_the_rendezvous() -> None:
    track = RendezvousTrack()
    track.observe(0, {"time": 5.0, "phase": "rendezvous"})
    assert track.share() == {"reached": {"0": 5.0}, "left": False}
    track.observe(0, {"time": 6.0, "phase": "setup"})
    assert track.share() == {"reached": {"0": 5.0}, "left": True}
    command = RendezvousTrack()
    command.observe(3, {"time": 7.0, "phase": "step"})  # report() never says "rendezvous"
    assert command.left


def test_shares_of_another_attempt_or_malformed_are_left_out() -> None:
    files: list[dict[str, Any]] = [
        {"attempt": "1.0", "node": "n1", "node_rank": 0, "rendezvous": {"reached": {"0": 1.0}, "left": False}},
        {"attempt": "0.0", "node": "n2", "node_rank": 1, "rendezvous": {"reached": {"1": 1.0}, "left": True}},
        {"attempt": "1.0", "node": "n3", "node_rank": 2, "rendezvous": {"reached": {"x": 1.0}}},
        {"attempt": "1.0", "node": "n4", "ranks": {}},  # written before node_rank was shared
    ]
    assert rendezvous.views(files, "1.0") == [view("n1", 0, {0: 1.0})]


def _run_until(dogs: list[Any], clock: Clock, until: float) -> float:
    """Both sidecars tick every second; the time the claim appeared (or `until`)."""
    found = until
    while clock.t < until and not all(dog.ended for dog, _, _ in dogs):
        clock.t += 1
        for dog, _, _ in dogs:
            dog.tick()
        if claim(dogs[0][0].run_dir) is not None and found == until:
            found = clock.t
    return found


def test_the_hang_watch_names_the_node_that_did_not_join_within_about_a_minute(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock(1000.0)
    kill = Kill({})
    dogs = [
        make(run, "n1", [0, 1], clock, kill, node_rank=0, nodes=2, settings=SETTINGS),
        make(run, "n2", [2, 3], clock, kill, node_rank=1, nodes=2, settings=SETTINGS),
    ]
    for rank in (0, 1):
        beat(dogs[0][1], rank, 0, 1002.0, "rendezvous")  # n2's ranks never start
    claimed = _run_until(dogs, clock, 1200.0)
    assert 1062 <= claimed <= 1075, claimed  # a minute and a share interval, not the 1,200 s setup timeout
    assert all(dog.ended for dog, _, _ in dogs)
    verdict = json.loads(Path(run.verdict_json).read_text())
    assert verdict["verdict"].startswith("Rendezvous stalled: node n2 (ranks 2-3) did not join in ")
    assert verdict["phase"] == "rendezvous" and verdict["found_by"] == "n1"
    assert suspects.blamed_nodes(verdict) == ["n2"]  # as a hang's stalled ranks' nodes: left out on the requeue
    assert Path(run.exit_code).read_text() == "76\n"
    assert any("rendezvous stalled: node n2 (ranks 2-3) did not join" in line for line in dogs[0][2])
    assert sorted(pid - 10_000 for pid, sig in kill.calls if sig == 9) == [0, 1]  # the waiting ranks end


def test_node_0_judges_when_its_own_ranks_are_the_missing_ones(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock(1000.0)
    dogs = [
        make(run, "n1", [0, 1], clock, node_rank=0, nodes=2, settings=SETTINGS),
        make(run, "n2", [2, 3], clock, node_rank=1, nodes=2, settings=SETTINGS),
    ]
    for rank in (2, 3):
        beat(dogs[1][1], rank, 0, 1001.0, "rendezvous")
    _run_until(dogs, clock, 1120.0)
    verdict = json.loads(Path(run.verdict_json).read_text())
    assert verdict["verdict"].startswith("Rendezvous stalled: node n1 (ranks 0-1) did not join in ")


def test_a_completed_rendezvous_or_a_command_job_is_never_judged(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock(1000.0)
    dogs = [
        make(run, "n1", [0, 1], clock, node_rank=0, nodes=2, settings=SETTINGS),
        make(run, "n2", [2, 3], clock, node_rank=1, nodes=2, settings=SETTINGS),
    ]
    for rank in (0, 1, 2, 3):
        beat(dogs[rank // 2][1], rank, 0, 1002.0, "rendezvous")
    beat(dogs[1][1], 3, 0, 1004.0, "setup")  # one rank past it: every rank had arrived
    _run_until(dogs, clock, 1150.0)
    assert claim(run) is None

    command_run = RunDir(str(tmp_path / "command"))
    Path(command_run.root).mkdir()
    dogs = [
        make(command_run, "n1", [0], clock, node_rank=0, nodes=2, settings=SETTINGS),
        make(command_run, "n2", [1], clock, node_rank=1, nodes=2, settings=SETTINGS),
    ]
    beat(dogs[0][1], 0, 0, clock.t, "setup")  # a command job's report(): n2's program never reports
    _run_until(dogs, clock, clock.t + 150)
    assert claim(command_run) is None


@pytest.mark.parametrize("key", ["rendezvous_stall_s", "rendezvous_timeout_s"])
def test_the_bounds_are_checked_with_the_key_named(key: str) -> None:
    with pytest.raises(SchemaError, match=f"watchdog.{key}.*give 1 to 604800 seconds"):
        load(Settings, {key: 0}, "watchdog")  # as a spec's watchdog section is read
    assert getattr(Settings(), key) == {"rendezvous_stall_s": 60.0, "rendezvous_timeout_s": 180.0}[key]
