"""Preflight: what would end the job in its first second, checked on the cluster before it queues.

A user's worst hour is the one spent in a queue for a job that dies at once: a data path that exists on the
laptop but not on the cluster, a `setup:` line that breaks the interpreter, a partition that does not exist.
Every submit (and `meshrun submit --check`, which submits nothing) asks the cluster, in ONE round trip of
batched commands, where the ranks will run:

- `slurm`: `sbatch --test-only` with the rendered script and its flags: Slurm says whether it can ever run
  the request (partition, account, QOS, node count, time, constraint) and when it would start;
- `files`: the files the ranks read (data, validation and blend files, `init_from`) exist and are readable,
  and each `file:` secret is its user's alone (existence and mode only: never its content);
- `environment`: the profile's `setup:` lines, then its interpreter: torch is there (and which version),
  and which meshrun, against the one that rendered the job;
- `space`: the checkpoint root has room for two checkpoints of the model (or `resilience.min_free_gb`);
- a `command:` job's program, when it is a name the ranks look up on PATH: there (`environment` on a cluster,
  after the setup lines; `program` on the local cluster).

Each failure is one line naming what, where and the fix. `--no-check` skips it (docs/guides/preflight.md).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from meshrun.launcher.contract.spec.modelshape import checkpoint_space_needed
from meshrun.launcher.contract.spec.tokens import SAMPLE_BYTES, Sample, sample_problem
from meshrun.submit import __version__
from meshrun.submit.core.plan import Plan
from meshrun.submit.schedulers.base import Request
from meshrun.submit.transport.base import Result, Transport, batch

# The rendered script goes to a private temporary file on the login node (mktemp: 0600), which
# `sbatch --test-only` reads and which is removed at once: nothing is queued, nothing else written.
TEST_ONLY = (
    'f=$(mktemp) || exit 1; printf "%s" "$1" > "$f"; shift; '
    'sbatch --test-only "$@" "$f" 2>&1; s=$?; rm -f -- "$f"; exit $s'
)
# A sweep's refusal names the cluster's MaxArraySize (Slurm says only "Invalid job array specification").
TEST_ARRAY = TEST_ONLY.replace(
    "exit $s", "[ $s = 0 ] || scontrol show config 2>/dev/null | grep -i '^MaxArraySize'; exit $s"
)
# The first argument says whether to look into the data files (0: the submit judged them already, on this
# machine, which sees them as the ranks will: the local cluster, a login node). Each argument pair after it is KEY PATH, `~/` meaning the cluster user's home. A file that is missing or unreadable
# prints `missing KEY PATH`; a secret (its key starts with `secrets.`) also `open KEY PATH` when others may
# read it, `notmine KEY PATH` when another user owns it; a data file `tokens KEY BYTES NON_NUL NON_ASCII MAX_ID
# RECORD PATH`: its size, the bytes of its first MiB that are not NUL (token ids have NULs; text has none) and those
# that are not printable ASCII or whitespace (plain text has none), the largest id
# there, and whether a record (PATH.json) is beside it (the same test as meshrun.launcher.contract.spec.tokens, in sh: the
# file is on the cluster only).
FILES = r"""
inspect=$1; shift
while [ "$#" -ge 2 ]; do
  k=$1 p=$2; shift 2
  case $p in "~/"*) p="$HOME/${p#"~/"}";; esac
  if [ ! -r "$p" ] || [ -d "$p" ]; then echo "missing $k $p"; continue; fi
  case $inspect$k in 1data.*)
    t=-tu2; case $p in *.u32) t=-tu4;; esac
    s=$(wc -c < "$p"); n=$(head -c 1048576 "$p" | tr -d '\000' | wc -c)
    a=$(head -c 1048576 "$p" | tr -d '\t\n\r\040-\176' | wc -c)
    m=$(head -c 1048576 "$p" | od -An -v $t | awk '{for (i = 1; i <= NF; i++) if ($i + 0 > m) m = $i + 0} END {print m + 0}')
    r=0; [ -r "$p.json" ] && r=1
    echo "tokens $k $s $n $a $m $r $p";;
  esac
  case $k in secrets.*)
    [ -O "$p" ] || { echo "notmine $k $p"; continue; }
    [ -z "$(find "$p" -maxdepth 0 -perm /077 2>/dev/null)" ] || echo "open $k $p";;
  esac
