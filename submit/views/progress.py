"""An upload progress bar on stderr: redrawn in place on a terminal, one summary line when piped."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


class ProgressBar:
    """Call it as a transport Progress: bar(sent, total); then done()."""

    def __init__(self, label: str, out: Optional[TextIO] = None, width: int = 30) -> None:
        # sys.stderr looked up now, not at import: it may have been replaced since (tests, wrappers).
        out = out if out is not None else sys.stderr
        self.label, self.out, self.width = label, out, width
        self.tty = out.isatty()
        self.started: float = 0.0  # set by the first call: the bytes' clock, not the connection's
        self.sent = self.total = 0
        self._drawn = -1.0

    def __call__(self, sent: int, total: int) -> None:
        self.sent, self.total = sent, total
        self.started = self.started or time.monotonic()
        if not self.tty:
            return
        now = time.monotonic()
        if sent < total and now - self._drawn < 0.1:  # redraw at most 10 times a second
            return
        self._drawn = now
        filled = int(self.width * sent / total) if total else self.width
        self.out.write(f"\r\x1b[2K{self.label} [{'#' * filled}{' ' * (self.width - filled)}] {_mb(sent)}/{_mb(total)}")
        self.out.flush()

    def done(self) -> None:
        seconds = time.monotonic() - (self.started or time.monotonic())
        line = f"{self.label}: {_mb(self.total)} in {seconds:.1f} s"
        self.out.write(("\r\x1b[2K" if self.tty else "") + line + "\n")
        self.out.flush()
