"""The page's Python interpreter, seen from the session: one tests/docs/pydriver.py process per page."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional


@dataclass(frozen=True)
class Outcome:
    exit: Optional[int]
    """0, a SystemExit's code, 1 for an exception; None when the block ran past its time."""
    error: str
    """The traceback (or SystemExit) when it failed."""
    printed: str
    """What the block (and every process it started) printed."""


class Interpreter:
    """Started on the first python block, in the session's folder and environment at that moment."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path) -> None:
        read, write = os.pipe()
        self.log = log
        with log.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("pydriver.py")), str(write)],
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                pass_fds=(write,),
                start_new_session=True,  # stopped with everything it started
            )
        os.close(write)
        self.reply: IO[str] = os.fdopen(read)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, code: str, filename: str, timeout: float) -> Outcome:
        start = self.log.stat().st_size
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"code": code, "filename": filename}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.reply], [], [], timeout)
        answer = self.reply.readline() if ready else ""
        with self.log.open() as log:
            log.seek(start)
            printed = log.read()
        if not ready:
            self.stop(wait=0)
            return Outcome(None, "", printed)
        if not answer:
            return Outcome(1, f"the page's python interpreter died (exit {self.proc.wait()})", printed)
        result = json.loads(answer)
        return Outcome(result["exit"], result["error"], printed)

    def stop(self, wait: float = 10) -> None:
        """End of input, `wait` seconds to finish, then killed with whatever it started."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.reply.close()
