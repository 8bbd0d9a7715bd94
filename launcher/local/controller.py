"""The `local` cluster's rank controller: submitit's, recording how each rank ended. Torch-free.

submitit's local Controller is the ranks' parent, so only it can learn that a rank was killed by a
signal (SIGKILL leaves no result file and no last word); it keeps the exit codes to itself. When one rank
is killed, its peers fail a moment later with a collective's "connection closed by peer", and their
error was all the supervisor could show. This controller is submitit's, with one addition: each rank's
end (exit code, or the signal that killed it, and when) is appended to a file as the controller sees it,
so the supervisor names the first rank that died, and how (what srun prints for a Slurm job).

It also starts the ranks faster. submitit starts each rank as a new interpreter, which for the built-in
trainer spent about 4 s of CPU importing torch and the trainer before its first step (on a laptop's few cores,
most of a small job's start). Given PRELOAD_ENV (the supervisor sets it for trainer jobs), this controller
imports those modules once and forks each rank from itself: a real process with its own pid, environment and
signals, running submitit's worker exactly as `python -u -m submitit.core._submit FOLDER` would. Nothing has
touched a GPU before the fork (importing torch does not).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from submitit.local import local as submitit_local

from meshrun.launcher.batch.rankends import RankEnd

ENDS_SUFFIX = "_rank_ends.jsonl"
"""`<submitit folder>/<controller pid>_rank_ends.jsonl`: one {"rank", "code", "time"} line per rank end."""


def ends_path(folder: str | Path, controller_pid: int | str) -> Path:
    return Path(folder) / f"{controller_pid}{ENDS_SUFFIX}"


PRELOAD_ENV = "MESHRUN_RANK_PRELOAD"
"""Comma-separated modules the controller imports once and forks the ranks from (unset: one interpreter each)."""
TRAINER_PRELOAD = (
    "torch",
    "torch.distributed",
    "meshrun.launcher.rank.entry",
    "meshrun.launcher.train.loop",
    "meshrun.launcher.checkpoint.manager",
    "torch._dynamo",
)
"""What every built-in trainer rank imports first. torch._dynamo is among them though meshrun never compiles:
FSDP2's first `fully_shard` (through torch's lazy `_disable_dynamo`) imports it, ~0.4 s of CPU in each rank."""


class ForkedTask:
    """A rank forked by the controller: the parts of subprocess.Popen that submitit's Controller uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it has ended, how is lost
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen says
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class RecordingController(submitit_local.Controller):  # type: ignore[misc]
    """submitit's Controller, appending each rank's end as its poll first sees it (and forking the ranks
    from preloaded modules when told to)."""

    def start_tasks(self) -> None:
        preload = [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]
        if preload and _preloaded(preload):
            self._fork_tasks()
        else:
            super().start_tasks()
        self._ended: set[int] = set()

    def _fork_tasks(self) -> None:
        from submitit.core import utils

        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        for k in range(self.ntasks):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_worker(self.folder, k, self.pid, self.stdouts[k].fileno(), self.stderrs[k].fileno())
            self.tasks.append(ForkedTask(pid))

    def wait(self, freq: int = 24) -> Sequence[Optional[int]]:
        """submitit's loop (all tasks end, or the time-out signal is sent), recording ends as they come."""
        timeout = freq * self.timeout_s
        almost_timeout = freq * (self.timeout_s - self.signal_delay_s)
        for step in range(timeout):
            codes = [task.poll() for task in self.tasks]
            self._record(codes)
            if all(code is not None for code in codes):
                return codes
            if step == almost_timeout:
                self._forward_signal(submitit_local.LocalJobEnvironment._usr_sig())
            time.sleep(1.0 / freq)
        return [task.poll() for task in self.tasks]

    def _record(self, codes: Sequence[Optional[int]]) -> None:
        new = [(rank, code) for rank, code in enumerate(codes) if code is not None and rank not in self._ended]
        if not new:
            return
        now = time.time()
        with open(ends_path(self.folder, self.pid), "a") as out:
            for rank, code in new:
                self._ended.add(rank)
                out.write(json.dumps({"rank": rank, "code": code, "time": now}) + "\n")


