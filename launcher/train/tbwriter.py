"""TensorBoard scalars written by the job itself, with tensorboard's own event writer. Torch-free.

Rank 0 (the built-in trainer, or report() in a user's script) writes RUN_DIR/tensorboard/, so
`tensorboard --logdir WORK_DIR` shows every run and `meshrun tb` serves the files as they are.
Each process opens a new event file there; the first event of each one is a session START at the
first step it will write, so TensorBoard drops the points an earlier attempt logged past the
checkpoint it resumed from (no doubled curve after a requeue).

The events are tensorboard's own protocol buffers (`tensorboard.compat.proto`), framed as its EventFileWriter
frames them (`EventFile` below), without importing that writer: its package imports tensorboard's summary
APIs and numpy first, ~260 ms of CPU in every process that writes (measured: 80% of a sidecar's start).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import sys
import time
from typing import Any, Mapping, Optional

_FILE_NUMBER = itertools.count()
"""Told apart the event files one process opens in the same second (as EventFileWriter's counter does)."""


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
            from tensorboard.compat.proto import event_pb2  # noqa: F401  (the events' format)
        except ImportError as exc:
            print(
                f"[meshrun] no TensorBoard event files: {sys.executable} cannot import tensorboard ({exc})",
                file=sys.stderr,
            )
            return
        self._writer = EventFile(logdir)

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


class EventFile:
    """A new TensorBoard event file in `logdir`, named and framed as tensorboard's EventFileWriter writes one: a
    TFRecord per event (its length, the length's masked CRC-32C, the serialized Event, its masked CRC-32C), the
    first event naming the format. Each event reaches the file in one unbuffered write, as it is added: a reader
    never sees half a record, and nothing waits in a buffer for a flush."""

    def __init__(self, logdir: str) -> None:
        from tensorboard.compat.proto import event_pb2

        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBER)}"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "wb", buffering=0)
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add_event(self, event: Any) -> None:
        self._file.write(tf_record(event.SerializeToString()))

    def flush(self) -> None:
        """Nothing is buffered (the EventFileWriter's method, kept for its callers)."""

    def close(self) -> None:
        self._file.close()


def tf_record(data: bytes) -> bytes:
    """`data` framed as one TFRecord (what TensorBoard's reader checks, CRCs included)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli's polynomial, reflected
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`: the checksum TFRecords use (zlib's crc32 is another polynomial)."""
    crc = 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC as TFRecords store it: rotated right by 15 bits and offset (a CRC of CRC-bearing data stays sound)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
