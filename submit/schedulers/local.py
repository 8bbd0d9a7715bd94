"""The `local` backend: this machine, no Slurm. Torch-free.

schedule writes the run dir and starts the rendered run.sh detached, in a session of
its own, with MESHRUN_JOB_ID set; run.sh execs the node side, `python -m
meshrun.launcher.local.supervisor` (what sbatch + srun are on Slurm). Each job id has its own state
file in the run dir's `.meshrun/jobs/`, so a resumed run never rewrites an earlier id's
outcome. Two writers in one run dir are impossible: a start (or resume) is refused while
any process of an earlier job of that run dir lives, even when its supervisor was
killed and left its ranks running (orphans are found by process group, and `cancel`
stops them).
"""

from __future__ import annotations

import fcntl
import glob
import os
import secrets
import signal
import subprocess
import sys
import time
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from meshrun.launcher.contract import procs
from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.records.rundir import JOB_ID_ENV, RunDir, local_state_path, merge_state, read_state
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.submit.config.cluster import ClusterProfile
from meshrun.submit.core import findings
from meshrun.submit.core import secrets as job_secrets
from meshrun.submit.core.plan import Plan
from meshrun.submit.core.registry import JobRecord, now
from meshrun.submit.core.runspec import read_run_spec
from meshrun.submit.core.state import FINAL, SUCCESS, JobState
from meshrun.submit.core.status import Status, metrics_tail, parse_losses, parse_metrics_tail
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.schedulers.base import Request, run_dir_files, secret_files, start_argv
from meshrun.submit.transport.base import Transport

ACTIVE = ("PENDING", "RUNNING")
"""The state file's words while the job's processes may run."""
STATES: Mapping[str, JobState] = MappingProxyType(
    {
        "PENDING": JobState.PENDING,
        "RUNNING": JobState.RUNNING,
        "COMPLETED": JobState.COMPLETED,
        "FAILED": JobState.FAILED,
        "CANCELLED": JobState.CANCELLED,
        "TIMEOUT": JobState.TIMEOUT,
        "PREEMPTED": JobState.PREEMPTED,
    }
)
"""Every word a local job's state file holds (written here and by launcher/local/supervisor.py), as meshrun's state:
the one place that reads them. Anything else (no state file, a word not here) is UNKNOWN."""
CLOCK_SLACK_S = 30.0
"""A submitit-API job's controller starts just before its registry record is written: at most this before."""


def new_job_id() -> str:
    return f"local-{secrets.token_hex(4)}"


class LocalBackend:
    name = "local"
    template = "local.sh.j2"
    ships_code = False
    over_ssh = False
    supports_arrays = False
    supports_dependencies = False

    def check_after(self, after: Sequence[str], transport: Transport) -> None:
        """No dependencies here: api.check_dependencies refused --after before any connection."""

    def interpreter(self, profile: ClusterProfile) -> str:
        # The local supervisor runs with the interpreter running meshrun now.
        return sys.executable

    def check(self, spec: JobSpec, profile: ClusterProfile) -> None:
        if spec.resources.nodes != 1:
            raise InputError("resources.nodes", spec.resources.nodes, "the local cluster is this one machine: use 1")
        if spec.resilience.spare_nodes:
            raise InputError(
                "resilience.spare_nodes", spec.resilience.spare_nodes, "the local cluster is this one machine: give 0"
            )

    def dryrun(self, plan: Plan, after: Sequence[str] = ()) -> Request:
        from meshrun.submit.schedulers.render import render

        if after:
            raise InputError("--after", after[0], "dependencies are Slurm's; the local cluster has none")
        script = render(plan, self)
        path = RunDir(plan.run_dir).script(self.name)
        secrets_dir, secret_names = secret_files(plan)
        return Request(
            scheduler=self.name,
            run_dir=plan.run_dir,
            script_path=path,
            script=script,
            argv=start_argv(plan, ("bash", path)),  # the supervisor never holds a secret: the ranks read it
            files=run_dir_files(plan, RunDir.SCRIPTS[self.name], script),
            secrets_dir=secrets_dir,
            secrets=secret_names,
        )

    def schedule(self, request: Request, transport: Transport) -> str:
        with _start_lock(request.run_dir):
            _refuse_live_writers(request.run_dir)
            transport.put(request.files, request.run_dir)
            job_secrets.send(request.secrets_dir, request.secrets, transport)
            return _start(request.run_dir, request.argv)

    def statuses(
        self, records: Sequence[JobRecord], transport: Transport, detail: bool = False, live: bool = False
    ) -> list[Status]:
        return [_status(record, transport, detail, live) for record in records]

    def cancel(self, records: Sequence[JobRecord], transport: Transport) -> None:
        for record in records:
            _cancel(record)
        transport.run(job_secrets.forget_argv([r.run_dir for r in records], whole_array=False))

    def log_path(self, record: JobRecord, rank: Optional[int]) -> str:
        run_dir = RunDir(record.run_dir)
        return run_dir.supervisor_log if rank is None else run_dir.rank_log(rank)

    def restart(self, record: JobRecord, transport: Transport) -> str:
        run_dir = RunDir(record.run_dir)
        with _start_lock(record.run_dir):
            _refuse_live_writers(record.run_dir)
            run_spec = read_run_spec(record, transport)
            job_secrets.resend(run_spec, record.run_dir, transport)  # the supervisor removed them at the end
            return _start(record.run_dir, job_secrets.scrubbed(("bash", run_dir.script(self.name)), [run_spec.job]))

    def poll_interval(self, elapsed_s: float) -> float:
        return 0.5  # reading a local file costs nothing


