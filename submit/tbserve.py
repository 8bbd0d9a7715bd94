"""TensorBoard for one run, on the login node (a standalone script: stdlib + tensorboard only).

`meshrun tb` copies this file to RUN_DIR/tensorboard/ and runs it there, in the
cluster's environment (the profile's setup lines):

    python tbserve.py start RUN_DIR   # reuse a live server or start one; prints {"port", "pid", "reused"}
    python tbserve.py serve RUN_DIR PORT   # (what start spawns) the server itself

The server binds 127.0.0.1 only (it is reached through an SSH tunnel) and turns
the run's metrics.jsonl into TensorBoard scalars as the job writes it, so it
needs nothing from the ranks but that file. It stops on SIGTERM, or by itself
after MAX_HOURS so that a forgotten one does not live forever.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

SERVER_FILE = "server.json"
EVENTS_SUFFIX = ".meshrun"
MAX_HOURS = 24.0
START_TIMEOUT_S = 90.0


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"tbserve" in handle.read()
    except OSError:
        return False


def _recorded(tb_dir: Path) -> Optional[dict[str, Any]]:
    try:
        server = json.loads((tb_dir / SERVER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return server if _alive(int(server["pid"])) and _answers(int(server["port"])) else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(run_dir: Path) -> dict[str, Any]:
    tb_dir = run_dir / "tensorboard"
    tb_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = _recorded(tb_dir)
    if server is not None:
        return {**server, "reused": True}
    port = _free_port()
    with open(tb_dir / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", str(run_dir), str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # outlives this SSH session
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"tensorboard did not start; see {tb_dir / 'server.log'}")
        time.sleep(0.2)
    return {"port": port, "pid": proc.pid, "reused": False}


class Bridge:
    """metrics.jsonl -> TensorBoard scalar events, incrementally (complete lines only)."""

    def __init__(self, run_dir: Path, tb_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        for old in glob.glob(str(tb_dir / f"events.out.tfevents.*{EVENTS_SUFFIX}")):
            os.unlink(old)  # rebuilt from the start: a restarted server must not show points twice
        self.metrics, self.offset = run_dir / "metrics.jsonl", 0
        self.writer = EventFileWriter(str(tb_dir), flush_secs=1, filename_suffix=EVENTS_SUFFIX)

    def poll(self) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        try:
            with open(self.metrics, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            values = [
                summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                for k, v in row.items()
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            self.writer.add_event(
                event_pb2.Event(
                    wall_time=float(row.get("time") or time.time()),
                    step=step,
                    summary=summary_pb2.Summary(value=values),
                )
            )
        if complete:
            self.writer.flush()


def serve(run_dir: Path, port: int) -> None:
    from tensorboard import program

    tb_dir = run_dir / "tensorboard"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    bridge = Bridge(run_dir, tb_dir)
    bridge.poll()
    board = program.TensorBoard()
    board.configure(
        argv=[
            "tensorboard",
            "--logdir",
            str(tb_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--reload_interval",
            "2",
            "--load_fast",
            "false",
        ]
    )
    board.launch()  # serves from a background thread
    (tb_dir / SERVER_FILE).write_text(json.dumps({"port": port, "pid": os.getpid()}))
    stop_at = time.monotonic() + MAX_HOURS * 3600
    while time.monotonic() < stop_at:
        bridge.poll()
        time.sleep(1.0)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "start":
        print(json.dumps(start(Path(argv[1]))), flush=True)
        return 0
    if len(argv) == 3 and argv[0] == "serve":
        serve(Path(argv[1]), int(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