done
echo done
"""
# The free space (KiB) of the file system that holds the folder (or its nearest existing parent).
SPACE = r"""
p=$1; case $p in "~/"*) p="$HOME/${p#"~/"}";; esac
while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname -- "$p"); done
df -Pk -- "$p" | awk 'NR == 2 {print $4}'
"""
# Which torch and meshrun the interpreter sees, without importing torch (seconds on a login node).
VERSIONS = (
    "import importlib.metadata as m, importlib.util as u\n"
    "def v(name):\n"
    "    try:\n"
    "        return m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        return '-'\n"
    "print('torch', v('torch') if u.find_spec('torch') else '-')\n"
    "print('meshrun', v('meshrun'))\n"
)
START = re.compile(r"to start at (\S+) using .* on nodes (\S+) in partition (\S+)")


@dataclass(frozen=True)
class Check:
    what: str
    """slurm, files, environment, space."""
    ok: bool
    line: str
    """What was found; for a failure, what, where and the fix."""


@dataclass(frozen=True)
class Preflight:
    checks: tuple[Check, ...]
    start: Optional[str] = None
    """Slurm's estimate of when the job would start (`sbatch --test-only`), as it prints it."""

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def describe(self) -> list[str]:
        """One line per check, as `submit --check` prints them."""
        return [f"{'ok  ' if c.ok else 'FAIL'}  {c.what:<11} {c.line}" for c in self.checks]

    def failure_lines(self) -> list[str]:
        return [f"preflight: {c.what}: {c.line}" for c in self.failures]


def files_to_check(plan: Plan) -> list[tuple[str, str]]:
    """(key, path as the ranks see it) of every file the ranks read at start."""
    job = plan.spec
    found: list[tuple[str, str]] = []
    if job.command is None and job.train is not None:
        found.append(("data.path", job.data.path))
        if job.data.val_path:
            found.append(("data.val_path", job.data.val_path))
        found += [(f"data.blend[{i}].path", source.path) for i, source in enumerate(job.data.blend)]
        if job.train.init_from:
            found.append(("train.init_from", job.train.init_from))
    found += [(f"secrets.{name}", source.file) for name, source in job.secrets.items() if source.file]
    return found


def program_on_path(plan: Plan) -> Optional[str]:
    """A `command:` job's program when the ranks look it up on PATH (a bare name: `python3`, `torchrun`); None for
    the built-in trainer and for a path (one relative to the code snapshot is not on the cluster before the upload)."""
    command = plan.spec.command
    return command[0] if command and "/" not in command[0] else None


def commands(plan: Plan, request: Request, local: bool, inspect_data: bool = True) -> list[tuple[str, list[str]]]:
    """(check, argv) for one batched round trip; the scheduler's and the interpreter's only where the
    ranks run elsewhere than this process (`local`: the embedded cluster, whose interpreter is this one); the data
    files' contents only with `inspect_data` (False: the submit read them here already)."""
    found: list[tuple[str, list[str]]] = []
    if request.scheduler == "slurm":
        flags = [f"--job-name={plan.spec.name}", f"--chdir={plan.run_dir}"]
        found.append(("slurm", ["sh", "-c", TEST_ARRAY if plan.tasks else TEST_ONLY, "sh", request.script, *flags]))
    pairs = [word for pair in files_to_check(plan) for word in pair]
    found.append(("files", ["sh", "-c", FILES, "sh", "1" if inspect_data else "0", *pairs]))
    program = program_on_path(plan)
    if not local:
        # Each setup line as the batch script runs it (verbatim, its failure not fatal), marked when it fails.
        setup = "".join(f"{{ {line}\n}} || echo 'setup-failed {i}' >&2\n" for i, line in enumerate(plan.cluster.setup))
        script = f"{setup}{shlex.join([plan.cluster.python, '-c', VERSIONS])}\n"
        if program:  # after the setup lines, as the ranks look it up (a module may put it on PATH)
            script += (
                f"command -v -- {shlex.quote(program)} >/dev/null 2>&1 && echo 'program found' || echo 'program -'\n"
            )
        found.append(("environment", ["bash", "-c", script]))
    elif program:  # the local cluster's ranks run with this interpreter's folder first on PATH (local.sh.j2)
        look = 'PATH="$2${PATH:+:$PATH}"; command -v -- "$1" >/dev/null 2>&1 && echo found || echo -'
        found.append(("program", ["sh", "-c", look, "sh", program, os.path.dirname(sys.executable)]))
    found.append(("space", ["sh", "-c", SPACE, "sh", plan.run_spec.run.checkpoint_dir]))
    return found


