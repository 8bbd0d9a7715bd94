"""launcher/contract/procs.py: a pid read from a file is signalled only while it names the process that was recorded,
and only inside the job; the watchdog, the local backend's cancel and the batch script's signals go through
it. Every "victim" here is a real, live process of this same user that the test started itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from meshrun.launcher.contract import procs
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import Watchdog as Settings
from meshrun.launcher.sidecar import watchdog as wd

FAST = Settings(step_factor=2, step_floor_s=1, setup_timeout_s=1, eval_timeout_s=1, checkpoint_timeout_s=1)


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this user that no pid file names: what a reused pid names."""
    proc = subprocess.Popen(["sleep", "600"], env={**os.environ, procs.SLURM_JOB_ENV: "999999"})
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def stale(proc: subprocess.Popen[bytes]) -> procs.Identity:
    """What a pid file of an earlier process holds once `proc` got its pid: the pid, another start time."""
    identity = procs.process_identity(proc.pid)
    assert identity is not None
    return procs.Identity(proc.pid, identity.started_at - 7.25)


def still_running(proc: subprocess.Popen[bytes]) -> bool:
    time.sleep(0.2)  # a signal's default action has had time to act
    return proc.poll() is None


def run_until_ended(dog: wd.Watchdog, lines: list[str]) -> None:
    """Tick the watchdog as its loop would until it has ended its ranks (30 s at most)."""
    deadline = time.monotonic() + 30
    while not dog.ended and time.monotonic() < deadline:
        dog.tick()
        time.sleep(0.2)
    assert dog.ended, lines


def test_identity_is_exact_and_round_trips_through_a_pid_file(tmp_path: Path) -> None:
    me = procs.own_identity()
    assert procs.same_process(me.pid, me.started_at) and procs.alive(me)
    assert procs.process_identity(os.getpid()) == me  # read twice: the very same value (no clock in it)
    path = str(tmp_path / "x.pid")
    procs.write_pid_file(path)
    assert procs.read_pid_file(path) == me
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    Path(path).write_text(str(me.pid))  # a bare pid: cannot be told from a reuse, never signalled
    assert procs.read_pid_file(path) is None
    assert procs.read_pid_file(str(tmp_path / "missing")) is None
    assert procs.Identity.from_json({"pid": True, "started_at": 1.0}) is None
    assert procs.Identity.from_json({"pid": 0, "started_at": 1.0}) is None


