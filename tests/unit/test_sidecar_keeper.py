"""A dead sidecar and lost checkpoints: the keeper starts a killed sidecar again and
tells it what its predecessor was told; a sidecar whose parent is gone carries on while its ranks run;
steps saved beyond the newest complete checkpoint are lost, raise an alert, and end a "finished" run as a
failure; status's CKPT counts only what is complete on shared storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.batch import requeue
from meshrun.launcher.contract.records import ckptdir, lost
from meshrun.launcher.contract.records.alerts import read as read_alerts
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import JobSpec, Resources, RunInfo, RunSpec, write_run_spec
from meshrun.launcher.sidecar import keeper
from meshrun.submit.core.status import parse_metrics_tail

# A stand-in sidecar: records its pid; the first one ignores USR2 (so only a restart can end the keeper);
# a later one exits 0 at once when its keeper says it was told USR2 before it started.
CHILD = """
import os, signal, sys, time
path = sys.argv[1]
first = not os.path.exists(path)
with open(path, "a") as f:
    f.write(f"{os.getpid()}|{os.environ.get('MESHRUN_SIDECAR_TOLD', '')}|{os.environ.get('MESHRUN_SIDECAR_SINCE')}\\n")
if not first and "SIGUSR2" in os.environ.get("MESHRUN_SIDECAR_TOLD", ""):
    sys.exit(0)
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


def _lines(path: Path, count: int, timeout: float = 20) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = [line.split("|") for line in path.read_text().splitlines()] if path.exists() else []
        if len(rows) >= count:
            return rows
        assert time.monotonic() < deadline, f"{len(rows)} of {count} children started"
        time.sleep(0.05)


def _keeper_whose_first_sidecar_misses_usr2_and_dies(
    child: str, pids: Path
) -> tuple[keeper.Keeper, list[str], list[int], threading.Thread]:
    """A keeper of the stand-in sidecar `child` (which records its pid in `pids`), run in a thread: once its first
    sidecar is up, the ranks end (USR2, which that sidecar ignores: it is "busy") and the sidecar is killed -9."""
    log: list[str] = []
    kept = keeper.Keeper([sys.executable, "-c", child, str(pids)], log.append, env=dict(os.environ))
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(kept.run()))
    thread.start()
    first = _lines(pids, 1)[0]
    kept.on_signal(signal.SIGUSR2, None)
    os.kill(int(first[0]), signal.SIGKILL)
    return kept, log, result, thread


def test_the_keeper_starts_a_killed_sidecar_again_and_tells_it_what_it_was_told(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    kept, log, result, thread = _keeper_whose_first_sidecar_misses_usr2_and_dies(CHILD, pids)
    try:
        thread.join(timeout=20)
        assert not thread.is_alive() and result == [0]
    finally:
        if thread.is_alive():
            os.kill(int(_lines(pids, 1)[-1][0]), signal.SIGKILL)
    rows = _lines(pids, 2)
    assert len(rows) == 2 and rows[1][1] == "SIGUSR2"  # the new one learnt of the USR2 from its environment
    assert rows[0][2] == rows[1][2]  # one attempt start for both: the ranks' beats stay this attempt's
    assert any("ended (killed by SIGKILL) while the job runs: starting it again" in line for line in log), log
    assert "restart 1 of at most" in log[0]


# A stand-in sidecar as the real one behaves: it stops at once when told USR2 before it started, or on USR2.
STOPPING_CHILD = """
import os, signal, sys, time
if "SIGUSR2" in os.environ.get("MESHRUN_SIDECAR_TOLD", ""):
    sys.exit(0)
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})  # as the real one: its keeper started it blocked
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
while True:
    time.sleep(0.05)
"""


def test_a_stop_signal_that_comes_while_the_sidecar_is_being_started_still_reaches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks of a short job can end while the keeper is inside Popen: the USR2 then finds no child to pass
    on to and is not in the child's environment; the keeper passes it on once the child exists."""
    pids = tmp_path / "pids"
    kept = keeper.Keeper([sys.executable, "-c", STOPPING_CHILD, str(pids)], [].append, env=dict(os.environ))
    real_popen = keeper.subprocess.Popen

    def popen_interrupted_by_usr2(*args: Any, **kwargs: Any) -> Any:
        kept.on_signal(signal.SIGUSR2, None)  # arrives after the child's environment was made
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(keeper.subprocess, "Popen", popen_interrupted_by_usr2)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(kept.run()))
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():  # the bug: the sidecar runs on; end it so that the test ends
        for pid in _lines(pids, 1):
            os.kill(int(pid[0]), signal.SIGKILL)
        thread.join(timeout=20)
        pytest.fail("the sidecar never learnt of the USR2 that came while it was being started")
    assert result == [0]