class _start_lock:
    """An exclusive lock around "check for live writers, then start": two resumes cannot race."""

    def __init__(self, run_dir: str) -> None:
        self.path = RunDir(run_dir).lock
        self.fd = -1

    def __enter__(self) -> None:
        make_private_dir(os.path.dirname(self.path))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_exc: Any) -> None:
        os.close(self.fd)  # closing releases the lock


def _job_states(run_dir: str) -> list[dict[str, Any]]:
    return [read_state(path) for path in glob.glob(local_state_path(run_dir, "*"))]


def _refuse_live_writers(run_dir: str) -> None:
    for state in _job_states(run_dir):
        pgid = state.get("pgid")
        live = procs.group_members(int(pgid)) if pgid else []
        if live:
            raise ClusterError(
                f"job {state.get('job_id')} still has {len(live)} live process(es) in {run_dir} "
                f"(pids {', '.join(map(str, live[:8]))}): two jobs must never write one run dir; "
                f"`meshrun cancel {state.get('job_id')}` stops it"
            )


def _start(run_dir: str, argv: Sequence[str]) -> str:
    """Start the script detached, in a new session (its process group is the job's)."""
    job_id = new_job_id()
    state_path = local_state_path(run_dir, job_id)
    merge_state(state_path, state="PENDING", job_id=job_id, submitted=time.time())
    # The previous run's agreed exit code and error belong to it, not to this start.
    for stale in (RunDir(run_dir).exit_code, RunDir(run_dir).rank_error):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    log = os.open(RunDir(run_dir).supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            list(argv),
            cwd=run_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, JOB_ID_ENV: job_id},
        )
    finally:
        os.close(log)
    from meshrun.launcher.contract.procs import process_identity

    # The start time with the pid: a cancel signals the group only while the pid still names this supervisor.
    identity = process_identity(proc.pid)
    started_at = identity.started_at if identity is not None else None
    merge_state(state_path, supervisor_pid=proc.pid, pgid=proc.pid, supervisor_started_at=started_at)
    return job_id


def _alive(pid: int) -> bool:
    """True if the process runs (zombies count as dead: PID 1 may reap them late)."""
    state = procs.state(pid)
    return state is not None and state not in procs.ENDED


def _supervisor_alive(state: dict[str, Any]) -> bool:
    """Whether the state file's supervisor still runs: its pid, while it names that very process."""
    pid, started = int(state["supervisor_pid"]), state.get("supervisor_started_at")
    if not _alive(pid):
        return False
    if not isinstance(started, (int, float)):
        return True  # a state file from before start times were recorded
    from meshrun.launcher.contract.procs import same_process

    return same_process(pid, float(started))


def _group_is_ours(state: dict[str, Any]) -> bool:
    """False when the supervisor's pid now names another process: a process group of that id is then that
    process's (the kernel never reuses an id while a group of it has members), not this job's orphans."""
    started = state.get("supervisor_started_at")
    if not isinstance(started, (int, float)):
        return True
    from meshrun.launcher.contract.procs import process_identity, same_process

    pid = int(state["supervisor_pid"])
    return process_identity(pid) is None or same_process(pid, float(started))


def current_state(run_dir: str, job_id: str) -> dict[str, Any]:
    """The job's state, corrected when its supervisor died without writing its end."""
    path = local_state_path(run_dir, job_id)
    state = read_state(path)
    pid = state.get("supervisor_pid")
    if state.get("state") not in ACTIVE or not pid or _supervisor_alive(state):
        return state
    state = read_state(path)  # it may have finished between the two reads
    if state.get("state") not in ACTIVE:
        return state
    live = procs.group_members(int(state.get("pgid") or pid)) if _group_is_ours(state) else []
    if live:
        return {
            **state,
            "state": "RUNNING",
            "orphans": live,
            "message": f"orphaned: the local supervisor died and {len(live)} process(es) still run; "
            f"`meshrun cancel {job_id}` stops them",
        }
    return _record_death(run_dir, job_id, state)