def test_a_stale_pid_file_naming_a_live_process_of_this_user_is_never_signalled(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    path = str(tmp_path / "rank.pid")
    procs.write_pid_file(path, stale(bystander))
    recorded = procs.read_pid_file(path)
    assert recorded is not None and recorded.pid == bystander.pid
    assert not procs.same_process(recorded.pid, recorded.started_at) and not procs.alive(recorded)
    assert procs.signal_if_same(recorded, signal.SIGKILL) is False
    assert procs.signal_group_if_same(recorded, signal.SIGKILL) is False
    assert still_running(bystander)


def test_the_recorded_process_is_signalled_only_inside_its_job(bystander: subprocess.Popen[bytes]) -> None:
    identity = procs.process_identity(bystander.pid)
    assert identity is not None
    other_job = procs.JobScope(procs.SLURM_JOB_ENV, "123")
    assert procs.in_job(bystander.pid, procs.JobScope(procs.SLURM_JOB_ENV, "999999"))
    assert procs.signal_if_same(identity, signal.SIGKILL, other_job) is False
    assert still_running(bystander)
    assert procs.signal_if_same(identity, signal.SIGTERM, procs.JobScope(procs.SLURM_JOB_ENV, "999999"))
    assert bystander.wait(timeout=10) == -signal.SIGTERM
    assert procs.signal_if_same(identity, signal.SIGTERM) is False  # gone (reaped): nothing to signal


def test_current_job_prefers_slurm_then_the_local_job_id() -> None:
    assert procs.current_job({"SLURM_JOB_ID": "7", "MESHRUN_JOB_ID": "local-x"}) == procs.JobScope("SLURM_JOB_ID", "7")
    assert procs.current_job({"MESHRUN_JOB_ID": "local-x"}) == procs.JobScope("MESHRUN_JOB_ID", "local-x")
    assert procs.current_job({}) is None


def test_a_group_is_signalled_while_its_leader_is_the_recorded_one() -> None:
    leader = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    try:
        identity = procs.process_identity(leader.pid)
        assert identity is not None
        assert procs.signal_group_if_same(stale(leader), signal.SIGKILL) is False
        assert still_running(leader)
        assert procs.signal_group_if_same(identity, signal.SIGKILL)
        assert leader.wait(timeout=10) == -signal.SIGKILL
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()


def beat_of(run: RunDir, node: str, rank: int, data: dict[str, object]) -> None:
    path = Path(run.node_dir("", node).progress(rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_watchdog_never_signals_a_heartbeat_pid_that_now_names_another_process(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    """A requeued job's new attempt: a heartbeat (here a fresh one, the worst case) still names a pid that a
    live process of this user got since. The hang it sees is diagnosed and the verdict written, but with the
    real signals (no stand-in) nothing is sent to that process: neither the stack signal nor SIGKILL."""
    run = RunDir(str(tmp_path / "run"))
    old = stale(bystander)
    lines: list[str] = []
    now = time.time()
    beat_of(run, "n1", 0, {"rank": 0, "step": 3, "phase": "step", "time": now, **old.to_json(), "stack_signal": 12})
    dog = wd.Watchdog(run, run.node_dir("", "n1"), "n1", 0, 1, [0], FAST, "5.1", lines.append)
    run_until_ended(dog, lines)
    assert any("killed ranks none (already gone)" in line for line in lines), lines
    assert any("asked ranks none for their stacks" in line for line in lines), lines
    assert still_running(bystander)


def test_the_watchdog_kills_its_own_hung_rank(tmp_path: Path) -> None:
    """The same path with a heartbeat the rank itself wrote (meshrun.launcher.report.Heartbeat): it is killed."""
    run = RunDir(str(tmp_path / "run"))
    script = "import sys, time\nfrom meshrun.launcher.report import Heartbeat\nHeartbeat(sys.argv[1], 0).stamp(1)\n"
    script += "print('stamped', flush=True)\ntime.sleep(600)\n"
    env = {**os.environ, "MESHRUN_NODE_DIR": run.node_dir("", "n1").root}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    rank = subprocess.Popen([sys.executable, "-c", script, run.root], env=env, stdout=subprocess.PIPE)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"stamped\n"
        beat = json.loads(Path(run.node_dir("", "n1").progress(0)).read_text())
        assert procs.Identity.from_json(beat) == procs.process_identity(rank.pid)
        lines: list[str] = []
        dog = wd.Watchdog(run, run.node_dir("", "n1"), "n1", 0, 1, [0], FAST, "5.2", lines.append)
        run_until_ended(dog, lines)
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert any(f"killed ranks 0 (pid {rank.pid})" in line for line in lines), lines
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_a_local_cancel_never_signals_the_group_a_stale_state_file_names(tmp_path: Path) -> None:
    """`meshrun cancel` of a local job whose state file's supervisor pid (and process group) is now another
    session leader of this user: with the start time recorded, or without (an older state file) where the
    group does not carry the job's id, nothing is signalled."""
    from meshrun.launcher.contract.records.rundir import local_state_path, merge_state
    from meshrun.submit.schedulers import local
    from tests.helpers import builders

    victim = subprocess.Popen(["sleep", "600"], start_new_session=True)  # leads its own group, as a supervisor
    try:
        now = procs.process_identity(victim.pid)
        assert now is not None
        path = local_state_path(str(tmp_path), "local-a")
        merge_state(path, state="RUNNING", job_id="local-a", supervisor_pid=victim.pid, pgid=victim.pid)
        merge_state(path, supervisor_started_at=now.started_at - 3.0)
        assert local.current_state(str(tmp_path), "local-a")["state"] != "RUNNING"  # its supervisor is gone
        merge_state(path, state="RUNNING", supervisor_started_at=None)  # an older state file: no start time
        local._cancel(
            builders.record("local-a", cluster="local", run_dir=tmp_path, scheduler="local", submitted_at=time.time())
        )
        assert still_running(victim)
        record = builders.record(
            str(victim.pid), cluster="local", run_dir=tmp_path, scheduler="local", submitted_at=time.time()
        )  # a submitit-API job id is its controller's pid
        local._cancel_submitit_job(record)
        assert still_running(victim)
    finally:
        victim.kill()
        victim.wait()


def test_the_batch_script_signals_srun_and_the_sidecar_only_while_this_shell_has_not_reaped_them() -> None:
    """Once bash has reaped a background job its pid may name another process (the issue's silent slurmd
    deaths: slurmd has no USR1 handler, and a pid number may even be one of its threads). Every signal the
    rendered batch script sends to srun or the sidecar goes through `running`, which is false for a reaped
    child and true for a running one."""
    script = (Path(__file__).resolve().parents[1] / "golden" / "testbed__two-node.txt").read_text()
    kills = [line for line in script.splitlines() if re.search(r"\bkill -\w+ \"\$\w+_pid\"", line)]
    assert kills and all(re.search(r'running "\$(\w+_pid)" && kill -\w+ "\$\1"', line) for line in kills), kills
    assert 'kill -0 "$' not in script
    running = next(line for line in script.splitlines() if line.startswith("running() {"))
    probe = f'set -uo pipefail\n{running}\nsleep 0.1 & a=$!\nsleep 30 & b=$!\nwait "$a"\n'
    probe += 'running "$a" && echo a-running || echo a-reaped\nrunning "$b" && echo b-running\nkill "$b"\n'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=20)
    assert out.stdout.split() == ["a-reaped", "b-running"], out


def test_catches_tells_a_program_with_its_own_handler_from_one_the_signal_would_kill() -> None:
    handler = (
        "import signal, time; signal.signal(signal.SIGUSR1, lambda *_: None); print('set', flush=True); time.sleep(30)"
    )
    plain = "import time; print('set', flush=True); time.sleep(30)"
    started = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for code in (handler, plain)]
    try:
        for child in started:
            assert child.stdout is not None and child.stdout.readline() == b"set\n"
        with_handler, without = started
        assert procs.catches(with_handler.pid, signal.SIGUSR1)
        assert not procs.catches(with_handler.pid, signal.SIGUSR2)
        assert not procs.catches(without.pid, signal.SIGUSR1)
    finally:
        for child in started:
            child.kill()
            child.wait()
    assert not procs.catches(started[0].pid, signal.SIGUSR1)  # gone: nothing to signal


REPO = Path(__file__).resolve().parents[2]
PROC_PATH = re.compile(r"""/proc/(?:\{[^}]*\}|%[sd]|self|thread-self|\d+)/|/proc/["']\s*\+""")
"""A path under /proc/<pid>/ (or /proc/self/, /proc/thread-self/) built in code: an f-string or %-format with a
pid in it, or "/proc/" + something."""
OWN_PROC_READS = {
    "launcher/contract/procs.py": "the one module: own_identity reads /proc/PID/stat alone (a command job's own "
    "Python may have only the standard library), and catches reads SigCgt, which psutil does not give",
    "launcher/train/worktime.py": "/proc/thread-self/schedstat, a thread's run and wait time: psutil has no schedstat",
    "submit/views/tbserve.py": "a standalone script (stdlib + tensorboard only), copied to the login node and run "
    "in the cluster's environment: it cannot import meshrun or psutil",
}


def _zombie() -> subprocess.Popen[bytes]:
    """A child that has ended but is not yet reaped (the caller waits for it)."""
    child = subprocess.Popen(["sleep", "600"])
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended: a zombie until child.wait() reaps it
    return child


def test_the_guard_itself_sees_a_hand_read_of_proc() -> None:
    assert PROC_PATH.search('Path(f"/proc/{pid}/cmdline").read_bytes()')
    assert PROC_PATH.search('open(f"/proc/{self.pid}/stat")')
    assert PROC_PATH.search('open("/proc/%d/status" % pid)')
    assert PROC_PATH.search('open("/proc/self/status")')
    assert PROC_PATH.search('open("/proc/" + str(pid) + "/stat")')
    assert not PROC_PATH.search('open("/proc/meminfo")')
    assert not PROC_PATH.search('Path(f"{proc}/diskstats")')


def test_only_procs_reads_a_process_from_proc_by_hand() -> None:
    """Process identity and state are read in one module (procs, on psutil); the exceptions say why."""
    found = sorted(
        str(path.relative_to(REPO))
        for folder in ("submit", "launcher")
        for path in (REPO / folder).rglob("*.py")
        if PROC_PATH.search(path.read_text(encoding="utf-8"))
    )
    assert found == sorted(OWN_PROC_READS), found


def test_state_names_a_running_an_ended_and_a_gone_process() -> None:
    import psutil

    assert procs.ENDED == (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    assert procs.state(os.getpid()) == psutil.STATUS_RUNNING
    child = _zombie()
    try:
        assert procs.state(child.pid) == psutil.STATUS_ZOMBIE
    finally:
        child.wait()
    assert procs.state(child.pid) is None
    assert procs.state(0) is None and procs.state(-1) is None


def test_a_zombie_or_a_gone_process_is_not_alive_to_the_sidecar_nor_the_local_backend(
    bystander: subprocess.Popen[bytes],
) -> None:
    from meshrun.launcher.sidecar.loop import process_alive
    from meshrun.submit.schedulers import local

    assert process_alive(bystander.pid) and local._alive(bystander.pid)
    child = _zombie()
    try:
        assert not process_alive(child.pid) and not local._alive(child.pid)
    finally:
        child.wait()
    assert not process_alive(child.pid) and not local._alive(child.pid)
    assert not process_alive(0) and not local._alive(0) and not local._alive(-1)
    assert not process_alive("12") and not process_alive(None)


def test_a_keeperless_sidecar_is_found_by_its_argv_and_only_it_is_signalled(
    monkeypatch: pytest.MonkeyPatch, bystander: subprocess.Popen[bytes]
) -> None:
    from meshrun.launcher.local import supervisor

    code = "import time; time.sleep(60)"
    sidecar = subprocess.Popen([sys.executable, "-c", code, "meshrun.launcher.sidecar"])
    named = subprocess.Popen([sys.executable, "-c", code, "--not=meshrun.launcher.sidecar"])
    started = (sidecar, named, bystander)
    monkeypatch.setattr(supervisor, "_group_members", lambda: [p.pid for p in started if p.poll() is None])
    try:
        supervisor._stop_keeperless_sidecar(20)
        assert sidecar.wait(timeout=5) == -signal.SIGUSR2
        assert named.poll() is None and bystander.poll() is None
    finally:
        named.kill()
        named.wait()