def run(plan: Plan, request: Request, transport: Transport, local: bool, inspect_data: bool = True) -> Preflight:
    """Every check in one round trip (meshrun.launcher.contract.spec.modelshape sizes the checkpoints)."""
    planned = commands(plan, request, local, inspect_data)
    return judge(plan, planned, batch(transport, [argv for _, argv in planned], timeout=120))


def judge(plan: Plan, planned: Sequence[tuple[str, list[str]]], results: Sequence[Result]) -> Preflight:
    """The checks' verdicts from their commands' results (`submit -c any` runs several plans' commands in one
    round trip, and judges each plan's share here)."""
    checks: list[Check] = []
    start: Optional[str] = None
    for (what, _), result in zip(planned, results):
        if what == "slurm":
            check, start = _slurm(result, len(plan.tasks))
        elif what == "files":
            check = _files(result, plan.spec.train.model.vocab_size if plan.spec.train else 0)
        elif what == "environment":
            check = _environment(plan, result)
            checks += _program_there(plan, result)  # one label for the program's check, here and on `local`
        elif what == "program":
            check = _program(plan, result.stdout.strip() == "found", "on this machine", "program")
        else:
            check = _space(plan, result)
        checks.append(check)
    return Preflight(tuple(checks), start)


def _last_line(result: Result) -> str:
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {result.returncode}"


MAX_ARRAY = re.compile(r"^MaxArraySize\s*=\s*(\d+)", re.M | re.I)


def _slurm(result: Result, tasks: int = 0) -> tuple[Check, Optional[str]]:
    found = START.search(result.stdout + result.stderr)
    if result.returncode == 0 and found:
        start, nodes, partition = found.groups()
        return Check("slurm", True, f"Slurm can run it: on {nodes} in {partition}, estimated start {start}"), start
    limit = MAX_ARRAY.search(result.stdout)
    if tasks and limit and tasks > int(limit.group(1)):
        most = int(limit.group(1))  # array indexes run 0..MaxArraySize-1
        return Check(
            "slurm",
            False,
            f"Slurm refuses the sweep: its {tasks} tasks are more than the cluster's MaxArraySize={limit.group(1)} "
            f"allows (at most {most} tasks, indexes 0-{most - 1}); split the sweep, or ask the admins to raise it",
        ), None
    lines = [line for line in (result.stdout + result.stderr).splitlines() if not MAX_ARRAY.match(line)]
    result = Result(result.argv, result.returncode, "\n".join(lines), "")
    reason = _last_line(result).removeprefix("sbatch: error: ").removeprefix("allocation failure: ")
    if "Unable to contact slurm controller" in reason:
        return Check(
            "slurm", False, f"Slurm's controller did not answer ({reason}); try again, or ask the admins"
        ), None
    fix = "check resources (nodes, partition, time, account) against `sinfo` and the profile's partitions"
    return Check("slurm", False, f"Slurm refuses the request: {reason}; {fix}"), None


def _token_problem(fields: str, vocab: int) -> list[str]:
    """What a data file's `tokens` line says is wrong with it as token ids ([] when nothing), judged as
    meshrun.launcher.contract.spec.tokens judges a file this machine sees."""
    key, size, non_nul, non_ascii, top, record, path = (fields.split(" ", 6) + [""] * 7)[:7]
    try:
        nbytes, kept, odd, largest = int(size), int(non_nul), int(non_ascii), int(top)
    except ValueError:
        return []
    sampled = min(nbytes, SAMPLE_BYTES)
    sample = Sample(
        size=nbytes,
        width=4 if path.endswith(".u32") else 2,
        has_nul=kept < sampled,
        ascii_only=odd == 0,
        largest=largest,
        has_record=record == "1",
    )
    problem = sample_problem(sample, vocab)
    return [f"{key}: {path} {problem}"] if problem else []