def _record_death(run_dir: str, job_id: str, state: dict[str, Any]) -> dict[str, Any]:
    """The end of a job whose supervisor died and whose processes have all ended, written into its state
    file when first seen: ELAPSED stops at its last sign of life, and a later resume writing into the
    run dir does not move it."""
    from meshrun.launcher.contract.records import lost

    ended = last_activity(run_dir, float(state.get("started") or state.get("submitted") or 0))
    if state.get("cancel_requested"):
        final, message = "CANCELLED", ""
    else:
        final, message = "FAILED", "the local supervisor process died (killed?)"
    lost_line = lost.check(run_dir)  # nothing else ran the end-of-run check: the checkpoint_lost alert too
    if lost_line:
        message = f"{message}; {lost_line}" if message else lost_line
    merge_state(local_state_path(run_dir, job_id), state=final, ended=ended, message=message)
    return {**state, "state": final, "ended": ended, "message": message}


def last_activity(run_dir: str, started: float) -> float:
    """When the job's processes last wrote (its logs, metrics, last heartbeats): when it ended, near enough."""
    rd = RunDir(run_dir)
    paths = [rd.metrics, *glob.glob(os.path.join(glob.escape(rd.logs), "*"))]
    paths += glob.glob(os.path.join(glob.escape(rd.path(rd.INTERNAL, "last-beats")), "*"))
    times = []
    for path in paths:
        try:
            times.append(os.stat(path).st_mtime)
        except OSError:
            continue
    return min(max([started, *times]), time.time())


def submitit_files(run_dir: str) -> str:
    """Where submitit keeps a submitit-API job's pickles: its run dir's, or for a task of an array
    submission (`map_array`: RUN/tasks/N, each task its own controller) the submission's, which is the
    folder submitit was given."""
    path = os.path.normpath(run_dir)
    parent = os.path.dirname(path)
    if os.path.basename(parent) == RunDir.TASKS and os.path.basename(path).isdigit():
        return RunDir(os.path.dirname(parent)).submitit
    return RunDir(path).submitit


def _submitit_controller(record: JobRecord) -> Optional[procs.Identity]:
    """The process a cancel signals: the job's submitit controller, while it runs for this job's files and started
    with the job (a pid from the registry may be another process's by now). The job id is the controller's pid,
    or, on a profile with setup lines, the pid of the shell submitit runs them in (`sh -c "SETUP && python -m
    submitit.local._local"`), whose child the controller is: a TERM to that shell would end it and leave the
    controller and its tasks running. The shell itself only while it has not started the controller yet."""
    job_pid = int(record.job_id) if record.job_id.isdigit() else 0
    if not job_pid or not _runs_controller(record, job_pid):
        return None
    if not _is_controller(procs.command_line(job_pid) or []):
        inner = [pid for pid in procs.children(job_pid) if _runs_controller(record, pid)]
        job_pid = inner[0] if inner else job_pid
    return procs.process_identity(job_pid)


def _is_controller(argv: Sequence[str]) -> bool:
    """`python -m submitit.local._local FOLDER` itself, not a shell whose command line names it."""
    return argv[1:3] == ["-m", "submitit.local._local"]


def _runs_controller(record: JobRecord, pid: int) -> bool:
    """pid runs (or is the setup shell of) submitit's controller for this job's files, and started with the job."""
    command = " ".join(procs.command_line(pid) or [])
    started = procs.started_wall(pid)
    ours = "submitit.local._local" in command and submitit_files(record.run_dir) in command
    fresh = started is not None and started >= record.submitted_at - CLOCK_SLACK_S
    return ours and fresh and _alive(pid)


def submitit_state(record: JobRecord) -> dict[str, Any]:
    """A job of the submitit API (`meshrun.submit.api.executor` on a local profile): submitit's own files say
    how it went (its LocalExecutor writes no meshrun state); the job id is its controller's pid. A controller
    gone without a result was killed: FAILED, never UNKNOWN, so `watch` and `status --watch` end."""
    if not record.job_id.isdigit():
        return {}
    pattern = os.path.join(submitit_files(record.run_dir), f"{glob.escape(record.job_id)}_*_result.pkl")
    if not glob.glob(pattern):
        if record.job_id.isdigit() and _runs_controller(record, int(record.job_id)):
            return {"state": "RUNNING"}
        if not glob.glob(pattern):  # it may have written its result and ended since the first look
            return {"state": "FAILED", "message": "its submitit controller ended without a result (killed?)"}
    from submitit.core.utils import pickle_load

    for path in sorted(glob.glob(pattern)):
        try:
            outcome, value = pickle_load(path)
        except Exception:  # a result whose type only the caller can import: it did return
            continue
        if outcome != "success":
            lines = str(value).strip().splitlines()
            return {"state": "FAILED", "message": lines[-1] if lines else "the function raised"}
    return {"state": "COMPLETED"}


