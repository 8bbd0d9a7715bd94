"""Scalars to one TensorBoard event file with tensorboard's own writer (no torch, no TensorFlow).

A no-op when tensorboard is not importable: the sidecar's log says so once, gpu.jsonl still has it all.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Optional


class Scalars:
    def __init__(self, logdir: str) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # ImportError: the caller logs it

        self.writer: Any = EventFileWriter(logdir, flush_secs=30)

    def add(self, step: int, scalars: Mapping[str, Any], wall_time: Optional[float] = None) -> None:
        """Finite numbers only (booleans, text and None are not plotted)."""
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            for tag, value in scalars.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ]
        if values:
            event = event_pb2.Event(
                wall_time=time.time() if wall_time is None else wall_time,
                step=step,
                summary=summary_pb2.Summary(value=values),
            )
            self.writer.add_event(event)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
