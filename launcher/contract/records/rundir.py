"""The run-dir contract: one type naming every file of a run dir. Torch-free, stdlib only.

Both sides use it: `submit` writes the run dir and reads it back (status, logs,
resume), the ranks, the local supervisor and the sidecar write into it, and the
templates get their paths from it. Paths are POSIX strings, since a run dir
usually lives on a cluster, not on the machine that names it.

    RUN_DIR/
      job.yaml               the spec as submitted (overrides applied)
      spec.json              the resolved run spec the ranks read
      job.sbatch | run.sh    the rendered script (one per scheduler)
      metrics.jsonl          rank 0: one JSON line per logged step, plus events
      tensorboard/           rank 0: TensorBoard event files (`tensorboard --logdir WORK_DIR` shows every run)
      gpu.jsonl              the sidecars: one JSON line per sample per GPU (and per node's host)
      env/NODE.json          each node's sidecar: hostname, GPUs, driver, CUDA, torch, NCCL, meshrun
      ranks-exit-code        rank 0: the code every rank agreed on
      rank-error.txt         the first rank's one-line fatal error, if any
      logs/                  what a person reads: the batch log, rank-N.log and sidecar-NODE.log
      checkpoints/           unless the cluster has a checkpoint root
      diagnosis/             a hang's diagnosis: verdict.txt/.json, NODE/ (stacks, heartbeats, GPUs)
      stragglers.json        the sidecars: ranks persistently slower than the median (absent: none)
      alerts.jsonl           rank 0 and node 0's sidecar: one JSON line per alert (see launcher/contract/records/alerts.py)
      doctor/rank-N.json     `meshrun doctor`: each rank's preflight results (launcher/probes/doctor.py)
      health/NODE.json       each node's health check before this start (launcher/probes/health.py)
      health.json            the health gate's verdict on this start: failing nodes, what was done (launcher/batch/gate.py)
      tasks/N/               a sweep task's own run dir (same layout)
      .meshrun/              scheduler internals: local state, submitit's files, the lock
        pylib/meshrun/launcher  a link to meshrun's launcher package, on a command job's PYTHONPATH
        nodes/NODE/          a node's own files when the cluster has no node-local scratch (see NodeDir),
                             among them progress/rank-N.json, every rank's heartbeat {"rank", "step", "phase", "time"}
        steptimes/NODE.json  each node's sidecar: its ranks' recent step and busy times (straggler input)
        last-beats/NODE.json each node's ranks' last heartbeats when its sidecar stopped
        reported-step.json   rank 0's highest step given to report(): a command job's progress
        requeue.json         the requeue policy's count of failed runs without progress (meshrun.launcher.batch.requeue)
        attempts.jsonl       each start and end of the job's allocation (the batch shell, the local supervisor)
        goodput/JOB.json     where the job's allocated time went (launcher/contract/records/goodput.py)
        energy/JOB.NODE.json what NODE's sidecar measured of the job's energy (launcher/contract/records/energy.py)

A node's own files live in its NodeDir: on node-local scratch (`paths.scratch` in the cluster
profile) when there is one, else under RUN_DIR/.meshrun/nodes/NODE/.
"""

from __future__ import annotations

import getpass
import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from meshrun.launcher.contract.private import make_private_dir
from meshrun.launcher.contract.spec import SPEC_FILE

JOB_ID_ENV = "MESHRUN_JOB_ID"
"""Set by the local backend for its supervisor: which job id's state file it writes."""
NODE_DIR_ENV = "MESHRUN_NODE_DIR"
"""Set for every rank (meshrun.launcher.rank.entry): this node's NodeDir, where its heartbeat and stack dump go."""
ATTEMPTS_FILE = "resume-attempts.json"
"""The crash-loop guard's counts, beside the checkpoints (in the checkpoint dir, not the run dir)."""