def _status(record: JobRecord, transport: Transport, detail: bool = False, live: bool = False) -> Status:
    if not os.path.isdir(record.run_dir):
        # A job that had ended keeps the state meshrun saw then: removing its folder does not undo its end.
        seen = record.last_state if STATES.get(record.last_state) in FINAL else "UNKNOWN"
        state: dict[str, Any] = {"state": seen, "message": f"the run dir {record.run_dir} is gone"}
    else:
        state = current_state(record.run_dir, record.job_id) or submitit_state(record) or {"state": "UNKNOWN"}
    job_state = STATES.get(state.get("state", ""), JobState.UNKNOWN)
    started, ended = state.get("started"), state.get("ended")
    elapsed = int((ended or now()) - started) if started else None
    found = findings.findings_from(
        findings.read_files(record.run_dir, detail, live), record.submitted_at, record.job_id
    )
    tail = metrics_tail(transport, record.run_dir, live)
    return Status(
        job_id=record.job_id,
        cluster=record.cluster,
        name=record.name,
        state=job_state,
        run_dir=record.run_dir,
        submitted_at=record.submitted_at,
        done=job_state in FINAL,
        succeeded=job_state in SUCCESS,
        elapsed_s=elapsed,
        time_limit_s=None if job_state in FINAL else state.get("time_limit_s"),
        reason=state.get("message") or None,
        progress=found.progress(parse_metrics_tail(tail, record.job_id)),
        exit_code=state.get("exit_code"),
        losses=parse_losses(tail, record.job_id) if live else [],
        usage=found.usage(elapsed, None),
        **found.status_fields(),
    )


def _cancel(record: JobRecord) -> None:
    """SIGTERM to the job's process group: supervisor, submitit controller, ranks (orphans too)."""
    state = current_state(record.run_dir, record.job_id)
    if not state and submitit_state(record).get("state") == "RUNNING":
        _cancel_submitit_job(record)
        return
    if state.get("state") not in ACTIVE:
        raise ClusterError(
            f"job {record.job_id} is not running: it ended {state.get('state', 'UNKNOWN')} "
            f"(see `meshrun status {record.job_id}`)"
        )
    merge_state(local_state_path(record.run_dir, record.job_id), cancel_requested=time.time())
    pgid = int(state.get("pgid") or state.get("supervisor_pid") or 0)
    if not pgid:
        return  # not started yet: the supervisor sees cancel_requested and starts nothing

    # Only the group this job's supervisor started, and only if its processes carry this job's id: a pid
    # from a state file may name another process (and group) by now.
    started = state.get("supervisor_started_at")
    leader = procs.Identity(pgid, float(started)) if isinstance(started, (int, float)) else None
    leader = leader or procs.process_identity(pgid) or procs.Identity(pgid, -1.0)
    job = procs.JobScope(JOB_ID_ENV, record.job_id)
    # A live supervisor stops the job itself: it signals the ranks (again, until those still starting have it)
    # and lets the sidecar copy their last checkpoint. A TERM to the whole group reached the sidecar and the
    # ranks in their first second, before they had handlers, and lost that checkpoint. Orphans (the supervisor
    # is gone): the group, found by its id.
    if not procs.signal_if_same(leader, signal.SIGTERM, job):
        procs.signal_group_if_same(leader, signal.SIGTERM, job)


def _cancel_submitit_job(record: JobRecord) -> None:
    """A submitit-API job on this machine: SIGINT to its controller, as submitit's own `job.cancel()` sends it,
    which stops the tasks (SIGINT, then SIGKILL a second later). A SIGTERM would only be passed on to the tasks,
    whose submitit handlers pass over it ("Bypassing signal SIGTERM") once the function runs: the job said
    CANCELLED and ran to its end. The outcome is recorded in meshrun's own state file, which submitit's
    LocalExecutor does not write."""

    controller = _submitit_controller(record)
    if controller is not None:
        procs.signal_if_same(controller, signal.SIGINT)
    merge_state(
        local_state_path(record.run_dir, record.job_id),
        state="CANCELLED",
        job_id=record.job_id,
        cancel_requested=time.time(),
        ended=time.time(),
        message="",
    )


BACKEND = LocalBackend()
