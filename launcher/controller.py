"""The `local` cluster's rank controller: submitit's, recording how each rank ended. Torch-free.

submitit's local Controller is the ranks' parent, so only it can learn that a rank was killed by a
signal (SIGKILL leaves no result file and no last word); it keeps the exit codes to itself. When one rank
is killed, its peers fail a moment later with a collective's "connection closed by peer", and their
error was all the supervisor could show. This controller is submitit's, with one addition: each rank's
end (exit code, or the signal that killed it, and when) is appended to a file as the controller sees it,
so the supervisor names the first rank that died, and how (what srun prints for a Slurm job).
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

ENDS_SUFFIX = "_rank_ends.jsonl"
"""`<submitit folder>/<controller pid>_rank_ends.jsonl`: one {"rank", "code", "time"} line per rank end."""


def ends_path(folder: str | Path, controller_pid: int | str) -> Path:
    return Path(folder) / f"{controller_pid}{ENDS_SUFFIX}"


class RecordingController(submitit_local.Controller):  # type: ignore[misc]
    """submitit's Controller, appending each rank's end as its poll first sees it."""

    def start_tasks(self) -> None:
        super().start_tasks()
        self._ended: set[int] = set()

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


def how(code: int) -> str:
    """A rank's end in words: 'was killed by SIGKILL ...' or 'exited with code 1'. A command job's rank
    reports its program's death by signal N as 128 + N, as a shell does."""
    if code < 0:
        return f"was killed by {_signal_words(-code)}"
    if 128 < code < 128 + 65:
        return f"exited with code {code} (its program was killed by {_signal_words(code - 128)})"
    return f"exited with code {code}"


def _signal_words(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    if number == signal.SIGKILL:
        return f"{name} (kill -9, or the kernel's out-of-memory killer: see `dmesg`)"
    return name


def first_death(
    ends: Sequence[dict[str, Any]], clean: Sequence[int], returned: Mapping[int, tuple[float, int]]
) -> Optional[dict[str, Any]]:
    """The first rank to end other than cleanly, as {"rank", "code", "time"}. A rank whose function returned
    (`returned`: when its result was written, and the code) gave its own account, which a signal reaching its
    process while it exits (the stop of its peers) does not change; any other rank's end is its process's."""
    merged = {int(end["rank"]): (float(end.get("time", 0)), int(end["code"])) for end in ends}
    merged.update(returned)
    bad = sorted((when, rank, code) for rank, (when, code) in merged.items() if code not in clean)
    if not bad:
        return None
    when, rank, code = bad[0]
    return {"rank": rank, "code": code, "time": when}


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
    return subprocess.Popen([sys.executable, "-m", "launcher.controller", str(folder)], env=env)


class RecordingExecutor(submitit_local.LocalExecutor):  # type: ignore[misc]
    """submitit's LocalExecutor, its jobs run by RecordingController."""

    def _submit_command(self, command: str) -> submitit_local.LocalJob[Any]:
        process = start(self.folder, command, self.parameters)
        tasks = list(range(self.parameters.get("tasks_per_node", 1)))
        return submitit_local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=tasks)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launcher.controller SUBMITIT_FOLDER")
    RecordingController(Path(sys.argv[1])).run()
