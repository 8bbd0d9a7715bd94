"""Slurm, as argv builders and pure parsers of its stable output.

Only stable formats are parsed: `sbatch --parsable`, `sacct --parsable2` with a
fixed field list, and `squeue` with a fixed `-o` format. Nothing here runs a
command; the transport does. Slurm's state names are read here and nowhere else: STATES
maps each to meshrun's JobState (submit/core/state.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Optional, Sequence

from meshrun.submit.core.state import FAILURE, FINAL, SUCCESS, JobState
from meshrun.submit.errors import ClusterError, InputError

# Slurm 22.05's sacct has no restart count field: the ranks report SLURM_RESTART_COUNT in metrics.jsonl.
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Elapsed", "Timelimit", "NodeList", "UID", "AllocTRES")
SACCT_READ = 7
"""The fields every row must have; UID (the owner, to tell an owner's cancel from an admin's) may be absent
from recorded output of older versions."""
SQUEUE_FORMAT = "%i|%T|%M|%l|%N|%r"
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")  # [0-9], not \d: full-width digits are digits to Python, not to Slurm

STATES: Mapping[str, JobState] = MappingProxyType(
    {
        # Base states.
        "PENDING": JobState.PENDING,
        "RUNNING": JobState.RUNNING,
        "SUSPENDED": JobState.SUSPENDED,
        "COMPLETED": JobState.COMPLETED,
        "CANCELLED": JobState.CANCELLED,
        "FAILED": JobState.FAILED,
        "TIMEOUT": JobState.TIMEOUT,
        "NODE_FAIL": JobState.NODE_FAIL,
        "PREEMPTED": JobState.PREEMPTED,
        "BOOT_FAIL": JobState.BOOT_FAIL,
        "DEADLINE": JobState.DEADLINE,
        "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
        # Flags, which squeue and sacct print instead of the base state while one is set.
        "COMPLETING": JobState.COMPLETING,
        "CONFIGURING": JobState.CONFIGURING,
        "EXPEDITING": JobState.EXPEDITING,
        "LAUNCH_FAILED": JobState.LAUNCH_FAILED,
        "POWER_UP_NODE": JobState.POWER_UP_NODE,
        "RECONFIG_FAIL": JobState.RECONFIG_FAIL,
        "REQUEUED": JobState.REQUEUED,
        "REQUEUE_FED": JobState.REQUEUE_FED,
        "REQUEUE_HOLD": JobState.REQUEUE_HOLD,
        "RESIZING": JobState.RESIZING,
        "RESV_DEL_HOLD": JobState.RESV_DEL_HOLD,
        "REVOKED": JobState.REVOKED,
        "SIGNALING": JobState.SIGNALING,
        "SPECIAL_EXIT": JobState.SPECIAL_EXIT,
        "STAGE_OUT": JobState.STAGE_OUT,
        "STOPPED": JobState.STOPPED,
        "UPDATE_DB": JobState.UPDATE_DB,
    }
)
"""Every job state name Slurm's squeue (%T) and sacct print (slurm.schedmd.com/job_state_codes.html), as
meshrun's state: the one place that reads Slurm's words. A name not here (a newer Slurm's) is UNKNOWN, and
the job's reason names it."""


@dataclass(frozen=True)
class SlurmJob:
    """One job as squeue or sacct reports it, its state read through STATES."""

    job_id: str
    state: JobState
    exit_code: Optional[str] = None
    elapsed: Optional[str] = None
    time_limit: Optional[str] = None
    nodes: Optional[str] = None
    restarts: int = 0
    earlier_s: int = 0
    """The seconds the job's earlier runs (before its requeues) ran: with `elapsed`, the job's whole life."""
    reason: Optional[str] = None
    gpus: Optional[int] = None
    """The GPUs Slurm's accounting says the allocation holds (AllocTRES's gres/gpu; 0: none); None: not known."""

    @property
    def done(self) -> bool:
        return self.state in FINAL

    @property
    def succeeded(self) -> bool:
        return self.state in SUCCESS


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise ClusterError(f"job id {job_id!r} is not a Slurm job id (digits, or digits_digits for arrays)")
    return job_id


DEPENDENCY_KINDS = ("ok", "any", "notok", "start")


def dependency(after: Sequence[str]) -> Optional[str]:
    """`--after [KIND:]JOB` values -> sbatch's --dependency (afterok unless KIND says otherwise)."""
    parts = []
    for item in after:
        kind, _, job_id = item.rpartition(":")
        kind = kind or "ok"
        if kind not in DEPENDENCY_KINDS or not _JOB_ID.fullmatch(job_id):
            raise InputError(
                "--after",
                item,
                f"give a Slurm job id, or KIND:JOB with KIND one of {', '.join(DEPENDENCY_KINDS)} (default ok)",
            )
        slurm_kind = "after" if kind == "start" else f"after{kind}"
        parts.append(f"{slurm_kind}:{job_id}")
    return ",".join(parts) or None


def dependency_target(item: str) -> tuple[str, str]:
    """One `--after [KIND:]JOB` (checked by `dependency`) -> (kind, job id)."""
    kind, _, job_id = item.rpartition(":")
    return kind or "ok", job_id


def dependency_state(job_id: str, sacct: dict[str, SlurmJob], squeue: dict[str, SlurmJob]) -> SlurmJob:
    """The job a dependency names, as Slurm sees it; a job array's id (its tasks are ID_N rows) stands for
    all its tasks: failed when one failed, completed when all completed, else the state of one still going.
    A job still COMPLETING (its processes ending) whose accounting record has ended has its outcome: that
    is what a dependency waits on (merge_states keeps it running for status: its last copies are not done)."""
    squeue = {key: job for key, job in squeue.items() if not (job.state is JobState.COMPLETING and _ended(sacct, key))}
    (known,) = merge_states([job_id], sacct, squeue).values()
    tasks = sorted({key for key in [*sacct, *squeue] if key.startswith(f"{job_id}_")})
    if known.state is not JobState.UNKNOWN or not tasks:
        return known
    states = [job.state for job in merge_states(tasks, sacct, squeue).values()]
    failed = [state for state in states if state in FAILURE]
    going = [state for state in states if state not in FINAL]
    state = failed[0] if failed else going[0] if going else JobState.COMPLETED
    return SlurmJob(job_id=job_id, state=state)


def _ended(sacct: Mapping[str, SlurmJob], job_id: str) -> bool:
    job = sacct.get(job_id)
    return job is not None and job.done


def dependency_problem(kind: str, job: SlurmJob) -> Optional[str]:
    """Why a dependency of KIND on JOB cannot do what the user meant (None: it can)."""
    if job.state is JobState.UNKNOWN:
        return (
            f"Slurm knows no job {job.job_id} (it would drop the dependency and start this job at once): "
            "`meshrun status` or squeue lists the ids"
        )
    if kind == "ok" and job.state in FAILURE:
        return (
            f"job {job.job_id} ended {job.state}: afterok would never release this one; any:{job.job_id} runs it anyway"
        )
    if kind == "notok" and job.state in SUCCESS:
        return f"job {job.job_id} COMPLETED: afternotok would never release this one"
    return None


def sbatch_argv(script: str, job_name: str, chdir: str, after: Sequence[str] = ()) -> list[str]:
    # The literal job name travels here, as one argv word: sbatch's #SBATCH parser knows
    # no shell quoting, so the script carries only a sanitized label (render.sbatch_label).
    depends = dependency(after)
    return [
        "sbatch",
        "--parsable",
        f"--job-name={job_name}",
        f"--chdir={chdir}",
        *([f"--dependency={depends}"] if depends else []),
        script,
    ]


def parse_sbatch(output: str) -> str:
    """`sbatch --parsable` prints `ID` or `ID;CLUSTER`."""
    line = output.strip().splitlines()[-1] if output.strip() else ""
    job_id = line.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise ClusterError(f"sbatch printed no job id (got {output.strip()!r}); check the script and the partition")
    return job_id


def sacct_argv(job_ids: Sequence[str]) -> list[str]:
    ids = ",".join(check_job_id(j) for j in job_ids)
    # --duplicates: a requeued job's earlier runs too (REQUEUED, PREEMPTED rows, oldest first): its restart count,
    # which a program that reports no step (a framework's own loop) gives status no other way.
    return [
        "sacct",
        "--allocations",
        "--duplicates",
        "--parsable2",
        "--noheader",
        "--jobs",
        ids,
        "--format",
        ",".join(SACCT_FIELDS),
    ]


def squeue_argv(job_ids: Sequence[str]) -> list[str]:
    ids = ",".join(check_job_id(j) for j in job_ids)
    # --array: one row per array task (12_3), not one folded row (12_[3-9]) for the pending ones.
    return ["squeue", "--noheader", "--array", "--states=all", "--jobs", ids, "--format", SQUEUE_FORMAT]


def scancel_argv(job_id: str, signal: Optional[str] = None) -> list[str]:
    argv = ["scancel"]
    if signal:
        if not re.fullmatch(r"[A-Z0-9]+", signal):
            raise ClusterError(f"signal {signal!r} is not a signal name like USR1")
        argv.append(f"--signal={signal}")
    return argv + [check_job_id(job_id)]


def _state_word(text: str) -> str:
    # sacct writes "CANCELLED by 0"; squeue can append a '+' on some versions.
    return text.split()[0].rstrip("+").upper() if text.strip() else ""


def state_of(text: str) -> JobState:
    """A state column of squeue or sacct as meshrun's state (UNKNOWN when empty or not in STATES)."""
    return STATES.get(_state_word(text), JobState.UNKNOWN)


def unknown_state_note(text: str) -> Optional[str]:
    """For a state name STATES lacks: a reason naming it (the person still sees Slurm's word); else None."""
    word = _state_word(text)
    return f"Slurm state {word}" if word and word not in STATES else None


def cancel_note(text: str, owner: Optional[str] = None) -> Optional[str]:
    """sacct's "CANCELLED by UID" as a reason: who ended it, the job's owner (`meshrun cancel`, scancel), Slurm
    itself or an administrator (uid 0), or another uid."""
    words = text.split()
    if len(words) == 3 and _state_word(text) == "CANCELLED" and words[1] == "by" and words[2].isdigit():
        if words[2] == owner:
            return f"cancelled by its owner (uid {owner})"
        return "cancelled by Slurm or an administrator (uid 0)" if words[2] == "0" else f"cancelled by uid {words[2]}"
    return None


def parse_sacct(output: str) -> dict[str, SlurmJob]:
    """One SlurmJob per job id from `sacct --allocations --duplicates --parsable2` with SACCT_FIELDS: the newest
    run's row, with the earlier runs' rows (a requeue's) counted as its restarts."""
    states: dict[str, SlurmJob] = {}
    runs: dict[str, int] = {}
    earlier: dict[str, int] = {}
    for line in output.splitlines():
        cols = line.split("|")
        if len(cols) < SACCT_READ:
            continue
        job_id, _name, state, exit_code, elapsed, limit, nodes = cols[:SACCT_READ]
        owner = cols[SACCT_READ].strip() if len(cols) > SACCT_READ else None
        tres = cols[SACCT_READ + 1] if len(cols) > SACCT_READ + 1 else None
        if "." in job_id:  # a step row; --allocations should have removed it
            continue
        if job_id in states:  # a later run of a requeued job: the earlier one's time counts in its life
            earlier[job_id] = earlier.get(job_id, 0) + (seconds(states[job_id].elapsed) or 0)
        runs[job_id] = runs.get(job_id, 0) + 1
        states[job_id] = SlurmJob(
            job_id=job_id,
            state=state_of(state),
            exit_code=exit_code or None,
            elapsed=elapsed or None,
            time_limit=limit or None,
            nodes=nodes or None,
            reason=unknown_state_note(state) or cancel_note(state, owner),
            gpus=allocated_gpus(tres),
            restarts=runs[job_id] - 1,
            earlier_s=earlier.get(job_id, 0),
        )
    return states


def allocated_gpus(tres: Optional[str]) -> Optional[int]:
    """GPUs in sacct's AllocTRES ("billing=16,cpu=16,gres/gpu=8,mem=64G,node=1"; a typed "gres/gpu:h100=8" is the
    same GPUs again); 0 when it lists none, None when there is no AllocTRES (a job not allocated yet)."""
    if not tres:
        return None
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "gres/gpu" and value.strip().isdigit():
            return int(value)
    return 0


def parse_squeue(output: str) -> dict[str, SlurmJob]:
    """One SlurmJob per job id from `squeue -o SQUEUE_FORMAT`."""
    states: dict[str, SlurmJob] = {}
    for line in output.splitlines():
        cols = line.strip().split("|")
        if len(cols) != 6:
            continue
        job_id, state, elapsed, limit, nodes, reason = cols
        states[job_id] = SlurmJob(
            job_id=job_id,
            state=state_of(state),
            elapsed=elapsed or None,
            time_limit=limit or None,
            nodes=nodes or None,
            reason=unknown_state_note(state) or (None if reason in ("None", "") else reason),
        )
    return states


def merge_states(
    job_ids: Iterable[str], sacct: dict[str, SlurmJob], squeue: dict[str, SlurmJob]
) -> dict[str, SlurmJob]:
    """Accounting is the record, but it trails squeue by seconds: a live squeue row wins
    while sacct has not caught up (except an end: that waits for accounting's exit code), and a job neither
    knows is UNKNOWN. A job squeue still lists as
    COMPLETING is not done whatever sacct says: its processes are ending (the sidecars' last checkpoint
    copies), and a resume or a CKPT read now would race them."""
    merged: dict[str, SlurmJob] = {}
    for job_id in job_ids:
        acct, live = sacct.get(job_id), squeue.get(job_id)
        ending = live is not None and live.state is JobState.COMPLETING
        if acct and (acct.done or not live) and not ending:
            merged[job_id] = acct
        elif acct and live and live.done:
            # squeue says how it ended, accounting has not recorded it yet, nor its exit code: the job stays as
            # accounting last had it for those seconds, never shown ended with a stale exit code ("0:0")
            merged[job_id] = acct
        elif live:
            merged[job_id] = (
                live if not acct else SlurmJob(**{**acct.__dict__, "state": live.state, "reason": live.reason})
            )
        else:
            merged[job_id] = SlurmJob(job_id=job_id, state=JobState.UNKNOWN)
    return merged


def seconds(text: Optional[str]) -> Optional[int]:
    """Slurm durations ([D-]HH:MM:SS, MM:SS) -> seconds; None for UNLIMITED or unknown."""
    if not text or not re.match(r"^(\d+-)?\d+(:\d+){0,2}$", text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s
