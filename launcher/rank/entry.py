"""What every rank runs: read the run spec and the environment, then train or run the user's program.

Torch-free at import time: submitit pickles `run_rank` by reference, and a
`command:` job should not pay for importing torch it may not use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping, MutableMapping, Optional, Sequence

from meshrun.launcher import installed_version
from meshrun.launcher import job as kit
from meshrun.launcher.contract import private, procs
from meshrun.launcher.contract.exitcodes import EXIT_REQUEUE
from meshrun.launcher.contract.private import make_private_below, make_private_dir, private_umask
from meshrun.launcher.contract.records.rundir import (
    NODE_DIR_ENV,
    NodeDir,
    RunDir,
    expand_node_path,
    in_job_restart,
    record_exit,
    run_node_dir,
)
from meshrun.launcher.contract.spec import secrets
from meshrun.launcher.contract.spec.job import RunSpec, read_run_spec
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.rank.env import RankEnv, rank_env, setdefault_env, torchrun_vars
from meshrun.launcher.rank.failure import reports_fatal_errors
from meshrun.launcher.rank.preempt import StopFlag
from meshrun.launcher.report import expose_to_commands


def prepare_env(run_spec: RunSpec, environ: MutableMapping[str, str]) -> None:
    """Apply job.env (explicit: it wins), then fill in the torchrun-compatible variables."""
    # job.env first, so a key the user set on purpose (say MASTER_PORT) is what the rank
    # view below is built from, and setdefault_env then leaves it alone.
    environ.update(run_spec.job.env)
    setdefault_env(torchrun_vars(rank_env(environ)), environ)
    # As torchrun does: one rank's math threads = its CPUs (torch's default, one per core of the
    # machine, makes co-located ranks spin in each other's OpenMP barriers). Set before torch loads.
    setdefault_env({"OMP_NUM_THREADS": str(run_spec.job.resources.cpus_per_task)}, environ)
    node = run_node_dir(run_spec.run.run_dir, run_spec.run.scratch_dir, environ)
    make_node_dir(run_spec, node)
    environ[NODE_DIR_ENV] = node.root  # the heartbeat and the stack dump go here (the sidecar reads them)
    setdefault_env(flight_recorder_env(node), environ)


def make_node_dir(run_spec: RunSpec, node: NodeDir) -> None:
    """This node's folder, 0700, and on scratch the folders above it up to the profile's `paths.scratch`
    (`meshrun-$USER`, the run's): private even where an older meshrun or another umask left them 0755."""
    scratch = expand_node_path(run_spec.run.scratch_dir)
    if not scratch:
        make_private_dir(node.root)
        return
    top = scratch.split("/meshrun-", 1)[0] if "/meshrun-" in scratch else os.path.dirname(scratch)
    make_private_below(top or "/", node.root)


def flight_recorder_env(node: NodeDir) -> dict[str, str]:
    """PyTorch's NCCL flight recorder on, dumping into the node dir when the sidecar writes to a rank's
    pipe (a hang's diagnosis) or when a collective times out. Ignored by gloo (CPU) ranks."""
    make_private_dir(os.path.dirname(node.nccl_prefix))
    return {
        # torch >= 2.6 names (TORCH_FR_*); the older TORCH_NCCL_TRACE_* ones only warn.
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": node.nccl_prefix,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": node.nccl_pipe_prefix,
    }


def accelerator_env(gpus_per_node: int) -> dict[str, str]:
    """DS_ACCELERATOR=cpu for a job that asked for no GPUs (a value the user set wins).

    DeepSpeed picks its accelerator by probing: a node whose GPUs Slurm does not hide (no cgroup
    device constraint) would make a CPU job's script take CUDA and NCCL, and where nothing is found it
    warns on every rank. The job's own spec says which it is; DeepSpeed then uses gloo on CPU.
    """
    return {} if gpus_per_node > 0 else {"DS_ACCELERATOR": "cpu"}


@reports_fatal_errors  # bad input: one line, rank-error.txt, exit 2 (also under submitit)
def run_rank(run_dir: str, replace_process: Optional[bool] = None) -> int:
    """Run this rank of the job in `run_dir`; returns its exit code.

    A `command:` job replaces this process with the user's program (signals from
    Slurm then reach it directly) unless running inside submitit, whose worker must
    return to record the result; there the program runs as a child instead.
    """
    private_umask()  # what torch writes (DCP shards in step-N.tmp/, event files) and the user's program: 0600
    run_spec = read_run_spec(Path(run_dir))
    prepare_env(run_spec, os.environ)
    # The job's secrets, into this rank's environment only (the trainer's, or the program's it execs):
    # read here from their files, never written anywhere; a missing or readable-by-others one is bad input.
    secrets.apply(run_spec.job.secrets, run_spec.run.run_dir, os.environ)
    env = rank_env(os.environ)
    print(rank_banner(env, os.environ), flush=True)
    if (mismatch := version_mismatch(run_spec.run.meshrun_version, installed_version())) is not None:
        print(mismatch, flush=True)
    command = run_spec.job.command
    if command is not None:
        setdefault_env(run_spec.run.nccl_env, os.environ)  # the user's NCCL gets the cluster preset too
        setdefault_env(accelerator_env(run_spec.job.resources.gpus_per_node), os.environ)
        expose_to_commands(run_spec.run.run_dir, os.environ)  # `from meshrun.launcher import job` works
        os.environ.update(command_env(run_spec, env, os.environ))
        if replace_process is None:
            replace_process = "SUBMITIT_EXECUTOR" not in os.environ
        return run_command(command, os.environ, replace_process)
    # The stop flag goes up before torch is even imported: a preemption signal that arrives
    # while the rank starts must not kill it (SIGUSR1's default action) but stop it cleanly.
    flag = StopFlag().install()
    try:
        from meshrun.launcher.train.loop import train  # lazy: torch is imported only by ranks that train

        code = train(run_spec, env, flag)
    finally:
        flag.uninstall()
    if env.rank == 0:
        record_exit(Path(run_spec.run.run_dir), code)
    return code


def command_env(run_spec: RunSpec, env: RankEnv, environ: Mapping[str, str]) -> dict[str, str]:
    """What a `command:` job's program learns beside the torchrun variables (meshrun.launcher.job reads them):
    where to write, where its checkpoints go (created 0700), which restart this is, how a stop is asked."""
    checkpoints = run_spec.run.checkpoint_dir or RunDir(run_spec.run.run_dir).default_checkpoints
    private.make_private_dir(Path(checkpoints))
    return {
        kit.RUN_DIR_ENV: run_spec.run.run_dir,
        kit.CHECKPOINT_DIR_ENV: checkpoints,
        # Slurm's requeue count; the local supervisor sets its own (the earlier runs of this run dir).
        kit.RESTART_COUNT_ENV: environ.get(kit.RESTART_COUNT_ENV) or str(env.restart_count),
        # USR1: the time limit is near, or a preemption (the batch shell passes it on); TERM: scancel.
        kit.STOP_SIGNALS_ENV: "SIGUSR1,SIGTERM",
        kit.EXIT_REQUEUE_ENV: str(EXIT_REQUEUE),
    }


def rank_banner(env: RankEnv, environ: Mapping[str, str]) -> str:
    """One line per rank at start: which rank, where, and which restart (logs append across requeues)."""
    host = environ.get("SLURMD_NODENAME") or os.uname().nodename
    in_job = in_job_restart(environ)  # a restart inside the allocation, on spare nodes (0: the allocation's first run)
    return (
        f"[meshrun] rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
        f"node {env.node_rank}/{env.num_nodes} ({host}) job {env.job_id or '-'} restart {env.restart_count} "
        + (f"in-job {in_job} " if in_job else "")
        + f"master {env.master_addr}:{env.master_port}"
    )


def version_mismatch(rendered_by: str, installed: str) -> Optional[str]:
    """One log line when this rank runs another meshrun than the one that rendered its job (a cluster
    install lagging the login node's explains odd failures); None when they agree, or when spec.json
    predates the record ("")."""
    if not rendered_by or rendered_by == installed:
        return None
    return (
        f"[meshrun] version mismatch: this rank runs meshrun {installed}, the job was rendered by meshrun "
        f"{rendered_by}; install the same meshrun on the cluster and where you submit"
    )


def run_command(argv: Sequence[str], environ: Mapping[str, str], replace_process: bool) -> int:
    """exec the user's argv with `environ`, or run it as a child and return its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()  # exec drops Python's buffers: flush what this rank already printed
    try:
        if replace_process:
            os.execvpe(argv[0], list(argv), dict(environ))
        return _wait_for_child(argv, environ)
    except FileNotFoundError:
        # Bad input, as a bad spec is (rank-error.txt, exit 2: never requeued, status names it): a requeue would
        # not find it either, and the crash-loop guard's "gave up" hid the cause behind two lost starts.
        where = environ.get("SLURMD_NODENAME") or os.uname().nodename  # the node, where one machine runs several
        raise SchemaError(
            "command", argv[0], f"not found on PATH on {where}: give an absolute path, or install it on the cluster"
        ) from None


def _wait_for_child(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """Run the program as a child (submitit's worker) and return its exit code.

    A cancel signals the whole process group, the program included, and the program decides what a
    SIGTERM means; this worker only waits for it. submitit's own handler would print "Bypassing signal
    SIGTERM" into the rank's log for every signal, a warning about nothing. It is not put back when the
    program has ended: the worker only returns its code then, and a cancel's second TERM (the controller passes
    the signal on to its tasks too) would otherwise still reach submitit's handler in that moment.

    SIGUSR1 (the local supervisor's time limit, sent to the ranks, not the group) is passed on to the program:
    its default action ended this worker and left the program running until the kill, which never heard of
    the limit (a framework that saves on it saved nothing). A program with no handler for it gets SIGTERM
    instead, the stop it does know: USR1's default action would kill it (Lightning, which handles USR1 only
    where it finds Slurm, died of it on `local` with nothing saved)."""
    passed_on: list[int] = []  # a USR1 before the program exists: it gets it once it does
    child: Optional[subprocess.Popen[bytes]] = None

    def pass_on(signum: int, _frame: object) -> None:
        if child is None:
            passed_on.append(signum)
        else:
            child.send_signal(signum if procs.catches(child.pid, signum) else signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, _the_program_decides), signal.signal(signal.SIGUSR1, pass_on)
    try:
        child = subprocess.Popen(list(argv), env=dict(environ))
    except OSError:  # no program to wait for: the worker's own handlers again
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGUSR1, before[1])
        raise
    for signum in passed_on:
        pass_on(signum, None)
    return _exit_code(child.wait())


def _the_program_decides(_signum: int, _frame: object) -> None:
    """A Python handler, not SIG_IGN: an ignored signal would stay ignored in the program exec'd after it."""


def _exit_code(returncode: int) -> int:
    """A child killed by signal N reports -N; shells report 128+N, which is what Slurm expects."""
    return 128 - returncode if returncode < 0 else returncode
