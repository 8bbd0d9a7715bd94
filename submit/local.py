"""The `local` cluster: this machine, no Slurm.

`meshrun submit -c local` starts a detached supervisor (`python -m submit.local
RUN_DIR`, through the rendered run.sh) in its own process group. The supervisor
starts the ranks with submitit's LocalExecutor, which gives each rank a
Slurm-like environment (SUBMITIT_LOCAL_GLOBALID, ...), waits for them and
records the job's state in RUN_DIR/state.json. `status` reads that file;
`cancel` signals the supervisor's process group. Torch-free: the ranks import
torch, never this process.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from launcher.preempt import EXIT_REQUEUE

STATE_FILE = "state.json"
STOP_GRACE_S = 60
"""How long ranks may take to save and exit after a cancel or the time limit before they are killed."""

SUPERVISOR_LOG = "logs/supervisor.log"


def new_job_id() -> str:
    return f"local-{secrets.token_hex(4)}"


def write_state(run_dir: Path, **fields: Any) -> None:
    """Merge fields into state.json, atomically (status may read it at any moment)."""
    path = run_dir / STATE_FILE
    state = read_state(run_dir)
    state.update(fields)
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, path)


def read_state(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _alive(pid: int) -> bool:
    """True if the process runs (zombies count as dead: PID 1 may reap them late)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def current_state(run_dir: Path) -> dict[str, Any]:
    """state.json, corrected when the supervisor died without writing its end."""
    state = read_state(run_dir)
    pid = state.get("supervisor_pid")
    if state.get("state") in ("PENDING", "RUNNING") and pid and not _alive(int(pid)):
        state = {**read_state(run_dir)}  # it may have finished between the two reads
        if state.get("state") in ("PENDING", "RUNNING"):
            state.update(state="FAILED", message="the local supervisor process died (killed?)")
    return state


def reset_state(run_dir: Path) -> None:
    """Forget an ended run's state before it starts again (`meshrun resume`)."""
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)


def start(run_dir: Path, script: Path, job_id: str) -> int:
    """Start the job's script detached, in a new session; returns the supervisor's pid."""
    run_dir = Path(run_dir)
    write_state(run_dir, state="PENDING", job_id=job_id, submitted=time.time())
    log = open(run_dir / SUPERVISOR_LOG, "ab")
    try:
        proc = subprocess.Popen(["bash", str(script)], cwd=run_dir, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    write_state(run_dir, supervisor_pid=proc.pid)
    return proc.pid


def cancel(run_dir: Path) -> bool:
    """SIGTERM to the supervisor's process group (supervisor, submitit controller, ranks)."""
    state = current_state(run_dir)
    pid = state.get("supervisor_pid")
    if state.get("state") not in ("PENDING", "RUNNING") or not pid or not _alive(int(pid)):
        return False
    write_state(run_dir, cancel_requested=time.time())
    try:
        os.killpg(int(pid), signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


# ------------------------------------------------------------------ the supervisor

class _Supervisor:
    def __init__(self, run_dir: Path) -> None:
        from launcher.spec import read_run_spec  # torch-free

        self.run_dir = run_dir
        self.spec = read_run_spec(run_dir).job
        self.cancelled = False

    def _on_term(self, signum: int, _frame: Any) -> None:
        self.cancelled = True

    def _executor(self) -> Any:
        import submitit

        from submit.plan import parse_time

        executor = submitit.LocalExecutor(folder=self.run_dir / "logs")
        # The supervisor's own clock enforces the limit; submitit's gets a margin so that
        # its timeout path (which would requeue) never fires first.
        limit_min = math.ceil(parse_time(self.spec.resources.time) / 60)
        executor.update_parameters(tasks_per_node=self.spec.tasks_per_node, nodes=1,
                                   timeout_min=limit_min + 5, stderr_to_stdout=True,
                                   gpus_per_node=self.spec.resources.gpus_per_node)
        return executor, limit_min * 60

    def _link_rank_logs(self, controller: str) -> None:
        for rank in range(self.spec.tasks_per_node):
            link = self.run_dir / "logs" / f"rank-{rank}.log"
            if not link.is_symlink():
                link.symlink_to(f"{controller}_{rank}_log.out")

    def run(self) -> int:
        from launcher.entry import run_rank  # torch-free at import; pickled by reference

        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        executor, limit_s = self._executor()
        job = executor.submit(run_rank, str(self.run_dir))
        started = time.time()
        write_state(self.run_dir, state="RUNNING", started=started, controller_pid=job.job_id,
                    time_limit_s=limit_s)
        self._link_rank_logs(job.job_id)
        print(f"[meshrun] local job started {self.spec.tasks_per_node} ranks (controller {job.job_id})", flush=True)
        self.timed_out = False
        deadline: Optional[float] = None
        while not job.done():
            now = time.time()
            if deadline is None and (self.cancelled or now - started > limit_s):
                # The ranks got (cancel) or now get (time limit) a signal that makes them save a
                # checkpoint and exit at the next step; they have a grace period to do it.
                self.timed_out = not self.cancelled
                if self.timed_out:
                    _signal_children(int(job.job_id), signal.SIGUSR1)
                deadline = now + STOP_GRACE_S
            if deadline is not None and now > deadline:
                break
            time.sleep(0.25)
        return self._finish(job, started, limit_s)

    def _finish(self, job: Any, started: float, limit_s: int) -> int:
        final, codes, message = "COMPLETED", None, ""
        stopped = "CANCELLED" if self.cancelled else "TIMEOUT" if self.timed_out else None
        if not job.done():
            final = stopped or "TIMEOUT"
            job.cancel(check=False)
        else:
            try:
                codes = list(job.results())
                if codes and all(c == EXIT_REQUEUE for c in codes):
                    final, message = stopped or "PREEMPTED", "checkpoint saved: `meshrun resume` continues it"
                elif any(codes):
                    final, message = "FAILED", f"rank exit codes {codes}"
            except Exception as exc:  # submitit re-raises a rank's exception
                final = "CANCELLED" if self.cancelled else "FAILED"
                message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        write_state(self.run_dir, state=final, ended=time.time(), exit_codes=codes, message=message,
                    elapsed_s=round(time.time() - started, 3))
        print(f"[meshrun] local job {final} {message}".rstrip(), flush=True)
        return 0 if final == "COMPLETED" else 1


def _signal_children(parent: int, sig: int) -> None:
    """Signal the rank processes (the submitit controller's children), not this supervisor."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                os.kill(int(entry), sig)
        except (OSError, IndexError, ValueError):
            continue


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m submit.local RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    try:
        return _Supervisor(run_dir).run()
    except Exception as exc:
        write_state(run_dir, state="FAILED", ended=time.time(), message=f"supervisor: {exc}")
        raise


if __name__ == "__main__":
    sys.exit(main())
