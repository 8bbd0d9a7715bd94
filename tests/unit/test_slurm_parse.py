"""Pure parsers of Slurm's stable output, on output recorded from slurm-wlm 22.05."""

from __future__ import annotations

import pytest

from meshrun.submit.errors import ClusterError
from meshrun.submit.schedulers import slurm_cli as slurm

# sacct --allocations --parsable2 --noheader --jobs 11,12,13,14 --format JobID,JobName,State,ExitCode,...
SACCT = """\
11|two-node-gpt|COMPLETED|0:0|00:00:21|00:20:00|n[1-2]
12|tiny|CANCELLED by 0|0:15|00:00:04|00:30:00|n1
13|tiny|RUNNING|0:0|00:00:09|00:30:00|n[1-2]
14|a $(b) `c` d|PENDING|0:0|00:00:00|UNLIMITED|None assigned
"""
# squeue --noheader --states=all --jobs 13,15 --format %i|%T|%M|%l|%N|%r
SQUEUE = """\
13|RUNNING|0:09|30:00|n[1-2]|None
15|PENDING|0:00|30:00||Resources
"""


def test_parse_sacct() -> None:
    states = slurm.parse_sacct(SACCT)
    assert states["11"].state == "COMPLETED" and states["11"].succeeded and states["11"].done
    assert states["12"].state == "CANCELLED" and states["12"].done and not states["12"].succeeded
    assert states["12"].reason == "cancelled by Slurm or an administrator (uid 0)" and states["11"].reason is None
    assert slurm.parse_sacct("16|t|CANCELLED by 1000|0:15|00:00:04|00:30:00|n1")["16"].reason == "cancelled by uid 1000"
    # With the owner's UID (sacct's 8th field): the owner's own cancel (`meshrun cancel`, root's included) is
    # said so, not blamed on Slurm or an administrator (a new user's trial, as root, read it that way).
    owned = slurm.parse_sacct("17|t|CANCELLED by 0|0:15|00:00:04|00:30:00|n1|0\n18|t|CANCELLED by 0|0:15|1|1|n1|1000")
    assert owned["17"].reason == "cancelled by its owner (uid 0)"
    assert owned["18"].reason == "cancelled by Slurm or an administrator (uid 0)"
    assert states["13"].state == "RUNNING" and not states["13"].done and states["13"].time_limit == "00:30:00"
    assert slurm.seconds(states["11"].elapsed) == 21 and slurm.seconds(states["11"].time_limit) == 1200


# sacct --allocations --duplicates ... -j 4: a Lightning job preempted once on the testbed, then 9 never requeued
SACCT_REQUEUED = """\
4|lightning-script|REQUEUED|0:0|00:00:13|00:10:00|n[1-2]
9|tiny|COMPLETED|0:0|00:00:21|00:20:00|n1
4|lightning-script|COMPLETED|0:0|00:01:06|00:10:00|n[1-2]
"""


def test_a_requeued_jobs_earlier_runs_are_its_restarts() -> None:
    """A program that reports no step (Lightning's own loop) showed RESTARTS 0 after a requeue: the count came
    only from the trainer's metrics lines. Accounting's rows of the earlier runs count now."""
    states = slurm.parse_sacct(SACCT_REQUEUED)
    assert (states["4"].state, states["4"].restarts, states["4"].elapsed) == ("COMPLETED", 1, "00:01:06")
    assert states["4"].earlier_s == 13 and states["9"].earlier_s == 0  # ELAPSED: the job's whole life, 79 s
    assert states["9"].restarts == 0
    assert "--duplicates" in slurm.sacct_argv(["4"])
    from meshrun.submit.schedulers.slurm import _whole_life

    assert _whole_life(states["4"]) == 79 and _whole_life(states["9"]) == 21  # status's ELAPSED and GPU-hours


@pytest.mark.parametrize("text, code", [("0:0", 0), ("2:0", 2), ("0:15", None), ("75:0", 75), ("", None)])
def test_a_job_ended_by_a_signal_has_no_exit_code_of_its_own(text: str, code: object) -> None:
    from meshrun.submit.schedulers.slurm import _exit_code

    assert _exit_code(text) == code  # "0:15" (a cancel) must not read as a clean exit 0