def _preloaded(modules: Sequence[str]) -> bool:
    """Imports `modules`; True when forking from this process is safe. A CUDA context does not survive a fork
    (a child that touches it fails), so once anything imported has created one, each rank gets its own
    interpreter instead."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def _become_worker(folder: Path, task: int, job_id: str, out: int, err: int) -> None:
    """In the fork: submitit's worker for `task`, as `python -u -m submitit.core._submit FOLDER` runs it
    (with the variables submitit's Controller gives it); never returns."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # the controller's own handlers are not the rank's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(out, 1)
        os.dup2(err, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]  # python -u
        sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
        os.environ.update(
            SUBMITIT_LOCAL_LOCALID=str(task), SUBMITIT_LOCAL_GLOBALID=str(task), SUBMITIT_LOCAL_JOB_ID=job_id
        )
        sys.argv = ["submitit.core._submit", str(folder)]
        from submitit.core.submission import submitit_main

        submitit_main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:  # the interpreter's way out: non-daemon threads joined, atexit run, buffers flushed
            import threading

            threading._shutdown()  # type: ignore[attr-defined]
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def read_ends(folder: str | Path, controller_pid: int | str) -> list[dict[str, Any]]:
    """The ranks' recorded ends, first first (a torn last line, from a controller killed mid-write, is skipped)."""
    try:
        lines = ends_path(folder, controller_pid).read_text().splitlines()
    except OSError:
        return []
    ends = []
    for line in lines:
        try:
            end = json.loads(line)
        except ValueError:
            continue
        if isinstance(end, dict) and isinstance(end.get("rank"), int) and isinstance(end.get("code"), int):
            ends.append(end)
    return sorted(ends, key=lambda end: float(end.get("time", 0)))


def rank_ends(ends: Sequence[dict[str, Any]], returned: Mapping[int, tuple[float, int]]) -> list[RankEnd]:
    """Each rank's end: a rank whose function returned (`returned`: when its result was written, and the code)
    gave its own account, which a signal reaching its process while it exits (the stop of its peers) does not
    change; any other rank's end is its process's, as recorded (`read_ends`)."""
    merged = {int(end["rank"]): (float(end.get("time", 0)), int(end["code"])) for end in ends}
    merged.update(returned)
    return [RankEnd(rank, code, when) for rank, (when, code) in sorted(merged.items())]


def start(folder: Path, command: str, parameters: dict[str, Any]) -> subprocess.Popen[bytes]:
    """This controller for `folder`'s job, with the environment submitit's start_controller gives its own
    (no setup lines: the supervisor's ranks run in its environment)."""
    env = dict(os.environ)
    env.update(
        SUBMITIT_LOCAL_NTASKS=str(parameters.get("tasks_per_node", 1)),
        SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * parameters.get("timeout_min", 2.0))),
        SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(parameters.get("signal_delay_s", 30))),
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if parameters.get("stderr_to_stdout", False) else "",
        SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=",".join(str(k) for k in range(parameters.get("gpus_per_node", 0))),
        SUBMITIT_LOCAL_WITH_SHELL="",
    )
    return subprocess.Popen([sys.executable, "-m", "meshrun.launcher.local.controller", str(folder)], env=env)


class RecordingExecutor(submitit_local.LocalExecutor):  # type: ignore[misc]
    """submitit's LocalExecutor, its jobs run by RecordingController."""

    def _submit_command(self, command: str) -> submitit_local.LocalJob[Any]:
        process = start(self.folder, command, self.parameters)
        tasks = list(range(self.parameters.get("tasks_per_node", 1)))
        return submitit_local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=tasks)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m meshrun.launcher.local.controller SUBMITIT_FOLDER")
    RecordingController(Path(sys.argv[1])).run()
