"""The submit side of a job's secrets (spec `secrets:`, launcher/contract/spec/secrets.py): checked when the job is planned,
sent when it is scheduled, never written where a person or Slurm keeps things.

- plan time (before any connection): every `env:` source is set here and every `file:` source that this
  machine sees is private; a name that the cluster's network preset sets is refused;
- the request names the files and where each value is read from (a variable of this environment), never
  a value, so printing it (`--dry-run`) shows names and sources only (submit/schedulers/base.py builds that
  part of it from the plan: `secret_files`, `start_argv`);
- schedule: the values go over the transport's input channel (the tar of `put`; over SSH, the channel's
  stdin, never a command line) into the run's private secrets folder, before the job can start; the
  scheduler's start command runs under `env -u NAME...`, so sbatch (whose environment Slurm stores with
  AccountingStoreFlags=job_env and passes to the job) never holds a secret's name or its source's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence

from meshrun.launcher.contract.spec import secrets as ls
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.submit.errors import InputError
from meshrun.submit.transport.base import Upload

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import JobSpec, RunSpec
    from meshrun.submit.config.cluster import ClusterProfile
    from meshrun.submit.transport.base import Transport


def check(spec: JobSpec, cluster: ClusterProfile, visible: bool) -> None:
    """Plan-time checks: names against the cluster's preset, `env:` sources set here, `file:` sources private
    where this machine sees the cluster's files (`visible`: the local cluster or a login node)."""
    for name, source in spec.secrets.items():
        key = f"secrets.{name}"
        if name in cluster.interconnect.nccl:
            raise InputError(key, name, f"the cluster profile's network preset sets {name}; pick another name")
        if source.env is not None:
            env_value(key, source.env)
        elif visible and source.file is not None:
            file_value(f"{key}.file", os.path.expanduser(source.file))


def file_value(key: str, path: str) -> str:
    """A `file:` source's value, read here (where this machine sees the file); InputError when it is not private."""
    try:
        return ls.read_private_file(key, path)
    except SchemaError as exc:
        raise InputError(exc.key, exc.value, exc.fix) from None


def env_value(key: str, var: str) -> str:
    """The value of `var` in this environment, checked; InputError naming the variable (never the value)."""
    value = os.environ.get(var)
    if value is None:
        raise InputError(
            f"{key}.env",
            var,
            f"{var} is not set where meshrun submit runs: export it first, or give a {{file: PATH}} source",
        )
    try:
        return ls.check_value(f"{key}.env", os.fsencode(value), var)
    except SchemaError as exc:
        raise InputError(exc.key, exc.value, exc.fix) from None


def sources(spec: JobSpec) -> dict[str, str]:
    """{NAME: env:VAR | file:PATH}: what --dry-run shows."""
    return {name: source.describe() for name, source in spec.secrets.items()}


def env_names(specs: Sequence[JobSpec]) -> list[str]:
    """The variables kept out of the scheduler's environment: every secret's name and every `env:` source."""
    names = {name for spec in specs for name in spec.secrets}
    names |= {s.env for spec in specs for s in spec.secrets.values() if s.env is not None}
    return sorted(names)


def scrubbed(argv: Sequence[str], specs: Sequence[JobSpec]) -> tuple[str, ...]:
    """`argv` run under `env -u NAME...` (names only: never a value) when the job has secrets, else as is."""
    names = env_names(specs)
    if not names:
        return tuple(argv)
    return ("env", *[word for name in names for word in ("-u", name)], *argv)


def send(folder: str, files: Mapping[str, str], transport: Transport) -> None:
    """Read each value from this environment now and put it into `folder` on the cluster (0700, files 0600),
    over the transport's input channel. Nothing to do for a job without `env:` secrets."""
    if not files:
        return
    uploads = {
        rel: Upload(env_value(f"secrets.{rel.rsplit('/', 1)[-1]}", var).encode(), 0o600) for rel, var in files.items()
    }
    transport.put(uploads, folder, timeout=120)


def resend(run_spec: RunSpec, run_dir: str, transport: Transport) -> None:
    """`meshrun resume`: the secrets folder went when the job ended; send its values again from this
    environment (a variable missing here is bad input, before anything starts)."""
    files = {name: str(s.env) for name, s in run_spec.job.secrets.items() if s.env is not None}
    send(ls.secrets_dir_for(run_dir), files, transport)


def forget_argv(run_dirs: Sequence[str], whole_array: bool) -> list[str]:
    """`rm -rf` of the runs' secrets folders (`meshrun cancel`; absent folders are fine): a whole array's
    folder, or each job's own."""
    if whole_array:
        folders = {ls.secrets_dir_for(run_dir.rsplit("/tasks/", 1)[0]) for run_dir in run_dirs}
    else:
        folders = {ls.secrets_dir_for(run_dir) for run_dir in run_dirs}
    return ["rm", "-rf", "--", *sorted(folders)]