@dataclass(frozen=True)
class RunDir:
    """Every file of one run dir, by name."""

    root: str
    """The run dir itself (absolute, as the cluster sees it)."""

    JOB_YAML = "job.yaml"
    SPEC = SPEC_FILE
    METRICS = "metrics.jsonl"
    TENSORBOARD = "tensorboard"
    GPU_METRICS = "gpu.jsonl"
    ENV = "env"
    EXIT_CODE = "ranks-exit-code"
    RANK_ERROR = "rank-error.txt"
    LOGS = "logs"
    CHECKPOINTS = "checkpoints"
    DIAGNOSIS = "diagnosis"
    STRAGGLERS = "stragglers.json"
    ALERTS = "alerts.jsonl"
    DEEPSPEED_CONFIG = "deepspeed.json"
    """train.engine: deepspeed: the DeepSpeed config generated from the spec (written for inspection)."""
    DOCTOR = "doctor"
    """`meshrun doctor`'s job: one rank-N.json of preflight results per rank (launcher/probes/doctor.py)."""
    HEALTH = "health"
    """Each node's answer to the health check before the ranks start (launcher/probes/health.py)."""
    TASKS = "tasks"
    INTERNAL = ".meshrun"
    SCRIPTS = {"slurm": "job.sbatch", "local": "run.sh"}

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    @property
    def job_yaml(self) -> str:
        return self.path(self.JOB_YAML)

    @property
    def spec(self) -> str:
        return self.path(self.SPEC)

    @property
    def metrics(self) -> str:
        return self.path(self.METRICS)

    @property
    def tensorboard(self) -> str:
        """Rank 0's TensorBoard event files (report() and the built-in trainer write them)."""
        return self.path(self.TENSORBOARD)

    @property
    def pylib(self) -> str:
        """Holds only a link to the `launcher` package: a command job's python imports report() from it."""
        return self.path(self.INTERNAL, "pylib")

    def node_dir(self, scratch_dir: str, node: str) -> NodeDir:
        """A node's own files: on its node-local scratch when the cluster has one, else in the run dir."""
        if scratch_dir:
            return NodeDir(posixpath.join(scratch_dir, node))
        return NodeDir(self.path(self.INTERNAL, "nodes", node))

    @property
    def diagnosis(self) -> str:
        """A hang's diagnosis, collected before anything is killed (see launcher/sidecar)."""
        return self.path(self.DIAGNOSIS)

    @property
    def verdict(self) -> str:
        """The hang's one-paragraph verdict (what `meshrun status` shows)."""
        return self.path(self.DIAGNOSIS, "verdict.txt")

    @property
    def verdict_json(self) -> str:
        """The verdict as data: {"time", "step", "phase", "verdict", "ranks": [{"rank", "node", "step", "phase", "where"}]}."""
        return self.path(self.DIAGNOSIS, "verdict.json")

    def node_diagnosis(self, node: str) -> str:
        """One node's part of the diagnosis: rank-N.stack.txt, heartbeats.json, gpus.json, nccl-trace-rank-N."""
        return self.path(self.DIAGNOSIS, node)

    @property
    def stragglers(self) -> str:
        """{"time", "factor", "median_s", "stragglers": [{"rank", "node", "busy_s", "ratio"}]} (node rank 0's sidecar)."""
        return self.path(self.STRAGGLERS)

    def last_beats(self, node: str) -> str:
        """A node's ranks' last heartbeats when its sidecar stopped: {"node", "attempt", "beats": {rank: beat}}."""
        return self.path(self.INTERNAL, "last-beats", f"{node}.json")

    @property
    def alerts(self) -> str:
        """One JSON line per alert: {"time", "step", "rule", "value", "threshold", "rank", "node", "message"}.
        Written only from node 0 (rank 0 and its sidecar: appends from one machine stay whole lines)."""
        return self.path(self.ALERTS)

    def node_alerts(self, node: str) -> str:
        """Another node's sidecar's alerts, which node 0's sidecar forwards into alerts.jsonl."""
        return self.path(self.INTERNAL, "alerts", f"{node}.jsonl")

    def step_times(self, node: str) -> str:
        """A node's ranks' recent step times, shared so that one sidecar can compare all nodes."""
        return self.path(self.INTERNAL, "steptimes", f"{node}.json")

    @property
    def gpu_metrics(self) -> str:
        """The sidecars' samples: one JSON line per GPU (and one per node's host) per interval."""
        return self.path(self.GPU_METRICS)

    def doctor_result(self, rank: int) -> str:
        """A doctor job's rank's results: versions, GPUs, storage, compute and all-reduce figures."""
        return self.path(self.DOCTOR, f"rank-{rank}.json")

    def health_result(self, node: str) -> str:
        """A node's health check before this start: each check's verdict and evidence."""
        return self.path(self.HEALTH, f"{node}.json")

    @property
    def health_verdict(self) -> str:
        """The health gate's verdict on the latest start (launcher/batch/gate.py): the failing nodes and the action."""
        return self.path(f"{self.HEALTH}.json")

    def env_record(self, node: str) -> str:
        """A node's environment record (written by its sidecar)."""
        return self.path(self.ENV, f"{node}.json")

    def sidecar_log(self, node: str) -> str:
        return self.path(self.LOGS, f"sidecar-{node}.log")

    def sidecar_tensorboard(self, node: str) -> str:
        """A node's sidecar's TensorBoard event files (beside rank 0's, under tensorboard/)."""
        return self.path(self.TENSORBOARD, f"sidecar-{node}")

    @property
    def exit_code(self) -> str:
        return self.path(self.EXIT_CODE)

    @property
    def rank_error(self) -> str:
        return self.path(self.RANK_ERROR)

    @property
    def logs(self) -> str:
        return self.path(self.LOGS)

    def rank_log(self, rank: int) -> str:
        return self.path(self.LOGS, f"rank-{rank}.log")

    def batch_log(self, job_id: str) -> str:
        """The batch shell's log (Slurm: slurm-JOBID.out; local: supervisor.log, one for all runs)."""
        return self.path(self.LOGS, f"slurm-{job_id}.out")

    @property
    def supervisor_log(self) -> str:
        return self.path(self.LOGS, "supervisor.log")

    def script(self, scheduler: str) -> str:
        return self.path(self.SCRIPTS[scheduler])

    @property
    def default_checkpoints(self) -> str:
        return self.path(self.CHECKPOINTS)

    @property
    def internal(self) -> str:
        """Scheduler internals a person need not read (hidden from `ls`)."""
        return self.path(self.INTERNAL)

    @property
    def submitit(self) -> str:
        """submitit's pickles and its own logs (local cluster, submitit API jobs)."""
        return self.path(self.INTERNAL, "submitit")

    @property
    def reported_step(self) -> str:
        """{"step", "time"}: the highest step rank 0 gave report(); what the requeue policy calls progress."""
        return self.path(self.INTERNAL, "reported-step.json")

    @property
    def finished(self) -> str:
        """{"attempt", "step", "time"}: a `command:` job's program said it finished in that start
        (meshrun.launcher.job.finished): its exit 0 after a stop signal is a finish, not a stop (launcher/contract/records/finish.py)."""
        return self.path(self.INTERNAL, "finished.json")

    @property
    def last_checkpoint(self) -> str:
        """{"step", "job", "time"}: the newest checkpoint made complete on shared storage, written by what made
        it so (rank 0's commit, the sidecar's copier for a staged save, meshrun.launcher.job's mark_complete): status's
        CKPT, however many step lines the metrics log has appended since (`note_checkpoint`)."""
        return self.path(self.INTERNAL, "last-checkpoint.json")

    @property
    def attempts(self) -> str:
        """One JSON line per start and end of an allocation of the job: {"event": "start", "job", "restart",
        "time", "submitted", "nodes"} and {"event": "end", "job", "restart", "time", "status"}."""
        return self.path(self.INTERNAL, "attempts.jsonl")

    def energy(self, job_id: str, node: str) -> str:
        """What node's sidecar measured of job_id's energy (launcher/contract/records/energy.py)."""
        return self.path(self.INTERNAL, "energy", f"{job_id}.{node}.json")

    def goodput(self, job_id: str) -> str:
        """Where job_id's allocated time went, as of its newest attempt's start or end (goodput.account)."""
        return self.path(self.INTERNAL, "goodput", f"{job_id}.json")

    @property
    def requeue_state(self) -> str:
        """{"failures", "step"}: the requeue policy's memory across a command job's runs (meshrun.launcher.batch.requeue)."""
        return self.path(self.INTERNAL, "requeue.json")

    @property
    def lock(self) -> str:
        """Held by the live job's supervisor: two writers in one run dir are impossible."""
        return self.path(self.INTERNAL, "lock")

    def task(self, index: int) -> RunDir:
        """A sweep task's own run dir."""
        return RunDir(self.path(self.TASKS, str(index)))


