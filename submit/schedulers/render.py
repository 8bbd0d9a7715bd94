"""Rendering: a plan -> its scheduler's script (the sbatch script, the local run.sh), through templates/ (Jinja2).

The backend that renders hands itself in (`render(plan, self)` in its dryrun): its template and its
interpreter are all this module asks of it, and it never looks a scheduler up.

Quote by default: every `{{ value }}` is shell-quoted by the environment's
finalize hook and refused if it holds a newline or a control character. Only
values wrapped in `Verbatim` (the cluster profile's trusted setup lines) pass
through as written.
"""

from __future__ import annotations

import math
import posixpath
import re
import shlex
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Optional

import jinja2

from meshrun.launcher.contract import exitcodes
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import dumps_run_spec
from meshrun.submit import __version__
from meshrun.submit.config.cluster import check_node_names
from meshrun.submit.config.resources import template_source
from meshrun.submit.core.plan import Plan, format_time
from meshrun.submit.errors import InputError, InternalError
from meshrun.submit.folders import own_cache
from meshrun.submit.transport import seal

if TYPE_CHECKING:
    from meshrun.submit.schedulers.base import Backend

VERSION = __version__
"""The meshrun that renders: the script's header and spec.json record it."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


class Verbatim(str):
    """A trusted string rendered as written (cluster setup lines only)."""


def _finalize(value: Any) -> str:
    if isinstance(value, Verbatim):
        return value
    if value is None or isinstance(value, (dict, list, tuple)):
        raise InternalError(f"the template rendered a non-scalar {value!r}")
    text = str(value)
    if _CONTROL.search(text):
        raise InputError("template", text, "newlines and control characters are refused in scripts")
    return shlex.quote(text)


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(template_source),  # package data: a wheel's or a checkout's templates/
        bytecode_cache=compiled_templates(),
        undefined=jinja2.StrictUndefined,
        finalize=_finalize,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def compiled_templates() -> Optional[jinja2.BytecodeCache]:
    """The templates compiled once, in the user's cache folder: compiling them took ~25 ms of every `render`
    and `submit`. Jinja keys each by its template's source, so an edited or upgraded template compiles again.
    Loading runs the cached code, so the folder serves only when it is this user's and no one else can write
    it (`own_cache`); otherwise every call compiles, as before."""
    folder = own_cache("templates")
    return None if folder is None else jinja2.FileSystemBytecodeCache(str(folder))


def sbatch_label(name: str) -> str:
    """A #SBATCH-safe job name: sbatch's own directive parser knows no shell quoting,
    so the literal name travels as an argv `--job-name` (see slurm.sbatch_argv)."""
    return _LABEL_UNSAFE.sub("_", name)[:128] or "meshrun"


def _name(word: str) -> Verbatim:
    """A run-dir file name from the contract, rendered as written (it is checked to need no quoting)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", word):
        raise InternalError(f"run-dir name {word!r} would need quoting")
    return Verbatim(word)


def _setup_lines(plan: Plan) -> list[Verbatim]:
    lines = []
    for i, line in enumerate(plan.cluster.setup):
        if _CONTROL.search(line):
            raise InputError(f"setup[{i}]", line, "one shell line per list item; no newlines or control characters")
        lines.append(Verbatim(line))
    return lines


LAUNCHER = "meshrun.launcher"
"""The module every rank runs (`python -m meshrun.launcher RUN_DIR`)."""


def _rank_command(plan: Plan) -> tuple[list[str], list[str]]:
    """(srun flags, the command words before the run dir) for the container runtime, if any."""
    python = [plan.cluster.python, "-m", LAUNCHER]
    box = plan.cluster.container
    if box is None:
        return [], python
    if box.runtime == "pyxis":
        flags = [f"--container-image={box.image}"]
        if box.mounts:
            flags.append(f"--container-mounts={','.join(box.mounts)}")
        return flags, python
    binds = [word for mount in box.mounts for word in ("--bind", mount)]
    gpu = ["--nv"] if plan.spec.resources.gpus_per_node else []
    return [], ["apptainer", "exec", *gpu, *binds, box.image, *python]


