"""The `local` cluster's node side: what sbatch + srun are on Slurm. Torch-free.

`meshrun submit -c local` runs the rendered run.sh detached, in a new session, with
MESHRUN_JOB_ID set; run.sh execs `python -m meshrun.launcher.local.supervisor RUN_DIR`. The
supervisor starts the ranks through submitit's LocalExecutor (which gives each rank a
Slurm-like environment), enforces the time limit, stops every rank when one fails
(Slurm's --kill-on-bad-exit), and records the job's outcome in its own state file,
`.meshrun/jobs/JOB_ID.json`. Each rank writes its output to `logs/rank-N.log`
(appended across resumes, as on Slurm); submitit's own files stay in `.meshrun/submitit`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from meshrun.launcher.batch import rankends
from meshrun.launcher.batch.requeue import crash_loop, programs_own
from meshrun.launcher.contract import procs
from meshrun.launcher.contract.exitcodes import (
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_GAVE_UP,
    EXIT_INPUT,
    EXIT_NO_PROGRESS,
    EXIT_REQUEUE,
    NOT_REQUEUED,
    diverged_fix,
)
from meshrun.launcher.contract.private import make_private_dir, private_umask
from meshrun.launcher.contract.records import ckptdir, finish, goodput
from meshrun.launcher.contract.records import lost as lost_checkpoints
from meshrun.launcher.contract.records.rundir import (
    JOB_ID_ENV,
    RunDir,
    local_state_path,
    merge_state,
    node_name,
    read_state,
)
from meshrun.launcher.contract.spec.secrets import remove_dir, secrets_dir_for
from meshrun.launcher.job import RESTART_COUNT_ENV
from meshrun.launcher.report import reported_step

STOP_GRACE_S = 60
"""How long ranks may take to save and exit after a cancel or the time limit before they are killed."""
FAILED_PEER_GRACE_S = 10
"""How long the other ranks get to exit after one rank failed, before they are killed."""
SIDECAR_STOP_S = 5
"""How long the sidecar gets to stop after the ranks ended, before it is killed."""
CLEAN_CODES = (0, EXIT_REQUEUE)
"""A rank's ends that fail nothing: done, or stopped after saving (a preemption's)."""
RESIGNAL_S = 2.0
"""After a stop, how often the ranks are signalled again: one that was still starting (submitit's worker
waves a SIGTERM through until the rank's own handler is in place) must not miss it."""


def rank_main(run_dir: str) -> int:
    """One rank, run by submitit's worker: output to logs/rank-N.log for the rank's life only
    (submitit's own closing lines stay in its file, not in the log a person reads)."""
    from meshrun.launcher.rank.entry import run_rank  # torch-free at import

    rank = int(os.environ.get("SUBMITIT_LOCAL_GLOBALID", "0"))
    with _output_to(RunDir(run_dir).rank_log(rank)):
        # The log appends across resumes: each run starts with the job id `meshrun logs JOB` names.
        print(
            f"[meshrun] local job {os.environ.get(JOB_ID_ENV, '-')} rank {rank} "
            f"at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
            flush=True,
        )
        return run_rank(run_dir)


class _output_to:
    """Point fds 1 and 2 at a file (append), and back afterwards."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.saved: list[int] = []

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.saved = [os.dup(1), os.dup(2)]
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def __exit__(self, *_exc: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, saved in zip((1, 2), self.saved):
            os.dup2(saved, target)
            os.close(saved)


def _group_members() -> list[int]:
    """Every other process of this supervisor's process group: the controller, the ranks and whatever
    the ranks started (a `command:` job's program runs as a rank's child)."""
    me = os.getpid()
    return [pid for pid in procs.group_members(os.getpgid(0)) if pid != me]


def _signal_found(pids: Iterator[int], sig: int, skip: Optional[set[procs.Identity]] = None) -> None:
    """Signal processes a /proc scan found: each identity is taken as it is found and checked at the signal
    (meshrun.launcher.contract.procs), so a process that exits meanwhile never passes its signal to a reuse of its pid.
    Those in `skip` are left alone; each one signalled is added to it."""
    found = [identity for identity in map(procs.process_identity, pids) if identity is not None]
    for identity in found:
        if skip is not None and identity in skip:
            continue
        try:
            procs.signal_if_same(identity, sig)
        except OSError:
            pass
        if skip is not None:
            skip.add(identity)


def _signal_group(sig: int, skip: Optional[set[procs.Identity]] = None) -> None:
    """Like Slurm ending a step: every process of the job, not only the ranks (their children too)."""
    _signal_found(iter(_group_members()), sig, skip)


def _signal_ranks(controller: int, sig: int) -> None:
    """Signal the rank processes (the submitit controller's children), not this supervisor."""
    _signal_found(iter(procs.children(controller)), sig)


@dataclass
class _Stop:
    """A stop under way: why, the signal, whether it goes to the whole group or to the ranks only, and when
    the ranks are killed if they have not ended."""

    why: str
    sig: int
    whole_group: bool
    deadline: float
    sidecar: Optional[procs.Identity] = None
    """Never signalled: the supervisor stops it once the ranks have ended, after it copied their last
    checkpoint (a TERM in its first second ended it before it had a handler, and the checkpoint was lost)."""
    signalled: set[procs.Identity] = dataclasses.field(default_factory=set)
    """The group's processes that have had the signal: one that appears later (a program a rank started after
    a cancel in the job's first second) gets it once too."""
    resignal_at: float = 0.0

    def send(self, controller: int, now: float) -> None:
        if self.whole_group:
            skip = self.signalled | self._sidecars()
            _signal_group(self.sig, skip)
            self.signalled |= skip
        if now >= self.resignal_at:  # the ranks again: one may have been starting when the last came
            _signal_ranks(controller, self.sig)
            self.resignal_at = now + RESIGNAL_S

    def _sidecars(self) -> set[procs.Identity]:
        """The sidecar's processes now (its keeper, the sidecar, its copiers)."""
        if self.sidecar is None:
            return set()
        found = {self.sidecar}
        for pid in _group_members():
            identity = procs.process_identity(pid)
            if identity is not None and procs.descendant_of(pid, self.sidecar):
                found.add(identity)
        return found


class Supervisor:
    def __init__(self, run_dir: Path, job_id: str) -> None:
        from meshrun.launcher.contract.spec.job import read_run_spec  # torch-free

        self.run_dir = RunDir(str(run_dir))
        self.job_id = job_id
        self.state_path = local_state_path(self.run_dir.root, job_id)
        self.spec = read_run_spec(run_dir)
        self.cancelled = False
        self.sidecar: Optional[subprocess.Popen[bytes]] = None
        self.sidecar_stop_s = self.spec.job.sidecar.final_copy_s + SIDECAR_STOP_S

    def _on_term(self, signum: int, _frame: Any) -> None:
        self.cancelled = True

    def _cancel_requested(self) -> bool:
        return self.cancelled or _EARLY_STOP[0] or bool(read_state(self.state_path).get("cancel_requested"))

    def _executor(self) -> tuple[Any, int]:
        import math

        from meshrun.launcher.local.controller import PRELOAD_ENV, TRAINER_PRELOAD, RecordingExecutor

        job = self.spec.job
        if job.command is None:  # the built-in trainer: its ranks are forked with torch already imported
            os.environ[PRELOAD_ENV] = ",".join(TRAINER_PRELOAD)
        limit_s = self.spec.run.time_limit_s or 3600
        executor = RecordingExecutor(folder=self.run_dir.submitit)
        # The supervisor's own clock enforces the limit; submitit's gets a margin so that
        # its timeout path (which would requeue) never fires first.
        executor.update_parameters(
            tasks_per_node=job.tasks_per_node,
            nodes=1,
            timeout_min=math.ceil(limit_s / 60) + 5,
            stderr_to_stdout=True,
            gpus_per_node=job.resources.gpus_per_node,
        )
        return executor, limit_s

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        if self._cancel_requested():  # cancelled before the ranks were started: start none
            return self._record("CANCELLED", started=time.time(), codes=None, message="cancelled before start")
        make_private_dir(self.run_dir.logs)
        executor, limit_s = self._executor()
        # A command job's program learns which run this is (Slurm's SLURM_RESTART_COUNT has no local twin).
        os.environ[RESTART_COUNT_ENV] = str(earlier_runs(self.run_dir.root, self.job_id))
        submitted = read_state(self.state_path).get("submitted")
        goodput.record_start(
            str(self.run_dir.root),
            self.job_id,
            0,
            submitted if isinstance(submitted, (int, float)) else None,
            node_name(os.environ),
        )
        job = executor.submit(rank_main, self.run_dir.root)
        self.sidecar = start_sidecar(self.run_dir.root, self.spec.job.resources.gpus_per_node)
        started = time.time()
        merge_state(
            self.state_path, state="RUNNING", started=started, controller_pid=int(job.job_id), time_limit_s=limit_s
        )
        print(f"[meshrun] local job {self.job_id} started {self.spec.job.tasks_per_node} ranks", flush=True)
        stopped = self._watch(job, started, limit_s)
        return self._finish(job, started, stopped)

    def _watch(self, job: Any, started: float, limit_s: int) -> Optional[str]:
        """Wait for the ranks; returns why they were stopped (None: they ended by themselves)."""
        stop: Optional[_Stop] = None
        controller = int(job.job_id)
        while not job.done():
            now = time.time()
            if stop is None:
                if self._cancel_requested():
                    # The whole job, as scancel does: the ranks save a checkpoint and exit, and a
                    # command's own program gets it too (submitit's workers ignore TERM, and a cancel
                    # in the first second reached the group before the program existed, or the ranks).
                    stop = _Stop("CANCELLED", signal.SIGTERM, True, now + STOP_GRACE_S, self._sidecar_identity())
                elif now - started > limit_s:
                    stop = _Stop("TIMEOUT", signal.SIGUSR1, False, now + STOP_GRACE_S)
                elif self._failed_rank(job) is not None:
                    # Slurm's --kill-on-bad-exit: one rank's failure ends the job, not its full time.
                    stop = _Stop("FAILED", signal.SIGTERM, True, now + FAILED_PEER_GRACE_S, self._sidecar_identity())
            if stop is not None:
                stop.send(controller, now)
                if stop.why != "FAILED" and self._failed_rank(job) is not None:
                    # A rank the stop ended before it could save (a TERM while it started): its peers wait in
                    # a collective it will never join, and no checkpoint can come of them. As Slurm's
                    # --kill-on-bad-exit, they get the failed peer's grace, not the whole stop's.
                    stop.deadline = min(stop.deadline, now + FAILED_PEER_GRACE_S)
                if now > stop.deadline:
                    _signal_group(signal.SIGKILL)
                    stop.deadline = now + STOP_GRACE_S  # SIGKILL again later if something survived
            time.sleep(0.25)
        return None if stop is None else stop.why

    def _sidecar_identity(self) -> Optional[procs.Identity]:
        return None if self.sidecar is None else procs.process_identity(self.sidecar.pid)

    @staticmethod
    def _failed_rank(job: Any) -> Optional[int]:
        """The first rank that ended with an error or a failing exit code (75 is a clean stop), or that its
        controller saw end so (a rank killed by a signal leaves no result file)."""

        died = _first_death(job)
        return None if died is None else died.rank

    @staticmethod
    def _codes(job: Any) -> tuple[Optional[list[int]], str]:
        """Each rank's exit code from submitit's result files, read at once (submitit's own
        `results()` waits ~15 s for a file that a killed rank never writes)."""
        from submitit.core.utils import pickle_load

        codes = []
        for task in range(job.num_tasks):
            path = job.task(task).paths.result_pickle
            try:
                outcome, value = pickle_load(path)
            except Exception:
                return None, f"rank {task} ended without a result (killed?)"
            if outcome != "success":
                lines = str(value).strip().splitlines()
                return None, lines[-1] if lines else f"rank {task} raised"
            codes.append(int(value))
        return codes, ""

    def _finish(self, job: Any, started: float, stopped: Optional[str]) -> int:
        stop_sidecar(self.sidecar, self.sidecar_stop_s)
        if not job.done():
            job.cancel(check=False)
        _signal_group(signal.SIGKILL)  # nothing of the job outlives it (a rank's orphaned children)
        if stopped is None and self._cancel_requested():
            stopped = "CANCELLED"  # the ranks died of the cancel before the watch loop saw it
        codes, message = self._codes(job)
        agreed = _read_code(self.run_dir.exit_code)
        rank_error = _first_line(self.run_dir.rank_error)
        if stopped == "TIMEOUT" and self._finished_at_its_stop(codes):
            final, message = "COMPLETED", ""  # it said it finished: its last step came with the time limit
        elif stopped in ("CANCELLED", "TIMEOUT"):
            final = stopped
            # The ranks were stopped on purpose: how they ended (killed while starting up) is no news.
            saved = agreed == EXIT_REQUEUE or (codes and all(c == EXIT_REQUEUE for c in codes))
            message = "checkpoint saved: `meshrun resume` continues it" if saved else ""
            if not saved and codes and not any(codes) and self.spec.job.command is not None:
                # A framework that left its loop on the stop and exited 0: work is left, and status says where.
                kind = finish.TIME_LIMIT if stopped == "TIMEOUT" else finish.CANCEL
                message = (
                    f"{finish.stopped(kind, reported_step(str(self.run_dir.root)))}: `meshrun resume` continues it"
                )
        elif codes is not None and all(c == EXIT_REQUEUE for c in codes):
            final, message = "PREEMPTED", "checkpoint saved: `meshrun resume` continues it"
        elif codes is not None and not any(codes) and stopped is None:
            final, message = "COMPLETED", ""
        elif agreed == EXIT_NO_PROGRESS:
            final = "FAILED"  # the sidecar found a hang, diagnosed it and ended the ranks
            message = f"no progress (exit {EXIT_NO_PROGRESS}): {_first_sentence(self.run_dir.verdict)}"
        elif agreed == EXIT_DIVERGED:
            final = "FAILED"  # never requeued: it would diverge again (alerts.jsonl has the step)
            fix = diverged_fix(newest_checkpoint(self.run_dir.root))  # where resume starts, named
            message = f"diverged (exit {EXIT_DIVERGED}): the loss went NaN/inf; {fix}"
        else:
            final = "FAILED"
            message = (
                first_death_words(job, rank_error) or rank_error or (f"rank exit codes {codes}" if codes else message)
            )
        code = agreed if agreed is not None else _job_exit_code(codes, final)
        lost = lost_checkpoints.check(self.run_dir.root)  # after the sidecar's last copies: a checkpoint_lost alert
        if lost is not None:
            # Never a success with lost steps; any other outcome says it too (`resume` starts further back).
            final, code = ("FAILED", EXIT_FAILED) if final == "COMPLETED" else (final, code)
            message = f"{message}; {lost}" if message else lost
        if self.spec.job.command is not None:
            code, own = programs_own(str(self.run_dir.root), code)
            message = f"{message} ({own})" if own else message
            # The batch script's crash-loop rule (meshrun.launcher.batch.requeue): nothing requeues here, but a second
            # failure in a row without progress says so, with the same exit code.
            clean = final != "FAILED" or stopped in ("CANCELLED", "TIMEOUT") or code in NOT_REQUEUED
            if (gave_up := crash_loop(self.run_dir.root, failed=not clean)) is not None and not clean:
                code, message = EXIT_GAVE_UP, f"gave up ({gave_up}); this run: {message}"
        return self._record(final, started, codes, message, code)

    def _finished_at_its_stop(self, codes: Optional[list[int]]) -> bool:
        """A `command:` job whose ranks all exited 0 after the time limit's stop and that said it finished
        (meshrun.launcher.job.finished, or its command_steps reported): a finish, not a stop (launcher/contract/records/finish.py)."""
        if self.spec.job.command is None or not codes or any(codes):
            return False
        root = str(self.run_dir.root)
        return finish.said_finished(root, reported_step(root), self.spec.job.command_steps)

    def _record(
        self, final: str, started: float, codes: Optional[list[int]], message: str, exit_code: Optional[int] = None
    ) -> int:
        remove_dir(secrets_dir_for(str(self.run_dir.root)))  # a final state: the env: secrets go (resume resends)
        # The goodput record first: it holds the step and checkpoint the ended job shows from now on (a status
        # that sees the final state finds them written).
        goodput.record_end(str(self.run_dir.root), self.job_id, 0, exit_code)
        goodput.write(str(self.run_dir.root), self.job_id)
        merge_state(
            self.state_path,
            state=final,
            ended=time.time(),
            exit_codes=codes,
            message=message,
            exit_code=exit_code,
            elapsed_s=round(time.time() - started, 3),
        )
        print(f"[meshrun] local job {self.job_id} {final} {message}".rstrip(), flush=True)
        return 0 if final == "COMPLETED" else 1


def _returned(job: Any) -> dict[int, tuple[float, int]]:
    """Each rank's returned exit code, from submitit's result files, with when it was written; a rank that
    raised counts as 1 (its rank error says why); a rank with no result yet (running, being written, killed)
    is absent."""
    from submitit.core.utils import pickle_load

    codes = {}
    for task in range(job.num_tasks):
        result = job.task(task).paths.result_pickle
        try:
            written = result.stat().st_mtime
            outcome, value = pickle_load(result)
        except Exception:
            continue  # none, or being written
        codes[task] = (written, int(value) if outcome == "success" and isinstance(value, int) else EXIT_FAILED)
    return codes


def _first_death(job: Any) -> Optional[rankends.RankEnd]:
    """The first rank that ended badly, as its controller and its result file saw it."""
    from meshrun.launcher.local import controller

    ends = controller.rank_ends(controller.read_ends(job.paths.folder, job.job_id), _returned(job))
    return rankends.first_death(ends, CLEAN_CODES)


def first_death_words(job: Any, rank_error: str) -> str:
    """The first rank that ended badly, and how (its controller saw it), before the first rank error when
    another rank wrote it: a rank killed by a signal writes nothing, and its peers' errors ("connection
    closed by peer") would be all there is to read. "" when no end was recorded or that rank said why itself."""
    first = _first_death(job)
    if first is None or rank_error.startswith(f"rank {first.rank}:"):
        return ""
    if rank_error and not rankends.by_signal(first.code):
        # A rank that exited with a code of its own had its say: ranks that meet the same bad input exit in any
        # order, and whichever wrote the rank error first speaks for them.
        return ""
    lead = first.words()
    return f"{lead}, first; then {rank_error}" if rank_error else lead


def newest_checkpoint(run_dir: str) -> Optional[int]:
    """The newest complete checkpoint's step of the run (None: none, or the run's spec unreadable)."""
    try:
        steps = ckptdir.complete_steps(Path(lost_checkpoints.checkpoint_dir_of(run_dir)))
    except Exception:
        return None
    return steps[-1] if steps else None


def earlier_runs(run_dir: str, job_id: str) -> int:
    """How many jobs ran in this run dir before `job_id` (each `meshrun resume` is a new local job)."""
    jobs = Path(local_state_path(run_dir, job_id)).parent
    return sum(1 for path in jobs.glob("*.json") if path.stem != job_id)


def start_sidecar(run_dir: str, gpus_per_node: int) -> Optional[subprocess.Popen[bytes]]:
    """The job's sidecar (meshrun.launcher.sidecar: metrics, the env record), in this process group so nothing
    outlives the job; it sees the GPUs submitit gives the ranks. It never fails the job: None if it cannot start."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(gpus_per_node)))
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "meshrun.launcher.sidecar", run_dir], env=env, stdin=subprocess.DEVNULL
        )
    except OSError as exc:
        print(f"[meshrun] no sidecar: {exc}", flush=True)
        return None


def stop_sidecar(proc: Optional[subprocess.Popen[bytes]], timeout_s: float = SIDECAR_STOP_S) -> None:
    """SIGUSR2 once the ranks are done, as the Slurm batch script sends it (it first copies checkpoints staged
    on scratch, within sidecar.final_copy_s; a TERM would mean "the job is ending", and a sidecar that never
    saw the ranks run would wait for them); SIGKILL if it has not stopped after `timeout_s`."""
    if proc is None:
        return
    if proc.poll() is not None:
        _stop_keeperless_sidecar(timeout_s)
        return
    try:
        proc.send_signal(signal.SIGUSR2)  # its keeper passes it on
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=SIDECAR_STOP_S)
    except (OSError, subprocess.TimeoutExpired):
        pass  # the process group's SIGKILL that follows ends it


def _stop_keeperless_sidecar(timeout_s: float) -> None:
    """Its keeper was killed, but the sidecar itself may live on (it carries on alone while the ranks run):
    it too gets its USR2 and its time for the last copies, before the group's SIGKILL ends everything."""
    sidecars = [pid for pid in _group_members() if "meshrun.launcher.sidecar" in (procs.command_line(pid) or [])]
    _signal_found(iter(sidecars), signal.SIGUSR2)  # members of this process group, found just now
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid in sidecars for pid in _group_members()):
        time.sleep(0.2)


def _read_code(path: str) -> Optional[int]:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def _first_line(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace").strip().splitlines()[0][:500]
    except (OSError, IndexError):
        return ""


def _first_sentence(path: str) -> str:
    """The verdict's first sentence (where and when the hang was found); `meshrun status JOB` shows all."""
    text = _first_line(path)
    head, dot, _ = text.partition(". ")
    return (head + dot).strip() or "a hang (see `meshrun status JOB`)"


def _job_exit_code(codes: Optional[list[int]], final: str) -> int:
    if final == "COMPLETED":
        return 0
    if codes and EXIT_INPUT in codes:
        return EXIT_INPUT
    return max(codes) if codes and max(codes) else EXIT_FAILED


_EARLY_STOP = [False]
"""A TERM or INT that came before the Supervisor's own handlers were in place (a cancel in the job's first
moments): remembered, not fatal, so the job still ends CANCELLED through the supervisor."""


def _stop_early(_signum: int, _frame: Any) -> None:
    _EARLY_STOP[0] = True


def main(argv: Optional[list[str]] = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_early)
    argv = sys.argv[1:] if argv is None else argv
    job_id = os.environ.get(JOB_ID_ENV, "")
    if len(argv) != 1 or not job_id:
        print(f"usage: {JOB_ID_ENV}=ID python -m meshrun.launcher.local.supervisor RUN_DIR", file=sys.stderr)
        return EXIT_INPUT
    run_dir = Path(argv[0])
    private_umask()  # the ranks (submitit's workers) and the sidecar inherit it: DCP's shards, TensorBoard's files
    try:
        return Supervisor(run_dir, job_id).run()
    except Exception as exc:
        remove_dir(secrets_dir_for(str(run_dir)))
        merge_state(
            local_state_path(str(run_dir), job_id), state="FAILED", ended=time.time(), message=f"supervisor: {exc}"
        )
        raise


if __name__ == "__main__":
    sys.exit(main())
