"""The Slurm backend: sbatch, squeue + sacct, scancel, the batch log; over any transport.

A submit writes the run dir and runs `sbatch --parsable` in ONE round trip; status asks
squeue, one batched sacct, every run's metrics tail and the sidecars' findings (a hang's
verdict, stragglers, environment mismatches) in ONE remote command per cluster.
The command lines and parsers of Slurm's stable output are in `slurm_cli`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.submit.config.cluster import ClusterProfile
from meshrun.submit.core import secrets as job_secrets
from meshrun.submit.core.plan import Plan
from meshrun.submit.core.state import FINAL, JobState
from meshrun.submit.errors import InputError
from meshrun.submit.schedulers import slurm_cli
from meshrun.submit.schedulers.base import Request, run_dir_files, secret_files, start_argv
from meshrun.submit.transport.base import Result, Transport, batch, new_marker

if TYPE_CHECKING:  # the status side's modules are imported where a status is read: `render` never reads one
    from meshrun.submit.core import findings
    from meshrun.submit.core.registry import JobRecord
    from meshrun.submit.core.status import Status

BATCH_JOBS = 1000


class SlurmBackend:
    name = "slurm"
    template = "slurm.sbatch.j2"
    ships_code = True
    over_ssh = True
    supports_arrays = True
    supports_dependencies = True

    def interpreter(self, profile: ClusterProfile) -> str:
        return profile.python

    def check(self, spec: JobSpec, profile: ClusterProfile) -> None:
        return None

    def dryrun(self, plan: Plan, after: Sequence[str] = ()) -> Request:
        from meshrun.submit.schedulers.render import render

        slurm_cli.dependency(after)  # bad --after values fail before anything is sent
        run_dir = RunDir(plan.run_dir)
        script = render(plan, self)
        name = RunDir.SCRIPTS[self.name]
        sbatch = slurm_cli.sbatch_argv(run_dir.script(self.name), plan.spec.name, plan.run_dir, after)
        secrets_dir, secret_names = secret_files(plan)
        return Request(
            scheduler=self.name,
            run_dir=plan.run_dir,
            script_path=run_dir.script(self.name),
            script=script,
            argv=start_argv(plan, sbatch),  # sbatch's environment is stored: no secret in it
            files=run_dir_files(plan, name, script),
            code_dir=plan.code_dir,
            array_tasks=len(plan.tasks),
            secrets_dir=secrets_dir,
            secrets=secret_names,
        )

    def schedule(self, request: Request, transport: Transport) -> str:
        job_secrets.send(request.secrets_dir, request.secrets, transport)  # before the job can start
        done = transport.put(request.files, request.run_dir, then=request.argv, timeout=120)
        assert done is not None
        if done.returncode != 0:
            # Nothing is left behind by a failed submit: the run dir goes (it held only what we wrote).
            transport.run(["rm", "-rf", "--", request.run_dir, *([request.secrets_dir] if request.secrets_dir else [])])
            done.check("sbatch")
        return slurm_cli.parse_sbatch(done.stdout)

    def statuses(
        self, records: Sequence[JobRecord], transport: Transport, detail: bool = False, live: bool = False
    ) -> list[Status]:
        """ONE remote round trip per BATCH_JOBS jobs (the sidecars' findings and alerts of every job included;
        `live`: each job's loss history and newest GPU samples too)."""
        from meshrun.submit.core import findings

        if len(records) > BATCH_JOBS:  # keeps one command line well under sshd's packet limit (256 KiB)
            return [
                s
                for i in range(0, len(records), BATCH_JOBS)
                for s in self.statuses(records[i : i + BATCH_JOBS], transport, detail, live)
            ]
        marker = new_marker()
        extra = findings.findings_argv([r.run_dir for r in records], detail, marker, with_gpus=live)
        results = batch(transport, [*query_argvs(records, live), extra], timeout=120)
        states = states_from(records, results[0], results[1])
        tails, errors = results[2 : 2 + len(records)], results[2 + len(records) : 2 + 2 * len(records)]
        files = findings.split_findings(results[-1].stdout, len(records), marker)
        return [
            _status(
                record,
                states[record.job_id],
                tail,
                error,
                findings.findings_from(found, record.submitted_at, record.job_id),
                live,
            )
            for record, tail, error, found in zip(records, tails, errors, files)
        ]

    def check_after(self, after: Sequence[str], transport: Transport) -> None:
        """Slurm (22.05) drops a dependency on a job it does not know and starts the new one at once, and
        holds one that can never be met (afterok on a failed job) forever: both are refused here."""
        wanted = [slurm_cli.dependency_target(item) for item in after]
        ids = [job_id for _, job_id in wanted]
        squeue, sacct = batch(transport, [slurm_cli.squeue_argv(ids), slurm_cli.sacct_argv(ids)])
        if squeue.returncode != 0 and sacct.returncode != 0 and "Invalid job id" not in squeue.stderr:
            sacct.check("sacct and squeue")
        acct = slurm_cli.parse_sacct(sacct.stdout) if sacct.returncode == 0 else {}
        live = slurm_cli.parse_squeue(squeue.stdout) if squeue.returncode == 0 else {}
        for item, (kind, job_id) in zip(after, wanted):
            problem = slurm_cli.dependency_problem(kind, slurm_cli.dependency_state(job_id, acct, live))
            if problem is not None:
                raise InputError("--after", item, problem)

    def cancel(self, records: Sequence[JobRecord], transport: Transport) -> None:
        record = records[0]
        job_id = record.job_id.split("_")[0] if len(records) > 1 else record.job_id
        # The secrets folder goes with the cancel, in the same round trip (a pending job never ran to remove it).
        forget = job_secrets.forget_argv([r.run_dir for r in records], whole_array=len(records) > 1)
        batch(transport, [slurm_cli.scancel_argv(job_id), forget])[0].check("scancel")

    def log_path(self, record: JobRecord, rank: Optional[int]) -> str:
        run_dir = RunDir(record.run_dir)
        return run_dir.batch_log(record.job_id) if rank is None else run_dir.rank_log(rank)

    def restart(self, record: JobRecord, transport: Transport) -> str:
        from meshrun.submit.core.runspec import read_run_spec

        argv = slurm_cli.sbatch_argv(RunDir(record.run_dir).script(self.name), record.name, record.run_dir, ())
        run_spec = read_run_spec(record, transport)
        job_secrets.resend(run_spec, record.run_dir, transport)  # removed when the job ended
        argv = list(job_secrets.scrubbed(argv, [run_spec.job]))
        return slurm_cli.parse_sbatch(transport.run(argv, timeout=120).check("sbatch").stdout)

    def poll_interval(self, elapsed_s: float) -> float:
        """2 s, then 5 s, then 10 s."""
        return 2.0 if elapsed_s < 30 else 5.0 if elapsed_s < 300 else 10.0


CLOCK_ARGV = ("date", "+%Y-%m-%dT%H:%M:%S")
"""The login node's clock, as `sbatch --test-only` prints its estimate (local time, no zone): `-c any` reads each
estimate against it, asked just before, so that "starts now" is a wait of 0 wherever and whenever it was asked."""


UNSCHEDULED = ("--job-name=", "--output=", "--error=", "--open-mode=", "--signal=", "--requeue")
"""#SBATCH options that name or log the job, or say what happens at its end: Slurm's start estimate is the same
without them."""


def scheduled_by(script: str) -> tuple[str, ...]:
    """The script's #SBATCH options that Slurm schedules by (nodes, time, partition, account, ...): two scripts
    with the same ones get the same `sbatch --test-only` answer on one cluster, so `-c any` asks it once."""
    options = (line.split(None, 1)[1].strip() for line in script.splitlines() if line.startswith("#SBATCH "))
    return tuple(sorted(o for o in options if not o.startswith(UNSCHEDULED)))


def free_nodes_argv(partition: str) -> list[str]:
    """sinfo's node counts by state in the partition (a fixed format: `COUNT STATE` a line)."""
    return ["sinfo", "--noheader", f"--partition={partition}", "--format=%D %t"]


def free_nodes(result: Result) -> Optional[int]:
    """The partition's idle nodes from free_nodes_argv's answer (`idle` only: not `idle*`, which does not
    respond, nor drained or mixed nodes); None when sinfo did not answer."""
    if result.returncode != 0:
        return None
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
    try:
        return sum(int(row[0]) for row in rows if len(row) == 2 and row[1] == "idle")
    except ValueError:
        return None


def query_argvs(records: Sequence[JobRecord], live: bool = False) -> list[list[str]]:
    """squeue, sacct, one metrics tail per job (`live`: the loss history's lines), then each job's first
    rank error (if any): what the single round trip runs."""
    from meshrun.submit.core.status import metrics_tail_bytes

    ids = [r.job_id for r in records]
    size = str(metrics_tail_bytes(live))
    tails = [["tail", "-c", size, "--", RunDir(r.run_dir).metrics] for r in records]
    errors = [["head", "-c", "500", "--", RunDir(r.run_dir).rank_error] for r in records]
    return [slurm_cli.squeue_argv(ids), slurm_cli.sacct_argv(ids), *tails, *errors]


def states_from(records: Sequence[JobRecord], squeue: Result, sacct: Result) -> dict[str, slurm_cli.SlurmJob]:
    """Merge both answers; raise only when neither scheduler command worked."""
    if squeue.returncode != 0 and sacct.returncode != 0 and "Invalid job id" not in squeue.stderr:
        sacct.check("sacct and squeue")
    acct = slurm_cli.parse_sacct(sacct.stdout) if sacct.returncode == 0 else {}
    live = slurm_cli.parse_squeue(squeue.stdout) if squeue.returncode == 0 else {}
    merged = slurm_cli.merge_states([r.job_id for r in records], acct, live)
    for record in records:  # accounting off and slurmctld forgot the job: keep what meshrun last saw
        if merged[record.job_id].state is JobState.UNKNOWN and record.last_state in FINAL:
            merged[record.job_id] = slurm_cli.SlurmJob(job_id=record.job_id, state=JobState(record.last_state))
    return merged


def _exit_code(text: Optional[str]) -> Optional[int]:
    """sacct's ExitCode is CODE:SIGNAL. A job ended by a signal (a cancel: 0:15) has no code of its own:
    None, not a 0 that reads as success."""
    head, _, signal = (text or "").partition(":")
    if not head.isdigit() or (head == "0" and signal.isdigit() and signal != "0"):
        return None
    return int(head)


def _whole_life(job: slurm_cli.SlurmJob) -> Optional[int]:
    """ELAPSED: every run of the job (a requeued job's earlier ones too), not only the newest."""
    now = slurm_cli.seconds(job.elapsed)
    return now + job.earlier_s if now is not None else (job.earlier_s or None)


def _status(
    record: JobRecord,
    job: slurm_cli.SlurmJob,
    tail: Result,
    error: Result,
    found: Optional[findings.Findings] = None,
    live: bool = False,
) -> Status:
    from meshrun.submit.core import findings
    from meshrun.submit.core.status import Status, parse_losses, parse_metrics_tail

    found = found if found is not None else findings.NOTHING
    text = tail.stdout if tail.returncode == 0 else ""
    progress = found.progress(parse_metrics_tail(text, record.job_id))
    rank_error = error.stdout.strip().splitlines()[0] if error.returncode == 0 and error.stdout.strip() else None
    # A failed job says why in the ranks' own words (bad input, a crash), as on the local cluster.
    reason = rank_error if job.done and not job.succeeded and rank_error else job.reason
    if progress.get("stopped") and not job.done and job.state is not JobState.RUNNING:
        # Requeued after a stop that was no finish (a framework's exit 0 on the preemption's SIGTERM): say so.
        reason = f"{progress['stopped']}; requeued" + (f" ({reason})" if reason and reason != "None" else "")
    if job.state is JobState.CANCELLED and progress.get("checkpoint_step") is not None:
        saved = f"checkpoint at step {progress['checkpoint_step']}: `meshrun resume {record.job_id}` continues it"
        reason = f"{reason}; {saved}" if reason else saved
    return Status(
        job_id=record.job_id,
        cluster=record.cluster,
        name=record.name,
        state=job.state,
        run_dir=record.run_dir,
        submitted_at=record.submitted_at,
        done=job.done,
        succeeded=job.succeeded,
        elapsed_s=_whole_life(job),
        time_limit_s=slurm_cli.seconds(job.time_limit),
        restarts=max(job.restarts, int(progress.get("restart_count") or 0)),
        reason=reason,
        progress=progress,
        exit_code=_exit_code(job.exit_code) if job.done else None,
        losses=parse_losses(text, record.job_id) if live else [],
        usage=found.usage(_whole_life(job), job.gpus),  # every run held its GPUs
        **found.status_fields(),
    )


BACKEND = SlurmBackend()