def _signal_seconds(plan: Plan) -> int:
    """How long before the time limit Slurm sends its warning (USR1): the profile's, at most half the job's time."""
    return min(plan.cluster.defaults.signal_seconds, max(plan.time_seconds // 2, 1))


def time_limit_backstop_s(signal_seconds: int) -> int:
    """After the time limit's warning, when the batch shell requeues a job whose ranks have not stopped: 10 s (at
    least 5, a sixth of the lead) before the limit, never sooner than half the lead. A program that saves and
    exits in time never meets it; one whose own save-and-requeue hung (Lightning's handler, waiting in a barrier
    for a rank inside an all-reduce) would otherwise end TIMEOUT, which Slurm never requeues."""
    return max(signal_seconds - max(signal_seconds // 6, 5), signal_seconds // 2, 1)


SIDECAR_STOP_MARGIN_S = 5
"""Beyond sidecar.final_copy_s, how long the batch script waits for the sidecar to stop by itself."""


def _sidecar_command(rank_command: list[str], module: str = "meshrun.launcher.sidecar") -> list[str]:
    """A node-side module's command words (the sidecar, the requeue policy): the ranks' own (python, or the
    container's), another module."""
    if rank_command[-1] != LAUNCHER:
        raise InternalError(f"rank command {rank_command!r} does not end with the launcher module")
    return [*rank_command[:-1], module]


def context(plan: Plan, python: str) -> dict[str, Any]:
    """The template's values; `python` is the interpreter the script runs (the backend's, for the profile)."""
    spec, cluster, res = plan.spec, plan.cluster, plan.spec.resources
    srun_flags, rank_command = _rank_command(plan)
    return {
        "version": VERSION,
        "cluster_name": cluster.name,
        "job_name": spec.name,
        "sbatch_job_name": sbatch_label(spec.name),
        "nodes": res.nodes,
        "tasks_per_node": spec.tasks_per_node,
        "gpus_per_node": res.gpus_per_node,
        "cpus_per_task": res.cpus_per_task,
        "time": format_time(plan.time_seconds),
        "partition": plan.partition.name if plan.partition else None,
        "account": cluster.defaults.account,
        "qos": cluster.defaults.qos,
        "constraint": cluster.defaults.constraint,
        "exclusive": cluster.defaults.exclusive,
        "exclude": ",".join(check_node_names("defaults.exclude", cluster.defaults.exclude)),
        "memory_gb": res.memory_gb,
        "signal_seconds": _signal_seconds(plan),
        "backstop_s": time_limit_backstop_s(_signal_seconds(plan)),
        "run_dir": plan.run_dir,
        # sbatch reads % in --output as a pattern (%j, %a): a literal one is written %%.
        "output_prefix": plan.run_dir.replace("%", "%%"),
        # Run-dir names from the contract: constant, file-name-safe words, written as they are.
        "logs_dir": _name(RunDir.LOGS),
        "spec_file": _name(RunDir.SPEC),
        "tasks_dir": _name(RunDir.TASKS),
        "spec_json": Verbatim(dumps_run_spec(plan.run_spec).rstrip("\n")),
        "setup": _setup_lines(plan),
        # Keys are checked environment names (ClusterProfile), so the test may be verbatim.
        "nccl_env": [
            (key, Verbatim(f'"${{{key}+x}}"'), value) for key, value in sorted(cluster.interconnect.nccl.items())
        ],
        "job_env": sorted(spec.env.items()),
        "sidecar": True,  # one `python -m meshrun.launcher.sidecar` per node beside the ranks (launcher/sidecar)
        "sidecar_command": _sidecar_command(rank_command),
        "sidecar_stop_s": math.ceil(spec.sidecar.final_copy_s) + SIDECAR_STOP_MARGIN_S,
        "python": python,
        "python_dir": posixpath.dirname(python),
        "srun_flags": srun_flags,
        "rank_command": rank_command,
        "max_requeues": spec.checkpoint.max_requeues,
        "requeue_command": _sidecar_command(rank_command, "meshrun.launcher.batch.requeue"),
        "attempt_command": _sidecar_command(rank_command, "meshrun.launcher.batch.attempt"),
        "spare_nodes": spec.resilience.spare_nodes,
        "max_restarts_in_job": spec.resilience.max_restarts,
        "health_gate": spec.resilience.health_check,
        # A SIGTERM to the batch shell: the built-in trainer's ranks hear USR1 from it too; a `command:` job's
        # program only Slurm's own TERM (its USR1 may mean "requeue me": Lightning's does).
        "term_tells_ranks": spec.command is None,
        "health_command": _sidecar_command(rank_command, "meshrun.launcher.probes.health"),
        "gate_command": _sidecar_command(rank_command, "meshrun.launcher.batch.gate"),
        "health_timeout_s": math.ceil(spec.resilience.health_timeout_s),
        "health_dir": _name(RunDir.HEALTH),
        "exit_unhealthy": exitcodes.EXIT_UNHEALTHY,
        "exit_requeue": exitcodes.EXIT_REQUEUE,
        "exit_no_progress": exitcodes.EXIT_NO_PROGRESS,
        "exit_file": _name(RunDir.EXIT_CODE),
        "rank_error_file": _name(RunDir.RANK_ERROR),
        "exit_input": exitcodes.EXIT_INPUT,
        "exit_gave_up": exitcodes.EXIT_GAVE_UP,
        "exit_diverged": exitcodes.EXIT_DIVERGED,
        "code_dir": plan.code_dir,
        # The batch script checks its code folder is the sealed snapshot before the ranks start from it.
        "code_seal": plan.code_seal[0] if plan.code_dir and plan.code_seal else None,  # the manifest's sha256
        "verify_function": Verbatim(seal.VERIFY_FUNCTION),
        "array_size": len(plan.tasks),
    }


def render(plan: Plan, backend: Backend) -> str:
    """The job's script for `backend`, the plan's scheduler's (sbatch script, or the local run.sh). Pure."""
    template = backend.template
    python = backend.interpreter(plan.cluster)
    try:
        return environment().get_template(template).render(**context(plan, python))
    except jinja2.UndefinedError as exc:
        raise InternalError(f"template {template}: {exc}") from None
