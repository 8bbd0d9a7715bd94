"""The sidecar's hang watchdog (launcher/sidecar/watchdog.py): timeouts per phase, the claim / contribute /
verdict / exit code / kill protocol between two nodes on one run dir (fake clock, fake kill), stale claims
and verdicts of another attempt, a node that never answers, and stragglers."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from meshrun.launcher.contract.records.rundir import NodeDir, RunDir
from meshrun.launcher.contract.spec.job import Watchdog as Settings
from meshrun.launcher.sidecar import watchdog as wd
from meshrun.launcher.sidecar.beats import phase_timeout, step_timeout
from meshrun.launcher.sidecar.stragglers import RankTime, StragglerTracker

REPO = Path(__file__).resolve().parents[2]
USR2 = int(signal.SIGUSR2)
SETTINGS = Settings(step_factor=5, step_floor_s=1, setup_timeout_s=100, eval_timeout_s=200, checkpoint_timeout_s=300)
STALLED = """Current thread 0x1 (most recent call first):
  File "/w/launcher/testing/faults.py", line 20 in inject_hang
  File "/w/launcher/train/loop.py", line 9 in <module>
"""
WAITING = """Current thread 0x2 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/w/launcher/train/optim.py", line 55 in global_grad_norm
  File "/w/launcher/train/loop.py", line 9 in <module>
"""


class Lines(list[str]):
    def __call__(self, message: str) -> None:
        self.append(message)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def beat(node_dir: NodeDir, rank: int, step: int, t: float, phase: str = "step", **extra: Any) -> None:
    """A heartbeat as meshrun.launcher.report.Heartbeat writes it (replaced atomically)."""
    path = node_dir.progress(rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {"rank": rank, "step": step, "phase": phase, "time": t, "pid": 10_000 + rank, **extra}
    Path(f"{path}.tmp").write_text(json.dumps(data))
    os.replace(f"{path}.tmp", path)


class Kill:
    """os.kill's stand-in: records (pid, sig); a stack signal makes the "rank" write its dump, as faulthandler
    would; a kill -9 first checks that every node's part of the diagnosis exists (nothing killed before)."""

    def __init__(self, stacks: dict[int, tuple[NodeDir, str]], before_kill: Callable[[], None] = lambda: None) -> None:
        self.stacks, self.before_kill = stacks, before_kill
        self.calls: list[tuple[int, int]] = []
        self.dead: set[int] = set()

    def __call__(self, pid: int, sig: int) -> None:
        if pid in self.dead:
            raise ProcessLookupError(pid)
        if sig == 0:
            return
        self.calls.append((pid, sig))
        rank = pid - 10_000
        if sig == USR2:
            node_dir, text = self.stacks[rank]
            with open(node_dir.stack(rank), "a", encoding="utf-8") as handle:
                handle.write(text)
        if sig == signal.SIGKILL:
            self.before_kill()
            self.dead.add(pid)

    def signals(self, sig: int) -> list[int]:
        return sorted(pid - 10_000 for pid, s in self.calls if s == sig)


def make(
    run: RunDir,
    node: str,
    ranks: list[int],
    clock: Clock,
    kill: Any = None,
    node_rank: int = 0,
    nodes: int = 1,
    settings: Settings = SETTINGS,
    attempt: str = "42.0",
    on_scalars: Optional[Callable[[dict[str, float]], None]] = None,
) -> tuple[wd.Watchdog, NodeDir, Lines]:
    log = Lines()
    node_dir = run.node_dir("", node)
    dog = wd.Watchdog(
        run,
        node_dir,
        node,
        node_rank,
        nodes,
        ranks,
        settings,
        attempt,
        log,
        gpu_snapshot=lambda: [{"uuid": "GPU-1", "util_pct": 0}],
        clock=clock,
        kill=kill or Kill({}),
        on_scalars=on_scalars,
    )
    return dog, node_dir, log


