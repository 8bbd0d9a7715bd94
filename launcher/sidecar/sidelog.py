"""The sidecar's log: one timestamped line per call, appended to RUN_DIR/logs/sidecar-NODE.log.

Its own module so that the keeper (keeper.py), which writes to the same log, needs nothing of the sidecar's
loop and tasks to start: a keeper is one small process per node and per attempt, and the less it imports the
less there is in it to fail (it imported the whole sidecar before: ~45 ms of CPU more per keeper).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from meshrun.launcher.contract.private import make_private_dir


class Log:
    """One timestamped line per call, appended to the sidecar's log (stderr when that cannot be opened)."""

    def __init__(self, path: str, node: str) -> None:
        self.node = node
        self.stream: TextIO
        try:
            make_private_dir(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self.stream = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
        except OSError as exc:
            self.stream = sys.stderr
            self(f"cannot open {path} ({exc}): logging to stderr")

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            self.stream.write(f"{stamp} [sidecar {self.node}] {message}\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a full disk must not end the sidecar, let alone the job
