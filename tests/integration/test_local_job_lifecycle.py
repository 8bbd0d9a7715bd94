"""A job's life on the `local` cluster, through the real CLI with real processes: one failing rank stops its
peers, a TERM-trapping program cancels as CANCELLED (at once after submit too), a killed supervisor leaves no
second writer, each job id keeps its own outcome and its own log lines, resume without a run dir says so,
Ctrl-C while waiting leaves the job running. The items are what a new user hit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from meshrun.launcher.contract.procs import group_members
from tests.helpers.cli import REPO, env_for, meshrun, status, submitted


def _command_spec(tmp_path: Path, name: str, script: str, tasks: int = 2) -> Path:
    """A `command:` job (no torch: starts in a second) running `script` with bash on every rank."""
    spec = {
        "name": name,
        "resources": {"nodes": 1, "tasks_per_node": tasks, "time": "00:10:00"},
        "command": ["bash", "-c", script],
        "env": {"OMP_NUM_THREADS": "1"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _wait_state(home: Path, job_id: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (row := status(home, job_id))["state"] not in states:
        assert time.monotonic() < deadline, f"{job_id} stayed {row['state']} ({row.get('reason')})"
        time.sleep(0.3)
    return row


def _wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_one_failing_rank_stops_the_others(tmp_path: Path) -> None:
    """Item 9: as Slurm's --kill-on-bad-exit does, not after the peers' full time."""
    spec = _command_spec(tmp_path, "one-fails", 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 300')
    started = time.monotonic()
    out = meshrun(tmp_path, "submit", str(spec), "-c", "local", "--wait", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - started < 60
    job_id, run_dir = submitted(out)
    assert status(tmp_path, job_id)["state"] == "FAILED"
    # Nothing of the job outlives it: not rank 0's `sleep`, a child of the rank process.
    pgid = yaml.safe_load((run_dir / ".meshrun" / "jobs" / f"{job_id}.json").read_text())["pgid"]
    assert group_members(pgid) == []


def _rank_process(run_dir: Path, job_id: str, rank: int) -> int:
    """The pid of rank `rank`'s own process: the child of the job's submitit controller that carries its rank."""
    import psutil

    state = yaml.safe_load((run_dir / ".meshrun" / "jobs" / f"{job_id}.json").read_text())
    for child in psutil.Process(state["controller_pid"]).children():
        if child.environ().get("SUBMITIT_LOCAL_GLOBALID") == str(rank):
            return int(child.pid)
    raise AssertionError(f"no process of rank {rank} under the controller {state['controller_pid']}")


def test_a_rank_killed_by_a_signal_is_named_and_stops_its_peers(tmp_path: Path) -> None:
    """Item 13: kill -9 of rank 1 leaves no result and no last word, and its peers' errors were all the reason
    said (or, with peers that wait, the job held on for their full time). Its controller saw it die: named,
    first, and the job ends at once."""
    spec = _command_spec(tmp_path, "killed-rank", 'touch "$MESHRUN_RUN_DIR/up-$RANK"; sleep 300')
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "local", check=True))
    _wait_file(run_dir / "up-1")
    _wait_file(run_dir / "up-0")
    os.kill(_rank_process(run_dir, job_id, 1), signal.SIGKILL)
    row = _wait_state(tmp_path, job_id, ("FAILED", "COMPLETED", "CANCELLED"), timeout=40)
    assert row["state"] == "FAILED", row
    assert row["reason"].startswith("rank 1 was killed by SIGKILL (kill -9, or the kernel's out-of-memory"), row


def test_a_rank_whose_program_was_killed_says_so(tmp_path: Path) -> None:
    """A command job's rank reports its program's death by signal as 128 + N, as a shell does: said in words."""
    spec = _command_spec(tmp_path, "killed-program", 'if [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 300')
    out = meshrun(tmp_path, "submit", str(spec), "-c", "local", "--wait", timeout=120)
    job_id, _ = submitted(out)
    row = status(tmp_path, job_id)
    assert row["state"] == "FAILED" and "rank 1 exited with code 137 (its program was killed by SIGKILL" in (
        row["reason"] or ""
    ), row


def test_cancelling_a_program_that_traps_term_ends_cancelled(tmp_path: Path) -> None:
    """Item 10: exit 143 from the user's own TERM trap is still a cancel."""
    spec = _command_spec(
        tmp_path, "traps-term", 'trap "exit 143" TERM; touch "$MESHRUN_RUN_DIR/up-$RANK"; while :; do sleep 0.2; done'
    )
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "local", check=True))
    _wait_file(run_dir / "up-1")
    meshrun(tmp_path, "cancel", job_id, check=True)
    assert _wait_state(tmp_path, job_id, ("CANCELLED", "FAILED"))["state"] == "CANCELLED"
    # The program decides what the TERM means; the rank process that waits for it says nothing about it.
    logs = [(run_dir / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)]
    assert not any("Bypassing signal" in log for log in logs), logs


def test_cancel_right_after_submit_is_prompt_and_clean(tmp_path: Path) -> None:
    """Item 28: no 15 s of RUNNING, no submitit log line as the reason."""
    spec = _command_spec(tmp_path, "early-cancel", "sleep 300")
    job_id, _ = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "local", check=True))
    meshrun(tmp_path, "cancel", job_id, check=True)
    row = _wait_state(tmp_path, job_id, ("CANCELLED", "FAILED", "COMPLETED"), timeout=20)
    assert row["state"] == "CANCELLED", row
    assert "log" not in (row["reason"] or "") and "without a result" not in (row["reason"] or ""), row