def _files(result: Result, vocab: int = 0) -> Check:
    if result.returncode != 0 or not result.stdout.rstrip().endswith("done"):
        return Check("files", False, f"the file check did not run: {_last_line(result)}")
    problems = []
    for line in result.stdout.splitlines():
        word, _, rest = line.partition(" ")
        key, _, path = rest.partition(" ")
        if word == "missing":
            problems.append(
                f"{key}: {path} is not on the cluster (or not readable there); copy it there, or fix the path"
            )
        elif word == "open":
            problems.append(f"{key}: {path} is readable by others on the cluster; chmod 600 it")
        elif word == "notmine":
            problems.append(f"{key}: {path} belongs to another user on the cluster; use a file of your own")
        elif word == "tokens":
            problems += _token_problem(rest, vocab)
    if problems:
        return Check("files", False, "; ".join(problems))
    return Check("files", True, "every file the ranks read is there")


def _failed_setup(plan: Plan, result: Result) -> str:
    """The setup lines that failed on the login node, as `setup[i] (LINE) failed`; '' when none did."""
    failed = [
        int(w) for line in result.stderr.splitlines() for w in line.split()[1:2] if line.startswith("setup-failed ")
    ]
    return "; ".join(f"setup[{i}] ({plan.cluster.setup[i]}) failed" for i in failed if i < len(plan.cluster.setup))


def _environment(plan: Plan, result: Result) -> Check:
    versions = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.count(" ") == 1)
    failed = _failed_setup(plan, result)
    if result.returncode != 0 or "torch" not in versions:
        said = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("setup-failed ")]
        return Check(
            "environment",
            False,
            f"`{plan.cluster.python}` after the profile's setup lines failed on the login node"
            f"{': ' + failed if failed else ''} ({said[-1] if said else _last_line(result)}); "
            "fix `setup:` or `python:` in the cluster profile",
        )
    torch, meshrun = versions["torch"], versions.get("meshrun", "-")
    if torch == "-" and plan.spec.command is None:
        return Check(
            "environment",
            False,
            f"`{plan.cluster.python}` (after the profile's setup lines{': ' + failed if failed else ''}) cannot "
            "import torch; install torch there, or fix `setup:` / `python:` in the cluster profile",
        )
    if meshrun not in ("-", __version__):
        return Check(
            "environment",
            False,
            f"the cluster's meshrun is {meshrun}, this one is {__version__}; install the same meshrun on both",
        )
    there = "meshrun from the code snapshot" if meshrun == "-" else f"meshrun {meshrun}"
    note = f" (on the login node {failed}: a compute node may differ)" if failed else ""
    return Check("environment", True, f"torch {torch}, {there}{note}")


def _program_there(plan: Plan, result: Result) -> list[Check]:
    """The `program` check from the environment's round trip on a cluster (its `program found|-` line); [] when the
    job's program is not looked up on PATH or the line is missing (the shell died before it)."""
    said = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("program ")]
    if program_on_path(plan) is None or not said:
        return []
    where = "on the login node after the profile's setup lines (a compute node may differ)"
    return [_program(plan, said[-1].strip() == "found", where, "program")]


def _program(plan: Plan, found: bool, where: str, what: str) -> Check:
    """A `command:` job's program, looked up on PATH where the ranks will: a job whose program is not there dies at
    once, at every start."""
    name = program_on_path(plan)
    if found:
        return Check(what, True, f"`{name}` is on PATH")
    return Check(
        what,
        False,
        f"command: `{name}` is not on PATH {where}; give an absolute path, install it, or load it in the profile's "
        "`setup:` lines",
    )


def _space_reason(plan: Plan) -> str:
    """Where the space a job needs comes from, and the fixes that fit it."""
    if plan.spec.resilience.min_free_gb > 0:
        return "(resilience.min_free_gb); free space there, point paths.checkpoint_root elsewhere, or lower it"
    return (
        "for two checkpoints; free space there, point paths.checkpoint_root elsewhere, or set "
        "resilience.min_free_gb to what the job needs"
    )


def _space(plan: Plan, result: Result) -> Check:
    root = plan.run_spec.run.checkpoint_dir
    need = checkpoint_space_needed(plan.spec)
    try:
        free = int(result.stdout.split()[-1]) * 1024
    except (ValueError, IndexError):
        return Check("space", True, f"free space at {root} not measured ({_last_line(result)})")
    if free < need:
        return Check(
            "space",
            False,
            f"{root}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed {_space_reason(plan)}",
        )
    return Check("space", True, f"{free / 1e9:.1f} GB free at the checkpoint root ({need / 1e9:.1f} GB needed)")