# A stand-in sidecar: the first misses every USR2 (as if srun had dropped them) and is then killed; the next,
# told USR2 through its environment, takes a second to start before it sets its handler, as the real one does
# (launcher/sidecar/__main__.py): a USR2 that reached it while it started with USR2's default action ended it.
SLOW_STARTING_CHILD = """
import os, signal, sys, time
told = os.environ.get("MESHRUN_SIDECAR_TOLD", "")
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}|{told}\\n")
if "SIGUSR2" not in told:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    while True:
        time.sleep(0.05)
time.sleep(1.0)
signal.signal(signal.SIGUSR2, lambda *_: None)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # done, as the sidecar does (keeper.block_stop_signals)
sys.exit(0)
"""


def test_a_usr2_that_reaches_a_starting_sidecar_waits_for_its_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch script says USR2 every second until the sidecars stop (srun may drop one), and Slurm signals
    every process of the step, the keeper's child too: a sidecar starts with the stop signals blocked until its
    handlers are set, else each repeat could end the next sidecar as it starts, and it would never finish its
    last copies."""
    monkeypatch.setattr(keeper, "BACKOFF_S", (0.0,))
    pids = tmp_path / "pids"
    kept, log, result, thread = _keeper_whose_first_sidecar_misses_usr2_and_dies(SLOW_STARTING_CHILD, pids)
    try:
        second = int(_lines(pids, 2)[1][0])
        deadline = time.monotonic() + 20
        while thread.is_alive() and time.monotonic() < deadline:
            kept.on_signal(signal.SIGUSR2, None)  # the batch script's repeats, passed on by the keeper ...
            try:
                os.kill(second, signal.SIGUSR2)  # ... and from Slurm, straight to the sidecar
            except ProcessLookupError:
                pass
            time.sleep(0.1)
    finally:
        for row in _lines(pids, 1):
            try:
                os.kill(int(row[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        thread.join(timeout=20)
    assert result == [0]
    assert len(_lines(pids, 2)) == 2 and not any("SIGUSR2" in line for line in log), log


def test_a_sidecar_and_its_keeper_told_usr2_again_and_again_to_their_last_instant_exit_cleanly(tmp_path: Path) -> None:
    """The real keeper and sidecar, every process of their group sent USR2 every 5 ms (the batch script's repeats,
    passed on by Slurm to each process of the step) from the sidecar's start to the keeper's exit. Python resets
    its signal handlers to the default action as it shuts down, and USR2's is death: without the stop signals
    blocked once they are done, a sidecar that had stopped cleanly died "killed by SIGUSR2" in its last instant and
    its keeper started it again, every run."""
    job = JobSpec(name="t", resources=Resources(tasks_per_node=1), command=("true",))
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="local", scheduler="local", run_dir=str(tmp_path))), tmp_path)
    env = {**os.environ, "SLURMD_NODENAME": "n1", "CUDA_VISIBLE_DEVICES": ""}
    sidecar_log = Path(RunDir(str(tmp_path)).sidecar_log("n1"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun.launcher.sidecar", str(tmp_path)], env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while not (sidecar_log.exists() and "started" in sidecar_log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the sidecar did not start"
            time.sleep(0.01)
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, signal.SIGUSR2)
            except ProcessLookupError:
                break
            time.sleep(0.005)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = sidecar_log.read_text()
    assert "SIGUSR2" not in log and log.count("started (pid") == 1 and log.rstrip().endswith("stopped"), log


def test_a_sidecar_that_keeps_dying_is_restarted_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keeper, "MAX_RESTARTS", 2)
    monkeypatch.setattr(keeper, "BACKOFF_S", (0.0,))
    log: list[str] = []
    assert keeper.Keeper([sys.executable, "-c", "raise SystemExit(3)"], log.append, env=dict(os.environ)).run() == 0
    assert len(log) == 3 and "exit 3" in log[0] and log[-1].endswith("3 times: not restarted again")


def test_a_sidecar_whose_parent_is_gone_carries_on_while_its_ranks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshrun.launcher.sidecar import __main__ as sidecar_main

    class Ranks:
        alive = True

        def ranks_alive(self) -> bool:
            return self.alive

    ranks, stop, log = Ranks(), threading.Event(), []
    waiting = sidecar_main.EndWait(ranks, threading.Event(), stop, log.append)
    monkeypatch.setattr(sidecar_main.os, "getppid", lambda: waiting.parent + 1)  # the keeper was killed
    for _ in range(3):
        waiting.check()
    assert not stop.is_set() and "is gone: carrying on while this node's ranks run" in log[0]
    ranks.alive = False
    waiting.check()
    assert stop.is_set()


def _events(*rows: dict[str, Any]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_saved_steps_follow_the_job_back_when_it_resumes_from_an_older_checkpoint() -> None:
    text = _events(
        {"step": 4, "loss": 1.0},
        {"event": "checkpoint", "checkpoint_step": 5, "staged": True},
        {"event": "checkpoint", "checkpoint_step": 5, "copied": True},  # the sidecar's commit: not a save
        {"event": "checkpoint", "checkpoint_step": 10, "staged": True},
        {"event": "checkpoint", "checkpoint_step": 15, "staged": True},
        {"event": "checkpoint", "checkpoint_step": 10, "staged": True},  # resumed from 5: 10 again, 15 gone
    )
    assert lost.saved_steps(text + '{"event": "checkpoint", "checkpoint_st') == [5, 10]


def _run_dir(tmp_path: Path, saved: list[int], complete: list[int]) -> RunDir:
    job = JobSpec(name="t", resources=Resources(tasks_per_node=1))
    tmp_path.mkdir(exist_ok=True)
    write_run_spec(RunSpec(job=job, run=RunInfo(cluster="local", scheduler="local", run_dir=str(tmp_path))), tmp_path)
    run_dir = RunDir(str(tmp_path))
    events = [{"event": "checkpoint", "checkpoint_step": s, "staged": True} for s in saved]
    Path(run_dir.metrics).write_text(_events(*events))
    for step in complete:
        folder = ckptdir.step_dir(Path(run_dir.default_checkpoints), step)
        folder.mkdir(parents=True)
        (folder / ckptdir.MARKER).write_text(json.dumps({"step": step}))
    return run_dir


def test_steps_beyond_the_newest_complete_checkpoint_are_lost_with_an_alert(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, saved=[5, 10, 15, 20], complete=[5, 10])
    line = lost.check(run_dir.root)
    assert line is not None and "checkpoint steps 15, 20 never reached shared storage" in line
    assert "the newest complete checkpoint is step 10, which `meshrun resume` and `export` use" in line
    (alert,) = read_alerts(run_dir.alerts)
    assert alert["rule"] == "checkpoint_lost" and alert["step"] == 20 and alert["value"] == 2
    assert lost.check(_run_dir(tmp_path / "ok", saved=[5, 10], complete=[5, 10]).root) is None


def test_a_finished_run_with_lost_steps_is_a_failure_and_is_requeued(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _run_dir(tmp_path, saved=[5, 10, 15], complete=[5])
    assert requeue.main([run_dir.root, "0", "0", "3"]) == 0
    decision = capsys.readouterr().out
    assert decision.startswith("requeue 1 requeueing: restart 1 of at most 3"), decision
    assert "checkpoint steps 10, 15 never reached shared storage" in Path(run_dir.rank_error).read_text()
    assert requeue.main([run_dir.root, "0", "3", "3"]) == 0  # no restart left: it ends failed, never 0
    assert capsys.readouterr().out.startswith("stop 1 requeue limit (checkpoint.max_requeues=3) reached")


def test_status_ckpt_counts_only_checkpoints_complete_on_shared_storage() -> None:
    staged = {"event": "checkpoint", "checkpoint_step": 10, "staged": True}
    copied = {"event": "checkpoint", "checkpoint_step": 5, "copied": True}
    assert parse_metrics_tail(_events(copied, staged, {"step": 11, "loss": 2.0}))["checkpoint_step"] == 5
    assert "checkpoint_step" not in parse_metrics_tail(_events(staged, {"step": 11, "loss": 2.0}))
    direct = {"event": "checkpoint", "checkpoint_step": 10}  # saved straight to shared storage
    assert parse_metrics_tail(_events(copied, direct))["checkpoint_step"] == 10


def test_node_0_stops_waiting_for_the_parts_of_a_node_whose_sidecar_is_gone(tmp_path: Path) -> None:
    """A node whose sidecar stopped (or died: its stamp went stale) will send no more parts: node 0 does not
    hold the job's nodes for sidecar.final_copy_s waiting for them."""
    from meshrun.launcher.sidecar import copier
    from tests.unit.test_copier import ATTEMPT, stage

    a, shared = tmp_path / "a", tmp_path / "shared"
    stage(a, 10, 0, {".metadata": b"m10"})  # node 1 never copies its part of step 10
    logs: list[str] = []
    zero = copier.Copier(str(a), str(shared), "n0", 0, 2, ATTEMPT, 3, 0, logs.append)
    polls: list[int] = []
    began = time.monotonic()
    assert zero.drain(began + 60, gone=lambda: {1}, on_poll=lambda: polls.append(1)) == [10]
    assert time.monotonic() - began < 20 and polls  # not the 60 s: as soon as its own part was copied
    assert "node rank(s) 1 stopped copying: not waiting for their parts" in logs
    assert (
        logs[-1]
        == "step 10 exists only on node-local scratch and is lost; resume starts from step 0 (no complete checkpoint)"
    )
    assert (copier.done_file(shared, 10, 0)).is_file()  # its own part made it
    # While node 1 is not gone, node 0 waits (here: until its deadline).
    stage(a, 20, 0, {".metadata": b"m20"})
    began = time.monotonic()
    assert zero.drain(began + 3, gone=set) == [10, 20] and time.monotonic() - began >= 3


