"""TensorBoard scalars written by the job itself, with tensorboard's own event writer. Torch-free.

Rank 0 (the built-in trainer, or report() in a user's script) writes RUN_DIR/tensorboard/, so
`tensorboard --logdir WORK_DIR` shows every run and `meshrun tb` serves the files as they are.
Each process opens a new event file there; the first event of each one is a session START at the
first step it will write, so TensorBoard drops the points an earlier attempt logged past the
checkpoint it resumed from (no doubled curve after a requeue).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, Optional

FLUSH_SECS = 5
"""Events reach the file at least this often (and at every flush/close)."""


def scalars_of(record: Mapping[str, Any], skip: tuple[str, ...] = ("step", "time")) -> dict[str, float]:
    """The finite numbers of a metrics record (what TensorBoard can plot), booleans and text left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in skip or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class ScalarWriter:
    """Scalars to one TensorBoard log dir; a no-op (with one line on stderr) without tensorboard installed."""

    def __init__(self, logdir: str, first_step: Optional[int] = None, session_start: bool = True) -> None:
        self._writer: Any = None
        self._first_step = first_step
        """Where this attempt starts (its resume step); None: at the first step written."""
        self._started = not session_start  # a sample counter (the sidecar) purges nothing
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            print(
                f"[meshrun] no TensorBoard event files: {sys.executable} cannot import tensorboard ({exc})",
                file=sys.stderr,
            )
            return
        self._writer = EventFileWriter(logdir, flush_secs=FLUSH_SECS)

    def starts_at(self, step: int) -> None:
        """This attempt's first step (set before the first add): where the session START goes."""
        self._first_step = step

    def add(self, step: int, scalars: Mapping[str, float], wall_time: Optional[float] = None) -> None:
        if self._writer is None:
            return
        from tensorboard.compat.proto import event_pb2, summary_pb2

        now = time.time() if wall_time is None else wall_time
        if not self._started:  # once per file: TensorBoard purges older points from this step on
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            first = step if self._first_step is None else min(step, self._first_step)
            self._writer.add_event(event_pb2.Event(wall_time=now, step=first, session_log=start))
            self._started = True
        values = [summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        if not values:
            return
        self._writer.add_event(event_pb2.Event(wall_time=now, step=step, summary=summary_pb2.Summary(value=values)))

    @property
    def enabled(self) -> bool:
        """False without tensorboard installed (then every call is a no-op)."""
        return self._writer is not None

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
