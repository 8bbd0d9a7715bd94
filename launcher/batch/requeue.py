"""Whether a job that stopped comes back: the one requeue decision. Torch-free, stdlib only.

The batch script asks it once its ranks have exited:

    python -m meshrun.launcher.batch.requeue RUN_DIR STATUS RESTARTS MAX_REQUEUES [--stop-requested] [--terminated]

and gets one line, `ACTION CODE WHY`: ACTION is `requeue` or `stop`, CODE the status the job ends with,
WHY the sentence for its log. The rules:

- 0 (finished), 2 (bad input), 77 (crash loop) and 78 (diverged) end the job; so does a SIGTERM
  (`scancel`, or Slurm ending the job itself) and the requeue limit (`checkpoint.max_requeues`).
- 79 (a node failed its health check before the ranks started) is requeued when meshrun.launcher.batch.gate excluded the
  node, and ends the job when it could not (too few nodes would be left). The gate leaves out what a failure's
  requeue leaves out (`leave_out`, one decision for both) and the policy passes on its smaller node count.
- 75 (saved for requeue), 76 (no progress) and failures (a crash, a lost node: often transient) are
  requeued, as is anything after the batch shell passed on a stop signal (a program that died of it).
- A `command:` job's 0 after the batch shell passed on a stop (`--stop-requested=preemption|time-limit`) is a
  finish only when the program said so (launcher/contract/records/finish.py); otherwise it is a stop, requeued as a 75:
  frameworks leave their loop on SIGTERM and exit 0 with work left.
- A `command:` job has one more rule, the built-in trainer's crash-loop guard (launcher/checkpoint/resume.py) said
  in its own terms: a failed run that reported no step beyond the highest one reported before it started
  (meshrun.launcher.report's progress mark) counts one; MAX_ATTEMPTS such runs in a row end the job with 77
  instead of burning the allocation in a requeue loop. (The trainer's own guard counts its checkpoints.)

The local supervisor never requeues (`meshrun resume` does), but applies the same crash-loop rule through
`crash_loop`, so a command job there also ends "gave up (crash loop)" on its second failure in a row.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

from meshrun.launcher.batch import rankends
from meshrun.launcher.batch.gate import verdict_of
from meshrun.launcher.batch.leaving import Runner, leave_out, run_slurm
from meshrun.launcher.checkpoint.resume import MAX_ATTEMPTS
from meshrun.launcher.contract import nodelist
from meshrun.launcher.contract.exitcodes import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_GAVE_UP,
    EXIT_INPUT,
    EXIT_NAMES,
    EXIT_NO_PROGRESS,
    EXIT_REQUEUE,
    EXIT_UNHEALTHY,
    NOT_REQUEUED,
)
from meshrun.launcher.contract.private import append_line
from meshrun.launcher.contract.records import finish, suspects
from meshrun.launcher.contract.records import lost as lost_checkpoints
from meshrun.launcher.contract.records.rundir import (
    RunDir,
    attempt_id,
    in_job_restart,
    job_field,
    job_of,
    read_state,
    write_json,
)
from meshrun.launcher.contract.spec.secrets import remove_dir, secrets_dir_for
from meshrun.launcher.report import open_metrics, reported_step

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import RunSpec


@dataclass(frozen=True)
class Decision:
    requeue: bool
    code: int
    """The status the job ends with when it is not requeued."""
    why: str
    """One sentence for the batch log."""

    restart: bool = False
    """Restart the ranks inside the allocation (spare nodes) instead of requeueing the job."""

    def line(self) -> str:
        action = "restart" if self.restart else "requeue" if self.requeue else "stop"
        return f"{action} {self.code} {self.why}"


def crash_loop(run_dir: str, failed: bool) -> Optional[str]:
    """Count this run of a command job (call once per run, whatever its outcome); the give-up sentence when
    MAX_ATTEMPTS failed runs in a row reported no new step, else None.

    A run that reported a step beyond the previous high-water mark made progress and clears the count;
    a clean stop (75, or a stop signal) neither counts nor clears it.
    """
    path = RunDir(run_dir).requeue_state
    state = read_state(path)
    before = state.get("step")
    now = reported_step(run_dir)
    progressed = now is not None and (not isinstance(before, int) or now > before)
    failures = 0 if progressed else int(state.get("failures") or 0) + int(failed)
    write_json(path, {"failures": failures, "step": now if now is not None else before})
    if failures < MAX_ATTEMPTS:
        return None
    beyond = f"beyond step {now}" if now is not None else "at all"
    return (
        f"crash loop: {failures} runs in a row failed without reporting a step {beyond}; "
        f"giving up instead of requeueing (exit {EXIT_GAVE_UP}): fix the program, then `meshrun resume` continues it"
    )


def programs_own(run_dir: str, code: int) -> tuple[int, str]:
    """A command job's exit code as meshrun acts on it, with a note for the log ('' when unchanged).

    2 is meshrun's bad-input verdict only when meshrun's side said so: a rank error line (meshrun.launcher.job's
    checks and the trainer's write one). A program's own 2 (argparse's usage error, say) is its failure like
    any other: requeued, and a repeat without progress ends in the crash-loop guard's 77.
    """
    if code != EXIT_INPUT or Path(RunDir(run_dir).rank_error).exists():
        return code, ""
    return EXIT_FAILED, f"the program exited with code {EXIT_INPUT}, its own (no bad input was reported)"


def decide(
    run_dir: str,
    status: int,
    restarts: int,
    max_requeues: int,
    stop_requested: bool = False,
    terminated: bool = False,
    command_job: bool = False,
) -> Decision:
    """What the batch script does with a run that ended with `status` (see the module docstring)."""
    ends = terminated or status in NOT_REQUEUED
    failed = not ends and status not in (EXIT_REQUEUE, EXIT_UNHEALTHY) and not stop_requested  # no rank ran on 79
    # Every run moves the mark the next one is measured against, even one that is not requeued.
    gave_up = crash_loop(run_dir, failed) if command_job else None
    if terminated:
        return Decision(False, status, f"SIGTERM (scancel, or Slurm ended the job): not requeueing (status {status})")
    if status in NOT_REQUEUED:
        return Decision(False, status, f"{EXIT_NAMES[status]} (exit {status}): not requeueing")
    if status == EXIT_UNHEALTHY and (gate := verdict_of(run_dir)).get("action") != "requeue":
        why = str(gate.get("why") or "a node failed its health check and could not be excluded")
        record_reason(run_dir, why)
        return Decision(False, status, f"{why} (exit {status})")
    if gave_up is not None:
        record_reason(run_dir, f"gave up ({gave_up})")
        return Decision(False, EXIT_GAVE_UP, f"gave up ({gave_up})")
    if restarts >= max_requeues:
        return Decision(
            False,
            status,
            f"requeue limit (checkpoint.max_requeues={max_requeues}) reached: not requeueing; `meshrun resume` continues it",
        )
    return Decision(True, status, f"requeueing: restart {restarts + 1} of at most {max_requeues}")


def record_first_death(run_dir: str, restarts: int, environ: Mapping[str, str] = os.environ) -> None:
    """On Slurm, the first rank a signal ended leads the job's reason (rank-error.txt), before what the
    other ranks said (a collective's "connection closed by peer"): srun's own line for it ("srun: error: n1:
    task 0: Killed"), read from this attempt's part of the batch log. The local supervisor does the same
    from its rank controller's record."""
    found = srun_first_death(run_dir, restarts, environ)
    if found is None or not rankends.by_signal(found.code):
        return  # a rank that exited with a code of its own had its say
    path = Path(RunDir(run_dir).rank_error)
    said = path.read_text(errors="replace").strip() if path.exists() else ""
    if said.startswith(f"rank {found.rank}:"):
        return
    lead = found.words()
    path.write_text((f"{lead}, first; then {said}" if said else lead) + "\n")
    path.chmod(0o600)


def record_launch_failure(run_dir: str, restarts: int, environ: Mapping[str, str] = os.environ) -> bool:
    """When srun never started the ranks (its own complaint in this attempt's part of the batch log, no task's
    end), that complaint is the job's reason (status, logs); True when srun refused its own options, which
    fails the same way at every start (a requeue cannot help)."""
    log = batch_log_of(run_dir, environ)
    job = environ.get("SLURM_JOB_ID")
    complaint = rankends.launch_failure(log, attempt_line(job, restarts, in_job_restart(environ))) if job else None
    if complaint is None:
        return False
    record_reason(run_dir, f"the ranks never started: {complaint}")
    return rankends.refused_argv(complaint)


def batch_log_of(run_dir: str, environ: Mapping[str, str]) -> str:
    """The job's batch log (an array task's own), or "" when there is none to read."""
    job = environ.get("SLURM_JOB_ID")
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if not job:
        return ""
    try:
        return Path(RunDir(run_dir).batch_log(f"{array}_{task}" if array and task else job)).read_text(errors="replace")
    except OSError:
        return ""


def attempt_line(job: str, restarts: int, in_job: int) -> str:
    """The start of the batch log's line that opens this attempt (the batch script echoes it)."""
    return f"[meshrun] job {job} restart {restarts} " + (f"in-job {in_job} on " if in_job else "on ")


def srun_first_death(run_dir: str, restarts: int, environ: Mapping[str, str]) -> Optional[rankends.RankEnd]:
    """The first task srun reported ending badly in this attempt's part of the batch log."""
    job = environ.get("SLURM_JOB_ID")
    log = batch_log_of(run_dir, environ)
    if not job or not log:
        return None
    return rankends.first_death(rankends.srun_ends(log, attempt_line(job, restarts, in_job_restart(environ))))


NODE_SIGNALS = (signal.SIGKILL, signal.SIGBUS)
"""Deaths that point at the node: killed from outside (the kernel's OOM killer, an operator, a lost node) or
a bus error (failing memory, a vanished file system). Not the stop signals meshrun and Slurm send, nor a
segfault or an abort, which are the program's own more often than not."""


def blamed_for(run_dir: str, status: int, restarts: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The nodes this attempt's end points at, with the evidence: a hang verdict's stalled ranks' nodes (exit
    76), or the node of the first rank killed by SIGKILL or SIGBUS (srun's line: the kernel's OOM killer, a lost
    node, a kill -9, failing memory). A rank that exited with a code of its own blames no node: its error is
    the program's."""
    if status == EXIT_NO_PROGRESS:
        verdict = read_state(RunDir(run_dir).verdict_json)
        if verdict.get("attempt") != attempt_id(environ):
            return {}
        return {node: suspects.verdict_evidence(verdict) for node in suspects.blamed_nodes(verdict)}
    found = srun_first_death(run_dir, restarts, environ)
    if found is None or not rankends.by_signal(found.code) or abs(found.code) % 128 not in NODE_SIGNALS:
        return {}
    return {found.node: f"rank {found.rank} {rankends.how(found.code)}"}


def restart_in_allocation(
    run_dir: str, status: int, restarts: int, spares: int, environ: Mapping[str, str] = os.environ
) -> Optional[tuple[Decision, dict[str, str]]]:
    """A failure or hang the job restarts from inside its allocation, on spare nodes in place of the blamed
    ones (resilience.spare_nodes, .max_restarts, .restart_on); None when it is requeued as before."""
    from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

    res = read_run_spec(Path(run_dir)).job.resilience
    kind = "hang" if status == EXIT_NO_PROGRESS else "failure"
    if not res.spare_nodes or status in (EXIT_REQUEUE, EXIT_UNHEALTHY) or kind not in res.restart_on:
        return None
    done = in_job_restart(environ)
    if done >= res.max_restarts:
        print(
            f"[meshrun] {done} restarts inside the allocation already (resilience.max_restarts): requeueing",
            file=sys.stderr,
        )
        return None
    blamed = blamed_for(run_dir, status, restarts, environ)
    if len(blamed) > spares:
        print(
            f"[meshrun] {len(blamed)} node(s) to replace and {spares} healthy spare(s) left: requeueing",
            file=sys.stderr,
        )
        return None
    without = f" without {', '.join(f'{n} ({why})' for n, why in sorted(blamed.items()))}" if blamed else ""
    why = f"restarting inside the allocation{without}: restart {done + 1} of at most {res.max_restarts} (exit {status})"
    return Decision(True, status, why, restart=True), blamed


def record_reason(run_dir: str, why: str) -> None:
    """The job's one-line reason for `meshrun status` (RUN_DIR/rank-error.txt, which both schedulers
    show for a failed job), unless a rank already wrote its own error there."""
    path = Path(RunDir(run_dir).rank_error)
    if not path.exists():
        path.write_text(why + "\n")
        path.chmod(0o600)


USAGE = (
    "usage: python -m meshrun.launcher.batch.requeue RUN_DIR STATUS RESTARTS MAX_REQUEUES [--stop-requested[=KIND]] [--terminated] "
    "[--spares=N] [--unasked-stop]"
)

STEP_ABORTED = "srun: Job step aborted:"
"""srun's line when Slurm ends the ranks' step from outside (a step cancel: `scancel JOB.STEP`, or slurmctld's
retry of one meant for an earlier start); not when srun ends it itself (--kill-on-bad-exit: `_step_signal:
Terminating`), nor at a rank's own death."""
STEP_CANCELLED = re.compile(r"\*\*\* STEP \S+ ON \S+ CANCELLED AT \S+ \*\*\*")
"""slurmstepd's line for the same cancel, which srun passes on to the batch log in its stead now and then (the
testbed showed either); a whole job's cancel says `JOB ... CANCELLED AT ... DUE TO ...` instead."""
NOT_RESTARTED = (EXIT_INPUT, EXIT_GAVE_UP, EXIT_DIVERGED)
"""Ends that no start inside the allocation would change."""


def step_cancelled(attempt_log: str) -> bool:
    """Whether this start's part of the batch log says Slurm cancelled the ranks' step from outside."""
    return STEP_ABORTED in attempt_log or STEP_CANCELLED.search(attempt_log) is not None


def unasked_restart(status: int, attempt_log: str, finished: bool) -> Optional[Decision]:
    """The ranks' step was cancelled though nothing of this start asked for it (`--unasked-stop`: the batch shell
    passed on no stop, got no TERM, and Slurm says the job runs, unpreempted, in its first minutes; and Slurm says
    the step was cancelled, in this start's part of the batch log). Slurm names a step by job id and number, and
    the numbers start again at 0 at each start: a late cancel meant for an earlier start's step reaches this one's
    (a trial saw `STEP 700010.2 ON n1 CANCELLED` 4 s into a requeued start, no scancel; the ranks were killed,
    their node blamed, the job requeued). The ranks start again inside the allocation, from their newest
    checkpoint, without a requeue, blaming no node; None for any other end (the usual rules apply). srun's own
    status after such a cancel can be 0 (seen on the testbed, the ranks killed): an exit 0 is a finish only when
    the program said so (`finished`)."""
    if status in NOT_RESTARTED or (status == EXIT_FINISHED and finished) or not step_cancelled(attempt_log):
        return None
    why = (
        f"the ranks' step was cancelled (exit {status}) though nobody of this start asked: Slurm says the job is "
        "running, not preempted, not ending (a late cancel for an earlier start's step of the same number); "
        "starting them again inside the allocation, not requeueing"
    )
    return Decision(True, status, why, restart=True)


def said_it_finished(run_dir: str, spec: RunSpec) -> bool:
    """Whether the ranks' work is done: a `command:` job's program said so (launcher/contract/records/finish.py), or the
    built-in trainer reported its last step."""
    reported = reported_step(run_dir)
    if spec.job.command is not None:
        return finish.said_finished(run_dir, reported, spec.job.command_steps)
    return spec.job.train is not None and reported is not None and reported >= spec.job.train.steps


def attempt_log(run_dir: str, restarts: int, environ: Mapping[str, str]) -> str:
    """This attempt's part of the batch log ("" when there is none to read)."""
    job = environ.get("SLURM_JOB_ID")
    log = batch_log_of(run_dir, environ)
    marker = attempt_line(job, restarts, in_job_restart(environ)) if job else ""
    return log[log.rfind(marker) :] if marker and marker in log else ""


def stop_kind_of(args: list[str]) -> Optional[str]:
    """`--stop-requested=KIND` (preemption, time-limit) or a bare `--stop-requested`: the stop the batch shell
    passed on to the ranks; None when it passed on none."""
    for arg in args:
        if arg == "--stop-requested":
            return ""
        if arg.startswith("--stop-requested="):
            return arg.split("=", 1)[1]
    return None


def unfinished_stop(run_dir: str, spec: RunSpec, status: int, stop_kind: Optional[str]) -> Optional[str]:
    """A `command:` job's exit 0 after a stop that is no finish (launcher/contract/records/finish.py): what stopped it and
    where ("stopped by preemption at step 40"), recorded for `meshrun status` (an event line in metrics.jsonl);
    None when it was a finish, or no such exit."""
    if status != EXIT_FINISHED or stop_kind is None or spec.job.command is None:
        return None
    reported = reported_step(run_dir)
    if finish.said_finished(run_dir, reported, spec.job.command_steps):
        return None
    said = finish.stopped(stop_kind, reported)
    record_stop(run_dir, said)
    return said


DIED_OF_THE_STOP = frozenset({128 + signal.SIGTERM, 128 + signal.SIGUSR1})
"""A rank's status when the stop signal itself ended it: a program with no handler for it (Hugging Face's
Trainer installs none for SIGTERM)."""


def stopped_by_the_signal(run_dir: str, spec: RunSpec, status: int, stop_kind: Optional[str]) -> Optional[str]:
    """A `command:` job whose ranks died of the stop signal passed on for a preemption or the time limit: what
    stopped it and where, recorded for `meshrun status` as an exit 0 after the stop is (a new user's trial saw a
    preempted Hugging Face job wait with only Slurm's `Resources` for a reason); None otherwise."""
    if status not in DIED_OF_THE_STOP or stop_kind is None or spec.job.command is None:
        return None
    said = finish.stopped(stop_kind, reported_step(run_dir))
    record_stop(run_dir, said)
    return said


def record_stop(run_dir: str, said: str, environ: Mapping[str, str] = os.environ) -> None:
    """{"event": "stopped", "why"}: status shows the newest stop as the job's reason while nothing came after it."""
    line = {"event": "stopped", "why": said, "restart_count": int(environ.get("SLURM_RESTART_COUNT") or 0)}
    try:
        with open_metrics(run_dir) as metrics:
            metrics.write(json.dumps({**line, "time": time.time(), **job_field(environ)}) + "\n")
    except OSError as exc:
        print(f"[meshrun] cannot record the stop in {RunDir(run_dir).metrics}: {exc}", file=sys.stderr)


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spares_given = [a.split("=", 1)[1] for a in args if a.startswith("--spares=")]
    stop_kind = stop_kind_of(args)
    flags = {a for a in args if a.startswith("--") and not a.startswith(("--spares=", "--stop-requested"))}
    unasked = "--unasked-stop" in flags
    words = [a for a in args if not a.startswith("--")]
    if (
        len(words) != 4
        or not all(w.isdigit() for w in [*words[1:], *spares_given])
        or flags - {"--terminated", "--unasked-stop"}
        or stop_kind not in (None, "", *finish.STOP_KINDS)
    ):
        print(USAGE, file=sys.stderr)
        return 2
    run_dir, (status, restarts, max_requeues) = words[0], map(int, words[1:])
    from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

    spec = read_run_spec(Path(run_dir))
    lost = lost_checkpoints.check(run_dir)  # a checkpoint_lost alert, whatever the status
    if lost is not None and status == 0:
        # The ranks finished, but their last checkpoints never reached shared storage: not a success.
        # A failure is requeued (from the newest complete checkpoint: the lost steps are trained again).
        status = EXIT_FAILED
        record_reason(run_dir, lost)
    stop_requested, terminated = stop_kind is not None, "--terminated" in flags
    stray = (
        unasked_restart(status, attempt_log(run_dir, restarts, os.environ), said_it_finished(run_dir, spec))
        if unasked and not stop_requested and not terminated
        else None
    )
    if stray is not None:
        print(stray.line(), flush=True)
        return 0
    if status not in (EXIT_FINISHED, EXIT_REQUEUE, EXIT_UNHEALTHY) and not stop_requested and not terminated:
        record_first_death(run_dir, restarts)  # a stop's or a cancel's signals are no news
        if record_launch_failure(run_dir, restarts):
            status = EXIT_INPUT  # srun refused its own options: every start would (the reason says which)
    command_job = spec.job.command is not None
    note = ""
    unfinished = None if terminated else unfinished_stop(run_dir, spec, status, stop_kind)
    if unfinished is not None:  # a stop like the built-in trainer's saved one: requeued as it is
        status, note = EXIT_REQUEUE, f"{unfinished}: {finish.WHY_A_STOP}"
    elif command_job:
        if not terminated and (died := stopped_by_the_signal(run_dir, spec, status, stop_kind)) is not None:
            note = died
        status, own = programs_own(run_dir, status)
        note = f"{note}: {own}" if note and own else note or own
    decision = decide(
        run_dir,
        status,
        restarts,
        max_requeues,
        stop_requested=stop_requested,
        terminated=terminated,
        command_job=command_job,
    )
    if decision.requeue and spares_given and not decision.restart:
        restart = restart_in_allocation(run_dir, status, restarts, int(spares_given[0]))
        if restart is not None:
            decision, blamed = restart
            for node, evidence in blamed.items():
                record_suspect(run_dir, node, evidence)
            print(decision.line(), flush=True)
            if blamed:
                print(f"exclude {','.join(sorted(blamed))}", flush=True)
            return 0
    if not decision.requeue:  # the job's final state: its env: secrets go (`meshrun resume` sends them again)
        remove_dir(secrets_dir_for(run_dir))
        if unfinished is not None:  # never a success: status says what stopped it and where
            record_reason(run_dir, f"{unfinished}: {decision.why}")
    if note:
        decision = Decision(decision.requeue, decision.code, f"{note}: {decision.why}")
    print(decision.line(), flush=True)
    if decision.requeue and status == EXIT_UNHEALTHY:
        # The health gate decided what the requeued job leaves out (`leave_out`, as below), and the batch script has
        # its ExcNodeList already: only a smaller node count is passed on, as below.
        fewer = verdict_of(run_dir).get("nodes")
        if isinstance(fewer, int) and fewer > 0:
            print(f"nodes {fewer}", flush=True)
    elif decision.requeue:
        # A saved stop (a preemption, the time limit) blames no node: Slurm's own kills at its grace time's end
        # are no finding.
        requeue_leaves_out(run_dir, status, restarts, blame=status != EXIT_REQUEUE and not stop_requested)
    return 0


def record_suspect(run_dir: str, node: str, evidence: str, environ: Mapping[str, str] = os.environ) -> None:
    """A node a restart inside the allocation leaves behind goes in the cluster's ledger of suspects (a hang's
    nodes are there already: the sidecar put them)."""
    from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

    ledger = read_run_spec(Path(run_dir)).run.suspects_file
    if not ledger or evidence.startswith("hang verdict"):
        return
    try:
        append_line(ledger, suspects.finding_line(node, evidence, job_of(environ) or "?"))
    except OSError as exc:
        print(f"[meshrun] cannot record {node} in {ledger}: {exc}", file=sys.stderr)


def requeue_leaves_out(
    run_dir: str,
    status: int,
    restarts: int,
    environ: Mapping[str, str] = os.environ,
    run: Runner = run_slurm,
    now: Optional[float] = None,
    blame: bool = True,
) -> None:
    """The nodes the requeued job leaves out (`leave_out`, the decision the health gate's requeue shares): those
    this attempt's end blames (a hang's stalled nodes, the node of the first rank a signal killed: recorded as
    suspects), the nodes this allocation left out earlier and the ledger's suspects. A second line, `exclude
    NODES`, which the batch script sets as the job's ExcNodeList right after the requeue (as for the health gate's
    failures); a third, `nodes N`, when the requeued job asks for fewer nodes (its spares given up). When not even
    this end's own nodes can be spared, the log says they stay in."""
    from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

    if not job_of(environ):
        return
    spec = read_run_spec(Path(run_dir))
    blamed = blamed_for(run_dir, status, restarts, environ) if blame else {}
    for node, evidence in blamed.items():
        record_suspect(run_dir, node, evidence, environ)
    found = leave_out(spec, blamed, environ, run, now)
    if found is None:
        return
    if found.fits:
        left = [f"{node} ({found.reasons[node]})" for node in found.excluded if node in found.reasons]
        print(f"[meshrun] the requeued job leaves out {'; '.join(left)}{found.fewer()}", file=sys.stderr, flush=True)
        print(f"exclude {','.join(found.excluded)}", flush=True)
        if found.nodes < found.asked:
            print(f"nodes {found.nodes}", flush=True)
    else:
        staying = [node for node in sorted(found.reasons) if node not in found.before]
        print(
            f"[meshrun] suspect node(s) {nodelist.compress(staying)} stay in the requeued job: the partition cannot spare "
            f"them beside the job's {found.least} nodes",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
