"""Secrets: environment values a job names (spec `secrets:`) but that are never written down.
Torch-free, stdlib only: part of the contract `submit` may import.

A job spec maps each variable NAME to a source, never to a value:

    secrets:
      WANDB_API_KEY: {env: WANDB_API_KEY}     # the environment `meshrun submit` runs in, read at submit time
      HF_TOKEN: {file: ~/.config/hf/token}    # a file the ranks read, private to its owner (0600 or 0400)

The values reach the ranks' environment at rank start (meshrun.launcher.rank.entry) and nowhere else: not the script,
the run dir, spec.json (names and sources only), the logs, sbatch's argv or environment, nor Slurm's job
record. An `env:` value travels over the transport's input channel into a private folder beside the run
dir (`secrets_dir_for`, a function of the run dir alone: 0700, one 0600 file per name), which the batch script's final requeue decision
(meshrun.launcher.batch.requeue), the local supervisor and `meshrun cancel` remove.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping, Optional

from meshrun.launcher.contract.spec.schema import SchemaError, check_text

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""An environment variable's name (job spec `env:` and `secrets:` keys, `env:` sources)."""

MAX_BYTES = 64 * 1024
"""A secret's size limit: exec refuses an environment string above 128 KiB (MAX_ARG_STRLEN)."""

RESERVED_PREFIXES = ("MESHRUN_", "SLURM_", "SUBMITIT_", "TORCHELASTIC_", "TORCH_FR_", "TORCH_NCCL_")
"""Variables meshrun, Slurm, submitit and torch's flight recorder set for the ranks: a secret would shadow them."""

RESERVED_NAMES = frozenset(
    {
        # meshrun.launcher.rank.env.torchrun_vars
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        # meshrun.launcher.rank.entry and meshrun.launcher.report
        "OMP_NUM_THREADS",
        "DS_ACCELERATOR",
        "PYTHONPATH",
        "CUDA_VISIBLE_DEVICES",
        # what every process runs by: a "secret" there is a mistake
        "PATH",
        "HOME",
        "USER",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
    }
)


@dataclass(frozen=True)
class SecretSource:
    """Where one secret's value comes from: exactly one of `file` and `env`."""

    file: Optional[str] = None
    """A file as the ranks see it (absolute, or ~/... in the cluster user's home), on a filesystem every node
    shares; only its owner may read it (mode 0600 or 0400). Read by every rank at start (and checked at
    submit where this machine sees it). One trailing newline is dropped."""
    env: Optional[str] = None
    """A variable of the environment `meshrun submit` runs in (a login node, a laptop), read at submit time
    and sent to the cluster over the transport's input channel, never on a command line."""

    def describe(self) -> str:
        """`env:NAME` or `file:PATH`: what --dry-run and errors show (never a value)."""
        return f"env:{self.env}" if self.env is not None else f"file:{self.file}"


HIDDEN = "(not shown)"
"""What an error shows in place of anything given under `secrets:` that could be a value."""


def parse_secrets(raw: Any, env: Mapping[str, str]) -> dict[str, SecretSource]:
    """The spec's `secrets:` section, checked: each name a variable name, not in `env:`, not one meshrun or
    the scheduler sets, with exactly one source. Parsed here, not by the schema, so that an error never
    echoes what was given where a source belongs: `TOKEN: sk-123` or `{value: sk-123}` is a value."""
    if raw is None:  # `secrets:` with nothing under it
        return {}
    if not isinstance(raw, Mapping):
        raise SchemaError("secrets", HIDDEN, "expected a mapping of NAME: {env: VAR} or NAME: {file: PATH}")
    return {str(name): _source(str(name), given, env) for name, given in raw.items()}


def _source(name: str, given: Any, env: Mapping[str, str]) -> SecretSource:
    key = f"secrets.{name}"
    if not ENV_KEY.fullmatch(name):
        raise SchemaError(key, name, "environment variable names match [A-Za-z_][A-Za-z0-9_]*")
    if name in env:
        raise SchemaError(key, name, f"{name} is also in env: (readable by anyone who reads the script); keep one")
    if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
        raise SchemaError(key, name, "meshrun or the scheduler sets this variable for the ranks; pick another name")
    if isinstance(given, SecretSource):
        given = {"file": given.file, "env": given.env}
    where = "give where the value comes from, never the value: {env: VAR} or {file: PATH}"
    if not isinstance(given, Mapping):
        raise SchemaError(key, HIDDEN, where)
    unknown = sorted(str(k) for k in given if k not in ("file", "env"))
    if unknown:
        raise SchemaError(f"{key}.{unknown[0]}", HIDDEN, f"unknown key; {where}")
    file, var = given.get("file"), given.get("env")
    if (file is None) == (var is None):
        raise SchemaError(key, HIDDEN, f"give exactly one of env: and file:; {where}")
    if var is not None and not (isinstance(var, str) and ENV_KEY.fullmatch(var)):
        raise SchemaError(f"{key}.env", HIDDEN, "name an environment variable: [A-Za-z_][A-Za-z0-9_]*")
    if file is not None and not (isinstance(file, str) and file.startswith(("/", "~/")) and len(file) > 2):
        raise SchemaError(f"{key}.file", HIDDEN, "give an absolute path as the ranks see it (or ~/...)")
    if file is not None:
        check_text(f"{key}.file", file)
    return SecretSource(file=file, env=var)