def test_parse_squeue_and_merge_prefers_live_rows_until_accounting_catches_up() -> None:
    live = slurm.parse_squeue(SQUEUE)
    assert live["15"].reason == "Resources" and live["13"].reason is None
    merged = slurm.merge_states(["11", "13", "15", "99"], slurm.parse_sacct(SACCT), live)
    assert merged["11"].state == "COMPLETED"  # done in accounting: the record
    assert merged["13"].state == "RUNNING" and merged["13"].nodes == "n[1-2]"
    assert merged["15"].state == "PENDING"  # not yet in accounting: squeue
    assert merged["99"].state == "UNKNOWN"


@pytest.mark.parametrize("out, job_id", [("123\n", "123"), ("456;testbed\n", "456")])
def test_parse_sbatch(out: str, job_id: str) -> None:
    assert slurm.parse_sbatch(out) == job_id


def test_parse_sbatch_without_an_id_is_an_error() -> None:
    with pytest.raises(ClusterError, match="no job id"):
        slurm.parse_sbatch("sbatch: error: Batch job submission failed\n")


def test_argv_builders_reject_anything_but_job_ids() -> None:
    with pytest.raises(ClusterError):
        slurm.scancel_argv("1; rm -rf /")
    with pytest.raises(ClusterError):
        slurm.sacct_argv(["12", "$(x)"])
    assert slurm.scancel_argv("12", "USR1") == ["scancel", "--signal=USR1", "12"]
    argv = slurm.sbatch_argv("/r/job.sbatch", "a 'b' $(c)", "/r")
    assert argv == ["sbatch", "--parsable", "--job-name=a 'b' $(c)", "--chdir=/r", "/r/job.sbatch"]


@pytest.mark.parametrize(
    "text, seconds",
    [("1-02:03:04", 93784), ("10:00", 600), ("00:00:05", 5), ("UNLIMITED", None), ("", None), (None, None)],
)
def test_seconds(text, seconds) -> None:
    assert slurm.seconds(text) == seconds


def test_a_job_squeue_lists_as_completing_is_not_done_whatever_sacct_says() -> None:
    """Found by a testbed journey: the batch shell killed, sacct said FAILED while the sidecars still copied
    checkpoints (squeue: COMPLETING); status showed it ended with CKPT 20, then 37, and a resume raced them."""
    acct = slurm.parse_sacct("24|tiny|FAILED|0:9|00:00:17|00:30:00|n[1-2]\n")
    live = slurm.parse_squeue("24|COMPLETING|0:17|30:00|n[1-2]|None\n")
    merged = slurm.merge_states(["24"], acct, live)["24"]
    assert merged.state == "COMPLETING" and not merged.done and merged.exit_code == "0:9"
    assert slurm.merge_states(["24"], acct, {})["24"].state == "FAILED"  # gone from squeue: sacct's record


def test_an_end_squeue_shows_before_accounting_records_it_waits_for_its_exit_code() -> None:
    """Found in a 4-worker run: squeue said FAILED while sacct still had the job RUNNING with ExitCode 0:0, and
    status showed it FAILED with exit code 0 (the batch script had exited 79)."""
    acct = slurm.parse_sacct("24|tiny|RUNNING|0:0|00:00:17|00:30:00|n[1-2]\n")
    live = slurm.parse_squeue("24|FAILED|0:17|30:00|n[1-2]|NonZeroExitCode\n")
    merged = slurm.merge_states(["24"], acct, live)["24"]
    assert merged.state == "RUNNING" and not merged.done  # as accounting has it, until it records the end
    recorded = slurm.parse_sacct("24|tiny|FAILED|79:0|00:00:18|00:30:00|n[1-2]\n")
    ended = slurm.merge_states(["24"], recorded, live)["24"]
    assert ended.state == "FAILED" and ended.exit_code == "79:0"
    assert slurm.merge_states(["24"], {}, live)["24"].state == "FAILED"  # no accounting at all: squeue's word
