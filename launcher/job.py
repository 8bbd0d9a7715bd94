"""The safety net for your own training script (a `command:` job). Torch-free: import it first thing.

    from meshrun.launcher import job

    path = job.latest_checkpoint()               # newest *complete* checkpoint, or None: start fresh
    for step in range(start, steps + 1):
        ...train one step...
        job.report(step, loss=loss)              # metrics.jsonl, TensorBoard, heartbeat, progress
        if job.should_stop():                    # preemption / time limit; every rank gets the same answer
            folder = job.new_checkpoint(step)    # write your files in it (rank 0, or each rank its own)
            ...torch.save(state, folder / "state.pt"); barrier...
            job.mark_complete(folder)            # one rank, after every rank wrote: now it counts
            job.exit_for_requeue()               # exit 75: the batch script requeues, you resume above
    job.finished(steps)                          # the work is done: an exit 0 now is a finish, not a stop

Under meshrun the stop signals (MESHRUN_STOP_SIGNALS: SIGUSR1 ahead of the time limit or on preemption,
SIGTERM on scancel) are caught from the moment this module is imported, so one that arrives early is
not lost; elsewhere from the first should_stop(). The handler only sets a flag (meshrun.launcher.rank.preempt).
A program that exits 0 after a stop signal without calling finished() (or reporting the spec's
`command_steps`) stopped, it did not finish: meshrun requeues it (launcher/contract/records/finish.py).
Checkpoints follow the built-in trainer's rule (meshrun.launcher.checkpoint.commit): a folder counts only once its
marker is written last and it is renamed into place; latest_checkpoint() never returns anything else.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn, Optional

from meshrun.launcher import report as _report
from meshrun.launcher.contract import private
from meshrun.launcher.contract.exitcodes import EXIT_REQUEUE
from meshrun.launcher.contract.records import ckptdir, finish
from meshrun.launcher.contract.records.rundir import note_checkpoint, record_exit
from meshrun.launcher.rank.preempt import DEFAULT_SIGNALS, StopFlag

RUN_DIR_ENV = _report.RUN_DIR_ENV
CHECKPOINT_DIR_ENV = "MESHRUN_CHECKPOINT_DIR"
RESTART_COUNT_ENV = _report.RESTART_COUNT_ENV
STOP_SIGNALS_ENV = "MESHRUN_STOP_SIGNALS"
EXIT_REQUEUE_ENV = "MESHRUN_EXIT_REQUEUE"
_NAMED_STEP = re.compile(r"^step-(\d+)(\.tmp)?$")

_flag = StopFlag()


def _stop_signals() -> list[int]:
    names = os.environ.get(STOP_SIGNALS_ENV, "")
    return [int(signal.Signals[n.strip()]) for n in names.split(",") if n.strip()] or list(DEFAULT_SIGNALS)


def _listen() -> None:
    """Install the stop handler once (only the main thread may)."""
    if not _flag.installed and threading.current_thread() is threading.main_thread():
        _flag.install(_stop_signals())


def should_stop() -> bool:
    """True once a stop signal arrived. With torch.distributed initialised every rank must call it at
    the same point (one small all-reduce, MAX): any rank signalled stops them all, after the same step."""
    _listen()
    torch = sys.modules.get("torch")  # never imported here: a torch-free script stays torch-free
    if torch is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return _flag.raised
    dist = torch.distributed
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    raised = torch.tensor([int(_flag.raised)], device=device)
    dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    return bool(raised.item())


def exit_for_requeue() -> NoReturn:
    """Exit with 75 (saved for requeue). Rank 0 records it for the batch script first, and every rank waits
    for that (Slurm's kill-on-bad-exit ends the others as soon as one rank exits non-zero)."""
    run_dir = os.environ.get(RUN_DIR_ENV, "")
    if run_dir and _report.rank_from_env() == 0:
        record_exit(Path(run_dir), EXIT_REQUEUE)
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(EXIT_REQUEUE)


def finished(step: Optional[int] = None) -> None:
    """Say the work is done (call it once the last step is trained, before exiting 0): an exit 0 after a stop
    signal (a preemption, the time limit) is then a finish. Without it such an exit is a stop, which meshrun
    requeues: frameworks leave their loop on SIGTERM and exit 0 with work left. Rank 0 records it; every rank
    may call it."""
    run_dir = os.environ.get(RUN_DIR_ENV, "")
    if run_dir and _report.rank_from_env() == 0:
        finish.declare(run_dir, step)


def report(step: int, **scalars: Any) -> None:
    """meshrun.launcher.report.report: rank 0's numbers to metrics.jsonl and TensorBoard, every rank's heartbeat,
    and the progress the requeue policy looks for (a step beyond any reported before)."""
    _report.report(step, **scalars)


def checkpoint_dir() -> Path:
    """Your checkpoints' folder on shared storage (MESHRUN_CHECKPOINT_DIR; outside meshrun ./checkpoints), 0700."""
    path = Path(os.environ.get(CHECKPOINT_DIR_ENV) or "checkpoints")
    private.make_private_dir(path)
    return path


def latest_checkpoint() -> Optional[Path]:
    """The newest complete checkpoint folder (`step-N/` with its marker), or None; unmarked ones are ignored."""
    return ckptdir.latest(checkpoint_dir())


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder (`step-N` or `step-N.tmp`)."""
    match = _NAMED_STEP.match(Path(path).name)
    if match is None:
        raise ValueError(f"checkpoint folder {path}: name it step-N (job.new_checkpoint(step) does)")
    return int(match.group(1))


def new_checkpoint(step: int) -> Path:
    """An empty private folder to save step `step` into (`step-N.tmp/`: ignored until mark_complete)."""
    final = ckptdir.step_dir(checkpoint_dir(), step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that an earlier run never finished
    private.make_private_dir(tmp)
    return tmp


def mark_complete(path: Path, **info: Any) -> Path:
    """Make a saved folder a checkpoint: its marker last (with `info`), fsync, rename to `step-N/`; returns
    that. Call it on one rank, once every rank's files are written. Any `step-N[.tmp]` in checkpoint_dir() works."""
    path, root = Path(path), checkpoint_dir()
    step = checkpoint_step(path)
    if path.resolve().parent != root.resolve():
        raise ValueError(f"checkpoint folder {path}: put it in job.checkpoint_dir() ({root})")
    final = ckptdir.step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if path != tmp:  # a folder saved under its final name: unmarked, so nothing loads it while it moves
        shutil.rmtree(tmp, ignore_errors=True)
        os.rename(path, tmp)
    ckptdir.commit(tmp, final, {"step": step, **info})
    if os.environ.get(RUN_DIR_ENV):  # in a meshrun job: status's CKPT shows it
        note_checkpoint(os.environ[RUN_DIR_ENV], step)
    return final


if STOP_SIGNALS_ENV in os.environ:  # the program of a meshrun job: listen from the first moment
    _listen()