def _job_process(job_id: str) -> int:
    """A process of job `job_id` that is not this test's descendant (as a rank is not its sidecar's): a
    `sleep` started by a shell that exits at once, so the sleep is re-parented away from us."""
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
        env=dict(os.environ, MESHRUN_JOB_ID=job_id),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


def _ranks_and_wait(monkeypatch: pytest.MonkeyPatch, job_id: str) -> tuple[Any, Any, Any, Any, list[str]]:
    from meshrun.launcher.sidecar import __main__ as sidecar_main

    class Ranks:
        alive = False

        def ranks_alive(self) -> bool:
            return self.alive

    ranks, ending, stop, log = Ranks(), threading.Event(), threading.Event(), []
    monkeypatch.setenv("MESHRUN_JOB_ID", job_id)  # a job's sidecar: its parent says when the ranks end
    waiting = sidecar_main.EndWait(ranks, ending, stop, log.append)
    return ranks, ending, stop, waiting, log


def test_a_sidecar_told_the_job_is_ending_waits_for_ranks_that_have_not_started_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel in the ranks' first second: no rank of this attempt beat yet, but their processes run. The
    sidecar waits for them to start, save and end (their checkpoint is staged on scratch for it to copy),
    not only for them to end."""
    job_id = f"local-{os.getpid()}-starting"
    ranks, ending, stop, waiting, log = _ranks_and_wait(monkeypatch, job_id)
    starting = _job_process(job_id)
    try:
        ending.set()  # the TERM, before any heartbeat
        for _ in range(3):
            waiting.check()
        assert not stop.is_set(), "stopped before the ranks had even started"
        ranks.alive = True  # they start, and save
        waiting.check()
        assert not stop.is_set()
        ranks.alive = False  # and end
        waiting.check()
        assert stop.is_set() and "waiting for this node's ranks to end" in log[0]
    finally:
        os.kill(starting, signal.SIGKILL)


def test_a_sidecar_whose_ranks_never_beat_stops_once_no_process_of_the_job_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command job that never calls report() writes no heartbeat: the job's processes say when its ranks
    have ended (with the local supervisor killed, nobody else would tell it: it waited 120 s)."""
    job_id = f"local-{os.getpid()}-silent"
    ranks, ending, stop, waiting, log = _ranks_and_wait(monkeypatch, job_id)
    rank = _job_process(job_id)
    ending.set()
    waiting.check()
    assert not stop.is_set(), "stopped while a process of the job still ran"
    os.kill(rank, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not stop.is_set():
        assert time.monotonic() < deadline, "never stopped after the job's last process ended"
        time.sleep(0.1)
        waiting.check()
