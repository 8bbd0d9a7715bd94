"""The interface every scheduler backend implements, and the request it submits.

Shaped like torchx's schedulers: `dryrun(plan)` builds a `Request` holding everything
that would be sent (the script, the argv that starts the job, the run-dir files), each
rendered once; `--dry-run` prints it; `schedule(request)` sends exactly that request.
The other verbs (status, cancel, logs, resume) go through the same backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec import secrets as ls
from meshrun.submit.core import secrets as job_secrets
from meshrun.submit.transport.base import Upload

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import JobSpec
    from meshrun.submit.config.cluster import ClusterProfile
    from meshrun.submit.core.plan import Plan
    from meshrun.submit.core.registry import JobRecord
    from meshrun.submit.core.status import Status
    from meshrun.submit.transport.base import Transport


@dataclass(frozen=True)
class Request:
    """One submission, complete: printed by `submit --dry-run`, sent as is by `schedule`."""

    scheduler: str
    """The backend that sends it."""
    run_dir: str
    """The run dir on the cluster."""
    script_path: str
    """Where the script lands (inside the run dir)."""
    script: str
    """The rendered script, byte for byte what is written."""
    argv: tuple[str, ...]
    """The command that starts the job on the cluster (sbatch ..., or the local start)."""
    files: Mapping[str, Upload] = field(default_factory=dict)
    """Every run-dir file written before the start, by path relative to the run dir (the script included)."""
    code_dir: Optional[str] = None
    """The code snapshot the ranks import, if the backend ships code."""
    array_tasks: int = 0
    """Job-array tasks (a sweep); 0 for a single job."""
    secrets_dir: str = ""
    """The private folder the job's `env:` secrets are sent into before the start ("" when it has none)."""
    secrets: Mapping[str, str] = field(default_factory=dict)
    """{file in secrets_dir: the variable of this environment its value is read from when sent}: names only,
    never a value (`secret_files`; submit/core/secrets.py sends the values)."""

    def as_json(self) -> dict[str, Any]:
        files = [
            {
                "path": f"{self.run_dir}/{rel}",
                "mode": oct(item.mode),
                "bytes": None if rel.endswith("/") else len(item.data) if isinstance(item.data, bytes) else None,
            }
            for rel, item in sorted(self.files.items())
        ]
        return {
            "scheduler": self.scheduler,
            "run_dir": self.run_dir,
            "script_path": self.script_path,
            "argv": list(self.argv),
            "files": files,
            "code_dir": self.code_dir,
            "secrets": {
                "dir": self.secrets_dir,
                "files": {rel: f"env:{var}" for rel, var in sorted(self.secrets.items())},
            },
            "script": self.script,
        }


def run_dir_files(plan: Plan, script_name: str, script: str) -> dict[str, Upload]:
    """The run dir as submitted: the spec as written, the resolved spec, the script, logs/, the generated
    DeepSpeed config of a deepspeed job (and each sweep task's spec, logs/ and DeepSpeed config: a sweep
    may change the batch or the ZeRO stage). Names come from the run-dir contract."""
    import yaml  # here, not at the top: `status`, `cancel` and `logs` load this module and never write a spec

    from meshrun.launcher.contract.spec.job import dumps_run_spec

    files = {
        RunDir.JOB_YAML: Upload(yaml.safe_dump(plan.submitted, sort_keys=False, allow_unicode=True).encode()),
        RunDir.SPEC: Upload(dumps_run_spec(plan.run_spec).encode()),
        script_name: Upload(script.encode(), 0o700),
        f"{RunDir.LOGS}/": Upload(b"", 0o700),
        **_deepspeed_config("", plan.spec),
    }
    for task in plan.tasks:
        prefix = f"{RunDir.TASKS}/{task.index}"
        files[f"{prefix}/{RunDir.SPEC}"] = Upload(dumps_run_spec(task.run_spec).encode())
        files[f"{prefix}/{RunDir.LOGS}/"] = Upload(b"", 0o700)
        files.update(_deepspeed_config(f"{prefix}/", task.run_spec.job))
    return files


def _deepspeed_config(prefix: str, job: JobSpec) -> dict[str, Upload]:
    """{prefix + deepspeed.json: the config} for a deepspeed job, for a person to inspect; else {}."""
    from meshrun.launcher.contract.spec import dsconfig

    if not dsconfig.uses_deepspeed(job):
        return {}
    return {f"{prefix}{RunDir.DEEPSPEED_CONFIG}": Upload(dsconfig.dumps(job).encode())}


def _specs(plan: Plan) -> list[JobSpec]:
    return [task.run_spec.job for task in plan.tasks] or [plan.spec]


def start_argv(plan: Plan, argv: Sequence[str]) -> tuple[str, ...]:
    """The plan's start command with its secrets kept out of the scheduler's environment (`env -u NAME...`)."""
    return job_secrets.scrubbed(argv, _specs(plan))


def secret_files(plan: Plan) -> tuple[str, dict[str, str]]:
    """(the secrets folder, {file in it: the variable of this environment it is read from}): `env:` secrets,
    one file per name; a sweep task's in `tasks/N/` (each task's folder is its own, removed when it ends)."""
    folder = ls.secrets_dir_for(plan.run_dir)
    if plan.tasks:
        files = {
            f"tasks/{task.index}/{name}": str(source.env)
            for task in plan.tasks
            for name, source in task.run_spec.job.secrets.items()
            if source.env is not None
        }
    else:
        files = {name: str(source.env) for name, source in plan.spec.secrets.items() if source.env is not None}
    return (folder, files) if files else ("", {})


class Backend(Protocol):
    """What meshrun needs from a scheduler."""

    name: str
    """The profile's `scheduler` value."""
    template: str
    """The script template in templates/."""
    ships_code: bool
    """The job runs from a code snapshot on the cluster (else from this machine's files, in place)."""
    over_ssh: bool
    """The cluster may be reached over SSH (a profile with `ssh:`); else it is this machine."""
    supports_arrays: bool
    """`--sweep` (job arrays)."""
    supports_dependencies: bool
    """`--after`."""

    def interpreter(self, profile: ClusterProfile) -> str:
        """The Python the job's script runs."""

    def check(self, spec: JobSpec, profile: ClusterProfile) -> None:
        """The backend's own plan-time checks (InputError)."""

    def dryrun(self, plan: Plan, after: Sequence[str] = ()) -> Request: ...

    def check_after(self, after: Sequence[str], transport: Transport) -> None:
        """`--after`'s jobs exist and can still release the new one (InputError), asked before it is sent."""

    def schedule(self, request: Request, transport: Transport) -> str:
        """Send the request; returns the job id."""

    def statuses(
        self, records: Sequence[JobRecord], transport: Transport, detail: bool = False, live: bool = False
    ) -> list[Status]:
        """One Status per record; `detail`: also the nodes' environment mismatches; `live`: also the loss
        history and the newest GPU samples (`meshrun top`)."""

    def cancel(self, records: Sequence[JobRecord], transport: Transport) -> None: ...

    def log_path(self, record: JobRecord, rank: Optional[int]) -> str:
        """Rank N's log, or (None) the batch shell's / local supervisor's log."""

    def restart(self, record: JobRecord, transport: Transport) -> str:
        """Start a stopped job's own script again in its run dir (`meshrun resume`); the new job id."""

    def poll_interval(self, elapsed_s: float) -> float:
        """How often `--wait` asks, so that a long wait does not hammer the scheduler."""