@dataclass(frozen=True)
class NodeDir:
    """One node's own files for one run: heartbeats, stack dumps and (with scratch) staged checkpoints.

    On node-local scratch the heartbeat every rank rewrites every step costs shared storage nothing.
    """

    root: str

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def progress(self, rank: int) -> str:
        """A rank's heartbeat, rewritten every step: {"rank", "step", "phase", "time", "pid", ...}."""
        return self.path("progress", f"rank-{rank}.json")

    def stack(self, rank: int) -> str:
        """Where a rank's faulthandler writes every thread's Python stack when the sidecar asks (a signal)."""
        return self.path("progress", f"rank-{rank}.stack")

    @property
    def staging(self) -> str:
        """Checkpoints saved here first when the cluster has scratch; the sidecar copies them to shared storage."""
        return self.path("checkpoints")

    @property
    def nccl_prefix(self) -> str:
        """PyTorch's NCCL flight recorder: dumps go to PREFIX<rank> (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)."""
        return self.path("nccl", "trace-rank-")

    @property
    def nccl_pipe_prefix(self) -> str:
        """Writing to PIPE<rank>.pipe asks a rank for a flight-recorder dump (TORCH_NCCL_DEBUG_INFO_PIPE_FILE)."""
        return self.path("nccl", "pipe-rank-")