def test_timeout_arithmetic() -> None:
    assert phase_timeout(SETTINGS, "setup", []) == 100
    assert phase_timeout(SETTINGS, "eval", [1, 1, 1]) == 200
    assert phase_timeout(SETTINGS, "checkpoint", [1, 1, 1]) == 300
    assert step_timeout(SETTINGS, [1.0, 1.0]) == 100  # warm-up: fewer than 3 durations get setup's
    assert step_timeout(SETTINGS, [1.0, 1.0, 1.0]) == 5 * 1 + 1
    assert step_timeout(SETTINGS, [1.0, 1.0, 1.0, 10.0]) == 2 * 10 + 1  # the slowest wins over 5 x median


def tick_at(dog: wd.Watchdog, clock: Clock, t: float) -> None:
    clock.t = t
    dog.tick()


def claim(run: RunDir) -> Optional[dict[str, Any]]:
    path = Path(run.diagnosis) / ".claim"
    return json.loads(path.read_text()) if path.exists() else None


def test_setup_phase_hangs_after_the_setup_timeout(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    dog, node_dir, log = make(run, "n1", [0, 1], clock)
    beat(node_dir, 0, 0, clock.t, "setup")
    beat(node_dir, 1, 0, clock.t, "setup")
    tick_at(dog, clock, 1099)
    assert claim(run) is None
    tick_at(dog, clock, 1101)
    got = claim(run)
    assert got is not None
    assert {k: got[k] for k in ("attempt", "node", "step", "phase", "timeout_s")} == {
        "attempt": "42.0",
        "node": "n1",
        "step": 0,
        "phase": "setup",
        "timeout_s": 100,
    }
    assert got["silent_s"] == pytest.approx(101)
    assert any("no progress for 101 s at step 0 (phase setup, timeout 100 s)" in line for line in log)


def test_step_timeout_follows_the_recent_step_times(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    dog, node_dir, log = make(run, "n1", [0, 1], clock)
    for step in range(1, 7):  # 2-second steps, each seen by a tick
        clock.t += 2
        for rank in (0, 1):
            beat(node_dir, rank, step, clock.t)
        dog.tick()
    last = clock.t
    assert dog.current() == (6, "step", 5 * 2 + 1)
    tick_at(dog, clock, last + 10.5)
    assert claim(run) is None
    tick_at(dog, clock, last + 11.5)
    assert claim(run)["timeout_s"] == 11  # type: ignore[index]
    timeouts = [line for line in log if "hang timeout now" in line]
    assert timeouts == ["hang timeout now 100 s (phase step, step 1)", "hang timeout now 11 s (phase step, step 4)"]


def test_one_rank_progressing_is_progress_and_steps_shorter_than_a_tick_count_per_step(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    dog, node_dir, _ = make(run, "n1", [0, 1], clock)
    for step in (1, 4, 7, 10):  # a tick sees every third 0.5-second step
        clock.t += 1.5
        beat(node_dir, 0, step, clock.t)
        dog.tick()
    assert sorted(dog.durations()) == [0.5] * 9  # one per step: 3 sightings, 3 steps each
    assert dog.current()[2] == 5 * 0.5 + 1  # max(2.5, 2 x 0.5) + 1


def test_eval_and_checkpoint_phases_get_their_own_timeouts(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    dog, node_dir, _ = make(run, "n1", [0], clock)
    beat(node_dir, 0, 5, clock.t, "eval")
    tick_at(dog, clock, 1150)
    assert claim(run) is None  # past setup's 100 s, within eval's 200 s
    tick_at(dog, clock, 1201)
    assert claim(run)["phase"] == "eval"  # type: ignore[index]


def test_nothing_is_declared_before_the_first_heartbeat_and_that_is_said_once(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    dog, _, log = make(run, "n1", [0], clock)
    for t in (1050, 1101, 1500, 5000):
        tick_at(dog, clock, t)
    assert claim(run) is None and not dog.ended
    said = [line for line in log if "no heartbeat" in line]
    assert len(said) == 1 and "meshrun.launcher.report.report()" in said[0]


def test_a_previous_attempts_beats_are_ignored(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    node_dir = run.node_dir("", "n1")
    beat(node_dir, 0, 30, clock.t - 600)  # left over by the attempt before the requeue
    dog, _, _ = make(run, "n1", [0], clock)
    tick_at(dog, clock, 1200)
    assert dog.live_beats() == {} and claim(run) is None
    Path(node_dir.progress(0)).write_text('{"rank": 0, "st')  # half a file: ignored, read again later
    tick_at(dog, clock, 1201)
    beat(node_dir, 0, 0, 1201, "setup")
    tick_at(dog, clock, 1202)
    assert dog.live_beats()[0]["step"] == 0


def two_nodes(tmp_path: Path) -> tuple[RunDir, Clock, Kill, list[tuple[wd.Watchdog, NodeDir, Lines]]]:
    """n1 runs ranks 0, 1 (rank 1 hangs in inject_hang), n2 runs 2, 3 (rank 3 never armed a stack dump)."""
    run, clock = RunDir(str(tmp_path)), Clock()
    nd1, nd2 = run.node_dir("", "n1"), run.node_dir("", "n2")

    def parts_exist() -> None:
        for node in ("n1", "n2"):
            assert (Path(run.node_diagnosis(node)) / "done.json").exists(), f"{node} killed before its part"

    kill = Kill({0: (nd1, WAITING), 1: (nd1, STALLED), 2: (nd2, WAITING)}, parts_exist)
    dogs = [
        make(run, "n1", [0, 1], clock, kill, node_rank=0, nodes=2),
        make(run, "n2", [2, 3], clock, kill, node_rank=1, nodes=2),
    ]
    for step in range(1, 5):
        clock.t += 2
        for rank, node_dir in ((0, nd1), (1, nd1), (2, nd2)):
            beat(node_dir, rank, step if rank != 1 else min(step, 3), clock.t, stack_signal=USR2)
        beat(nd2, 3, step, clock.t + 0.5)  # n2 last progressed a little later: n1 finds the hang
        for dog, _, _ in dogs:
            dog.tick()
    return run, clock, kill, dogs


def test_two_nodes_claim_contribute_verdict_exit_code_then_kill(tmp_path: Path) -> None:
    run, clock, kill, dogs = two_nodes(tmp_path)
    nd1 = dogs[0][1]
    os.makedirs(os.path.dirname(nd1.nccl_pipe_prefix), exist_ok=True)
    pipe = f"{nd1.nccl_pipe_prefix}0.pipe"
    os.mkfifo(pipe)

    # The read end is open before any tick, as rank 0's PyTorch holds it from its start: a thread that had
    # not yet reached open() when the sidecar wrote (a loaded machine) made the write ENXIO, no dump asked.
    read_end = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)

    def flight_recorder() -> None:  # rank 0's PyTorch: a write to the pipe asks for a dump
        select.select([read_end], [], [])
        os.read(read_end, 1)
        os.close(read_end)
        Path(nd1.nccl_prefix + "0").write_bytes(b"NCCL trace of rank 0")

    reader = threading.Thread(target=flight_recorder, daemon=True)
    reader.start()
    start = clock.t
    for t in range(1, 20):  # every second, both sidecars tick
        clock.t = start + t
        for dog, _, _ in dogs:
            dog.tick()
        if all(dog.ended for dog, _, _ in dogs):
            break
        # Once claimed, the dump has been asked for: give the recorder's thread real time to write it (a
        # loaded machine took more than 0.2 s); join returns at once when it has.
        reader.join(2.0 if claim(run) else 0)
    assert all(dog.ended for dog, _, _ in dogs)
    assert claim(run)["node"] == "n1"  # type: ignore[index]
    # only pids whose heartbeat names the stack signal were asked; rank 3 (no stack_signal) never
    assert kill.signals(USR2) == [0, 1, 2]
    assert kill.signals(signal.SIGKILL) == [0, 1, 2, 3]
    verdict = json.loads(Path(run.verdict_json).read_text())
    text = Path(run.verdict).read_text()
    assert verdict["verdict"] + "\n" == text
    assert "Rank 1 (n1, pid 10001) stalled in inject_hang (launcher/testing/faults.py:20), not in a collective" in text
    assert "ranks 0, 2 (n1, n2) wait in all_reduce (called from launcher/train/optim.py:55 global_grad_norm)" in text
    assert "rank 3 (n2, pid 10003) gave no stack" in text
    assert verdict["attempt"] == "42.0" and verdict["found_by"] == "n1" and verdict["missing_nodes"] == []
    code = Path(run.exit_code)
    assert code.read_text() == "76\n" and stat.S_IMODE(code.stat().st_mode) == 0o600
    part = Path(run.node_diagnosis("n1"))
    assert sorted(p.name for p in part.iterdir()) == [
        "done.json",
        "gpus.json",
        "heartbeats.json",
        "nccl-trace-rank-0",
        "rank-0.stack.txt",
        "rank-1.stack.txt",
    ]
    assert (part / "rank-1.stack.txt").read_text() == STALLED
    assert (part / "nccl-trace-rank-0").read_bytes() == b"NCCL trace of rank 0"
    assert json.loads((part / "heartbeats.json").read_text())["beats"]["1"]["step"] == 3
    assert json.loads((part / "gpus.json").read_text()) == {"gpus": [{"uuid": "GPU-1", "util_pct": 0}]}
    assert any("killed ranks 2 (pid 10002), 3 (pid 10003)" in line for line in dogs[1][2])
    calls = len(kill.calls)
    for dog, _, _ in dogs:  # ended: ticks do nothing more
        dog.tick()
    assert len(kill.calls) == calls


def test_a_claim_and_a_verdict_of_another_attempt_are_stale(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))
    os.makedirs(run.diagnosis)
    old = {"attempt": "41.0", "node": "n9", "time": 1.0, "step": 3, "phase": "step", "silent_s": 1, "timeout_s": 1}
    Path(run.diagnosis, ".claim").write_text(json.dumps(old))
    Path(run.verdict_json).write_text(json.dumps({"attempt": "41.0", "verdict": "old"}))
    clock = Clock()
    kill = Kill({0: (run.node_dir("", "n1"), STALLED)})
    dog, node_dir, _ = make(run, "n1", [0], clock, kill)
    beat(node_dir, 0, 0, clock.t, "setup", stack_signal=USR2)
    tick_at(dog, clock, 1050)
    assert not kill.calls  # the old verdict and claim are not this attempt's
    for t in range(1101, 1110):
        tick_at(dog, clock, t)
    assert claim(run)["attempt"] == "42.0" and claim(run)["node"] == "n1"  # type: ignore[index]
    assert dog.ended and kill.signals(signal.SIGKILL) == [0]
    assert json.loads(Path(run.verdict_json).read_text())["attempt"] == "42.0"


def test_of_two_nodes_finding_one_stale_claim_exactly_one_replaces_it(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    os.makedirs(run.diagnosis)
    stale = json.dumps({"attempt": "41.0", "node": "n9"})
    Path(run.diagnosis, ".claim").write_text(stale)
    a, _, log_a = make(run, "n1", [0], clock)
    b, _, log_b = make(run, "n2", [1], clock)
    # n1 read the stale claim and took the attempt's lock, but has not replaced it yet: n2 keeps off
    os.mkdir(Path(run.diagnosis, ".claim.replace.42.0"))
    b._claim(clock.t, 1, "step", 70, 60)
    assert Path(run.diagnosis, ".claim").read_text() == stale
    os.rmdir(Path(run.diagnosis, ".claim.replace.42.0"))
    a._claim(clock.t, 1, "step", 70, 60)
    b._claim(clock.t, 1, "step", 70, 60)
    assert claim(run)["node"] == "n1"  # type: ignore[index]
    assert any("replaced a stale claim" in line for line in log_a)
    assert not any("claimed" in line for line in log_b)


def test_a_node_that_never_answers_is_named_after_the_wait(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    kill = Kill({0: (run.node_dir("", "n1"), STALLED)})
    dog, node_dir, _ = make(run, "n1", [0], clock, kill, nodes=2)
    # n2's sidecar shared its step times once, then went silent (its node froze)
    os.makedirs(os.path.dirname(run.step_times("n2")))
    Path(run.step_times("n2")).write_text(json.dumps({"node": "n2", "attempt": "42.0", "time": 1000, "ranks": {}}))
    beat(node_dir, 0, 0, clock.t, "setup", stack_signal=USR2)
    tick_at(dog, clock, 1101)
    assert claim(run) is not None
    for t in range(1102, 1130):
        tick_at(dog, clock, t)
    assert not Path(run.verdict_json).exists() and not dog.ended  # still waiting for n2
    tick_at(dog, clock, 1131.5)
    tick_at(dog, clock, 1132)
    assert dog.ended
    verdict = json.loads(Path(run.verdict_json).read_text())
    assert verdict["missing_nodes"] == ["n2"] and "n2 sent no diagnosis within 30 s." in verdict["verdict"]


def test_stragglers_need_three_checks_in_a_row() -> None:
    log = Lines()
    tracker = StragglerTracker(1.5, log)
    slow = [RankTime(0, "n1", 1.0), RankTime(1, "n1", 1.0), RankTime(2, "n2", 2.0)]
    fine = [RankTime(0, "n1", 1.0), RankTime(1, "n1", 1.0), RankTime(2, "n2", 1.1)]
    reports = [tracker.check(times, float(i)) for i, times in enumerate([slow, slow, fine, slow, slow])]
    assert [r[0]["stragglers"] for r in reports] == [[], [], [], [], []]  # a fine check resets the count
    report, scalars = tracker.check(slow, 6.0)
    assert report["stragglers"] == [{"rank": 2, "node": "n2", "busy_s": 2.0, "ratio": 2.0}]
    assert report["median_s"] == 1.0 and report["factor"] == 1.5
    assert scalars == {"straggler/rank0_ratio": 1.0, "straggler/rank1_ratio": 1.0, "straggler/rank2_ratio": 2.0}
    assert log == ["straggler: rank 2 (n2) takes 2 s per step, 2.00x the median 1 s (factor 1.5)"]
    tracker.check(fine, 7.0)
    assert log[-1] == "rank 2 (n2) is no longer a straggler (1.10x the median)"


def test_node_rank_0_compares_every_nodes_busy_times(tmp_path: Path) -> None:
    run, clock = RunDir(str(tmp_path)), Clock()
    scalars: list[dict[str, float]] = []
    a, nd1, log = make(run, "n1", [0, 1], clock, node_rank=0, nodes=2, on_scalars=scalars.append)
    b, nd2, _ = make(run, "n2", [2, 3], clock, node_rank=1, nodes=2)
    for step in range(1, 40):
        clock.t += 1
        for rank, node_dir in ((0, nd1), (1, nd1), (2, nd2), (3, nd2)):
            beat(node_dir, rank, step, clock.t, busy_s=0.9 if rank == 3 else 0.3)
        b.tick()
        a.tick()
    report = json.loads(Path(run.stragglers).read_text())
    assert report["stragglers"] == [{"rank": 3, "node": "n2", "busy_s": 0.9, "ratio": 3.0}]
    assert scalars[-1] == {f"straggler/rank{r}_ratio": 3.0 if r == 3 else 1.0 for r in range(4)}
    assert len(scalars) == 4  # one check every 10 s
    assert [line for line in log if "straggler" in line] == [
        "straggler: rank 3 (n2) takes 0.9 s per step, 3.00x the median 0.3 s (factor 1.5)"
    ]
    assert not Path(run.diagnosis).exists()  # busy ranks that progress are no hang


# --- a real stack dump ---------------------------------------------------------------------------------

FAST = Settings(step_factor=1, step_floor_s=1, setup_timeout_s=1, diagnosis_wait_s=5)
RANK_SCRIPT = """\
import sys, time
from meshrun.launcher.report import Heartbeat

rank = int(sys.argv[1])
heartbeat = Heartbeat(sys.argv[2], rank)
for step in range(1, 4):
    heartbeat.stamp(step)


def stuck_here():
    time.sleep(600)


def all_reduce():
    time.sleep(600)


def global_grad_norm():
    all_reduce()


print("stuck", flush=True)
stuck_here() if rank == 1 else global_grad_norm()
"""


def run_until_ended(dog: wd.Watchdog, procs: list[subprocess.Popen[bytes]], log: Lines) -> None:
    """Tick like the sidecar (every 0.2 s here) until the watchdog ended the ranks; they must die by SIGKILL."""
    try:
        deadline = time.monotonic() + 30
        while not dog.ended and time.monotonic() < deadline:
            dog.tick()
            time.sleep(0.2)
        assert dog.ended, log
        for proc in procs:
            assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_ranks(
    script: Path, run: RunDir, node_dir: NodeDir, extra_env: dict[str, str]
) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, **extra_env, "MESHRUN_RUN_DIR": run.root, "MESHRUN_NODE_DIR": node_dir.root}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), run.root], env=env, stdout=subprocess.PIPE)
        for rank in (0, 1)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == b"stuck\n"
    return procs


def test_real_ranks_are_dumped_diagnosed_and_killed(tmp_path: Path) -> None:
    """Two real processes stamp heartbeats through meshrun.launcher.report.Heartbeat and hang (one in `stuck_here`,
    one in a function named all_reduce); a third pid has a heartbeat without stack_signal. The watchdog with
    the real os.kill gets their faulthandler stacks, names the stalled rank, and kills all three."""
    run = RunDir(str(tmp_path / "run"))
    node_dir = run.node_dir("", "n1")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    calls: list[tuple[int, int]] = []

    def kill(pid: int, sig: int) -> None:
        calls.append((pid, sig))
        os.kill(pid, sig)

    log = Lines()
    dog = wd.Watchdog(run, node_dir, "n1", 0, 1, [0, 1, 2], FAST, "7.0", log, kill=kill)
    unarmed = subprocess.Popen(["sleep", "600"])  # a program that never registered the stack dump
    procs = [*start_ranks(script, run, node_dir, {}), unarmed]
    beat(node_dir, 2, 3, time.time(), pid=unarmed.pid)
    run_until_ended(dog, procs, log)
    pids = {procs[0].pid: 0, procs[1].pid: 1, unarmed.pid: 2}
    assert sorted(pids[pid] for pid, sig in calls if sig == signal.SIGUSR2) == [0, 1]
    assert sorted(pids[pid] for pid, sig in calls if sig == signal.SIGKILL) == [0, 1, 2]
    lines = RANK_SCRIPT.splitlines()
    stuck_line = lines.index("    time.sleep(600)") + 1
    caller_line = lines.index("    all_reduce()") + 1
    text = Path(run.verdict).read_text()
    assert f"Rank 1 (n1, pid {procs[1].pid}) stalled in stuck_here ({script}:{stuck_line}), not in a collective" in text
    assert (
        f"rank 0 (n1, pid {procs[0].pid}) waits in all_reduce (called from {script}:{caller_line} global_grad_norm)"
        in text
    )
    assert f"rank 2 (n1, pid {unarmed.pid}) gave no stack" in text
    assert "stuck_here" in Path(run.node_diagnosis("n1"), "rank-1.stack.txt").read_text()
    assert Path(run.exit_code).read_text() == "76\n"


GLOO_SCRIPT = """\
import sys, time
import torch
import torch.distributed as dist
from meshrun.launcher.report import Heartbeat

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
Heartbeat(sys.argv[2], rank).stamp(1)


def stuck_here():
    time.sleep(600)


def global_grad_norm():
    dist.all_reduce(torch.ones(1))


print("stuck", flush=True)
stuck_here() if rank == 1 else global_grad_norm()
"""


def test_a_real_gloo_all_reduce_is_named_with_its_caller(tmp_path: Path) -> None:
    """Rank 0 blocks in a real torch.distributed all_reduce that rank 1 never joins (it sleeps)."""
    pytest.importorskip("torch")
    run = RunDir(str(tmp_path / "run"))
    node_dir = run.node_dir("", "n1")
    script = tmp_path / "gloo_rank.py"
    script.write_text(GLOO_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Lines()
    dog = wd.Watchdog(run, node_dir, "n1", 0, 1, [0, 1], FAST, "8.0", log)
    procs = start_ranks(script, run, node_dir, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    run_until_ended(dog, procs, log)
    lines = GLOO_SCRIPT.splitlines()
    caller_line = lines.index("    dist.all_reduce(torch.ones(1))") + 1
    verdict = json.loads(Path(run.verdict_json).read_text())
    assert [(r["rank"], r["state"], r["where"]) for r in verdict["ranks"]] == [
        (0, "collective", f"all_reduce (called from {script}:{caller_line} global_grad_norm)"),
        (1, "stalled", f"stuck_here ({script}:{lines.index('    time.sleep(600)') + 1})"),
    ]
    assert "torch/distributed/distributed_c10d.py" in Path(run.node_diagnosis("n1"), "rank-0.stack.txt").read_text()
