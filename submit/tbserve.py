"""TensorBoard for one or more runs, on the login node (a standalone script: stdlib + tensorboard only).

`meshrun tb` copies this file to ~/.cache/meshrun/tb/ on the login node and runs it there, in
the cluster's environment (the profile's setup lines):

    python tbserve.py start LABEL RUN_DIR [LABEL RUN_DIR ...]   # reuse a live server of these runs or start
                                                              # one; prints {"port", "pid", "reused", "dir"}
    python tbserve.py serve STATE_DIR PORT                     # (what start spawns) the server itself

Each set of runs gets a state dir (~/.cache/meshrun/tb/KEY, KEY from the labels and run dirs)
holding server.json, server.log and runs/LABEL: a link to the run's own event files
(RUN_DIR/tensorboard/, written by the job), or, for an old run that wrote none, a folder the
server fills from its metrics.jsonl as the job writes it. TensorBoard reads runs/, so each run
is named by its label (a job id, a sweep task's id). The state lives outside the work dir, so
`tensorboard --logdir WORK_DIR` never shows a run twice. The server binds 127.0.0.1 only (it is
reached through an SSH tunnel), stops on SIGTERM, or by itself after MAX_HOURS.
"""

from __future__ import annotations

import glob
import hashlib
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
RUNS = "runs"
CONVERTED = "converted.json"
"""Which labels the server converts from metrics.jsonl (the rest link to the job's own event files)."""
EVENTS = "events.out.tfevents.*"
EVENTS_SUFFIX = ".meshrun"
"""The converter's event files (older meshrun wrote them into RUN_DIR/tensorboard/ too)."""
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


def _recorded(state: Path) -> Optional[dict[str, Any]]:
    try:
        server = json.loads((state / SERVER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return server if _alive(int(server["pid"])) and _answers(int(server["port"])) else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def writes_events(run_dir: Path) -> bool:
    """The job writes its own event files (meshrun's trainer and report() do), or has not logged yet."""
    own = [p for p in glob.glob(str(run_dir / "tensorboard" / EVENTS)) if not p.endswith(EVENTS_SUFFIX)]
    return bool(own) or not (run_dir / "metrics.jsonl").exists()


def state_dir(runs: list[tuple[str, Path]]) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshrun" / "tb"
    key = hashlib.sha256(json.dumps([[label, str(path)] for label, path in runs]).encode()).hexdigest()[:16]
    return base / key


def prepare(state: Path, runs: list[tuple[str, Path]]) -> list[str]:
    """runs/LABEL for each run (a link to its event files, or a folder to convert into); the converted labels."""
    tree = state / RUNS
    tree.mkdir(mode=0o700, parents=True, exist_ok=True)
    converted = []
    for label, run_dir in runs:
        entry = tree / label
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        elif entry.is_dir():
            for old in entry.glob(EVENTS):
                old.unlink()  # rebuilt from the start: a restarted server must not show points twice
        if writes_events(run_dir):
            if entry.is_dir():
                entry.rmdir()
            entry.symlink_to(run_dir / "tensorboard", target_is_directory=True)
        else:
            entry.mkdir(mode=0o700, exist_ok=True)
            converted.append(label)
    (state / CONVERTED).write_text(json.dumps({label: str(path) for label, path in runs if label in converted}))
    return converted


def start(runs: list[tuple[str, Path]]) -> dict[str, Any]:
    state = state_dir(runs)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = _recorded(state)
    if server is not None:
        return {**server, "reused": True, "dir": str(state)}
    prepare(state, runs)
    port = _free_port()
    with open(state / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", str(state), str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # outlives this SSH session
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"tensorboard did not start; see {state / 'server.log'}")
        time.sleep(0.2)
    return {"port": port, "pid": proc.pid, "reused": False, "dir": str(state)}


class Bridge:
    """An old run's metrics.jsonl -> TensorBoard scalar events, incrementally (complete lines only)."""

    def __init__(self, metrics: Path, out_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.metrics, self.offset = metrics, 0
        self.writer = EventFileWriter(str(out_dir), flush_secs=1, filename_suffix=EVENTS_SUFFIX)

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


def serve(state: Path, port: int) -> None:
    from tensorboard import program

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    converted = json.loads((state / CONVERTED).read_text())
    bridges = [Bridge(Path(run_dir) / "metrics.jsonl", state / RUNS / label) for label, run_dir in converted.items()]
    for bridge in bridges:
        bridge.poll()
    board = program.TensorBoard()
    board.configure(
        argv=[
            "tensorboard",
            "--logdir",
            str(state / RUNS),
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
    (state / SERVER_FILE).write_text(json.dumps({"port": port, "pid": os.getpid()}))
    stop_at = time.monotonic() + MAX_HOURS * 3600
    while time.monotonic() < stop_at:
        for bridge in bridges:
            bridge.poll()
        time.sleep(1.0)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "start" and len(argv) % 2 == 1:
        runs = [(argv[i], Path(argv[i + 1])) for i in range(1, len(argv), 2)]
        print(json.dumps(start(runs)), flush=True)
        return 0
    if len(argv) == 3 and argv[0] == "serve":
        serve(Path(argv[1]), int(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