def secrets_dir_for(run_dir: str) -> str:
    """The private folder holding a run's `env:` secrets: beside the run dir, never inside it (RUNS/.NAME.secrets);
    a sweep task's is its own folder in the sweep's (RUNS/.NAME.secrets/tasks/N), so each task removes its own."""
    path = run_dir.rstrip("/")
    task = re.fullmatch(r"(.+)/tasks/([0-9]+)", path)
    if task:
        return f"{_beside(task[1])}/tasks/{task[2]}"
    return _beside(path)


_SECRETS_DIR = re.compile(r".*/\.[^/]+\.secrets(/tasks/[0-9]+)?")


def _beside(path: str) -> str:
    parent, _, name = path.rpartition("/")
    return f"{parent}/.{name}.secrets"


def check_value(key: str, data: bytes, where: str) -> str:
    """A secret's bytes -> its text (one trailing newline dropped); SchemaError never shows the value."""
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise SchemaError(key, where, "the secret is empty; put the value there")
    if len(data) > MAX_BYTES:
        raise SchemaError(
            key, where, f"the secret is over {MAX_BYTES // 1024} KiB; an environment value cannot hold it"
        )
    if b"\0" in data:
        raise SchemaError(key, where, "the secret holds a NUL byte, which no environment value can")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SchemaError(key, where, "the secret is not UTF-8 text") from None


def read_private_file(key: str, path: str) -> str:
    """The value in `path` (a regular file of this user, readable by no one else); SchemaError otherwise.

    The checks run on the opened file (fstat), so a file swapped between check and read is still checked.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SchemaError(key, path, "no such file; create it (mode 0600) or fix the path") from None
    except OSError as exc:
        raise SchemaError(key, path, f"cannot be opened ({exc.strerror}); check the path and its folders") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SchemaError(key, path, "not a regular file; point at the file holding the value")
        if info.st_uid != os.geteuid():
            raise SchemaError(key, path, "owned by another user; a secret file must be yours (chown it, chmod 600)")
        if info.st_mode & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            raise SchemaError(key, path, f"mode {mode:04o} lets others read it; run `chmod 600 {path}`")
        data = os.read(fd, MAX_BYTES + 3)
    finally:
        os.close(fd)
    return check_value(key, data, path)


def rank_secrets(secrets: Mapping[str, SecretSource], run_dir: str) -> dict[str, str]:
    """Every secret's value, as a rank reads them at start: a `file:` from its file (`~` is this user's home),
    an `env:` from the file `meshrun submit` wrote into the run's secrets folder (secrets_dir_for)."""
    values: dict[str, str] = {}
    for name, source in secrets.items():
        key = f"secrets.{name}"
        if source.file is not None:
            values[name] = read_private_file(f"{key}.file", os.path.expanduser(source.file))
            continue
        folder = secrets_dir_for(run_dir)
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise SchemaError(
                key,
                source.describe(),
                f"the value sent at submit time is gone ({folder} is removed when the job ends or is "
                "cancelled); `meshrun resume` sends it again",
            )
        values[name] = read_private_file(key, path)
    return values


def apply(secrets: Mapping[str, SecretSource], run_dir: str, environ: MutableMapping[str, str]) -> list[str]:
    """Put the secrets into `environ` (this rank's, before training or exec); the names set."""
    values = rank_secrets(secrets, run_dir)
    environ.update(values)
    return sorted(values)


def remove_dir(secrets_dir: str) -> None:
    """Remove a run's secrets folder (the job reached a final state, or was cancelled); a sweep task's
    removes the sweep's folder too once the last task's is gone. Never raises: cleanup must not fail a job."""
    if not _SECRETS_DIR.fullmatch(secrets_dir.rstrip("/")):
        return  # only a folder secrets_dir_for names: an edited spec.json must not aim this elsewhere
    shutil.rmtree(secrets_dir, ignore_errors=True)
    parent = os.path.dirname(secrets_dir.rstrip("/"))
    if os.path.basename(parent) == "tasks":
        for folder in (parent, os.path.dirname(parent)):
            try:
                os.rmdir(folder)  # only when empty: other tasks may still run
            except OSError:
                return