def _pids_of(run_dir: Path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(run_dir) in cmdline and state != "Z":
                found.append(int(entry))
    return found


def test_a_killed_supervisor_leaves_no_second_writer(tmp_path: Path) -> None:
    """Item 8: its ranks run on; status says so, resume refuses, cancel stops them."""
    spec = _command_spec(tmp_path, "orphans", 'touch "$MESHRUN_RUN_DIR/up-$RANK"; sleep 300')
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "local", check=True))
    # Both programs running, so both ranks wait for them: a rank still starting when the cancel comes has only
    # submitit's handler, which lets the TERM through ("Bypassing signal"), and no supervisor signals it again.
    _wait_file(run_dir / "up-0")
    _wait_file(run_dir / "up-1")
    state = yaml.safe_load((run_dir / ".meshrun" / "jobs" / f"{job_id}.json").read_text())
    os.kill(state["supervisor_pid"], signal.SIGKILL)
    row = _wait_state(tmp_path, job_id, ("RUNNING",))
    deadline = time.monotonic() + 10
    while "orphaned" not in (row["reason"] or ""):
        assert time.monotonic() < deadline, row
        row = status(tmp_path, job_id)
    resumed = meshrun(tmp_path, "resume", job_id)
    assert resumed.returncode != 0 and "still RUNNING" in resumed.stderr, resumed.stderr
    meshrun(tmp_path, "cancel", job_id, check=True)
    assert _wait_state(tmp_path, job_id, ("CANCELLED", "FAILED"))["state"] == "CANCELLED"
    # The program decides what the TERM means; the rank process that waits for it says nothing about it.
    logs = [(run_dir / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)]
    assert not any("Bypassing signal" in log for log in logs), logs
    deadline = time.monotonic() + 20
    while _pids_of(run_dir):
        assert time.monotonic() < deadline, "the orphaned ranks survived the cancel"
        time.sleep(0.3)


def test_each_job_id_keeps_its_outcome_and_its_log(tmp_path: Path) -> None:
    """Items 6, 7, 27 and 26: a resumed run logs where `logs NEWJOB` looks, the cancelled id stays
    CANCELLED, a completed job is not resumed, an ended one is not cancelled."""
    spec = _command_spec(
        tmp_path,
        "resumable",
        'if [ -f "$MESHRUN_RUN_DIR/go" ]; then echo "second run"; exit 0; '
        'fi; touch "$MESHRUN_RUN_DIR/up-$RANK"; sleep 300',
    )
    first, run_dir = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "local", check=True))
    _wait_file(run_dir / "up-1")
    meshrun(tmp_path, "cancel", first, check=True)
    _wait_state(tmp_path, first, ("CANCELLED",))
    (run_dir / "go").touch()
    out = meshrun(tmp_path, "resume", first, "--wait", check=True)
    second = out.stdout.split(" as job ")[1].split()[0]
    assert status(tmp_path, first)["state"] == "CANCELLED" and status(tmp_path, second)["state"] == "COMPLETED"
    log = meshrun(tmp_path, "logs", second, check=True).stdout
    assert f"local job {second} rank 0" in log and "second run" in log
    again = meshrun(tmp_path, "resume", second)
    assert again.returncode == 2 and "completed" in again.stderr
    ended = meshrun(tmp_path, "cancel", second)
    assert ended.returncode == 1 and "already ended (COMPLETED)" in ended.stderr


def test_every_verb_says_the_run_dir_is_gone_and_status_keeps_the_end(tmp_path: Path) -> None:
    spec = _command_spec(tmp_path, "gone", "exit 5", tasks=1)
    out = meshrun(tmp_path, "submit", str(spec), "-c", "local", "--wait")
    job_id, run_dir = submitted(out)
    assert status(tmp_path, job_id)["state"] == "FAILED"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    for verb in (("resume", job_id), ("export", job_id, "-o", str(tmp_path / "out")), ("logs", job_id)):
        said = meshrun(tmp_path, *verb)
        assert said.returncode == 1 and "is gone" in said.stderr and said.stderr.count("\n") == 1, (verb, said)
        assert "nothing to resume" not in said.stderr and not said.stdout
    kept = status(tmp_path, job_id)
    assert kept["state"] == "FAILED" and "is gone" in kept["reason"], kept


def test_ctrl_c_while_waiting_leaves_the_job_running_and_says_so(tmp_path: Path) -> None:
    """Item 29."""
    spec = _command_spec(tmp_path, "ctrl-c", 'touch "$MESHRUN_RUN_DIR/up-$RANK"; sleep 300', tasks=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun.submit.cli.main", "submit", str(spec), "-c", "local", "--wait"],
        cwd=REPO,
        env=env_for(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    run_dirs: list[Path] = []
    while not (run_dirs and (run_dirs[0] / "up-0").exists()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
        run_dirs = list((tmp_path / ".local" / "share" / "meshrun" / "runs").glob("ctrl-c-*"))
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    job_id = stdout.split("submitted job ")[1].split()[0]
    assert f"job {job_id} keeps running" in stderr and f"meshrun cancel {job_id}" in stderr
    assert status(tmp_path, job_id)["state"] == "RUNNING"
    meshrun(tmp_path, "cancel", job_id, check=True)
    # The cancel took: its supervisor and sidecar end with it, not in the next test's time (or the suite's sweep).
    assert _wait_state(tmp_path, job_id, ("CANCELLED", "FAILED"))["state"] == "CANCELLED"
