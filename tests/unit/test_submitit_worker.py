"""launcher/rank/submitit_worker.py: the requeue command outlives the SIGTERM a requeue sends to the job."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from meshrun.launcher.rank import submitit_worker
from meshrun.submit import executor

# A stand-in for `scontrol requeue` on a loaded node: the TERM reaches it before it exits.
TERMED_BEFORE_EXIT = ["sh", "-c", "kill -TERM $$; exit 0"]


def test_a_command_that_is_sent_sigterm_before_it_exits_still_succeeds() -> None:
    with pytest.raises(subprocess.CalledProcessError):  # what submitit's own requeue call does
        subprocess.run(TERMED_BEFORE_EXIT, check=True, timeout=10)
    submitit_worker.run_ignoring_term(TERMED_BEFORE_EXIT, timeout_s=10)


def test_the_caller_keeps_its_own_sigterm_handler() -> None:
    def handler(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        submitit_worker.run_ignoring_term(["true"], timeout_s=10)
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_failing_requeue_still_fails() -> None:
    with pytest.raises(subprocess.CalledProcessError):
        submitit_worker.run_ignoring_term(["false"], timeout_s=10)


def test_the_slurm_executor_runs_this_worker() -> None:
    ex = executor.MeshrunSlurmExecutor.__new__(executor.MeshrunSlurmExecutor)  # only the command is asked
    ex.python, ex.folder = "python3", Path("/runs/a b")
    assert ex._submitit_command_str == "python3 -u -m meshrun.launcher.rank.submitit_worker '/runs/a b'"