def job_of(environ: Mapping[str, str]) -> Optional[str]:
    """The id meshrun's registry knows this job by (Slurm's, an array task as ARRAY_TASK; the local job's).

    Every line of a run dir's shared records (metrics.jsonl, alerts.jsonl) names it: a resume is a new job
    in the same run dir, and each id shows its own progress and alerts."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or environ.get(JOB_ID_ENV) or None


def job_field(environ: Mapping[str, str]) -> dict[str, str]:
    """{"job": ID} for a record line, or nothing outside a job (a test, a bench)."""
    job = job_of(environ)
    return {"job": job} if job else {}


def note_checkpoint(run_dir: str, step: int, environ: Mapping[str, str] = os.environ) -> None:
    """Record `step` as the run's newest checkpoint complete on shared storage (RunDir.last_checkpoint).

    Within one job the record only rises: a copy that commits an older step after a newer one (a copier
    killed and restarted on its backlog) must not make the job's CKPT go back. A later job of the run dir
    (a resume, perhaps from an older step on purpose) writes its own."""
    import time

    path, job = RunDir(run_dir).last_checkpoint, job_field(environ)
    known = read_state(path)
    if job and known.get("job") == job["job"] and isinstance(known.get("step"), int) and known["step"] > step:
        return
    write_json(path, {"step": step, "time": time.time(), **job})


def attempt_id(environ: Mapping[str, str]) -> str:
    """This start of the job: Slurm's job id and restart count (a requeue is a new attempt) and its restart inside
    the allocation (on spare nodes), or the local job id.

    Files one attempt leaves on a node (heartbeats, staged checkpoints, a hang claim) name it, so the
    next attempt never mistakes them for its own.
    """
    job = environ.get("SLURM_JOB_ID") or environ.get(JOB_ID_ENV) or "nojob"
    in_job = in_job_restart(environ)
    return f"{job}.{environ.get('SLURM_RESTART_COUNT') or 0}" + (f".{in_job}" if in_job else "")


IN_JOB_ENV = "MESHRUN_RESTART_IN_JOB"
"""Set by the batch script: how many times the ranks were restarted inside this allocation (on spare nodes)."""
RUN_NODES_ENV = "MESHRUN_RUN_NODES"
"""Set by the batch script when the job has spare nodes: the nodes the ranks run on now (comma-separated)."""


def in_job_restart(environ: Mapping[str, str]) -> int:
    try:
        return int(environ.get(IN_JOB_ENV) or 0)
    except ValueError:
        return 0


def expand_node_path(path: str) -> str:
    """A node-local path from the profile as this node sees it (`~`, $USER and other variables expanded here)."""
    if not path:
        return path
    user = os.environ.get("USER") or getpass.getuser()  # a batch job or container may not export USER
    path = path.replace("${USER}", user).replace("$USER", user)
    return os.path.expanduser(os.path.expandvars(path))


def node_name(environ: Mapping[str, str]) -> str:
    """Slurm's name of this node (two nodes may share a hostname), else the short hostname; file-name safe."""
    name = environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0] or "node"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def local_state_path(run_dir: str, job_id: str) -> str:
    """A local job's state: one file per job id, so each id keeps its own outcome after a resume."""
    return RunDir(run_dir).path(RunDir.INTERNAL, "jobs", f"{job_id}.json")


def read_state(path: str) -> dict[str, Any]:
    """A JSON state file as a dict ({} when missing or being replaced)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: str, data: Mapping[str, Any], indent: Optional[int] = None) -> None:
    """Write a private (0600) JSON file atomically: a temporary beside it, then a rename, so that a reader
    (another node, another process) never sees half a file. Its folder is created 0700 if missing."""
    folder = os.path.dirname(path)
    make_private_dir(folder)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=indent, sort_keys=True)
    os.replace(tmp, path)


def merge_state(path: str, **fields: Any) -> dict[str, Any]:
    """Merge fields into a JSON state file, atomically (readers may look at any moment); private (0600)."""
    state = {**read_state(path), **fields}
    write_json(path, state)
    return state


def record_exit(run_dir: Path, code: int) -> None:
    """The exit code every rank agreed on, for the batch script (srun's own status is not it when
    kill-on-bad-exit signals ranks still tearing down after the first one exited): atomic and 0600."""
    tmp = Path(run_dir) / f".{RunDir.EXIT_CODE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # as private as the rest of the run dir
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{code}\n")
    os.replace(tmp, Path(run_dir) / RunDir.EXIT_CODE)


def run_node_dir(run_dir: str, scratch_dir: str, environ: Mapping[str, str]) -> NodeDir:
    """This node's folder for a run (the ranks' heartbeats, staged saves, NCCL dumps): on the profile's scratch
    (the run spec's run.scratch_dir) when it has one, else under the run dir's internals."""
    return RunDir(run_dir).node_dir(expand_node_path(scratch_dir), node_name(environ))
